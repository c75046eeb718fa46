"""``python -m npattn info`` and ``python -m npattn demo``; see :mod:`npattn.tools.cli`."""
import sys

from .tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
