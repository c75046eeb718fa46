"""A decode step's products straight from an int8 or float8 e4m3 cache's codes, converted in registers.

A quantized decode step is a few query rows (a GQA group folded into rows) against many
keys. Dequantizing a key tile into a float32 staging first (:func:`~npattn.cpu.tiles.dequantize_tile`)
costs more than the products that read it: each code is converted, scaled, stored, then
loaded again once per query row. Here the codes are loaded as bytes and converted in registers
(:func:`~npattn.cpu.simd.load_code`, exact: int8, or e4m3 as 2**-8 times its value,
which the key's scale takes back), and the per-key scale is applied once per product
instead of once per value:

- :func:`code_dot_products`: ``S[r, j] = alpha * scale_j * (q_r . codes_j)``,
- :func:`code_product`: ``O[r, :] += sum_j (P[r, j] * scale_j) * codes_j``.

Both round differently from the float32 staging (one scale multiply per product, not
per value); the sums are the same float32 sums otherwise, within the same error bound of
the float64 result on the dequantized cache. Compiled for float32 sums only (float32 and
16-bit queries): a float64 query's step, rare, dequantizes its tiles, and its kernels skip
this code's compile (a first float64 forward compiled in 16.8-21.8 s with it, 13.9 without).
"""
from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from .jit import OPTIONS, helper
from .signatures import as_offset, as_readonly, plain_int, scalar_like
from .simd import (VECTOR_BYTES, add, fill, horizontal_sum, lanes_in, load, load_code, multiply_add, never_inline,
                   store, store_key_sums)


# Query rows per register block, on both ISAs: each key's codes are converted once for a
# GQA group of 4; rows left over go one at a time (no 2-row block: each block size is
# compiled into both kernels, 2-3 s of a first call's compile). Keys per dot-product block
# and value vectors per product block: as many as leave the accumulators in registers,
# 4 x 4 of the 32 zmm, 4 x 2 of the 16 ymm. (AVX2 blocks were 2 rows x 4 keys, which
# converted each key's codes twice for a group of 4. Measured on the Zen 4 VM forced to
# AVX2, one core, (1, 32/8, 4096, 128): e4m3 90-91 -> 70-71 ns per key and kv head, int8
# unchanged at 50; the same bits, the sums being the same chains)
ROW_BLOCK = 4
KEY_BLOCK = 4 if VECTOR_BYTES == 64 else 2
VECTOR_BLOCK = KEY_BLOCK
# Whether P V scales its probabilities once, in place, before the blocks: with AVX2's
# blocks of 2 vectors, scaling them per block costs a scalar multiply and a broadcast per
# key and row for 2 FMAs. One core of the Zen 4 VM, (1, 32/8, 4096, 128): forced to AVX2,
# int8 49.6-52.1 -> 46.1-47.1 ns per key and kv head, e4m3 68.7-70 -> 66-67; with AVX-512's
# blocks of 4 vectors, e4m3 47.8-48.5 -> 49.5-50.6 (int8 within the noise), so not there.
SCALED_FIRST = VECTOR_BLOCK == 2
# What an e4m3 code's scale is multiplied by: load_code gives 2**-8 times its value
E4M3_UNIT = np.float32(256.0)
_ONE = np.float32(1.0)


def code_dot_products(a, a_offset, a_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c, c_offset,
                      c_row, rows, cols, depth, alpha, e4m3):
    """``C[r, j] = alpha * scales[scale_offset + j * scale_step] * sum_x A[r, x] B[j, x]``
    for r < rows, j < cols, where ``A[r, x] = a[a_offset + r * a_row + x]`` (floats),
    ``B[j, x]`` the value of the byte ``codes[b_offset + j * b_row + x]`` (int8, or with
    ``e4m3`` float8 e4m3) and ``C[r, j] = c[c_offset + r * c_row + j]``; ``depth`` a
    multiple of the vector's lanes. float32 only (see
    :func:`~npattn.cpu.tiles.codes_in_registers`): elsewhere a stub that does nothing."""
    raise NotImplementedError


@overload(code_dot_products, jit_options=OPTIONS)
def _code_dot_products_overload(a, a_offset, a_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c,
                                c_offset, c_row, rows, cols, depth, alpha, e4m3):
    if c.dtype != types.float32:
        return lambda a, a_offset, a_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c, c_offset, \
            c_row, rows, cols, depth, alpha, e4m3: None

    def implementation(a, a_offset, a_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c, c_offset,
                       c_row, rows, cols, depth, alpha, e4m3):
        _code_dot_products(as_readonly(a), plain_int(a_offset), plain_int(a_row), as_readonly(codes),
                           plain_int(b_offset), plain_int(b_row), as_readonly(scales), plain_int(scale_offset),
                           plain_int(scale_step), c, plain_int(c_offset), plain_int(c_row), plain_int(rows),
                           plain_int(cols), plain_int(depth), scalar_like(alpha, c), bool(e4m3))
    return implementation


@helper
def _code_dot_products(a, a_offset, a_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c, c_offset,
                       c_row, rows, cols, depth, alpha, e4m3):
    """:func:`_dot_products_of` for int8 codes or e4m3 codes, each compiled with its own
    decode (a constant there)."""
    never_inline()
    if e4m3:
        _dot_products_of(a, a_offset, a_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c, c_offset,
                         c_row, rows, cols, depth, alpha * E4M3_UNIT, True)
    else:
        _dot_products_of(a, a_offset, a_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c, c_offset,
                         c_row, rows, cols, depth, alpha, False)


@njit(inline="always")
def _dot_products_of(a, a_offset, a_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c, c_offset,
                     c_row, rows, cols, depth, alpha, e4m3):
    """:data:`KEY_BLOCK` keys at a time against blocks of :data:`ROW_BLOCK` query rows, then
    single rows (each key's codes converted once per block, a FMA chain per key and row);
    then the keys left one by one. ``alpha`` takes an e4m3 code's 2**8 (:data:`E4M3_UNIT`)."""
    lanes = lanes_in(c)
    j = 0
    while j + KEY_BLOCK <= cols:
        k = b_offset + j * b_row
        factors = _key_factors(scales, scale_offset + j * scale_step, scale_step, alpha)
        r = 0
        while r + ROW_BLOCK <= rows:
            _key_block(a, a_offset + r * a_row, a_row, codes, k, b_row, c, c_offset + r * c_row + j, c_row,
                       factors, ROW_BLOCK, depth, lanes, e4m3)
            r += ROW_BLOCK
        while r < rows:
            _key_block(a, a_offset + r * a_row, a_row, codes, k, b_row, c, c_offset + r * c_row + j, c_row,
                       factors, 1, depth, lanes, e4m3)
            r += 1
        j += KEY_BLOCK
    zero = fill(0.0, c)
    while j < cols:
        k = b_offset + j * b_row
        factor = alpha * scales[as_offset(scale_offset + j * scale_step)]
        for r in range(rows):
            q0 = a_offset + r * a_row
            s0 = zero
            for x in range(0, depth, lanes):
                s0 = multiply_add(load(a, q0 + x), load_code(codes, k + x, zero, e4m3), s0)
            c[as_offset(c_offset + r * c_row + j)] = factor * horizontal_sum(s0)
        j += 1


@njit(inline="always")
def _key_factors(scales, at, step, alpha):
    """``alpha`` times the scales of a block's :data:`KEY_BLOCK` keys, a tuple."""
    if KEY_BLOCK == 4:
        return (alpha * scales[as_offset(at)], alpha * scales[as_offset(at + step)],
                alpha * scales[as_offset(at + 2 * step)], alpha * scales[as_offset(at + 3 * step)])
    return alpha * scales[as_offset(at)], alpha * scales[as_offset(at + step)]


@njit(inline="always")
def _key_block(a, q_at, a_row, codes, k, b_row, c, c_at, c_row, factors, rows, depth, lanes, e4m3):
    """The scores of :data:`KEY_BLOCK` keys for ``rows`` (1 or :data:`ROW_BLOCK`, a
    constant) query rows of :func:`_dot_products_of`: the accumulators of query row r are
    s, t, u, w, numbered by key."""
    zero = fill(0.0, c)
    s0 = s1 = s2 = s3 = t0 = t1 = t2 = t3 = u0 = u1 = u2 = u3 = w0 = w1 = w2 = w3 = b2 = b3 = zero
    for x in range(0, depth, lanes):
        b0, b1 = load_code(codes, k + x, zero, e4m3), load_code(codes, k + b_row + x, zero, e4m3)
        if KEY_BLOCK == 4:
            b2, b3 = load_code(codes, k + 2 * b_row + x, zero, e4m3), load_code(codes, k + 3 * b_row + x, zero, e4m3)
        row = load(a, q_at + x)
        s0, s1 = multiply_add(row, b0, s0), multiply_add(row, b1, s1)
        if KEY_BLOCK == 4:
            s2, s3 = multiply_add(row, b2, s2), multiply_add(row, b3, s3)
        if rows == 4:
            row = load(a, q_at + a_row + x)
            t0, t1 = multiply_add(row, b0, t0), multiply_add(row, b1, t1)
            if KEY_BLOCK == 4:
                t2, t3 = multiply_add(row, b2, t2), multiply_add(row, b3, t3)
            row = load(a, q_at + 2 * a_row + x)
            u0, u1 = multiply_add(row, b0, u0), multiply_add(row, b1, u1)
            if KEY_BLOCK == 4:
                u2, u3 = multiply_add(row, b2, u2), multiply_add(row, b3, u3)
            row = load(a, q_at + 3 * a_row + x)
            w0, w1 = multiply_add(row, b0, w0), multiply_add(row, b1, w1)
            if KEY_BLOCK == 4:
                w2, w3 = multiply_add(row, b2, w2), multiply_add(row, b3, w3)
    if rows == 4 and KEY_BLOCK == 4:
        store_key_sums(c, c_at, c_row, (s0, s1, s2, s3, t0, t1, t2, t3, u0, u1, u2, u3, w0, w1, w2, w3), factors)
    elif rows == 4:
        store_key_sums(c, c_at, c_row, (s0, s1, t0, t1, u0, u1, w0, w1), factors)
    elif KEY_BLOCK == 4:
        store_key_sums(c, c_at, c_row, (s0, s1, s2, s3), factors)
    else:
        store_key_sums(c, c_at, c_row, (s0, s1), factors)


def code_product(p, p_offset, p_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c, c_offset, c_row,
                 rows, cols, width, e4m3):
    """``C[r, x] += sum_j (P[r, j] * scales[scale_offset + j * scale_step]) * B[j, x]`` for
    r < rows, j < cols, x < width, where ``P[r, j] = p[p_offset + r * p_row + j]`` (floats),
    ``B[j, x]`` the value of the byte ``codes[b_offset + j * b_row + x]`` (int8, or with
    ``e4m3`` float8 e4m3) and ``C[r, x] = c[c_offset + r * c_row + x]``; ``width`` a
    multiple of the vector's lanes. May leave each ``P[r, j]`` times its scale in ``p``
    (:data:`SCALED_FIRST`: the forward is done with the probabilities by then). float32
    only, as :func:`code_dot_products`."""
    raise NotImplementedError


@overload(code_product, jit_options=OPTIONS)
def _code_product_overload(p, p_offset, p_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c, c_offset,
                           c_row, rows, cols, width, e4m3):
    if c.dtype != types.float32:
        return lambda p, p_offset, p_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c, c_offset, \
            c_row, rows, cols, width, e4m3: None

    def implementation(p, p_offset, p_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c, c_offset,
                       c_row, rows, cols, width, e4m3):
        _code_product(p, plain_int(p_offset), plain_int(p_row), as_readonly(codes), plain_int(b_offset),
                      plain_int(b_row), as_readonly(scales), plain_int(scale_offset), plain_int(scale_step), c,
                      plain_int(c_offset), plain_int(c_row), plain_int(rows), plain_int(cols), plain_int(width),
                      bool(e4m3))
    return implementation


@helper
def _code_product(p, p_offset, p_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c, c_offset, c_row,
                  rows, cols, width, e4m3):
    """:func:`_product_of` for int8 codes or e4m3 codes, each compiled with its own decode."""
    never_inline()
    if e4m3:
        _product_of(p, p_offset, p_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c, c_offset, c_row,
                    rows, cols, width, E4M3_UNIT, True)
    else:
        _product_of(p, p_offset, p_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c, c_offset, c_row,
                    rows, cols, width, _ONE, False)


@njit(inline="always")
def _product_of(p, p_offset, p_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c, c_offset, c_row,
                rows, cols, width, unit, e4m3):
    """Columns :data:`VECTOR_BLOCK` vectors at a time, blocks of :data:`ROW_BLOCK` rows of C
    (then single rows) held in registers over every key: each key's codes of those columns
    converted once per block, its probabilities scaled (by the scale times ``unit``, an
    e4m3 code's 2**8) once per block, or once in all (:data:`SCALED_FIRST`); then the
    columns left a vector at a time. Each weight rounds the same either way."""
    if SCALED_FIRST:
        for j in range(cols):
            scale = scales[as_offset(scale_offset + j * scale_step)] * unit
            for r in range(rows):
                at = as_offset(p_offset + r * p_row + j)
                p[at] = scalar_like(p[at] * scale, c)
    lanes = lanes_in(c)
    x0 = 0
    while x0 + VECTOR_BLOCK * lanes <= width:
        r = 0
        while r + ROW_BLOCK <= rows:
            _vector_block(p, p_offset + r * p_row, p_row, codes, b_offset + x0, b_row, scales, scale_offset,
                          scale_step, c, c_offset + r * c_row + x0, c_row, ROW_BLOCK, cols, lanes, unit, e4m3)
            r += ROW_BLOCK
        while r < rows:
            _vector_block(p, p_offset + r * p_row, p_row, codes, b_offset + x0, b_row, scales, scale_offset,
                          scale_step, c, c_offset + r * c_row + x0, c_row, 1, cols, lanes, unit, e4m3)
            r += 1
        x0 += VECTOR_BLOCK * lanes
    while x0 < width:
        for r in range(rows):
            _one_vector(p, p_offset + r * p_row, codes, b_offset + x0, b_row, scales, scale_offset, scale_step, c,
                        c_offset + r * c_row + x0, cols, unit, e4m3)
        x0 += lanes


@njit(inline="always")
def _vector_block(p, p_at, p_row, codes, b_at, b_row, scales, scale_offset, scale_step, c, c_at, c_row, rows, cols,
                  lanes, unit, e4m3):
    """:data:`VECTOR_BLOCK` vectors of columns of ``rows`` (1 or :data:`ROW_BLOCK`, a
    constant) rows of :func:`_product_of`: the accumulators of row r are s, t, u, w,
    numbered by vector."""
    zero = fill(0.0, c)
    s0 = s1 = s2 = s3 = t0 = t1 = t2 = t3 = u0 = u1 = u2 = u3 = w0 = w1 = w2 = w3 = b2 = b3 = zero
    for j in range(cols):
        scale = _weight_scale(scales, scale_offset + j * scale_step, unit)
        at = b_at + j * b_row
        b0, b1 = load_code(codes, at, zero, e4m3), load_code(codes, at + lanes, zero, e4m3)
        if VECTOR_BLOCK == 4:
            b2, b3 = load_code(codes, at + 2 * lanes, zero, e4m3), load_code(codes, at + 3 * lanes, zero, e4m3)
        weight = _weight(p, p_at + j, scale, c)
        s0, s1 = multiply_add(weight, b0, s0), multiply_add(weight, b1, s1)
        if VECTOR_BLOCK == 4:
            s2, s3 = multiply_add(weight, b2, s2), multiply_add(weight, b3, s3)
        if rows == 4:
            weight = _weight(p, p_at + p_row + j, scale, c)
            t0, t1 = multiply_add(weight, b0, t0), multiply_add(weight, b1, t1)
            if VECTOR_BLOCK == 4:
                t2, t3 = multiply_add(weight, b2, t2), multiply_add(weight, b3, t3)
            weight = _weight(p, p_at + 2 * p_row + j, scale, c)
            u0, u1 = multiply_add(weight, b0, u0), multiply_add(weight, b1, u1)
            if VECTOR_BLOCK == 4:
                u2, u3 = multiply_add(weight, b2, u2), multiply_add(weight, b3, u3)
            weight = _weight(p, p_at + 3 * p_row + j, scale, c)
            w0, w1 = multiply_add(weight, b0, w0), multiply_add(weight, b1, w1)
            if VECTOR_BLOCK == 4:
                w2, w3 = multiply_add(weight, b2, w2), multiply_add(weight, b3, w3)
    _add_block(c, c_at, lanes, s0, s1, s2, s3)
    if rows == 4:
        _add_block(c, c_at + c_row, lanes, t0, t1, t2, t3)
        _add_block(c, c_at + 2 * c_row, lanes, u0, u1, u2, u3)
        _add_block(c, c_at + 3 * c_row, lanes, w0, w1, w2, w3)


@njit(inline="always")
def _weight_scale(scales, at, unit):
    """A key's scale times ``unit``, where the block scales its probabilities (None where
    :data:`SCALED_FIRST` did)."""
    if SCALED_FIRST:
        return None
    return scales[as_offset(at)] * unit


@njit(inline="always")
def _weight(p, at, scale, c):
    """The vector of ``p[at]`` times ``scale`` (``p[at]`` itself, scaled first: ``scale`` None)."""
    if SCALED_FIRST:
        return fill(p[as_offset(at)], c)
    return fill(scalar_like(p[as_offset(at)] * scale, c), c)


@njit(inline="always")
def _one_vector(p, p_at, codes, b_at, b_row, scales, scale_offset, scale_step, c, c_at, cols, unit, e4m3):
    """One vector of columns of one row of :func:`_product_of`."""
    zero = fill(0.0, c)
    s0 = zero
    for j in range(cols):
        weight = _weight(p, p_at + j, _weight_scale(scales, scale_offset + j * scale_step, unit), c)
        s0 = multiply_add(weight, load_code(codes, b_at + j * b_row, zero, e4m3), s0)
    store(c, c_at, add(load(c, c_at), s0))


@njit(inline="always")
def _add_block(c, at, lanes, s0, s1, s2, s3):
    """A row's :data:`VECTOR_BLOCK` accumulators added into ``c`` from ``at``."""
    store(c, at, add(load(c, at), s0))
    store(c, at + lanes, add(load(c, at + lanes), s1))
    if VECTOR_BLOCK == 4:
        store(c, at + 2 * lanes, add(load(c, at + 2 * lanes), s2))
        store(c, at + 3 * lanes, add(load(c, at + 3 * lanes), s3))
