"""The counter a call's threads share, and the atomic operations on int64 slots that the
threads (npattn/cpu/threads.py) and the crew (npattn/cpu/crew.py) synchronize with, for
jitted code."""
from __future__ import annotations

import platform

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

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


def _slot_pointer(context, builder, signature, args):
    """A pointer to ``counter[index]`` (the intrinsics' first two arguments)."""
    data = context.make_array(signature.args[0])(context, builder, args[0]).data
    return builder.gep(data, [context.cast(builder, args[1], signature.args[1], types.intp)])


def _is_slot(counter, index) -> bool:
    return isinstance(counter, types.Array) and counter.dtype == types.int64 and isinstance(index, types.Integer)


@intrinsic
def fetch_add_one(typingctx, counter, index):
    """Atomically ``counter[index] += 1``, returning the value before (int64 ``counter``;
    jitted code only). Sequentially consistent: the thread's writes before it (its items'
    outputs, before it counts itself OUT) are seen by a thread that reads the new value."""
    if not _is_slot(counter, index):
        return None

    def codegen(context, builder, signature, args):
        return builder.atomic_rmw("add", _slot_pointer(context, builder, signature, args),
                                  ir.Constant(ir.IntType(64), 1), "seq_cst")
    return types.int64(counter, index), codegen


@intrinsic
def load_slot(typingctx, counter, index):
    """``counter[index]`` read atomically (acquire: what its writer wrote before it is seen
    after it), so a loop that polls it reads memory each time."""
    if not _is_slot(counter, index):
        return None

    def codegen(context, builder, signature, args):
        return builder.load_atomic(_slot_pointer(context, builder, signature, args), "acquire", 8)
    return types.int64(counter, index), codegen


@intrinsic
def store_slot(typingctx, counter, index, value):
    """``counter[index] = value`` atomically (release: what this thread wrote before it is
    seen by a thread that reads the new value with :func:`load_slot`)."""
    if not (_is_slot(counter, index) and isinstance(value, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        stored = context.cast(builder, args[2], signature.args[2], types.int64)
        builder.store_atomic(stored, _slot_pointer(context, builder, signature, args), "release", 8)
        return context.get_dummy_value()
    return types.none(counter, index, value), codegen


@intrinsic
def compare_exchange(typingctx, counter, index, expected, new):
    """Atomically: if ``counter[index] == expected``, set it to ``new``; whether it did
    (sequentially consistent, like :func:`fetch_add_one`)."""
    if not (_is_slot(counter, index) and isinstance(expected, types.Integer)
            and isinstance(new, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        old, replacement = (context.cast(builder, value, kind, types.int64)
                            for value, kind in zip(args[2:], signature.args[2:]))
        pair = builder.cmpxchg(_slot_pointer(context, builder, signature, args), old, replacement,
                               "seq_cst", "seq_cst")
        return builder.extract_value(pair, 1)
    return types.boolean(counter, index, expected, new), codegen


_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


@intrinsic
def pause(typingctx):
    """The x86 ``pause`` hint in a polling loop (it frees the core's resources for a sibling
    thread and saves power); nothing elsewhere."""
    def codegen(context, builder, signature, args):
        if _X86:
            builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                        "llvm.x86.sse2.pause"), [])
        return context.get_dummy_value()
    return types.none(), codegen
