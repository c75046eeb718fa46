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
scores ``S = Q K^T`` are such a product too. For a few query rows (a decode step) that
copy costs more than the products: :func:`dot_products` takes their scores straight
from the key rows, one fixed sum per score.
"""
from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from .amx import TILES, tile_pair_product
from .jit import OPTIONS, helper
from .signatures import as_offset, as_readonly, plain_int, scalar_like, smaller
from .simd import (BF16_DOT, VECTOR_BYTES, add, always_inline, as_bits, as_float, fill, horizontal_sum, lanes_in,
                   load, load_first, load_like, multiply, multiply_add, never_inline, repeat, splat_fma_rows,
                   splat_pair_dot_rows, store, store_first, store_scaled_rows, transpose_square)

_BLOCK_ROWS = 6
# B's share of L1 (48 KiB on the project's machine; 32 KiB is common)
_L1_BYTES = 32768
# Vectors per row of the register block: 6 x 4 of the 32 zmm, 6 x 2 of the 16 ymm.
VECTORS_PER_CHUNK = 4 if VECTOR_BYTES == 64 else 2
# For a single row of C (a decode step's query row without GQA) a chunk of that width
# gives 2 (4) FMA chains, each as long as the depth, so the FMAs wait on each other's
# latency: such a row takes chunks this many vectors wide instead (6 ymm, 8 zmm).
# Measured on one core of the AVX2 VM, the 1-row products of a decode tile, P V at
# 1 x 384 x 128 and Q K^T at 1 x 128 x 384: 5.2-5.4 -> 3.7-4.5 us and 6.9 -> 4.3 us.
# Two rows gained nothing (2 x 2 vectors are already 4 chains; 2 x 6 was slower).
WIDE_VECTORS = 8 if VECTOR_BYTES == 64 else 6
WIDE_ROWS = 1
# The rows of B a chunk of C's columns takes at a time (the depth's slices): they fit in
# L1 beside the accumulators (a chunk's bytes: the same for every dtype).
# npattn.cpu.code_products sums its slices alike.
DEPTH_BLOCK = _L1_BYTES // (VECTORS_PER_CHUNK * VECTOR_BYTES)


def padded_width(columns, like):
    """``columns`` rounded up to whole chunks of :func:`product` (64 float32 and 32 float64
    columns on AVX-512; 16 and 8 on AVX2), or below one chunk to whole vectors: a tile of
    16 keys then costs one vector's products, not a chunk's four (a (1, 8, 16 x 16, 64)
    forward's kernel: 27 -> 18 us)."""
    raise NotImplementedError


@overload(padded_width, jit_options=OPTIONS)
def _padded_width_overload(columns, like):
    lanes = VECTOR_BYTES // (like.dtype.bitwidth // 8)
    chunk = VECTORS_PER_CHUNK * lanes

    def implementation(columns, like):
        step = chunk if columns >= chunk else lanes
        return (columns + step - 1) // step * step
    return implementation


def chunk_columns(dtype) -> int:
    """The column count of :func:`product`'s chunk for a NumPy ``dtype``."""
    return VECTORS_PER_CHUNK * VECTOR_BYTES // np.dtype(dtype).itemsize


@helper
def _block(operands, r, block):
    """C's rows ``[r, r + len(block))`` and the columns of ``block`` (a tuple of rows of
    vectors, zero on entry), held in registers for the whole depth loop; returns the next
    row. ``operands``: :func:`_columns`'s, as a tuple."""
    # (inlined, it starts from zeroed registers: called, it took its zero block through
    # the stack, 24 vectors stored and loaded again per block, which cost a bfloat16
    # forward's score product of 32 pair steps (D = 64) a tenth of its time; measured on
    # the 2-core Zen 4 VM with _columns inlined too, (1, 8, 2048, 64) float32 forward
    # 46-55 -> 43-48 ms, bfloat16 25-29 -> 23-25 ms)
    always_inline()
    a, a_offset, a_row, a_col, b, b_offset, b_row, c, c_offset, c_row, depth, scale, accumulate, pairs = operands
    a_offset += r * a_row
    row = block[0]
    for _ in range(depth):
        block = _splat(a, a_offset, a_row, load_like(b, b_offset, row), block, pairs)
        a_offset += a_col
        b_offset += b_row
    store_scaled_rows(c, c_offset + r * c_row, c_row, block, scale, accumulate)
    return r + len(block)


@helper
def _columns(a, a_offset, a_row, a_col, b, b_offset, b_row, c, c_offset, c_row, rows, depth, alpha,
             accumulate, zero_row, pairs):
    """The columns of ``zero_row``'s vectors, all rows: blocks of 6 rows, then the rest in
    one block each of 4, 2 and 1 rows where they fit, so a few rows (a decode step's
    query heads) still keep several independent FMA chains in flight."""
    always_inline()
    operands = (a, a_offset, a_row, a_col, b, b_offset, b_row, c, c_offset, c_row, depth, fill(alpha, c),
                accumulate, pairs)
    r = 0
    while r + _BLOCK_ROWS <= rows:
        r = _block(operands, r, repeat(zero_row, _BLOCK_ROWS))
    if rows - r >= 4:
        r = _block(operands, r, repeat(zero_row, 4))
    if rows - r >= 2:
        r = _block(operands, r, repeat(zero_row, 2))
    if rows - r >= 1:
        _block(operands, r, repeat(zero_row, 1))


@njit(inline="always")
def product(a, a_offset, a_row, a_col, b, b_offset, b_row, c, c_offset, c_row, rows, depth, width,
            alpha, accumulate):
    """``C[r, x] = [C[r, x] +] alpha * sum_j A[r, j] B[j, x]`` for r < rows, x < width, where
    ``A[r, j] = a[a_offset + r * a_row + j * a_col]``, ``B[j, x] = b[b_offset + j * b_row + x]``
    and ``C[r, x] = c[c_offset + r * c_row + x]`` (flat arrays of one float dtype). A
    ``width`` that is not whole vectors (:func:`npattn.cpu.simd.lanes_of`) ends in a vector of
    B and C read and written masked (a decode tile's values of a head dim such as 40 with
    AVX-512's 16 lanes); indices are not checked."""
    _product(as_readonly(a), plain_int(a_offset), plain_int(a_row), plain_int(a_col),
             as_readonly(b), plain_int(b_offset), plain_int(b_row),
             c, plain_int(c_offset), plain_int(c_row),
             plain_int(rows), plain_int(depth), plain_int(width), scalar_like(alpha, c), bool(accumulate), None)


def pair_product(a, a_offset, a_row, a_col, b, b_offset, b_row, c, c_offset, c_row, rows, pairs, width, alpha,
                 accumulate):
    """:func:`product` on bfloat16 pairs (float32 arrays whose elements hold two bfloat16,
    see :func:`pair_bits`): ``C[r, x] = [C[r, x] +] alpha * sum_p (A[r, p].lo B[p, x].lo +
    A[r, p].hi B[p, x].hi)`` for p < ``pairs``, with ``A[r, p] = a[a_offset + r * a_row + p * a_col]``
    and ``B[p, x] = b[b_offset + p * b_row + x]``: each step two depths, one vdpbf16ps a
    vector on AVX512_BF16 (:func:`npattn.cpu.simd.splat_pair_dot_rows`). Where the CPU has
    AMX (:data:`npattn.cpu.amx.TILES`), products whose A has rows of pairs (``a_col`` 1),
    whole tiles of columns (``width`` a multiple of 16) and no scale on a sum they add to
    run on its tiles instead (:func:`npattn.cpu.amx.tile_pair_product`), 256 pair products
    an instruction.

    Compiled only where it can run (float32 operands on a CPU with AVX512_BF16, where
    :func:`npattn.cpu.operands.bf16_products` turns it on); elsewhere a stub that does
    nothing, so the kernels of other dtypes and ISAs do not compile a second micro-kernel
    (18 s of a float32 forward's compile)."""
    raise NotImplementedError


@overload(pair_product, jit_options=OPTIONS)
def _pair_product_overload(a, a_offset, a_row, a_col, b, b_offset, b_row, c, c_offset, c_row, rows, pairs, width,
                           alpha, accumulate):
    if not (BF16_DOT and c.dtype == types.float32):
        return lambda a, a_offset, a_row, a_col, b, b_offset, b_row, c, c_offset, c_row, rows, pairs, width, alpha, \
            accumulate: None

    def on_vectors(a, a_offset, a_row, a_col, b, b_offset, b_row, c, c_offset, c_row, rows, pairs, width, alpha,
                   accumulate):
        _vector_pair_product(a, a_offset, a_row, a_col, b, b_offset, b_row, c, c_offset, c_row, rows, pairs, width,
                             alpha, accumulate)

    def on_tiles(a, a_offset, a_row, a_col, b, b_offset, b_row, c, c_offset, c_row, rows, pairs, width, alpha,
                 accumulate):
        if a_col == 1 and width % 16 == 0 and (alpha == 1 or not accumulate):
            tile_pair_product(as_readonly(a), plain_int(a_offset), plain_int(a_row), as_readonly(b),
                              plain_int(b_offset), plain_int(b_row), c, plain_int(c_offset), plain_int(c_row),
                              plain_int(rows), plain_int(pairs), plain_int(width), scalar_like(alpha, c),
                              bool(accumulate))
        else:
            _vector_pair_product(a, a_offset, a_row, a_col, b, b_offset, b_row, c, c_offset, c_row, rows, pairs,
                                 width, alpha, accumulate)
    return on_tiles if TILES else on_vectors


@njit(inline="always")
def _vector_pair_product(a, a_offset, a_row, a_col, b, b_offset, b_row, c, c_offset, c_row, rows, pairs, width, alpha,
                         accumulate):
    """:func:`pair_product` on AVX512_BF16's vectors (``vdpbf16ps``)."""
    _product(as_readonly(a), plain_int(a_offset), plain_int(a_row), plain_int(a_col),
             as_readonly(b), plain_int(b_offset), plain_int(b_row),
             c, plain_int(c_offset), plain_int(c_row),
             plain_int(rows), plain_int(pairs), plain_int(width), scalar_like(alpha, c), bool(accumulate), True)


def _splat(a, index, a_row, row, block, pairs):
    """One depth step of a register block: FMAs (``pairs`` None) or bfloat16 pair dots."""
    raise NotImplementedError


@overload(_splat, jit_options=OPTIONS)
def _splat_overload(a, index, a_row, row, block, pairs):
    if isinstance(pairs, types.NoneType):
        return lambda a, index, a_row, row, block, pairs: splat_fma_rows(a, index, a_row, row, block)
    return lambda a, index, a_row, row, block, pairs: splat_pair_dot_rows(a, index, a_row, row, block)


@njit(inline="always")
def pair_bits(low, high):
    """The float32 whose bits hold bfloat16(``low``) in the low half and bfloat16(``high``)
    in the high half (round to nearest even; exact for values that are bfloat16 already):
    one element of :func:`pair_product`'s operands."""
    return as_float(_bfloat16_bits(low) | (_bfloat16_bits(high) << np.uint32(16)))


@njit(inline="always")
def _bfloat16_bits(value):
    bits = as_bits(np.float32(value))
    return (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)


_CHUNK, _TAIL, _TWO_VECTORS, _ONE_VECTOR = 0, 1, 2, 3  # (_product's passes over columns)


@helper
def _product(a, a_offset, a_row, a_col, b, b_offset, b_row, c, c_offset, c_row, rows, depth, width,
             alpha, accumulate, pairs):
    """:func:`product` on one compiled type of operands. The depth is cut into slices whose
    rows of B fit in L1 beside the accumulators: B is re-read once per 6 rows of C, from
    L1 rather than L2."""
    never_inline()
    lanes = lanes_in(c)
    chunk = VECTORS_PER_CHUNK * lanes
    x = 0
    if pairs is None and rows <= WIDE_ROWS:  # (pair products never take it: less to compile)
        # one row reads each row of B once: no depth slices for L1 (and so each element
        # of C is the same one chain over the whole depth, the bits of the narrow chunks)
        wide = WIDE_VECTORS * lanes
        while x + wide <= width:
            _columns(a, a_offset, a_row, a_col, b, b_offset + x, b_row, c, c_offset + x, c_row, rows, depth,
                     alpha, accumulate, repeat(fill(0.0, c), WIDE_VECTORS), pairs)
            x += wide
    while x < width:
        # the columns this pass takes: a whole chunk; else (fewer columns left) those
        # columns together, a last partial vector masked; else whole vectors, two at a
        # time where a chunk holds more (AVX-512), else one (pair products: always one).
        # Whole vectors short of a chunk (a tile of 16 or 32 keys, a head dim of 32 or
        # 48; 8 or 24 on AVX2) so take 6-row blocks as a chunk does, 6 or 12 FMA chains
        # with no branch in the depth loop, where the masked tail's 4-row blocks ran 4
        # to 12 chains through a branch per FMA. Each column is the same chain either
        # way (the same bits). One core of the 2-core Zen 4 VM, GFLOP/s (rows x depth x
        # width, best of 7): 16 x 64 x 16 42 -> 84, 16 x 64 x 32 76 -> 99, 192 x 384 x
        # 32 80 -> 106; forced to AVX2, 16 x 64 x 8 15 -> 55, 192 x 384 x 24 59 -> 88
        vectors, count = (width - x) // lanes, (width - x) % lanes
        if x + chunk <= width:
            step, kind = chunk, _CHUNK
        elif pairs is None and count:
            step, kind = width - x, _TAIL
        elif pairs is None and VECTORS_PER_CHUNK > 2 and vectors >= 2:
            step, kind = 2 * lanes, _TWO_VECTORS
        else:
            step, kind = lanes, _ONE_VECTOR
        for j0 in range(0, depth, DEPTH_BLOCK):
            j_count = smaller(DEPTH_BLOCK, depth - j0)
            args = (a, a_offset + j0 * a_col, a_row, a_col, b, b_offset + j0 * b_row + x, b_row,
                    c, c_offset + x, c_row, rows, j_count, alpha, accumulate or j0 > 0)
            if kind == _CHUNK:
                _columns(*args, repeat(fill(0.0, c), VECTORS_PER_CHUNK), pairs)
            elif kind == _TAIL:
                _tail_columns(*args, vectors, count)
            elif kind == _TWO_VECTORS:
                _columns(*args, repeat(fill(0.0, c), 2), pairs)
            else:
                _columns(*args, repeat(fill(0.0, c), 1), pairs)
        x += step


@helper
def _tail_columns(a, a_offset, a_row, a_col, b, b_offset, b_row, c, c_offset, c_row, rows, depth, alpha,
                  accumulate, vectors, count):
    """The columns left after the whole chunks where they end in a partial vector:
    ``vectors`` whole vectors (fewer than a chunk's), then ``count`` columns (0 < count
    < lanes) of a vector whose B and C lanes past them are neither read nor written
    (the values of a head dim such as 40 with AVX-512's 16 lanes). Rows four at a time,
    then two, then one, each vector of each row
    its own FMA chain (one vector at a time, a row's one chain waited on the FMA's
    latency at every key; two rows at a time, a 64-row tile re-read B from L1 32 times:
    (1, 8/2, 16 x 4096, 40) took 651 us where BLAS took 605). Each column is the chain a
    whole chunk's block makes (``fma(A[r, j], B[j, x], s)`` over j from zero, then
    ``[C +] alpha * s``): the same bits."""
    never_inline()
    r = 0
    while r + 4 <= rows:
        _tail_rows(a, a_offset + r * a_row, a_row, a_col, b, b_offset, b_row, c, c_offset + r * c_row, c_row, 4,
                   depth, alpha, accumulate, vectors, count)
        r += 4
    if rows - r >= 2:
        _tail_rows(a, a_offset + r * a_row, a_row, a_col, b, b_offset, b_row, c, c_offset + r * c_row, c_row, 2,
                   depth, alpha, accumulate, vectors, count)
        r += 2
    if r < rows:
        _tail_rows(a, a_offset + r * a_row, a_row, a_col, b, b_offset, b_row, c, c_offset + r * c_row, c_row, 1,
                   depth, alpha, accumulate, vectors, count)


@helper
def _tail_rows(a, a_at, a_row, a_col, b, b_at, b_row, c, c_at, c_row, rows, depth, alpha, accumulate, vectors,
               count):
    """:func:`_tail_columns` of ``rows`` (1, 2 or 4, a constant) rows: s, t, u and w are
    their accumulators, each four vectors (the last the partial one)."""
    always_inline()
    lanes = lanes_in(c)
    zero = fill(0.0, c)
    s = t = u = w = (zero, zero, zero, zero)
    last = vectors * lanes
    for j in range(depth):
        row = b_at + j * b_row
        values = (load(b, row) if vectors > 0 else zero, load(b, row + lanes) if vectors > 1 else zero,
                  load(b, row + 2 * lanes) if vectors > 2 else zero,
                  load_first(b, row + last, count, 0.0) if count else zero)
        at = a_at + j * a_col
        s = tail_step(broadcast_element(a, at, c), values, s, vectors, count)
        if rows >= 2:
            t = tail_step(broadcast_element(a, at + a_row, c), values, t, vectors, count)
        if rows == 4:
            u = tail_step(broadcast_element(a, at + 2 * a_row, c), values, u, vectors, count)
            w = tail_step(broadcast_element(a, at + 3 * a_row, c), values, w, vectors, count)
    scale = fill(alpha, c)
    _store_tail(c, c_at, s, scale, accumulate, vectors, count)
    if rows >= 2:
        _store_tail(c, c_at + c_row, t, scale, accumulate, vectors, count)
    if rows == 4:
        _store_tail(c, c_at + 2 * c_row, u, scale, accumulate, vectors, count)
        _store_tail(c, c_at + 3 * c_row, w, scale, accumulate, vectors, count)


@helper
def broadcast_element(a, at, c):
    """``a[at]`` in every lane of a vector of ``c``'s type (a broadcast the FMAs take from
    memory): a weight of the tails here and of code_products' blocks."""
    always_inline()
    return fill(scalar_like(a[as_offset(at)], c), c)


@helper
def tail_step(weight, values, sums, vectors, count):
    """One row's tail accumulators ``sums`` (four vectors) after one depth step: ``weight``
    (a vector) times each vector of ``values`` added by a FMA, for the ``vectors`` whole
    ones and, where ``count``, the partial last. Also code_products' tails."""
    always_inline()
    s0, s1, s2, s3 = sums
    if vectors > 0:
        s0 = multiply_add(weight, values[0], s0)
    if vectors > 1:
        s1 = multiply_add(weight, values[1], s1)
    if vectors > 2:
        s2 = multiply_add(weight, values[2], s2)
    if count:
        s3 = multiply_add(weight, values[3], s3)
    return s0, s1, s2, s3


@helper
def _store_tail(c, at, sums, scale, accumulate, vectors, count):
    """A row's tail sums into C from ``at``: ``[C +] scale * sum``, ``vectors`` whole
    vectors of ``sums``, then the first ``count`` lanes of its last, masked."""
    always_inline()
    lanes = lanes_in(c)
    for n in range(vectors):
        value = multiply(sums[n], scale)
        if accumulate:
            value = add(value, load(c, at + n * lanes))
        store(c, at + n * lanes, value)
    if count:
        value = multiply(sums[3], scale)
        if accumulate:
            value = add(value, load_first(c, at + vectors * lanes, count, 0.0))
        store_first(c, at + vectors * lanes, value, count)


@njit(inline="always")
def dot_products(a, a_offset, a_row, b, b_offset, b_row, c, c_offset, c_row, rows, cols, depth, alpha):
    """``C[r, j] = alpha * sum_x A[r, x] B[j, x]`` for r < rows, j < cols, where
    ``A[r, x] = a[a_offset + r * a_row + x]``, ``B[j, x] = b[b_offset + j * b_row + x]`` and
    ``C[r, j] = c[c_offset + r * c_row + j]``; a ``depth`` that is not whole vectors ends in a
    vector read masked (a head dim such as 40 with AVX-512's 16 lanes).

    The scores of a tile of few query rows (a decode step) straight from the key rows:
    :func:`pack_transposed` would copy each key once for a handful of products with it,
    and on such a tile the copy cost more than the products."""
    _dot_products(as_readonly(a), plain_int(a_offset), plain_int(a_row), as_readonly(b), plain_int(b_offset),
                  plain_int(b_row), c, plain_int(c_offset), plain_int(c_row), plain_int(rows), plain_int(cols),
                  plain_int(depth), scalar_like(alpha, c))


@helper
def _dot_products(a, a_offset, a_row, b, b_offset, b_row, c, c_offset, c_row, rows, cols, depth, alpha):
    """8 keys at a time (8 independent FMA chains: enough to cover the FMA latency), each
    row of A against them while their rows sit in L1; then the keys left one by one. The
    last lanes of a depth that is not whole vectors are read masked (zeros past it, which
    add nothing), not past the row: the next bytes are another row's, or none."""
    never_inline()
    lanes = lanes_in(c)
    whole = depth - depth % lanes
    rest = depth - whole
    j = 0
    while j + 8 <= cols:
        k = b_offset + j * b_row
        for r in range(rows):
            q = a_offset + r * a_row
            s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = fill(0.0, c)
            for x in range(0, whole, lanes):
                row = load(a, q + x)
                s0 = multiply_add(row, load(b, k + x), s0)
                s1 = multiply_add(row, load(b, k + b_row + x), s1)
                s2 = multiply_add(row, load(b, k + 2 * b_row + x), s2)
                s3 = multiply_add(row, load(b, k + 3 * b_row + x), s3)
                s4 = multiply_add(row, load(b, k + 4 * b_row + x), s4)
                s5 = multiply_add(row, load(b, k + 5 * b_row + x), s5)
                s6 = multiply_add(row, load(b, k + 6 * b_row + x), s6)
                s7 = multiply_add(row, load(b, k + 7 * b_row + x), s7)
            if rest:
                row = load_first(a, q + whole, rest, 0.0)
                s0 = multiply_add(row, load_first(b, k + whole, rest, 0.0), s0)
                s1 = multiply_add(row, load_first(b, k + b_row + whole, rest, 0.0), s1)
                s2 = multiply_add(row, load_first(b, k + 2 * b_row + whole, rest, 0.0), s2)
                s3 = multiply_add(row, load_first(b, k + 3 * b_row + whole, rest, 0.0), s3)
                s4 = multiply_add(row, load_first(b, k + 4 * b_row + whole, rest, 0.0), s4)
                s5 = multiply_add(row, load_first(b, k + 5 * b_row + whole, rest, 0.0), s5)
                s6 = multiply_add(row, load_first(b, k + 6 * b_row + whole, rest, 0.0), s6)
                s7 = multiply_add(row, load_first(b, k + 7 * b_row + whole, rest, 0.0), s7)
            out = c_offset + r * c_row + j
            c[out] = alpha * horizontal_sum(s0)
            c[out + 1] = alpha * horizontal_sum(s1)
            c[out + 2] = alpha * horizontal_sum(s2)
            c[out + 3] = alpha * horizontal_sum(s3)
            c[out + 4] = alpha * horizontal_sum(s4)
            c[out + 5] = alpha * horizontal_sum(s5)
            c[out + 6] = alpha * horizontal_sum(s6)
            c[out + 7] = alpha * horizontal_sum(s7)
        j += 8
    while j < cols:
        k = b_offset + j * b_row
        for r in range(rows):
            q = a_offset + r * a_row
            s0 = fill(0.0, c)
            for x in range(0, whole, lanes):
                s0 = multiply_add(load(a, q + x), load(b, k + x), s0)
            if rest:
                s0 = multiply_add(load_first(a, q + whole, rest, 0.0), load_first(b, k + whole, rest, 0.0), s0)
            c[c_offset + r * c_row + j] = alpha * horizontal_sum(s0)
        j += 1


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
    lanes = lanes_in(x)
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
