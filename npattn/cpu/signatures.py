"""One compiled type per argument: conversions that keep Numba from compiling a helper again.

Numba compiles a jitted function once per distinct tuple of argument types, and a
call from jitted code passes its arguments' types as they are: a literal ``0``
is ``Literal[int](0)``, a writable array differs from a read-only one, a float64
constant from a float32 variable. Each distinct tuple costs a full compile of the
callee and of everything it calls (seconds for the micro-kernels, and again in
every caller that links it). The helpers' wrappers pass their arguments through
these conversions, so every call site shares one compiled body.

:func:`smaller` and :func:`larger` replace the builtin ``min`` and ``max`` on
scalars for the same reason: the builtins compile a small function of their own
per tuple of argument types, which every caller then links and optimizes again.

Use only inside ``@njit`` code.
"""
from __future__ import annotations

from . import _cache  # noqa: F401  (before any @njit: stamps caches with the package hash)
from numba import types
from numba.core.imputils import impl_ret_borrowed
from numba.extending import intrinsic


def _integer_conversion(name, target, accepted, doc):
    """An intrinsic converting one scalar of an ``accepted`` type to ``target``: typed and
    lowered in place, with no function of its own to compile, link or inline."""
    def typer(typingctx, value):
        if not isinstance(value, accepted):
            return None

        def codegen(context, builder, signature, args):
            return context.cast(builder, args[0], signature.args[0], target)
        return target(value), codegen
    typer.__name__ = typer.__qualname__ = name
    typer.__doc__ = doc
    return intrinsic(typer)


plain_int = _integer_conversion("plain_int", types.int64, (types.Integer, types.Boolean), """\
``value`` as an int64, never a literal. An intrinsic rather than an inlined
``np.int64(value)``: Numba re-reads an inlined function's bytecode at every call site,
and the helpers' wrappers make dozens of these calls.""")

as_offset = _integer_conversion("as_offset", types.uint64, types.Integer, """\
A nonnegative integer ``value`` typed uint64, for array indices in hot loops. Numba
wraps a negative signed index around (adds the length), and on a runtime offset such
as ``r * ld + c`` that select keeps LLVM from vectorizing the loop: measured on
``ds[x] = p[x] * (ds[x] - delta)`` over a 96 x 192 tile, 1.8 ns an element with int64
indices against 0.18 with uint64 ones. Arithmetic between uint64 and int64 gives
float64 in Numba, so convert whole index expressions (or offsets that are only added
to other offsets). Never pass a negative value.""")


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


def _pick(typingctx, first, second, *, keep_first_when):
    """Typing and lowering of :func:`smaller` / :func:`larger`: both converted to their
    common type, then one compare and one select (no call, no library to link)."""
    numbers = (types.Integer, types.Float, types.Boolean)
    if not (isinstance(first, numbers) and isinstance(second, numbers)):
        return None
    common = typingctx.unify_types(types.unliteral(first), types.unliteral(second))
    if isinstance(common, types.Boolean):
        common = types.int64

    def codegen(context, builder, signature, args):
        a = context.cast(builder, args[0], signature.args[0], common)
        b = context.cast(builder, args[1], signature.args[1], common)
        if isinstance(common, types.Float):  # ordered: false with a NaN, so ``second``
            keep = builder.fcmp_ordered(keep_first_when, a, b)
        elif common.signed:
            keep = builder.icmp_signed(keep_first_when, a, b)
        else:
            keep = builder.icmp_unsigned(keep_first_when, a, b)
        return builder.select(keep, a, b)
    return common(first, second), codegen


@intrinsic
def smaller(typingctx, first, second):
    """``min(first, second)`` for two numbers, in their common type; ``second`` when they
    tie or either is NaN."""
    return _pick(typingctx, first, second, keep_first_when="<")


@intrinsic
def larger(typingctx, first, second):
    """``max(first, second)`` for two numbers, in their common type; ``second`` when they
    tie or either is NaN."""
    return _pick(typingctx, first, second, keep_first_when=">")
