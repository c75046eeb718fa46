"""Calls that cannot fit in memory fail before any work, naming the size and the option."""
import numpy as np
import pytest

import npattn
from npattn import cpu, reference
from npattn.runtime import limits

GIB = 1 << 30


@pytest.fixture
def machine_with_64_gib_free(monkeypatch):
    """The free memory fixed, so the outcome does not depend on the machine, and every
    backend's forward replaced by a failure: nothing may run before the check."""
    monkeypatch.setattr(limits, "free_bytes", lambda array: 64 * GIB)
    for backend in (cpu, reference):
        monkeypatch.setattr(backend, "forward", lambda problem: pytest.fail("a kernel ran before the check"))


def test_weights_too_large_for_the_machine_fail_before_any_work(machine_with_64_gib_free):
    q = np.zeros((1, 1, 200_000, 1), np.float32)
    with pytest.raises(MemoryError, match=r"return_weights=True needs 149\.0 GiB for the weights "
                                          r"\(B, H, Sq, Sk\) = \(1, 1, 200000, 200000\) in float32, and "
                                          r"64\.0 GiB of memory is free here"):
        npattn.attention(q, q, q, return_weights=True, backend="cpu")


def test_the_reference_names_its_score_arrays(machine_with_64_gib_free):
    q = np.zeros((1, 1, 200_000, 1), np.float32)
    with pytest.raises(MemoryError, match=r"backend='reference' needs 894\.1 GiB for at least 3 float64"):
        npattn.attention_vjp(q, q, q, backend="reference")


@pytest.mark.parametrize("free, fails", [(10_000 * 4 - 1, True), (10_000 * 4, False)])
def test_the_bound_is_the_weights_bytes(monkeypatch, free, fails):
    monkeypatch.setattr(limits, "free_bytes", lambda array: free)
    q = np.ones((1, 1, 100, 2), np.float32)
    if fails:
        with pytest.raises(MemoryError, match=r"return_weights=True needs 39\.1 KiB .* and 39\.1 KiB of memory is free"):
            npattn.attention(q, q, q, return_weights=True, backend="cpu")
    else:
        _, weights = npattn.attention(q, q, q, return_weights=True, backend="cpu")
        assert weights.shape == (1, 1, 100, 100)


def test_an_unknown_amount_of_memory_checks_nothing(monkeypatch):
    monkeypatch.setattr(limits, "free_bytes", lambda array: None)
    q = np.ones((1, 1, 4, 2), np.float32)
    npattn.attention(q, q, q, return_weights=True, backend="reference")


def test_free_bytes_reads_this_machine():
    free = limits.free_bytes(np.zeros(1))
    assert free is None or free > 0


def test_a_non_finite_result_too_large_for_the_reference_says_why(monkeypatch):
    monkeypatch.setattr(limits, "free_bytes", lambda array: 1000)
    q = np.ones((1, 1, 100, 2), np.float32)
    v = q.copy()
    v[0, 0, 3, 1] = np.nan
    npattn.attention(q, q, q, backend="cpu")  # finite: the kernels' answer, no reference, no check
    with pytest.raises(MemoryError, match=r"the result holds NaN or inf .* backend='reference' needs 234\.4 KiB"):
        npattn.attention(q, q, v, backend="cpu")
