"""The documentation under docs/ builds without a warning, and every code block of its
pages runs as written (each page's blocks in order, in one namespace)."""
import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
PAGES = sorted(DOCS.rglob("*.rst"))


@pytest.mark.filterwarnings("ignore:The mapping interface for autodoc options")  # Sphinx's own napoleon
def test_the_docs_build_without_warnings(tmp_path):
    from sphinx.cmd.build import build_main

    status = build_main(["-W", "--keep-going", "-q", "-b", "html", "-d", str(tmp_path / "doctrees"),
                         str(DOCS), str(tmp_path / "html")])
    assert status == 0, "sphinx-build -W failed: see its warnings above"


def _code_blocks(page):
    text = page.read_text()
    blocks = re.findall(r"\.\. code-block:: python\n\n((?:(?:   .*)?\n)+)", text)
    return ["\n".join(line[3:] for line in block.splitlines()) for block in blocks]


@pytest.mark.parametrize("page", [p for p in PAGES if _code_blocks(p)], ids=lambda p: p.stem)
def test_every_code_block_runs(page):
    namespace = {}
    for block in _code_blocks(page):
        exec(compile(block, str(page), "exec"), namespace)


def test_the_tutorials_have_code():
    assert {p.stem for p in PAGES if _code_blocks(p)} >= {"arrays", "training", "decoding", "oracle", "frameworks"}
