"""The bfloat16 backward's products as bfloat16 pairs (AVX512_BF16's ``vdpbf16ps``, or AMX tiles).

Where a bfloat16 backward multiplies in bfloat16 (:func:`npattn.cpu.operands.bf16_products`),
q, k and v are read as they lie, as float32 words of two bfloat16 each (pairs along a
row), and every product of :func:`npattn.cpu.backward_kernel.backward_kernel` runs on
:func:`~npattn.cpu.microkernels.pair_product`, two products per float32 lane and float32
sums, with the operands the GPU kernels round:

- ``S = Q K^T``: q's rows as they lie, K^T packed in pairs (as the forward packs it);
- ``dP = dO V^T``: dout's rows as they lie (bfloat16 words too), V^T packed in pairs;
- ``dV += P~^T dO``: P~ (the probabilities after dropout) rounded to bfloat16, and dO, in
  pairs of consecutive query rows, P~'s read down its columns (on AMX tiles, transposed
  first: a tile's A holds its pairs along its rows);
- ``dK += (scale dS)^T Q``: scale dS rounded to bfloat16 and q, in pairs of query rows
  likewise;
- ``dQ += (scale dS) K``: scale dS in pairs along its row, k in pairs of consecutive keys.

(scale dS, not dS, is rounded: as exact a rounding, and the products then add unscaled
sums, which AMX tiles can: :mod:`npattn.cpu.amx`.)

The softmax's own arithmetic (P, dP - delta, the dominant key's gradient) stays float32,
from the float32 sums, and so do the dK, dV and dQ sums. The pair layouts are those
:func:`~npattn.cpu.simd.splat_pair_dot_rows` reads: a float32 word holds the lower index
in its low half.

Compiled only where they run (float32 kernels on a CPU with AVX512_BF16); elsewhere the
entry points here are stubs that do nothing, so other dtypes' and ISAs' kernels compile
none of it.
"""
from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from .jit import OPTIONS, helper
from .amx import TILES
from .microkernels import pack_transposed, padded_width, pair_product
from .operands import Int
from .signatures import as_readonly
from .simd import (BF16_DOT, VECTOR_BYTES, as_bits, as_float, fill, load, multiply, store_interleaved_pairs,
                   store_rounded_pairs)
from .tiles import pack_row_pairs, pair_rows


def backward_pair_sizes(rows, keys, head_dim, value_dim, ld):
    """The float32 words of :func:`backward_pair_tiles`' five tiles for BLOCK_Q ``rows``,
    BLOCK_K ``keys`` and SCORE_LD ``ld``. Plain Python: the kernels compile it too."""
    half_rows = (rows + 1) // 2
    return (half_rows * ld, rows * ((ld + 1) // 2), half_rows * value_dim, half_rows * head_dim,
            (keys + 1) // 2 * head_dim)


_pair_sizes = njit(inline="always")(backward_pair_sizes)


@njit(inline="always")
def backward_pair_tiles(ints, scratch):
    """``(row pairs, ds pairs, dout row pairs, query row pairs, key pairs)``, the
    tiles of :func:`pair_gradients` carved from the backward's scratch after its other
    tiles (:func:`npattn.cpu.scratch.backward_scratch_specs`):

    - row pairs (BLOCK_Q / 2 x SCORE_LD): P~, then dS, in pairs of consecutive rows;
    - ds pairs (BLOCK_Q x SCORE_LD / 2): dS in pairs along its rows;
    - dout row pairs (BLOCK_Q / 2 x Dv) and query row pairs (BLOCK_Q / 2 x D);
    - key pairs (BLOCK_K / 2 x D): the key tile in pairs of consecutive keys."""
    sizes = _pair_sizes(ints[Int.BLOCK_Q], ints[Int.BLOCK_K], ints[Int.HEAD_DIM], ints[Int.VALUE_DIM],
                        ints[Int.SCORE_LD])
    a = sizes[0]
    b = a + sizes[1]
    c = b + sizes[2]
    d = c + sizes[3]
    return scratch[:a], scratch[a:b], scratch[b:c], scratch[c:d], scratch[d:d + sizes[4]]


@helper
def pair_consecutive_rows(x, offset, row_stride, rows, width, out, out_row, scale):
    """Rows ``[0, rows)`` of float32 ``x`` (``x[offset + r * row_stride + c]``) times
    ``scale``, rounded to bfloat16 in pairs of consecutive rows: ``out[p * out_row + c]`` =
    pair (scale x[2p, c], scale x[2p + 1, c]), 0 for the high half of an odd count's last
    pair, for c below ``width`` rounded up to whole vectors (the caller's rows must be that
    long)."""
    lanes = VECTOR_BYTES // 4
    zero = fill(0.0, x)
    factor = fill(scale, x)
    for p in range((rows + 1) // 2):
        first = offset + 2 * p * row_stride
        second = first + row_stride
        target = p * out_row
        if 2 * p + 1 < rows:
            for c in range(0, width, lanes):
                store_rounded_pairs(out, target + c, multiply(load(x, first + c), factor),
                                    multiply(load(x, second + c), factor))
        else:
            for c in range(0, width, lanes):
                store_rounded_pairs(out, target + c, multiply(load(x, first + c), factor), zero)


@helper
def pair_consecutive_word_rows(words, offset, row_stride, rows, width, out, out_row):
    """Rows ``[0, rows)`` of bfloat16 memory seen as float32 words (row r's values from
    word ``offset + r * row_stride``; ``width`` values a row, whole vectors) in pairs of
    consecutive rows, ``out[p * out_row + x]`` = pair (row 2p's x, row 2p + 1's x), 0 for
    the high half of an odd count's last pair: no rounding, the values are bfloat16."""
    lanes = VECTOR_BYTES // 4
    for p in range((rows + 1) // 2):
        first = offset + 2 * p * row_stride
        has_second = 2 * p + 1 < rows
        second = first + row_stride if has_second else first
        for x in range(0, width, lanes):
            store_interleaved_pairs(out, p * out_row + x, words, first + x // 2, second + x // 2, has_second)


def pair_key_tile(k, pages, ints, b, kv_head, j0, cols, scratch):
    """Keys ``[j0, j0 + cols)`` of ``kv_head`` (k: bfloat16 words) in pairs of consecutive
    keys into :func:`backward_pair_tiles`' key pairs (0 past ``cols``): dQ's B operand."""
    raise NotImplementedError


@overload(pair_key_tile, jit_options=OPTIONS)
def _pair_key_tile_overload(k, pages, ints, b, kv_head, j0, cols, scratch):
    if not _pairs_compile(scratch):
        return lambda k, pages, ints, b, kv_head, j0, cols, scratch: None

    def implementation(k, pages, ints, b, kv_head, j0, cols, scratch):
        _pair_key_rows(as_readonly(k), pages, ints, b, kv_head, j0, cols, backward_pair_tiles(ints, scratch)[4])
    return implementation


@helper
def _pair_key_rows(k, pages, ints, b, kv_head, j0, cols, out):
    pack_row_pairs(k, pages, ints, b, kv_head, j0, cols, ints[Int.HEAD_DIM], ints[Int.K_STRIDE_B],
                   ints[Int.K_STRIDE_H], ints[Int.K_STRIDE_S], out)


def pair_output_gradient(dout, o_offset, o_row, values, ds, ld, rows, cols, ints):
    """``dP = dO V^T`` into ``ds`` (rows x SCORE_LD, padding columns included) from dout's
    rows as they lie (bfloat16 words: row r at word ``o_offset + r * o_row``) and
    ``values``, V^T packed in pairs (:func:`npattn.cpu.tiles.pack_value_tile`)."""
    raise NotImplementedError


@overload(pair_output_gradient, jit_options=OPTIONS)
def _pair_output_gradient_overload(dout, o_offset, o_row, values, ds, ld, rows, cols, ints):
    if not _pairs_compile(ds):
        return lambda dout, o_offset, o_row, values, ds, ld, rows, cols, ints: None

    def implementation(dout, o_offset, o_row, values, ds, ld, rows, cols, ints):
        value_words = ints[Int.VALUE_DIM] // 2
        pair_product(dout, o_offset, o_row, 1, values, 0, ld, ds, 0, ld, rows, value_words, padded_width(cols, ds),
                     1.0, False)
    return implementation


def pair_gradients(query, q_offset, q_row, dout, o_offset, o_row, dropped, ds, ld, rows, cols, dk_tile, dv_tile,
                   dq, dq_offset, scale, ints, scratch):
    """A tile's ``dV += P~^T dO``, ``dK += scale dS^T Q`` and ``dQ += scale dS K`` on
    bfloat16 pairs: ``dropped`` (P~) and ``ds`` (rows x ``ld``) float32, rounded here;
    query row r at word ``q_offset + r * q_row`` of ``query`` and its dout row at word
    ``o_offset + r * o_row`` of ``dout`` (both bfloat16 words); dk_tile and dv_tile (cols x D, cols x
    Dv) and dq's rows from ``dq_offset`` (row stride D) summed into; the key tile's pairs
    packed by :func:`pair_key_tile`."""
    raise NotImplementedError


@overload(pair_gradients, jit_options=OPTIONS)
def _pair_gradients_overload(query, q_offset, q_row, dout, o_offset, o_row, dropped, ds, ld, rows, cols, dk_tile,
                             dv_tile, dq, dq_offset, scale, ints, scratch):
    if not _pairs_compile(scratch):
        return (lambda query, q_offset, q_row, dout, o_offset, o_row, dropped, ds, ld, rows, cols, dk_tile, dv_tile,
                dq, dq_offset, scale, ints, scratch: None)

    def implementation(query, q_offset, q_row, dout, o_offset, o_row, dropped, ds, ld, rows, cols, dk_tile,
                       dv_tile, dq, dq_offset, scale, ints, scratch):
        head_dim, value_dim = ints[Int.HEAD_DIM], ints[Int.VALUE_DIM]
        row_pairs, ds_pairs, dout_row_pairs, query_row_pairs, key_pairs = backward_pair_tiles(ints, scratch)
        half = (rows + 1) // 2
        # (scale dS rounded to bfloat16, not dS: the products then add unscaled sums, which
        # AMX tiles take; as exact a rounding)
        # dV (cols x Dv) += P~^T (cols x rows) dO (rows x Dv): P~'s row pairs read down a column
        pair_consecutive_rows(dropped, 0, ld, rows, cols, row_pairs, ld, 1.0)
        pair_consecutive_word_rows(dout, o_offset, o_row, rows, value_dim, dout_row_pairs, value_dim)
        _transposed_product(row_pairs, ld, half, cols, dout_row_pairs, value_dim, dv_tile, ds_pairs)
        # dK (cols x D) += scale dS^T (cols x rows) Q (rows x D), the same way
        pair_consecutive_rows(ds, 0, ld, rows, cols, row_pairs, ld, scale)
        pair_consecutive_word_rows(query, q_offset, q_row, rows, head_dim, query_row_pairs, head_dim)
        _transposed_product(row_pairs, ld, half, cols, query_row_pairs, head_dim, dk_tile, ds_pairs)
        # dQ (rows x D) += scale dS (rows x cols) K (cols x D): dS in pairs along its rows
        half_ld = (ld + 1) // 2
        pair_rows(ds, 0, ld, rows, cols, ds_pairs, half_ld, scale)
        pair_product(ds_pairs, 0, half_ld, 1, key_pairs, 0, head_dim, dq, dq_offset, head_dim, rows,
                     (cols + 1) // 2, head_dim, 1.0, True)
    return implementation


@njit(inline="always")
def _transposed_product(row_pairs, ld, half, cols, b, width, c, spare):
    """``C (cols x width) += A B`` for ``A[key, p] = row_pairs[p * ld + key]`` (pairs of
    consecutive query rows, read down a column) and B's rows of ``width`` words. On AMX
    tiles, whose A must hold its pairs along its rows, A is first transposed into
    ``spare`` (the dS pairs' tile, free until dQ's product) where it fits."""
    if TILES and cols * half <= spare.size:
        pack_transposed(row_pairs, 0, ld, half, cols, spare, half, half)
        pair_product(spare, 0, half, 1, b, 0, width, c, 0, width, cols, half, width, 1.0, True)
    else:
        pair_product(row_pairs, 0, 1, ld, b, 0, width, c, 0, width, cols, half, width, 1.0, True)


@njit(inline="always")
def bfloat16_word(words, index):
    """Value ``index`` of bfloat16 memory seen as float32 ``words``, as a float32."""
    bits = as_bits(np.float32(words[index // 2]))
    half = bits >> np.uint32(16) if index % 2 else bits & np.uint32(0xFFFF)
    return as_float(half << np.uint32(16))


def _pairs_compile(scratch) -> bool:
    """Whether the pair code compiles for a kernel whose scratch is ``scratch``'s type."""
    return BF16_DOT and scratch.dtype == types.float32
