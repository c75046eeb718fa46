"""tests/offload.py: a full run's offloaded files run in a child pytest, and the main
process reports each of their tests as the child ran it: a failure stays a failure with
its message, a skip keeps its reason, and an unreported test runs here."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import offload

CONFTEST = """
import sys
from concurrent.futures import ThreadPoolExecutor
sys.path.insert(0, {tests!r})
import offload

offload.FILES = ("test_there.py",)
_POOL = ThreadPoolExecutor(1)


def pytest_configure(config):
    config.pluginmanager.register(offload.Plugin(config), "npattn-offload")


def pytest_collection_modifyitems(session, config, items):
    offloaded = offload.start(config, offload.wanted(config, items), lambda name, work: _POOL.submit(work), None,
                              dict(__import__("os").environ))
    items[:] = [item for item in items if item not in offloaded] + offloaded
"""
THERE = """
import os
import pytest

def test_runs_in_the_child():
    assert os.environ.get({variable!r})

def test_fails_there():
    assert 1 + 1 == 3, "planted failure"

def test_skips_there():
    pytest.skip("planted skip")

@pytest.mark.parametrize("n", [1, 2])
def test_parametrized_there(n):
    assert n in (1, 2)
"""
HERE = """
import os

def test_runs_here():
    assert not os.environ.get({variable!r})
"""


CRASH = """

def test_crashes_the_child():
    if os.environ.get({variable!r}):
        os._exit(3)
"""


def run_project(tmp_path: Path, *arguments: str, crash: bool = False) -> subprocess.CompletedProcess:
    tests = str(Path(__file__).parent)
    (tmp_path / "conftest.py").write_text(textwrap.dedent(CONFTEST.format(tests=tests)))
    there = THERE + (CRASH if crash else "")
    (tmp_path / "test_there.py").write_text(textwrap.dedent(there.format(variable=offload.REPORTS)))
    (tmp_path / "test_here.py").write_text(textwrap.dedent(HERE.format(variable=offload.REPORTS)))
    (tmp_path / "setup.cfg").write_text("[tool:pytest]\n")
    environment = {key: value for key, value in os.environ.items() if key != offload.REPORTS}
    return subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", *arguments],
                          cwd=tmp_path, capture_output=True, text=True, env=environment, timeout=300)


def test_the_childs_outcomes_are_reported_as_the_main_process_own(tmp_path):
    done = run_project(tmp_path)
    out = done.stdout
    assert done.returncode == 1, out
    assert "PASSED test_there.py::test_runs_in_the_child" in out
    assert "FAILED test_there.py::test_fails_there" in out and "planted failure" in out
    assert "SKIPPED [1] test_there.py" in out and "planted skip" in out
    assert "PASSED test_there.py::test_parametrized_there[2]" in out
    assert "PASSED test_here.py::test_runs_here" in out
    assert "1 failed, 4 passed, 1 skipped" in out


def test_a_run_of_named_files_runs_them_here(tmp_path):
    """Given paths (or -k, -m) a run offloads nothing: the child runs whole files."""
    done = run_project(tmp_path, "test_there.py", "test_here.py")
    assert "FAILED test_there.py::test_runs_in_the_child" in done.stdout
    assert "FAILED test_there.py::test_fails_there" in done.stdout


def test_the_tests_of_a_child_that_crashed_run_here(tmp_path):
    """A child that dies before writing its reports leaves each offloaded test to the
    main process (which then finds it is not in the child)."""
    done = run_project(tmp_path, crash=True)
    assert "FAILED test_there.py::test_runs_in_the_child" in done.stdout
    assert "PASSED test_there.py::test_crashes_the_child" in done.stdout
    assert "2 failed, 4 passed, 1 skipped" in done.stdout, done.stdout
