"""The documentation under docs/ builds without a warning, and every code block of its
pages runs as written (each page's blocks in order, in one namespace)."""
import importlib.util
import pathlib
import re
import subprocess
import sys
import tempfile

import pytest

import code_blocks
from conftest import started_beside, started_in_turn

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
PAGES = sorted(DOCS.rglob("*.rst"))


def _sphinx_build() -> subprocess.CompletedProcess:
    """sphinx-build -W of the docs into a temporary folder, in a process of its own."""
    with tempfile.TemporaryDirectory() as folder:
        return subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                               "-d", str(pathlib.Path(folder) / "doctrees"), str(DOCS),
                               str(pathlib.Path(folder) / "html")], capture_output=True, text=True)


def background_run(item) -> bool:
    """The build runs beside the other tests (conftest's ``background_run``): 4 s of one
    core that the suite's last tests leave free."""
    return started_beside(item, "test_the_docs_build_without_warnings", "sphinx-build", _sphinx_build, "sphinx")


def test_the_docs_build_without_warnings():
    if importlib.util.find_spec("sphinx") is None:
        pytest.skip("sphinx is not installed")
    result = started_in_turn("sphinx-build", _sphinx_build).result()
    assert result.returncode == 0, "sphinx-build -W failed:\n" + result.stdout + result.stderr


def _code_blocks(page):
    text = page.read_text()
    blocks = re.findall(r"\.\. code-block:: python\n\n((?:(?:   .*)?\n)+)", text)
    return ["\n".join(line[3:] for line in block.splitlines()) for block in blocks]


@pytest.mark.parametrize("page", [p for p in PAGES if _code_blocks(p)], ids=lambda p: p.stem)
def test_every_code_block_runs(page):
    namespace = {}
    for number, block in enumerate(_code_blocks(page), 1):
        code_blocks.run(block, f"{page.relative_to(DOCS)}, block {number}", namespace)


def test_the_tutorials_have_code():
    assert {p.stem for p in PAGES if _code_blocks(p)} >= {"arrays", "training", "decoding", "oracle", "frameworks"}
