"""The crew (npattn/cpu/crew.py): worker threads that watch for the next call before they
sleep. What a user relies on: a call's results do not depend on who ran its items, no
worker touches a call's arrays after the call returns, calls from several threads at once
and forked children still work, and a bad NPATTN_SPIN_US fails with its name."""
import os
import pathlib
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from numba import njit

import npattn
from npattn.cpu import crew, threads


@njit(nogil=True)
def _record_items(ran, call, counter, items):
    """Claim every item of ``counter``; mark each in ``ran`` with ``call``."""
    while True:
        item = threads.next_item(counter, items)
        if item >= items:
            break
        ran[item] = call


def test_no_worker_runs_a_call_after_it_returns(monkeypatch):
    """A post that no worker took by the time the calling thread is done with every item
    is taken back: a sleeping worker that wakes late finds nothing to run. Here the workers
    sleep at once (a one-microsecond watch) and the calling thread runs each call's two
    items before a worker is awake; each worker call is checked against its call's return."""
    monkeypatch.setenv("NPATTN_NUM_THREADS", "2")
    monkeypatch.setenv("NPATTN_SPIN_US", "1")
    log, returned = [], {}

    def kernel(ran, call, counter, items):
        log.append((int(call[0]), threading.current_thread() is threading.main_thread(), time.perf_counter()))
        _record_items(ran, call[0], counter, items)
    for call in range(60):
        time.sleep(0.002)  # (the workers are asleep before each call)
        ran = np.full(2, -1, np.int64)
        threads.run_items(kernel, (ran, np.array([call], np.int64)), 2)
        returned[call] = time.perf_counter()
        assert (ran == call).all()
    time.sleep(0.05)
    late = [(call, at - returned[call]) for call, on_caller, at in log if not on_caller and at > returned[call]]
    assert not late, f"workers ran calls after they returned: {late}"
    # and none failed on the way (a worker that woke to a post its call had finished with
    # would find no job, and leave)
    assert all(thread.is_alive() for thread in crew._CREW.threads)


def test_results_are_the_same_bits_with_the_crew_the_pool_and_one_thread(monkeypatch):
    """A threaded forward and backward give the same bits whoever runs their items."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 8, 256, 64), np.float32) for _ in range(3))
    dout = rng.standard_normal((2, 8, 256, 64), np.float32)
    results = []
    for count, spin in (("2", "200"), ("2", "0"), ("1", "200")):
        monkeypatch.setenv("NPATTN_NUM_THREADS", count)
        monkeypatch.setenv("NPATTN_SPIN_US", spin)
        out, vjp = npattn.attention_vjp(q, k, v, causal=True, backend="cpu")
        results.append([out.tobytes(), *(gradient.tobytes() for gradient in vjp(dout))])
    assert results[0] == results[1] == results[2]


def test_calls_from_several_threads_at_once_share_the_crew_and_the_pool(monkeypatch):
    """One call at a time has the crew; the others meanwhile use the pool. Every call's
    result is the one a lone call gives."""
    monkeypatch.setenv("NPATTN_NUM_THREADS", "2")
    rng = np.random.default_rng(4)
    inputs = [tuple(rng.standard_normal((1, 8, 192, 64), np.float32) for _ in range(3)) for _ in range(4)]
    expected = [npattn.attention(*arrays, backend="cpu").tobytes() for arrays in inputs]
    used = {"crew": 0, "pool": 0}
    real_run, real_submit = crew.Crew.run, threads._submit

    def crew_run(self, *arguments):
        used["crew"] += 1
        return real_run(self, *arguments)

    def submit(calls):
        used["pool"] += 1
        return real_submit(calls)
    monkeypatch.setattr(crew.Crew, "run", crew_run)
    monkeypatch.setattr(threads, "_submit", submit)
    failures = []

    def caller(index):
        try:
            for _ in range(15):
                assert npattn.attention(*inputs[index], backend="cpu").tobytes() == expected[index]
        except BaseException as error:  # (reported by the test's thread)
            failures.append(error)
    callers = [threading.Thread(target=caller, args=(index,)) for index in range(4)]
    for thread in callers:
        thread.start()
    for thread in callers:
        thread.join(120)
    assert not failures, failures
    assert used["crew"] and used["crew"] + used["pool"] == 60


def items_shared_with_a_worker() -> bool:
    """Whether a worker ran one of a threaded call's items: the calling thread waits (up to
    10 s) for another thread's claim before it claims any itself."""
    def kernel(ran, counter, items):
        caller = threading.current_thread() is threading.main_thread()
        if caller:
            deadline = time.monotonic() + 10
            while counter[threads.CLAIMED] < 1 and time.monotonic() < deadline:
                time.sleep(0.0002)
        _record_items(ran, int(caller), counter, items)
    ran = np.full(4, -1, np.int64)
    threads.run_items(kernel, (ran,), 4)
    return bool((ran == 0).any())


# In a process of its own (the test process has JAX's and torch's threads, which a fork must
# not copy): a threaded call shares its items with a worker, then so does one in a forked child.
_FORK_SCRIPT = f"""
import os, sys
sys.path.insert(0, {str(pathlib.Path(__file__).resolve().parent)!r})
from test_cpu_crew import items_shared_with_a_worker

assert items_shared_with_a_worker(), "no worker took part in the parent"
child = os.fork()
if child == 0:
    os._exit(0 if items_shared_with_a_worker() else 3)
sys.exit(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
@pytest.mark.parametrize("spin", ["200", "0"])
def test_a_forked_child_shares_its_calls_items_with_workers_of_its_own(spin):
    """A child forked after threaded calls has none of its parent's workers (threads do not
    survive a fork): its threaded calls start their own (the crew's, or the pool's), and
    share their items with them, rather than post to workers that do not exist."""
    environment = dict(os.environ, NPATTN_NUM_THREADS="2", NPATTN_SPIN_US=spin)
    result = subprocess.run([sys.executable, "-c", _FORK_SCRIPT], env=environment, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])


@pytest.mark.parametrize("value", ["-1", "fast", "1.5", "10000001"])
def test_a_bad_spin_setting_fails_the_call_with_its_name(monkeypatch, value):
    monkeypatch.setenv("NPATTN_NUM_THREADS", "2")
    monkeypatch.setenv("NPATTN_SPIN_US", value)
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((1, 8, 256, 64), np.float32) for _ in range(3))
    with pytest.raises(ValueError, match="NPATTN_SPIN_US"):
        npattn.attention(q, k, v, backend="cpu")


def test_the_watch_is_timed_in_this_cpus_polls():
    """The polls a worker's watch makes per microsecond are measured, not assumed: a
    ``pause`` takes from a few ns to over 100 ns depending on the core."""
    rate = crew._polls_per_microsecond()
    assert 0.5 < rate < 10_000


def test_a_call_interrupted_while_a_worker_works_leaves_the_next_call_a_new_crew(monkeypatch):
    """A call interrupted in its wait for a worker (Ctrl-C) leaves that worker on its job,
    on the crew's counter: the next call gets a new crew (the old one's workers leave once
    done), and its results are right."""
    monkeypatch.setenv("NPATTN_NUM_THREADS", "2")
    monkeypatch.setenv("NPATTN_SPIN_US", "200")
    monkeypatch.setattr(crew, "DONE_POLLS", 1)
    worker_in_job, release_worker = threading.Event(), threading.Event()

    def interrupted():
        raise RuntimeError("interrupted while waiting for a worker")
    monkeypatch.setattr(crew, "_nap", interrupted)

    def kernel(ran, call, counter, items):
        if threading.current_thread() is not threading.main_thread():
            worker_in_job.set()
            release_worker.wait(30)
        else:
            assert worker_in_job.wait(30)
        _record_items(ran, call[0], counter, items)
    ran = np.full(4, -1, np.int64)
    threads.run_items(_record_items, (ran, 0), 4)  # (the crew exists)
    first = crew._CREW
    with pytest.raises(RuntimeError, match="interrupted"):
        threads.run_items(kernel, (ran, np.ones(1, np.int64)), 4)
    assert first.abandoned
    monkeypatch.undo()
    monkeypatch.setenv("NPATTN_NUM_THREADS", "2")
    ran = np.full(64, -1, np.int64)
    threads.run_items(_record_items, (ran, 7), 64)
    assert crew._CREW is not first and (ran == 7).all()
    release_worker.set()
    for thread in first.threads:
        thread.join(30)
        assert not thread.is_alive(), "the abandoned crew's worker did not leave"
