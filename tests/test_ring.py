"""Ring attention over MPI (npattn.distributed): ``mpiexec -n 2, 3, 4`` on loopback, each
rank comparing its outputs and gradients with the one-process call (tests/ring_worker.py).
Needs mpi4py and an MPI launcher (the test extra installs mpi4py and the MPICH wheel)."""
import functools
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import npattn
from conftest import one_thread_environment, started_in_turn
from npattn.distributed import shard, unshard

pytest.importorskip("mpi4py")
WORKER = pathlib.Path(__file__).resolve().parent / "ring_worker.py"
# the launcher of the MPI that mpi4py was built against sits beside the interpreter in a venv
MPIEXEC = shutil.which("mpiexec", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("mpiexec")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")


def run(ranks, *arguments, timeout=300, folder=None):
    """The worker on ``ranks`` ranks; with ``folder``, each rank writes its report lines to
    ``folder/rank<R>.txt`` (lines on one shared pipe may run into each other)."""
    environment = one_thread_environment()
    if folder is not None:
        environment["NPATTN_FUZZ_OUT"] = str(folder)
    result = subprocess.run([MPIEXEC, "-n", str(ranks), sys.executable, str(WORKER), *map(str, arguments)],
                            capture_output=True, text=True, timeout=timeout, cwd=WORKER.parent, env=environment)
    return result


# the worker runs that tests read from a run started at collection, by test: the worker's
# arguments from the test's parameters
_BESIDE = {
    "test_outputs_and_gradients_equal_the_one_process_call":
        lambda strategy, ranks: (ranks, "correctness", strategy, ranks, 25),
    "test_a_mismatched_shard_raises_the_same_error_on_every_rank": lambda: (3, "mismatch"),
    "test_a_peer_that_never_calls_makes_the_others_time_out_naming_the_wait": lambda: (3, "silent-peer"),
    "test_what_a_strategy_cannot_split_is_refused_by_name": lambda: (2, "refusals"),
}


def worker_run(item):
    """The future of the worker run test ``item`` reads, started once, beside the other
    tests (:func:`conftest.started_in_turn`): the ranks' processes spend most of their
    seconds starting and loading kernels, one core's work, while the suite's last tests
    keep the other core busy."""
    callspec = getattr(item, "callspec", None)
    arguments = _BESIDE[item.originalname](**(callspec.params if callspec else {}))
    return started_in_turn("ring " + " ".join(map(str, arguments)), functools.partial(run, *arguments))


def background_run(item) -> bool:
    """Start the worker run ``item`` reads (conftest calls this at collection for each
    test of this module); whether there is one."""
    if item.originalname not in _BESIDE or MPIEXEC is None:
        return False
    worker_run(item)
    return True


@pytest.mark.parametrize("strategy, ranks", [("ring", 2), ("ring", 3), ("ring", 4), ("heads", 2), ("heads", 3)])
def test_outputs_and_gradients_equal_the_one_process_call(strategy, ranks, request):
    result = worker_run(request.node).result()
    assert result.returncode == 0, result.stdout + result.stderr
    # the ranks' lines share one pipe and may run into each other: read them by pattern
    assert sorted(re.findall(r"ok rank (\d+) of", result.stdout)) == [str(rank) for rank in range(ranks)]


def _gpu_reason():
    return npattn.backends()["gpu"].reason


@pytest.mark.skipif(_gpu_reason() is not None, reason=f"CuPy shards need the gpu backend: {_gpu_reason()}")
@pytest.mark.parametrize("strategy, ranks", [("ring", 2), ("ring", 3), ("heads", 2)])
def test_cupy_shards_give_cupy_results_equal_to_the_one_process_call(strategy, ranks):
    """The ranks share one GPU here; the blocks travel through host memory."""
    result = run(ranks, "correctness", strategy, ranks + 10, 12, "cupy")
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(re.findall(r"ok rank (\d+) of", result.stdout)) == [str(rank) for rank in range(ranks)]


def test_a_mismatched_shard_raises_the_same_error_on_every_rank(request):
    result = worker_run(request.node).result()
    assert result.returncode == 0, result.stdout + result.stderr
    raised = re.findall(r"raised rank (\d): (ring attention: .*? lengths)", result.stdout)
    assert sorted(rank for rank, _ in raised) == ["0", "1", "2"], result.stdout
    assert len({message for _, message in raised}) == 1 and "rank 1's q, k, v shapes" in raised[0][1]


def test_a_peer_that_never_calls_makes_the_others_time_out_naming_the_wait(request):
    result = worker_run(request.node).result()
    timed_out = re.findall(r"timed out rank (\d): ring attention: rank \d waited 1 s for every rank to make the "
                           r"same call", result.stdout)
    assert sorted(timed_out) == ["1", "2"], result.stdout + result.stderr


def test_what_a_strategy_cannot_split_is_refused_by_name(request):
    result = worker_run(request.node).result()
    assert result.returncode == 0, result.stdout + result.stderr
    refused = re.findall(r"refused rank 0: (?:ring attention: rank 0's inputs: )?(?:ring attention does not (?:take (\w+) yet|return (weights))|"
                         r"strategy='heads' (?:does not take (\w+)|splits the heads: (H) ))", result.stdout)
    assert ["".join(names) for names in refused] == ["weights", "mask", "H", "q_start", "q_offset"], result.stdout


def test_a_call_one_rank_gets_wrong_raises_the_same_named_error_on_every_rank_at_once(tmp_path):
    """A bad shard, option or timeout on one rank or all: no rank returns, none hangs or
    waits out a timeout, and every rank's error is the same and names the argument."""
    result = run(2, "safety", timeout=120, folder=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    printed = "".join((tmp_path / f"rank{rank}.txt").read_text() for rank in (0, 1))
    outcomes = re.findall(r"case (.+?) (forward|vjp) rank (\d): (\w+) in ([\d.]+) s: (.*)", printed)
    assert not re.findall(r"returned", printed), printed
    named = {"3-D q on rank 0": "q must be 4-D", "float mask on rank 1": "rank 1's mask has dtype float32",
             "mask on rank 1 only": "rank 1 passes ['mask']", "NaN sink_logits": "sink_logits holds NaN",
             "unknown option": "'softmax_scale': npattn's equivalent is scale=", "window on rank 1": "window",
             "timeout nan": "timeout must be", "timeout -1": "timeout must be", "timeout text": "timeout must be",
             "timeout nan on rank 1": "rank 1's inputs: timeout must be", "alibi too steep": "alibi_slopes",
             "dout on rank 1": "rank 1's dout: dout must have out's shape"}
    by_case = {}
    for label, entry, rank, kind, seconds, message in outcomes:
        assert kind in ("ValueError", "TypeError") and float(seconds) < 10, (label, entry, kind, seconds)
        by_case.setdefault((label, entry), {})[rank] = message
    assert {label for label, _ in by_case} == set(named), printed
    for (label, entry), messages in by_case.items():
        assert sorted(messages) == ["0", "1"] and len(set(messages.values())) == 1, (label, entry, messages)
        assert named[label] in messages["0"], (label, messages["0"])


@pytest.mark.parametrize("sharding, length", [("contiguous", 10), ("zigzag", 12)])
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_shard_and_unshard_are_inverse(sharding, length, ranks):
    array = np.arange(2 * length * 3).reshape(2, length, 3)
    parts = [shard(array, rank, ranks, 1, sharding) for rank in range(ranks)]
    np.testing.assert_array_equal(unshard(parts, 1, sharding), array)
    if sharding == "zigzag":  # rank r holds chunks r and 2R-1-r
        chunk = length // (2 * ranks)
        np.testing.assert_array_equal(parts[0][:, :chunk], array[:, :chunk])
        np.testing.assert_array_equal(parts[0][:, chunk:], array[:, length - chunk:])


def test_zigzag_needs_equal_chunks():
    with pytest.raises(ValueError, match="2 x 3 equal chunks"):
        shard(np.zeros((1, 10)), 0, 3, 1, "zigzag")


def test_bench_ring_times_the_ring_against_one_process():
    import io

    from npattn.tools import bench_ring

    printed = io.StringIO()
    results = bench_ring.compare(2, (1, 2, 32, 8), repeats=1, out=printed)
    assert set(results["ring"]) == set(results["one process"]) == {"forward", "fwd+bwd"}
    for key, ratio in results["ratio"].items():
        assert ratio == pytest.approx(results["ring"][key] / results["one process"][key])
    assert "2 ranks (zigzag)" in printed.getvalue() and "0.500x" in printed.getvalue()


def test_the_readmes_mpi_example_runs_on_two_ranks(tmp_path):
    readme = (WORKER.parent.parent / "README.md").read_text()
    (block,) = re.findall(r"```python mpi\n(.*?)```", readme, flags=re.S)
    script = tmp_path / "readme_ring.py"
    script.write_text(block)
    result = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(script)], capture_output=True, text=True,
                            timeout=300, env=one_thread_environment())
    assert result.returncode == 0, result.stdout + result.stderr
