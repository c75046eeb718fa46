"""layer_norm and rms_norm on the CPU backend's row kernel (npattn.cpu.normalization)
against float64, and the autograd's use of it for float32 NumPy arrays."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

pytest.importorskip("numba")

from npattn import autograd as ag  # noqa: E402
from npattn.cpu import normalization  # noqa: E402
from npattn.cpu.normalization import normalize  # noqa: E402

EPS32 = float(np.finfo(np.float32).eps)


def _float64_normalize(x, weight, bias, eps, center):
    wide = x.astype(np.float64)
    mean = wide.mean(axis=-1, keepdims=True) if center else 0.0
    inverse = 1.0 / np.sqrt(((wide - mean) ** 2).mean(axis=-1, keepdims=True) + eps)
    normalized = (wide - mean) * inverse
    w = 1.0 if weight is None else weight.astype(np.float64)
    b = 0.0 if bias is None else bias.astype(np.float64)
    return normalized * w + b, normalized, inverse, np.abs(normalized * w) + np.abs(b)


def _assert_close(got, exact, scale):
    """Rounded once from float64 sums: half an ulp, plus float64's error of the row's sums
    (features * 1e-16 relative to the row's scale), allowed as 2 eps of ``scale``, and
    float32's subnormal step where the value is below its normal range."""
    assert got.dtype == np.float32 and got.shape == exact.shape
    assert np.all(np.abs(got.astype(np.float64) - exact) <= 2 * EPS32 * scale + 2.0 ** -149)


@given(st.data(), st.booleans(), st.booleans(), st.booleans(), st.sampled_from([1e-12, 1e-5, 0.1]))
def test_the_row_kernel_is_float64s_normalization_rounded_once(data, center, has_weight, has_bias, eps):
    shape = data.draw(hnp.array_shapes(min_dims=1, max_dims=3, max_side=12))
    offset = data.draw(st.sampled_from([0.0, 1e3]))  # a large mean: float64 sums keep the deviations
    x = data.draw(hnp.arrays(np.float32, shape, elements=st.floats(-100, 100, width=32))) + np.float32(offset)
    features = shape[-1]
    parameter = hnp.arrays(np.float32, (features,), elements=st.floats(-3, 3, width=32))
    weight = data.draw(parameter) if has_weight else None
    bias = data.draw(parameter) if has_bias else None
    out, normalized, inverse_std = normalize(x, weight, bias, eps, center, keep=True)
    exact, exact_normalized, exact_inverse, scale = _float64_normalize(x, weight, bias, eps, center)
    _assert_close(out, exact, scale)
    _assert_close(normalized, exact_normalized, np.abs(exact_normalized))
    _assert_close(inverse_std, exact_inverse, exact_inverse)
    plain, none, nothing = normalize(x, weight, bias, eps, center, keep=False)
    assert none is None and nothing is None and np.array_equal(plain, out)  # the same bits either way


def test_non_finite_rows_stay_in_their_rows_and_inputs_are_untouched():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    x[1, 2] = np.nan
    x[2, 0] = np.inf
    kept = x.copy()
    out, _, _ = normalize(x.T.T, None, None, 1e-5, True, keep=False)
    assert np.isfinite(out[0]).all() and np.isnan(out[1]).all() and np.isnan(out[2]).all()
    assert np.array_equal(x, kept, equal_nan=True)
    strided = np.asfortranarray(np.random.default_rng(0).standard_normal((5, 6)).astype(np.float32))
    assert np.array_equal(normalize(strided, None, None, 1e-5, True, keep=False)[0],
                          normalize(np.ascontiguousarray(strided), None, None, 1e-5, True, keep=False)[0])


@pytest.mark.parametrize("center", [True, False])
def test_the_autograds_float32_norms_take_the_kernel_and_their_gradients_match_float64(center, monkeypatch):
    """float32 NumPy data takes the kernel, with and without recording (the same bits);
    the backward, which reads the kernel's normalized rows and inverse deviations, matches
    the float64 node's gradients."""
    rng = np.random.default_rng(1)
    data = rng.standard_normal((3, 5, 16)).astype(np.float32) * 4 + 2
    w, b = rng.standard_normal(16).astype(np.float32), rng.standard_normal(16).astype(np.float32)
    dout = rng.standard_normal(data.shape).astype(np.float32)

    def run(dtype, record=True):
        x = ag.Tensor(data.astype(dtype), requires_grad=record)
        weight = ag.Tensor(w.astype(dtype), requires_grad=record)
        bias = ag.Tensor(b.astype(dtype), requires_grad=record)
        y = ag.layer_norm(x, weight, bias, eps=1e-5) if center else ag.rms_norm(x, weight, eps=1e-6)
        if record:
            y.backward(dout.astype(dtype))
            return y.data, x.grad, weight.grad, (bias.grad if center else None)
        return y.data

    calls = []
    kernel = normalization.normalize
    monkeypatch.setattr(normalization, "normalize", lambda *a, **k: calls.append(a[0].dtype) or kernel(*a, **k))
    exact = run(np.float64)
    got = run(np.float32)
    assert calls == [np.float32]  # (float64 data keeps NumPy's form)
    assert run(np.float32, record=False).tobytes() == got[0].tobytes() and len(calls) == 2
    for value, reference in zip(got, exact):
        if reference is not None:
            assert value.dtype == np.float32
            # the backward's float32 NumPy sums over a row's features: features * eps each
            # way, twice over (the row's two sums), of the largest gradient
            assert np.abs(value - reference).max() <= 4 * data.shape[-1] * EPS32 * np.abs(reference).max()
