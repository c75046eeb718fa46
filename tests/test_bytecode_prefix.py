"""tests/bytecode_prefix.py: where bytecode is turned off, a run keeps it under a temporary
prefix shared with the processes it starts, and changes nothing otherwise."""
import os
import pathlib
import subprocess
import sys

import pytest

import bytecode_prefix


def _turned_off(monkeypatch, prefix=None):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "pycache_prefix", prefix)


def test_bytecode_turned_off_is_kept_under_a_fresh_prefix_for_this_process_and_its_children(monkeypatch):
    _turned_off(monkeypatch)
    environment = {"PYTHONDONTWRITEBYTECODE": "1", "OTHER": "kept"}
    prefix = bytecode_prefix.keep_for_the_run(environment)
    try:
        assert prefix is not None and os.path.isdir(prefix)
        assert (sys.dont_write_bytecode, sys.pycache_prefix) == (False, prefix)
        assert environment == {"OTHER": "kept", bytecode_prefix.PREFIX: prefix}
    finally:
        os.rmdir(prefix)


def test_nothing_changes_where_bytecode_is_written_or_a_prefix_is_set(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    monkeypatch.setattr(sys, "pycache_prefix", None)
    environment = {}
    assert bytecode_prefix.keep_for_the_run(environment) is None and environment == {}
    for prefix, variables in ((str(tmp_path), {}), (None, {bytecode_prefix.PREFIX: str(tmp_path)})):
        _turned_off(monkeypatch, prefix)
        environment = {"PYTHONDONTWRITEBYTECODE": "1", **variables}
        assert bytecode_prefix.keep_for_the_run(environment) is None
        assert environment == {"PYTHONDONTWRITEBYTECODE": "1", **variables}
        assert (sys.dont_write_bytecode, sys.pycache_prefix) == (True, prefix)


def test_a_child_of_this_run_writes_its_bytecode_under_the_runs_prefix(tmp_path):
    """In a run where the environment turned bytecode off (conftest called
    keep_for_the_run first), a child's imports leave their bytecode under the prefix."""
    prefix = os.environ.get(bytecode_prefix.PREFIX)
    if prefix is None or sys.pycache_prefix != prefix:
        assert not sys.dont_write_bytecode  # (bytecode written as usual: nothing to keep)
        pytest.skip("this environment writes bytecode: no prefix was needed")
    module = tmp_path / "imported_by_the_child.py"
    module.write_text("VALUE = 1\n")
    subprocess.run([sys.executable, "-c", "import imported_by_the_child"], cwd=tmp_path, check=True,
                   env={**os.environ, "PYTHONPATH": str(tmp_path)})
    written = pathlib.Path(prefix + str(tmp_path)) / f"imported_by_the_child.{sys.implementation.cache_tag}.pyc"
    assert written.is_file()
    assert not (tmp_path / "__pycache__").exists()
