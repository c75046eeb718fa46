"""Row operations of the online softmax, written so LLVM vectorizes them.

Numba's ``np.exp`` is a scalar libm call here (no SVML), about 5 ns an
element: slower than the matrix products it sits between. For float32,
:func:`exp_shifted` uses ``2**x = 2**n * 2**f`` with ``n = round(x)`` and ``f``
in [-1/2, 1/2]: a degree-7 Taylor polynomial for ``2**f`` (relative error below
1e-8, under float32's rounding) times ``2**n`` assembled in the exponent bits.
The loop vectorizes (about 0.7 ns an element on one core). Arguments below
-127 give exactly 0 (the exponent field is 0), so masked scores (-inf)
contribute exactly nothing. float64 uses the exact ``exp``.
"""
from __future__ import annotations

import math

import numpy as np

from . import _cache  # noqa: F401  (before any @njit: stamps caches with the package hash)
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# 2**f = exp(f ln2) = sum (f ln2)^k / k!
_C = tuple(LN2 ** k / math.factorial(k) for k in range(8))
# Never "ninf" or "nnan" on code that meets -inf: -inf is how a score is masked.
FASTMATH = {"reassoc", "contract", "nsz", "arcp", "afn"}
# A max reduction vectorizes only under "nnan"; scores are never NaN (inputs are finite).
_MAX_FASTMATH = FASTMATH | {"nnan"}
_LANES = 16


@intrinsic
def _float32_from_bits(typingctx, bits):
    """Reinterpret an int32's bits as a float32 (a register move, no memory round trip)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@njit(cache=True, fastmath=_MAX_FASTMATH, nogil=True)
def row_max(row, n, partial):
    """max(row[:n]), -inf for n == 0 or an all -inf row. ``partial`` is scratch of at least
    16 elements (passed in: an allocation per row would cost more than the row): sixteen
    independent partial maxima make the loop a vector max, not a chain of compares."""
    partial[:_LANES] = -np.inf
    full = n - n % _LANES
    for c in range(0, full, _LANES):
        for lane in range(_LANES):
            value = row[c + lane]
            partial[lane] = value if value > partial[lane] else partial[lane]
    best = row.dtype.type(-np.inf)
    for lane in range(_LANES):
        best = partial[lane] if partial[lane] > best else best
    for c in range(full, n):
        best = row[c] if row[c] > best else best
    return best


def exp_shifted(row, n, shift):
    """``row[c] = exp(row[c] - shift)`` for c < n, in place; returns ``(sum, max)``: the sum
    of the new values and the max of the old ones (in the row's dtype), so a caller that
    guessed ``shift`` can check the guess after the fact. Jitted code only."""
    raise NotImplementedError


# "nnan" lets the max that rides along vectorize; -inf (a masked score) is still exact.
@overload(exp_shifted, jit_options={"cache": True, "fastmath": _MAX_FASTMATH, "nogil": True})
def _exp_shifted_overload(row, n, shift):
    if row.dtype == types.float32:
        c0, c1, c2, c3, c4, c5, c6, c7 = (np.float32(c) for c in _C)
        log2e, lowest, half = np.float32(LOG2E), np.float32(-127.0), np.float32(0.5)

        def polynomial(row, n, shift):
            total = np.float32(0.0)
            best = np.float32(-np.inf)
            for c in range(n):
                best = row[c] if row[c] > best else best
                x = (row[c] - shift) * log2e
                x = x if x > lowest else lowest  # not max(): its NaN branches stop vectorization
                whole = np.floor(x + half)
                f = x - whole
                p = c7 * f + c6
                p = p * f + c5
                p = p * f + c4
                p = p * f + c3
                p = p * f + c2
                p = p * f + c1
                p = p * f + c0
                value = p * _float32_from_bits((np.int32(whole) + np.int32(127)) << np.int32(23))
                row[c] = value
                total += value
            return total, best
        return polynomial

    def exact(row, n, shift):
        total = row.dtype.type(0.0)
        best = row.dtype.type(-np.inf)
        for c in range(n):
            best = row[c] if row[c] > best else best
            value = math.exp(row[c] - shift)
            row[c] = value
            total += value
        return total, best
    return exact
