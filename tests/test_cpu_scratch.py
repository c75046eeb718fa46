"""The CPU kernels' scratch arena: which sets a thread keeps and hands out again."""
import numpy as np
import pytest

pytest.importorskip("numba")

from npattn.cpu import scratch  # noqa: E402


def _span(specs_list):
    """The sets one call's requests get (one begin_reuse .. end_reuse span)."""
    scratch.begin_reuse()
    try:
        return [scratch.scratch_set(specs) for specs in specs_list]
    finally:
        scratch.end_reuse()


def _specs(nbytes):
    """One float32 array of ``nbytes`` and a small one beside it."""
    return ((nbytes // 4, np.float32), (16, np.float32))


def test_sets_up_to_the_reuse_size_are_handed_out_again_and_larger_ones_are_fresh():
    scratch._ARENA.sets = None  # (this thread's arena, emptied)
    small, large = _specs(scratch._REUSE_BYTES // 2), _specs(scratch._REUSE_BYTES + 4096)
    first = _span([small, small, large])
    second = _span([small, small, large])
    # the n-th request of a span gets the n-th set kept: two distinct sets, each again
    assert first[0][0] is second[0][0] and first[1][0] is second[1][0]
    assert first[0][0] is not first[1][0]
    assert first[2][0] is not second[2][0]  # above _REUSE_BYTES: allocated anew
    for arrays in first + second:  # each on a cache line, of its size, writable
        for array, (size, dtype) in zip(arrays, small if arrays[0].size == small[0][0] else large):
            assert array.size == size and array.dtype == dtype and array.ctypes.data % 64 == 0
            array[:] = 1


def test_a_thread_keeps_at_most_the_kept_bytes():
    scratch._ARENA.sets = None
    kinds = [_specs(scratch._REUSE_BYTES - 1024 * (i + 1)) for i in range(scratch._REUSE_KINDS)]
    for specs in kinds:
        _span([specs])
    kept = scratch._kept_bytes(scratch._ARENA.sets)
    assert 0 < kept <= scratch._KEPT_BYTES
    assert list(scratch._ARENA.sets)[-1] == kinds[-1]  # the most recent kept, the oldest dropped
    assert kinds[0] not in scratch._ARENA.sets
    # a kind used again is still handed its kept set
    again = _span([kinds[-1]])[0][0]
    assert again is scratch._ARENA.sets[kinds[-1]][0][0]
