"""A decode step's new keys written into its caches in one compiled pass.

``attention_with_kvcache`` writes each new key row ``new[b, s]`` (Hkv, D) into the slot
``cache[targets[b, s], positions[b, s]]`` of a cache (a page and its slot for a paged
cache, a cache row and its position for a contiguous one) and keeps the slots' old bytes
to put back should the attention after it raise. Through NumPy that is a fancy gather and
a fancy assignment per cache: 6 us of a paged (4, 8/2, 1 + 40, 64) step whose attention
takes 40. Here it is one call for both caches, the old bytes and the new rows copied out
first, so that new rows which are views of the caches read as NumPy's assignment reads
them (as if copied before any write).

Slots are not checked here: the kv-cache call checked them, once per step, before its
plan existed (every slot inside its cache, no slot written twice).
"""
from __future__ import annotations

import numpy as np

from .jit import helper, kernel


class SlotWriter:
    """Writes the new rows of a step's structure into its caches at fixed slots.

    ``caches``: the caches as a plan's first run passes them (the key and value caches,
    then a quantized cache's scales: pairs, (N, S, H, D) or (N, S, H)); ``new``: the rows
    for each, (B, Sn, H, D) or (B, Sn, H); ``targets``, ``positions``: int64 (B, Sn), the
    cache row or page of each new row and its slot there. Later calls must pass arrays of
    the same dtypes and shapes (a plan checked them)."""

    def __init__(self, caches, new, targets, positions):
        self._targets, self._positions = targets, positions
        # per pair of caches: the unsigned ints its bytes are copied as (or None), and the
        # size of its staging: each cache's old rows, then a copy of its new rows
        self._pairs = tuple((_bits(caches[pair].dtype), 2 * (new[pair].size + new[pair + 1].size))
                            for pair in range(0, len(caches), 2))
        bits, size = self._pairs[0]
        # one pair of caches the kernel types as they are (float32, float64): one call, no views
        self._plain = (len(self._pairs) == 1 and bits is None and caches[0].ndim == 4, size, caches[0].dtype)

    def write(self, caches, new) -> tuple:
        """Write ``new`` into ``caches``; returns the slots' old bytes, for :meth:`restore`.
        Nothing is written where this raises."""
        plain, size, dtype = self._plain
        if plain:
            staged = np.empty(size, dtype)
            _write_slots(caches[0], caches[1], new[0], new[1], self._targets, self._positions, staged)
            return (staged,)
        olds = []
        try:
            for index, (bits, size) in enumerate(self._pairs):
                arrays = [_as_rows(array, bits) for array in (caches[2 * index], caches[2 * index + 1],
                                                               new[2 * index], new[2 * index + 1])]
                staged = np.empty(size, arrays[0].dtype)
                _write_slots(*arrays, self._targets, self._positions, staged)
                olds.append(staged)
        except BaseException:
            self.restore(caches, new, olds)
            raise
        return tuple(olds)

    def restore(self, caches, new, olds) -> None:
        """Put back the old bytes :meth:`write` returned (rare: what ran after the write
        raised), through NumPy."""
        index = (self._targets, self._positions)
        for pair, staged in enumerate(olds):
            first, second = caches[2 * pair], caches[2 * pair + 1]
            sizes = (new[2 * pair].size, new[2 * pair + 1].size)
            for cache, start, size in ((first, 0, sizes[0]), (second, 2 * sizes[0], sizes[1])):
                cache[index] = staged[start:start + size].view(cache.dtype).reshape(cache[index].shape)


def _as_rows(array, bits):
    """``array`` as :func:`_write_slots` takes it: 4-D (a unit last axis for scales), its
    bytes as ``bits`` (unsigned ints) where Numba cannot type its dtype."""
    if array.ndim == 3:
        array = array[..., None]
    return array if bits is None else array.view(bits)


def _bits(dtype: np.dtype) -> np.dtype | None:
    """The unsigned int dtype of ``dtype``'s width where Numba cannot type ``dtype``
    (float16; ml_dtypes' bfloat16 and float8), else None (a copy moves the bytes as they are)."""
    return None if dtype in _TYPED else np.dtype(f"u{dtype.itemsize}")


_TYPED = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int8))


@kernel
def _write_slots(first, second, first_new, second_new, targets, positions, staged):
    """:func:`SlotWriter.write` on arrays Numba types, one cache after the other (as
    NumPy's two assignments would: rows of ``second_new`` read after ``first`` took its
    rows); ``staged`` (flat): for each cache its slots' old bytes, then a copy of its new
    rows, taken before its first write."""
    _write_cache(second, second_new, targets, positions, staged,
                 _write_cache(first, first_new, targets, positions, staged, 0))


@helper
def _write_cache(cache, new, targets, positions, staged, start):
    """One cache of :func:`_write_slots` from ``staged[start:]``; returns where the next starts."""
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
