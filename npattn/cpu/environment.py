"""Environment variables the CPU backend reads at every call (``NPATTN_NUM_THREADS``,
``NPATTN_SPIN_US``), so that a change between calls applies to the next one and a bad
value fails the call that reads it, naming the variable."""
from __future__ import annotations

import functools
import os
from typing import Any, Callable

# CPython's os.environ keeps its names and values encoded in a dict, ``_data``, that every
# change through os.environ updates: reading it costs 0.05 us where os.environ.get, which
# encodes the name and decodes the value, costs 0.6 (a small call's every call reads it)
_ENVIRON = getattr(os.environ, "_data", None)
_UNSET = os.environ.encodevalue("") if _ENVIRON is not None else ""


class Setting:
    """``setting()``: the variable ``name`` parsed by ``parse`` (given its text, stripped;
    "" when unset), each distinct value parsed once."""

    def __init__(self, name: str, parse: Callable[[str], Any]):
        self.name = name
        self._key = os.environ.encodekey(name) if _ENVIRON is not None else None

        @functools.lru_cache(maxsize=16)
        def parsed(value: str | bytes) -> Any:
            return parse((os.fsdecode(value) if isinstance(value, bytes) else value).strip())
        self._parsed = parsed

    def __call__(self) -> Any:
        if _ENVIRON is not None:
            return self._parsed(_ENVIRON.get(self._key, _UNSET))
        return self._parsed(os.environ.get(self.name, ""))
