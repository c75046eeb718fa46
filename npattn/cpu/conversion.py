"""float16 <-> float32 and float32 -> bfloat16 conversions of whole arrays on the vector units.

The CPU kernels compute float16 problems in float32. Where the forward reads k and v
a 16-bit tile at a time (:func:`npattn.cpu.operands.kv_codes`) it reads q as it lies too
(:func:`npattn.cpu.operands.query_codes`) and writes a 16-bit out itself, and the
backward reads q, k, v and a dout of q's dtype so too; elsewhere (a bias gradient's
backward, head dims that are not whole vectors, asked weights) arrays go in converted,
and gradients come back converted. NumPy's ``astype`` runs a scalar
loop for float16: on the 2-core AVX-512 VM 1.7 ms to float32 and 2.6 ms back per million
values, 7.7 ms of a (1, 8, 2048, 64) causal forward that takes 25 ms in float32. Here each vector of 16 (8 on AVX2) goes
through F16C's ``vcvtph2ps`` / ``vcvtps2ph``: both exact or rounded to nearest even as
NumPy rounds, so the values are NumPy's. A bfloat16 out comes back the same way (integer
rounding to nearest even, a vector at a time: ml_dtypes' values, NaNs included; its own
``astype`` took 1.8 ms for 4 million values where this takes about 1); bfloat16 in needs
no kernel (ml_dtypes' widening is a copy's speed, and the bfloat16 products read
bfloat16 as it lies).
"""
from __future__ import annotations

import threading
from typing import Callable

import numpy as np

from numba import types
from numba.extending import overload

from .jit import OPTIONS, kernel
from .simd import (MICROKERNELS, VECTOR_BYTES, fill, horizontal_max, horizontal_sum, load, load_first,
                   load_float16_bits, maximum, multiply, multiply_add, store, store_float16_bits,
                   store_float16_bits_first)
from .threads import direct_entry

_LANES = VECTOR_BYTES // 4  # float32 lanes of a vector
_FLOAT16, _FLOAT32 = np.dtype(np.float16), np.dtype(np.float32)
# the dtype object 16-bit arrays are viewed as bytes by (a view by the np.int8 class looks
# its dtype up: 0.07 us more of a small call's every view)
BYTES = np.dtype(np.int8)
# Arrays of fewer values go through NumPy's astype: its scalar loop (1.2-2.9 ns a value on
# the 2-core AVX-512 VM) converts 1024 values in about the 1.7 us this call's set-up takes
# (768 values: 1.4 and 2.3 us, against 1.7-1.8), and a small float16 call converts q and out.
VECTOR_VALUES = 1024


@kernel
def _to_float32(source, out):
    """``out[i]`` = the float16 whose bytes are ``source[2i : 2i + 2]``, whole vectors."""
    like = fill(0.0, out)
    for i in range(0, out.size - out.size % _LANES, _LANES):
        store(out, i, load_float16_bits(source, 2 * i, like, False))


@kernel
def _bfloat16_to_float32(source, out):
    """``out[i]`` = the bfloat16 whose bytes are ``source[2i : 2i + 2]``, whole vectors
    (exact: its bits are float32's upper half)."""
    like = fill(0.0, out)
    for i in range(0, out.size - out.size % _LANES, _LANES):
        store(out, i, load_float16_bits(source, 2 * i, like, True))


# The least float32 magnitudes that round to an infinity: halfway between each 16-bit
# type's largest finite value and the next power of two (a tie rounds to the even
# neighbour, the infinity)
_FLOAT16_PAST = np.float32(65520.0)
_BFLOAT16_PAST = np.frombuffer(np.uint32(0x7F7F8000).tobytes(), np.float32)[0]


def narrow_run(source, start, count, out, out_at, brain):
    """``source[start : start + count]`` (float32) rounded to nearest even
    into ``out``'s 16-bit elements ``out_at`` on (``out``: bytes; bfloat16 with ``brain``,
    else float16): the bits of :func:`converted`; whether any of those results is not
    finite: from a NaN or an infinity in ``source``, or a value that rounds to an
    infinity. Checked in the registers the values are rounded from (a second pass over
    ``source`` doubled a small array's time): the largest magnitude, and a sum of
    ``x * 0``, which is 0 for every finite x and NaN for the others (an FMA: no fast-math
    flag lets it be assumed finite). A count that is not whole vectors ends in a vector
    read and written masked (a key tile's gradient rows of head dim 40, say). A float64
    ``source`` (a kernel's other dtype, never asked) does nothing. Jitted code only."""
    raise NotImplementedError


@overload(narrow_run, jit_options=OPTIONS)
def _narrow_run_overload(source, start, count, out, out_at, brain):
    if source.dtype != types.float32:  # (never asked of other kernels: nothing to compile)
        return lambda source, start, count, out, out_at, brain: False

    def implementation(source, start, count, out, out_at, brain):
        zero, negate = fill(0.0, source), fill(-1.0, source)
        largest, nan_or_inf = zero, zero
        whole = count - count % _LANES
        for i in range(0, whole, _LANES):
            value = load(source, start + i)
            if brain:  # (the rounding is a compile-time choice: a literal in each branch)
                store_float16_bits(out, 2 * (out_at + i), value, True)
            else:
                store_float16_bits(out, 2 * (out_at + i), value, False)
            largest = maximum(maximum(value, multiply(value, negate)), largest)
            nan_or_inf = multiply_add(value, zero, nan_or_inf)
        if whole < count:  # (zeros in the lanes past the end: finite, and no larger)
            value = load_first(source, start + whole, count - whole, 0.0)
            if brain:
                store_float16_bits_first(out, 2 * (out_at + whole), value, count - whole, True)
            else:
                store_float16_bits_first(out, 2 * (out_at + whole), value, count - whole, False)
            largest = maximum(maximum(value, multiply(value, negate)), largest)
            nan_or_inf = multiply_add(value, zero, nan_or_inf)
        limit = _BFLOAT16_PAST if brain else _FLOAT16_PAST
        return not (horizontal_sum(nan_or_inf) == 0.0 and horizontal_max(largest) < limit)
    return implementation


@kernel
def _to_float16(source, out):
    """The bytes ``out[2i : 2i + 2]`` = ``source[i]`` rounded to float16, whole vectors;
    returns whether any of them is not finite (NaN, or inf: from 65520 on values round there)."""
    return narrow_run(source, 0, source.size - source.size % _LANES, out, 0, False)


@kernel
def _to_bfloat16(source, out):
    """The bytes ``out[2i : 2i + 2]`` = ``source[i]`` rounded to bfloat16, whole vectors;
    returns whether any of them is not finite."""
    return narrow_run(source, 0, source.size - source.size % _LANES, out, 0, True)


# the 16-bit dtypes a float32 array converts to here, by name, and their kernels
_NARROW_KERNELS = {"float16": _to_float16, "bfloat16": _to_bfloat16}
NARROW = tuple(_NARROW_KERNELS)
# and the 16-bit dtypes conversion_entry widens to float32
_WIDENING_KERNELS = {"float16": _to_float32, "bfloat16": _bfloat16_to_float32}


def converted(array: np.ndarray, dtype, empty=np.empty) -> np.ndarray | None:
    """``array.astype(dtype)`` laid out in memory as ``array`` is, for float16 to float32
    and float32 to float16 or bfloat16 (``dtype``: a dtype whose name is in
    :data:`NARROW`) on CPUs with the vector kernels; None for any other case (the
    caller's ``astype`` then), and for arrays under :data:`VECTOR_VALUES` values, which
    NumPy's scalar loop converts sooner than this call is made. ``array``: C-contiguous,
    or a bhsd view of a bshd array; ``empty(shape, dtype)`` gives the (C-contiguous,
    writable) result's memory. (Written for a small call's every us: 1.3 us of set-up
    where the general version of it took 3.)"""
    if type(array) is not np.ndarray or array.size < VECTOR_VALUES or not MICROKERNELS:
        return None
    source_dtype = array.dtype
    # (NumPy's native dtypes are one object each: ``is`` first, == for the others)
    if source_dtype is _FLOAT16 or source_dtype == _FLOAT16:
        if not (dtype is np.float32 or dtype is _FLOAT32 or dtype == _FLOAT32):
            return None
        narrowing, dtype = None, _FLOAT32
    elif source_dtype is _FLOAT32 or source_dtype == _FLOAT32:
        narrowing, dtype = _narrowing(dtype)
        if narrowing is None:
            return None
    else:
        return None
    if array.flags.c_contiguous:
        order = None
        source = array.reshape(-1)
        out = empty(array.shape, dtype)
    else:
        order = _memory_order(array)
        if order is None:
            return None
        source = array.transpose(order).reshape(-1)  # a view, in memory order
        out = empty(tuple(array.shape[axis] for axis in order), dtype)
    target = out.reshape(-1)
    if narrowing is None:
        _to_float32(source.view(np.int8), target)
    else:
        narrowing(source, target.view(np.int8))
    whole = source.size - source.size % _LANES
    if whole < source.size:
        with np.errstate(over="ignore", invalid="ignore"):  # (past the range is inf, as the vectors give it)
            target[whole:] = source[whole:]  # the last values, fewer than a vector
    # (the orders _memory_order gives are their own inverses)
    return out if order is None else out.transpose(order)


def conversion_entry(source_dtype, target_dtype, size: int):
    """The machine-code entry point of the kernel that converts ``size`` values of
    ``source_dtype`` into ``target_dtype`` (float16 or bfloat16 -> float32, float32 ->
    float16 or bfloat16), for a plan that converts arrays of one size on every call: no dispatcher
    typing its arguments, none of :func:`converted`'s checks (2.1-2.3 us of a small
    float16 call's conversion, of which the kernel took 0.6). None where the vector
    kernels do not convert every value (no vector kernels, a size that is not whole
    vectors) or for other dtypes.

    Its arguments are flat C-contiguous arrays, each 16-bit side viewed as int8 bytes:
    ``entry(source.view(np.int8), target)`` widening, ``entry(source, target.view(np.int8))``
    narrowing. The values are :func:`converted`'s (the same kernels)."""
    source_dtype, target_dtype = np.dtype(source_dtype), np.dtype(target_dtype)
    if not MICROKERNELS or size % _LANES:
        return None
    if source_dtype.name in _WIDENING_KERNELS and target_dtype == _FLOAT32:
        convert, arguments = (_WIDENING_KERNELS[source_dtype.name],
                              (np.zeros(2 * _LANES, np.int8), np.empty(_LANES, np.float32)))
    elif source_dtype == _FLOAT32 and target_dtype.name in _NARROW_KERNELS:
        convert, arguments = _NARROW_KERNELS[target_dtype.name], (np.zeros(_LANES, np.float32),
                                                                 np.empty(2 * _LANES, np.int8))
    else:
        return None
    convert(*arguments)  # (compiled, or loaded from the cache, for these types)
    return direct_entry(convert, arguments)


# The float32 copies a 16-bit backward widens its arrays into where it does not read them by
# tiles (a bias gradient's), and a 16-bit forward's out, are kept per thread
# and slot, for the next call of the same shapes: their fresh pages, not the conversions,
# were most of what a float16 forward and backward at (1, 8, 2048, 64) causal cost beyond
# float32's in one process (101-112 against 86-89 ms; 89-90 with glibc keeping freed
# memory). At most _KEPT_WIDENED_BYTES a thread, the most recently used kept first.
_KEPT_WIDENED_BYTES = 64 << 20
_WIDENED = threading.local()


def kept_widened(slot: str) -> Callable[[tuple, object], np.ndarray]:
    """An ``empty(shape, dtype)`` (for :func:`~npattn.cpu.conversion.converted`) that gives
    the calling thread's kept array for ``slot``, shape and dtype, or a new one it keeps:
    the caller is done with it before the thread's next call asks for that slot again."""
    def empty(shape: tuple, dtype) -> np.ndarray:
        kept = getattr(_WIDENED, "arrays", None)
        if kept is None:
            kept = _WIDENED.arrays = {}  # (slot, shape, dtype) -> array, the most recently used last
        key = (slot, tuple(shape), np.dtype(dtype))
        array = kept.pop(key, None)
        if array is not None:  # (kept again, the most recent: the total is unchanged)
            kept[key] = array
            return array
        array = np.empty(shape, dtype)
        if array.nbytes > _KEPT_WIDENED_BYTES:
            return array
        kept[key] = array
        total = sum(kept_array.nbytes for kept_array in kept.values())
        while total > _KEPT_WIDENED_BYTES:
            total -= kept.pop(next(iter(kept))).nbytes
        return array
    return empty


_NARROWINGS = {}


def _narrowing(dtype):
    """``(kernel, np.dtype)`` of a float32 -> ``dtype`` conversion here, ``(None, None)``
    where there is none; by the dtype object first (its ``name`` costs a small call
    microseconds)."""
    known = _NARROWINGS.get(dtype)
    if known is None:
        dtype_object = np.dtype(dtype)
        kernel = _NARROW_KERNELS.get(dtype_object.name)
        known = _NARROWINGS[dtype] = (kernel, dtype_object if kernel is not None else None)
    return known


def _memory_order(array):
    """The axis order in which ``array`` is C-contiguous: its own, or (0, 2, 1, 3) for a
    bhsd view of a bshd array; None for any other layout. (:func:`npattn.cpu.operands.memory_order`
    says the same with a dtype check, but operands imports this module: no import circle.)"""
    if array.flags.c_contiguous:
        return tuple(range(array.ndim))
    if array.ndim == 4 and array.transpose(0, 2, 1, 3).flags.c_contiguous:
        return (0, 2, 1, 3)
    return None
