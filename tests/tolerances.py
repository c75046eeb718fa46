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
import ml_dtypes
import numpy as np

SAFETY = 4


def finfo(dtype):
    """np.finfo, extended to bfloat16 (ml_dtypes' NumPy dtype, which np.finfo refuses)."""
    dtype = np.dtype(dtype)
    return ml_dtypes.finfo(dtype) if dtype.name == "bfloat16" else np.finfo(dtype)


def accumulate_dtype(dtype):
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def bound(dtype, length, magnitude=1.0):
    """Absolute error bound for a result of ``dtype`` summing ``length`` terms of size ``magnitude``."""
    dtype = np.dtype(dtype)
    rounding = 0.5 * float(finfo(dtype).eps)
    accumulation = max(length, 1) * np.finfo(accumulate_dtype(dtype)).eps
    return SAFETY * magnitude * (rounding + accumulation)


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
