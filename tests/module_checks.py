"""Checks shared by the module tests."""
import numpy as np

from npattn.autograd import gradcheck
from tolerances import assert_close


def gradcheck_module(module, *inputs, **options):
    """gradcheck of ``module(*inputs, **options)`` with respect to the inputs that require
    gradients and every parameter (each swapped in as a plain input)."""
    owners = []
    for name, _ in module.named_parameters():
        path, _, attribute = name.rpartition(".")
        owner = dict(module.named_modules())[path]
        owners.append((owner, attribute))
    parameters = module.parameters()

    def call(*args):
        for (owner, attribute), value in zip(owners, args[len(inputs):]):
            setattr(owner, attribute, value)
        return module(*args[:len(inputs)], **options)

    try:
        assert gradcheck(call, [*inputs, *parameters])
    finally:
        for (owner, attribute), value in zip(owners, parameters):
            setattr(owner, attribute, value)


def assert_same_composition(actual, expected, length, what="result"):
    """Two float64 evaluations of one composition that differ only in summation order agree
    to the accumulated-rounding bound of ``length`` chained terms (:mod:`tolerances`), at the
    magnitude of the result (at least 1: the tests' inputs and weights are of order 1)."""
    actual = np.asarray(getattr(actual, "data", actual))
    expected = np.asarray(getattr(expected, "data", expected))
    magnitude = max(1.0, float(np.abs(expected).max(initial=0.0)))
    assert_close(actual, expected, np.float64, length, magnitude, what)
