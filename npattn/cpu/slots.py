"""A decode step's new keys written into its caches in one compiled pass.

``attention_with_kvcache`` writes each new key row ``new[b, s]`` (Hkv, D) into the slot
``cache[targets[b, s], positions[b, s]]`` of a cache (a page and its slot for a paged
cache, a cache row and its position for a contiguous one) and keeps the slots' old bytes
to put back should the attention after it raise. Through NumPy that is a fancy gather and
a fancy assignment per cache: 6-9 us of a paged (4, 8/2, 1 + 40, 64) step, where this
takes 1.6-2.0. Here it is one call for both caches, the old bytes and the new rows copied out
first, so that new rows which are views of the caches read as NumPy's assignment reads
them (as if copied before any write).

An int8 or float8 e4m3 cache's new float rows are quantized in the same pass
(:meth:`SlotWriter.quantize`), by :func:`npattn.core.quantization.quantize_rows`'s float32
steps, to its bits: NumPy's eight array operations on a decode step's two rows cost 23 us
of a 104 us int8 step (e4m3's table search, more).

Slots are not checked here: the kv-cache call checked them, once per step, before its
plan existed (every slot inside its cache, no slot written twice). A plan's later runs
check the arrays' shapes, strides and alignment here, in the write's compiled call, before
its first write (:meth:`SlotWriter.write_checked`, through the machine code's entry point):
0.6-0.7 us for the checked write of a (1, 8/2, 1 + 40, 64) step, where the dispatcher's call
of the write costs 1.0-1.2 and comparing the five arrays' shapes and strides in Python 1.1.
"""
from __future__ import annotations

import copy
import math
import threading
from typing import NamedTuple

import numpy as np

from numba import njit, typeof, types

from ..core.quantization import CODE_LIMIT, E4M3_LARGEST
from .jit import helper, kernel, type_fingerprint
from .signatures import plain_int
from .simd import MICROKERNELS, VECTOR_BYTES, as_bits, load, store


class SlotWriter:
    """Writes the new rows of a step's structure into its caches at fixed slots.

    ``caches``: the caches as a plan's first run passes them (the key and value caches,
    then a quantized cache's scales: pairs, (N, S, H, D) or (N, S, H)); ``new``: the rows
    for each, (B, Sn, H, D) or (B, Sn, H); ``targets``, ``positions``: int64 (B, Sn), the
    cache row or page of each new row and its slot there. Later calls must pass arrays of
    the same dtypes and shapes (a plan checked them)."""

    def __init__(self, caches, new, targets, positions):
        # read-only, whoever made them: one type for the compiled writes to take
        self._targets, self._positions = _read_only(targets), _read_only(positions)
        # per pair of caches: the unsigned ints its bytes are copied as (or None), and the
        # size of its staging: each cache's old rows, then a copy of its new rows
        self._pairs = tuple((_bits(caches[pair].dtype), 2 * (new[pair].size + new[pair + 1].size))
                            for pair in range(0, len(caches), 2))
        bits, size = self._pairs[0]
        # one pair of caches the kernel types as they are (float32, float64): one call, no
        # views; a vector a copy where every row is whole vectors, contiguous
        plain = len(self._pairs) == 1 and bits is None and caches[0].ndim == 4
        lanes = VECTOR_BYTES // caches[0].itemsize
        vectors = plain and MICROKERNELS and all(array.shape[3] % lanes == 0 and array.strides[3] == array.itemsize
                                                 for array in (*caches[:2], *new[:2]))
        self._plain = (plain, size, caches[0].dtype, _write_vector_plain if vectors else _write_plain)
        self._entry, self._local = None, threading.local()  # write_checked's entry point and staging
        # a quantized cache's quantizing write: its staging, the old codes of both caches then
        # their old scales (as float32, from byte _scales_at on), and new codes and scales
        self._codes = caches[0].dtype
        codes = new[0].shape[:3]
        self._scales_at = -(-2 * (math.prod(new[0].shape) + math.prod((*codes, caches[1].shape[3]))) // 8) * 8
        self._quantized_staging = self._scales_at + 4 * 2 * 2 * math.prod(codes)
        self._quantize_entry = None  # quantize_checked's entry point

    def moved(self, targets, positions) -> "SlotWriter":
        """This writer for the same structure at other slots (a decode loop's next step):
        its compiled entry points and staging shared."""
        writer = copy.copy(self)
        writer._targets, writer._positions = _read_only(targets), _read_only(positions)
        return writer

    def write(self, caches, new) -> tuple:
        """Write ``new`` into ``caches``; returns the slots' old bytes, for :meth:`restore`.
        Nothing is written where this raises."""
        plain, size, dtype, write = self._plain
        if plain:
            staged = np.empty(size, dtype)
            _run(write, caches[0], caches[0], caches[1], new[0], new[1], self._targets, self._positions, staged,
                 _UNCHECKED)
            return (staged,)
        olds = []
        try:
            for index, (bits, size) in enumerate(self._pairs):
                arrays = [_as_rows(array, bits) for array in (caches[2 * index], caches[2 * index + 1],
                                                               new[2 * index], new[2 * index + 1])]
                staged = np.empty(size, arrays[0].dtype)
                _run(_write_plain, arrays[0], *arrays, self._targets, self._positions, staged, _UNCHECKED)
                olds.append(staged)
        except BaseException:
            self.restore(caches, new, olds)
            raise
        return tuple(olds)

    @property
    def plain(self) -> bool:
        """Whether the writer takes one pair of caches Numba types as they are (float32,
        float64): the pair :meth:`write_checked` writes."""
        return self._plain[0]

    def write_checked(self, q, k_cache, v_cache, k, v, expected) -> np.ndarray | None:
        """:meth:`write` of a :attr:`plain` writer for a plan's run that has checked only
        the kind, dtype, ndim and writability of its arrays (q is read for its structure
        only): their shapes, strides and alignment are compared with ``expected`` (int64
        (5, 8), read-only: each array's shape, then its strides in bytes) in the compiled
        call, before its first write. Returns the staging (the one array of the tuple
        :meth:`write` returns; this thread's, reused by its next call), or None, with nothing
        written, where an array differs (the caller checks them one by one, to name it).

        It runs the write's machine code for the arrays' Numba types in any layout
        (:func:`_typed_entry`), which the caller's checks fix (kind, dtype, ndim, writable
        caches): the dispatcher's typing of nine arguments costs twice the write."""
        staged = getattr(self._local, "staged", None)
        if staged is None:
            _, size, dtype, _ = self._plain
            staged = self._local.staged = np.empty(size, dtype)
        arguments = (q, k_cache, v_cache, k, v, self._targets, self._positions, staged, expected)
        entry = self._entry
        if entry is not None:
            return staged if entry(*arguments) else None
        # kept once a call matched (the structure the plan's later runs are checked against)
        entry = _typed_entry(self._plain[3], arguments)
        if not entry(*arguments):
            return None
        self._entry = entry
        return staged

    def quantizes(self, rows_dtype) -> bool:
        """Whether :meth:`quantize` takes new rows of ``rows_dtype``: the writer's caches
        are int8 or float8 e4m3 codes (uint8) with their scales, the rows float32 or float64
        (which Numba types)."""
        return (len(self._pairs) == 2 and self._codes in (_INT8, _E4M3) and np.dtype(rows_dtype) in _TYPED[:2])

    def quantize(self, caches, new) -> tuple | None:
        """:meth:`write` of the float rows ``new`` (k, v) quantized as
        :func:`~npattn.core.quantization.quantize_rows` quantizes them (int8 or e4m3 caches,
        see :meth:`quantizes`), the codes and scales computed in the same compiled pass;
        None, with nothing written, where a row holds a value that is not finite in float32
        (NumPy's int8 of a NaN is the platform's: the caller quantizes through NumPy)."""
        # (the checked call's machine code with nothing to compare: the new keys stand in for q,
        # whose structure only the comparison reads; one compiled function serves both calls)
        olds = self._quantized(new[0], caches, new, _UNCHECKED)
        return olds if type(olds) is _Quantized else None

    def quantize_checked(self, q, caches, new, expected):
        """:meth:`quantize` for a plan's run that has checked only the kind, dtype, ndim and
        writability of its arrays and that the caches and scales own their memory apart: the
        shapes, strides and alignment of q, the caches, their scales and the new rows (in
        that order) are compared with ``expected`` (int64 (7, 8), read-only: each array's
        shape, then its strides in bytes) in the compiled call, before its first write.
        Returns the staging for :meth:`restore`; or, with nothing written, 0 where an array
        differs (the caller checks them one by one, to name it) and -1 where a row is not
        finite in float32 (the caller quantizes through NumPy). Runs the machine code typed
        for the arrays' Numba types, as :meth:`write_checked` does."""
        return self._quantized(q, caches, new, expected)

    def _quantized(self, q, caches, new, expected):
        """:meth:`quantize_checked`; with ``expected`` of no rows (:data:`_UNCHECKED`) it
        compares nothing."""
        staged = np.empty(self._quantized_staging, np.uint8)
        arguments = (q, *caches, *new, self._targets, self._positions, staged[:self._scales_at].view(np.int8),
                     staged[self._scales_at:].view(np.float32), self._codes == _E4M3, expected)
        checked = expected is not _UNCHECKED
        entry = self._quantize_entry if checked else None
        typed = entry or _typed_entry(_quantize_slots_checked, arguments)
        done = typed(*arguments)
        if checked and entry is None and done != 0:  # (kept once a call matched, as write_checked's)
            self._quantize_entry = typed
        return _Quantized(staged) if done == 1 else done

    def restore(self, caches, new, olds) -> None:
        """Put back the old bytes :meth:`write` returned (rare: what ran after the write
        raised), through NumPy."""
        index = (self._targets, self._positions)
        if type(olds) is _Quantized:  # (:meth:`quantize`'s one staging)
            staged = olds.staged
            scales = staged[self._scales_at:].view(np.float32)
            rows = math.prod(new[0].shape[:3])
            sizes = (rows * caches[0].shape[3], rows * caches[1].shape[3])
            parts = (staged[:sizes[0]], staged[2 * sizes[0]:2 * sizes[0] + sizes[1]], scales[:rows],
                     scales[2 * rows:3 * rows])
            for cache, old in zip(caches, parts):
                cache[index] = old.view(cache.dtype).reshape(cache[index].shape)
            return
        for pair, staged in enumerate(olds):
            first, second = caches[2 * pair], caches[2 * pair + 1]
            sizes = (new[2 * pair].size, new[2 * pair + 1].size)
            for cache, start, size in ((first, 0, sizes[0]), (second, 2 * sizes[0], sizes[1])):
                cache[index] = staged[start:start + size].view(cache.dtype).reshape(cache[index].shape)


def _typed_entry(kernel, arguments):
    """The entry point of ``kernel``'s machine code for ``arguments``, compiled for their
    Numba types with every array's layout "A" (strides read from the array), so that one
    compile per dtype and dimension count serves caches and new rows of any layout: C or
    Fortran order, or views such as a fused projection's k and v slices, each of which had
    been a compile of its own (0.7-8 s on the 2-core Zen 4 VM) in the middle of a serving loop,
    after a warmup that had seen other layouts. Kept per Numba fingerprint of the
    arguments: a plan per decode step looks it up in 1.3 us, where typing the arguments
    costs tens. The entry point reads each array's own shape and strides, whatever
    layout it has."""
    key = (kernel, *(type_fingerprint(argument) for argument in arguments))
    entry = _ENTRIES.get(key)
    if entry is None:
        signature = tuple(_any_layout(typeof(argument)) for argument in arguments)
        kernel.compile(signature)  # (or loads it from the cache)
        entry = _ENTRIES[key] = kernel.overloads[signature].entry_point
    return entry


def _any_layout(numba_type):
    """``numba_type``, an array's with layout "A"."""
    return numba_type.copy(layout="A") if isinstance(numba_type, types.Array) else numba_type


def _run(kernel, *arguments):
    """``kernel(*arguments)`` through :func:`_typed_entry`'s machine code."""
    return _typed_entry(kernel, arguments)(*arguments)


_ENTRIES: dict = {}  # _typed_entry's entry points


class _Quantized(NamedTuple):
    """What :meth:`SlotWriter.quantize` returns: its staging (old codes, new codes, then
    old and new scales), which :meth:`SlotWriter.restore` reads apart from a pair's."""

    staged: np.ndarray


def _as_rows(array, bits):
    """``array`` as :func:`_write_plain` takes it: 4-D (a unit last axis for scales), its
    bytes as ``bits`` (unsigned ints) where Numba cannot type its dtype."""
    if array.ndim == 3:
        array = array[..., None]
    return array if bits is None else array.view(bits)


def _bits(dtype: np.dtype) -> np.dtype | None:
    """The int dtype of ``dtype``'s width where Numba cannot type ``dtype`` (float16;
    ml_dtypes' bfloat16 and float8) or where another dtype of its width is compiled for
    already (uint8 e4m3 codes, as int8), else None (a copy moves the bytes as they are):
    each write kernel is compiled once per width, not once per dtype."""
    if dtype in _TYPED:
        return None
    return np.dtype(np.int8) if dtype.itemsize == 1 else np.dtype(f"u{dtype.itemsize}")


def _read_only(array: np.ndarray) -> np.ndarray:
    """``array``, or a read-only view of it where it is writable."""
    if not array.flags.writeable:
        return array
    view = array.view()
    view.setflags(write=False)
    return view


_UNCHECKED = np.zeros((0, 8), np.int64)  # no rows: _write_plain compares no array
_UNCHECKED.setflags(write=False)
_TYPED = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int8))
_INT8, _E4M3 = np.dtype(np.int8), np.dtype(np.uint8)  # (e4m3 codes are held as uint8)


@kernel
def _write_plain(query, first, second, first_new, second_new, targets, positions, staged, expected):
    """:meth:`SlotWriter.write` on arrays Numba types, one cache after the other (as
    NumPy's two assignments would: rows of ``second_new`` read after ``first`` took its
    rows); ``staged`` (flat): for each cache its slots' old bytes, then a copy of its new
    rows, taken before its first write. Where ``expected`` has rows, first whether
    ``query``, the caches and their new rows have the shapes, strides (bytes) and alignment
    of its rows (:func:`_matches`): False, with nothing written, where one does not."""
    if not _all_match(query, first, second, first_new, second_new, expected):
        return False
    _write_cache(second, second_new, targets, positions, staged,
                 _write_cache(first, first_new, targets, positions, staged, plain_int(0)))
    return True


@helper
def _all_match(query, first, second, first_new, second_new, expected):
    return expected.shape[0] == 0 or (
        _matches(query, expected[0]) and _matches(first, expected[1]) and _matches(second, expected[2])
        and _matches(first_new, expected[3]) and _matches(second_new, expected[4]))


@helper
def _matches(array, expected):
    """Whether ``array`` has the shape, then strides, of ``expected`` and lies aligned."""
    if array.ctypes.data % array.itemsize:
        return False
    for axis in range(array.ndim):
        if array.shape[axis] != expected[axis] or array.strides[axis] != expected[array.ndim + axis]:
            return False
    return True


@helper
def _write_cache(cache, new, targets, positions, staged, start):
    """One cache of :func:`_write_plain` from ``staged[start:]``; returns where the next starts."""
    batch, new_len, heads, width = new.shape
    rows = batch * new_len * heads * width
    at = start
    for b in range(batch):
        for s in range(new_len):
            row, slot = targets[b, s], positions[b, s]
            for h in range(heads):
                for d in range(width):
                    staged[at] = cache[row, slot, h, d]
                    staged[at + rows] = new[b, s, h, d]
                    at += 1
    at = start + rows
    for b in range(batch):
        for s in range(new_len):
            row, slot = targets[b, s], positions[b, s]
            for h in range(heads):
                for d in range(width):
                    cache[row, slot, h, d] = staged[at]
                    at += 1
    return start + 2 * rows


@kernel
def _write_vector_plain(query, first, second, first_new, second_new, targets, positions, staged, expected):
    """:func:`_write_plain` for float caches whose rows, and new rows, are whole vectors
    and contiguous: a vector a copy (the element loops ran scalar, 1.3 us of a 4-sequence
    step's write)."""
    if not _all_match(query, first, second, first_new, second_new, expected):
        return False
    _write_vector_cache(second, second_new, targets, positions, staged,
                        _write_vector_cache(first, first_new, targets, positions, staged, plain_int(0)))
    return True


@helper
def _write_vector_cache(cache, new, targets, positions, staged, start):
    """:func:`_write_cache` a vector at a time (rows addressed by their element strides)."""
    batch, new_len, heads, width = new.shape
    lanes = VECTOR_BYTES // staged.itemsize
    item = staged.itemsize
    cache_strides = (cache.strides[0] // item, cache.strides[1] // item, cache.strides[2] // item)
    new_strides = (new.strides[0] // item, new.strides[1] // item, new.strides[2] // item)
    rows = batch * new_len * heads * width
    at = start
    for b in range(batch):
        for s in range(new_len):
            slot = targets[b, s] * cache_strides[0] + positions[b, s] * cache_strides[1]
            for h in range(heads):
                old, fresh = slot + h * cache_strides[2], b * new_strides[0] + s * new_strides[1] + h * new_strides[2]
                for d in range(0, width, lanes):
                    store(staged, at + d, load(cache, old + d))
                    store(staged, at + rows + d, load(new, fresh + d))
                at += width
    at = start + rows
    for b in range(batch):
        for s in range(new_len):
            slot = targets[b, s] * cache_strides[0] + positions[b, s] * cache_strides[1]
            for h in range(heads):
                old = slot + h * cache_strides[2]
                for d in range(0, width, lanes):
                    store(cache, old + d, load(staged, at + d))
                at += width
    return start + 2 * rows


# IEEE arithmetic, as NumPy's: no fastmath (a reciprocal for the division would move codes)
_exact = njit(cache=True, nogil=True, error_model="numpy", _nrt=False)
# the same, called only from jitted code: no CPython or C wrapper (as jit.helper)
_exact_helper = njit(cache=True, nogil=True, error_model="numpy", _nrt=False, no_cpython_wrapper=True,
                     no_cfunc_wrapper=True)


@_exact_helper
def _quantize_slots(key_codes, value_codes, key_scales, value_scales, k, v, targets, positions, codes, scales, e4m3):
    """:func:`_quantize_slots_checked`'s write: both caches' rows quantized
    (int8 codes, or with ``e4m3`` float8 e4m3 bits) into ``codes`` and ``scales`` (flat; per
    cache its old codes, then its new ones, as bytes; its old scales, then its new ones)
    before the first write; False, with nothing written, where a row is not finite in
    float32."""
    value_at, value_scale_at = 2 * k.size, 2 * k.shape[0] * k.shape[1] * k.shape[2]
    if not (_quantize_cache(key_codes, key_scales, k, targets, positions, codes, scales, 0, 0, e4m3)
            and _quantize_cache(value_codes, value_scales, v, targets, positions, codes, scales, value_at,
                                value_scale_at, e4m3)):
        return False
    _write_quantized(key_codes, key_scales, k, targets, positions, codes, scales, 0, 0)
    _write_quantized(value_codes, value_scales, v, targets, positions, codes, scales, value_at, value_scale_at)
    return True


@_exact
def _quantize_slots_checked(query, key_codes, value_codes, key_scales, value_scales, k, v, targets, positions,
                            codes, scales, e4m3, expected):
    """:meth:`SlotWriter.quantize_checked`, and unchecked :meth:`SlotWriter.quantize`: 1
    where :func:`_quantize_slots` wrote; 0, nothing written, where an array does not have
    the shape, strides and alignment of its row of ``expected`` (:func:`_matches`; none
    where it has no rows); -1, nothing written, where a row is not finite."""
    if expected.shape[0] and not (
            _matches(query, expected[0]) and _matches(key_codes, expected[1]) and _matches(value_codes, expected[2])
            and _matches(key_scales, expected[3]) and _matches(value_scales, expected[4])
            and _matches(k, expected[5]) and _matches(v, expected[6])):
        return 0
    return 1 if _quantize_slots(key_codes, value_codes, key_scales, value_scales, k, v, targets, positions, codes,
                                scales, e4m3) else -1


@njit(inline="always")
def _quantize_cache(cache, cache_scales, rows, targets, positions, codes, scales, at, scale_at, e4m3):
    """One cache's old codes and scales, and its new ones, into ``codes[at:]`` and
    ``scales[scale_at:]``: quantize_rows' steps in float32 (the largest magnitude over
    127, or 448 for e4m3, 1 where it is 0; each value over it rounded half to even,
    clipped: an int8, or the nearest e4m3 bits, :func:`_e4m3_bits`)."""
    limit = np.float32(E4M3_LARGEST) if e4m3 else np.float32(CODE_LIMIT)
    batch, new_len, heads, width = rows.shape
    count, row_count = rows.size, batch * new_len * heads
    row = 0
    for b in range(batch):
        for s in range(new_len):
            target, slot = targets[b, s], positions[b, s]
            for h in range(heads):
                largest = np.float32(0.0)
                for d in range(width):
                    value = np.float32(rows[b, s, h, d])
                    if not abs(value) < np.inf:
                        return False
                    largest = max(largest, abs(value))
                scale = np.float32(largest / limit)
                safe = scale if scale > 0 else np.float32(1.0)
                scales[scale_at + row] = cache_scales[target, slot, h]
                scales[scale_at + row_count + row] = scale
                base = at + row * width
                for d in range(width):
                    scaled = np.float32(np.float32(rows[b, s, h, d]) / safe)
                    codes[base + d] = cache[target, slot, h, d]
                    if e4m3:
                        codes[base + count + d] = _e4m3_bits(scaled)
                    else:
                        codes[base + count + d] = np.int8(min(max(np.rint(scaled), np.float32(-CODE_LIMIT)),
                                                              np.float32(CODE_LIMIT)))
                row += 1
    return True


@njit(inline="always")
def _e4m3_bits(scaled):
    """The float8 e4m3 bits (as an int8 byte) nearest the float32 ``scaled`` (finite),
    ties to the even pattern, magnitudes past 448 taken as 448: quantize_rows' rounding
    (its table search) by the float32's bits. Below 2**-6, steps of 2**-9 (the
    subnormals: rint of the value times 2**9, exact); above, the float32's mantissa
    rounded half to even at 3 bits, its exponent rebiased from 127 to 7."""
    magnitude = min(abs(scaled), np.float32(E4M3_LARGEST))
    if magnitude < np.float32(2.0 ** -6):
        code = np.int32(np.rint(magnitude * np.float32(2.0 ** 9)))
    else:
        bits = np.int32(as_bits(magnitude))
        code = ((bits + np.int32(0x7FFFF) + ((bits >> 20) & 1)) >> 20) - np.int32(120 << 3)
    if scaled < 0:
        code |= 0x80
    return np.int8(np.uint8(code))


@njit(inline="always")
def _write_quantized(cache, cache_scales, rows, targets, positions, codes, scales, at, scale_at):
    """One cache's new codes and scales from the staging into its slots."""
    batch, new_len, heads, width = rows.shape
    count, row_count = rows.size, batch * new_len * heads
    row = 0
    for b in range(batch):
        for s in range(new_len):
            target, slot = targets[b, s], positions[b, s]
            for h in range(heads):
                cache_scales[target, slot, h] = scales[scale_at + row_count + row]
                base = at + count + row * width
                for d in range(width):
                    cache[target, slot, h, d] = codes[base + d]
                row += 1
