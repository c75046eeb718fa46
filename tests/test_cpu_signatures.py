"""The scalar intrinsics that stand in for ``min``, ``max`` and ``np.int64`` inside the
kernels: same values and types as the builtins, for every mix of argument types the
kernels pass (int64 array elements, Python int literals, float32 and float64); and the
uint64 offsets of their elementwise loops."""
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("numba")
from numba import njit  # noqa: E402

from npattn.cpu.signatures import as_offset, larger, plain_int, smaller  # noqa: E402


@njit  # not cached: a cache stamped with this file alone would outlive edits to signatures
def _pick_ints(values, a, b):
    return (smaller(values[0], values[1]), larger(values[0], values[1]),
            smaller(values[0], a), larger(b, values[1]), smaller(0, a), larger(a, 1),
            plain_int(values[0]) + plain_int(True))


@njit
def _pick_floats(values32, a64):
    return (smaller(values32[0], values32[1]), larger(values32[0], values32[1]),
            smaller(values32[0], a64), larger(a64, values32[1]))


ints = st.integers(-2**62, 2**62)


@given(st.lists(ints, min_size=2, max_size=2), ints, ints)
def test_integer_min_max_match_the_builtins(values, a, b):
    got = _pick_ints(np.array(values, np.int64), a, b)
    assert got == (min(values), max(values), min(values[0], a), max(b, values[1]), min(0, a),
                   max(a, 1), values[0] + 1)


floats = st.floats(width=32, allow_nan=False)


@given(st.lists(floats, min_size=2, max_size=2), st.floats(-1e300, 1e300))
def test_float_min_max_match_the_builtins_and_keep_float32(values, a64):
    values32 = np.array(values, np.float32)
    low, high, mixed_low, mixed_high = _pick_floats(values32, a64)
    first, second = float(values32[0]), float(values32[1])
    assert (low, high) == (min(first, second), max(first, second))
    assert (mixed_low, mixed_high) == (min(first, a64), max(a64, second))
    # two float32 operands stay float32; with a float64 the result is float64
    assert [str(t) for t in _pick_floats.nopython_signatures[0].return_type] == \
        ["float32", "float32", "float64", "float64"]


def test_a_nan_gives_the_second_argument():
    low, high, _, _ = _pick_floats(np.array([np.nan, 1.0], np.float32), 0.0)
    assert (low, high) == (1.0, 1.0)
    low, high, _, _ = _pick_floats(np.array([1.0, np.nan], np.float32), 0.0)
    assert math.isnan(low) and math.isnan(high)


@njit
def _scaled_run(x, start, stop, base, factor):
    """``x[base + i] *= factor`` for i in [start, stop), indexed through uint64 offsets."""
    first = as_offset(base)
    for i in range(as_offset(start), as_offset(stop)):
        x[first + i] *= factor
    return as_offset(stop)


def test_an_offset_range_that_starts_past_its_stop_is_empty():
    """The kernels rely on it: score_tile's fill from a padded width past the tile's last
    column (Numba counts an unsigned range through a signed difference)."""
    x = np.arange(100, dtype=np.float32)
    _scaled_run(x, 30, 10, 5, np.float32(3))
    np.testing.assert_array_equal(x, np.arange(100, dtype=np.float32))


@given(st.integers(0, 40), st.integers(0, 40), st.integers(0, 20))
def test_offset_loops_touch_exactly_their_run(start, length, base):
    x = np.arange(100, dtype=np.float32)
    expected = x.copy()
    expected[base + start:base + start + length] *= 3
    stop = _scaled_run(x, start, start + length, base, np.float32(3))
    np.testing.assert_array_equal(x, expected)
    assert type(stop) is int and stop == start + length
