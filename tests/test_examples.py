"""Every script in examples/ runs and reports success."""
import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = sorted((pathlib.Path(__file__).resolve().parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_succeeds(script):
    """In full: train_sort.py must reach its stated accuracy on this CPU (its quick mode,
    NPATTN_EXAMPLE_QUICK=1, only checks that the loss falls)."""
    environment = {name: value for name, value in os.environ.items() if name != "NPATTN_EXAMPLE_QUICK"}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                            env=environment)
    assert result.returncode == 0, result.stdout + result.stderr
