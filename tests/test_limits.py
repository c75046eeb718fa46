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


@pytest.mark.parametrize("free, fails", [(limits.CHECKED_FROM_BYTES - 1, True), (limits.CHECKED_FROM_BYTES, False)])
def test_the_bound_is_the_weights_bytes(monkeypatch, free, fails):
    monkeypatch.setattr(limits, "free_bytes", lambda array: free)
    q = np.ones((1, 1, 2048, 2), np.float32)  # float32 weights of 2048 x 2048: 16 MiB, the least checked
    if fails:
        with pytest.raises(MemoryError,
                           match=r"return_weights=True needs 16\.0 MiB .* and 16\.0 MiB of memory is free"):
            npattn.attention(q, q, q, return_weights=True, backend="cpu")
    else:
        _, weights = npattn.attention(q, q, q, return_weights=True, backend="cpu")
        assert weights.shape == (1, 1, 2048, 2048)


def test_a_bound_under_the_floor_reads_no_free_memory(monkeypatch):
    monkeypatch.setattr(limits, "free_bytes", lambda array: pytest.fail("read the free memory"))
    q = np.ones((1, 1, 2047, 2), np.float32)  # (16 MiB less 16 KiB of weights)
    _, weights = npattn.attention(q, q, q, return_weights=True, backend="cpu")
    assert weights.shape == (1, 1, 2047, 2047)


def test_small_weights_are_planned_and_large_ones_checked_at_every_call(monkeypatch):
    """A structure whose weights are under the floor is planned like any other (its third
    call builds no problem); one whose weights are checked reads the free memory at every
    call, so memory freed or taken between calls counts."""
    from npattn import api
    from npattn.runtime import plans

    plans.clear()
    built, reads = [], []
    build = api.build_problem
    monkeypatch.setattr(api, "build_problem", lambda *a, **k: built.append(1) or build(*a, **k))
    monkeypatch.setattr(limits, "free_bytes", lambda array: reads.append(1) or 64 * GIB)
    small = np.random.default_rng(0).standard_normal((1, 2, 16, 8), dtype=np.float32)
    results = [npattn.attention(small, small, small, causal=True, return_weights=True) for _ in range(3)]
    assert (len(built), len(reads)) == (2, 0)
    for planned, full in zip(results[2], results[0]):  # the plan's out and weights are the full path's bits
        np.testing.assert_array_equal(planned, full)
    large = np.ones((1, 1, 2048, 2), np.float32)
    for _ in range(3):
        npattn.attention(large, large, large, return_weights=True)
    assert (len(built), len(reads)) == (5, 3)


def test_an_unknown_amount_of_memory_checks_nothing(monkeypatch):
    monkeypatch.setattr(limits, "free_bytes", lambda array: None)
    q = np.ones((1, 1, 4, 2), np.float32)
    npattn.attention(q, q, q, return_weights=True, backend="reference")


def test_free_bytes_reads_this_machine():
    free = limits.free_bytes(np.zeros(1))
    assert free is None or free > 0


def test_a_non_finite_result_too_large_for_the_reference_says_why(monkeypatch):
    monkeypatch.setattr(limits, "free_bytes", lambda array: 1000)
    q = np.ones((1, 1, 1000, 2), np.float32)
    v = q.copy()
    v[0, 0, 3, 1] = np.nan
    npattn.attention(q, q, q, backend="cpu")  # finite: the kernels' answer, no reference, no check
    with pytest.raises(MemoryError, match=r"the result holds NaN or inf .* backend='reference' needs 22\.9 MiB"):
        npattn.attention(q, q, v, backend="cpu")
