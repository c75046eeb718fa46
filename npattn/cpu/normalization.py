"""Layer and RMS normalization of float32 rows in one pass a row: :func:`normalize`, which
the autograd's ``layer_norm`` and ``rms_norm`` take for float32 NumPy arrays.

Why: NumPy's form (mean, centered copy, squares, their mean, square root, product, then
weight and bias) makes seven passes and five temporaries over the array: 3.1-3.8 ns a
value at BERT's (32, 30, 384) on the 2-core Zen 3 VM, 7% of the sentence-embeddings
example's time. Here each row (in cache) is summed, its squared deviations summed, and
written normalized, with weight and bias, in float64 and one rounding to float32 per
value (weight and bias by one FMA): 0.73 ns a value there. A row's mean and variance no
longer take float32's rounding of a long sum, and the outputs are the same bits whether
or not the backward's copies are kept.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .jit import OPTIONS


@intrinsic
def _fused_multiply_add(typingctx, a, b, c):
    """``a * b + c`` of float64s rounded once (``llvm.fma``): written out, LLVM contracted it
    into an FMA in one of the kernel's loops and not the other, whose outputs then differed
    in their last bits where b's term cancelled c."""
    if not (a == b == c == types.float64):
        return None

    def codegen(context, builder, signature, args):
        double = ir.DoubleType()
        function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(double, [double] * 3),
                                                  "llvm.fma.f64")
        return builder.call(function, args)
    return types.float64(a, b, c), codegen


@njit(**OPTIONS)
def normalize_rows(x, weight, bias, eps, center, out, normalized, inverse_std):
    """For each row r of the 2-D float32 ``x`` (rows, features): ``n = (x - mean) / sqrt(var
    + eps)`` (mean 0 without ``center``: RMS normalization), ``out[r] = n * weight + bias``,
    and where ``normalized`` has x's rows, ``normalized[r] = n`` and ``inverse_std[r] =
    1 / sqrt(var + eps)``. Sums in float64."""
    rows, features = x.shape
    keep = normalized.shape[0] == rows
    for r in range(rows):
        row = x[r]
        mean = 0.0
        if center:
            total = 0.0
            for i in range(features):
                total += row[i]
            mean = total / features
        squares = 0.0
        for i in range(features):
            deviation = row[i] - mean
            squares += deviation * deviation
        inverse = 1.0 / math.sqrt(squares / features + eps)
        if keep:
            inverse_std[r] = inverse
            for i in range(features):
                value = (row[i] - mean) * inverse
                normalized[r, i] = value
                out[r, i] = _fused_multiply_add(value, np.float64(weight[i]), np.float64(bias[i]))
        else:  # (the same expressions: the same bits with or without the backward's copies)
            for i in range(features):
                value = (row[i] - mean) * inverse
                out[r, i] = _fused_multiply_add(value, np.float64(weight[i]), np.float64(bias[i]))


_NOTHING = np.empty((0, 0), np.float32)


def normalize(x, weight, bias, eps: float, center: bool, keep: bool):
    """``(out, normalized, inverse_std)`` of a float32 NumPy ``x`` (..., features) with
    float32 ``weight`` and ``bias`` (features,) or None: fresh C-contiguous float32 arrays,
    ``inverse_std`` of shape (..., 1); the last two None unless ``keep`` (the backward's)."""
    features = x.shape[-1]
    rows = np.ascontiguousarray(x).reshape(-1, features)
    weight = np.ones(features, np.float32) if weight is None else np.ascontiguousarray(weight)
    bias = np.zeros(features, np.float32) if bias is None else np.ascontiguousarray(bias)
    out = np.empty(rows.shape, np.float32)
    normalized = np.empty(rows.shape, np.float32) if keep else _NOTHING
    inverse_std = np.empty(rows.shape[0] if keep else 0, np.float32)
    normalize_rows(rows, weight, bias, float(eps), bool(center), out, normalized, inverse_std)
    if not keep:
        return out.reshape(x.shape), None, None
    return out.reshape(x.shape), normalized.reshape(x.shape), inverse_std.reshape(*x.shape[:-1], 1)
