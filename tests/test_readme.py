"""The README's Python examples run as written."""
import pathlib
import re

import code_blocks

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no Python example"
    for number, block in enumerate(blocks, 1):
        code_blocks.run(block, f"README.md, block {number}", {})
