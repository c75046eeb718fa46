"""Documentation code blocks run as a user runs them from a file of their own."""
import linecache


def run(block: str, name: str, namespace: dict) -> None:
    """Execute ``block`` in ``namespace`` as the source named ``<name>`` (say "oracle.rst,
    block 2"), whose lines are the block's own: tracebacks and ``inspect.getsource`` read
    them there (hypothesis reads a test's source to seed it). Compiled under the page's
    file name, the block's line numbers pointed into the page's other lines, which
    Python 3.13's tokenizer refused (TokenError) where 3.11's read them quietly."""
    filename = f"<{name}>"
    # (size, mtime None: never checked against a file, lines, name), as linecache keeps it
    linecache.cache[filename] = (len(block), None, block.splitlines(keepends=True), filename)
    exec(compile(block, filename, "exec"), namespace)
