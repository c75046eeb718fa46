"""Run a kernel's work items on every core, with Python threads around nogil Numba code.

Each kernel takes ``(..., counter, items)`` and, in a loop, claims the next
unclaimed work item with :func:`next_item` (an atomic increment of
``counter[CLAIMED]``), or a run of them with :func:`claim_items`, until none is
left. Claiming on demand rather than by a fixed
split keeps both cores busy to the end when items differ in cost (the last
query tile of a head is short; causal tiles near the diagonal cost more) and
when the hypervisor takes one core away for a while (this project's VMs do). Every
item writes only its own outputs, so the results do not depend on which thread
ran which item, on the thread count or on timing: the bits are the same.

Who the calling thread shares items with: the crew (:mod:`npattn.cpu.crew`), worker
threads that watch for the next call for ``NPATTN_SPIN_US`` after each one, so calls in
quick succession hand items over without a system call; or, where the crew is off or
another call has it, a pool of sleeping threads. A pool thread that finds no item left
counts itself out (``counter[OUT]``) and leaves, and the calling thread, out of items
itself, watches that count for the workers still in theirs (:func:`threads_out`) rather
than sleep on their futures.

Why threads rather than Numba's ``prange``: a parallel region costs about 5 s of
extra compile time per kernel and dtype (measured), and the kernels release the
GIL anyway, so plain threads give the same parallelism.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numba import njit

from . import _cache  # noqa: F401  (before any @njit: stamps caches with the package hash)
from . import compiling
from .counters import (CLAIMED, COUNTER_SIZE, NON_FINITE, OUT, SINGLES, THREADS, fetch_add_one,  # noqa: F401
                       load_slot, new_counter, pause)
from .crew import crew_for, spin_microseconds
from .jit import type_fingerprint
from .environment import Setting

_POOL = None
_POOL_SIZE = 0
_POOL_LOCK = threading.Lock()


def thread_count() -> int:
    """Threads the kernels use: ``NPATTN_NUM_THREADS`` if set, else the usable cores."""
    configured = configured_threads()
    if configured is not None:
        return configured
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def configured_threads() -> int | None:
    """``NPATTN_NUM_THREADS`` as an int >= 1, or None when unset; a ValueError naming the
    variable for any other value. Every call checks it (a call small enough for one thread
    too), so a bad setting fails at once, not at the first large call."""
    return _THREADS_SETTING()


def _parsed_threads(configured: str) -> int | None:
    if not configured:
        return None
    if not configured.isdigit() or int(configured) < 1:
        raise ValueError(f"NPATTN_NUM_THREADS must be a positive integer (or unset), got {configured!r}")
    return int(configured)


_THREADS_SETTING = Setting("NPATTN_NUM_THREADS", _parsed_threads)


def _submit(calls) -> list:
    """Run each ``(function, arguments)`` of ``calls`` on the shared worker pool, grown to
    ``len(calls)`` threads when smaller. Submitting under the lock means a concurrent call
    that replaces the pool cannot shut it down between the lookup and the submits (a pool
    shut down without waiting still runs what was submitted to it)."""
    global _POOL, _POOL_SIZE
    with _POOL_LOCK:
        if _POOL is None or _POOL_SIZE < len(calls):
            if _POOL is not None:
                _POOL.shutdown(wait=False)
            _POOL, _POOL_SIZE = ThreadPoolExecutor(len(calls), thread_name_prefix="npattn"), len(calls)
        return [_POOL.submit(function, *arguments) for function, arguments in calls]


# Calls with less work than these (the forward's FLOPs, 2 B H Sq Sk (D + Dv), for both
# passes) run on the calling thread alone: handing items to another thread costs more than
# it saves. Measured on the 2-core Zen 4 VM with the crew (npattn/cpu/crew.py), float32,
# D = 64, alternating processes, the best of three medians of 9 rounds, 2 threads against
# 1: forwards (1, 8, 16 x 16) 0.5 MFLOP 1.10-1.52x, (1, 8, 20 x 20) 0.8 MFLOP 0.84x,
# (1, 8, 24 x 24) 1.2 MFLOP 0.96-0.99x, (1, 8, 32 x 32) 2.1 MFLOP 0.84-1.01x, (1, 8, 48 x 48)
# 0.77-0.79x, (1, 8, 64 x 64) 0.66-0.69x, (1, 8, 88 x 88) 16 MFLOP 0.59-0.64x, decode steps
# (1, 16, 1 x 1024) 0.64x and (4, 8, 1 x 1024) 0.54x; backwards (vjp) (1, 8, 16 x 16)
# 1.27-1.49x, (1, 8, 20 x 20) 1.11x, (1, 8, 24 x 24) 0.97x, (1, 8, 32 x 32) 0.93-1.01x,
# (1, 8, 40 x 40) 3.3 MFLOP 0.91x, (1, 8, 48 x 48) 0.82x, (1, 8, 64 x 64) 0.75x.
FORWARD_INLINE_FLOPS = 1e6
BACKWARD_INLINE_FLOPS = 2e6
# Where the pool takes the items instead (NPATTN_SPIN_US=0, or another call holds the
# crew), its wake-ups and GIL meetings cost more. Measured on the same VM with
# NPATTN_SPIN_US=0, planned forwards (1, 8, S x S, 64), medians of 9 rounds, three
# processes each, inline against the pool: S = 32 (2.1 MFLOP) 49-51 against 65-123 us,
# S = 48 (4.7 MFLOP) 80-84 against 92-150, S = 64 (8.4 MFLOP) 120-127 against 101-173,
# S = 88 (15.9 MFLOP) 247-259 against 179-186, S = 128 271-288 against 249-272.
POOL_INLINE_FLOPS = 6e6


def runs_inline(flops: float, items: int, backward: bool = False, pool: bool = False) -> bool:
    """Whether a call of ``flops`` (the forward's FLOPs) in ``items`` work items runs on the
    calling thread alone: one item, or less work than :data:`FORWARD_INLINE_FLOPS`
    (:data:`BACKWARD_INLINE_FLOPS` for a backward), or, where the pool would take the items
    (``pool``), than :data:`POOL_INLINE_FLOPS`. A plan decides it once."""
    if items <= 1:
        return True
    return flops < (POOL_INLINE_FLOPS if pool else BACKWARD_INLINE_FLOPS if backward else FORWARD_INLINE_FLOPS)


def run_items(kernel, arguments, items: int, scratch=tuple, inline: bool = False,
              pool_inline: bool | None = None) -> np.ndarray:
    """``kernel(*arguments, *scratch(), counter, items)`` on ``min(items, threads)`` threads
    sharing one fresh ``counter``, each with scratch of its own from ``scratch()``; on the
    calling thread alone where ``inline`` (:func:`runs_inline`), where ``items`` is 1, and
    where the crew is off or busy and ``pool_inline`` (None: ``inline``). Which thread runs
    an item never changes the bits. The first call of a kernel for a dtype in the process
    (a compile, or a load from Numba's cache) is announced (:mod:`.compiling`). Returns the
    ``counter`` (:func:`new_counter`), whose ``[NON_FINITE]`` is what the forward reports of
    its run (1 where it wrote a non-finite output row)."""
    pool_inline = inline if pool_inline is None else pool_inline
    key = (kernel, arguments[0].dtype)
    if key in _PREPARED:
        return _run_items(kernel, arguments, items, scratch, inline, pool_inline)
    with compiling.announced(getattr(kernel, "__name__", "kernel"), arguments[0].dtype):
        counter = _run_items(kernel, arguments, items, scratch, inline, pool_inline)
    _PREPARED.add(key)
    return counter


_PREPARED: set = set()  # (kernel, dtype) pairs called in this process


def direct_entry(kernel, arguments):
    """The entry point of ``kernel``'s machine code compiled for exactly the Numba types of
    ``arguments`` (the whole call: scratch, counter and item count included), or None
    where none is compiled. The dispatcher types each argument on every call (1.1 us of a
    28-argument call, a twentieth of a small attention call); a caller that knows its
    arguments' types cannot change (a plan: frozen views of fixed layout, its own scratch
    and outputs) calls the entry point instead. Looked up by the dispatcher's own
    fingerprints of the types (0.15 us an argument), typed only for a new combination:
    a decode loop makes a plan per step (its key count grows), and typing the 28
    arguments at each had cost a (1, 8/2, 1 + 850, 64) step 0.3 ms."""
    key = (kernel, *(type_fingerprint(argument) for argument in arguments))
    entry = _ENTRIES.get(key)
    if entry is None:
        from numba import typeof

        overload = kernel.overloads.get(tuple(typeof(argument) for argument in arguments))
        if overload is None:
            return None
        entry = _ENTRIES[key] = overload.entry_point
    return entry


_ENTRIES: dict = {}  # (kernel, each argument's type fingerprint) -> its machine code's entry point


def _run_items(kernel, arguments, items, scratch, inline, pool_inline) -> np.ndarray:
    configured_threads()  # a bad NPATTN_NUM_THREADS fails every call, not only the threaded ones
    threads = 1 if inline else min(items, thread_count())
    if threads > 1:
        spin_us = spin_microseconds()
        crew = crew_for(threads - 1) if spin_us else None
        if crew is not None:  # (None: turned off, or another call has it: the pool)
            try:
                return crew.run(kernel, arguments, items, scratch, threads, spin_us)
            finally:
                crew.lock.release()
        if pool_inline:
            threads = 1
    if threads <= 1:
        counter = new_counter(threads)
        kernel(*arguments, *scratch(), counter, items)
        return counter
    counter = new_counter(threads)
    futures = _submit([(kernel, (*arguments, *scratch(), counter, items)) for _ in range(threads - 1)])
    kernel(*arguments, *scratch(), counter, items)  # the calling thread works too
    # A worker that has not started by now would find every item claimed: cancel it rather
    # than wait for it to wake up (on a busy VM that took longer than a small call's whole
    # work). The others are watched through the counter (each thread that finds no item
    # left counts itself out, after its last write), not waited for on their futures:
    # a future's result wakes this thread 32-36 us after the worker's kernel returned
    # (measured on the 2-core Zen 4 VM at (1, 8, 128, 64) and (1, 8, 256, 64), where the
    # worker finished last in about half the calls of 0.3 and 0.8 ms). A worker that
    # failed before its kernel ran never counts itself out: after the watch its future
    # says why.
    running = [future for future in futures if not future.cancel()]
    if running and not threads_out(counter, 1 + len(running), WATCH_PAUSES):
        for future in running:
            future.result()
    return counter


# The polls of OUT :func:`threads_out` makes before it gives up: about 60-150 us of
# ``pause`` (its latency is about 65 cycles on Zen cores, 140 on recent Intel ones), a few
# times the wake-up it saves; a worker with longer left to run is waited for on its
# future, whose wake-up is then a small part of the wait
WATCH_PAUSES = 4096


@njit(nogil=True, cache=True)
def threads_out(counter, threads, pauses):
    """Whether ``counter[OUT]`` reaches ``threads`` within ``pauses`` polls (watched
    without the GIL, so the workers' Python goes on meanwhile)."""
    for _ in range(pauses):
        if load_slot(counter, OUT) >= threads:
            return True
        pause()
    return load_slot(counter, OUT) >= threads


@njit(inline="always")
def _counted_out(counter, first, items):
    """``first``, having counted the claiming thread OUT when it is past the last item
    (each kernel leaves its loop then, done with the call's arrays)."""
    if first >= items:
        fetch_add_one(counter, OUT)
    return first


@njit(inline="always")
def next_item(counter, items):
    """Claim a work item: atomically ``counter[CLAIMED] += 1``, returning the value before
    (int64 ``counter``; jitted code only). A thread given ``items`` or more must leave its
    loop at once and write nothing more: it is counted OUT, and the caller may return."""
    return _counted_out(counter, fetch_add_one(counter, CLAIMED), items)


@njit(inline="always")
def claim_items(counter, items, run):
    """Claim work items ``[first, stop)`` (``first >= items``: none is left): ``run`` items
    at once, the items of a run in order (a forward's kv head, whose key tiles the thread
    keeps packed for the next query tile: claimed one by one, the threads would each
    pack every tile of every head), but for the last ``counter[THREADS]`` runs, claimed one
    item at a time so that the threads still finish together. ``run`` 1: one item at a
    time, as :func:`next_item` (a thread given ``first >= items`` is counted OUT)."""
    singles_from = 0
    if run > 1:
        whole_runs = items // run - counter[THREADS]
        if whole_runs > 0:
            claimed = fetch_add_one(counter, CLAIMED)
            if claimed < whole_runs:
                return claimed * run, claimed * run + run
            singles_from = whole_runs * run
    first = _counted_out(counter, singles_from + fetch_add_one(counter, SINGLES if run > 1 else CLAIMED), items)
    return first, first + 1


def _forget_pool() -> None:
    """In a forked child: the parent's pool threads do not exist there (its submits would
    wait for ever)."""
    global _POOL, _POOL_SIZE, _POOL_LOCK
    _POOL, _POOL_SIZE, _POOL_LOCK = None, 0, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)
