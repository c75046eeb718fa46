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
from npattn.cpu.activations import gelu, gelu_gradient  # noqa: E402


def _float64_gelu_and_slope(x):
    """The float64 values ``x * Phi(x)`` and its derivative ``Phi(x) + x phi(x)`` of
    float32 ``x`` (SciPy's ndtr keeps the left tail's relative precision)."""
    wide = x.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        cdf = special.ndtr(wide)
        return wide * cdf, cdf + wide * np.exp(-0.5 * wide * wide) / math.sqrt(2 * math.pi)


def _check_gradient(x, dout):
    """gelu_gradient against float64: within an ulp, or where Phi and x phi nearly cancel
    (the slope is 0 at x = -0.75), within 1e-10 of dout (Phi + |x| phi), float64's error of
    the sum before its one rounding."""
    got = gelu_gradient(x, dout)
    assert got.shape == x.shape and got.dtype == np.float32
    wide = x.astype(np.float64)
    _, slope = _float64_gelu_and_slope(x)
    with np.errstate(invalid="ignore", over="ignore"):
        exact = dout.astype(np.float64) * slope
        scale = np.abs(dout) * (special.ndtr(wide) + np.abs(wide) * np.exp(-0.5 * wide * wide))
    off = _ulps_off(got, exact)
    finite = np.isfinite(exact.astype(np.float32))
    loose = np.abs(got[finite].astype(np.float64) - exact[finite]) <= 1e-10 * scale[finite]
    assert np.all((off <= 1.0) | loose)


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


@given(FLOAT32, st.data())
def test_the_vector_gelu_and_its_gradient_are_within_an_ulp_of_the_exact_ones(x, data):
    out = gelu(x)
    assert out.shape == x.shape and out.dtype == np.float32
    exact, _ = _float64_gelu_and_slope(x)
    # at most 0.5 ulp from rounding and 1e-11 relative from the fit: one ulp of the
    # float32 rounding of the exact value, which is itself 0.5 ulp off it
    assert _ulps_off(out, exact).max(initial=0) <= 1.0
    dout = data.draw(hnp.arrays(np.float32, x.shape, elements=st.floats(-1e6, 1e6, width=32)))
    _check_gradient(x, dout)


def test_the_vector_gelu_is_within_an_ulp_across_its_range():
    """Every float32 step near the fit's joins and edges, and a fine grid over [-16, 16]
    (past +-15.6 the CDF is 0 or 1 in float32)."""
    grid = np.linspace(-16, 16, 1_000_001).astype(np.float32)
    edges = np.concatenate([np.nextafter(np.float32(v), np.float32(direction)) * np.ones(1, np.float32)
                            for v in (0.0, -15.556, 15.556, -1e-30, 1e-30) for direction in (-np.inf, np.inf)])
    x = np.concatenate([grid, edges, np.array([0.0, -0.0, 1e-45, -1e-45, 3.4e38, -3.4e38], np.float32)])
    exact, _ = _float64_gelu_and_slope(x)
    assert _ulps_off(gelu(x), exact).max() <= 1.0
    _check_gradient(x, np.random.default_rng(4).standard_normal(x.shape).astype(np.float32))


def test_the_left_tail_keeps_float32s_relative_precision():
    """Where 0.5 * (1 + erf(x / sqrt 2)) in float32 loses Phi to cancellation (at x = -5
    it is off by a few percent of itself), the kernel keeps gelu to an ulp."""
    x = -np.linspace(3, 13, 10001).astype(np.float32)
    exact = special.ndtr(x.astype(np.float64))
    # (an ulp of float32 is at most eps relative to the value: two of them, for the
    # rounding of x * Phi and the comparison's own division)
    assert np.abs(gelu(x) / (x * exact) - 1).max() < 2 * np.finfo(np.float32).eps
    cancelled = 0.5 * (1 + special.erf(x / np.float32(math.sqrt(2))).astype(np.float32))
    assert np.abs(cancelled / exact - 1).max() > 1e-3  # (the form it replaces: the test can tell)


def test_special_values_are_torchs():
    """gelu(-inf) = -inf * 0 = NaN as in torch (and the erf form); NaN stays NaN; the
    gradient at either infinity is NaN as the erf form's (inf * density 0)."""
    x = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0], np.float32)
    out = gelu(x)
    assert out[0] == np.inf and np.isnan(out[1]) and np.isnan(out[2])
    assert out[3] == 0 and np.signbit(out[4])
    slope = gelu_gradient(x, np.ones_like(x))
    assert np.isnan(slope[:3]).all() and np.all(slope[3:] == 0.5)


def test_any_memory_order_gives_the_same_values_and_the_inputs_are_untouched():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 7, 5)).astype(np.float32) * 4
    dout = rng.standard_normal((5, 6, 7)).astype(np.float32).transpose(1, 2, 0)  # (6, 7, 5), not C-ordered
    kept, kept_dout = x.copy(), dout.copy()
    for view, grad in ((x, dout), (x.transpose(2, 0, 1), dout.transpose(2, 0, 1)), (x[:, ::2], dout[:, ::2]),
                       (np.asfortranarray(x), np.asfortranarray(dout))):
        assert np.array_equal(gelu(view), gelu(np.ascontiguousarray(view)))
        assert np.array_equal(gelu_gradient(view, grad),
                              gelu_gradient(np.ascontiguousarray(view), np.ascontiguousarray(grad)))
    assert np.array_equal(x, kept) and np.array_equal(dout, kept_dout)


def test_the_autograds_float32_gelu_takes_the_kernel_and_its_gradient_is_exact(monkeypatch):
    """float32 NumPy data never reaches erf (it is made to fail here); the value and the
    gradient are the kernel's, and the gradient (dout * (Phi + x phi)) is the float64 one
    to float32's rounding. float64 data still takes erf."""
    def no_erf(x):
        raise AssertionError("float32 GELU reached erf")

    monkeypatch.setattr(ops, "_erf", no_erf)
    data = np.random.default_rng(1).standard_normal((4, 9)).astype(np.float32) * 3
    x = ag.Tensor(data, requires_grad=True)
    y = ag.gelu(x)
    assert np.array_equal(y.data, gelu(data))
    dout = np.random.default_rng(2).standard_normal(data.shape).astype(np.float32)
    y.backward(dout)
    assert np.array_equal(x.grad, gelu_gradient(data, dout))
    wide = data.astype(np.float64)
    exact = dout * (special.ndtr(wide) + wide * np.exp(-0.5 * wide * wide) / math.sqrt(2 * math.pi))
    assert np.abs(x.grad - exact).max() <= 8 * np.finfo(np.float32).eps * np.abs(exact).max()
    with ag.no_grad():
        assert np.array_equal(ag.gelu(x).data, y.data)
    with pytest.raises(AssertionError, match="reached erf"):
        ag.gelu(ag.Tensor(wide))


def test_a_float32_warmup_compiles_the_gelu_and_normalization_kernels():
    """In a process of its own, where no other test has called them."""
    import subprocess
    import sys

    script = """
import npattn
from npattn.cpu.activations import gelu_kernel
from npattn.cpu.normalization import normalize_rows
npattn.warmup(dtypes=("float64",), backward=False, serving=False)
print(len(gelu_kernel.signatures), len(normalize_rows.signatures))
npattn.warmup(dtypes=("float32",), backward=False, serving=False)
print(len(gelu_kernel.signatures), len(normalize_rows.signatures))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "0", "1", "1"], result.stdout


def test_the_fitting_tool_makes_the_kernels_coefficients():
    """``python -m npattn.tools.fit_normal_cdf`` fits the polynomial the kernel holds (to a
    least-squares solve's rounding) with the error its docstring states. Compared by value
    over the fit's interval, not by coefficient: the conversion from the Chebyshev basis is
    ill-conditioned, and the coefficients of degree 12 and up came out 7e-6 apart (relative)
    on an AVX-512 Zen 4 from those fitted on a Zen 3, while the polynomials' values agreed to
    1e-15, four orders below the fit's own error."""
    from numpy.polynomial import polynomial

    from npattn.cpu import activations
    from npattn.tools import fit_normal_cdf

    coefficients, error = fit_normal_cdf.fit()
    s = np.linspace(-1.0, 1.0, 100001)
    kernels = polynomial.polyval(s, np.asarray(activations._H))
    assert np.abs(polynomial.polyval(s, coefficients) / kernels - 1).max() < 1e-13
    assert error < 9e-12
    assert (fit_normal_cdf.Z_HIGH, fit_normal_cdf.T_LOW) == (activations._Z_HIGH, activations._T_LOW)
