"""The analytic backward against float64 central finite differences.

A random dot-product test (HIPS/autograd's check_vjp): for a random cotangent
``dout`` and a random direction ``u`` over every differentiable input
(q, k, v, bias, sink_logits), the vjp must satisfy
``sum_x <grad_x, u_x> == d/dt sum(out(x + t u) * dout)`` at t = 0.
"""
import numpy as np
import pytest
from hypothesis import assume, given

from conftest import NUMPY_BACKENDS
from strategies import cases
from tolerances import bound
import npattn

EPS = np.finfo(np.float64).eps
# Central differences with step h have truncation error ~ h^2 |f'''| / 6 and rounding
# error ~ eps |f| / h; h = eps^(1/3) balances them at ~ eps^(2/3) ~ 4e-11 relative.
STEP = EPS ** (1 / 3)
# The exponentials of the softmax make |f'''| up to a few hundred times |f'| on these
# problems, so the check allows RELATIVE_TOLERANCE of the quantities' scale.
RELATIVE_TOLERANCE = 1e4 * EPS ** (2 / 3)

pytestmark = pytest.mark.parametrize("backend", NUMPY_BACKENDS)


def differentiable_inputs(case):
    inputs = {"q": case.q, "k": case.k, "v": case.v}
    for name in ("bias", "sink_logits"):
        if name in case.options:
            inputs[name] = np.asarray(case.options[name], dtype=np.float64)
    return inputs


@given(case=cases())
def test_vjp_matches_finite_differences(backend, case):
    inputs = differentiable_inputs(case)
    options = {k: v for k, v in case.options.items() if k not in inputs}
    rng = np.random.default_rng(0)
    out, vjp = npattn.attention_vjp(**inputs, **options, backend=backend)
    dout = rng.normal(size=out.shape)
    grads = dict(zip(inputs, vjp(dout)))
    assert len(grads) == len(inputs) == len(vjp(dout))
    for name, grad in grads.items():
        assert grad.shape == inputs[name].shape and grad.dtype == inputs[name].dtype, name
    direction = {name: rng.normal(size=x.shape) for name, x in inputs.items()}

    def objective(t):
        moved = {name: x + t * direction[name] for name, x in inputs.items()}
        return float(np.sum(npattn.attention(**moved, **options, backend=backend) * dout))

    numeric = (objective(STEP) - objective(-STEP)) / (2 * STEP)
    analytic = sum(float(np.sum(np.where(np.isfinite(grads[n]), grads[n], 0) * direction[n])) for n in inputs)
    scale = 1.0 + abs(analytic) + sum(float(np.abs(g).sum()) for g in grads.values())
    assert abs(numeric - analytic) <= RELATIVE_TOLERANCE * scale, (numeric, analytic)


@given(case=cases(options=("bias",)))
def test_dbias_sums_over_broadcast_dimensions(backend, case):
    """A broadcast bias's gradient is the full gradient summed over the broadcast axes."""
    assume("bias" in case.options)
    bias = case.options["bias"]
    full = np.broadcast_to(bias, case.dims.scores_shape).copy()
    out, vjp = case.vjp(backend)
    _, vjp_full = case.vjp(backend, bias=full)
    dout = np.random.default_rng(2).normal(size=out.shape)
    dbias, dbias_full = vjp(dout)[3], vjp_full(dout)[3]
    padded = (1,) * (4 - bias.ndim) + bias.shape
    axes = tuple(a for a, s in enumerate(padded) if s == 1)
    summed_terms = int(np.prod(case.dims.scores_shape)) // max(1, bias.size)
    np.testing.assert_allclose(dbias, dbias_full.sum(axis=axes, keepdims=True).reshape(bias.shape), rtol=0,
                               atol=bound(np.float64, summed_terms, 1 + np.abs(dbias_full).max(initial=0)))
