"""A decode step's products straight from an int8 cache's codes, converted in registers.

A quantized decode step is a few query rows (a GQA group folded into rows) against many
keys. Dequantizing a key tile into a float32 staging first (:func:`~npattn.cpu.tiles.dequantize_tile`)
costs more than the products that read it: each code is converted, scaled, stored, then
loaded again once per query row. Here the codes are loaded as int8 and converted in
registers (:func:`~npattn.cpu.simd.load_int8`, exact), and the per-key scale is applied
once per product instead of once per value:

- :func:`code_dot_products`: ``S[r, j] = alpha * scale_j * (q_r . codes_j)``,
- :func:`code_product`: ``O[r, :] += sum_j (P[r, j] * scale_j) * codes_j``.

Both round differently from the float32 staging (one scale multiply per product, not
per value); the sums are the same float32 sums otherwise, within the same error bound of
the float64 result on the dequantized cache.
"""
from __future__ import annotations

from numba import njit

from .jit import helper
from .signatures import as_readonly, plain_int, scalar_like
from .simd import VECTOR_BYTES, add, fill, horizontal_sum, load, load_int8, multiply_add, never_inline, store


@njit(inline="always")
def code_dot_products(a, a_offset, a_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c, c_offset,
                      c_row, rows, cols, depth, alpha):
    """``C[r, j] = alpha * scales[scale_offset + j * scale_step] * sum_x A[r, x] B[j, x]``
    for r < rows, j < cols, where ``A[r, x] = a[a_offset + r * a_row + x]`` (floats),
    ``B[j, x] = codes[b_offset + j * b_row + x]`` (int8) and ``C[r, j] = c[c_offset + r *
    c_row + j]``; ``depth`` a multiple of the vector's lanes."""
    _code_dot_products(as_readonly(a), plain_int(a_offset), plain_int(a_row), as_readonly(codes),
                       plain_int(b_offset), plain_int(b_row), as_readonly(scales), plain_int(scale_offset),
                       plain_int(scale_step), c, plain_int(c_offset), plain_int(c_row), plain_int(rows),
                       plain_int(cols), plain_int(depth), scalar_like(alpha, c))


@helper
def _code_dot_products(a, a_offset, a_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c, c_offset,
                       c_row, rows, cols, depth, alpha):
    """4 keys at a time against 2 query rows (8 FMA chains; each key's codes converted
    once per pair of rows), or 1 row for an odd last one; then the keys left one by one."""
    never_inline()
    lanes = VECTOR_BYTES // c.itemsize
    zero = fill(0.0, c)
    j = 0
    while j + 4 <= cols:
        k = b_offset + j * b_row
        factors = (alpha * scales[scale_offset + j * scale_step], alpha * scales[scale_offset + (j + 1) * scale_step],
                   alpha * scales[scale_offset + (j + 2) * scale_step],
                   alpha * scales[scale_offset + (j + 3) * scale_step])
        r = 0
        while r + 2 <= rows:
            q0 = a_offset + r * a_row
            q1 = q0 + a_row
            s0 = s1 = s2 = s3 = t0 = t1 = t2 = t3 = zero
            for x in range(0, depth, lanes):
                b0, b1 = load_int8(codes, k + x, zero), load_int8(codes, k + b_row + x, zero)
                b2, b3 = load_int8(codes, k + 2 * b_row + x, zero), load_int8(codes, k + 3 * b_row + x, zero)
                row = load(a, q0 + x)
                s0, s1 = multiply_add(row, b0, s0), multiply_add(row, b1, s1)
                s2, s3 = multiply_add(row, b2, s2), multiply_add(row, b3, s3)
                row = load(a, q1 + x)
                t0, t1 = multiply_add(row, b0, t0), multiply_add(row, b1, t1)
                t2, t3 = multiply_add(row, b2, t2), multiply_add(row, b3, t3)
            _store_four(c, c_offset + r * c_row + j, factors, s0, s1, s2, s3)
            _store_four(c, c_offset + (r + 1) * c_row + j, factors, t0, t1, t2, t3)
            r += 2
        if r < rows:
            q0 = a_offset + r * a_row
            s0 = s1 = s2 = s3 = zero
            for x in range(0, depth, lanes):
                row = load(a, q0 + x)
                s0 = multiply_add(row, load_int8(codes, k + x, zero), s0)
                s1 = multiply_add(row, load_int8(codes, k + b_row + x, zero), s1)
                s2 = multiply_add(row, load_int8(codes, k + 2 * b_row + x, zero), s2)
                s3 = multiply_add(row, load_int8(codes, k + 3 * b_row + x, zero), s3)
            _store_four(c, c_offset + r * c_row + j, factors, s0, s1, s2, s3)
        j += 4
    while j < cols:
        k = b_offset + j * b_row
        factor = alpha * scales[scale_offset + j * scale_step]
        for r in range(rows):
            q0 = a_offset + r * a_row
            s0 = zero
            for x in range(0, depth, lanes):
                s0 = multiply_add(load(a, q0 + x), load_int8(codes, k + x, zero), s0)
            c[c_offset + r * c_row + j] = factor * horizontal_sum(s0)
        j += 1


@njit(inline="always")
def _store_four(c, at, factors, s0, s1, s2, s3):
    c[at] = factors[0] * horizontal_sum(s0)
    c[at + 1] = factors[1] * horizontal_sum(s1)
    c[at + 2] = factors[2] * horizontal_sum(s2)
    c[at + 3] = factors[3] * horizontal_sum(s3)


@njit(inline="always")
def code_product(p, p_offset, p_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c, c_offset, c_row,
                 rows, cols, width):
    """``C[r, x] += sum_j (P[r, j] * scales[scale_offset + j * scale_step]) * B[j, x]`` for
    r < rows, j < cols, x < width, where ``P[r, j] = p[p_offset + r * p_row + j]`` (floats),
    ``B[j, x] = codes[b_offset + j * b_row + x]`` (int8) and ``C[r, x] = c[c_offset + r *
    c_row + x]``; ``width`` a multiple of the vector's lanes."""
    _code_product(as_readonly(p), plain_int(p_offset), plain_int(p_row), as_readonly(codes), plain_int(b_offset),
                  plain_int(b_row), as_readonly(scales), plain_int(scale_offset), plain_int(scale_step), c,
                  plain_int(c_offset), plain_int(c_row), plain_int(rows), plain_int(cols), plain_int(width))


@helper
def _code_product(p, p_offset, p_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c, c_offset, c_row,
                  rows, cols, width):
    """Columns 4 vectors at a time (then one at a time), 2 rows of C at a time (then an odd
    last one) held in registers over every key: each key's codes of those columns converted
    once per pair of rows, its probabilities scaled once."""
    never_inline()
    lanes = VECTOR_BYTES // c.itemsize
    zero = fill(0.0, c)
    x0 = 0
    while x0 < width:
        wide = x0 + 4 * lanes <= width  # 4 vectors, else 1
        r = 0
        while r < rows:
            two = r + 1 < rows
            first, second = p_offset + r * p_row, p_offset + (r + 1) * p_row
            s0 = s1 = s2 = s3 = t0 = t1 = t2 = t3 = zero
            for j in range(cols):
                scale = scales[scale_offset + j * scale_step]
                weight = fill(scalar_like(p[first + j] * scale, c), c)
                at = b_offset + j * b_row + x0
                b0 = load_int8(codes, at, zero)
                b1 = b2 = b3 = zero
                s0 = multiply_add(weight, b0, s0)
                if wide:
                    b1, b2, b3 = (load_int8(codes, at + lanes, zero), load_int8(codes, at + 2 * lanes, zero),
                                  load_int8(codes, at + 3 * lanes, zero))
                    s1, s2, s3 = multiply_add(weight, b1, s1), multiply_add(weight, b2, s2), multiply_add(weight, b3, s3)
                if two:
                    weight = fill(scalar_like(p[second + j] * scale, c), c)
                    t0 = multiply_add(weight, b0, t0)
                    if wide:
                        t1, t2, t3 = (multiply_add(weight, b1, t1), multiply_add(weight, b2, t2),
                                      multiply_add(weight, b3, t3))
            _add_row(c, c_offset + r * c_row + x0, lanes, wide, s0, s1, s2, s3)
            if two:
                _add_row(c, c_offset + (r + 1) * c_row + x0, lanes, wide, t0, t1, t2, t3)
            r += 2
        x0 += 4 * lanes if wide else lanes


@njit(inline="always")
def _add_row(c, at, lanes, wide, s0, s1, s2, s3):
    store(c, at, add(load(c, at), s0))
    if wide:
        store(c, at + lanes, add(load(c, at + lanes), s1))
        store(c, at + 2 * lanes, add(load(c, at + 2 * lanes), s2))
        store(c, at + 3 * lanes, add(load(c, at + 3 * lanes), s3))
