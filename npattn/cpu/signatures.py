"""One compiled type per argument: conversions that keep Numba from compiling a helper again.

Numba compiles a jitted function once per distinct tuple of argument types, and a
call from jitted code passes its arguments' types as they are: a literal ``0``
is ``Literal[int](0)``, a writable array differs from a read-only one, a float64
constant from a float32 variable. Each distinct tuple costs a full compile of the
callee and of everything it calls (seconds for the micro-kernels, and again in
every caller that links it). The helpers' wrappers pass their arguments through
these conversions, so every call site shares one compiled body.

Use only inside ``@njit`` code.
"""
from __future__ import annotations

from . import _cache  # noqa: F401  (before any @njit: stamps caches with the package hash)
import numpy as np
from numba import njit, types
from numba.core.imputils import impl_ret_borrowed
from numba.extending import intrinsic


@njit(inline="always")
def plain_int(value):
    """``value`` as an int64, never a literal."""
    return np.int64(value)


@intrinsic
def as_readonly(typingctx, array):
    """The same 1-D array typed read-only with any layout."""
    if not (isinstance(array, types.Array) and array.ndim == 1):
        return None
    target = types.Array(array.dtype, 1, "A", readonly=True)

    def codegen(context, builder, signature, args):
        # every 1-D layout and mutability shares one data model: the struct is reused as
        # is, with a reference of its own (the caller releases both)
        return impl_ret_borrowed(context, builder, target, args[0])
    return target(array), codegen


@intrinsic
def scalar_like(typingctx, value, array):
    """``value`` converted to ``array``'s dtype."""
    if not (isinstance(value, (types.Float, types.Integer, types.Boolean)) and isinstance(array, types.Array)):
        return None

    def codegen(context, builder, signature, args):
        return context.cast(builder, args[0], signature.args[0], array.dtype)
    return array.dtype(value, array), codegen
