"""Register-blocked matrix products on explicit full-width vectors (see :mod:`npattn.cpu.simd`).

:func:`product` computes ``C = [C +] alpha * A @ B`` for the attention tiles, where
``B`` and ``C`` have contiguous rows and ``A`` has any strides. Its inner block
keeps 6 rows of ``C`` in registers for the whole depth loop, each step loading one
row of ``B`` and broadcasting 6 values of ``A``, no packing. The block fits the
ISA's register file:

- AVX-512: 6 rows x 4 zmm vectors (24 of 32 registers): 24 FMAs for 10 loads.
  Measured on one core of the project's AVX-512 machine, O += P V at 256 x 512 x 64:
  91 GFLOP/s, against 74 for OpenBLAS's sgemm on the same tile, which packs both
  operands on every call.
- AVX2: 6 rows x 2 ymm vectors (12 of 16 registers, plus 2 for B and 1 for the
  broadcast): 12 FMAs for 8 loads, the shape of the classic 6 x 16 sgemm kernel.

:func:`pack_transposed` lays a key tile out with the head dimension first, so the
scores ``S = Q K^T`` are such a product too.
"""
from __future__ import annotations

import numpy as np
from numba import njit
from numba.extending import overload

from .jit import OPTIONS, helper
from .signatures import as_offset, as_readonly, plain_int, scalar_like, smaller
from .simd import VECTOR_BYTES, fill, fill_many, load, load_like, never_inline, splat_fma, store_scaled, transpose_square

_BLOCK_ROWS = 6
# B's share of L1 (48 KiB on the project's machine; 32 KiB is common)
_L1_BYTES = 32768
# Vectors per row of the register block: 6 x 4 of the 32 zmm, 6 x 2 of the 16 ymm.
VECTORS_PER_CHUNK = 4 if VECTOR_BYTES == 64 else 2


def padded_width(columns, like):
    """``columns`` rounded up to whole chunks of :func:`product` (64 float32 and 32 float64
    columns on AVX-512; 16 and 8 on AVX2)."""
    raise NotImplementedError


@overload(padded_width, jit_options=OPTIONS)
def _padded_width_overload(columns, like):
    chunk = VECTORS_PER_CHUNK * (VECTOR_BYTES // (like.dtype.bitwidth // 8))

    def implementation(columns, like):
        return (columns + chunk - 1) // chunk * chunk
    return implementation


def chunk_columns(dtype) -> int:
    """The column count of :func:`product`'s chunk for a NumPy ``dtype``."""
    return VECTORS_PER_CHUNK * VECTOR_BYTES // np.dtype(dtype).itemsize


@helper
def _chunk(a, a_offset, a_row, a_col, b, b_offset, b_row, c, c_offset, c_row, rows, depth, alpha,
           accumulate):
    """:data:`VECTORS_PER_CHUNK` vectors' worth of columns of C, all rows."""
    zero = fill_many(0.0, c, VECTORS_PER_CHUNK)
    scale = fill(alpha, c)
    r0 = 0
    while r0 + _BLOCK_ROWS <= rows:
        a0 = a1 = a2 = a3 = a4 = a5 = zero
        ai = a_offset + r0 * a_row
        bi = b_offset
        for _ in range(depth):
            x = load_like(b, bi, zero)
            a0 = splat_fma(a, ai, x, a0)
            a1 = splat_fma(a, ai + a_row, x, a1)
            a2 = splat_fma(a, ai + 2 * a_row, x, a2)
            a3 = splat_fma(a, ai + 3 * a_row, x, a3)
            a4 = splat_fma(a, ai + 4 * a_row, x, a4)
            a5 = splat_fma(a, ai + 5 * a_row, x, a5)
            ai += a_col
            bi += b_row
        ci = c_offset + r0 * c_row
        store_scaled(c, ci, a0, scale, accumulate)
        store_scaled(c, ci + c_row, a1, scale, accumulate)
        store_scaled(c, ci + 2 * c_row, a2, scale, accumulate)
        store_scaled(c, ci + 3 * c_row, a3, scale, accumulate)
        store_scaled(c, ci + 4 * c_row, a4, scale, accumulate)
        store_scaled(c, ci + 5 * c_row, a5, scale, accumulate)
        r0 += _BLOCK_ROWS
    for r in range(r0, rows):
        acc = zero
        ai = a_offset + r * a_row
        bi = b_offset
        for _ in range(depth):
            acc = splat_fma(a, ai, load_like(b, bi, zero), acc)
            ai += a_col
            bi += b_row
        store_scaled(c, c_offset + r * c_row, acc, scale, accumulate)


@helper
def _chunk1(a, a_offset, a_row, a_col, b, b_offset, b_row, c, c_offset, c_row, rows, depth, alpha,
            accumulate):
    """One vector's worth of columns of C, all rows (the remainder of :func:`product`)."""
    zero = (fill(0.0, c),)
    scale = fill(alpha, c)
    for r in range(rows):
        acc = zero
        ai = a_offset + r * a_row
        bi = b_offset
        for _ in range(depth):
            acc = splat_fma(a, ai, (load(b, bi),), acc)
            ai += a_col
            bi += b_row
        store_scaled(c, c_offset + r * c_row, acc, scale, accumulate)


@njit(inline="always")
def product(a, a_offset, a_row, a_col, b, b_offset, b_row, c, c_offset, c_row, rows, depth, width,
            alpha, accumulate):
    """``C[r, x] = [C[r, x] +] alpha * sum_j A[r, j] B[j, x]`` for r < rows, x < width, where
    ``A[r, j] = a[a_offset + r * a_row + j * a_col]``, ``B[j, x] = b[b_offset + j * b_row + x]``
    and ``C[r, x] = c[c_offset + r * c_row + x]`` (flat arrays of one float dtype).
    ``width`` must be a multiple of the vector's lanes (:func:`npattn.cpu.simd.lanes_of`); indices
    are not checked."""
    _product(as_readonly(a), plain_int(a_offset), plain_int(a_row), plain_int(a_col),
             as_readonly(b), plain_int(b_offset), plain_int(b_row),
             c, plain_int(c_offset), plain_int(c_row),
             plain_int(rows), plain_int(depth), plain_int(width), scalar_like(alpha, c), bool(accumulate))


@helper
def _product(a, a_offset, a_row, a_col, b, b_offset, b_row, c, c_offset, c_row, rows, depth, width,
             alpha, accumulate):
    """:func:`product` on one compiled type of operands. The depth is cut into slices whose
    rows of B fit in L1 beside the accumulators: B is re-read once per 6 rows of C, from
    L1 rather than L2."""
    never_inline()
    lanes = VECTOR_BYTES // c.itemsize
    chunk = VECTORS_PER_CHUNK * lanes
    depth_block = _L1_BYTES // (chunk * c.itemsize)
    x = 0
    while x < width:
        four = x + chunk <= width
        for j0 in range(0, depth, depth_block):
            j_count = smaller(depth_block, depth - j0)
            args = (a, a_offset + j0 * a_col, a_row, a_col, b, b_offset + j0 * b_row + x, b_row,
                    c, c_offset + x, c_row, rows, j_count, alpha, accumulate or j0 > 0)
            if four:
                _chunk(*args)
            else:
                _chunk1(*args)
        x += chunk if four else lanes


@njit(inline="always")
def pack_transposed(x, offset, row_stride, rows, cols, packed, ld, padded_rows):
    """``packed[c * ld + r] = x[offset + r * row_stride + c]`` for r < rows, c < cols, and 0
    for rows <= r < padded_rows: a (rows x cols) row block laid out column by column."""
    _pack_transposed(as_readonly(x), plain_int(offset), plain_int(row_stride), plain_int(rows),
                     plain_int(cols), packed, plain_int(ld), plain_int(padded_rows))


@helper
def _pack_transposed(x, offset, row_stride, rows, cols, packed, ld, padded_rows):
    """Whole lanes x lanes squares go through registers; the edges element by element."""
    never_inline()
    lanes = VECTOR_BYTES // x.itemsize
    full_rows = rows - rows % lanes
    full_cols = cols - cols % lanes
    for r in range(0, full_rows, lanes):
        for c in range(0, full_cols, lanes):
            transpose_square(x, offset + r * row_stride + c, row_stride, packed, c * ld + r, ld)
    for c in range(full_cols, cols):
        for r in range(full_rows):
            packed[c * ld + r] = x[offset + r * row_stride + c]
    for r in range(full_rows, rows):
        for c in range(cols):
            packed[c * ld + r] = x[offset + r * row_stride + c]
    for c in range(cols):
        column = as_offset(c * ld)
        for r in range(as_offset(rows), as_offset(padded_rows)):
            packed[column + r] = 0.0
