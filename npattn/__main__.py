"""``python -m npattn info`` and ``python -m npattn demo``; see :mod:`npattn.cli`."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
