"""Saying when the CPU kernels compile, which a first call otherwise does in silence.

Numba compiles each kernel on its first call for a dtype on a machine and loads it from
its disk cache in later processes. The compile is long on small machines: the float32
forward's first call took 83 s on a 2-core AVX2 Zen 3 VM (2026-11-29), every float32
kernel 44 s on a 2-core Zen 4 VM (2026-11-26). :func:`announced` wraps the first call of
each kernel and dtype in a process: one INFO line on the ``npattn`` logger before it,
and when it took longer than :data:`NOTE_SECONDS` (a compile, not a cache load), one
note on stderr for the process, naming the ways to pay the compile ahead of time. :func:`quiet` silences both where the
caller asked for the compile (:func:`npattn.warmup`, ``python -m npattn compile``).
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
import time

LOGGER = logging.getLogger("npattn")
NOTE_SECONDS = 2.0
AHEAD_OF_TIME = "npattn.warmup() or `python -m npattn compile` compiles them ahead of time"

_QUIET = contextvars.ContextVar("npattn_compile_quiet", default=False)
_noted = False


@contextlib.contextmanager
def quiet():
    """No log line and no note for the kernels prepared inside (the caller asked for it)."""
    token = _QUIET.set(True)
    try:
        yield
    finally:
        _QUIET.reset(token)


@contextlib.contextmanager
def announced(kernel: str, dtype) -> object:
    """Log before the first call of ``kernel`` for ``dtype`` in this process; note on
    stderr (once per process) when it took over :data:`NOTE_SECONDS`."""
    global _noted
    if _QUIET.get():
        yield
        return
    LOGGER.info("npattn: preparing the CPU kernel %s for %s (compiled on this machine's first call, which can "
                "take a minute or more on a small machine; loaded from Numba's disk cache after that); %s",
                kernel, dtype, AHEAD_OF_TIME)
    start = time.perf_counter()
    yield
    seconds = time.perf_counter() - start
    if seconds <= NOTE_SECONDS:
        return
    LOGGER.info("npattn: the CPU kernel %s for %s took %.1f s to compile", kernel, dtype, seconds)
    if not _noted:
        _noted = True
        print(f"npattn: compiled the CPU kernel {kernel} for {dtype} in {seconds:.1f} s (once per machine and dtype: "
              f"cached on disk now); {AHEAD_OF_TIME}", file=sys.stderr)
