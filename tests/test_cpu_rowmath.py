"""The online softmax's row operations on their own: the float32 exp polynomials (float32's
and the bfloat16 forward's brief one), the vector row max and softcap's tanh, on rows of
every length (whole vectors, a partial last vector, both).

The kernel tests reach these only through whole attention results, where an error in a
rare lane (the tail, an underflow, an overflow) can hide under the tolerance of a sum.
"""
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

pytest.importorskip("numba")
from numba import njit  # noqa: E402

from npattn.cpu.rowmath import (_BRIEF_C, SHORT_ROW_BYTES, exp_short_row_shifted, exp_shifted, row_max,  # noqa: E402
                                short_row_max, soft_capped)
from npattn.cpu.simd import VECTOR_BYTES, lanes_in, line_elements  # noqa: E402

EPS32 = float(np.finfo(np.float32).eps)
# float32 exp underflows to exactly 0 below 2**-126 (the polynomial's smallest normal) and
# overflows to +inf from 2**127.5 up (its 2**n factor for n = 128)
SMALLEST_NORMAL = float(np.finfo(np.float32).tiny)
OVERFLOW = 2.0 ** 127.5
FLOAT32_MAX = float(np.finfo(np.float32).max)


def _brief_error():
    """The brief polynomial's own largest relative error against 2**f on [-1/2, 1/2]
    (npattn.cpu.rowmath._BRIEF_C in float64 on a fine grid; its float32 rounding is the
    bound's few eps)."""
    fraction = np.linspace(-0.5, 0.5, 100001)
    value = np.polynomial.polynomial.polyval(fraction, np.array(_BRIEF_C, np.float32).astype(np.float64))
    return float(np.abs(value / 2.0 ** fraction - 1).max())


BRIEF_ERROR = _brief_error()


@njit  # not cached: a cache stamped with this file alone would outlive edits to rowmath
def _exp_shifted(row, start, n, shift, brief=False):
    return exp_shifted(row, start, n, shift, brief)


@njit  # not cached: a cache stamped with this file alone would outlive edits to rowmath
def _row_max(row, start, n):
    return row_max(row, start, n)


@njit  # not cached: a cache stamped with this file alone would outlive edits to rowmath
def _exp_short_row_shifted(row, start, shift):
    return exp_short_row_shifted(row, start, shift)


@njit  # not cached: a cache stamped with this file alone would outlive edits to rowmath
def _short_row_max(row, start):
    return short_row_max(row, start)


@njit  # not cached (as above)
def _soft_capped(row, tanh, start, n, softcap):
    soft_capped(row, tanh, start, n, softcap)


@njit  # not cached (as above): each value alone, in a partial vector
def _soft_capped_one_by_one(row, tanh, start, n, softcap):
    for c in range(start, start + n):
        soft_capped(row, tanh, c, 1, softcap)


def _ulps(got, want):
    """|got - want| in float32 steps (both float32, finite, of one sign or zero)."""
    ordered = [np.where(x.view(np.int32) < 0, -(x.view(np.int32) & 0x7FFFFFFF), x.view(np.int32)).astype(np.int64)
               for x in (got, want)]
    return np.abs(ordered[0] - ordered[1])


lengths = st.integers(0, 70)
starts = st.integers(0, 19)  # rows start anywhere in a score tile, not on a vector boundary
scores = st.floats(-200, 200, width=32) | st.just(-np.inf)


@pytest.mark.parametrize("brief", [False, True])
@given(data=st.data(), start=starts, n=lengths, shift=st.floats(-100, 100, width=32))
def test_float32_exp_is_within_its_derived_bound_of_float64(brief, data, start, n, shift):
    row = data.draw(hnp.arrays(np.float32, start + n + 3, elements=scores))
    before = row.copy()
    shift = np.float32(shift)
    total = _exp_shifted(row, start, n, shift, brief)
    argument = before[start:start + n].astype(np.float64) - np.float64(shift)
    with np.errstate(over="ignore"):
        exact = np.exp(argument)
    # the float32 argument x - shift and its product with log2(e) are rounded: the exponent
    # is off by up to |x - shift| * eps relatively, the polynomial and the 2**n product by a
    # few eps. Brief: x log2(e) - shift log2(e) in one FMA rounds shift log2(e) on its own
    # (up to |shift| * eps more), and its polynomial adds its own error
    magnitude = np.abs(np.where(np.isfinite(argument), argument, 0.0))
    if brief:
        magnitude = magnitude + abs(float(shift))
    relative = (magnitude + 4) * EPS32 + (BRIEF_ERROR if brief else 0.0)
    got = row[start:start + n].astype(np.float64)
    assert not np.isnan(got).any()
    overflow = exact >= OVERFLOW * (1 - relative)
    assert np.all(got[exact > FLOAT32_MAX * (1 + relative)] == np.inf)
    fine = ~overflow
    assert np.all(np.abs(got[fine] - exact[fine]) <= relative[fine] * exact[fine] + SMALLEST_NORMAL)
    assert np.all(got[np.isneginf(argument)] == 0.0), "a masked score must contribute exactly 0"
    np.testing.assert_array_equal(row[:start], before[:start], err_msg="before start the row is untouched")
    np.testing.assert_array_equal(row[start + n:], before[start + n:], err_msg="past n the row is untouched")
    if got.sum() < FLOAT32_MAX * (1 - n * EPS32):
        # the sum of float32 values in float32: one rounding per term
        assert abs(float(total) - got.sum()) <= n * EPS32 * got.sum() + SMALLEST_NORMAL
    elif got.sum() > FLOAT32_MAX * (1 + n * EPS32):
        assert total == np.inf, "a float32 sum past float32's range is +inf"


def test_the_brief_exp_gives_0_below_the_least_normal_and_no_subnormal_past_half_a_step_above():
    # (a subnormal result costs Intel's cores a microcode assist each: masked scores, -inf,
    # and scores far below their row's max must give 0 without making one)
    exponents = np.linspace(-140.0, -120.0, 4001)
    row = (exponents / np.log2(np.e)).astype(np.float32)
    _exp_shifted(row, 0, row.size, np.float32(0.0), True)
    exponent = (exponents / np.log2(np.e)).astype(np.float32).astype(np.float64) * np.log2(np.e)
    # (the kernel's exponent is the argument times log2(e) in float32: off by a few of its
    # ulps, relative to its magnitude)
    slack = 4 * EPS32 * np.abs(exponent)
    assert np.all(row[exponent < -126 - slack] == 0.0)
    assert np.all(row[exponent > -125.5 + slack] >= np.finfo(np.float32).tiny)


@njit  # not cached (as above): each value alone, in a partial vector
def _exp_one_by_one(row, start, n, shift, brief):
    for c in range(start, start + n):
        exp_shifted(row, c, 1, shift, brief)


@pytest.mark.parametrize("brief", [False, True])
@given(data=st.data(), start=starts, n=lengths, shift=st.floats(-100, 100, width=32))
def test_a_float32_exp_has_the_same_bits_anywhere_in_a_row(brief, data, start, n, shift):
    """A value's exp does not depend on its place in the row: whole vectors and the partial
    last one give the same bits (the forward and the backward cut a row into vectors at
    different places: a causal band's last key, another tile width)."""
    row = data.draw(hnp.arrays(np.float32, start + n + 3, elements=scores))
    whole, one_by_one = row.copy(), row.copy()
    _exp_shifted(whole, start, n, np.float32(shift), brief)
    _exp_one_by_one(one_by_one, start, n, np.float32(shift), brief)
    np.testing.assert_array_equal(one_by_one.view(np.int32), whole.view(np.int32))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@given(data=st.data(), start=starts, n=lengths)
def test_row_max_is_the_max_of_its_n_elements(dtype, data, start, n):
    row = data.draw(hnp.arrays(dtype, start + n + 2, elements=st.floats(-1e6, 1e6, width=32) | st.just(-np.inf)))
    expected = row[start:start + n].max() if n else -np.inf
    assert _row_max(row, start, n) == expected


def test_float64_exp_is_the_exact_exp():
    row = np.linspace(-30, 30, 40)
    total = _exp_shifted(row, 3, 37, 1.5)
    expected = np.exp(np.linspace(-30, 30, 40)[3:] - 1.5)
    np.testing.assert_allclose(row[3:], expected, rtol=2 * np.finfo(np.float64).eps, atol=0)
    assert total == pytest.approx(expected.sum(), rel=37 * np.finfo(np.float64).eps)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@given(data=st.data(), start=starts, shift=st.floats(-100, 100, width=32))
def test_the_short_row_operations_give_the_general_ones_bits(dtype, data, start, shift):
    """A short tile's rows (one AVX-512 vector, two AVX2 ones) take the inlined short-row
    forms; the kernels' results must not depend on which form a row took (NaN lanes
    included: both skip them in the max)."""
    length = SHORT_ROW_BYTES // np.dtype(dtype).itemsize
    elements = st.floats(-200, 200, width=32) | st.just(-np.inf) | st.just(np.nan)
    row = data.draw(hnp.arrays(dtype, start + length + 2, elements=elements))
    shift = dtype(shift)
    general, short = row.copy(), row.copy()
    assert np.array_equal(_short_row_max(row, start), _row_max(row, start, length), equal_nan=True)
    total = _exp_shifted(general, start, length, shift)
    assert np.array_equal(_exp_short_row_shifted(short, start, shift), total, equal_nan=True)
    assert general.tobytes() == short.tobytes()


@njit  # not cached (as above)
def _lanes_and_line(row):
    return lanes_in(row), line_elements(row)


@pytest.mark.parametrize("dtype", [np.int8, np.float32, np.float64])
def test_lanes_in_and_line_elements_are_the_dtypes_counts(dtype):
    """simd.lanes_in and line_elements: the constants jitted code uses in place of a
    division by an array's itemsize (which Numba reads at run time)."""
    array = np.zeros(4, dtype)
    assert _lanes_and_line(array) == (VECTOR_BYTES // array.itemsize, 64 // array.itemsize)


def test_sums_keep_the_order_written_on_every_cpu():
    """simd.add and horizontal_sum emit fadd without "reassoc" (the kernels' fastmath flags
    carry it), so LLVM cannot regroup a row's sum differently where it is inlined: on an
    Emerald Rapids CPU a short row's sum and the general loop's differed in the last bit
    when they could. Read from the LLVM IR, so it holds on any CPU, not only where the
    regrouping happens to show in the bits."""
    import re

    from npattn.cpu.jit import OPTIONS
    from npattn.cpu.simd import add, horizontal_sum, load

    @njit(**{**OPTIONS, "cache": False})
    def summed(x, y):
        return add(horizontal_sum(load(x, 0)), y)

    x = np.arange(VECTOR_BYTES // 4, dtype=np.float32)
    assert summed(x, np.float32(0.5)) == np.float32(x.sum() + 0.5)
    ir = next(iter(summed.inspect_llvm().values()))
    sums = re.findall(r"= fadd ([a-z ]*?)(?:<\d+ x )?float", ir)
    assert len(sums) >= 2, ir  # the lanes' halves and the scalar
    assert all(flags.split() == ["nsz"] for flags in sums), sums


def test_float32_tanh_is_within_2_ulps_of_the_rounded_tanh_everywhere():
    """Every 509th float32 of either sign (8 million values, 16 thousand in each binade:
    both branches, the tiny and the saturated) and the floats around the switch at 5/8, in
    whole vectors: within 2 ulps of float64's tanh rounded to float32; NaN stays NaN, +-inf
    give +-1, -0 gives -0."""
    switch = int(np.float32(0.625).view(np.uint32))
    positive = np.concatenate([np.arange(0, 0x7F800000, 509, dtype=np.uint32),
                               np.arange(switch - 4096, switch + 4096, dtype=np.uint32)]).view(np.float32)
    values = np.concatenate([positive, -positive, np.float32([np.inf, -np.inf, np.nan, -0.0])])
    row, tanh = values.copy(), np.empty_like(values)
    _soft_capped(row, tanh, 0, row.size, np.float32(1.0))
    finite = np.isfinite(values)
    want = np.tanh(values[finite].astype(np.float64)).astype(np.float32)
    assert _ulps(tanh[finite], want).max() <= 2
    assert np.isnan(tanh[np.isnan(values)]).all()
    np.testing.assert_array_equal(tanh[-4:-2], [1.0, -1.0])
    assert tanh[-1] == 0 and np.signbit(tanh[-1])
    np.testing.assert_array_equal(row.view(np.int32)[finite], tanh.view(np.int32)[finite])  # softcap 1: s = tanh


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@given(data=st.data(), start=starts, n=lengths, softcap=st.floats(0.5, 100, width=32))
def test_softcap_rows_keep_their_tanh_and_scale_it(dtype, data, start, n, softcap):
    """A row of scores becomes softcap * tanh(s / softcap), the tanh kept for the backward:
    float32 within 2 ulps of the rounded tanh of its float32 argument, in whole vectors and
    in the partial last one alike (the same bits); float64 libm's tanh (``math.tanh``'s); the elements
    around the row untouched."""
    size = start + n + 5
    row = data.draw(hnp.arrays(dtype, size, elements=st.floats(-1e4, 1e4, width=32)))
    tanh = np.full(size, 7.0, dtype)
    got = row.copy()
    _soft_capped(got, tanh, start, n, dtype(softcap))
    part = slice(start, start + n)
    np.testing.assert_array_equal(got[:start], row[:start])
    np.testing.assert_array_equal(got[start + n:], row[start + n:])
    assert (tanh[:start] == 7).all() and (tanh[start + n:] == 7).all()
    argument = row[part] * (dtype(1.0) / dtype(softcap))
    if dtype == np.float64:
        np.testing.assert_array_equal(tanh[part], [math.tanh(x) for x in row[part] * (1.0 / softcap)])
    else:
        assert _ulps(tanh[part], np.tanh(argument.astype(np.float64)).astype(np.float32)).max(initial=0) <= 2
        one_by_one, kept = row.copy(), np.full(size, 7.0, dtype)
        _soft_capped_one_by_one(one_by_one, kept, start, n, dtype(softcap))
        np.testing.assert_array_equal(kept.view(np.int32), tanh.view(np.int32))
        np.testing.assert_array_equal(one_by_one.view(np.int32), got.view(np.int32))
    np.testing.assert_array_equal(got[part], dtype(softcap) * tanh[part])
