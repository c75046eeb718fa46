"""Calls from several Python threads at once give the same bits as the same calls made
one after another: npattn's kernels, its worker pool and its hold on BLAS's thread count
are shared by every call in the process, and none of them may leak from one call into
another's arithmetic."""
import threading

import numpy as np
import pytest

import npattn
from npattn import cpu
from npattn.cpu import blas

pytestmark = pytest.mark.skipif(not npattn.backends()["cpu"], reason="needs the cpu backend")

_CALLERS = 4
_ROUNDS = 12


def _calls():
    """Mixed calls whose products are big enough for a multi-threaded BLAS to split."""
    rng = np.random.default_rng(7)

    def draw(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    q, k, v = draw(2, 4, 333, 128), draw(2, 4, 333, 128), draw(2, 4, 333, 128)
    gq, gk, gv = draw(1, 8, 200, 64), draw(1, 2, 260, 64), draw(1, 2, 260, 64)
    dout = draw(1, 8, 200, 64)
    sink_logits = draw(4)

    def backward():
        _, vjp = npattn.attention_vjp(gq, gk, gv, causal=True, backend="cpu")
        return vjp(dout)[:3]

    return [
        lambda: (npattn.attention(q, k, v, softcap=20.0, sink_logits=sink_logits, backend="cpu"),),
        lambda: npattn.attention(gq, gk, gv, window=40, return_lse=True, backend="cpu"),
        backward,
    ]


def _bits(results):
    return [np.asarray(r).tobytes() for r in results]


@pytest.fixture
def multithreaded_blas():
    """SciPy's BLAS on 2 threads for the test (what it picks on a 2-core machine), so a
    pin released under a running kernel would change how that kernel's products split."""
    openblas = blas._scipy_openblas()
    if openblas is None:
        pytest.skip("SciPy's BLAS is not OpenBLAS: its thread count cannot be read")
    get, set_ = openblas
    before = get()
    set_(2)
    yield get
    set_(before)


def test_concurrent_calls_give_the_bits_of_sequential_calls(multithreaded_blas):
    calls = _calls()
    with cpu.products("blas"):
        expected = [_bits(call()) for call in calls]
        mismatches, errors = [], []

        def caller(offset):
            try:
                with cpu.products("blas"):  # tuning holds per thread: each caller sets its own
                    for round_ in range(_ROUNDS):
                        index = (offset + round_) % len(calls)
                        if _bits(calls[index]()) != expected[index]:
                            mismatches.append((offset, round_, index))
            except Exception as error:  # reported below, not lost in the thread
                errors.append(error)

        threads = [threading.Thread(target=caller, args=(offset,)) for offset in range(_CALLERS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not errors, errors
    assert not mismatches, f"{len(mismatches)} of {_CALLERS * _ROUNDS} concurrent calls changed bits: {mismatches[:5]}"
    # the last call to leave hands BLAS back its own setting
    assert multithreaded_blas() == 2


def test_tuning_set_in_one_thread_does_not_reach_another():
    """tile_sizes and products hold for the thread that set them: a call from another
    thread meanwhile runs the defaults (the settings once were process-wide)."""
    from npattn.cpu import tuning

    seen, ready, done = {}, threading.Event(), threading.Event()

    def other():
        ready.wait()
        seen["other"] = tuning.current()
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with cpu.tile_sizes(8, 16, edge_band=4), cpu.products("blas"):
        ready.set()
        done.wait()
        seen["mine"] = tuning.current()
    thread.join()
    assert seen["other"] == tuning.Tuning()
    assert (seen["mine"].forward, seen["mine"].backward, seen["mine"].edge_band, seen["mine"].vector) == (
        (8, 16), (8, 16), 4, False)
    assert tuning.current() == tuning.Tuning()
