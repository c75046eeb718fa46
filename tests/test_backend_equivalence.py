"""Kernel backends against the float64 reference: every option, dtype and layout, forward and backward.

The reference runs on the same values upcast to float64, so the difference is the kernel's
own rounding, bounded as in :mod:`tolerances` with the magnitudes the scores reach.
"""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import KERNEL_BACKENDS
from strategies import cases, layouts
from tolerances import assert_close, gradient_bound_terms, output_bound_terms, score_magnitude

pytestmark = pytest.mark.parametrize("backend", KERNEL_BACKENDS)


def upcast(case):
    return type(case)(case.dims, *(x.astype(np.float64) for x in (case.q, case.k, case.v)), case.options)


@given(case=cases(dtypes=("float32", "float64")), layout=layouts)
def test_forward_matches_the_reference(backend, case, layout):
    check_forward(backend, case, layout)


@given(case=cases(dtypes=("float32", "float64")), layout=layouts)
def test_backward_matches_the_reference(backend, case, layout):
    check_backward(backend, case, layout)


def check_forward(backend, case, layout):
    """out, lse and weights of ``backend`` against the float64 reference."""
    out, lse, weights = case.run(backend, layout=layout, return_lse=True, return_weights=True)
    exact_out, exact_lse, exact_weights = upcast(case).run("reference", layout=layout, return_lse=True,
                                                           return_weights=True)
    d, amplification = case.dims, 1 + score_magnitude(case)
    assert out.dtype == case.dtype and weights.dtype == case.dtype
    assert_close(out, exact_out, case.dtype, *output_bound_terms(case), "out")
    assert_close(lse, exact_lse, case.dtype, d.kv_len + d.head_dim, amplification + np.abs(
        exact_lse[np.isfinite(exact_lse)]).max(initial=0), "lse")
    assert_close(weights, exact_weights, case.dtype, d.kv_len + d.head_dim, amplification, "weights")


def check_backward(backend, case, layout):
    """Every gradient of ``backend`` against the float64 reference's."""
    out, vjp = case.vjp(backend, layout=layout)
    dout = np.random.default_rng(0).normal(size=out.shape).astype(case.dtype)
    grads = vjp(dout)
    exact = upcast(case).vjp("reference", layout=layout)[1](dout.astype(np.float64))
    names = ["dq", "dk", "dv"] + ["d" + n for n in ("bias", "sink_logits") if n in case.options]
    assert len(grads) == len(exact) == len(names)
    for name, grad, expected in zip(names, grads, exact):
        assert_close(grad, expected, case.dtype, *gradient_bound_terms(case, dout), name)


@st.composite
def peaked_cases(draw, dtypes=("float16", "float32")):
    """Cases at scales of 1e4-1e5, where most rows' softmax is one key to within rounding.
    Not float64: the float64 reference's own cancellation (about 1e-16 |dO| |v| times the
    scale) is then the size of the bound."""
    case = draw(cases(options=("causal", "mask", "bias", "kv_lengths", "dropout", "sink_logits"),
                      dtypes=dtypes))
    return case.with_options(scale=draw(st.sampled_from([1e4, 3e4, 1e5])))


@given(case=peaked_cases(), layout=layouts)
def test_backward_of_nearly_one_hot_rows_matches_the_reference(backend, case, layout):
    check_peaked_backward(backend, case, layout)


def check_peaked_backward(backend, case, layout):
    """Where a row's softmax is one key to within the accumulation's rounding, the gradients
    are tiny and well determined, and the usual bound (which grows with the scores'
    magnitude, here 1e4-1e5 times larger) would hide a cancellation: the bound counts the
    scores' amplification only in proportion to how far the peakiest row is from one-hot
    (1 - max P, in units of the accumulation's eps, at most 1), for dq and dk. dv sums
    P~ dO, so it carries P's own rounding, which grows with the scores' magnitude (a
    recomputed P = exp(s - lse) is off by about eps |s| relative): it keeps the usual bound."""
    out, vjp = case.vjp(backend, layout=layout)
    dout = np.random.default_rng(0).normal(size=out.shape).astype(case.dtype)
    grads = vjp(dout)
    exact_case = upcast(case)
    exact = exact_case.vjp("reference", layout=layout)[1](dout.astype(np.float64))
    weights = exact_case.without("dropout_p", "seed").run("reference", layout=layout, return_weights=True)[1]
    weights = weights.transpose(0, 2, 1, 3) if layout == "bshd" else weights
    # rows that see a key (a fully masked row has no softmax to be peaked); a row whose
    # sink logit takes most of the mass is not one-hot in any key, and counts as spread
    live = weights.sum(axis=-1) > 0
    spread = float((1 - weights.max(axis=-1))[live].max(initial=0.0))
    eps = float(np.finfo(np.float32).eps)
    amplification = 1 + score_magnitude(case) * min(1.0, spread / eps)
    length, usual = gradient_bound_terms(case, dout)
    magnitude = (float(np.abs(dout).max(initial=1) * np.abs(case.v).max(initial=1)) * amplification
                 / (1 - case.options.get("dropout_p", 0)) * max(1, case.dims.q_len))
    for name, grad, expected in zip(("dq", "dk", "dv"), grads, exact):
        assert_close(grad, expected, case.dtype, length, usual if name == "dv" else magnitude, name)
