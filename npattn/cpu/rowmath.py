"""Row operations of the online softmax, written so LLVM vectorizes them.

Numba's ``np.exp`` is a scalar libm call here (no SVML), about 5 ns an
element: slower than the matrix products it sits between. For float32,
:func:`exp_shifted` uses ``2**x = 2**n * 2**f`` with ``n = round(x)`` and ``f``
in [-1/2, 1/2]: a degree-7 Taylor polynomial for ``2**f`` (relative error below
1e-8, under float32's rounding) times ``2**n`` assembled in the exponent bits.
The loop vectorizes (0.8 ns an element on one core, with its sum). Results
below about 2**-126 are exactly 0 (the exponent field is 0), so masked scores
(-inf) contribute exactly nothing; results past float32's range are +inf. float64 uses
the exact ``exp``.

Measured, and why :func:`exp_shifted` returns no max: a max reduction in the
same loop (``best = x if x > best else best``) stops LLVM vectorizing it, even
under "nnan": 5 ns an element instead of 0.8. :func:`row_max` keeps sixteen
partial maxima instead, which does vectorize (0.4 ns an element).
"""
from __future__ import annotations

import math

import numpy as np

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from .jit import FASTMATH, HELPER_OPTIONS, OPTIONS
from .signatures import plain_int, scalar_like
from .simd import wide_vectors

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# 2**f = exp(f ln2) = sum (f ln2)^k / k!
_C = tuple(LN2 ** k / math.factorial(k) for k in range(8))
# A max reduction vectorizes only under "nnan"; scores are never NaN (inputs are finite).
_MAX_FASTMATH = FASTMATH | {"nnan"}
_LANES = 16


@intrinsic
def _float32_from_bits(typingctx, bits):
    """Reinterpret an int32's bits as a float32 (a register move, no memory round trip)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@njit(**{**HELPER_OPTIONS, "fastmath": _MAX_FASTMATH})
def row_max(row, n, partial):
    """max(row[:n]), -inf for n == 0 or an all -inf row. ``partial`` is scratch of at least
    16 elements (passed in: an allocation per row would cost more than the row): sixteen
    independent partial maxima make the loop a vector max, not a chain of compares."""
    wide_vectors()
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


@njit(inline="always")
def exp_shifted(row, n, shift):
    """``row[c] = exp(row[c] - shift)`` for c < n, in place; returns the sum of the new
    values (in the row's dtype). A caller that guessed ``shift`` below the row's max
    can check the guess after the fact from the sum alone: it is at least
    ``exp(max - shift)`` (+inf on float32 overflow). Jitted code only."""
    return _exp_shifted(row, plain_int(n), scalar_like(shift, row))


def _exp_shifted(row, n, shift):
    raise NotImplementedError


@overload(_exp_shifted, jit_options=OPTIONS)
def _exp_shifted_overload(row, n, shift):
    if row.dtype == types.float32:
        c0, c1, c2, c3, c4, c5, c6, c7 = (np.float32(c) for c in _C)
        log2e, half = np.float32(LOG2E), np.float32(0.5)
        # 2**-127 has exponent field 0: exactly 0; 2**128 has field 255: +inf
        lowest, highest = np.float32(-127.0), np.float32(128.0)

        def polynomial(row, n, shift):
            wide_vectors()
            total = np.float32(0.0)
            for c in range(n):
                x = (row[c] - shift) * log2e
                # not max()/min(): their NaN branches stop vectorization
                x = x if x > lowest else lowest
                x = x if x < highest else highest
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
            return total
        return polynomial

    def exact(row, n, shift):
        total = row.dtype.type(0.0)
        for c in range(n):
            value = math.exp(row[c] - shift)
            row[c] = value
            total += value
        return total
    return exact
