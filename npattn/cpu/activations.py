"""The exact GELU, ``x * Phi(x)`` with Phi the standard normal CDF, for float32 arrays, on
the vector units: :func:`gelu` and its backward :func:`gelu_gradient`.

Why: NumPy has no erf, and SciPy's float32 ``erf`` calls a scalar float64 routine per
value: GELU in SciPy's form took 24 ns a value on one core of the 2-core Zen 3 VM, and a
quarter of a BERT encoder's time there (``examples/sentence_embeddings.py``,
all-MiniLM-L6-v2, batch 32, one core: 1.09 of 4.4 s). Numba's ``math.erf`` and
``math.exp`` are scalar libm calls too. This kernel takes 3.8 ns a value there, forward
or backward.

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
one float32 ulp of the exact value (tested against float64 SciPy). The backward,
``grad (Phi(x) + x phi(x))``, takes the same steps from x alone, the exp giving phi too;
where Phi and x phi nearly cancel (the slope's zero, x about -0.75) it is within 1e-10 of
their size. The loops have no calls and no branches (selects), and index from 0 (from
``start`` Numba's wraparound of negative indices kept a loop scalar: 9 ns a value), so
LLVM runs them on whole vectors.
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
_INVERSE_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
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
def _cdf_and_exp(x):
    """``(Phi(x), exp(-x^2 / 2))`` of a float64 ``x`` (a float32's value), by the module's
    steps; from ``|x| / sqrt 2 = 11`` the exp is taken as 0."""
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
    w = 0.5 * x * x if inside else 0.0  # z^2, exact (0 outside, where e is not used)
    e = _exp_of_negative(-w) if inside else 0.0
    q = 0.5 * t * h * e  # Phi(-|x|)
    cdf = q if x < 0.0 else 1.0 - q
    return (cdf if x == x else x), e


@njit(**_OPTIONS)
def gelu_kernel(x, grad, out):
    """Over 1-D float32 arrays of one length: ``out[i] = x[i] * Phi(x[i])``, or where
    ``grad`` has their length, the backward ``out[i] = grad[i] * (Phi(x[i]) + x[i] phi(x[i]))``
    (phi the normal density)."""
    if grad.size == x.size:
        for i in range(x.size):
            value = np.float64(x[i])  # (float() of a float32 stays float32 in Numba)
            cdf, e = _cdf_and_exp(value)
            out[i] = np.float64(grad[i]) * (cdf + value * (e * _INVERSE_SQRT_2PI))
    else:
        for i in range(x.size):
            value = np.float64(x[i])
            out[i] = value * _cdf_and_exp(value)[0]


# One thread: shared among the CPU backend's threads (spans claimed from a counter), the
# example's throughput was 0.96-0.99x that of one thread in three interleaved runs on the
# 2-core Zen 3 VM. A GELU follows a matrix product, after which OpenBLAS's threads spin
# on the second core for a while.
_NO_GRAD = np.empty(0, np.float32)


def _flat(x):
    return x.reshape(-1) if x.flags.c_contiguous else x.ravel()  # (a copy only where x is not C-ordered)


def gelu(x):
    """``x * Phi(x)`` of a float32 NumPy array of any shape: a fresh C-contiguous float32
    array of x's shape."""
    out = np.empty(x.shape, np.float32)
    gelu_kernel(_flat(x), _NO_GRAD, out.reshape(-1))
    return out


def gelu_gradient(x, grad):
    """The backward of :func:`gelu`: ``grad * (Phi(x) + x phi(x))`` for float32 NumPy
    arrays ``x`` and ``grad`` of one shape, from x alone (nothing of the forward kept),
    rounded once: a fresh C-contiguous float32 array."""
    out = np.empty(x.shape, np.float32)
    gelu_kernel(_flat(x), _flat(grad), out.reshape(-1))
    return out
