"""The exact GELU's vector kernel (npattn.cpu.activations) against float64 SciPy, and the
autograd's use of it for float32 NumPy arrays."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

pytest.importorskip("numba")
special = pytest.importorskip("scipy.special")

from npattn import autograd as ag  # noqa: E402
from npattn.autograd import ops  # noqa: E402
from npattn.cpu.activations import gelu_with_cdf  # noqa: E402


def _float64_gelu_and_cdf(x):
    """The float64 values ``x * Phi(x)`` and ``Phi(x)`` of float32 ``x`` (SciPy's ndtr keeps
    the left tail's relative precision)."""
    wide = x.astype(np.float64)
    with np.errstate(invalid="ignore"):
        cdf = special.ndtr(wide)
        return wide * cdf, cdf


def _ulps_off(got, exact):
    """How many float32 ulps (of the float32 rounding of ``exact``) ``got`` lies from
    ``exact``, where exact is finite; NaN and infinities must match exactly."""
    rounded = exact.astype(np.float32)
    assert np.array_equal(np.isnan(got), np.isnan(rounded))
    finite = np.isfinite(rounded)
    assert np.array_equal(got[~finite & ~np.isnan(rounded)], rounded[~finite & ~np.isnan(rounded)])
    wide = rounded[finite].astype(np.float64)
    exponent = np.frexp(wide)[1] - 1  # (of a normal float32's leading bit; subnormals and 0 share -126's ulp)
    spacing = np.ldexp(1.0, np.maximum(np.where(wide == 0, -126, exponent), -126) - 23)
    return np.abs(got[finite].astype(np.float64) - exact[finite]) / spacing


FLOAT32 = hnp.arrays(np.float32, hnp.array_shapes(max_dims=3, max_side=40),
                     elements=st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True))


@given(FLOAT32)
def test_the_vector_gelu_is_within_an_ulp_of_the_exact_one(x):
    out, cdf = gelu_with_cdf(x)
    assert out.shape == cdf.shape == x.shape and out.dtype == cdf.dtype == np.float32
    exact, exact_cdf = _float64_gelu_and_cdf(x)
    # at most 0.5 ulp from rounding and 1e-11 relative from the fit: one ulp of the
    # float32 rounding of the exact value, which is itself 0.5 ulp off it
    assert _ulps_off(out, exact).max(initial=0) <= 1.0
    assert _ulps_off(cdf, exact_cdf).max(initial=0) <= 1.0


def test_the_vector_gelu_is_within_an_ulp_across_its_range():
    """Every float32 step near the fit's joins and edges, and a fine grid over [-16, 16]
    (past +-15.6 the CDF is 0 or 1 in float32)."""
    grid = np.linspace(-16, 16, 1_000_001).astype(np.float32)
    edges = np.concatenate([np.nextafter(np.float32(v), np.float32(direction)) * np.ones(1, np.float32)
                            for v in (0.0, -15.556, 15.556, -1e-30, 1e-30) for direction in (-np.inf, np.inf)])
    x = np.concatenate([grid, edges, np.array([0.0, -0.0, 1e-45, -1e-45, 3.4e38, -3.4e38], np.float32)])
    out, cdf = gelu_with_cdf(x)
    exact, exact_cdf = _float64_gelu_and_cdf(x)
    assert _ulps_off(out, exact).max() <= 1.0
    assert _ulps_off(cdf, exact_cdf).max() <= 1.0


def test_the_left_tail_keeps_float32s_relative_precision():
    """Where 0.5 * (1 + erf(x / sqrt 2)) in float32 loses Phi to cancellation (at x = -5
    it is off by about 1e-2 of itself), the kernel keeps it to an ulp."""
    x = -np.linspace(3, 13, 10001).astype(np.float32)
    _, cdf = gelu_with_cdf(x)
    exact = special.ndtr(x.astype(np.float64))
    assert np.abs(cdf / exact - 1).max() < 2 ** -22
    cancelled = 0.5 * (1 + special.erf(x / np.float32(math.sqrt(2))).astype(np.float32))
    assert np.abs(cancelled / exact - 1).max() > 1e-3  # (the form it replaces: the test can tell)


def test_special_values_are_torchs():
    """gelu(-inf) = -inf * 0 = NaN as in torch (and the erf form); NaN stays NaN."""
    out, cdf = gelu_with_cdf(np.array([np.inf, -np.inf, np.nan, 0.0, -0.0], np.float32))
    assert out[0] == np.inf and np.isnan(out[1]) and np.isnan(out[2])
    assert out[3] == 0 and np.signbit(out[4])
    assert cdf[0] == 1 and cdf[1] == 0 and np.isnan(cdf[2]) and cdf[3] == 0.5


def test_any_memory_order_gives_the_same_values_and_the_input_is_untouched():
    x = np.random.default_rng(0).standard_normal((6, 7, 5)).astype(np.float32) * 4
    kept = x.copy()
    views = (x, x.transpose(2, 0, 1), x[:, ::2], np.asfortranarray(x))
    for view in views:
        out, cdf = gelu_with_cdf(view)
        expected, expected_cdf = gelu_with_cdf(np.ascontiguousarray(view))
        assert np.array_equal(out, expected) and np.array_equal(cdf, expected_cdf)
    out, cdf = gelu_with_cdf(x, keep_cdf=False)
    assert cdf is None and np.array_equal(out, gelu_with_cdf(x)[0])
    assert np.array_equal(x, kept)


def test_the_autograds_float32_gelu_takes_the_kernel_and_its_gradient_is_exact(monkeypatch):
    """float32 NumPy data never reaches erf (it is made to fail here); the value is the
    kernel's, and the gradient (dout * (Phi + x phi)) is the float64 one to float32's
    rounding. float64 data still takes erf."""
    def no_erf(x):
        raise AssertionError("float32 GELU reached erf")

    monkeypatch.setattr(ops, "_erf", no_erf)
    data = np.random.default_rng(1).standard_normal((4, 9)).astype(np.float32) * 3
    x = ag.Tensor(data, requires_grad=True)
    y = ag.gelu(x)
    assert np.array_equal(y.data, gelu_with_cdf(data)[0])
    dout = np.random.default_rng(2).standard_normal(data.shape).astype(np.float32)
    y.backward(dout)
    wide = data.astype(np.float64)
    exact = dout * (special.ndtr(wide) + wide * np.exp(-0.5 * wide * wide) / math.sqrt(2 * math.pi))
    assert np.abs(x.grad - exact).max() <= 8 * np.finfo(np.float32).eps * np.abs(exact).max()
    with ag.no_grad():
        assert np.array_equal(ag.gelu(x).data, y.data)
    with pytest.raises(AssertionError, match="reached erf"):
        ag.gelu(ag.Tensor(wide))


def test_a_split_array_is_written_whole_with_the_values_of_its_pieces():
    """An array of many work items, shared among the threads, gets the values of each
    piece computed alone (below one item: the calling thread)."""
    x = np.random.default_rng(3).standard_normal(5 * (1 << 15) + 7).astype(np.float32) * 5
    out, cdf = gelu_with_cdf(x)
    pieces = [gelu_with_cdf(piece) for piece in np.array_split(x, 23)]
    assert np.array_equal(out, np.concatenate([piece[0] for piece in pieces]))
    assert np.array_equal(cdf, np.concatenate([piece[1] for piece in pieces]))


def test_a_float32_warmup_compiles_the_gelu_kernel():
    """In a process of its own, where no other test has called it."""
    import subprocess
    import sys

    script = """
import npattn
from npattn.cpu.activations import gelu_kernel
npattn.warmup(dtypes=("float64",), backward=False, serving=False)
print(len(gelu_kernel.signatures))
npattn.warmup(dtypes=("float32",), backward=False, serving=False)
print(len(gelu_kernel.signatures))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "1"], result.stdout
