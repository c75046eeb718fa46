"""gradcheck: a function's gradients against float64 central finite differences.

The test is HIPS/autograd's ``check_vjp``: for a random cotangent ``w`` of the output
and, per input, a random direction ``u``, the backward pass gives ``<w, J u>`` as
``<grad, u>``, and the forward alone gives it as
``(<w, f(x + step u)> - <w, f(x - step u)>) / (2 step)``. One backward pass and two
forward passes per input check the whole Jacobian along a random direction, which a
wrong gradient fails with probability 1.
"""
from __future__ import annotations

import numpy as np

from .tensor import Tensor, no_grad


class GradcheckError(AssertionError):
    """A gradient disagreed with its finite-difference estimate."""


_EPS = float(np.finfo(np.float64).eps)
# The step that balances a central difference's truncation error (~ step**2) against its
# rounding error (~ eps / step): the cube root of float64's unit roundoff, 6.1e-6.
STEP = _EPS ** (1 / 3)
# How many roundings of eps a forward pass may compound into <w, f(x)>, relative to the
# size of its terms sum |w f(x)|: a sum of n terms compounds up to n; the functions
# checked here chain a few sums of up to a few hundred terms.
FORWARD_ROUNDINGS = 2 ** 12


def gradcheck(fn, inputs, *, step: float = STEP, atol: float | None = None, rtol: float | None = None,
              trials: int = 2, seed: int = 0) -> bool:
    """Check the gradients of ``fn(*inputs)`` with respect to every input Tensor that has
    ``requires_grad``; returns True or raises :class:`GradcheckError`.

    Args:
        fn: Tensors in, one Tensor out (any shape).
        inputs: Tensors (float64 where they require gradients) and other arguments,
            passed positionally. They are not modified: ``fn`` runs on copies.
        step: the finite-difference step along each random direction.
        atol, rtol: the allowed error of each directional derivative is
            ``atol + rtol * |estimate|``. By default both derive from float64's eps:
            ``atol`` is the rounding of the two forward passes, ``FORWARD_ROUNDINGS * eps *
            sum|w f(x)| / step``, and ``rtol`` is ``step`` (the truncation error, relative
            to the slope, of a function whose curvature scale is at least ``step``).
        trials: random (cotangent, direction) pairs per input.
    """
    checked = [i for i, x in enumerate(inputs) if isinstance(x, Tensor) and x.requires_grad]
    if not checked:
        raise ValueError("gradcheck: no input is a Tensor with requires_grad=True")
    for i in checked:
        if inputs[i].dtype != np.float64:
            raise TypeError(f"gradcheck: input {i} must be float64 for finite differences; "
                            f"got {inputs[i].dtype}")
    rng = np.random.default_rng(seed)

    def fresh(shift_index=None, shift=None):
        args = []
        for i, x in enumerate(inputs):
            if isinstance(x, Tensor):
                data = x.data.copy() if shift_index != i else x.data + shift
                x = Tensor(data, requires_grad=x.requires_grad and shift is None)
            args.append(x)
        return args

    for trial in range(trials):
        args = fresh()
        out = fn(*args)
        xp = out.xp
        cotangent = xp.asarray(rng.standard_normal(out.shape))
        magnitude = float(xp.abs(out.data * cotangent).sum())
        allowed_absolute = FORWARD_ROUNDINGS * _EPS * magnitude / step if atol is None else atol
        allowed_relative = step if rtol is None else rtol
        out.backward(cotangent)
        for i in checked:
            direction = xp.asarray(rng.standard_normal(inputs[i].shape))
            grad = args[i].grad
            analytic = 0.0 if grad is None else float((grad * direction).sum())
            with no_grad():
                plus = float((fn(*fresh(i, step * direction)).data * cotangent).sum())
                minus = float((fn(*fresh(i, -step * direction)).data * cotangent).sum())
            numeric = (plus - minus) / (2 * step)
            allowed = allowed_absolute + allowed_relative * abs(numeric)
            if not abs(analytic - numeric) <= allowed:
                raise GradcheckError(
                    f"gradcheck: input {i} (shape {tuple(inputs[i].shape)}), trial {trial}: the "
                    f"backward pass gives a directional derivative of {analytic!r}, finite "
                    f"differences {numeric!r} (difference {abs(analytic - numeric):.3g}, allowed "
                    f"{allowed:.3g})")
    return True
