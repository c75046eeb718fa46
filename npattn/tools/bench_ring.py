"""``python -m npattn bench --ring N``: ring attention on N MPI ranks against one process.

Both run under ``mpiexec`` (the launcher beside the interpreter, as the mpich wheel
installs it, else on PATH) with one CPU thread per rank (``NPATTN_NUM_THREADS=1``), so N
ranks use N cores and the one-process run one: the ratio is what the ring gains per rank
of added cores, against 1/N for perfect scaling. Each run times the causal forward (and,
unless ``backward=False``, forward+backward) of one shape, the median of ``repeats``
runs after a warm-up, each started together behind a barrier; a ring run's time is its
slowest rank's.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np

DEFAULT_SHAPE = (1, 8, 8192, 64)


def launcher() -> str | None:
    """The mpiexec of the MPI beside this interpreter (a venv's mpich wheel), else PATH's."""
    return shutil.which("mpiexec", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("mpiexec")


def compare(ranks: int, shape=DEFAULT_SHAPE, sharding: str = "zigzag", repeats: int = 3,
            backward: bool = True, out=sys.stdout) -> dict:
    """Print and return {"one process": {pass: s}, "ring": {pass: s}, "ratio": {pass: x}}."""
    mpiexec = launcher()
    if mpiexec is None:
        raise RuntimeError("bench --ring needs mpiexec: pip install 'npattn[mpi]' (mpi4py and the MPICH wheel)")
    results = {}
    for name, count, layout in (("one process", 1, "contiguous"), ("ring", ranks, sharding)):
        command = [mpiexec, "-n", str(count), sys.executable, "-m", "npattn.tools.bench_ring", ",".join(map(str, shape)),
                   layout, str(repeats), "1" if backward else "0"]
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "NPATTN_NUM_THREADS": "1"})
        if done.returncode != 0:
            raise RuntimeError(f"bench --ring: {' '.join(command)} failed:\n{done.stdout}{done.stderr}")
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    results["ratio"] = {key: results["ring"][key] / results["one process"][key] for key in results["ring"]}
    batch, heads, length, dim = shape
    print(f"ring attention, ({batch},{heads},{length},{dim}) causal float32, {ranks} ranks ({sharding}) against "
          f"one process, one thread each, medians of {repeats}", file=out)
    print(f"{'pass':<9} {'one process s':>14} {'ring s':>9} {'ratio':>7} {'ideal':>7}", file=out)
    for key in results["ring"]:
        print(f"{key:<9} {results['one process'][key]:>14.3f} {results['ring'][key]:>9.3f} "
              f"{results['ratio'][key]:>6.3f}x {1 / ranks:>6.3f}x", file=out)
    return results


def _rank_main(shape_text: str, sharding: str, repeats: int, backward: bool) -> None:
    """One rank of a timed run: prints the slowest rank's medians as JSON (on rank 0)."""
    from mpi4py import MPI

    from ..distributed import ring_attention, ring_attention_vjp, shard

    comm = MPI.COMM_WORLD
    rank, ranks = comm.Get_rank(), comm.Get_size()
    batch, heads, length, dim = (int(x) for x in shape_text.split(","))
    rng = np.random.default_rng(0)
    full = [rng.standard_normal((batch, heads, length, dim), np.float32) for _ in range(3)]
    q, k, v = (shard(x, rank, ranks, 2, sharding) for x in full)
    dout = np.ones_like(q)

    def forward():
        ring_attention(q, k, v, comm, causal=True, sharding=sharding)

    def forward_backward():
        ring_attention_vjp(q, k, v, comm, causal=True, sharding=sharding)[1](dout)
    passes = {"forward": forward, **({"fwd+bwd": forward_backward} if backward else {})}
    medians = {}
    for name, run in passes.items():
        run()  # warm: compile or load the kernels, plan the calls
        times = []
        for _ in range(repeats):
            comm.Barrier()
            start = time.perf_counter()
            run()
            times.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
        medians[name] = float(np.median(times))
    if rank == 0:
        print(json.dumps(medians), flush=True)


if __name__ == "__main__":
    _rank_main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1")
