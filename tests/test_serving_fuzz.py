"""The seeded fuzz of the serving calls, the framework adapters and ring attention
(tests/serving_fuzz.py, tests/ring_worker.py's ``fuzz`` mode): valid and broken calls
mixed, none may end in a fault. The table of classes is printed at the end of the run.
The CI profile draws 1500 in-process calls and 200 ring calls on 2 ranks;
``--hypothesis-profile=dev`` ten times as many."""
from __future__ import annotations

import collections
import pathlib
import re
import subprocess
import sys

import pytest
from hypothesis import settings

import serving_fuzz
from conftest import FUZZ_TABLES, one_thread_environment

SCALE = 10 if settings().max_examples >= 1000 else 1
CALLS, RING_CALLS = 1500 * SCALE, 200 * SCALE


def _report(request, text):
    """The table, printed in the run's summary at the end (conftest.pytest_terminal_summary)."""
    request.config.stash.setdefault(FUZZ_TABLES, []).append(text)


def test_the_serving_and_adapter_fuzz_finds_no_fault(request):
    tally = serving_fuzz.fuzz(CALLS, seed=20261126)
    _report(request, tally.table())
    assert sum(tally.counts.values()) == CALLS
    assert tally.counts["ok"] > CALLS // 4 and tally.counts["rejected"] > CALLS // 4, tally.table()
    assert tally.faults == 0, tally.table()


def test_the_ring_fuzz_finds_no_fault_and_every_rank_raises_alike(request, tmp_path):
    pytest.importorskip("mpi4py")
    from test_ring import MPIEXEC, WORKER

    if MPIEXEC is None:
        pytest.skip("no mpiexec")
    result = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(WORKER), "fuzz", "20261126", str(RING_CALLS)],
                            capture_output=True, text=True, timeout=600, cwd=WORKER.parent,
                            env=one_thread_environment(NPATTN_FUZZ_OUT=str(tmp_path)))
    crashed = result.returncode != 0
    records = {}
    for rank in (0, 1):
        path = pathlib.Path(tmp_path, f"rank{rank}.txt")
        lines = path.read_text().splitlines() if path.exists() else []
        for line in lines:
            found = re.match(r"fuzz rank (\d) case (\d+) (.*?): ([a-z ]+?)(?:: (.*))?$", line)
            assert found, line
            records.setdefault(int(found[2]), {})[rank] = (found[3], found[4], found[5] or "")
    counts = collections.Counter()
    faults = []
    for case, ranks in sorted(records.items()):
        classes = {klass for _, klass, _ in ranks.values()}
        for label, klass, detail in ranks.values():
            counts[klass] += 1
            if klass not in ("ok", "rejected"):
                faults.append(f"case {case} {label}: {klass}: {detail}")
        if len(ranks) != 2 or len(classes) != 1:
            faults.append(f"case {case}: the ranks disagree: {ranks}")
        elif classes == {"rejected"} and len({detail for _, _, detail in ranks.values()}) != 1:
            faults.append(f"case {case}: the ranks raised different errors: {ranks}")
    missing = RING_CALLS - len(records)
    table = [f"ring fuzz: {RING_CALLS} calls on 2 ranks ({2 * RING_CALLS} rank calls)",
             *(f"  {klass:<20} {counts[klass]}" for klass in serving_fuzz.CLASSES),
             f"  crash                {int(crashed)}", f"  not reached          {missing}",
             *(f"  {fault}" for fault in faults[:10])]
    _report(request, "\n".join(table))
    assert not crashed and not missing, result.stdout[-3000:] + result.stderr[-3000:]
    assert not faults, "\n".join(table)
    assert counts["ok"] > RING_CALLS // 4 and counts["rejected"] > RING_CALLS // 4
