"""Run a kernel's work items on every core, with Python threads around nogil Numba code.

Each kernel takes ``(..., start, stop, step)`` and runs its work items
``start, start + step, ...``; thread ``t`` of ``T`` runs the stripe starting at
``t``. Striping interleaves cheap and expensive items (the causal tiles near
the diagonal), so each core gets about the same work. Every item writes only
its own outputs, so results do not depend on the thread count or timing.

Why threads rather than Numba's ``prange``: a parallel region costs about 5 s of
extra compile time per kernel and dtype (measured), and the kernels release the
GIL anyway, so plain threads give the same parallelism.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

_POOL = None
_POOL_SIZE = 0


def thread_count() -> int:
    """Threads the kernels use: ``NPATTN_NUM_THREADS`` if set, else the usable cores."""
    configured = os.environ.get("NPATTN_NUM_THREADS")
    if configured:
        return max(1, int(configured))
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def run_items(kernel, arguments, items: int) -> None:
    """``kernel(*arguments, start, items, step)`` over ``min(items, threads)`` stripes."""
    global _POOL, _POOL_SIZE
    stripes = min(items, thread_count())
    if stripes <= 1:
        kernel(*arguments, 0, items, 1)
        return
    if _POOL is None or _POOL_SIZE < stripes:
        if _POOL is not None:
            _POOL.shutdown(wait=False)
        _POOL, _POOL_SIZE = ThreadPoolExecutor(stripes, thread_name_prefix="npattn"), stripes
    futures = [_POOL.submit(kernel, *arguments, stripe, items, stripes) for stripe in range(1, stripes)]
    kernel(*arguments, 0, items, stripes)  # the calling thread takes the first stripe
    for future in futures:
        future.result()
