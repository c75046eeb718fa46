"""The tiled forward (FlashAttention-2): out and lse with an online softmax, and the
exact attention weights recomputed from lse.

Work items are (batch, head, query tile, key range), a decode step's holding every head
(``Int.HEAD_GROUP``: on caches whose key rows hold every head, each key tile is visited
head by head, the next one asked of memory in order); each thread of
:mod:`npattn.cpu.threads` claims the next item until none is left (``counter``,
``items``). There is one key range (all keys) unless :mod:`npattn.cpu.splitting` cuts a
short query's keys into several, whose results it merges. For
each item the key tiles that masking leaves alive are visited in order; per tile:
the scores (micro-kernel or BLAS, see :mod:`npattn.cpu.microkernels`), the running
max ``m`` and sum ``l`` updated per row, the accumulated output rescaled by
``exp(m_old - m_new)``, then ``out += P @ V`` straight into the output rows. Extra
memory is one (block_q x block_k) score tile and one packed key tile per thread
(:mod:`npattn.cpu.scratch`; a prefill keeps its kv head's key tiles packed, up to 1 MiB,
for the next query tile or head: :func:`~npattn.cpu.tiles.cached_key_tile`):
no Sq x Sk array is ever formed.

Every kernel takes the flat operands of :class:`~npattn.cpu.operands.Operands` first,
in its order, and its scratch last before ``counter, items``.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from .blas import gemm
from .jit import helper, kernel
from .simd import lanes_in
from .signatures import as_offset, as_readonly, larger, scalar_like, smaller
from .threads import NON_FINITE, claim_items, next_item
from .operands import Int, KvCodes, Real
from .rowmath import SHORT_ROW_BYTES, exp_short_row_shifted, exp_shifted, exp_tile_to_pairs, row_max, short_row_max
from .code_products import code_product
from .microkernels import pair_product, product
from .tiles import (accumulator_start, apply_dropout, band_keys, cache_slot_sizes,
                    cached_key_tile, codes_in_registers, convert_query_rows, convert_value_rows, copy_query_rows,
                    dequantize_tile,
                    key_cache, key_segments, memory_batch,
                    memory_batches, narrow_row, pack_key_codes, pack_key_tile, pack_value_pairs, page_run, pair_rows,
                    pair_tiles, prefetch_key_rows, queries_off_lines, query_rows, row_head, score_tile, span,
                    store_weights_row, v_row, v_scale_row, value_tile_rows, whole_vector_rows)
from .operands import Span


def forward_items(ints):
    """The number of work items of :func:`forward_kernel` and (one key range)
    :func:`weights_kernel`."""
    return (ints[Int.BATCH] * (ints[Int.HEADS] // ints[Int.HEAD_GROUP]) * -(-ints[Int.Q_LEN] // ints[Int.BLOCK_Q])
            * ints[Int.KEY_SPLITS])


@helper
def _query_tile(ints, spans, item):
    """Work item -> ``(b, h, i0, i1)``: its batch, (first) head and rows ``[i0, i1)``, cut to
    the entry's live rows ``[Q_START, Q_STOP)`` (empty when the whole tile is padding). An
    item holds HEAD_GROUP heads from h on (one, but for the forward's decode tiles)."""
    heads, q_len, block_q = ints[Int.HEADS] // ints[Int.HEAD_GROUP], ints[Int.Q_LEN], ints[Int.BLOCK_Q]
    tiles = (q_len + block_q - 1) // block_q
    b = item // (heads * tiles)
    h = ((item // tiles) % heads) * ints[Int.HEAD_GROUP]
    i0 = (item % tiles) * block_q
    i1 = smaller(smaller(q_len, i0 + block_q), span(spans, b, Span.Q_STOP))
    return b, h, larger(i0, span(spans, b, Span.Q_START)), i1


@njit(inline="always")
def _out_offset(out_strides, split, b, h, i0):
    """Where row ``i0`` of head ``h`` of entry ``b`` (key range ``split``) starts in out."""
    return split * out_strides[3] + b * out_strides[0] + h * out_strides[1] + i0 * out_strides[2]


@njit(inline="always")
def _sums_rows(ints, out_strides, split, b, h, g, i0):
    """``(offset, row stride)`` of the float32 sums of row ``i0`` of head ``h`` (the item's
    ``g``-th): in out itself, or with OUT_CODES in the item's scratch rows (g's BLOCK_Q rows
    of Dv from :func:`~npattn.cpu.tiles.accumulator_start`)."""
    if ints[Int.OUT_CODES]:
        value_dim = ints[Int.VALUE_DIM]
        return g * ints[Int.BLOCK_Q] * value_dim, value_dim
    return _out_offset(out_strides, split, b, h, i0), out_strides[2]


@kernel
def forward_kernel(q, k, v, bias, mask, alibi, sink, spans, pages, ints, reals, k_codes, v_codes, k_scale, v_scale,
                   out, out_strides, lse, s, tanh, packed, m, total, sums, seen, dequantized, counter, items):
    """Fill ``out`` (a flat view with element strides ``out_strides``, int64 (4,): batch,
    head, row, key range) and ``lse`` (flat (ranges, B, H, Sq); B is 1 with PACKED_ROWS,
    as is out's batch stride 0): every live row (``spans``) whole, zeros and -inf where it
    sees no key; rows outside the live ones stay as they are (a plain call has none: its
    out and lse may start uninitialized). ``s`` to ``dequantized``: this thread's
    :func:`~npattn.cpu.scratch.forward_scratch_specs`. With KV_CODES, k and v are
    placeholders and each key tile is read from ``k_codes`` and ``v_codes`` (int8 times
    their scales, or 16-bit floats: :func:`~npattn.cpu.tiles.dequantize_tile`; 16-bit
    values are read by P V in registers instead, :mod:`npattn.cpu.code_products`); with
    Q_CODES, q is 16-bit memory seen as float32 words, each item's rows converted once into
    the end of ``dequantized`` (:func:`~npattn.cpu.tiles.convert_query_rows`), and with
    OUT_CODES out is 16-bit memory too: each item sums its rows in float32 after those
    (:func:`_sums_rows`) and rounds each into out when it is done.
    ``counter[NON_FINITE]`` becomes 1 where an out row it wrote holds a NaN or an inf.

    One function from the item loop down to the tile's key loop, not a helper per
    tile: Numba optimizes and emits machine code for a function together with every
    helper it calls, once per level of calls, so a level less saves about 1.5 s of the
    first call's compile."""
    block_k, dv = ints[Int.BLOCK_K], ints[Int.VALUE_DIM]
    heads, ld = ints[Int.HEADS], ints[Int.SCORE_LD]
    keep_scale = reals[Real.KEEP_SCALE]
    v_row_stride = ints[Int.V_STRIDE_S]
    splits, split_keys = ints[Int.KEY_SPLITS], ints[Int.SPLIT_KEYS]
    quantized, bf16 = ints[Int.KV_CODES], ints[Int.BF16_PRODUCTS]
    in_registers = codes_in_registers(ints, s)  # (a decode tile's codes not dequantized: code_products)
    # 16-bit keys and values: packed from their own memory (pack_key_codes), and P V reads the
    # values in registers (code_product), as a decode step does: no float32 staging. Head dims
    # that are not whole vectors: each tile's rows converted (dequantize_tile), as a quantized
    # cache's are dequantized, and the products read those
    sixteen_bit = ((quantized == KvCodes.FLOAT16 or quantized == KvCodes.BFLOAT16)
                   and whole_vector_rows(ints, lanes_in(s)))
    tile, values = as_readonly(dequantized), as_readonly(value_tile_rows(ints, dequantized))
    p_pairs, v_pairs = pair_tiles(ints, dequantized)
    half_ld = (ld + 1) // 2
    # (SOFTMAX_SCALE: the score products leave the scale to exp's own multiply)
    softmax_scale = reals[Real.SCALE] if ints[Int.SOFTMAX_SCALE] else scalar_like(1.0, reals)
    group, block_q = ints[Int.HEAD_GROUP], ints[Int.BLOCK_Q]
    share = -(-block_k // group)  # the next tile's keys each head's pass asks memory for
    # asked in two halves, before the scores and before the value products: a burst of a
    # whole share waits for free miss buffers with nothing else to run (measured on the
    # 2-core Zen 4 VM: an int8 step's 64-key tiles streamed 20-35% slower than 32-key ones
    # in one burst, and 3-8% faster than them in two)
    half_share = share // 2
    prefetching = ints[Int.TILE_PREFETCH]  # (HEAD_GROUP items, where it pays: cpu.isa.tile_prefetch_pays)
    # where out's rows are summed: out itself, or (OUT_CODES: 16-bit out) float32 scratch
    # rows, written rounded into out when the item is done (_sums_rows)
    out_codes = ints[Int.OUT_CODES]
    sums_array = dequantized[accumulator_start(ints):] if out_codes else out
    # (KEY_CACHE_SLOTS) the key tiles this thread keeps packed: the first ``cached`` tiles
    # of entry and kv head ``cache_owner``
    key_cache_tiles, value_cache_tiles = key_cache(ints, dequantized)
    cache_key_size, cache_value_size = cache_slot_sizes(ints[Int.HEAD_DIM], dv, block_k, ld, bf16 != 0)
    cache_owner, cached = -1, 0
    item, claimed_stop = -1, 0  # the items [item, claimed_stop) this thread claimed
    while True:
        item += 1
        if item >= claimed_stop:  # (a kv head's items at once where its key tiles are kept)
            item, claimed_stop = claim_items(counter, items, ints[Int.CLAIM_RUN])
            if item >= items:
                break
        split = item % splits
        b, h0, i0, i1 = _query_tile(ints, spans, item // splits)
        rows = i1 - i0
        if rows <= 0:
            continue
        # the sink logit (the row's query head's) enters as a first column of value 0 (with key
        # ranges, in their merge: splitting.merge)
        has_sink = ints[Int.HAS_SINK] and splits == 1
        for g in range(group):  # each head's running max, sum and whether it saw a key; its out rows zero
            for r in range(rows):
                m[g * block_q + r] = sink[row_head(ints, h0 + g, i0 + r)] if has_sink else -np.inf
                total[g * block_q + r] = 1.0 if has_sink else 0.0
                seen[g * block_q + r] = False
                o, row_stride = _sums_rows(ints, out_strides, split, b, h0 + g, g, i0)
                o += r * row_stride
                for x in range(as_offset(o), as_offset(o + dv)):
                    sums_array[x] = 0.0
        if ints[Int.Q_CODES]:  # 16-bit queries: the item's rows in float32, once
            convert_query_rows(q, ints, b, h0, group, i0, rows, dequantized)
        # (QUERY_COPY_WORDS: rows off 64-byte lines copied onto them after the first key tile)
        off_lines, copied = queries_off_lines(q, ints, b, h0, group, i0), False
        sink_start, sink_end, band_start, band_stop = key_segments(ints, spans, b, i0, i1)
        range_start = split * split_keys
        for segment in range(2):
            first, last = (sink_start, sink_end) if segment == 0 else (band_start, band_stop)
            first, last = larger(first, range_start), smaller(last, range_start + split_keys)
            for j0 in range(first, last, block_k):
                cols = smaller(block_k, last - j0)
                for g in range(group):
                    h = h0 + g
                    ahead = j0 + block_k + g * share  # this head's share of the next tile (HEAD_GROUP)
                    if prefetching:  # its first half, rows of every head in memory order
                        prefetch_key_rows(k, v, k_codes, v_codes, k_scale, v_scale, pages, ints, b, ahead,
                                          smaller(ahead + half_share, last))
                    head_m, head_total, head_seen = m[g * block_q:], total[g * block_q:], seen[g * block_q:]
                    out_offset, out_row_stride = _sums_rows(ints, out_strides, split, b, h, g, i0)
                    kv_head = h // (heads // ints[Int.KV_HEADS])
                    if quantized and not in_registers and not sixteen_bit:
                        dequantize_tile(k_codes, v_codes, k_scale, v_scale, pages, ints, b, kv_head, j0, cols,
                                        dequantized)
                    # the tile's packed keys (and with BF16_PRODUCTS its value pairs): kept from an
                    # earlier query tile or head, or packed now
                    key_tile, value_pairs, from_cache = packed[:], v_pairs[:], False
                    slot, slot_keys = cached_key_tile(ints, j0, cols)
                    if slot >= 0:
                        owner = b * ints[Int.KV_HEADS] + kv_head
                        if owner != cache_owner:
                            cache_owner, cached = owner, 0
                        if slot <= cached:  # (the slot after the kept ones: packed now, as far as k goes)
                            key_tile = key_cache_tiles[slot * cache_key_size:]
                            value_pairs = value_cache_tiles[slot * cache_value_size:]
                            from_cache = True
                            if slot == cached:
                                pack_key_tile(k, tile, pages, ints, b, kv_head, j0, slot_keys, key_tile)
                                if bf16:  # (float values: read where they lie)
                                    pack_value_pairs(v, pages, ints, b, kv_head, j0, slot_keys, value_pairs)
                                cached += 1
                    if sixteen_bit:  # (never kept: 16-bit keys are codes, KEY_CACHE_SLOTS 0)
                        pack_key_codes(k_codes, dequantized, pages, ints, b, kv_head, j0, cols, key_tile)
                    elif not from_cache:
                        pack_key_tile(k, tile, pages, ints, b, kv_head, j0, cols, key_tile)
                    query, q_offset, q_row = query_rows(q, dequantized, ints, b, h, g, i0, copied)
                    full = score_tile(query, q_offset, q_row, k, tile, k_codes, k_scale, bias, mask, alibi, spans,
                                      pages, ints, reals, s, ld, tanh, key_tile, b, h, i0, rows, j0, cols)
                    # a bfloat16 tile's probabilities go to pairs as exp makes them (not with
                    # dropout, which needs them in s first, nor on short rows, exp'd inline)
                    pair_ld = half_ld if (bf16 and not ints[Int.HAS_DROPOUT]
                                          and cols * s.itemsize != SHORT_ROW_BYTES) else 0
                    outcome = _exp_with_running_max(s, ld, rows, cols, head_m, head_total, head_seen, sums, bf16,
                                                    p_pairs, pair_ld, softmax_scale)
                    if outcome != _DONE:
                        if outcome == _OVERWRITTEN:
                            # a score rose more than _HEADROOM above its row's max (rare: the running
                            # max is usually set by the first tile): recompute the scores
                            score_tile(query, q_offset, q_row, k, tile, k_codes, k_scale, bias, mask, alibi, spans,
                                       pages, ints, reals, s, ld, tanh, key_tile, b, h, i0, rows, j0, cols)
                        _exp_with_new_max(s, ld, rows, cols, head_m, head_total, head_seen, sums, sums_array,
                                          out_offset, out_row_stride, dv, bf16, p_pairs, pair_ld, softmax_scale)
                    if ints[Int.HAS_DROPOUT]:
                        apply_dropout(ints, s, ld, b, h, i0, rows, j0, cols, 1.0)
                    if prefetching:  # the share's second half
                        prefetch_key_rows(k, v, k_codes, v_codes, k_scale, v_scale, pages, ints, b,
                                          ahead + half_share, smaller(ahead + share, last))
                    # O (rows x dv) += P (rows x cols) . V (cols x dv); on a tile the causal or
                    # window edge cuts, each band of rows stops at its last visible key (the
                    # probabilities past it are exact zeros)
                    # (value rows run by run of one page: page_run)
                    if ints[Int.VECTOR_VALUES] and bf16:  # P rounded to bfloat16, V in pairs of keys
                        if not pair_ld:
                            pair_rows(s, 0, ld, rows, cols, p_pairs, half_ld, 1.0)
                        if not from_cache:
                            pack_value_pairs(v, pages, ints, b, kv_head, j0, cols, value_pairs)
                        band = rows if full else ints[Int.EDGE_BAND]
                        for r0 in range(0, rows, band):
                            band_rows = smaller(band, rows - r0)
                            depth = band_keys(ints, spans, b, i0 + r0 + band_rows - 1, j0, cols, full)
                            pair_product(p_pairs, r0 * half_ld, half_ld, 1, value_pairs, 0, dv, sums_array,
                                         out_offset + r0 * out_row_stride, out_row_stride, band_rows, (depth + 1) // 2,
                                         dv, 1.0, True)
                    elif ints[Int.VECTOR_VALUES]:
                        # a 16-bit tile's values, for a tall query tile: converted once, not per block of rows
                        converted = sixteen_bit and rows >= ints[Int.CONVERTED_VALUE_ROWS]
                        if converted:
                            convert_value_rows(v_codes, pages, ints, b, kv_head, j0, cols, dequantized)
                        band = rows if full else ints[Int.EDGE_BAND]
                        for r0 in range(0, rows, band):
                            band_rows = smaller(band, rows - r0)
                            depth = band_keys(ints, spans, b, i0 + r0 + band_rows - 1, j0, cols, full)
                            c0 = 0
                            while c0 < depth:  # (a tile from codes too: the same sums as its pages' rows)
                                run = page_run(ints, j0 + c0, depth - c0)
                                if in_registers or (sixteen_bit and not converted):
                                    j = j0 + c0
                                    code_product(s, r0 * ld + c0, ld, v_codes, v_row(ints, pages, b, kv_head, j),
                                                 v_row_stride, v_scale, v_scale_row(ints, pages, b, kv_head, j),
                                                 ints[Int.V_SCALE_STRIDE_S], sums_array,
                                                 out_offset + r0 * out_row_stride,
                                                 out_row_stride, band_rows, run, dv, quantized,
                                                 ints[Int.ROW_PREFETCH])
                                elif quantized:  # the converted value rows (16-bit ones too: converted)
                                    product(s, r0 * ld + c0, ld, 1, values, c0 * dv, dv, sums_array,
                                            out_offset + r0 * out_row_stride, out_row_stride, band_rows, run, dv, 1.0,
                                            True)
                                else:
                                    product(s, r0 * ld + c0, ld, 1, v, v_row(ints, pages, b, kv_head, j0 + c0),
                                            v_row_stride, sums_array, out_offset + r0 * out_row_stride,
                                            out_row_stride,
                                            band_rows, run, dv, 1.0, True)
                                c0 += run
                    else:  # column-major: O^T (dv x rows) += V^T (dv x cols) . P^T (cols x rows)
                        c0 = 0
                        while c0 < cols:  # (a 16-bit tile of a Dv that is not whole vectors: its converted rows)
                            run = page_run(ints, j0 + c0, cols - c0)
                            if quantized:
                                gemm(False, False, dv, rows, run, 1.0, values[c0 * dv:], dv, s[c0:], ld, 1.0,
                                     sums_array[out_offset:], out_row_stride)
                            else:
                                gemm(False, False, dv, rows, run, 1.0, v[v_row(ints, pages, b, kv_head, j0 + c0):],
                                     v_row_stride, s[c0:], ld, 1.0, sums_array[out_offset:], out_row_stride)
                            c0 += run
                # (the rows in cache now: the first tile read them; none copied for no tile after it)
                if off_lines and not copied and j0 + block_k < last:
                    copy_query_rows(q, ints, b, h0, group, i0, rows, dequantized)
                    copied = True
        for g in range(group):
            h = h0 + g
            out_offset, out_row_stride = _sums_rows(ints, out_strides, split, b, h, g, i0)
            lse_offset = ((split * memory_batches(ints) + memory_batch(ints, b)) * heads + h) * ints[Int.Q_LEN] + i0
            for r in range(rows):
                o = out_offset + r * out_row_stride
                if seen[g * block_q + r]:
                    factor = keep_scale / total[g * block_q + r]
                    # the caller need not read out again for NaN or inf: the row tells it
                    # (counter[NON_FINITE]). A comparison, which no fastmath flag here lets
                    # LLVM fold (x - x, say, it folds to 0 under "reassoc")
                    finite = True
                    for x in range(as_offset(o), as_offset(o + dv)):
                        sums_array[x] *= factor
                        finite &= abs(sums_array[x]) < np.inf
                    if not finite:
                        counter[NON_FINITE] = 1
                    lse[lse_offset + r] = m[g * block_q + r] + math.log(total[g * block_q + r])
                else:  # (zeros again: the products may have left 0 * inf = NaN from a value row)
                    lse[lse_offset + r] = -np.inf
                    for x in range(as_offset(o), as_offset(o + dv)):
                        sums_array[x] = 0.0
                if out_codes:  # the row rounded into 16-bit out
                    narrow_row(sums_array, o, out, _out_offset(out_strides, split, b, h, i0 + r), dv,
                               out_codes == KvCodes.BFLOAT16)


# exp(s - m) may reach exp(_HEADROOM) when m lags the true max: far below float32's
# overflow (exp(88)) even summed over a whole row, and exact all the same. A tile's sum
# is at least exp(its max - m), so a sum past _REDO_ABOVE is the sign of a lagging max.
_HEADROOM = 60.0
_REDO_ABOVE = math.exp(_HEADROOM)
_DONE, _UNTOUCHED, _OVERWRITTEN = 0, 1, 2


@helper
def _exp_with_running_max(s, ld, rows, cols, m, total, seen, sums, brief, pairs, pair_ld, scale):
    """The common tile: exp against each row's running max ``m`` as it stands, with no
    max pass and no rescale of the output. Returns _DONE; or _UNTOUCHED when a row
    has seen no key yet, and _OVERWRITTEN (scores replaced) when a row's sum shows
    a score more than the headroom above its max: the caller then takes
    :func:`_exp_with_new_max`. ``brief``: exp to bfloat16's needs (BF16_PRODUCTS,
    :func:`~npattn.cpu.rowmath.exp_shifted`); ``pair_ld`` > 0 (with ``brief``, not on
    short rows): the probabilities go to ``pairs``, row r's from ``r * pair_ld``, as
    bfloat16 pairs (:func:`~npattn.cpu.rowmath.exp_tile_to_pairs`), not to ``s``.
    ``scale``: the scores' scale where their products left it out (SOFTMAX_SCALE), else 1."""
    for r in range(rows):
        if not seen[r]:
            return _UNTOUCHED
    short = cols * s.itemsize == SHORT_ROW_BYTES  # (short rows: inlined, side by side)
    scale = _scaled_unless_to_pairs(s, ld, rows, cols, scale, short or not pair_ld)
    _exp_tile(s, ld, rows, cols, m, sums, short, brief, pairs, pair_ld, scale)
    for r in range(rows):
        if not sums[r] <= _REDO_ABOVE:
            return _OVERWRITTEN
    for r in range(rows):
        total[r] += sums[r]
    return _DONE


@helper
def _exp_with_new_max(s, ld, rows, cols, m, total, seen, sums, out, out_offset, out_row_stride, dv, brief, pairs,
                      pair_ld, scale):
    """The textbook online-softmax step: a max pass, exp against the new max, and the
    running sum and output rows rescaled by exp(m_old - m_new) (``sums``, ``brief``,
    ``pairs``, ``pair_ld`` and ``scale``: as :func:`_exp_with_running_max`'s)."""
    short = cols * s.itemsize == SHORT_ROW_BYTES  # (short rows: inlined, side by side)
    scale = _scaled_unless_to_pairs(s, ld, rows, cols, scale, short or not pair_ld)
    for r in range(rows):  # the new maxima; each row's shift to sums[r], where exp puts its sum
        # (a positive scale keeps the max where it is)
        tile_max = (short_row_max(s, r * ld) if short else row_max(s, r * ld, cols)) * scale
        m_before = m[r]
        new_max = larger(m_before, tile_max)
        if tile_max > -np.inf:
            seen[r] = True
        # nothing visible yet: a shift of 0 keeps every exp at 0 (not NaN)
        sums[r] = new_max if new_max > -np.inf else 0.0
        # (exp(-inf) without a call into libm: the first tile of every row)
        correction = 1.0 if new_max == -np.inf else (0.0 if m_before == -np.inf else math.exp(m_before - new_max))
        m[r] = new_max
        total[r] *= correction
        # a row that has seen no key yet has a zero output row: nothing to rescale (the
        # first tile of every row; a small call's only one)
        if correction != 1.0 and m_before > -np.inf:
            o = out_offset + r * out_row_stride
            for x in range(as_offset(o), as_offset(o + dv)):
                out[x] *= correction
    _exp_tile(s, ld, rows, cols, sums, sums, short, brief, pairs, pair_ld, scale)
    for r in range(rows):
        if sums[r] != sums[r]:  # a visible NaN score (row_max skips it): the row is NaN
            seen[r] = True
        total[r] += sums[r]


@njit(inline="always")
def _exp_tile(s, ld, rows, cols, shifts, sums, short, brief, pairs, pair_ld, scale):
    """``sums[r]`` = the sum of row r's exp against ``shifts[r]`` (read first: they may be
    one array), the values to s (short rows inlined side by side, or ``brief``'s) or with
    ``pair_ld`` to bfloat16 pairs (the scores then stay in s, but for each row's last
    values: a redo computes them again all the same)."""
    if pair_ld and not short:
        exp_tile_to_pairs(s, ld, rows, cols, shifts, pairs, pair_ld, scale, sums)
        return
    for r in range(rows):
        if short:
            sums[r] = exp_short_row_shifted(s, r * ld, shifts[r])
        else:
            sums[r] = exp_shifted(s, r * ld, cols, shifts[r], brief)


@njit(inline="always")
def _scaled_unless_to_pairs(s, ld, rows, cols, scale, other_path):
    """The scale exp should apply to the tile's scores: ``scale`` where they go to pairs
    (:func:`~npattn.cpu.rowmath.exp_tile_to_pairs` applies it), else 1, the scores
    scaled here first (a short row's or a dropout tile's exp takes scaled scores)."""
    if scale == 1.0 or not other_path:
        return scale
    for r in range(rows):
        for x in range(as_offset(r * ld), as_offset(r * ld + cols)):
            s[x] *= scale
    return scalar_like(1.0, s)


@kernel
def weights_kernel(q, k, v, bias, mask, alibi, sink, spans, pages, ints, reals, k_codes, v_codes, k_scale, v_scale,
                   lse, weights, weights_codes, s, tanh, packed, dequantized, counter, items):
    """Fill ``weights`` (flat, C-contiguous (B, H, Sq, Sk), zero on entry) with
    ``exp(s - lse)``: the exact probabilities, after masking and before dropout; with
    ``weights_codes`` (a KvCodes: FLOAT16 or BFLOAT16; else NONE) 16-bit weights, their
    memory seen as float32 words, each row rounded as it is stored (a float32 copy and a
    pass to round it had taken a float16 call 1.12-1.18x float32's time).
    ``s`` to ``dequantized``: this thread's :func:`~npattn.cpu.scratch.weights_scratch_specs`."""
    block_k, ld = ints[Int.BLOCK_K], ints[Int.SCORE_LD]
    heads, q_len, kv_len = ints[Int.HEADS], ints[Int.Q_LEN], ints[Int.KV_LEN]
    tile = as_readonly(dequantized)
    while True:
        item = next_item(counter, items)
        if item >= items:
            break
        b, h, i0, i1 = _query_tile(ints, spans, item)
        rows = i1 - i0
        if rows <= 0:
            continue
        row_offset = (memory_batch(ints, b) * heads + h) * q_len + i0
        kv_head = h // (heads // ints[Int.KV_HEADS])
        if ints[Int.Q_CODES]:  # 16-bit queries: the item's rows in float32, once (as the forward)
            convert_query_rows(q, ints, b, h, 1, i0, rows, dequantized)
        query, q_offset, q_row = query_rows(q, dequantized, ints, b, h, 0, i0, False)
        sink_start, sink_end, band_start, band_stop = key_segments(ints, spans, b, i0, i1)
        for segment in range(2):
            first, last = (sink_start, sink_end) if segment == 0 else (band_start, band_stop)
            for j0 in range(first, last, block_k):
                cols = smaller(block_k, last - j0)
                if ints[Int.KV_CODES] and not codes_in_registers(ints, s):
                    dequantize_tile(k_codes, v_codes, k_scale, v_scale, pages, ints, b, kv_head, j0, cols,
                                    dequantized, False)
                pack_key_tile(k, tile, pages, ints, b, kv_head, j0, cols, packed)
                score_tile(query, q_offset, q_row, k, tile, k_codes, k_scale, bias, mask, alibi, spans, pages, ints,
                           reals, s, ld, tanh, packed, b, h, i0, rows, j0, cols)
                for r in range(rows):
                    row_lse = lse[row_offset + r]
                    if row_lse > -np.inf:  # an empty row keeps its zeros
                        exp_shifted(s, r * ld, cols, row_lse, False)
                        store_weights_row(s, as_offset(r * ld), weights, as_offset((row_offset + r) * kv_len + j0),
                                          cols, weights_codes)
