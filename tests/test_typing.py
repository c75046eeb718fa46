"""The public API's type hints hold: mypy (configured in setup.cfg) passes on the public
modules, every public function is fully annotated, and the package says it is typed."""
import inspect
import pathlib

import pytest

import npattn

ROOT = pathlib.Path(__file__).resolve().parent.parent
PUBLIC_MODULES = ["npattn/__init__.py", "npattn/api.py", "npattn/backends.py", "npattn/warmup.py",
                  "npattn/types.py", "npattn/runtime/limits.py", "npattn/runtime/nonfinite.py", "npattn/core/arguments.py",
                  "npattn/compat/flash_attn.py", "npattn/compat/torch_sdpa.py", "npattn/testing/problems.py",
                  "npattn/testing/checks.py"]


def test_mypy_passes_on_the_public_modules():
    api = pytest.importorskip("mypy.api")
    stdout, stderr, status = api.run(["--config-file", str(ROOT / "setup.cfg"),
                                      *(str(ROOT / m) for m in PUBLIC_MODULES)])
    assert status == 0, stdout + stderr


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
