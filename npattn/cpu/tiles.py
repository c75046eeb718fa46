"""The pieces every CPU kernel shares: which keys a row may see, the dropout hash, and
one tile of fully optioned scores.

All functions here are Numba-jitted; ``ints`` and ``reals`` are the parameter arrays
of :mod:`npattn.cpu.operands` (indexed by ``Int`` and ``Real``), the other arrays are
the flat operands of the same name. They mirror the reference's steps exactly (see
:mod:`npattn.reference`), one (rows x cols) tile at a time.
"""
from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from .blas import gemm
from .code_products import code_bytes, code_dot_products
from .jit import OPTIONS, helper
from .rowmath import soft_capped
from .microkernels import dot_products, pack_transposed, pair_bits, pair_product, padded_width, product
from .simd import (VECTOR_BYTES, add, as_bits, as_float, fill, horizontal_sum, lanes_in, line_elements, load,
                   load_first, load_float16_bits, load_float16_bits_first, multiply, prefetch, prefetch_to_l2, store,
                   store_bfloat16, store_first, store_float16_bits, store_float16_bits_first, store_interleaved_pairs,
                   transpose_converted_square)
from .operands import SPAN_FIELDS, Int, KvCodes, Real, Span, cache_slot_words
from .signatures import as_offset, as_readonly, larger, plain_int, scalar_like, smaller

_MASK32 = np.uint64(0xFFFFFFFF)
_MIX_INCREMENT = np.uint64(0x9E3779B9)
_MIX_MULTIPLIER_1 = np.uint64(0x85EBCA6B)
_MIX_MULTIPLIER_2 = np.uint64(0xC2B2AE35)


@helper
def span(spans, b, column):
    """Batch entry ``b``'s entry ``column`` (a :class:`~npattn.core.kernel_params.Span`) of the
    flat spans operand."""
    return spans[b * SPAN_FIELDS + column]


@helper
def key_row(ints, pages, b, head, j, stride_b, stride_h, stride_s):
    """Element offset of key ``j``'s row of ``head`` in batch entry ``b`` of k or v (whose
    strides are given): row ``j % PAGE_SIZE`` of page ``pages[b * PAGES + j // PAGE_SIZE]``
    (not paged: row j of batch entry b)."""
    page_size = ints[Int.PAGE_SIZE]
    block = j // page_size
    return pages[b * ints[Int.PAGES] + block] * stride_b + head * stride_h + (j - block * page_size) * stride_s


@helper
def k_row(ints, pages, b, head, j):
    return key_row(ints, pages, b, head, j, ints[Int.K_STRIDE_B], ints[Int.K_STRIDE_H], ints[Int.K_STRIDE_S])


@helper
def v_row(ints, pages, b, head, j):
    return key_row(ints, pages, b, head, j, ints[Int.V_STRIDE_B], ints[Int.V_STRIDE_H], ints[Int.V_STRIDE_S])


@helper
def page_run(ints, j, keys):
    """How many of the ``keys`` keys from key ``j`` lie in ``j``'s page: rows one stride
    apart, which one product can read. A tile of keys is read run by run (one run when k
    and v are not paged)."""
    page_size = ints[Int.PAGE_SIZE]
    return smaller(keys, (j // page_size + 1) * page_size - j)


@helper
def memory_batch(ints, b):
    """Batch entry ``b``'s batch index in out, lse and the gradients: ``b``, or 0 when every
    entry's rows share one packed batch (PACKED_ROWS: their live rows are disjoint)."""
    return 0 if ints[Int.PACKED_ROWS] else b


@helper
def memory_batches(ints):
    """How many batch entries out, lse and the gradients hold: BATCH, or 1 when packed."""
    return 1 if ints[Int.PACKED_ROWS] else ints[Int.BATCH]


@helper
def row_position(ints, spans, b, i):
    """The position of query row ``i`` of batch entry ``b`` in the key sequence
    (``i + SHIFT``; bottom-right aligned by default): row ``i`` of a folded problem
    (:mod:`npattn.cpu.folding`) stands for query ``i // ROW_GROUP``."""
    group = ints[Int.ROW_GROUP]
    # (an integer division is 20-40 cycles: most problems have no folded rows)
    return (i if group == 1 else i // group) + span(spans, b, Span.SHIFT)


@njit(inline="always")
def row_head(ints, h, i):
    """The query head of row ``i`` of head ``h``: ``h`` itself, or in a folded problem
    (:mod:`npattn.cpu.folding`: ``h`` a kv head, its rows position-major) query head
    ``h * ROW_GROUP + i % ROW_GROUP``, whose ALiBi slope and sink logit the row takes."""
    group = ints[Int.ROW_GROUP]
    return h if group == 1 else h * group + i % group


@helper
def hidden_tail(s, start, stop, row_end):
    """``s[start:stop] = -inf`` for a run of hidden keys ending a score row, in whole
    vectors as far as ``row_end`` (the row's end in the tile: its columns past ``stop``
    are padding that nothing reads: every reader of a score row stops at its ``cols``, and
    :func:`pair_rows` pairs past it with 0). The causal diagonal tile hides a tail of every
    row; filled a column at a time, LLVM's scalar remainder loop took 4% of a causal
    (1, 64, 16 x 16, 16) forward's kernel samples."""
    lanes = lanes_in(s)
    hidden = fill(-np.inf, s)
    x = start
    while x < stop and x + lanes <= row_end:
        store(s, x, hidden)
        x += lanes
    for c in range(as_offset(x), as_offset(stop)):
        s[c] = -np.inf


@helper
def key_band(ints, spans, b, i):
    """``(lo, hi, sink_end)`` for query row ``i`` of batch ``b``: the row sees keys in
    ``[lo, hi)`` and in ``[KV_START, sink_end)`` (causal, window, sinks, the live keys;
    see :meth:`npattn.core.masks.Visibility.allowed`). Each bound is nondecreasing in ``i``,
    which is what lets a tile of rows be bounded by its first and last row (a folded
    problem's :func:`row_position` is nondecreasing too)."""
    kv_first, kv_valid = span(spans, b, Span.KV_START), span(spans, b, Span.KV_STOP)
    kv_len, left, right, causal = ints[Int.KV_LEN], ints[Int.WINDOW_LEFT], ints[Int.WINDOW_RIGHT], ints[Int.CAUSAL]
    position = row_position(ints, spans, b, i)
    # clipped to the keys: with q_offset a row may sit past the last key
    lo = kv_first if left < 0 else smaller(kv_len, larger(kv_first, position - left))
    hi = kv_len if right < 0 else smaller(kv_len, position + right + 1)
    if causal:
        hi = smaller(hi, position + 1)
    hi = larger(lo, smaller(hi, kv_valid))
    sink_end = kv_first
    if left >= 0 or right >= 0:
        sink_end = smaller(kv_first + ints[Int.SINKS], kv_valid)
        if causal:
            sink_end = smaller(sink_end, position + 1)
        sink_end = larger(kv_first, sink_end)
    if i < span(spans, b, Span.Q_START):  # left padding sees no key (the kernels skip it anyway)
        hi = lo
    return lo, hi, sink_end


@helper
def key_segments(ints, spans, b, i0, i1):
    """The keys rows ``[i0, i1)`` may see, as two disjoint half-open segments
    ``(sink_start, sink_end)`` and ``(start, stop)`` (either may be empty): whole key
    tiles outside them are never computed."""
    lo_first, _, _ = key_band(ints, spans, b, i0)
    _, hi_last, sink_last = key_band(ints, spans, b, i1 - 1)
    start = larger(lo_first, sink_last)
    return span(spans, b, Span.KV_START), sink_last, start, larger(start, hi_last)


@helper
def tile_fully_visible(ints, spans, b, i0, i1, j0, j1):
    """True when every row of ``[i0, i1)`` sees every key of ``[j0, j1)`` through causal,
    window, sinks and the live keys (bounds are monotone, so the first and last rows decide)."""
    lo_first, hi_first, sink_first = key_band(ints, spans, b, i0)
    lo_last, _, _ = key_band(ints, spans, b, i1 - 1)
    return (span(spans, b, Span.KV_START) <= j0 and j1 <= sink_first) or (lo_last <= j0 and j1 <= hi_first)


@helper
def band_keys(ints, spans, b, i_last, j0, cols, full):
    """How many keys of ``[j0, j0 + cols)`` rows up to ``i_last`` may see: ``cols`` for a
    fully visible tile (``full``), else up to the end of row ``i_last``'s band or sinks
    (both nondecreasing in the row, so no earlier row sees a key past them).

    On a tile the causal or window edge cuts, the kernels run their products in bands
    of ``ints[Int.EDGE_BAND]`` rows, each stopping at its last row's count: on the
    diagonal tiles of a causal problem that skips most of the masked upper triangle."""
    if full:
        return cols
    _, hi, sink_end = key_band(ints, spans, b, i_last)
    return larger(0, smaller(cols, larger(hi, sink_end) - j0))


@helper
def fmix32(x):
    """MurmurHash3's finalizer on a uint64 holding a 32-bit value (see :mod:`npattn.core.dropout`)."""
    x ^= x >> np.uint64(16)
    x = (x * _MIX_MULTIPLIER_1) & _MASK32
    x ^= x >> np.uint64(13)
    x = (x * _MIX_MULTIPLIER_2) & _MASK32
    return x ^ (x >> np.uint64(16))


@helper
def absorb(state, word):
    return fmix32(((state ^ word) + _MIX_INCREMENT) & _MASK32)


@helper
def dropout_row_state(ints, b, h, i):
    """The hash state after absorbing (seed_lo, seed_hi, b, h, i): one per query row."""
    state = absorb(np.uint64(0), np.uint64(ints[Int.SEED_LO]))
    state = absorb(state, np.uint64(ints[Int.SEED_HI]))
    state = absorb(state, np.uint64(b + ints[Int.DROPOUT_OFFSET_B]) & _MASK32)
    state = absorb(state, np.uint64(h + ints[Int.DROPOUT_OFFSET_H]) & _MASK32)
    return absorb(state, np.uint64(i + ints[Int.DROPOUT_OFFSET_I]) & _MASK32)


@njit(inline="always")
def apply_dropout(ints, s, ld, b, h, i0, rows, j0, cols, keep_scale):
    """Multiply each probability of the tile by ``keep_scale`` where the hash keeps it, 0 where
    it drops it (``keep_scale`` is 1 / (1 - p) or 1)."""
    _apply_dropout(ints, s, plain_int(ld), plain_int(b), plain_int(h), plain_int(i0), plain_int(rows),
                   plain_int(j0), plain_int(cols), scalar_like(keep_scale, s))


@helper
def _apply_dropout(ints, s, ld, b, h, i0, rows, j0, cols, keep_scale):
    threshold = np.uint64(ints[Int.DROPOUT_THRESHOLD])
    first_key = as_offset(j0 + ints[Int.DROPOUT_OFFSET_J])
    for r in range(rows):
        state = dropout_row_state(ints, b, h, i0 + r)
        row = as_offset(r * ld)
        for c in range(as_offset(cols)):
            kept = (absorb(state, np.uint64(first_key + c) & _MASK32) >> np.uint64(8)) >= threshold
            s[row + c] = s[row + c] * keep_scale if kept else 0.0


def codes_in_registers(ints, scores):
    """Whether a tile's products read a cache's codes (int8 or float8 e4m3 with scales,
    float16 or bfloat16) in registers (:mod:`npattn.cpu.code_products`), with no
    :func:`dequantize_tile`: a decode tile (a few rows, DOT_SCORES, whose P V runs on the
    micro-kernels for any Dv: VECTOR_VALUES), its sums in float32 (``scores``' dtype; a
    float64 kernel answers False when compiled, so its code is not compiled there). Head
    dims that are not whole vectors (16-bit ones: a one-byte cache's are) read their last
    vector masked (since 2026-12-01: their tiles had been converted into float32 rows)."""
    raise NotImplementedError


@overload(codes_in_registers, jit_options=OPTIONS)
def _codes_in_registers_overload(ints, scores):
    if scores.dtype != types.float32:
        return lambda ints, scores: False
    return lambda ints, scores: (ints[Int.KV_CODES] != KvCodes.NONE and ints[Int.DOT_SCORES]
                                 and ints[Int.VECTOR_VALUES])


@njit(inline="always")
def whole_vector_rows(ints, lanes):
    """Whether the head dim and Dv are whole vectors of ``lanes``: what a prefill tile's
    products that read 16-bit codes in registers, and the square transposes that pack
    their keys, take. A 16-bit prefill of other head dims (even ones:
    :func:`~npattn.cpu.operands.kv_codes`) converts each key tile's rows into float32 rows
    (:func:`dequantize_tile`), whose last vector is read masked, and takes the quantized
    caches' path from there; a decode tile reads them in registers all the same
    (:func:`codes_in_registers`)."""
    return ints[Int.HEAD_DIM] % lanes == 0 and ints[Int.VALUE_DIM] % lanes == 0


@njit(inline="always")
def k_scale_row(ints, pages, b, head, j):
    """Where key ``j``'s scale of ``head`` (its kv head) lies in the key scales."""
    return key_row(ints, pages, b, head, j, ints[Int.K_SCALE_STRIDE_B], ints[Int.K_SCALE_STRIDE_H],
                   ints[Int.K_SCALE_STRIDE_S])


@njit(inline="always")
def v_scale_row(ints, pages, b, head, j):
    """Where key ``j``'s scale of ``head`` (its kv head) lies in the value scales."""
    return key_row(ints, pages, b, head, j, ints[Int.V_SCALE_STRIDE_B], ints[Int.V_SCALE_STRIDE_H],
                   ints[Int.V_SCALE_STRIDE_S])


@helper
def dequantize_tile(k_codes, v_codes, k_scale, v_scale, pages, ints, b, kv_head, j0, cols, dequantized,
                    values=True):
    """Keys ``[j0, j0 + cols)`` of ``kv_head`` read from codes (``Int.KV_CODES``) as float
    rows: int8 or float8 e4m3 codes times their key's scale, or float16 / bfloat16 bits
    converted. The keys (cols x D) from ``dequantized[0]``, the values (cols x Dv) from
    ``dequantized[BLOCK_K * D]`` (not with ``values`` False: a caller that reads the values
    from the codes, or not at all), each row contiguous. :func:`pack_key_tile`,
    :func:`score_tile` and the forward's P V then read the tile's rows: an int8 cache
    streams in at a quarter of float32's bytes, a 16-bit one at half, with no float32
    copy of either. (A 16-bit forward needs none of this: it packs its keys from their own
    memory, :func:`pack_key_codes`, and P V reads the values in registers.)"""
    head_dim, value_dim = ints[Int.HEAD_DIM], ints[Int.VALUE_DIM]
    values_at = ints[Int.BLOCK_K] * head_dim
    codes = ints[Int.KV_CODES]
    width = code_bytes(codes)
    k_step, v_step = ints[Int.K_STRIDE_S], ints[Int.V_STRIDE_S]
    k_scale_step, v_scale_step = ints[Int.K_SCALE_STRIDE_S], ints[Int.V_SCALE_STRIDE_S]
    c = 0
    while c < cols:  # run by run of one page: the offsets of its first key, then strides
        j = j0 + c
        run = page_run(ints, j, cols - c)
        k_at, v_at = k_row(ints, pages, b, kv_head, j), v_row(ints, pages, b, kv_head, j)
        if width == 2:  # 16-bit values: no scales, rows converted as they lie, the keys' then the values'
            _converted_rows(k_codes, k_at, k_step, run, head_dim, codes == KvCodes.BFLOAT16, dequantized,
                            c * head_dim)
            if values:
                _converted_rows(v_codes, v_at, v_step, run, value_dim, codes == KvCodes.BFLOAT16, dequantized,
                                values_at + c * value_dim)
            c += run
            continue
        k_scale_at, v_scale_at = k_scale_row(ints, pages, b, kv_head, j), v_scale_row(ints, pages, b, kv_head, j)
        for r in range(run):
            if r + _PREFETCH_ROWS < run:  # the rows a few keys on: a decode step waits on memory
                k_ahead, v_ahead = k_at + (r + _PREFETCH_ROWS) * k_step, v_at + (r + _PREFETCH_ROWS) * v_step
                _prefetch_span(k_codes, k_ahead, k_ahead + head_dim * width)
                _prefetch_span(v_codes, v_ahead, v_ahead + value_dim * width)
            # the key row, then the value row, through one body: each decoder is inlined
            # once, not once per operand (the first call's compile is 1-2 s shorter)
            for part in range(2 if values else 1):
                if part == 0:
                    source, at, scale, out_at, count = (k_codes, k_at + r * k_step,
                                                        k_scale[k_scale_at + r * k_scale_step], (c + r) * head_dim,
                                                        head_dim)
                else:
                    source, at, scale, out_at, count = (v_codes, v_at + r * v_step,
                                                        v_scale[v_scale_at + r * v_scale_step],
                                                        values_at + (c + r) * value_dim, value_dim)
                if codes == KvCodes.INT8:
                    _scaled_row(source, at, scale, dequantized, out_at, count)
                else:
                    _e4m3_row(source, at, scale, dequantized, out_at, count)
        c += run


@helper
def convert_value_rows(v_codes, pages, ints, b, kv_head, j0, cols, dequantized):
    """The values of keys ``[j0, j0 + cols)`` of ``kv_head`` (16-bit codes, KV_CODES
    FLOAT16 or BFLOAT16) as float32 rows in :func:`value_tile_rows`' place, as
    :func:`dequantize_tile` converts them: the same floats, so P V's products give the bits
    of a float32 copy's."""
    value_dim, v_step = ints[Int.VALUE_DIM], ints[Int.V_STRIDE_S]
    values_at = ints[Int.BLOCK_K] * ints[Int.HEAD_DIM]
    brain = ints[Int.KV_CODES] == KvCodes.BFLOAT16
    c = 0
    while c < cols:  # run by run of one page
        run = page_run(ints, j0 + c, cols - c)
        _converted_rows(v_codes, v_row(ints, pages, b, kv_head, j0 + c), v_step, run, value_dim, brain,
                        dequantized, values_at + c * value_dim)
        c += run


# Keys ahead that dequantize_tile asks memory for
_PREFETCH_ROWS = 8


@helper
def prefetch_key_rows(k, v, k_codes, v_codes, k_scale, v_scale, pages, ints, b, j_start, j_stop):
    """Ask memory for keys ``[j_start, j_stop)`` of every kv head of entry ``b`` (in its row
    or pages): k and v, or their codes and scales (``Int.KV_CODES``), each key's row of heads in
    memory order. A decode step's item visits a key tile head by head (HEAD_GROUP): each
    head's pass alone reads a cache whose key rows hold every head (B, S, Hkv, D) a slice
    per row, at half the bandwidth of reading it in order (measured: 5.2 against 10.6
    GB/s on one core of the 2-core AVX-512 VM); these requests read the next tile in
    order while this one is worked on, into L2 (:data:`~npattn.cpu.simd.prefetch_to_l2`:
    a tile ahead in L1 would crowd out the tile being worked on), and the heads' passes
    find it there."""
    heads, head_dim, value_dim = ints[Int.KV_HEADS], ints[Int.HEAD_DIM], ints[Int.VALUE_DIM]
    codes = ints[Int.KV_CODES]
    width = code_bytes(codes)
    # Row by row, each row's page looked up again: measured on the 2-core Zen 4 VM, a loop
    # that looked pages up once per run issued the requests faster and an int8 step
    # (1, 32/8, 16384, 128) slowed: 1.88-2.27x float32's speed against 2.47-2.70x this way,
    # three alternating processes (the requests of a tile in one burst wait on each other)
    k_asked = v_asked = -1  # the lines of scales asked for last
    for j in range(j_start, j_stop):
        if codes:
            _prefetch_tile_span(k_codes, k_row(ints, pages, b, 0, j),
                                k_row(ints, pages, b, heads - 1, j) + head_dim * width)
            _prefetch_tile_span(v_codes, v_row(ints, pages, b, 0, j),
                                v_row(ints, pages, b, heads - 1, j) + value_dim * width)
            if codes in (KvCodes.INT8, KvCodes.FLOAT8):  # (16-bit codes have no scales)
                # a line of scales holds several keys' (a row of every head's is 8 x 4 bytes
                # at Hkv = 8): asked for once, by the first key in it
                k_at, v_at = k_scale_row(ints, pages, b, 0, j), v_scale_row(ints, pages, b, 0, j)
                k_line, v_line = _line_of(k_scale, k_at), _line_of(v_scale, v_at)
                if k_line != k_asked:
                    prefetch_to_l2(k_scale, k_at)
                    k_asked = k_line
                if v_line != v_asked:
                    prefetch_to_l2(v_scale, v_at)
                    v_asked = v_line
        else:
            _prefetch_tile_span(k, k_row(ints, pages, b, 0, j), k_row(ints, pages, b, heads - 1, j) + head_dim)
            _prefetch_tile_span(v, v_row(ints, pages, b, 0, j), v_row(ints, pages, b, heads - 1, j) + value_dim)


@njit(inline="always")
def _line_of(array, index):
    """The number of the 64-byte cache line that holds ``array[index]`` (counted from
    the line of the array's first element, wherever in its line that lies)."""
    return (index + array.ctypes.data % 64 // array.itemsize) // line_elements(array)


@njit(inline="always")
def _prefetch_span(array, start, stop):
    """The cache lines of ``array[start:stop]``, into L1 (for use a few rows on)."""
    for x in range(start, stop, line_elements(array)):
        prefetch(array, x)


@njit(inline="always")
def _prefetch_tile_span(array, start, stop):
    """The cache lines of ``array[start:stop]``, into L2 (for the next key tile)."""
    for x in range(start, stop, line_elements(array)):
        prefetch_to_l2(array, x)


@njit(inline="always")
def _scaled_row(codes, offset, scale, out, out_offset, width):
    """``out[out_offset + x] = codes[offset + x] * scale`` for x < width, in out's dtype."""
    factor = scalar_like(scale, out)
    start, source = as_offset(out_offset), as_offset(offset)
    for x in range(as_offset(width)):
        out[start + x] = scalar_like(codes[source + x], out) * factor


@njit(inline="always")
def _e4m3_row(codes, offset, scale, out, out_offset, width):
    """``out[out_offset + x]`` = the float8 e4m3 value of the byte ``codes[offset + x]`` times
    ``scale``, for x < width, in out's dtype. The byte's 7 magnitude bits shifted into a
    float32's exponent and mantissa read as 2^-127 times the value, subnormals included, so
    one multiply by 2^120 gives it (a branch-free loop LLVM vectorizes; a 256-entry table
    lookup ran at a third of the speed); 0x7F and 0xFF are NaN."""
    factor = scalar_like(scale, out)
    start, source = as_offset(out_offset), as_offset(offset)
    for x in range(as_offset(width)):
        byte = codes[source + x] & 0xFF
        magnitude = as_float((byte & 0x7F) << 20) * _E4M3_UNBIAS
        value = -magnitude if byte & 0x80 else magnitude
        out[start + x] = scalar_like(value if byte & 0x7F != 0x7F else np.nan, out) * factor


# 2^(127 - 7): a float32 exponent's bias over e4m3's
_E4M3_UNBIAS = np.float32(2.0 ** 120)


@njit(inline="always")
def _converted_row(codes, offset, out, out_offset, width, brain):
    """``out[out_offset + x]`` = the 16-bit float whose bytes start at ``codes[offset + 2x]``
    (bfloat16 with ``brain``, else float16), for x < width (out float32): whole vectors, and
    a last, partial one read and written masked (a head dim that is not whole vectors: the
    next bytes are another row's, in codes and in out)."""
    like = fill(0.0, out)
    lanes = lanes_in(out)
    whole = width - width % lanes
    for x in range(0, whole, lanes):
        store(out, out_offset + x, load_float16_bits(codes, offset + 2 * x, like, brain))
    if whole < width:
        rest = width - whole
        store_first(out, out_offset + whole, load_float16_bits_first(codes, offset + 2 * whole, rest, like, brain),
                    rest)


@helper
def _converted_rows(codes, at, row_bytes, rows, width, brain, out, out_at):
    """``rows`` rows of ``width`` 16-bit floats (bfloat16 with ``brain``, else float16),
    the first at byte ``at`` of ``codes`` (int8), the next ``row_bytes`` on, as contiguous
    float32 rows from ``out[out_at]`` (a last, partial vector masked): one loop a row,
    with none of the per-row scale and decoder choices of the one-byte codes. (Measured on
    the 2-core Zen 4 VM against those, five alternating processes: small float16 calls
    (1, 8, 16 x 16, 64) and (4, 8, 32 x 32, 64) 1-3% faster, larger ones within the noise.)"""
    for r in range(rows):
        if r + _PREFETCH_ROWS < rows:  # the row a few keys on: a tile from memory waits on it
            ahead = at + (r + _PREFETCH_ROWS) * row_bytes
            _prefetch_span(codes, ahead, ahead + 2 * width)
        if brain:
            _converted_row(codes, at + r * row_bytes, out, out_at + r * width, width, True)
        else:
            _converted_row(codes, at + r * row_bytes, out, out_at + r * width, width, False)


@njit(inline="always")
def query_offset(ints, b, h, i0):
    """Where row ``i0`` of head ``h`` of entry ``b`` starts in q (its strides' units)."""
    return b * ints[Int.Q_STRIDE_B] + h * ints[Int.Q_STRIDE_H] + i0 * ints[Int.Q_STRIDE_S]


@njit(inline="always")
def query_tile_start(ints):
    """Where the float32 rows of a work item's 16-bit queries (Q_CODES) start in the
    dequantized scratch: after a key tile's keys and values (:func:`dequantize_tile`)."""
    return ints[Int.BLOCK_K] * (ints[Int.HEAD_DIM] + ints[Int.VALUE_DIM])


@njit(inline="always")
def accumulator_start(ints):
    """Where the float32 sums of a work item's out rows (OUT_CODES: HEAD_GROUP x BLOCK_Q rows
    of Dv) start in the dequantized scratch: after the key tile and the item's queries, or
    with BF16_PRODUCTS after the pair tiles (:func:`pair_tiles`)."""
    if ints[Int.BF16_PRODUCTS]:
        p_size, value_size = pair_tile_sizes(ints[Int.BLOCK_Q], ints[Int.BLOCK_K], ints[Int.VALUE_DIM],
                                             ints[Int.SCORE_LD])
        return p_size + value_size
    return query_tile_start(ints) + ints[Int.HEAD_GROUP] * ints[Int.BLOCK_Q] * ints[Int.HEAD_DIM]


@njit(inline="always")
def convert_rows(words, at, row_bytes, rows, width, brain, out, out_at):
    """``rows`` rows of ``width`` 16-bit floats (bfloat16 with ``brain``, else float16) from
    ``words`` (16-bit memory seen as float32 words), the first at byte ``at``, the next
    ``row_bytes`` on, as contiguous float32 rows from ``out[out_at]`` (:func:`_converted_row`)."""
    source = words.view(np.int8)
    for r in range(rows):
        if brain:
            _converted_row(source, at + r * row_bytes, out, out_at + r * width, width, True)
        else:
            _converted_row(source, at + r * row_bytes, out, out_at + r * width, width, False)


@njit(inline="always")
def convert_query_rows(q, ints, b, h0, heads, i0, rows, dequantized):
    """Q_CODES: rows ``[i0, i0 + rows)`` of heads ``[h0, h0 + heads)`` of entry ``b``, from
    q's 16-bit memory (float32 words, byte strides), as float32 rows of HEAD_DIM in the
    dequantized scratch, head g's row r at ``query_tile_start + (g * BLOCK_Q + r) * HEAD_DIM``:
    each query converted once per work item (a backward's, once per key tile), never a
    float32 copy of q."""
    head_dim, start, block_q = ints[Int.HEAD_DIM], query_tile_start(ints), ints[Int.BLOCK_Q]
    for g in range(heads):
        convert_rows(q, query_offset(ints, b, h0 + g, i0), ints[Int.Q_STRIDE_S], rows, head_dim,
                     ints[Int.Q_CODES] == KvCodes.BFLOAT16, dequantized, start + g * block_q * head_dim)


def narrow_row(sums, offset, out, out_at, width, brain):
    """OUT_CODES: ``sums[offset : offset + width]`` (float32) rounded to nearest
    even into out's 16-bit row at element ``out_at`` (out: 16-bit memory seen as float32
    words; bfloat16 with ``brain``, else float16): the bits of converting a float32 out
    afterwards (:func:`~npattn.cpu.conversion.converted`). Jitted code only."""
    raise NotImplementedError


@overload(narrow_row, jit_options=OPTIONS, inline="always")
def _narrow_row_overload(sums, offset, out, out_at, width, brain):
    if sums.dtype != types.float32:  # (never asked of other kernels: nothing to compile)
        return lambda sums, offset, out, out_at, width, brain: None

    def implementation(sums, offset, out, out_at, width, brain):
        target = out.view(np.int8)
        lanes = lanes_in(sums)
        whole = width - width % lanes
        for x in range(0, whole, lanes):
            if brain:
                store_float16_bits(target, 2 * (out_at + x), load(sums, offset + x), True)
            else:
                store_float16_bits(target, 2 * (out_at + x), load(sums, offset + x), False)
        if whole < width:  # a Dv that is not whole vectors: the last lanes read and written masked
            rest = width - whole
            last = load_first(sums, offset + whole, rest, 0.0)
            if brain:
                store_float16_bits_first(target, 2 * (out_at + whole), last, rest, True)
            else:
                store_float16_bits_first(target, 2 * (out_at + whole), last, rest, False)
    return implementation


def store_weights_row(scores, offset, weights, at, cols, codes):
    """The weights kernel's row: ``scores[offset : offset + cols]`` into ``weights[at : at +
    cols]``, in weights' dtype, or with ``codes`` (a KvCodes: FLOAT16 or BFLOAT16) into
    16-bit weights (their memory seen as float32 words; ``at`` counts 16-bit elements),
    rounded to nearest even: the bits of rounding float32 weights afterwards
    (:func:`~npattn.cpu.conversion.converted`), without the second pass over them. Jitted
    code only."""
    raise NotImplementedError


@njit(inline="always")
def _store_row_as_is(scores, offset, weights, at, cols):
    for c in range(as_offset(cols)):  # not a slice copy: its shape check compiles str()
        weights[at + c] = scores[offset + c]


@overload(store_weights_row, jit_options=OPTIONS, inline="always")
def _store_weights_row_overload(scores, offset, weights, at, cols, codes):
    if scores.dtype != types.float32:  # (16-bit weights come of float32 scores only)
        return lambda scores, offset, weights, at, cols, codes: _store_row_as_is(scores, offset, weights, at, cols)

    def implementation(scores, offset, weights, at, cols, codes):
        if codes == KvCodes.NONE:
            _store_row_as_is(scores, offset, weights, at, cols)
            return
        target = weights.view(np.int8)
        lanes = lanes_in(scores)
        whole = cols - cols % lanes
        for x in range(0, whole, lanes):
            if codes == KvCodes.BFLOAT16:  # (a literal in each branch: the rounding is compiled in)
                store_float16_bits(target, 2 * (at + x), load(scores, offset + x), True)
            else:
                store_float16_bits(target, 2 * (at + x), load(scores, offset + x), False)
        if whole < cols:  # the last, partial vector: read and written masked (the next bytes are another row's)
            last = load_first(scores, offset + whole, cols - whole, 0.0)
            if codes == KvCodes.BFLOAT16:
                store_float16_bits_first(target, 2 * (at + whole), last, cols - whole, True)
            else:
                store_float16_bits_first(target, 2 * (at + whole), last, cols - whole, False)
    return implementation


def add_bias_codes(s, offset, bias, at, step, cols, brain):
    """BIAS_CODES: ``s[offset + c] += bias[at + c * step]`` for ``c < cols``, bias a 16-bit
    bias's memory seen as float32 words (``at``, ``step`` count its 16-bit elements;
    bfloat16 with ``brain``, a compile-time bool, else float16), each value converted
    exactly as it is added: the scores of adding its float32 copy, without the copy (a
    per-call conversion had taken a (1, 8, 512 x 512, 64) float16 call with a float16 bias
    1.11x float32's time). Keys in a row (``step`` 1) a vector at a time, the last, partial
    vector by masked loads and stores; other strides a value at a time. Jitted code only."""
    raise NotImplementedError


@overload(add_bias_codes, jit_options=OPTIONS, inline="always")
def _add_bias_codes_overload(s, offset, bias, at, step, cols, brain):
    if s.dtype != types.float32:  # (a 16-bit bias is read in place by float32 computations only)
        return lambda s, offset, bias, at, step, cols, brain: None

    def implementation(s, offset, bias, at, step, cols, brain):
        codes, like = bias.view(np.int8), fill(0.0, s)
        lanes = lanes_in(s)
        if step != 1:
            for c in range(as_offset(cols)):  # (one lane: the others load and add 0)
                value = horizontal_sum(load_float16_bits_first(codes, 2 * (at + c * step), 1, like, brain))
                s[offset + c] += value
            return
        whole = cols - cols % lanes
        for x in range(0, whole, lanes):
            store(s, offset + x, add(load(s, offset + x), load_float16_bits(codes, 2 * (at + x), like, brain)))
        if whole < cols:
            rest = cols - whole
            summed = add(load_first(s, offset + whole, rest, 0.0),
                         load_float16_bits_first(codes, 2 * (at + whole), rest, like, brain))
            store_first(s, offset + whole, summed, rest)
    return implementation


@njit(inline="always")
def query_rows(q, dequantized, ints, b, h, g, i0, copied):
    """``(array, offset, row stride)`` of row ``i0`` of head ``h`` (the item's ``g``-th) as
    :func:`score_tile` reads it: q itself, or with Q_CODES the item's converted rows
    (:func:`convert_query_rows`), or where ``copied`` its copied rows (:func:`copy_query_rows`)."""
    if ints[Int.Q_CODES]:
        head_dim = ints[Int.HEAD_DIM]
        return (as_readonly(dequantized), query_tile_start(ints) + g * ints[Int.BLOCK_Q] * head_dim, head_dim)
    if copied:
        words = ints[Int.QUERY_COPY_WORDS]
        return as_readonly(dequantized), query_copy_start(ints, dequantized) + g * ints[Int.BLOCK_Q] * words, words
    return as_readonly(q), query_offset(ints, b, h, i0), ints[Int.Q_STRIDE_S]


@njit(inline="always")
def queries_off_lines(q, ints, b, h0, heads, i0):
    """With QUERY_COPY_WORDS: whether some row of heads ``[h0, h0 + heads)`` from ``i0`` on
    starts off a 64-byte line, so that :func:`copy_query_rows` pays (q: bfloat16 pairs,
    strides in words). A tile row that straddles two lines loads at about half speed: on
    the AMX VM a 192 x 384 score tile at D = 128 took 41-46 thousand cycles with q 16 or 48
    bytes off a line against 35-39 thousand on lines (npattn/cpu/TUNING.md)."""
    if not ints[Int.QUERY_COPY_WORDS]:
        return False
    line = q.itemsize * line_elements(q)
    start = q.ctypes.data + q.itemsize * query_offset(ints, b, h0, i0)
    row_bytes, head_bytes = q.itemsize * ints[Int.Q_STRIDE_S], q.itemsize * ints[Int.Q_STRIDE_H]
    return start % line != 0 or row_bytes % line != 0 or (heads > 1 and head_bytes % line != 0)


@njit(inline="always")
def copy_query_rows(q, ints, b, h0, heads, i0, rows, dequantized):
    """Rows ``[i0, i0 + rows)`` of heads ``[h0, h0 + heads)`` of entry ``b`` (bfloat16 pairs,
    key_words words a row) copied to the dequantized scratch on 64-byte lines, head g's row
    r at ``query_copy_start + (g * BLOCK_Q + r) * QUERY_COPY_WORDS``: once per work item,
    after its first key tile, which brings the rows into cache (a copy first waited for them
    from memory), for its other key tiles to read (:func:`query_rows`)."""
    words, stride = key_words(ints), ints[Int.QUERY_COPY_WORDS]
    start, block_q, row_stride = query_copy_start(ints, dequantized), ints[Int.BLOCK_Q], ints[Int.Q_STRIDE_S]
    lanes = lanes_in(dequantized)
    whole = words - words % lanes
    for g in range(heads):
        source = query_offset(ints, b, h0 + g, i0)
        target = start + g * block_q * stride
        for r in range(rows):
            at, to = source + r * row_stride, target + r * stride
            for x in range(0, whole, lanes):
                store(dequantized, to + x, load(q, at + x))
            if whole < words:
                store_first(dequantized, to + whole, load_first(q, at + whole, words - whole, 0.0), words - whole)


@njit(inline="always")
def value_tile_rows(ints, dequantized):
    """The values of a :func:`dequantize_tile` tile (cols x Dv, rows contiguous)."""
    return dequantized[ints[Int.BLOCK_K] * ints[Int.HEAD_DIM]:]


@helper
def pack_key_tile(k, dequantized, pages, ints, b, kv_head, j0, cols, packed):
    """Keys ``[j0, j0 + cols)`` of ``kv_head`` as K^T (D x SCORE_LD) at the start of
    ``packed``, zero-padded to whole vector chunks: the B operand of Q K^T. A no-op
    when the products go through BLAS. A quantized cache's keys come from the
    ``dequantized`` tile (:func:`dequantize_tile`). With BF16_PRODUCTS, k is bfloat16
    memory seen as float32 words (pairs of consecutive depths): the words are
    transposed as float32 are, K^T in pairs (D / 2 x SCORE_LD), as
    :func:`~npattn.cpu.microkernels.pair_product` reads its B."""
    if not ints[Int.VECTOR_SCORES] or ints[Int.DOT_SCORES]:
        return
    width = padded_width(cols, packed)
    if ints[Int.KV_CODES]:
        head_dim = ints[Int.HEAD_DIM]
        pack_transposed(dequantized, 0, head_dim, cols, head_dim, packed, ints[Int.SCORE_LD], width)
        return
    c0 = 0
    while c0 < cols:  # run by run of one page; the last run pads the tile with zeros
        run = page_run(ints, j0 + c0, cols - c0)
        pack_transposed(k, k_row(ints, pages, b, kv_head, j0 + c0), ints[Int.K_STRIDE_S], run, key_words(ints),
                        packed[c0:], ints[Int.SCORE_LD], width - c0 if c0 + run == cols else run)
        c0 += run
    if ints[Int.KEY_SCALE_SHIFT]:
        lower_pair_exponents(packed, ints[Int.SCORE_LD], key_words(ints), width, ints[Int.KEY_SCALE_SHIFT])


def lower_pair_exponents(packed, ld, rows, width, shift):
    """Each bfloat16 of ``packed``'s words ``[r * ld, r * ld + width)``, r < ``rows``, times
    ``2**-shift``, exactly, on its bits: the exponent lowered by ``shift``; infinities and
    NaNs kept; a result below bfloat16's least normal 0 (of the value's sign), as the tile
    products read a subnormal (KEY_SCALE_SHIFT: the scores' scale carried by the keys).
    Compiled for float32 words (bfloat16 pairs) alone; a no-op for other dtypes' kernels."""
    raise NotImplementedError


@overload(lower_pair_exponents, jit_options=OPTIONS)
def _lower_pair_exponents_overload(packed, ld, rows, width, shift):
    if packed.dtype != types.float32:
        return lambda packed, ld, rows, width, shift: None

    def implementation(packed, ld, rows, width, shift):
        lowered = np.uint32(shift) << np.uint32(7)
        for r in range(rows):
            for x in range(as_offset(r * ld), as_offset(r * ld + width)):
                bits = as_bits(packed[x])
                packed[x] = as_float(_lowered_half(bits & np.uint32(0xFFFF), lowered)
                                     | (_lowered_half(bits >> np.uint32(16), lowered) << np.uint32(16)))
    return implementation


@njit(inline="always")
def _lowered_half(half, lowered):
    field = half & np.uint32(0x7F80)
    if field == np.uint32(0x7F80):
        return half
    return half - lowered if field > lowered else half & np.uint32(0x8000)


@helper
def pack_key_codes(k_codes, dequantized, pages, ints, b, kv_head, j0, cols, packed):
    """:func:`pack_key_tile` for 16-bit keys (KV_CODES FLOAT16 or BFLOAT16) straight from
    their own memory, with no float32 staging of their rows (:func:`dequantize_tile` is not
    asked for them): whole lanes x lanes squares converted and transposed in registers
    (:func:`~npattn.cpu.simd.transpose_converted_square`); each page run's last keys,
    fewer than a vector's lanes, converted into their staging rows and packed from there
    as pack_key_tile packs them, which also zero-pads K^T to whole chunks. The same
    floats, so the same bits."""
    if not ints[Int.VECTOR_SCORES] or ints[Int.DOT_SCORES]:
        return
    head_dim, ld, row_bytes = ints[Int.HEAD_DIM], ints[Int.SCORE_LD], ints[Int.K_STRIDE_S]
    brain = ints[Int.KV_CODES] == KvCodes.BFLOAT16
    lanes = lanes_in(packed)
    width = padded_width(cols, packed)
    c0 = 0
    while c0 < cols:  # run by run of one page
        run = page_run(ints, j0 + c0, cols - c0)
        at = k_row(ints, pages, b, kv_head, j0 + c0)
        full = run - run % lanes
        for r in range(0, full, lanes):
            for x in range(0, head_dim, lanes):
                if brain:
                    transpose_converted_square(k_codes, at + r * row_bytes + 2 * x, row_bytes, packed,
                                               x * ld + c0 + r, ld, True)
                else:
                    transpose_converted_square(k_codes, at + r * row_bytes + 2 * x, row_bytes, packed,
                                               x * ld + c0 + r, ld, False)
        last = c0 + run == cols
        if full < run or last:  # (the last run pads the tile with zeros)
            staged = (c0 + full) * head_dim
            _converted_rows(k_codes, at + full * row_bytes, row_bytes, run - full, head_dim, brain, dequantized,
                            staged)
            pack_transposed(dequantized, staged, head_dim, run - full, head_dim, packed[c0 + full:], ld,
                            width - c0 - full if last else run - full)
        c0 += run


@helper
def pair_rows(x, offset, row_stride, rows, cols, out, out_row, scale):
    """BF16_PRODUCTS: rows ``[0, rows)`` of ``x`` (``x[offset + r * row_stride + c]``, c <
    ``cols``) times ``scale`` as bfloat16 pairs along the row, ``out[r * out_row + p]`` =
    pair (scale x[r, 2p], scale x[r, 2p + 1]) (0 past ``cols``): a row rounded to bfloat16
    in order, a vector at a time."""
    lanes = VECTOR_BYTES // 4
    half = (cols + 1) // 2
    factor = fill(scale, x)
    scale = scalar_like(scale, x)
    for r in range(rows):
        source, target = offset + r * row_stride, r * out_row
        c = 0
        while c + lanes <= cols:
            store_bfloat16(out, target + c // 2, multiply(load(x, source + c), factor))
            c += lanes
        for p in range(c // 2, half):  # the last values, fewer than a vector
            high = scale * x[source + 2 * p + 1] if 2 * p + 1 < cols else 0.0
            out[target + p] = pair_bits(scale * x[source + 2 * p], high)


@njit(inline="always")
def key_words(ints):
    """The elements of k (and q) per key row as the kernels read them: D, or D / 2
    float32 words of bfloat16 pairs with BF16_PRODUCTS."""
    return ints[Int.HEAD_DIM] // 2 if ints[Int.BF16_PRODUCTS] else ints[Int.HEAD_DIM]


@helper
def pack_value_pairs(v, pages, ints, b, kv_head, j0, cols, out):
    """BF16_PRODUCTS: the values of keys ``[j0, j0 + cols)`` (v: bfloat16 memory seen as
    float32 words, :func:`key_words`) as bfloat16 pairs of consecutive keys, ``out[p * Dv
    + x]`` = pair (v[2p, x], v[2p + 1, x]) (0 past ``cols``): P V's B operand (Dv whole
    vectors: VECTOR_VALUES)."""
    pack_row_pairs(v, pages, ints, b, kv_head, j0, cols, ints[Int.VALUE_DIM], ints[Int.V_STRIDE_B],
                   ints[Int.V_STRIDE_H], ints[Int.V_STRIDE_S], out)


@njit(inline="always")
def pack_row_pairs(words, pages, ints, b, kv_head, j0, cols, width, stride_b, stride_h, stride_s, out):
    """Key rows ``[j0, j0 + cols)`` of ``kv_head`` of k or v (bfloat16 memory seen as float32
    ``words``, with those strides in words) as bfloat16 pairs of consecutive keys, ``out[p *
    width + x]`` = pair (row 2p's x, row 2p + 1's x) (0 past ``cols``), ``width`` values a
    row (whole vectors): two rows' halves interleaved a vector at a time."""
    lanes = VECTOR_BYTES // 4
    for p in range((cols + 1) // 2):
        first = key_row(ints, pages, b, kv_head, j0 + 2 * p, stride_b, stride_h, stride_s)
        has_second = 2 * p + 1 < cols
        second = key_row(ints, pages, b, kv_head, j0 + 2 * p + 1, stride_b, stride_h, stride_s) if has_second else first
        target = p * width
        for x in range(0, width, lanes):
            store_interleaved_pairs(out, target + x, words, first + x // 2, second + x // 2, has_second)


@njit(inline="always")
def pair_tiles(ints, scratch):
    """BF16_PRODUCTS: ``(p pairs, value pairs)``, the forward's bfloat16 tiles carved from
    its :func:`dequantize_tile` scratch (which a bfloat16 prefill does not use): the
    probabilities (BLOCK_Q x SCORE_LD / 2) and a key tile's values (BLOCK_K / 2 x Dv),
    rows of pairs (:func:`npattn.cpu.scratch.dequantized_tile_spec`)."""
    p_size, value_size = pair_tile_sizes(ints[Int.BLOCK_Q], ints[Int.BLOCK_K], ints[Int.VALUE_DIM],
                                         ints[Int.SCORE_LD])
    return scratch[:p_size], scratch[p_size:p_size + value_size]


@njit(inline="always")
def pair_tile_sizes(rows, keys, value_dim, ld):
    """The sizes of :func:`pair_tiles`' two tiles, in float32 words."""
    return rows * ((ld + 1) // 2), (keys + 1) // 2 * value_dim


# (the one formula of the operands' plan, which sizes the scratch and counts the slots)
cache_slot_sizes = njit(inline="always")(cache_slot_words)


@njit(inline="always")
def key_cache(ints, scratch):
    """KEY_CACHE_SLOTS: ``(keys, values)``, the packed key tiles (and with BF16_PRODUCTS
    value pairs; else none) a thread keeps (:func:`cached_key_tile`), carved from its
    :func:`dequantize_tile` scratch, after the pair tiles and the out rows' sums (bfloat16
    pairs) or from its start (float keys, which need nothing else there): slot n's tiles
    at n times :func:`~npattn.cpu.operands.cache_slot_words`."""
    start, keys_end, values_end = _key_cache_bounds(ints)
    return scratch[start:keys_end], scratch[keys_end:values_end]


@njit(inline="always")
def _key_cache_bounds(ints):
    """Where :func:`key_cache`'s keys start, end and its values end in the scratch."""
    pairs = ints[Int.BF16_PRODUCTS]
    start = 0
    if pairs:
        start = accumulator_start(ints)
        if ints[Int.OUT_CODES]:
            start += ints[Int.HEAD_GROUP] * ints[Int.BLOCK_Q] * ints[Int.VALUE_DIM]
    key_size, value_size = cache_slot_sizes(ints[Int.HEAD_DIM], ints[Int.VALUE_DIM], ints[Int.BLOCK_K],
                                            ints[Int.SCORE_LD], pairs != 0)
    keys_end = start + ints[Int.KEY_CACHE_SLOTS] * key_size
    return start, keys_end, keys_end + ints[Int.KEY_CACHE_SLOTS] * value_size


@njit(inline="always")
def query_copy_start(ints, scratch):
    """Where :func:`copy_query_rows` puts a work item's query rows in the dequantized
    ``scratch`` (BF16_PRODUCTS): on the first 64-byte line after the kept key tiles
    (:func:`key_cache`); the scratch starts on one (:func:`npattn.cpu.scratch.scratch_set`)."""
    line = line_elements(scratch)
    return -(-_key_cache_bounds(ints)[2] // line) * line


@njit(inline="always")
def cached_key_tile(ints, j0, cols):
    """``(slot, keys)``: the slot of :func:`key_cache` that serves keys ``[j0, j0 + cols)``
    and the keys it holds, or (-1, 0). A slot holds a tile of the grid of whole tiles (j0 a
    multiple of BLOCK_K) as far as k's memory goes, and serves any of its first keys but
    for an odd count short of its end: the keys past ``cols`` give scores past the tile's
    columns, which nothing reads (as nothing reads the padding's), and P V's pairs stop
    at ``cols``, where an odd count would pair its last probability with the next key's
    value, which may be anything (a NaN, even) instead of the padding's zero."""
    block_k = ints[Int.BLOCK_K]
    slot = j0 // block_k
    keys = smaller(block_k, ints[Int.KV_LEN] - j0)
    if j0 % block_k or slot >= ints[Int.KEY_CACHE_SLOTS] or (cols % 2 and cols != keys):
        return -1, 0
    return slot, keys


@helper
def pack_value_tile(v, value_rows, pages, ints, b, kv_head, j0, cols, packed):
    """Values ``[j0, j0 + cols)`` of ``kv_head`` as V^T (Dv x SCORE_LD) after the key tile
    in ``packed`` (see :func:`packed_values`): the B operand of dO V^T. With KV_CODES the
    values come from ``value_rows``, the tile's float rows (:func:`value_tile_rows`); with
    BF16_PRODUCTS, v is bfloat16 words and V^T is in pairs (Dv / 2 x SCORE_LD), as
    :func:`pack_key_tile` packs K^T."""
    if not ints[Int.VECTOR_SCORES]:
        return
    width = padded_width(cols, packed)
    values = packed_values(ints, packed)
    if ints[Int.KV_CODES]:
        value_dim = ints[Int.VALUE_DIM]
        pack_transposed(value_rows, 0, value_dim, cols, value_dim, values, ints[Int.SCORE_LD], width)
        return
    c0 = 0
    while c0 < cols:
        run = page_run(ints, j0 + c0, cols - c0)
        value_words = ints[Int.VALUE_DIM] // 2 if ints[Int.BF16_PRODUCTS] else ints[Int.VALUE_DIM]
        pack_transposed(v, v_row(ints, pages, b, kv_head, j0 + c0), ints[Int.V_STRIDE_S], run, value_words,
                        values[c0:], ints[Int.SCORE_LD], width - c0 if c0 + run == cols else run)
        c0 += run


@njit(inline="always")
def packed_values(ints, packed):
    """The V^T part of a packed tile (see :func:`npattn.cpu.scratch.score_tile_specs`)."""
    return packed[ints[Int.HEAD_DIM] * ints[Int.SCORE_LD]:]


@helper
def score_tile(q, q_offset, q_row, k, dequantized, k_codes, k_scale, bias, mask, alibi, spans, pages, ints, reals,
               s, ld, tanh, packed, b, h, i0, rows, j0, cols):
    """Scores of rows ``[i0, i0 + rows)`` against keys ``[j0, j0 + cols)`` of head ``h``
    into ``s[r * ld + c]``: ``scale * q.k``, softcap (its tanh kept in ``tanh`` for the
    backward), bias, ALiBi, then -inf where the key is invisible. Row ``i0 + r``'s query
    is ``q[q_offset + r * q_row:]`` (:func:`query_rows`). ``packed`` holds
    the key tile from :func:`pack_key_tile` (and ``dequantized``, for a quantized cache,
    its keys as rows, or, where :func:`codes_in_registers`, ``k_codes`` and ``k_scale``
    are read as they lie; with BF16_PRODUCTS, q and k are bfloat16 pairs, :func:`key_words`);
    keys read from k go run by run of one page
    (:func:`page_run`). Returns whether every row sees every key of the tile
    (:func:`tile_fully_visible`), which the caller's own products reuse."""
    kv_head = h // (ints[Int.HEADS] // ints[Int.KV_HEADS])
    head_dim = ints[Int.HEAD_DIM]
    full = tile_fully_visible(ints, spans, b, i0, i0 + rows, j0, j0 + cols)
    if ints[Int.VECTOR_SCORES]:
        # S (rows x cols) = Q (rows x D) . K^T (D x cols); the padding columns get zeros,
        # and nothing reads them. On a tile the causal or window edge cuts, each band of
        # rows stops at its last visible key; the scores past it get a finite 0 (softcap's
        # tanh must not meet stale NaNs) and -inf below.
        # With DOT_SCORES (few rows), from the key rows themselves, unpadded.
        band = rows if full else ints[Int.EDGE_BAND]
        for r0 in range(0, rows, band):
            band_rows = smaller(band, rows - r0)
            width = band_keys(ints, spans, b, i0 + r0 + band_rows - 1, j0, cols, full)
            if codes_in_registers(ints, s):  # (a decode tile: DOT_SCORES) the codes, run by run of one page
                c0 = 0
                while c0 < width:
                    run = page_run(ints, j0 + c0, width - c0)
                    j = j0 + c0
                    code_dot_products(q, q_offset + r0 * q_row, q_row, k_codes, k_row(ints, pages, b, kv_head, j),
                                      ints[Int.K_STRIDE_S], k_scale, k_scale_row(ints, pages, b, kv_head, j),
                                      ints[Int.K_SCALE_STRIDE_S], s, r0 * ld + c0, ld, band_rows, run, head_dim,
                                      reals[Real.SCALE], ints[Int.KV_CODES], ints[Int.ROW_PREFETCH])
                    c0 += run
            elif ints[Int.DOT_SCORES] and ints[Int.KV_CODES]:  # the dequantized tile's rows
                dot_products(q, q_offset + r0 * q_row, q_row, dequantized, 0, head_dim, s, r0 * ld, ld, band_rows,
                             width, head_dim, reals[Real.SCALE])
            elif ints[Int.DOT_SCORES]:
                c0 = 0
                while c0 < width:
                    run = page_run(ints, j0 + c0, width - c0)
                    dot_products(q, q_offset + r0 * q_row, q_row, k, k_row(ints, pages, b, kv_head, j0 + c0),
                                 ints[Int.K_STRIDE_S], s, r0 * ld + c0, ld, band_rows, run, head_dim, reals[Real.SCALE])
                    c0 += run
            else:
                width = padded_width(width, s)
                if width > 0 and ints[Int.BF16_PRODUCTS]:  # q's rows of pairs as they lie
                    # (KEY_SCALE_SHIFT: the packed keys carry the scale; SOFTMAX_SCALE: exp applies it)
                    scale = 1.0 if ints[Int.KEY_SCALE_SHIFT] or ints[Int.SOFTMAX_SCALE] else reals[Real.SCALE]
                    pair_product(q, q_offset + r0 * q_row, q_row, 1, packed, 0, ld, s, r0 * ld, ld, band_rows,
                                 key_words(ints), width, scale, False)
                elif width > 0:
                    product(q, q_offset + r0 * q_row, q_row, 1, packed, 0, ld, s, r0 * ld, ld, band_rows,
                            head_dim, width, reals[Real.SCALE], False)
            for r in range(r0, r0 + band_rows):
                for x in range(as_offset(r * ld + width), as_offset(r * ld + cols)):
                    s[x] = 0.0
    else:  # column-major: S^T (cols x rows) = K (cols x D) . Q^T (D x rows), run by run
        c0 = 0
        while c0 < cols:
            run = page_run(ints, j0 + c0, cols - c0)
            gemm(True, False, run, rows, head_dim, reals[Real.SCALE], k[k_row(ints, pages, b, kv_head, j0 + c0):],
                 ints[Int.K_STRIDE_S], q[q_offset:], q_row, 0.0, s[c0:], ld)
            c0 += run
    if ints[Int.HAS_SOFTCAP]:
        for r in range(rows):
            soft_capped(s, tanh, r * ld, cols, reals[Real.SOFTCAP])
    if ints[Int.HAS_BIAS]:
        sb, sh, sq, sk = (ints[Int.BIAS_STRIDE_B], ints[Int.BIAS_STRIDE_H], ints[Int.BIAS_STRIDE_Q],
                          ints[Int.BIAS_STRIDE_K])
        step = as_offset(sk)
        for r in range(rows):
            base, row = as_offset(b * sb + h * sh + (i0 + r) * sq + j0 * sk), as_offset(r * ld)
            if ints[Int.BIAS_CODES] == KvCodes.BFLOAT16:  # (a literal in each branch: compiled in)
                add_bias_codes(s, row, bias, base, step, cols, True)
            elif ints[Int.BIAS_CODES]:
                add_bias_codes(s, row, bias, base, step, cols, False)
            else:
                for c in range(as_offset(cols)):
                    s[row + c] += bias[base + c * step]
    if ints[Int.HAS_ALIBI]:  # (alibi: (B, H) slopes, H the query heads: HEADS x ROW_GROUP folded)
        query_heads = ints[Int.HEADS] * ints[Int.ROW_GROUP]
        for r in range(rows):
            slope = alibi[b * query_heads + row_head(ints, h, i0 + r)]
            position = row_position(ints, spans, b, i0 + r)
            for c in range(cols):
                s[as_offset(r * ld + c)] -= slope * abs(position - (j0 + c))
    if not full:
        head_stop = larger(0, smaller(cols, span(spans, b, Span.KV_START) - j0))
        for r in range(rows):
            # key j is hidden iff j < KV_START, or j >= sink_end and not lo <= j < hi: three
            # runs of columns, filled as runs (a per-column test cost as much as the tile's
            # product on the diagonal tiles of a causal problem)
            lo, hi, sink_end = key_band(ints, spans, b, i0 + r)
            gap_start = larger(head_stop, smaller(cols, sink_end - j0))
            gap_stop = larger(gap_start, smaller(cols, lo - j0))
            tail_start = larger(0, smaller(cols, larger(sink_end, hi) - j0))
            for x in range(as_offset(r * ld), as_offset(r * ld + head_stop)):
                s[x] = -np.inf
            for x in range(as_offset(r * ld + gap_start), as_offset(r * ld + gap_stop)):
                s[x] = -np.inf
            hidden_tail(s, r * ld + tail_start, r * ld + cols, r * ld + ld)
    if ints[Int.HAS_MASK]:
        sb, sh, sq, sk = (ints[Int.MASK_STRIDE_B], ints[Int.MASK_STRIDE_H], ints[Int.MASK_STRIDE_Q],
                          ints[Int.MASK_STRIDE_K])
        step = as_offset(sk)
        for r in range(rows):
            base, row = as_offset(b * sb + h * sh + (i0 + r) * sq + j0 * sk), as_offset(r * ld)
            for c in range(as_offset(cols)):
                if mask[base + c * step] == 0:
                    s[row + c] = -np.inf
    return full
