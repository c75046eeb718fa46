"""The oracle's answers for a :class:`~npattn.testing.Problem` and the checks against them.

The bound (``rule="bound"``, the default) is the one npattn's own tests hold every backend
to: a result computed in ``dtype`` (accumulating in float32, or float64 for float64) may
differ from the float64 answer by the rounding of the result (half an ulp of ``dtype``)
plus the accumulated rounding of its sums, ``n * eps`` of the accumulation dtype over their
``n`` terms, relative to the terms' size; a score's own rounding scales with the largest
possible score ``|scale| * D * max|q| * max|k|``, which is why the bound grows with it:

    bound = 4 * M * (eps(dtype) / 2 + n * eps(accumulate))

with, for ``out``, ``n = Sk + D`` and ``M = max|v| * (1 + max score) / (1 - dropout_p)``,
and for the gradients the sums over the query rows of a group, the keys and both head
dims of ``max|dout| * max|v| * (1 + max score)``-sized terms. The factor 4 covers the few
roundings per term the sum does not count (the exp, the online softmax's rescales).

``rule="low_precision_reference"`` is FlashAttention's test rule instead: the error may be
at most ``factor`` times that of the same attention done in the low dtype (inputs and
probabilities rounded to ``dtype``, sums in float32), plus a few ulps of the output.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import api
from ..core.dropout import keep_mask
from .problems import Problem

SAFETY = 4


def finfo(dtype):
    """np.finfo, extended to bfloat16 (ml_dtypes' NumPy dtype, which np.finfo refuses)."""
    dtype = np.dtype(dtype)
    if dtype.name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.finfo(dtype)
    return np.finfo(dtype)


def accumulate_dtype(dtype) -> np.dtype:
    """The dtype a kernel computing in ``dtype`` sums in: float64 for float64, else float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def _bhsd(problem: Problem, array):
    return array if problem.layout == "bhsd" else array.transpose(0, 2, 1, 3)


def reference(problem: Problem) -> Any:
    """The float64 answer of ``npattn.attention(q, k, v, layout=..., **options)``: ``out`` in
    the problem's layout, or ``(out, lse)`` with ``return_lse``."""
    q, k, v = problem.arrays(np.float64)
    return api.attention(q, k, v, layout=problem.layout, backend="reference", **problem.options)


def reference_gradients(problem: Problem, dout) -> tuple[np.ndarray, ...]:
    """The float64 ``(dq, dk, dv)`` of ``sum(out * dout)`` (then ``dbias`` and
    ``dsink_logits`` where the problem has them), in the problem's layout."""
    q, k, v = problem.arrays(np.float64)
    outputs, vjp = api.attention_vjp(q, k, v, layout=problem.layout, backend="reference", **problem.options)
    return tuple(vjp(np.asarray(dout, np.float64)))


def _score_magnitude(problem: Problem) -> float:
    """A bound on |score|: |scale| * D * max|q| * max|k| (with softcap, at most softcap)."""
    _, _, _, _, _, dim, _ = problem.shape
    scale = problem.options.get("scale")
    scale = 1 / np.sqrt(dim) if scale is None else abs(float(scale))
    largest = scale * dim * _largest(problem.q) * _largest(problem.k)
    softcap = problem.options.get("softcap")
    return min(largest, float(softcap)) if softcap else largest


def _largest(array) -> float:
    return float(np.abs(np.asarray(array, np.float64)).max(initial=1.0))


def bound(dtype, length: int, magnitude: float = 1.0) -> float:
    """The absolute error of a result of ``dtype`` summing ``length`` terms of size
    ``magnitude`` (see the module's doc): the one formula behind every bound here, and
    behind npattn's own tests."""
    dtype = np.dtype(dtype)
    rounding = 0.5 * float(finfo(dtype).eps)
    accumulation = max(length, 1) * float(np.finfo(accumulate_dtype(dtype)).eps)
    return SAFETY * magnitude * (rounding + accumulation)


def _keep_scale(problem: Problem) -> float:
    return 1.0 / (1.0 - float(problem.options.get("dropout_p", 0.0) or 0.0))


def error_bound(problem: Problem, dtype=None) -> float:
    """The absolute error a correct kernel computing ``problem`` in ``dtype`` (default: the
    problem's) may make in any element of ``out`` (see the module's doc)."""
    _, _, _, _, kv_len, dim, _ = problem.shape
    magnitude = _largest(problem.v) * (1 + _score_magnitude(problem)) * _keep_scale(problem)
    return bound(dtype or problem.dtype, kv_len + dim, magnitude)


def _lse_bound(problem: Problem, dtype) -> float:
    _, _, _, _, kv_len, dim, _ = problem.shape
    return bound(accumulate_dtype(dtype), kv_len + dim, 1 + _score_magnitude(problem)) + float(
        finfo(dtype).eps) * (1 + _score_magnitude(problem))


def gradient_error_bound(problem: Problem, dout, dtype=None) -> float:
    """:func:`error_bound` for the gradients of ``sum(out * dout)``."""
    _, heads, kv_heads, q_len, kv_len, dim, value_dim = problem.shape
    magnitude = _largest(dout) * _largest(problem.v) * (1 + _score_magnitude(problem)) * _keep_scale(problem)
    length = q_len * (heads // kv_heads) + kv_len + dim + value_dim
    return bound(dtype or problem.dtype, length, magnitude * max(1, q_len))


def dropout_keep(problem: Problem) -> np.ndarray:
    """The keep mask (B, H, Sq, Sk) bool of the problem's dropout (all True without):
    npattn's counter-based hash of ``(seed, b, h, i, j)``, for a kernel to apply as
    ``P * keep / (1 - dropout_p)`` after the softmax."""
    batch, heads, _, q_len, kv_len, _, _ = problem.shape
    p = float(problem.options.get("dropout_p", 0.0) or 0.0)
    if not p:
        return np.ones((batch, heads, q_len, kv_len), bool)
    return keep_mask(np, int(problem.options["seed"]), p, batch, heads, q_len, kv_len,
                     problem.options.get("dropout_offset", (0, 0, 0, 0)))


def assert_attention_close(actual, problem: Problem, *, dtype=None, rule: str = "bound",
                           factor: float = 2.0) -> None:
    """Raise AssertionError unless ``actual`` (``out`` in the problem's layout, or
    ``(out, lse)`` when the problem has ``return_lse``; any array kind NumPy can read) is
    the float64 answer within the rule's tolerance for a kernel computing in ``dtype``
    (default: the problem's dtype). ``rule``: "bound" (:func:`error_bound`) or
    "low_precision_reference" (within ``factor`` times the low-dtype attention's error).
    NaN where the answer is finite always fails; so do shape mismatches."""
    dtype = np.dtype(dtype or problem.dtype)
    expected = reference(problem)
    if problem.options.get("return_lse"):
        if not (isinstance(actual, tuple) and len(actual) == 2):
            raise AssertionError(f"the problem has return_lse: expected (out, lse), got {type(actual).__name__}; "
                                 f"{problem!r}")
        out, lse = actual
        expected_out, expected_lse = expected
        _compare(_as_float64(lse), expected_lse, _lse_bound(problem, dtype), "lse", problem)
    else:
        out, expected_out = actual, expected
    out = _as_float64(out)
    if rule == "bound":
        tolerance = error_bound(problem, dtype)
    elif rule == "low_precision_reference":
        low = _low_precision_out(problem, dtype)
        tolerance = factor * float(np.abs(low - expected_out).max(initial=0.0)) + 4 * float(
            finfo(dtype).eps) * _largest(problem.v)
    else:
        raise ValueError(f'rule must be "bound" or "low_precision_reference", got {rule!r}')
    _compare(out, expected_out, tolerance, "out", problem)


def assert_attention_grads_close(dq, dk, dv, problem: Problem, dout, *, dtype=None) -> None:
    """Raise AssertionError unless ``dq``, ``dk``, ``dv`` (in the problem's layout) are the
    float64 gradients of ``sum(out * dout)`` within :func:`gradient_error_bound`."""
    dtype = np.dtype(dtype or problem.dtype)
    expected = reference_gradients(problem, dout)
    tolerance = gradient_error_bound(problem, dout, dtype)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), expected):
        _compare(_as_float64(got), want, tolerance, name, problem)


def _as_float64(array) -> np.ndarray:
    if hasattr(array, "get") and type(array).__module__.startswith("cupy"):
        array = array.get()
    elif hasattr(array, "detach"):  # a torch tensor
        array = array.detach().cpu().float().numpy() if str(array.dtype) == "torch.bfloat16" else \
            array.detach().cpu().numpy()
    return np.asarray(array).astype(np.float64)


def _compare(actual: np.ndarray, expected: np.ndarray, tolerance: float, what: str, problem: Problem) -> None:
    if actual.shape != expected.shape:
        raise AssertionError(f"{what} has shape {actual.shape}, expected {expected.shape}; {problem!r}")
    same_special = (np.isnan(actual) == np.isnan(expected)) & (np.isinf(actual) == np.isinf(expected))
    finite = np.isfinite(expected) & np.isfinite(actual)
    with np.errstate(invalid="ignore"):
        error = np.where(finite, np.abs(actual - expected), 0.0)
        wrong = ~same_special | (error > tolerance) | (np.isinf(expected) & (actual != expected))
    if wrong.any():
        index = tuple(int(i) for i in np.argwhere(wrong)[0])
        raise AssertionError(
            f"{what}{list(index)} = {actual[index]!r}, expected {expected[index]!r} (float64 reference); "
            f"{int(wrong.sum())} of {wrong.size} elements off, largest finite error "
            f"{float(error.max(initial=0.0)):.3g} against a tolerance of {tolerance:.3g}; {problem!r}")


def _low_precision_out(problem: Problem, dtype) -> np.ndarray:
    """``out`` of the same attention done in ``dtype``: q, k, v and the probabilities
    rounded to it, the products summed in float32 (float64 for float64), the result
    rounded to it. Without dropout only."""
    if problem.options.get("dropout_p"):
        raise ValueError('rule="low_precision_reference" takes problems without dropout')
    q, k, v = problem.arrays(dtype)
    options = {name: value for name, value in problem.options.items() if name != "return_lse"}
    probabilities = api.attention(*(x.astype(np.float64) for x in (q, k, v)), layout=problem.layout,
                                  backend="reference", return_weights=True, **options)[1]  # (B, H, Sq, Sk)
    accumulate = accumulate_dtype(dtype)
    rounded = probabilities.astype(dtype).astype(accumulate)
    values = _bhsd(problem, v).astype(accumulate)
    group = rounded.shape[1] // values.shape[1]
    out = rounded @ np.repeat(values, group, axis=1)  # (B, H, Sq, Dv)
    return _bhsd(problem, out.astype(dtype).astype(np.float64))
