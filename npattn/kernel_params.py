"""The kernels' scalar parameters: positions in the int64 and real arrays that every
backend's kernels take (the Numba kernels index them with :class:`Int` and :class:`Real`;
the CUDA sources get the same positions as ``#define``s, see :mod:`npattn.gpu.sources`),
so the two backends cannot drift apart."""
from __future__ import annotations

from enum import IntEnum

import numpy as np

from .dropout import seed_words
from .options import OPTIONS


def _positions(name: str, names) -> type[IntEnum]:
    """An IntEnum numbering ``names`` 0, 1, ... (an enum's member is a compile-time
    constant to Numba, and each becomes a ``#define`` of the CUDA sources)."""
    return IntEnum(name, [(member, position) for position, member in enumerate(names)])  # type: ignore[return-value]


# Positions in the kernels' int64 parameter array (flat arrays of scalars compile several
# times faster in Numba than a named tuple of them): the shapes and strides, a HAS_* flag
# (or CAUSAL) per option of the table that names one, the visibility and dropout scalars,
# then what the backend's tuning fills in.
Int = _positions("Int", (
    "BATCH", "HEADS", "KV_HEADS", "Q_LEN", "KV_LEN", "HEAD_DIM", "VALUE_DIM",
    # element strides of the bhsd views (the last axis is unit); 0 along broadcast axes
    "Q_STRIDE_B", "Q_STRIDE_H", "Q_STRIDE_S", "K_STRIDE_B", "K_STRIDE_H", "K_STRIDE_S",
    "V_STRIDE_B", "V_STRIDE_H", "V_STRIDE_S", "BIAS_STRIDE_B", "BIAS_STRIDE_H", "BIAS_STRIDE_Q",
    "BIAS_STRIDE_K", "MASK_STRIDE_B", "MASK_STRIDE_H", "MASK_STRIDE_Q", "MASK_STRIDE_K",
    *(option.flag for option in OPTIONS if option.flag is not None),
    "SAVES_SCORES",  # some option present keeps a value per score (Option.saves_score)
    "WINDOW_LEFT", "WINDOW_RIGHT",  # -1 = unbounded
    "SINKS", "POSITION_SHIFT",  # query row i sits at key position i + POSITION_SHIFT
    "DROPOUT_THRESHOLD", "SEED_LO", "SEED_HI",
    # added to (b, h, i, j) before the dropout hash takes them (the dropout_offset option)
    "DROPOUT_OFFSET_B", "DROPOUT_OFFSET_H", "DROPOUT_OFFSET_I", "DROPOUT_OFFSET_J",
    "BLOCK_Q", "BLOCK_K",
    "SCORE_LD",       # row stride of score tiles: BLOCK_K, or it rounded up to whole vectors
    "VECTOR_SCORES",  # scores through :mod:`npattn.cpu.microkernels` (else BLAS)
    "VECTOR_VALUES",  # P V and dV through them too (needs Dv a whole number of vectors)
    "VECTOR_KEYS",    # dQ and dK through them too (needs D a whole number of vectors)
    "DOT_SCORES",     # CPU forward: scores as dot products of the key rows, no packed keys
    "EDGE_BAND",      # rows per band of a tile the causal/window edge cuts (tiles.band_keys)
    "KEY_SPLITS",     # CPU forward: key ranges per query tile, merged by lse (cpu.splitting)
    "SPLIT_KEYS",     # keys per range, a multiple of BLOCK_K
    "ROW_GROUP",      # CPU: query rows per position (GQA heads folded into rows, cpu.folding)
))

# Positions in the kernels' parameter array of the compute dtype: one per option of the
# table that names a real slot (SCALE, SOFTCAP with 0 = off, KEEP_SCALE = 1 / (1 - p)).
Real = _positions("Real", tuple(option.real[0] for option in OPTIONS if option.real is not None))


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
    values[Int.SAVES_SCORES] = int(any(option.present(problem) for option in _SAVING_OPTIONS))
    values[Int.WINDOW_LEFT] = -1 if visibility.window_left is None else visibility.window_left
    values[Int.WINDOW_RIGHT] = -1 if visibility.window_right is None else visibility.window_right
    values[Int.SINKS] = visibility.sinks
    values[Int.POSITION_SHIFT] = visibility.shift(problem.q_len, problem.kv_len)
    values[Int.DROPOUT_THRESHOLD] = problem.dropout_threshold
    if problem.dropout_p:  # the seed means nothing without dropout: problems differing in it alone share ints
        values[Int.SEED_LO], values[Int.SEED_HI] = seed_words(problem.seed)
        values[Int.DROPOUT_OFFSET_B:Int.DROPOUT_OFFSET_J + 1] = problem.dropout_offset
    return values


def problem_reals(problem, dtype):
    """:func:`problem_parameters`'s reals."""
    return np.array([value(problem) for _, value in _REAL_OPTIONS], dtype)


_FLAGGED_OPTIONS = tuple((Int[option.flag], option) for option in OPTIONS if option.flag is not None)
_SAVING_OPTIONS = tuple(option for option in OPTIONS if option.saves_score)
_REAL_OPTIONS = tuple(option.real for option in OPTIONS if option.real is not None)  # in Real's order


def sink_logits_gradient(xp, problem, lse, delta):
    """d loss / d sink_logits (H,) from the forward's lse (B, H, Sq) and delta = rowsum(dO * O)
    (B, H, Sq), arrays of module ``xp``: the sink column's probability is
    exp(sink - lse), and d out / d sink = -P(sink) * out, so the gradient is
    -sum over b and i of P(sink) * delta. Rows with no visible key (lse -inf) give 0."""
    sink = problem.sink_logits.astype(lse.dtype)[None, :, None]
    seen = xp.isfinite(lse)
    sink_probability = xp.exp(xp.where(seen, sink - xp.where(seen, lse, 0.0), -xp.inf))
    return -(sink_probability * delta).sum(axis=(0, 2))
