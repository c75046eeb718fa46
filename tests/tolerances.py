"""Error bounds derived from the dtypes' precision, never magic constants.

A backend result of dtype ``out_dtype`` computed with ``accumulate`` precision
may differ from the float64 reference by the rounding of the result itself
(half an ulp of ``out_dtype`` relative to the values' magnitude) plus the
accumulated rounding of a dot product or sum of ``length`` terms, bounded by
``length * eps(accumulate)`` relative to the terms' magnitude (the standard
worst-case bound for recursive summation, gamma_n ~ n * eps). ``SAFETY``
covers the few extra roundings per term (the exp, the rescale of the online
softmax) that the bound does not count.
"""
import ml_dtypes  # noqa: F401  (registers bfloat16, which the tests name as a string)
import numpy as np

# the formula users get from npattn.testing, so the project's tests and theirs hold kernels
# to one bound
from npattn.testing.checks import SAFETY, accumulate_dtype, bound, finfo  # noqa: F401


def assert_close(actual, expected, dtype, length, magnitude=1.0, what="result"):
    """Compare with :func:`bound`; -inf must sit in the same places in both."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert not np.isnan(actual).any(), f"{what} has NaN"
    np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected), err_msg=f"{what}: -inf positions")
    finite = np.isfinite(expected)
    tolerance = bound(dtype, length, magnitude)
    assert np.isfinite(tolerance), f"{what}: the tolerance must be finite, got {tolerance} (magnitude {magnitude})"
    np.testing.assert_allclose(actual[finite], expected[finite], rtol=0, atol=tolerance,
                               err_msg=f"{what} (dtype {np.dtype(dtype)}, tolerance {tolerance:.3g})")


def score_magnitude(case):
    """A bound on |scale * q.k|: a score's rounding error, and so the relative error of its
    probability, grows with it."""
    scale = case.options.get("scale", 1 / np.sqrt(case.dims.head_dim))
    return float(scale) * case.dims.head_dim * float(np.abs(case.q).max(initial=1)) * float(np.abs(case.k).max(initial=1))


def output_magnitude(case):
    """Size of the values a row of the output averages."""
    return float(np.abs(case.v).max(initial=1.0))


def gradient_magnitude(case, dout):
    """Size of the terms summed into a gradient: |dout| |v| and scaled |q| |k| products."""
    return float(np.abs(dout).max(initial=1)) * float(np.abs(case.v).max(initial=1)) * (1 + score_magnitude(case))


def output_bound_terms(case):
    """``(length, magnitude)`` of :func:`bound` for a forward's ``out``: a sum over the keys
    after a dot product over D, of values of the size of v, amplified by the scores'
    rounding and by dropout's 1 / (1 - p)."""
    d = case.dims
    magnitude = output_magnitude(case) * (1 + score_magnitude(case)) / (1 - case.options.get("dropout_p", 0))
    return d.kv_len + d.head_dim, magnitude


def gradient_bound_terms(case, dout):
    """``(length, magnitude)`` of :func:`bound` for the gradients: sums over the query rows of
    a group, the keys and both head dimensions, of :func:`gradient_magnitude`'s terms
    (times dropout's 1 / (1 - p)), and up to Sq of them add into one dk or dv element."""
    d = case.dims
    length = d.q_len * d.group + d.kv_len + d.head_dim + d.value_dim
    magnitude = gradient_magnitude(case, dout) / (1 - case.options.get("dropout_p", 0))
    return length, magnitude * max(1, d.q_len)


def attention_bounds(dtype, q, k, v, keys, scale=None, bias=None):
    """``(out, lse)`` tolerances of an attention result in ``dtype`` over ``keys`` keys of
    ``k`` and ``v`` (any layout, the head dim last): :func:`bound` over keys + D terms, of the
    values' size for out, amplified by the largest score |scale| D max|q| max|k| (whose
    rounding moves every probability; plus max|bias| where an additive bias joins it), and
    of that score's size for lse."""
    dim = np.shape(q)[-1]
    scale = 1 / np.sqrt(dim) if scale is None else abs(scale)
    score = float(scale * dim * np.abs(q).max(initial=1) * np.abs(k).max(initial=1))
    if bias is not None:
        score += float(np.abs(bias).max(initial=0))
    return (bound(dtype, keys + dim, float(np.abs(v).max(initial=1)) * (1 + score)),
            bound(accumulate_dtype(dtype), keys + dim, 1 + score))
