"""Test files run by a child pytest beside the main process, in a full run.

The main process runs its tests one after another, on one core: on the 2-core Zen 3 VM
(2026-11-29) the second core was busy with the builds (NVRTC, the GPU emulation's g++,
the CPU kernels' compile) and the test subprocesses until 416 s into a 591 s run, and
idle for the last 185 s, while the main process ran its remaining 765 tests. The files of
:data:`FILES` (tests of plain calls: no threads counted, no GPU builds, no subprocesses)
run instead in a child ``pytest`` at the builds' lower priority, started once the CPU
kernels are compiled; their tests come last in the main process, which reports the
child's outcome of each (its pass, failure with its traceback, skip with its reason, and
durations, through pytest's own report serialization). A test the child did not report
whole (it failed to start, to collect a file, or crashed) runs in the main process as
usual. The next run took 545 s, its CPU busy 196% of 200 until its end. On the same
VM on a later day (549 s) the child was done at about 497 s, and the main process ran on
alone for 52 s: test_quantized_cache.py, 12 s of that, joined the child's files.

conftest.py registers :class:`Plugin` and calls :func:`start` at collection.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

FILES = ("test_properties.py", "test_jax_adapter.py", "test_serving.py", "test_plan_api.py", "test_oracle.py",
         "test_torch_adapter.py", "test_nonfinite.py", "test_testing.py", "test_gradients.py",
         "test_backend_equivalence.py", "test_validation.py", "test_options.py", "test_quantized_cache.py")
# in the child's environment: the file its reports go to (and that it is the child)
REPORTS = "NPATTN_TESTS_CHILD_REPORTS"

_CHILD = pytest.StashKey[object]()  # an offloaded item's future: the child's reports by node id


def is_child() -> bool:
    return bool(os.environ.get(REPORTS))


def wanted(config, items) -> list:
    """The items to offload: those of :data:`FILES`, in a run of the whole suite (no paths,
    ``-k`` or ``-m`` given: the child runs whole files), outside a child."""
    option = config.option
    if is_child() or option.file_or_dir or option.keyword or option.markexpr:
        return []
    return [item for item in items if item.path.name in FILES]


def start(config, items, started, after, environment) -> list:
    """Start the child for ``items`` (from :func:`wanted`) with ``started(name, work)``
    once the future ``after`` (the CPU kernels' compile; None: at once) is done, in
    ``environment``; mark each item with the child's future. Returns ``items``."""
    if not items:
        return items
    files = sorted({str(item.path) for item in items})
    profile = config.getoption("hypothesis_profile", None)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files,
               *([f"--hypothesis-profile={profile}"] if profile else [])]

    def run():
        if after is not None:
            after.exception()  # (waits; a failed compile leaves the child to compile)
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "reports.json")
            # (its own tmp_path root: pytest's numbered directories, shared, are cleaned by each run)
            subprocess.run([*command, f"--basetemp={os.path.join(directory, 'tmp')}"], cwd=str(config.rootpath),
                           capture_output=True, text=True, env={**environment, REPORTS: path})
            reports = {}
            if os.path.exists(path):
                with open(path) as stream:
                    for data in json.load(stream):
                        if isinstance(data.get("longrepr"), list):  # a skip's (path, line, reason):
                            data["longrepr"] = tuple(data["longrepr"])  # a tuple, which JSON made a list
                        reports.setdefault(data["nodeid"], []).append(data)
            return reports

    future = started("offloaded-files", run)
    for item in items:
        item.stash[_CHILD] = future
    return items


def reported(item) -> bool:
    """Log the child's reports of an offloaded ``item`` as its own (its start, each phase's
    report, its finish); False where it has none (run it here)."""
    future = item.stash.get(_CHILD, None)
    if future is None:
        return False
    phases = future.result().get(item.nodeid)
    if not phases or phases[-1]["when"] != "teardown":  # (none, or cut short: the child crashed)
        return False
    hook = item.ihook
    hook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for data in phases:
        report = item.config.hook.pytest_report_from_serializable(config=item.config, data=data)
        hook.pytest_runtest_logreport(report=report)
    hook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


class Plugin:
    """The hooks, registered by conftest.py: in the main process an offloaded test's
    outcome is the child's; in the child, each report is kept and written at the end."""

    def __init__(self, config):
        self.config = config
        self.recorded: list = []

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        return True if reported(item) else None

    def pytest_runtest_logreport(self, report):
        if is_child():
            self.recorded.append(self.config.hook.pytest_report_to_serializable(config=self.config, report=report))

    def pytest_sessionfinish(self, session):
        if is_child():
            with open(os.environ[REPORTS], "w") as stream:
                json.dump(self.recorded, stream)
