"""The tiled backward (FlashAttention-2), deterministic: every output element has one owner.

Probabilities are recomputed tile by tile from the forward's lse, never stored:
``P = exp(s - lse)``, ``dP = dO V^T`` (times the dropout keep mask and 1/(1-p)),
``dS = P * (dP - delta)`` with ``delta = rowsum(dO * O)`` (for the one key a row may give
``P > 3/4``, ``dS = P * dO . (z v - O)``: see :func:`dominant_key_gradient`), then
``dV += P~^T dO``, ``dK += scale dS^T Q`` and ``dQ += scale dS K``, all through BLAS.

Work items are (batch, kv head, head part, key chunk). An item owns dK and dV of its
keys (summed over the query heads of its part of the group) and adds into dQ of its
heads' rows; with one chunk per kv head it owns those dQ rows too. When a problem has
too few kv heads to fill the cores, it is split further, either way into separate
buffers summed afterwards in order: keys into chunks, each with its own dQ, or a GQA
group's query heads into parts, each with its own dK and dV (for MQA these are 1/group
the size of dQ's copies). The counts depend only on the shapes, so the bits are the same
on every run and every machine.

:func:`dbias_kernel` gives the bias gradient: ``dS`` summed over the axes the
bias was broadcast along, each bias element owned by one item (with BF16_PRODUCTS its
scores and dP on bfloat16 pairs too, reading the same words as the backward).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .blas import gemm
from .jit import FASTMATH, HELPER_OPTIONS, helper, kernel
from .signatures import as_offset, as_readonly, larger, smaller
from .threads import NON_FINITE, next_item
from .conversion import narrow_run
from .operands import Int, KvCodes, Real, Span
from .rowmath import exp_shifted, row_max
from .microkernels import padded_width, product
from .pair_gradients import bfloat16_word, pair_gradients, pair_key_tile, pair_output_gradient
from .tiles import (apply_dropout, convert_query_rows, convert_rows, dequantize_tile, k_row, key_segments,
                    memory_batch, memory_batches, pack_key_tile, pack_value_tile, packed_values, query_offset,
                    query_tile_start, score_tile, span, v_row, value_tile_rows)

# the key codes and scales score_tile takes, for a backward, which never reads codes
_NO_CODES, _NO_SCALES = np.zeros(1, np.int8), np.zeros(1, np.float32)


# Above this probability a key's score gradient comes from dominant_key_gradient: above
# 1/2 at most one key per row qualifies, and 3/4 keeps an exact tie of two keys at 1/2
# (recomputed a rounding above it) on the ordinary formula (as the GPU kernels do).
DOMINANT_PROBABILITY = 0.75


@njit(inline="always")
def dout_offset(dout_strides, b, h, i0):
    """Where row ``i0`` of head ``h`` of entry ``b`` starts in dout (its strides' units)."""
    return b * dout_strides[0] + h * dout_strides[1] + i0 * dout_strides[2]


@helper
def tile_is_live(ints, spans, b, i0, i1, j0, j1):
    """True when some row of ``[i0, i1)`` may see some key of ``[j0, j1)``."""
    sink_start, sink_end, start, stop = key_segments(ints, spans, b, i0, i1)
    return (j0 < sink_end and sink_start < j1) or (j0 < stop and start < j1)


@helper
def score_gradient_tile(q, q_offset, q_row, k, v, bias, mask, alibi, spans, pages, ints, reals, dout, o_offset,
                        o_row, out, out_strides, lse, delta, p, dropped, ds, tanh, packed, dequantized, b, h, i0,
                        rows, j0, cols):
    """For one tile: ``p`` = probabilities, ``dropped`` = p after dropout (``p`` itself when
    there is none), ``ds`` = gradient of the scores after softcap, bias and ALiBi (what
    dbias needs; the caller applies softcap's derivative and the scale). Row ``i0 + r``'s
    query is ``q[q_offset + r * q_row:]`` and its output gradient ``dout[o_offset + r *
    o_row:]`` (the item's converted rows, for 16-bit ones). ``dequantized``: with KV_CODES
    the key tile's keys and values as float rows (:func:`dequantize_tile`), which ``packed``
    holds packed already. With BF16_PRODUCTS the products take bfloat16 pairs, q, k, v and
    dout as words (:mod:`npattn.cpu.pair_gradients`)."""
    ld = ints[Int.SCORE_LD]
    heads = ints[Int.HEADS]
    # (never quantized: forward-only; k and _NO_CODES stand in for the unused tiles, and 16-bit
    # keys read by tiles are packed already; with BF16_PRODUCTS q's rows of pairs as they lie)
    score_tile(q, q_offset, q_row, k, as_readonly(k), _NO_CODES, _NO_SCALES, bias, mask, alibi, spans, pages,
               ints, reals, p, ld, tanh, packed, b, h, i0, rows, j0, cols)
    row_offset = (memory_batch(ints, b) * heads + h) * ints[Int.Q_LEN] + i0
    for r in range(rows):
        row_lse = lse[row_offset + r]
        if row_lse > -np.inf:
            # (on bfloat16 pairs, the forward's brief exp: its P, which its lse sums, and
            # rounded to bfloat16 for dV anyway)
            exp_shifted(p, r * ld, cols, row_lse, ints[Int.BF16_PRODUCTS] != 0)
        else:  # an empty row: no probability, no gradient
            for x in range(as_offset(r * ld), as_offset(r * ld + cols)):
                p[x] = 0.0
    if ints[Int.BF16_PRODUCTS]:  # dO's rows of pairs as they lie, V^T in pairs
        pair_output_gradient(dout, o_offset, o_row, packed_values(ints, packed), ds, ld, rows, cols, ints)
    elif ints[Int.VECTOR_SCORES]:
        # dP (rows x cols) = dO (rows x Dv) . V^T (Dv x cols)
        product(dout, o_offset, o_row, 1, packed_values(ints, packed), 0, ld, ds, 0, ld,
                rows, ints[Int.VALUE_DIM], padded_width(cols, ds), 1.0, False)
    else:  # column-major: dP^T (cols x rows) = V (cols x Dv) . dO^T (Dv x rows)
        v_offset = v_row(ints, pages, b, h // (heads // ints[Int.KV_HEADS]), j0)
        gemm(True, False, cols, rows, ints[Int.VALUE_DIM], 1.0, v[v_offset:], ints[Int.V_STRIDE_S],
             dout[o_offset:], o_row, 0.0, ds, ld)
    if ints[Int.HAS_DROPOUT]:
        keep_scale = reals[Real.KEEP_SCALE]
        for x in range(as_offset(rows * ld)):  # not a slice copy: its shape check compiles str()
            dropped[x] = p[x]
        apply_dropout(ints, dropped, ld, b, h, i0, rows, j0, cols, keep_scale)
        apply_dropout(ints, ds, ld, b, h, i0, rows, j0, cols, keep_scale)
    for r in range(rows):
        row_delta = delta[row_offset + r]
        for x in range(as_offset(r * ld), as_offset(r * ld + cols)):
            ds[x] = p[x] * (ds[x] - row_delta)
    for r in range(rows):
        if row_max(p, r * ld, cols) > DOMINANT_PROBABILITY:
            dominant_key_gradient(v, dequantized, pages, ints, reals, dout, o_offset + r * o_row, out, out_strides,
                                  p, dropped, ds, b, h, i0, r, j0, cols)


@njit(**{**HELPER_OPTIONS, "fastmath": FASTMATH - {"contract"}})
def dominant_key_gradient(v, dequantized, pages, ints, reals, dout, o_row, out, out_strides, p, dropped, ds,
                          b, h, i0, r, j0, cols):
    """``ds`` of row ``r``'s key with ``P > 3/4`` (there is at most one) as
    ``P dO . (z v - O)``, with ``z`` dropout's keep factor (1 without dropout); v's row
    from the key tile's float rows with KV_CODES, its output gradient ``dout[o_row:]``
    (:func:`score_gradient_tile`).

    ``P (dP - delta)`` cancels there: ``dP`` and ``delta`` are both about ``|dO| |v|``,
    their difference about ``(1 - P) |dO| |v|``, so one rounding of either, times the
    scale and ``|k|``, can dwarf the exact gradient of a nearly one-hot row (measured: a
    dq of 0.30 where the exact one is 7e-11, at scale 1e5). Subtracting the vectors
    first leaves only O's own rounding, and none where the row is exactly one-hot: the
    forward computed that ``O`` as the same product ``z v``. Compiled without FMA
    contraction, which would keep ``z v`` unrounded where the forward rounded it."""
    ld = ints[Int.SCORE_LD]
    value_dim = ints[Int.VALUE_DIM]
    kv_head = h // (ints[Int.HEADS] // ints[Int.KV_HEADS])
    out_row = b * out_strides[0] + h * out_strides[1] + (i0 + r) * out_strides[2]
    for c in range(cols):
        x = r * ld + c
        if p[x] > DOMINANT_PROBABILITY:
            codes = ints[Int.KV_CODES]
            values = value_tile_rows(ints, dequantized) if codes else v
            value_row = c * value_dim if codes else v_row(ints, pages, b, kv_head, j0 + c)
            # z: the keep scale (exactly 1 without dropout), or 0 where dropout dropped the key;
            # both in the compute dtype, so z v is the forward's product
            keep = reals[Real.KEEP_SCALE]
            if ints[Int.HAS_DROPOUT] and dropped[x] == 0.0:
                keep = keep - keep
            total = 0.0
            if ints[Int.BF16_PRODUCTS]:  # v and dout as bfloat16 words (pair_gradients)
                for d in range(value_dim):
                    value = bfloat16_word(v, value_row * 2 + d)
                    total += bfloat16_word(dout, 2 * o_row + d) * (keep * value - out[out_row + d])
            else:
                for d in range(value_dim):
                    total += dout[o_row + d] * (keep * values[value_row + d] - out[out_row + d])
            ds[x] = p[x] * total
            return


def backward_items(ints, chunks, head_parts=1):
    return ints[Int.BATCH] * ints[Int.KV_HEADS] * head_parts * chunks


@helper
def _tile_rows(q, dout, dout_strides, ints, b, h, i0, rows, dequantized):
    """``(query, q_offset, q_row, grad_out, o_offset, o_row)``: where rows ``[i0, i0 + rows)``
    of head ``h`` of q and of dout lie for a key tile's products (:func:`score_gradient_tile`'s
    arguments): as they are, or (Q_CODES; dout_strides' KvCodes) their 16-bit rows converted
    into ``dequantized`` after the key tile, q's then dout's, no float32 copy of either."""
    head_dim = ints[Int.HEAD_DIM]
    query, q_offset, q_row = as_readonly(q), query_offset(ints, b, h, i0), ints[Int.Q_STRIDE_S]
    if ints[Int.Q_CODES]:
        convert_query_rows(q, ints, b, h, 1, i0, rows, dequantized)
        query, q_offset, q_row = as_readonly(dequantized), query_tile_start(ints), head_dim
    grad_out, o_offset, o_row = as_readonly(dout), dout_offset(dout_strides, b, h, i0), dout_strides[2]
    if dout_strides[3]:
        dout_start = query_tile_start(ints) + ints[Int.BLOCK_Q] * head_dim
        convert_rows(dout, o_offset, o_row, rows, ints[Int.VALUE_DIM], dout_strides[3] == KvCodes.BFLOAT16,
                     dequantized, dout_start)
        grad_out, o_offset, o_row = as_readonly(dequantized), dout_start, ints[Int.VALUE_DIM]
    return query, q_offset, q_row, grad_out, o_offset, o_row


@kernel
def backward_kernel(q, k, v, bias, mask, alibi, sink, spans, pages, ints, reals, k_codes, v_codes, k_scale, v_scale,
                    dout, dout_strides, out, out_strides, lse, delta, dq, dk, dv, chunks, head_parts,
                    p, dropped, ds, tanh, packed, dk_tile, dv_tile, dequantized, counter, items):
    """dq: flat (chunks, B, H, Sq, D); dk: flat (head_parts, B, Hkv, Sk, D); dv: flat
    (head_parts, B, Hkv, Sk, Dv); all C-contiguous in the compute dtype and zero on entry (B
    is 1 with PACKED_ROWS). ``p`` to ``dequantized``:
    this thread's :func:`~npattn.cpu.scratch.backward_scratch_specs`. ``dout_strides``:
    dout's batch, head and row strides, then how it is stored (a KvCodes: with Q_CODES a
    16-bit dout is its memory seen as float32 words, strides in bytes, each (head, query
    tile)'s rows converted where a key tile uses them, as q's are; NONE: the compute dtype),
    then how dk and dv are stored (a KvCodes: FLOAT16 or BFLOAT16, one head part and whole
    vectors: their 16-bit memory seen as float32 words, each key tile's rows rounded into
    it as they are written, ``counter[NON_FINITE]`` set where a rounded value is not
    finite; NONE: the compute dtype).

    The key tile's body is written here, not in a helper: each level of calls costs the
    first call's compile a pass of Numba's optimizer and code emitter over everything
    below it (see :func:`npattn.cpu.forward_kernel.forward_kernel`)."""
    kv_heads, block_q, block_k = ints[Int.KV_HEADS], ints[Int.BLOCK_Q], ints[Int.BLOCK_K]
    heads, q_len, kv_len = ints[Int.HEADS], ints[Int.Q_LEN], ints[Int.KV_LEN]
    head_dim, value_dim = ints[Int.HEAD_DIM], ints[Int.VALUE_DIM]
    group = heads // kv_heads
    scale = reals[Real.SCALE]
    ld = ints[Int.SCORE_LD]
    key_tiles = (kv_len + block_k - 1) // block_k
    tiles_per_chunk = (key_tiles + chunks - 1) // chunks
    heads_per_part = (group + head_parts - 1) // head_parts
    gradient_part = memory_batches(ints) * kv_heads * kv_len  # (rows of one part of dk and dv)
    gradient_codes = dout_strides[4]
    while True:
        item = next_item(counter, items)
        if item >= items:
            break
        b = item // (kv_heads * head_parts * chunks)
        kv_head = (item // (head_parts * chunks)) % kv_heads
        part = (item // chunks) % head_parts
        chunk = item % chunks
        first_head = kv_head * group + part * heads_per_part
        last_head = smaller(first_head + heads_per_part, (kv_head + 1) * group)
        first = chunk * tiles_per_chunk * block_k
        last = smaller(smaller(kv_len, span(spans, b, Span.KV_STOP)), first + tiles_per_chunk * block_k)
        first = larger(first, span(spans, b, Span.KV_START))
        rows_first, rows_valid = span(spans, b, Span.Q_START), smaller(q_len, span(spans, b, Span.Q_STOP))
        for j0 in range(first, last, block_k):
            cols = smaller(block_k, last - j0)
            for x in range(as_offset(cols * head_dim)):
                dk_tile[x] = 0.0
            for x in range(as_offset(cols * value_dim)):
                dv_tile[x] = 0.0
            # once for every query tile; 16-bit keys and values (KV_CODES) converted to float
            # rows first, which dQ and the dominant keys' gradients read
            codes = ints[Int.KV_CODES]
            if codes:
                dequantize_tile(k_codes, v_codes, k_scale, v_scale, pages, ints, b, kv_head, j0, cols, dequantized)
            keys = as_readonly(dequantized) if codes else as_readonly(k)
            k_offset, k_row_stride = (0, head_dim) if codes else (k_row(ints, pages, b, kv_head, j0),
                                                                   ints[Int.K_STRIDE_S])
            pack_key_tile(k, as_readonly(dequantized), pages, ints, b, kv_head, j0, cols, packed)
            pack_value_tile(v, as_readonly(value_tile_rows(ints, dequantized)), pages, ints, b, kv_head, j0, cols,
                            packed)
            if ints[Int.BF16_PRODUCTS]:  # and the keys in pairs of keys, dQ's B
                pair_key_tile(k, pages, ints, b, kv_head, j0, cols, dequantized)
            for h in range(first_head, last_head):
                for i0 in range(rows_first, rows_valid, block_q):
                    rows = smaller(block_q, rows_valid - i0)
                    if not tile_is_live(ints, spans, b, i0, i0 + rows, j0, j0 + cols):
                        continue
                    # 16-bit q and dout rows converted where this key tile uses them (no float32 copy)
                    query, q_offset, q_row, grad_out, o_offset, o_row = _tile_rows(q, dout, dout_strides, ints, b, h,
                                                                                   i0, rows, dequantized)
                    score_gradient_tile(query, q_offset, q_row, k, v, bias, mask, alibi, spans, pages, ints, reals,
                                        grad_out, o_offset, o_row, out, out_strides, lse, delta, p, dropped, ds,
                                        tanh, packed, as_readonly(dequantized), b, h, i0, rows, j0, cols)
                    if ints[Int.HAS_SOFTCAP]:  # d softcap*tanh(s/softcap) / ds = 1 - tanh^2
                        for r in range(rows):
                            for x in range(as_offset(r * ld), as_offset(r * ld + cols)):
                                ds[x] *= 1.0 - tanh[x] * tanh[x]
                    dq_offset = (((chunk * memory_batches(ints) + memory_batch(ints, b)) * heads + h) * q_len
                                 + i0) * head_dim
                    if ints[Int.BF16_PRODUCTS]:  # dV, dK and dQ on bfloat16 pairs (P~ and dS rounded)
                        pair_gradients(query, q_offset, q_row, grad_out, o_offset, o_row, dropped, ds, ld, rows, cols,
                                       dk_tile, dv_tile, dq, dq_offset, scale, ints, dequantized)
                        continue
                    # dV (cols x Dv) += dropped^T (cols x rows) . dO (rows x Dv)
                    if ints[Int.VECTOR_VALUES]:
                        product(dropped, 0, 1, ld, grad_out, o_offset, o_row, dv_tile, 0, value_dim,
                                cols, rows, value_dim, 1.0, True)
                    else:  # column-major: dV^T = dO^T (Dv x rows) . dropped (rows x cols)
                        gemm(False, True, value_dim, cols, rows, 1.0, grad_out[o_offset:], o_row,
                             dropped, ld, 1.0, dv_tile, value_dim)
                    if ints[Int.VECTOR_KEYS]:
                        # dK (cols x D) += scale dS^T (cols x rows) . Q (rows x D)
                        product(ds, 0, 1, ld, query, q_offset, q_row, dk_tile, 0, head_dim,
                                cols, rows, head_dim, scale, True)
                        # dQ (rows x D) += scale dS (rows x cols) . K (cols x D)
                        product(ds, 0, ld, 1, keys, k_offset, k_row_stride, dq, dq_offset, head_dim,
                                rows, cols, head_dim, scale, True)
                    else:  # column-major: dK^T = Q^T (D x rows) . dS (rows x cols); dQ^T = K^T . dS^T
                        gemm(False, True, head_dim, cols, rows, scale, query[q_offset:], q_row,
                             ds, ld, 1.0, dk_tile, head_dim)
                        gemm(False, False, head_dim, rows, cols, scale, keys[k_offset:], k_row_stride,
                             ds, ld, 1.0, dq[dq_offset:], head_dim)
            row = part * gradient_part + (memory_batch(ints, b) * kv_heads + kv_head) * kv_len + j0
            dk_start, dv_start = as_offset(row * head_dim), as_offset(row * value_dim)
            if gradient_codes:  # 16-bit dk and dv: the tile's rows rounded into them, checked as they round
                brain = gradient_codes == KvCodes.BFLOAT16
                if (narrow_run(dk_tile, 0, cols * head_dim, dk.view(np.int8), dk_start, brain)
                        | narrow_run(dv_tile, 0, cols * value_dim, dv.view(np.int8), dv_start, brain)):
                    counter[NON_FINITE] = 1
                continue
            for x in range(as_offset(cols * head_dim)):  # not slice copies: their shape checks compile str()
                dk[dk_start + x] = dk_tile[x]
            for x in range(as_offset(cols * value_dim)):
                dv[dv_start + x] = dv_tile[x]


@kernel
def dbias_kernel(q, k, v, bias, mask, alibi, sink, spans, pages, ints, reals, k_codes, v_codes, k_scale, v_scale,
                 dout, dout_strides, out, out_strides, lse, delta, dbias, dbias_shape, p, dropped, ds,
                 tanh, packed, dequantized,
                 counter, items):
    """dbias: flat C-contiguous ``dbias_shape`` (Bb, Hb, Sqb, Skb), each 1 or full, zero on
    entry. Item = (bias batch, bias head, query tile or all rows, key tile or all keys);
    it sums dS over the batches, heads, rows and keys that broadcast onto its elements.
    16-bit q, k, v and dout are read as :func:`backward_kernel` reads them (KV_CODES,
    Q_CODES, ``dout_strides``' KvCodes: tiles and rows converted where they are used).
    ``p`` to ``dequantized``: this thread's :func:`~npattn.cpu.scratch.dbias_scratch_specs`."""
    block_q, block_k = ints[Int.BLOCK_Q], ints[Int.BLOCK_K]
    batch, heads, q_len, kv_len = ints[Int.BATCH], ints[Int.HEADS], ints[Int.Q_LEN], ints[Int.KV_LEN]
    bias_b, bias_h, bias_q, bias_k = dbias_shape[0], dbias_shape[1], dbias_shape[2], dbias_shape[3]
    q_items = (q_len + block_q - 1) // block_q if bias_q > 1 else 1
    k_items = (kv_len + block_k - 1) // block_k if bias_k > 1 else 1
    ld = ints[Int.SCORE_LD]
    while True:
        item = next_item(counter, items)
        if item >= items:
            break
        k_item = item % k_items
        q_item = (item // k_items) % q_items
        hb = (item // (k_items * q_items)) % bias_h
        bb = item // (k_items * q_items * bias_h)
        i_first, i_last = (q_item * block_q, smaller(q_len, (q_item + 1) * block_q)) if bias_q > 1 else (0, q_len)
        j_first, j_last = (k_item * block_k, smaller(kv_len, (k_item + 1) * block_k)) if bias_k > 1 else (0, kv_len)
        for b in range(batch) if bias_b == 1 else range(bb, bb + 1):
            rows_valid = smaller(i_last, span(spans, b, Span.Q_STOP))
            keys_valid = smaller(j_last, span(spans, b, Span.KV_STOP))
            rows_first = larger(i_first, span(spans, b, Span.Q_START))
            keys_first = larger(j_first, span(spans, b, Span.KV_START))
            for h in range(heads) if bias_h == 1 else range(hb, hb + 1):
                for i0 in range(rows_first, rows_valid, block_q):
                    rows = smaller(block_q, rows_valid - i0)
                    for j0 in range(keys_first, keys_valid, block_k):
                        cols = smaller(block_k, keys_valid - j0)
                        if not tile_is_live(ints, spans, b, i0, i0 + rows, j0, j0 + cols):
                            continue
                        kv_head = h // (heads // ints[Int.KV_HEADS])
                        # (as backward_kernel: 16-bit keys and values converted to float rows first)
                        if ints[Int.KV_CODES]:
                            dequantize_tile(k_codes, v_codes, k_scale, v_scale, pages, ints, b, kv_head, j0, cols,
                                            dequantized)
                        pack_key_tile(k, as_readonly(dequantized), pages, ints, b, kv_head, j0, cols, packed)
                        pack_value_tile(v, as_readonly(value_tile_rows(ints, dequantized)), pages, ints, b, kv_head,
                                        j0, cols, packed)
                        query, q_offset, q_row, grad_out, o_offset, o_row = _tile_rows(q, dout, dout_strides, ints,
                                                                                       b, h, i0, rows, dequantized)
                        score_gradient_tile(query, q_offset, q_row, k, v, bias, mask, alibi, spans, pages, ints, reals,
                                            grad_out, o_offset, o_row, out, out_strides, lse, delta, p, dropped, ds,
                                            tanh, packed, as_readonly(dequantized), b, h, i0, rows, j0, cols)
                        for r in range(rows):
                            out_row = ((bb * bias_h + hb) * bias_q + (i0 + r if bias_q > 1 else 0)) * bias_k
                            row = as_offset(r * ld)
                            if bias_k > 1:
                                out_start = as_offset(out_row + j0)
                                for c in range(as_offset(cols)):
                                    dbias[out_start + c] += ds[row + c]
                            else:
                                row_sum = 0.0
                                for c in range(as_offset(cols)):
                                    row_sum += ds[row + c]
                                dbias[out_row] += row_sum
