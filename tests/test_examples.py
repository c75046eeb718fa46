"""Every script in examples/ runs and reports success."""
import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = sorted((pathlib.Path(__file__).resolve().parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_succeeds(script):
    # NPATTN_EXAMPLE_QUICK: training examples run a short version that checks the loss falls
    environment = {**os.environ, "NPATTN_EXAMPLE_QUICK": "1"}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                            env=environment)
    assert result.returncode == 0, result.stdout + result.stderr
