"""The exact GELU, ``x * Phi(x)`` with Phi the standard normal CDF, for float32 arrays, on
the vector units: :func:`gelu_with_cdf`.

Why: NumPy has no erf, and SciPy's float32 ``erf`` calls a scalar float64 routine per
value: GELU in SciPy's form took 24 ns a value on one core of the 2-core Zen 3 VM, and a
quarter of a BERT encoder's time there (``examples/sentence_embeddings.py``,
all-MiniLM-L6-v2, batch 32, one core: 1.09 of 4.4 s). Numba's ``math.erf`` and
``math.exp`` are scalar libm calls too. This kernel takes 4.0 ns a value there.

How, in float64 with one rounding to float32 at the end:

- ``Phi(x) = erfc(-x / sqrt 2) / 2``, and with ``z = |x| / sqrt 2``,
  ``erfc(z) = exp(-z^2) erfcx(z)``; ``erfcx``, the scaled complementary error function,
  is smooth, so ``erfcx(z) = t h(t)`` with ``t = 2 / (2 + z)`` and ``h`` a polynomial of
  degree 14 (:data:`_H`, fitted by ``python -m npattn.tools.fit_normal_cdf``: relative
  error under 9e-12 for z in [0, 11]).
- ``x < 0`` takes ``Phi(x) = exp(-z^2) erfcx(z) / 2`` itself, so the left tail keeps its
  relative precision (``(1 + erf(x / sqrt 2)) / 2``, the usual form, loses it to
  cancellation: at x = -5 float32 gives it to a few percent); ``x >= 0`` takes one minus it.
- ``z^2 = x^2 / 2`` is exact in float64 for a float32 x; ``exp`` of it is a Cody-Waite
  reduction by ln 2, a degree-11 Taylor polynomial (error under 3e-15) and ``2^k``
  assembled in the exponent bits.
- From ``z = 11`` (|x| about 15.6) Phi is 0 or 1 in float32 and is taken as exactly that:
  ``gelu(-inf)`` is ``-inf * 0 = NaN`` as in torch and in SciPy's form; NaN stays NaN.

So each result is float64's ``x * Phi(x)`` to about 1e-11 relative, rounded once: within
one float32 ulp of the exact value (tested against float64 SciPy). The loop has no calls
and no branches (selects), so LLVM runs it on whole vectors.
"""
from __future__ import annotations

import math
import struct

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .jit import OPTIONS
from .threads import next_item, run_items

# Past Z_HIGH the CDF is 0 (left) or 1 (right) in float32; the fit's t = 2 / (2 + z) runs
# down to T_LOW there
_Z_HIGH = 11.0
_T_LOW = 2.0 / (2.0 + _Z_HIGH)
# h(t) = erfcx(z) / t as a polynomial in s = (2 t - 1 - T_LOW) / (1 - T_LOW), lowest power first
_H = (0.5670172947761634, 0.3280580424966453, 0.10490060153594485, 0.00663672230422827, -0.006488947244913874,
      -0.0007254435986484222, 0.0006529189710579963, 7.4434232252684515e-06, -7.649423834503173e-05,
      1.4571023362478196e-05, 6.578415214960923e-06, -3.68380101518232e-06, 7.477047523261726e-08,
      4.151905008776941e-07, -9.402262371477217e-08)
_S_SCALE = 2.0 / (1.0 - _T_LOW)
_S_SHIFT = (1.0 + _T_LOW) / (1.0 - _T_LOW)
_LOG2E = 1.0 / math.log(2.0)
# ln 2 split for the reduction: the high part with its low 32 bits zero, so k * _LN2_HIGH is
# exact for the |k| <= 175 here
_LN2_HIGH = struct.unpack("<d", struct.pack("<Q", struct.unpack("<Q", struct.pack("<d", math.log(2.0)))[0]
                                            & ~0xFFFFFFFF))[0]
_LN2_LOW = math.log(2.0) - _LN2_HIGH
_INVERSE_SQRT2 = 1.0 / math.sqrt(2.0)
# Only FMA contraction: "reassoc" (the kernels' other flag) would let LLVM regroup the
# reduction y - k ln2_high - k ln2_low into y - k ln 2, which loses its point
_OPTIONS = {**OPTIONS, "fastmath": {"contract"}}


@intrinsic
def _round_even(typingctx, x):
    """A float64 rounded to the nearest whole number, ties to even (``llvm.roundeven``:
    one vector instruction, where Numba's round goes through an integer)."""
    if x != types.float64:
        return None

    def codegen(context, builder, signature, args):
        function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.DoubleType(), [ir.DoubleType()]),
                                                  "llvm.roundeven.f64")
        return builder.call(function, args)
    return types.float64(x), codegen


@intrinsic
def _power_of_two(typingctx, k):
    """``2**k`` for a float64 ``k`` holding a whole number in [-1022, 1023]: ``k + 2**52 +
    1023`` (exact) has ``k + 1023`` in its low bits, which shifted up are 2**k's exponent
    field."""
    if k != types.float64:
        return None

    def codegen(context, builder, signature, args):
        biased = builder.fadd(args[0], ir.Constant(ir.DoubleType(), float(2 ** 52 + 1023)))
        bits = builder.shl(builder.bitcast(biased, ir.IntType(64)), ir.Constant(ir.IntType(64), 52))
        return builder.bitcast(bits, ir.DoubleType())
    return types.float64(k), codegen


@njit(inline="always")
def _exp_of_negative(y):
    """``exp(y)`` for float64 ``y`` in [-121, 0]."""
    k = _round_even(y * _LOG2E)
    r = (y - k * _LN2_HIGH) - k * _LN2_LOW
    p = 1.0 / 39916800.0
    p = p * r + 1.0 / 3628800.0
    p = p * r + 1.0 / 362880.0
    p = p * r + 1.0 / 40320.0
    p = p * r + 1.0 / 5040.0
    p = p * r + 1.0 / 720.0
    p = p * r + 1.0 / 120.0
    p = p * r + 1.0 / 24.0
    p = p * r + 1.0 / 6.0
    p = p * r + 0.5
    p = p * r + 1.0
    p = p * r + 1.0
    return p * _power_of_two(k)


@njit(inline="always")
def _normal_cdf(x):
    """Phi(x) of a float64 ``x`` (a float32's value), by the module's steps."""
    z = abs(x) * _INVERSE_SQRT2
    t = 2.0 / (2.0 + z)
    s = t * _S_SCALE - _S_SHIFT
    h = _H[14]
    h = h * s + _H[13]
    h = h * s + _H[12]
    h = h * s + _H[11]
    h = h * s + _H[10]
    h = h * s + _H[9]
    h = h * s + _H[8]
    h = h * s + _H[7]
    h = h * s + _H[6]
    h = h * s + _H[5]
    h = h * s + _H[4]
    h = h * s + _H[3]
    h = h * s + _H[2]
    h = h * s + _H[1]
    h = h * s + _H[0]
    inside = z < _Z_HIGH  # (False for inf and NaN)
    w = 0.5 * x * x if inside else 0.0  # z^2, exact (0 outside, where q is not used)
    q = 0.5 * t * h * _exp_of_negative(-w) if inside else 0.0  # Phi(-|x|)
    cdf = q if x < 0.0 else 1.0 - q
    return cdf if x == x else x


@njit(**_OPTIONS)
def gelu_kernel(x, out, cdf, counter, items):
    """``out[i] = x[i] * Phi(x[i])`` over the 1-D float32 arrays (same length), and
    ``cdf[i] = Phi(x[i])`` when ``cdf`` has their length (else it is not written); item
    ``j`` of ``items`` is the span ``[j n / items, (j + 1) n / items)``, claimed from
    ``counter`` (:func:`~npattn.cpu.threads.run_items`)."""
    n = x.size
    while True:
        item = next_item(counter, items)
        if item >= items:
            return
        start, stop = item * n // items, (item + 1) * n // items
        if cdf.size == n:
            for i in range(start, stop):
                value = float(x[i])
                phi = _normal_cdf(value)
                out[i] = value * phi
                cdf[i] = phi
        else:
            for i in range(start, stop):
                value = float(x[i])
                out[i] = value * _normal_cdf(value)


# Values per work item (about 130 us at 4 ns a value on the Zen 3 VM): an array of fewer
# than two items' values runs on the calling thread alone
_ITEM_VALUES = 1 << 15
_NO_CDF = np.empty(0, np.float32)


def gelu_with_cdf(x, keep_cdf: bool = True):
    """``(gelu(x), Phi(x))`` of a float32 NumPy array of any shape (the second None unless
    ``keep_cdf``): fresh C-contiguous float32 arrays of x's shape. Large arrays are shared
    among the CPU backend's threads (``NPATTN_NUM_THREADS``), which never changes a value."""
    flat = x.reshape(-1) if x.flags.c_contiguous else x.ravel()  # (a copy only where x is not C-ordered)
    out = np.empty(x.shape, np.float32)
    cdf = np.empty(x.shape, np.float32) if keep_cdf else _NO_CDF
    run_items(gelu_kernel, (flat, out.reshape(-1), cdf.reshape(-1)), max(1, flat.size // _ITEM_VALUES))
    return out, (cdf if keep_cdf else None)
