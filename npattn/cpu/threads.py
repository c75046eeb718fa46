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

Why threads rather than Numba's ``prange``: a parallel region costs about 5 s of
extra compile time per kernel and dtype (measured), and the kernels release the
GIL anyway, so plain threads give the same parallelism.
"""
from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from . import compiling

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
    if _ENVIRON is not None:
        return _parsed_threads(_ENVIRON.get(_THREADS_KEY, _UNSET))
    return _parsed_threads(os.environ.get("NPATTN_NUM_THREADS", ""))


# CPython's os.environ keeps its names and values encoded in a dict, ``_data``, that every
# change through os.environ updates: reading it costs 0.05 us where os.environ.get, which
# encodes the name and decodes the value, costs 0.6 (a small call's every call reads it)
_ENVIRON = getattr(os.environ, "_data", None)
_THREADS_KEY = os.environ.encodekey("NPATTN_NUM_THREADS") if _ENVIRON is not None else None
_UNSET = os.environ.encodevalue("") if _ENVIRON is not None else ""


@functools.lru_cache(maxsize=16)
def _parsed_threads(configured: str | bytes) -> int | None:
    if isinstance(configured, bytes):
        configured = os.fsdecode(configured)
    configured = configured.strip()
    if not configured:
        return None
    if not configured.isdigit() or int(configured) < 1:
        raise ValueError(f"NPATTN_NUM_THREADS must be a positive integer (or unset), got {configured!r}")
    return int(configured)


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


# Calls with less work than this (the forward's FLOPs, 2 B H Sq Sk (D + Dv)) run on the
# calling thread alone: handing items to a pool worker costs more than the worker saves.
# Measured on the 2-core VM, float32, medians of 100 (1 thread against 2): the forward at
# (1, 8, 16, 64), 0.5 MFLOP, 165-270 against 410-445 us; (1, 8, 64, 64), 8.4 MFLOP,
# 257-259 against 307-328 us, its backward 661-708 against 729-794 us; at
# (1, 8, 128, 64), 34 MFLOP, even (forward 575-763 against 704-708, backward 1749-2117
# against 1606-1709); at (1, 8, 256, 64), 134 MFLOP, 2 threads win (1157-1258 against
# 1745-1748 us).
INLINE_FLOPS = 16e6


def run_items(kernel, arguments, items: int, scratch=tuple, flops: float | None = None) -> np.ndarray:
    """``kernel(*arguments, *scratch(), counter, items)`` on ``min(items, threads)`` threads
    sharing one fresh ``counter``, each with scratch of its own from ``scratch()``; on the
    calling thread alone when ``flops`` (the call's work, forward FLOPs) is below
    :data:`INLINE_FLOPS`. Which thread runs an item never changes the bits. The first
    call of a kernel for a dtype in the process (a compile, or a load from Numba's cache)
    is announced (:mod:`.compiling`). Returns the ``counter`` (:func:`new_counter`), whose
    ``[NON_FINITE]`` is what the forward reports of its run (1 where it wrote a
    non-finite output row)."""
    key = (kernel, arguments[0].dtype)
    if key in _PREPARED:
        return _run_items(kernel, arguments, items, scratch, flops)
    with compiling.announced(getattr(kernel, "__name__", "kernel"), arguments[0].dtype):
        counter = _run_items(kernel, arguments, items, scratch, flops)
    _PREPARED.add(key)
    return counter


_PREPARED: set = set()  # (kernel, dtype) pairs called in this process


def direct_entry(kernel, arguments):
    """The entry point of ``kernel``'s machine code compiled for exactly the Numba types of
    ``arguments`` (the whole call: scratch, counter and item count included), or None
    where none is compiled. The dispatcher types each argument on every call (1.1 us of a
    28-argument call, a twentieth of a small attention call); a caller that knows its
    arguments' types cannot change (a plan: frozen views of fixed layout, its own scratch
    and outputs) calls the entry point instead. Typing them here takes tens of us: once
    per plan."""
    from numba import typeof

    overload = kernel.overloads.get(tuple(typeof(argument) for argument in arguments))
    return None if overload is None else overload.entry_point


# A kernel's ``counter``, int64 (COUNTER_SIZE,): CLAIMED, the items (or with claim_items, the
# runs) claimed; NON_FINITE, set to 1 by a forward kernel that wrote a NaN or an inf into
# out; SINGLES, the items claim_items handed out one by one; THREADS, the threads sharing it
CLAIMED, NON_FINITE, SINGLES, THREADS = 0, 1, 2, 3
COUNTER_SIZE = 4


def new_counter(threads: int) -> np.ndarray:
    """A fresh ``counter`` for a kernel run on ``threads`` threads."""
    counter = np.zeros(COUNTER_SIZE, np.int64)
    counter[THREADS] = threads
    return counter


def _run_items(kernel, arguments, items, scratch, flops) -> np.ndarray:
    configured_threads()  # a bad NPATTN_NUM_THREADS fails every call, not only the threaded ones
    inline = (flops is not None and flops < INLINE_FLOPS) or items <= 1
    threads = 1 if inline else min(items, thread_count())
    counter = new_counter(threads)
    if threads <= 1:
        kernel(*arguments, *scratch(), counter, items)
        return counter
    futures = _submit([(kernel, (*arguments, *scratch(), counter, items)) for _ in range(threads - 1)])
    kernel(*arguments, *scratch(), counter, items)  # the calling thread works too
    for future in futures:
        # A worker that has not started by now would find every item claimed: cancel it
        # rather than wait for it to wake up (on a busy VM that took longer than a small
        # call's whole work).
        if not future.cancel():
            future.result()
    return counter


@intrinsic
def _fetch_add_one(typingctx, counter, index):
    """Atomically ``counter[index] += 1``, returning the value before (int64 ``counter``;
    jitted code only)."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64 and isinstance(index, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        position = context.cast(builder, args[1], signature.args[1], types.intp)
        return builder.atomic_rmw("add", builder.gep(data, [position]), ir.Constant(ir.IntType(64), 1), "monotonic")
    return types.int64(counter, index), codegen


@njit(inline="always")
def next_item(counter):
    """Claim a work item: atomically ``counter[CLAIMED] += 1``, returning the value before
    (int64 ``counter``; jitted code only)."""
    return _fetch_add_one(counter, CLAIMED)


@njit(inline="always")
def claim_items(counter, items, run):
    """Claim work items ``[first, stop)`` (``first >= items``: none is left): ``run`` items
    at once, the items of a run in order (a forward's kv head, whose key tiles the thread
    keeps packed for the next query tile: claimed one by one, the threads would each
    pack every tile of every head), but for the last ``counter[THREADS]`` runs, claimed one
    item at a time so that the threads still finish together. ``run`` 1: one item at a
    time, as :func:`next_item`."""
    singles_from = 0
    if run > 1:
        whole_runs = items // run - counter[THREADS]
        if whole_runs > 0:
            claimed = _fetch_add_one(counter, CLAIMED)
            if claimed < whole_runs:
                return claimed * run, claimed * run + run
            singles_from = whole_runs * run
    first = singles_from + _fetch_add_one(counter, SINGLES if run > 1 else CLAIMED)
    return first, first + 1
