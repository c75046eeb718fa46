"""Run a kernel's work items on every core, with Python threads around nogil Numba code.

Each kernel takes ``(..., counter, items)`` and, in a loop, claims the next
unclaimed work item with :func:`next_item` (an atomic increment of
``counter[CLAIMED]``), or a run of them with :func:`claim_items`, until none is
left. Claiming on demand rather than by a fixed
split keeps both cores busy to the end when items differ in cost (the last
query tile of a head is short; causal tiles near the diagonal cost more) and
when the hypervisor takes one core away for a while (this project's VMs do). Every
item writes only its own outputs, so the results do not depend on which thread
ran which item, on the thread count or on timing: the bits are the same. A
thread that finds no item left counts itself out (``counter[OUT]``) and leaves,
and the calling thread, out of items itself, watches that count for the workers
still in theirs (:func:`threads_out`) rather than sleep on their futures.

Why threads rather than Numba's ``prange``: a parallel region costs about 5 s of
extra compile time per kernel and dtype (measured), and the kernels release the
GIL anyway, so plain threads give the same parallelism.
"""
from __future__ import annotations

import functools
import os
import platform
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import _cache  # noqa: F401  (before any @njit: stamps caches with the package hash)
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
# out; SINGLES, the items claim_items handed out one by one; THREADS, the threads sharing
# it; OUT, the threads that found no item left (and so are done with the call's arrays)
CLAIMED, NON_FINITE, SINGLES, THREADS, OUT = 0, 1, 2, 3, 4
COUNTER_SIZE = 5


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


def _counter_slot(context, builder, signature, args):
    """A pointer to ``counter[index]`` (the intrinsics' first two arguments)."""
    data = context.make_array(signature.args[0])(context, builder, args[0]).data
    return builder.gep(data, [context.cast(builder, args[1], signature.args[1], types.intp)])


def _is_counter_slot(counter, index) -> bool:
    return isinstance(counter, types.Array) and counter.dtype == types.int64 and isinstance(index, types.Integer)


@intrinsic
def _fetch_add_one(typingctx, counter, index):
    """Atomically ``counter[index] += 1``, returning the value before (int64 ``counter``;
    jitted code only). Sequentially consistent: the thread's writes before it (its items'
    outputs, before it counts itself OUT) are seen by a thread that reads the new value."""
    if not _is_counter_slot(counter, index):
        return None

    def codegen(context, builder, signature, args):
        return builder.atomic_rmw("add", _counter_slot(context, builder, signature, args),
                                  ir.Constant(ir.IntType(64), 1), "seq_cst")
    return types.int64(counter, index), codegen


@intrinsic
def _load_slot(typingctx, counter, index):
    """``counter[index]`` read atomically (acquire: what its writer wrote before it is seen
    after it), so a loop that polls it reads memory each time."""
    if not _is_counter_slot(counter, index):
        return None

    def codegen(context, builder, signature, args):
        return builder.load_atomic(_counter_slot(context, builder, signature, args), "acquire", 8)
    return types.int64(counter, index), codegen


_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


@intrinsic
def _pause(typingctx):
    """The x86 ``pause`` hint in a polling loop (it frees the core's resources for a sibling
    thread and saves power); nothing elsewhere."""
    def codegen(context, builder, signature, args):
        if _X86:
            builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                        "llvm.x86.sse2.pause"), [])
        return context.get_dummy_value()
    return types.none(), codegen


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
        if _load_slot(counter, OUT) >= threads:
            return True
        _pause()
    return _load_slot(counter, OUT) >= threads


@njit(inline="always")
def _counted_out(counter, first, items):
    """``first``, having counted the claiming thread OUT when it is past the last item
    (each kernel leaves its loop then, done with the call's arrays)."""
    if first >= items:
        _fetch_add_one(counter, OUT)
    return first


@njit(inline="always")
def next_item(counter, items):
    """Claim a work item: atomically ``counter[CLAIMED] += 1``, returning the value before
    (int64 ``counter``; jitted code only). A thread given ``items`` or more must leave its
    loop at once and write nothing more: it is counted OUT, and the caller may return."""
    return _counted_out(counter, _fetch_add_one(counter, CLAIMED), items)


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
            claimed = _fetch_add_one(counter, CLAIMED)
            if claimed < whole_runs:
                return claimed * run, claimed * run + run
            singles_from = whole_runs * run
    first = _counted_out(counter, singles_from + _fetch_add_one(counter, SINGLES if run > 1 else CLAIMED), items)
    return first, first + 1
