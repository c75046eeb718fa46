"""An :class:`~npattn.problem.AttentionProblem` as the flat operands the Numba kernels take.

Every array goes to the kernels as a 1-D view of the memory it already occupies plus
its element strides, so one compiled kernel per dtype serves both layouts, any
broadcast mask or bias (stride 0 along broadcast axes: a (1, 1, Sq, Sk) bias is
read in place, never expanded), and any option set (options are runtime flags,
absent arrays are 1-element placeholders). Nothing is copied except to change a
dtype (float16 inputs, a bias of another float type) or to give BLAS a unit
stride along the head dimension.
"""
from __future__ import annotations

import functools
import threading
from collections import namedtuple

import numpy as np

from ..kernel_params import (OPERAND_NAMES, Int, Real, element_strides, lengths_or_full,  # noqa: F401
                             problem_int_values, problem_reals)  # (Int, Real: the kernels import them from here)
from ..problem import signature
from .microkernels import chunk_columns
from .simd import lanes_of as vector_lanes
from .splitting import key_splits
from .tuning import Tuning, current



# What every kernel takes first, in :data:`npattn.kernel_params.OPERANDS` order
# (``kernel(*operands, ...)``): q, k, v, bias, mask as flat views (strides in ``ints``);
# bias in the compute dtype, mask as uint8, alibi (B * H,) and sink (H,), each a
# 1-element placeholder when absent; q_lengths, kv_lengths int64 (B,), Sq / Sk where not
# given; ints (int64, by :class:`Int`) and reals (compute dtype, by :class:`Real`).
Operands = namedtuple("Operands", OPERAND_NAMES)


def flat_view(array, dtype, unit_last_axis=False):
    """``(flat, strides)``: a read-only 1-D view spanning ``array``'s memory and its element
    strides (read-only, as every operand, so that one compiled kernel serves all).

    Copies only when the dtype differs, a stride is negative or not a whole number of
    elements, or (``unit_last_axis``) the last axis is not contiguous."""
    if array.dtype == dtype and array.flags.c_contiguous and array.size:  # the common case, first
        return _frozen(array.reshape(-1)), element_strides(array)
    array = np.asarray(array)
    if array.dtype != dtype:
        array = array.astype(dtype)
    itemsize = array.itemsize
    strides = array.strides
    if (any(s < 0 or s % itemsize for s in strides)
            or (unit_last_axis and array.shape[-1] > 1 and strides[-1] != itemsize)):
        array = np.ascontiguousarray(array)
    elements = element_strides(array)
    if array.size == 0:
        return _placeholders(np.dtype(dtype))[0], elements
    if array.flags.c_contiguous:
        return _frozen(array.reshape(-1)), elements
    extent = 1 + sum((n - 1) * s for n, s in zip(array.shape, elements))
    flat = np.lib.stride_tricks.as_strided(array, shape=(extent,), strides=(itemsize,), writeable=False)
    return flat, elements


def row_strides(array, dtype):
    """``(flat, (batch, head, row))`` for a bhsd (B, H, S, X) array whose rows feed BLAS:
    the row stride is at least X (BLAS's leading-dimension rule). Rows that overlap (a
    row stride below X, as a ``np.broadcast_to`` along the sequence gives with stride 0)
    are copied once to whole rows; a single row has no row stride to obey."""
    rows, width = array.shape[-2], array.shape[-1]
    if rows > 1 and 0 <= array.strides[-2] < width * array.itemsize:
        array = np.ascontiguousarray(array)
    flat, (sb, sh, sr, _) = flat_view(array, dtype, unit_last_axis=True)
    return flat, (sb, sh, max(sr, width, 1))


def build_operands(problem, kind: str = "forward", tuning: Tuning | None = None,
                   rows_per_position: int = 1) -> Operands:
    """The kernels' operands for ``problem``, with the tiles of ``kind`` ("forward" or
    "backward") and the product path of ``tuning`` (default: the calling context's,
    :func:`npattn.cpu.tuning.current`); ``rows_per_position`` > 1 for a problem whose
    query rows are a GQA group's heads folded in (:mod:`npattn.cpu.folding`).

    Every operand is read-only: Numba types read-only and writable arrays differently,
    so placeholders and views share one compiled kernel."""
    tuning = current() if tuning is None else tuning
    dtype = problem.accumulate_dtype  # the kernels compute in it: float32 for float16 inputs
    q, q_strides = row_strides(problem.q, dtype)
    k, k_strides = row_strides(problem.k, dtype)
    v, v_strides = row_strides(problem.v, dtype)
    placeholder, mask_placeholder = _placeholders(dtype)
    no_strides = (0, 0, 0, 0)
    if problem.bias is not None:
        bias, bias_strides = flat_view(problem.bias, dtype)
    else:
        bias, bias_strides = placeholder, no_strides
    if problem.mask is not None:
        mask, mask_strides = flat_view(problem.mask.view(np.uint8), np.uint8)
    else:
        mask, mask_strides = mask_placeholder, no_strides
    alibi = (placeholder if problem.alibi_slopes is None
             else _read_only(np.ascontiguousarray(problem.alibi_slopes, dtype=dtype).reshape(-1)))
    sink = (placeholder if problem.sink_logits is None
            else _read_only(np.ascontiguousarray(problem.sink_logits, dtype=dtype)))

    # Everything else is a function of the shapes, strides and options: looked up for a
    # call like an earlier one. Dropout draws a fresh seed per call, so it is not kept.
    key = None if problem.dropout_p else (kind, tuning, rows_per_position, signature(problem))
    parameters = _PARAMETERS.get(key) if key is not None else None
    if parameters is None:
        strides = (q_strides, k_strides, v_strides, bias_strides, mask_strides)
        parameters = _parameters(problem, kind, tuning, rows_per_position, strides)
        if key is not None:
            _remember(key, parameters)
    ints, reals, all_rows, all_keys = parameters
    q_lengths = all_rows if problem.q_lengths is None else _lengths(problem.q_lengths)
    kv_lengths = all_keys if problem.kv_lengths is None else _lengths(problem.kv_lengths)
    return Operands(q=q, k=k, v=v, bias=bias, mask=mask, alibi=alibi, sink=sink,
                    q_lengths=q_lengths, kv_lengths=kv_lengths, ints=ints, reals=reals)


def _parameters(problem, kind, tuning, rows_per_position, strides):
    """``(ints, reals, q_lengths, kv_lengths)``, read-only, the lengths for a problem with
    none given (Sq and Sk for every batch entry); ``strides``: the element strides of the
    flat views of q, k, v (3 each), bias and mask (4 each)."""
    block_q, block_k = tuning.forward if kind == "forward" else tuning.backward
    # A problem smaller than a tile gets a tile of its own size: the same single tile,
    # so the same arithmetic, with scratch a small call can allocate in microseconds
    tiles = (min(block_q, max(problem.q_len, 1)), min(block_k, max(problem.kv_len, 1)))
    dtype = problem.accumulate_dtype
    q_strides, k_strides, v_strides, bias_strides, mask_strides = strides
    ints = problem_int_values(problem)
    ints[Int.Q_STRIDE_B:Int.Q_STRIDE_S + 1] = q_strides
    ints[Int.K_STRIDE_B:Int.K_STRIDE_S + 1] = k_strides
    ints[Int.V_STRIDE_B:Int.V_STRIDE_S + 1] = v_strides
    ints[Int.BIAS_STRIDE_B:Int.BIAS_STRIDE_K + 1] = bias_strides
    ints[Int.MASK_STRIDE_B:Int.MASK_STRIDE_K + 1] = mask_strides
    ints[Int.BLOCK_Q], ints[Int.BLOCK_K] = tiles
    ints[Int.EDGE_BAND] = tuning.edge_band
    vector = tuning.vector_products
    lanes, chunk = vector_lanes(dtype), chunk_columns(dtype)
    ints[Int.VECTOR_SCORES] = vector
    ints[Int.VECTOR_VALUES] = vector and problem.value_dim % lanes == 0
    ints[Int.VECTOR_KEYS] = vector and problem.head_dim % lanes == 0
    # rows counted as Sq x group both folded (Sq * group rows, group 1) and not (Sq rows
    # per head): the same problem takes the same path, so folding keeps the bits
    ints[Int.DOT_SCORES] = (kind == "forward" and ints[Int.VECTOR_KEYS]
                            and problem.q_len * problem.group_size <= tuning.dot_rows)
    ints[Int.SCORE_LD] = -(-tiles[1] // chunk) * chunk if vector else tiles[1]
    ints[Int.KEY_SPLITS], ints[Int.SPLIT_KEYS] = key_splits(problem, tiles) if kind == "forward" else (1, 1)
    ints[Int.ROW_GROUP] = rows_per_position
    all_rows = lengths_or_full(np, None, problem.batch, problem.q_len)
    all_keys = lengths_or_full(np, None, problem.batch, problem.kv_len)
    return tuple(_frozen(array) for array in
                 (np.array(ints, np.int64), problem_reals(problem, dtype), all_rows, all_keys))


# Parameters by (kind, tuning, rows per position, problem signature), oldest dropped first
# past the limit: a serving loop's few shapes stay, a sweep over shapes cannot grow it.
_PARAMETERS: dict = {}
_PARAMETERS_LIMIT = 256
_PARAMETERS_LOCK = threading.Lock()


def _remember(key, parameters) -> None:
    with _PARAMETERS_LOCK:
        while len(_PARAMETERS) >= _PARAMETERS_LIMIT:
            del _PARAMETERS[next(iter(_PARAMETERS))]
        _PARAMETERS[key] = parameters


def _lengths(lengths):
    return _read_only(np.ascontiguousarray(lengths, dtype=np.int64))


def _frozen(fresh_view):
    """``fresh_view``, a view made here, marked read-only (its base keeps its own flags)."""
    fresh_view.flags.writeable = False
    return fresh_view


def _read_only(array):
    """``array`` if read-only, else a read-only view of it (the caller's flags untouched)."""
    if not array.flags.writeable:
        return array
    view = array.view()
    view.flags.writeable = False
    return view


@functools.lru_cache(maxsize=None)
def _placeholders(dtype):
    """Read-only 1-element stand-ins for absent arrays: ``(dtype, uint8)``, made once."""
    placeholder, mask = np.zeros(1, dtype), np.ones(1, np.uint8)
    placeholder.flags.writeable = mask.flags.writeable = False
    return placeholder, mask
