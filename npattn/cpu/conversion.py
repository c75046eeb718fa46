"""float16 <-> float32 conversions of whole arrays on the vector units.

The CPU kernels compute float16 problems in float32: q (and k and v past a decode
step's size, see :func:`npattn.cpu.operands.kv_codes`) go in converted, out comes back
converted. NumPy's ``astype`` runs a scalar loop for float16: on the 2-core AVX-512 VM
1.7 ms to float32 and 2.6 ms back per million values, 7.7 ms of a (1, 8, 2048, 64)
causal forward that takes 25 ms in float32. Here each vector of 16 (8 on AVX2) goes
through F16C's ``vcvtph2ps`` / ``vcvtps2ph``: both exact or rounded to nearest even as
NumPy rounds, so the values are NumPy's.
"""
from __future__ import annotations

import numpy as np

from .jit import kernel
from .simd import MICROKERNELS, VECTOR_BYTES, fill, load, load_float16_bits, store, store_float16_bits

_LANES = VECTOR_BYTES // 4  # float32 lanes of a vector
_FLOAT16, _FLOAT32 = np.dtype(np.float16), np.dtype(np.float32)
# Arrays of fewer values go through NumPy's astype: its scalar loop (1.7-2.6 ns a value on
# the 2-core AVX-512 VM) converts 4096 values in the ~7 us this call's set-up took, and a
# small float16 call converts q and out: (1, 1, 8, 64) planned, 36.4 us against float32's 8.6.
VECTOR_VALUES = 4096


@kernel
def _to_float32(source, out):
    """``out[i]`` = the float16 whose bytes are ``source[2i : 2i + 2]``, whole vectors."""
    like = fill(0.0, out)
    for i in range(0, out.size - out.size % _LANES, _LANES):
        store(out, i, load_float16_bits(source, 2 * i, like, False))


@kernel
def _to_float16(source, out):
    """The bytes ``out[2i : 2i + 2]`` = ``source[i]`` rounded to float16, whole vectors."""
    for i in range(0, source.size - source.size % _LANES, _LANES):
        store_float16_bits(out, 2 * i, load(source, i))


def converted(array: np.ndarray, dtype) -> np.ndarray | None:
    """``array.astype(dtype)`` laid out in memory as ``array`` is, for float16 to float32
    and back on CPUs with the vector kernels; None for any other case (the caller's
    ``astype`` then), and for arrays under :data:`VECTOR_VALUES` values, which NumPy's
    scalar loop converts sooner than this call is made. ``array``: C-contiguous, or a
    bhsd view of a bshd array."""
    dtype = np.dtype(dtype)
    pair = (array.dtype, dtype)
    if (not MICROKERNELS or pair not in ((_FLOAT16, _FLOAT32), (_FLOAT32, _FLOAT16)) or type(array) is not np.ndarray
            or array.size < VECTOR_VALUES):
        return None
    order = _memory_order(array)
    if order is None:
        return None
    source = array.transpose(order).reshape(-1)  # a view, in memory order
    out = np.empty(source.shape, dtype)
    whole = source.size - source.size % _LANES
    if dtype == _FLOAT32:
        _to_float32(source.view(np.int8), out)
    else:
        _to_float16(source, out.view(np.int8))
    if whole < source.size:
        with np.errstate(over="ignore"):  # (past float16's range is inf, as the vectors give it)
            out[whole:] = source[whole:]  # the last values, fewer than a vector
    # (the orders _memory_order gives are their own inverses)
    return out.reshape(tuple(array.shape[axis] for axis in order)).transpose(order)


def _memory_order(array):
    """The axis order in which ``array`` is C-contiguous: its own, or (0, 2, 1, 3) for a
    bhsd view of a bshd array; None for any other layout. (:func:`npattn.cpu.operands.memory_order`
    says the same with a dtype check, but operands imports this module: no import circle.)"""
    if array.flags.c_contiguous:
        return tuple(range(array.ndim))
    if array.ndim == 4 and array.transpose(0, 2, 1, 3).flags.c_contiguous:
        return (0, 2, 1, 3)
    return None
