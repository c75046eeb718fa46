"""The public API's type hints hold: mypy (configured in setup.cfg) passes on the public
modules, every public function is fully annotated, and the package says it is typed."""
import importlib.util
import inspect
import pathlib
import subprocess
import sys

import pytest

import npattn
from conftest import started_beside, started_in_turn

ROOT = pathlib.Path(__file__).resolve().parent.parent
PUBLIC_MODULES = ["npattn/__init__.py", "npattn/api.py", "npattn/backends.py", "npattn/warmup.py",
                  "npattn/types.py", "npattn/runtime/limits.py", "npattn/runtime/nonfinite.py", "npattn/core/arguments.py",
                  "npattn/compat/flash_attn.py", "npattn/compat/torch_sdpa.py", "npattn/testing/problems.py",
                  "npattn/testing/checks.py"]


def _mypy() -> subprocess.CompletedProcess:
    """mypy on the public modules, in a process of its own."""
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "setup.cfg"),
                           *(str(ROOT / m) for m in PUBLIC_MODULES)], capture_output=True, text=True)


def background_run(item) -> bool:
    """mypy runs beside the other tests (conftest's ``background_run``): 5 s of one core
    that the suite's last tests leave free."""
    return started_beside(item, "test_mypy_passes_on_the_public_modules", "mypy", _mypy, "mypy")


def test_mypy_passes_on_the_public_modules():
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed")
    result = started_in_turn("mypy", _mypy).result()
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", [n for n in npattn.__all__ if inspect.isfunction(getattr(npattn, n))])
def test_every_public_function_is_annotated(name):
    function = getattr(npattn, name)
    hints = inspect.get_annotations(function)
    assert "return" in hints, name
    parameters = [p for p in inspect.signature(function, follow_wrapped=False).parameters.values()
                  if p.name in inspect.getfullargspec(function).args]
    assert all(p.name in hints for p in parameters), (name, hints)


def test_the_package_ships_py_typed():
    assert (ROOT / "npattn" / "py.typed").exists()
    assert "py.typed" in (ROOT / "setup.cfg").read_text()
