"""The kernels' scalar parameters: positions in the int64 and real arrays that every
backend's kernels take (the Numba kernels index them with :class:`Int` and :class:`Real`;
the CUDA sources get the same positions as ``#define``s, see :mod:`npattn.gpu.sources`),
so the two backends cannot drift apart."""
from __future__ import annotations

from enum import IntEnum

import numpy as np

from .dropout import seed_words
from .options import OPTIONS


class Int(IntEnum):
    """Positions in the kernels' int64 parameter array (flat arrays of scalars compile
    several times faster in Numba than a named tuple of them)."""

    BATCH = 0
    HEADS = 1
    KV_HEADS = 2
    Q_LEN = 3
    KV_LEN = 4
    HEAD_DIM = 5
    VALUE_DIM = 6
    Q_STRIDE_B = 7    # element strides of the bhsd views; the last axis is unit
    Q_STRIDE_H = 8
    Q_STRIDE_S = 9
    K_STRIDE_B = 10
    K_STRIDE_H = 11
    K_STRIDE_S = 12
    V_STRIDE_B = 13
    V_STRIDE_H = 14
    V_STRIDE_S = 15
    BIAS_STRIDE_B = 16  # 0 along broadcast axes
    BIAS_STRIDE_H = 17
    BIAS_STRIDE_Q = 18
    BIAS_STRIDE_K = 19
    MASK_STRIDE_B = 20
    MASK_STRIDE_H = 21
    MASK_STRIDE_Q = 22
    MASK_STRIDE_K = 23
    HAS_BIAS = 24
    HAS_MASK = 25
    HAS_ALIBI = 26
    HAS_SINK = 27
    HAS_SOFTCAP = 28
    HAS_DROPOUT = 29
    CAUSAL = 30
    WINDOW_LEFT = 31    # -1 = unbounded
    WINDOW_RIGHT = 32
    SINKS = 33
    DROPOUT_THRESHOLD = 34
    SEED_LO = 35
    SEED_HI = 36
    BLOCK_Q = 37
    BLOCK_K = 38
    SCORE_LD = 39        # row stride of score tiles: BLOCK_K, or it rounded up to whole vectors
    VECTOR_SCORES = 40   # scores through :mod:`npattn.cpu.microkernels` (else BLAS)
    VECTOR_VALUES = 41   # P V and dV through them too (needs Dv a whole number of vectors)
    VECTOR_KEYS = 42     # dQ and dK through them too (needs D a whole number of vectors)
    EDGE_BAND = 43       # rows per band of a tile the causal/window edge cuts (tiles.band_keys)
    KEY_SPLITS = 44      # CPU forward: key ranges per query tile, merged by lse (cpu.splitting)
    SPLIT_KEYS = 45      # keys per range, a multiple of BLOCK_K
    ROW_GROUP = 46       # CPU: query rows per position (GQA heads folded into rows, cpu.folding)


# The arrays every kernel takes first, in order, with their CUDA types (T: the storage
# type, Acc: the compute type) and what each holds: the CPU's Operands tuple, the GPU
# driver's argument tuple and the CUDA sources' Operands struct and parameter macros
# (written by npattn.gpu.sources.source()) all follow this one list.
OPERANDS = (
    ("q", "const T*", "bhsd rows of queries"),
    ("k", "const T*", "bhsd rows of keys"),
    ("v", "const T*", "bhsd rows of values"),
    ("bias", "const Acc*", "compute dtype, or a 1-element placeholder"),
    ("mask", "const unsigned char*", "bool as bytes, or a placeholder"),
    ("alibi", "const Acc*", "(B * H,) slopes, or a placeholder"),
    ("sink", "const Acc*", "(H,) sink logits, or a placeholder"),
    ("q_lengths", "const i64*", "(B,)"),
    ("kv_lengths", "const i64*", "(B,)"),
    ("ints", "const i64*", "NPATTN_INT_* / Int"),
    ("reals", "const Acc*", "NPATTN_REAL_* / Real"),
)
OPERAND_NAMES = tuple(name for name, _, _ in OPERANDS)


def operand_defines() -> list[str]:
    """The CUDA lines for :data:`OPERANDS`: the Operands struct's fields, the kernels'
    leading parameters and the struct built from them."""
    fields = " ".join(f"{ctype} {name};" for name, ctype, _ in OPERANDS)
    params = ", ".join(f"{ctype} {name}" for name, ctype, _ in OPERANDS)
    return [f"#define NPATTN_OPERAND_FIELDS {fields}",
            f"#define NPATTN_OPERAND_PARAMS {params}",
            f"#define NPATTN_OPERANDS {{{', '.join(OPERAND_NAMES)}}}"]


class Real(IntEnum):
    """Positions in the kernels' parameter array of the compute dtype."""

    SCALE = 0
    SOFTCAP = 1       # 0 = off
    KEEP_SCALE = 2    # 1 / (1 - dropout_p)


def element_strides(array) -> tuple:
    """``array``'s strides in elements, 0 along axes of length 1 (so broadcast views and
    size-1 axes read the same element)."""
    return tuple(0 if n == 1 else s // array.itemsize for n, s in zip(array.shape, array.strides))


def lengths_or_full(xp, lengths, batch: int, full: int):
    """int64 (batch,) contiguous array of module ``xp``: ``lengths``, or ``full`` everywhere
    when None (q_lengths / kv_lengths as the kernels take them)."""
    if lengths is None:
        return xp.full(batch, full, xp.int64)
    return xp.ascontiguousarray(xp.asarray(lengths).astype(xp.int64, copy=False))


def problem_parameters(problem, dtype):
    """``(ints, reals)`` for ``problem``: int64 (len(Int),) and ``dtype`` (len(Real),) arrays
    with the shapes, options, dropout seed and scalars filled in. The strides, tiles and
    product choices are the backend's to fill (zero here)."""
    return np.array(problem_int_values(problem), np.int64), problem_reals(problem, dtype)


def problem_int_values(problem) -> list:
    """:func:`problem_parameters`'s ints as a list, for a backend that fills in its own
    entries before making the array once (a small call's every microsecond counts)."""
    visibility = problem.visibility
    values = [0] * len(Int)
    values[Int.BATCH:Int.VALUE_DIM + 1] = (problem.batch, problem.heads, problem.kv_heads, problem.q_len,
                                           problem.kv_len, problem.head_dim, problem.value_dim)
    for index, option in _FLAGGED_OPTIONS:  # HAS_BIAS, HAS_MASK, ..., CAUSAL: from the options table
        values[index] = int(option.present(problem))
    values[Int.WINDOW_LEFT] = -1 if visibility.window_left is None else visibility.window_left
    values[Int.WINDOW_RIGHT] = -1 if visibility.window_right is None else visibility.window_right
    values[Int.SINKS] = visibility.sinks
    values[Int.DROPOUT_THRESHOLD] = problem.dropout_threshold
    values[Int.SEED_LO], values[Int.SEED_HI] = seed_words(problem.seed)
    return values


def problem_reals(problem, dtype):
    """:func:`problem_parameters`'s reals."""
    values = [0.0] * len(Real)
    values[Real.SCALE] = problem.scale
    values[Real.SOFTCAP] = problem.softcap or 0.0
    values[Real.KEEP_SCALE] = 1.0 / (1.0 - problem.dropout_p)
    return np.array(values, dtype)


_FLAGGED_OPTIONS = tuple((Int[option.flag], option) for option in OPTIONS if option.flag is not None)


def sink_logits_gradient(xp, problem, lse, delta):
    """d loss / d sink_logits (H,) from the forward's lse (B, H, Sq) and delta = rowsum(dO * O)
    (B, H, Sq), arrays of module ``xp``: the sink column's probability is
    exp(sink - lse), and d out / d sink = -P(sink) * out, so the gradient is
    -sum over b and i of P(sink) * delta. Rows with no visible key (lse -inf) give 0."""
    sink = problem.sink_logits.astype(lse.dtype)[None, :, None]
    seen = xp.isfinite(lse)
    sink_probability = xp.exp(xp.where(seen, sink - xp.where(seen, lse, 0.0), -xp.inf))
    return -(sink_probability * delta).sum(axis=(0, 2))
