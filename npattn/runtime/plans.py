"""Calls like an earlier call reuse what it worked out: the plan caches.

Everything :func:`npattn.core.validation.build_problem` decides about a call, and
everything a backend derives from the problem before its kernels run (parameter
arrays, tiles, work items, scratch sizes), is a function of the call's *structure*:
the array type, dtype, shape and strides of q, k and v, and the option values. Two
calls of one structure differ only in their arrays' contents. So a call whose
structure earlier successful calls had (a structure is planned at its second call)
goes straight to the plan they left (:func:`lookup`), skipping the checks whose
outcome is already known: serving loops and embedding pipelines repeat a handful of
structures, and on a small call those checks and that set-up cost more than the
kernel. A decode loop whose key count grows every step repeats none, and makes none.

A structure is only cached when every check of the call depends on nothing else
(:func:`call_key`): NumPy arrays of native byte order or CuPy arrays on one device, options of plain values
(None, bools, ints, floats, strings, tuples of ints and None), and NumPy arrays of the
small options whose checks read their values (lengths, starts and offsets per batch
entry, ALiBi slopes, page tables: :attr:`~npattn.core.options.Option.keyed`), keyed by
their bytes, of which the plan keeps its own copies. Masks and biases (read where they
lie), sink logits (a gradient), dropout (a fresh seed) and ``check_finite=True`` (reads
every value) take the full path, and so do calls whose weights are large enough that
each call checks the free memory for them (:data:`npattn.runtime.limits.CHECKED_FROM_BYTES`).

:class:`PlanCache` is the bounded, thread-safe dictionary the API and the CPU backend
keep their plans in; :func:`clear` empties every one (tests that change a module's
constants call it).
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

import numpy as np

from ..core import options as _options
from ..core.arrays import is_cupy
from ..core.checks import exact_structures

_CACHES: weakref.WeakSet = weakref.WeakSet()


class PlanCache:
    """A dict from keys to plans holding the newest ``limit`` (oldest dropped first: a
    loop's few structures stay, a sweep over shapes cannot grow it). Reads take no lock
    (a dict lookup is atomic); writes take one."""

    def __init__(self, limit: int = 256):
        self.limit = limit
        self._plans: dict = {}
        self._lock = threading.Lock()
        _CACHES.add(self)

    def get(self, key):
        return self._plans.get(key)

    def get_or_make(self, key, make: Callable[[], Any]) -> Any:
        """The plan kept for ``key``, else ``make()``, kept."""
        plan = self._plans.get(key)
        if plan is None:
            plan = make()
            self.put(key, plan)
        return plan

    def put(self, key, plan) -> None:
        with self._lock:
            while len(self._plans) >= self.limit:
                del self._plans[next(iter(self._plans))]
            self._plans[key] = plan

    def __len__(self) -> int:
        return len(self._plans)

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()


def clear() -> None:
    """Empty every :class:`PlanCache` (the next call of each structure plans again)."""
    for cache in list(_CACHES):
        cache.clear()


# ---- the API's cache: a call's structure -> what to run -------------------------------------

_PLAIN = (type(None), bool, int, float, str)


def _plain(value) -> bool:
    kind = type(value)
    return kind in _PLAIN or (kind is tuple and all(type(item) in (type(None), int) for item in value))


def repeatable(name: str, value) -> bool:
    """Whether a repeated call may skip the checks of option ``name`` given ``value``: a
    plain value that its table entry (:attr:`npattn.core.options.Option.repeatable`) allows;
    never for a name that is not an option (the full path raises)."""
    option = _options.BY_NAME.get(name)
    if option is None:
        return name == "backend" and type(value) is str
    return _plain(value) and (option.repeatable is None or option.repeatable(value))


def call_key(q, k, v, options: dict) -> tuple | None:
    """The structure of ``attention(q, k, v, **options)`` as a hashable key, or None when
    the call is not cacheable. Each option value is keyed with its type: ``causal=1`` is
    not ``causal=True`` (the checks reject the first)."""
    kind = type(q)
    if kind is np.ndarray:
        if not (type(k) is kind and type(v) is kind):
            return None
        q_dtype, k_dtype, v_dtype = q.dtype, k.dtype, v.dtype
        if not (q_dtype.isnative and k_dtype.isnative and v_dtype.isnative):
            return None
        key: list = [q.shape, q.strides, q_dtype, k.shape, k.strides, k_dtype, v.shape, v.strides, v_dtype]
    elif is_cupy(q) and type(k) is kind and type(v) is kind:
        # CuPy arrays: the device is part of the structure (a plan's operands live on one)
        device = q.device.id
        if k.device.id != device or v.device.id != device:
            return None
        key = [kind, device, q.shape, q.strides, q.dtype, k.shape, k.strides, k.dtype, v.shape, v.strides, v.dtype]
    else:
        return None
    options_part = options_key(options)
    return None if options_part is None else (*key, *options_part)


# Arrays of more entries than this are not keyed (copying them into a key costs more than
# the checks it saves)
KEYED_ENTRIES = 4096


def options_key(options: dict, arrays: bool = True) -> tuple | None:
    """The options of a call as part of a key (:func:`call_key`), or None where one of them
    keeps the call off the plans: each plain value :func:`repeatable` allows, with its
    type, and (``arrays``) each NumPy array of a :attr:`~npattn.core.options.Option.keyed`
    option by its bytes."""
    key: list = []
    for name, value in options.items():
        if repeatable(name, value):
            key += (name, type(value), value)
        elif arrays and type(value) is np.ndarray and value.size <= KEYED_ENTRIES and _keyed(name):
            key += (name, value.dtype, value.shape, value.tobytes())
        else:
            return None
    return tuple(key)


def values_key(values: tuple) -> tuple | None:
    """Arguments a call's checks read by value (a serving call's lengths, tables, bounds)
    as part of a key: None and ints as they are, NumPy integers as ints, NumPy arrays by
    their dtype, shape and bytes (:data:`KEYED_ENTRIES` at most, together); None where
    one is anything else (a list, another kind of array) or the arrays are larger."""
    key: list = []
    entries = 0
    for value in values:
        kind = type(value)
        if value is None or kind is int:
            key.append((kind, value))
        elif kind is np.ndarray:
            entries += value.size
            if entries > KEYED_ENTRIES:
                return None
            key.append((value.dtype, value.shape, value.tobytes()))
        elif isinstance(value, np.integer):
            key.append((kind, int(value)))
        else:
            return None
    return tuple(key)


def numpy_structures(*arrays) -> tuple | None:
    """Each array's exact structure (type, dtype, shape, strides; None for None) as part of
    a key, or None unless each is a NumPy array or None."""
    key = exact_structures(*arrays)
    if not key or any(structure is not None and structure[0] is not np.ndarray for structure in key):
        return None
    return key


def _keyed(name: str) -> bool:
    option = _options.BY_NAME.get(name)
    return option is not None and option.keyed


_FORWARD = PlanCache()


def lookup(key) -> Any:
    """What a call of structure ``key`` left to run (the API's plans), or None."""
    return _FORWARD.get(key)


# Structures seen once and not planned yet: a structure is planned at its second call, so
# that calls whose structure never repeats (a decode loop's growing key count) do not pay
# for making plans no later call will use.
_SEEN = PlanCache()


def remember(key, make: Callable[[], Any]) -> None:
    """Note that a call of structure ``key`` was answered by the full path; from the second
    such call on, keep ``make()`` (when not None) for later calls of it."""
    if key is None:
        return
    if _FORWARD.get(key) is None and _SEEN.get(key) is None:
        _SEEN.put(key, True)
        return
    plan = make()
    if plan is not None:
        _FORWARD.put(key, plan)
