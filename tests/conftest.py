"""Hypothesis profiles and the backend parametrization every equivalence test shares.

Profiles: "ci" (the default; fast, derandomized so CI is reproducible) and "dev"
(many more examples): ``pytest --hypothesis-profile=dev`` or
``NPATTN_HYPOTHESIS_PROFILE=dev pytest``.
"""
import os

import pytest
from hypothesis import HealthCheck, settings

import npattn

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=100, derandomize=True, print_blob=True, **_COMMON)
settings.register_profile("dev", max_examples=1000, **_COMMON)
settings.load_profile(os.environ.get("NPATTN_HYPOTHESIS_PROFILE", "ci"))

_STATUS = npattn.backends()


def backend_params(names=None):
    """pytest params for backends, each skipped with its reason where it cannot run here.
    A new backend is held to every parametrized property by being registered in npattn."""
    names = list(_STATUS) if names is None else names
    return [pytest.param(name, id=name,
                         marks=pytest.mark.skipif(not _STATUS[name], reason=f"{name}: {_STATUS[name].reason}"))
            for name in names]


# Backends that take NumPy arrays; the gpu backend gets its own CuPy-converting tests.
NUMPY_BACKENDS = backend_params(["reference", "cpu"])
# Backends held against the reference (the reference itself is compared with the loop oracle).
KERNEL_BACKENDS = backend_params(["cpu"])
