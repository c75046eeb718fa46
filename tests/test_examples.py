"""Every script in examples/ runs and reports success."""
import pathlib
import subprocess
import sys

import pytest

from conftest import one_thread_environment, started_in_turn

EXAMPLES = sorted((pathlib.Path(__file__).resolve().parent.parent / "examples").glob("*.py"))


def run_example(script):
    """The completed process of ``script`` run in full: conftest starts it at collection
    (:func:`conftest.started_in_turn`), so that it runs beside the other tests."""
    environment = {name: value for name, value in one_thread_environment().items() if name != "NPATTN_EXAMPLE_QUICK"}
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          env=environment)


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_succeeds(script):
    """In full: train_sort.py must reach its stated accuracy on this CPU (its quick mode,
    NPATTN_EXAMPLE_QUICK=1, only checks that the loss falls)."""
    result = started_in_turn(f"example-{script.name}", lambda: run_example(script)).result()
    assert result.returncode == 0, result.stdout + result.stderr
