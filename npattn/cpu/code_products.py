"""A decode step's products straight from a cache's codes, converted in registers: int8 or
float8 e4m3 codes with a scale per key, or float16 / bfloat16 values (whose P V every
16-bit forward takes here, prefills too: no float32 staging of the values).

A decode step is a few query rows (a GQA group folded into rows) against many keys.
Converting a key tile into a float32 staging first (:func:`~npattn.cpu.tiles.dequantize_tile`)
costs more than the products that read it: each value is converted (and scaled), stored,
then loaded again once per query row. Here the codes are loaded as they lie and converted
in registers (:func:`~npattn.cpu.simd.load_code`, exact: int8, or e4m3 as 2**-8 times its
value, which the key's scale takes back; :func:`~npattn.cpu.simd.load_float16_bits`, exact),
and a one-byte code's per-key scale is applied once per product instead of once per value:

- :func:`code_dot_products`: ``S[r, j] = alpha * scale_j * (q_r . codes_j)``,
- :func:`code_product`: ``O[r, :] += sum_j (P[r, j] * scale_j) * codes_j``.

The one-byte codes round differently from the float32 staging (one scale multiply per
product, not per value), within the same error bound of the float64 result on the
dequantized cache. 16-bit values have no scale (``scale_j`` is 1, and no multiply is
compiled): their sums are the chains the staged rows' products make, so the same bits.
Compiled for float32 sums only (float32 and 16-bit queries): a float64 query's step,
rare, dequantizes its tiles, and its kernels skip this code's compile (a first float64
forward compiled in 16.8-21.8 s with it, 13.9 without).

``decode`` is how the codes read (:data:`~npattn.core.kernel_params.KvCodes`: INT8,
FLOAT8, FLOAT16 or BFLOAT16); ``b_offset`` and ``b_row`` count bytes.
"""
from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import overload

from ..core.kernel_params import KvCodes
from .jit import OPTIONS, helper, inlined_helper
from .microkernels import DEPTH_BLOCK, WIDE_ROWS, WIDE_VECTORS, broadcast_element, tail_step
from .signatures import as_offset, as_readonly, plain_int, scalar_like, smaller
from .simd import (VECTOR_BYTES, add, always_inline, fill, horizontal_sum, lanes_in, load, load_code, load_first,
                   line_elements, load_float16_bits, load_float16_bits_first, load_strided, multiply, multiply_add,
                   never_inline, prefetch_to_l2, store, store_first, store_key_sums)


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
# Fewer rows than a block (one query per kv head, a decode step without GQA) go one row
# at a time: their scores 8 keys at a time and their P V microkernels.WIDE_VECTORS
# vectors at a time, so that as many FMA chains are in flight as float32's products keep
# (a block of KEY_BLOCK keys or VECTOR_BLOCK vectors waited on the FMAs' latency. Forced
# to AVX2 on the Zen 4 VM, float16 steps at (1, 8, 1 x 1024, 64) and (4, 8, 1 x 512, 64),
# all in cache: 1.11x and 1.03x float32's time with blocks of 2, 0.79x and 0.70x so; with
# AVX-512's blocks of 4 the same either way, 0.83-0.88x.)
WIDE_KEYS = 8
# One-byte codes' P V scales its probabilities once, in place, before its blocks: a row of
# 16 keys' scales gathered (simd.load_strided) and multiplied into every row, so that each
# block's weight is a probability as it lies, broadcast from memory into its FMAs
# (``vfmadd231ps m32{1to16}``: no multiply, no broadcast on the vector ports). Scaled in
# each block instead (a multiply and a broadcast per key, row and block of columns), the
# AVX-512 P V took 32 of the two FMA ports' slots per key and 64 columns where its 16 FMAs
# and 8 conversions take 24: one core of the Emerald Rapids VM, 4 rows x 64 keys at
# D = 128 in L1, 12.3 -> 9.8 ns per key (11.4 with the scaling done a key and row at a
# time, as AVX2's blocks of 2 had done since the Zen 4 VM measured them, forced to AVX2,
# at 49.6-52.1 -> 46.1-47.1 ns per key and kv head of a (1, 32/8, 4096, 128) int8 step).

# A cache line: the unit each request for rows ahead asks for
LINE_BYTES = 64
# What an e4m3 code's scale is multiplied by: load_code gives 2**-8 times its value
E4M3_UNIT = np.float32(256.0)
_ONE = np.float32(1.0)


# The decodes, as compile-time constants of the blocks below
_INT8, _FLOAT8 = int(KvCodes.INT8), int(KvCodes.FLOAT8)
_FLOAT16, _BFLOAT16 = int(KvCodes.FLOAT16), int(KvCodes.BFLOAT16)


def code_dot_products(a, a_offset, a_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c, c_offset,
                      c_row, rows, cols, depth, alpha, decode, ahead=0):
    """``C[r, j] = alpha * scale_j * sum_x A[r, x] B[j, x]`` for r < rows, j < cols, where
    ``A[r, x] = a[a_offset + r * a_row + x]`` (floats), ``B[j, x]`` value x of the row of
    codes whose bytes start at ``codes[b_offset + j * b_row]`` (read by ``decode``),
    ``scale_j = scales[scale_offset + j * scale_step]`` (1 for 16-bit values, ``scales``
    unread) and ``C[r, j] = c[c_offset + r * c_row + j]``; a 16-bit ``depth`` that is not
    whole vectors ends in a vector read masked, as :func:`~npattn.cpu.microkernels.dot_products`
    reads float32 rows (one-byte codes' head dims are whole vectors:
    :data:`npattn.core.quantization.HEAD_DIM_MULTIPLE`). With ``ahead`` > 0, asks L2 for
    the rows (and scales) of the keys ``ahead`` rows on as it goes (:func:`_ask_for_keys`). float32 only (see
    :func:`~npattn.cpu.tiles.codes_in_registers`): elsewhere a stub that does nothing."""
    raise NotImplementedError


@overload(code_dot_products, jit_options=OPTIONS)
def _code_dot_products_overload(a, a_offset, a_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c,
                                c_offset, c_row, rows, cols, depth, alpha, decode, ahead=0):
    if c.dtype != types.float32:
        return lambda a, a_offset, a_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c, c_offset, \
            c_row, rows, cols, depth, alpha, decode, ahead=0: None

    def implementation(a, a_offset, a_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c, c_offset,
                       c_row, rows, cols, depth, alpha, decode, ahead=0):
        _code_dot_products(as_readonly(a), plain_int(a_offset), plain_int(a_row), as_readonly(codes),
                           plain_int(b_offset), plain_int(b_row), as_readonly(scales), plain_int(scale_offset),
                           plain_int(scale_step), c, plain_int(c_offset), plain_int(c_row), plain_int(rows),
                           plain_int(cols), plain_int(depth), scalar_like(alpha, c), plain_int(decode),
                           plain_int(ahead))
    return implementation


@inlined_helper
def _code_dot_products(a, a_offset, a_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c, c_offset,
                       c_row, rows, cols, depth, alpha, decode, ahead):
    """:func:`_dot_products_of` compiled once per decode (a constant there)."""
    never_inline()
    if decode == _FLOAT16:
        _dot_products_of(a, a_offset, a_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c, c_offset,
                         c_row, rows, cols, depth, alpha, ahead, _FLOAT16)
    elif decode == _BFLOAT16:
        _dot_products_of(a, a_offset, a_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c, c_offset,
                         c_row, rows, cols, depth, alpha, ahead, _BFLOAT16)
    elif decode == _FLOAT8:
        _dot_products_of(a, a_offset, a_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c, c_offset,
                         c_row, rows, cols, depth, alpha * E4M3_UNIT, ahead, _FLOAT8)
    else:
        _dot_products_of(a, a_offset, a_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c, c_offset,
                         c_row, rows, cols, depth, alpha, ahead, _INT8)


@helper
def code_bytes(decode):
    """Bytes per value of the codes ``decode`` (a :data:`~npattn.core.kernel_params.KvCodes`)
    reads: 1 for int8 and e4m3, 2 for float16 and bfloat16."""
    always_inline()
    if decode == _FLOAT16 or decode == _BFLOAT16:
        return 2
    return 1


@helper
def _ask_for_block(codes, at, block_bytes, ahead_bytes):
    """Ask L2 for the ``block_bytes`` (a compile-time constant: a block's columns) of codes
    from ``codes[at + ahead_bytes]`` (the same columns of a key some rows on), inlined into
    P V's key loop, where a call would save every accumulator. Where they are less than a
    line (AVX2's blocks), every block asks for the line of its first byte: asking only
    from blocks whose offset in the array is a whole line missed lines wherever the array
    did not start on one (forced to AVX2, int8 (1, 32/8, 16384, 128) 5.5-5.9 ms against
    4.6). Nothing where ``ahead_bytes`` is 0."""
    always_inline()
    if ahead_bytes > 0:
        if block_bytes >= LINE_BYTES:
            for line in range(0, block_bytes, LINE_BYTES):
                prefetch_to_l2(codes, at + ahead_bytes + line)
        else:
            prefetch_to_l2(codes, at + ahead_bytes)


@helper
def _ask_for_scales(scales, at, count):
    """Ask L2 for the lines holding ``scales[at : at + count]``."""
    always_inline()
    for line in range(0, count, line_elements(scales)):
        prefetch_to_l2(scales, at + line)


@helper
def _values(codes, row, x, like, decode):
    """The vector of values ``x, x + 1, ...`` of the row of codes whose bytes start at
    ``codes[row]``, converted in registers; ``decode`` a constant at each call site."""
    always_inline()
    if decode == _FLOAT16:
        return load_float16_bits(codes, row + 2 * x, like, False)
    if decode == _BFLOAT16:
        return load_float16_bits(codes, row + 2 * x, like, True)
    return load_code(codes, row + x, like, decode == _FLOAT8)


@helper
def _values_first(codes, row, x, count, like, decode):
    """:func:`_values` of the first ``count`` values only, the other lanes 0 (a masked load:
    a row's last, partial vector). 16-bit values only: a one-byte decode gives the whole
    vector (its rows are whole vectors, so no caller asks it for fewer)."""
    always_inline()
    if decode == _FLOAT16:
        return load_float16_bits_first(codes, row + 2 * x, count, like, False)
    if decode == _BFLOAT16:
        return load_float16_bits_first(codes, row + 2 * x, count, like, True)
    return load_code(codes, row + x, like, decode == _FLOAT8)


@helper
def _partial_lanes(size, lanes, decode):
    """The lanes of ``size``'s last, partial vector (0 where it is whole vectors): 0 for
    one-byte codes, whose head dims are whole vectors (a constant: their masked code folds away)."""
    always_inline()
    if decode == _FLOAT16 or decode == _BFLOAT16:
        return size % lanes
    return 0


@helper
def _scale(scales, at, decode):
    """Key ``at``'s scale; 1 for 16-bit values, which have none (a constant: the multiplies
    by it fold away)."""
    always_inline()
    if decode == _FLOAT16 or decode == _BFLOAT16:
        return np.float32(1.0)
    return scales[as_offset(at)]


@helper
def _dot_products_of(a, a_offset, a_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c, c_offset,
                     c_row, rows, cols, depth, alpha, ahead, decode):
    """Fewer rows than a block: :data:`WIDE_KEYS` keys at a time, one row at a time. Then
    :data:`KEY_BLOCK` keys at a time against blocks of :data:`ROW_BLOCK` query rows, then
    single rows (each key's codes converted once per block, a FMA chain per key and row);
    then the keys left one by one. ``alpha`` takes an e4m3 code's 2**8 (:data:`E4M3_UNIT`).
    Each block of keys first asks for the keys ``ahead`` rows on (none where 0)."""
    always_inline()
    lanes = lanes_in(c)
    ahead_bytes, row_bytes = ahead * b_row, depth * code_bytes(decode)
    rest = _partial_lanes(depth, lanes, decode)  # (a last vector read masked)
    depth -= rest
    j = 0
    if rows < ROW_BLOCK:  # each row alone anyway: WIDE_KEYS chains in flight, not KEY_BLOCK
        while j + WIDE_KEYS <= cols:
            k = b_offset + j * b_row
            _ask_for_keys(codes, k, b_row, WIDE_KEYS, ahead_bytes, row_bytes, scales, scale_offset + (j + ahead) *
                          scale_step, scale_step, decode)
            low = _four_factors(scales, scale_offset + j * scale_step, scale_step, alpha, decode)
            high = _four_factors(scales, scale_offset + (j + 4) * scale_step, scale_step, alpha, decode)
            for r in range(rows):
                _wide_key_block(a, a_offset + r * a_row, codes, k, b_row, c, c_offset + r * c_row + j, low, high,
                                depth, rest, lanes, decode)
            j += WIDE_KEYS
    while j + KEY_BLOCK <= cols:
        k = b_offset + j * b_row
        _ask_for_keys(codes, k, b_row, KEY_BLOCK, ahead_bytes, row_bytes, scales, scale_offset + (j + ahead) *
                      scale_step, scale_step, decode)
        factors = _key_factors(scales, scale_offset + j * scale_step, scale_step, alpha, decode)
        r = 0
        while r + ROW_BLOCK <= rows:
            _key_block(a, a_offset + r * a_row, a_row, codes, k, b_row, c, c_offset + r * c_row + j, c_row,
                       factors, ROW_BLOCK, depth, rest, lanes, decode)
            r += ROW_BLOCK
        while r < rows:
            _key_block(a, a_offset + r * a_row, a_row, codes, k, b_row, c, c_offset + r * c_row + j, c_row,
                       factors, 1, depth, rest, lanes, decode)
            r += 1
        j += KEY_BLOCK
    zero = fill(0.0, c)
    while j < cols:  # (fewer keys than a block: not asked for)
        k = b_offset + j * b_row
        factor = alpha * _scale(scales, scale_offset + j * scale_step, decode)
        for r in range(rows):
            q0 = a_offset + r * a_row
            s0 = zero
            for x in range(0, depth, lanes):
                s0 = multiply_add(load(a, q0 + x), _values(codes, k, x, zero, decode), s0)
            if rest:
                s0 = multiply_add(load_first(a, q0 + depth, rest, 0.0), _values_first(codes, k, depth, rest, zero,
                                                                                       decode), s0)
            c[as_offset(c_offset + r * c_row + j)] = factor * horizontal_sum(s0)
        j += 1


@helper
def _ask_for_keys(codes, k, b_row, keys, ahead_bytes, row_bytes, scales, scale_at, scale_step, decode):
    """Ask for the rows of ``keys`` keys from ``codes[k]`` as they lie ``ahead_bytes`` on, and
    for their scales from ``scales[scale_at]`` (nothing where ``ahead_bytes`` is 0). The test
    is inlined, the requests are a call (:func:`_ask_for_key_rows`): made between blocks,
    where no accumulator is live; inlined into every block of every decode, their loops
    took 7 s more of the float32 forward's first compile."""
    always_inline()
    if ahead_bytes > 0:
        _ask_for_key_rows(codes, k + ahead_bytes, b_row, keys, row_bytes, scales, scale_at, scale_step,
                          decode == _INT8 or decode == _FLOAT8)


@helper
def _ask_for_key_rows(codes, at, b_row, keys, row_bytes, scales, scale_at, scale_step, scaled):
    """The requests of :func:`_ask_for_keys` (``scaled``: for the scales' lines too)."""
    never_inline()
    for n in range(keys):
        for line in range(0, row_bytes, LINE_BYTES):
            prefetch_to_l2(codes, at + n * b_row + line)
    if scaled:
        _ask_for_scales(scales, scale_at, keys * scale_step)


@helper
def _key_factors(scales, at, step, alpha, decode):
    """``alpha`` times the scales of a block's :data:`KEY_BLOCK` keys, a tuple."""
    always_inline()
    if KEY_BLOCK == 4:
        return _four_factors(scales, at, step, alpha, decode)
    return alpha * _scale(scales, at, decode), alpha * _scale(scales, at + step, decode)


@helper
def _four_factors(scales, at, step, alpha, decode):
    """``alpha`` times the scales of 4 keys from ``at``, a tuple."""
    always_inline()
    return (alpha * _scale(scales, at, decode), alpha * _scale(scales, at + step, decode),
            alpha * _scale(scales, at + 2 * step, decode), alpha * _scale(scales, at + 3 * step, decode))


@helper
def _wide_key_block(a, q_at, codes, k, b_row, c, c_at, low, high, depth, rest, lanes, decode):
    """The scores of :data:`WIDE_KEYS` keys for one query row (``low`` and ``high``: the
    factors of the first and last 4): 8 FMA chains, one per key, as many as
    :func:`~npattn.cpu.microkernels.dot_products` keeps, where a block of KEY_BLOCK keys
    waited on the FMAs' latency. ``depth`` whole vectors, then ``rest`` values masked."""
    always_inline()
    zero = fill(0.0, c)
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = zero
    for x in range(0, depth, lanes):
        row = load(a, q_at + x)
        s0 = multiply_add(row, _values(codes, k, x, zero, decode), s0)
        s1 = multiply_add(row, _values(codes, k + b_row, x, zero, decode), s1)
        s2 = multiply_add(row, _values(codes, k + 2 * b_row, x, zero, decode), s2)
        s3 = multiply_add(row, _values(codes, k + 3 * b_row, x, zero, decode), s3)
        s4 = multiply_add(row, _values(codes, k + 4 * b_row, x, zero, decode), s4)
        s5 = multiply_add(row, _values(codes, k + 5 * b_row, x, zero, decode), s5)
        s6 = multiply_add(row, _values(codes, k + 6 * b_row, x, zero, decode), s6)
        s7 = multiply_add(row, _values(codes, k + 7 * b_row, x, zero, decode), s7)
    if rest:
        row = load_first(a, q_at + depth, rest, 0.0)
        s0 = multiply_add(row, _values_first(codes, k, depth, rest, zero, decode), s0)
        s1 = multiply_add(row, _values_first(codes, k + b_row, depth, rest, zero, decode), s1)
        s2 = multiply_add(row, _values_first(codes, k + 2 * b_row, depth, rest, zero, decode), s2)
        s3 = multiply_add(row, _values_first(codes, k + 3 * b_row, depth, rest, zero, decode), s3)
        s4 = multiply_add(row, _values_first(codes, k + 4 * b_row, depth, rest, zero, decode), s4)
        s5 = multiply_add(row, _values_first(codes, k + 5 * b_row, depth, rest, zero, decode), s5)
        s6 = multiply_add(row, _values_first(codes, k + 6 * b_row, depth, rest, zero, decode), s6)
        s7 = multiply_add(row, _values_first(codes, k + 7 * b_row, depth, rest, zero, decode), s7)
    store_key_sums(c, c_at, 0, (s0, s1, s2, s3), low)
    store_key_sums(c, c_at + 4, 0, (s4, s5, s6, s7), high)


@helper
def _key_block(a, q_at, a_row, codes, k, b_row, c, c_at, c_row, factors, rows, depth, rest, lanes, decode):
    """The scores of :data:`KEY_BLOCK` keys for ``rows`` (1 or :data:`ROW_BLOCK`, a
    constant) query rows of :func:`_dot_products_of`: the accumulators of query row r are
    s, t, u, w, numbered by key. ``depth`` whole vectors, then ``rest`` values masked."""
    always_inline()
    zero = fill(0.0, c)
    sums = (zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero)
    for x in range(0, depth, lanes):
        sums = _key_step(a, q_at, a_row, codes, k, b_row, x, 0, rows, sums, zero, decode)
    if rest:
        sums = _key_step(a, q_at, a_row, codes, k, b_row, depth, rest, rows, sums, zero, decode)
    s0, s1, s2, s3, t0, t1, t2, t3, u0, u1, u2, u3, w0, w1, w2, w3 = sums
    if rows == 4 and KEY_BLOCK == 4:
        store_key_sums(c, c_at, c_row, (s0, s1, s2, s3, t0, t1, t2, t3, u0, u1, u2, u3, w0, w1, w2, w3), factors)
    elif rows == 4:
        store_key_sums(c, c_at, c_row, (s0, s1, t0, t1, u0, u1, w0, w1), factors)
    elif KEY_BLOCK == 4:
        store_key_sums(c, c_at, c_row, (s0, s1, s2, s3), factors)
    else:
        store_key_sums(c, c_at, c_row, (s0, s1), factors)


@helper
def _key_step(a, q_at, a_row, codes, k, b_row, x, count, rows, sums, zero, decode):
    """One step of :func:`_key_block` through the depth: ``sums`` (s0..s3, t0..t3, u0..u3,
    w0..w3) after values ``x, x + 1, ...`` of its keys and rows, a whole vector (``count``
    0: a constant where the whole vectors' loop calls it) or its first ``count`` lanes."""
    always_inline()
    s0, s1, s2, s3, t0, t1, t2, t3, u0, u1, u2, u3, w0, w1, w2, w3 = sums
    b0, b1 = _key_values(codes, k, x, count, zero, decode), _key_values(codes, k + b_row, x, count, zero, decode)
    b2 = b3 = zero
    if KEY_BLOCK == 4:
        b2 = _key_values(codes, k + 2 * b_row, x, count, zero, decode)
        b3 = _key_values(codes, k + 3 * b_row, x, count, zero, decode)
    row = _query_values(a, q_at + x, count)
    s0, s1 = multiply_add(row, b0, s0), multiply_add(row, b1, s1)
    if KEY_BLOCK == 4:
        s2, s3 = multiply_add(row, b2, s2), multiply_add(row, b3, s3)
    if rows == 4:
        row = _query_values(a, q_at + a_row + x, count)
        t0, t1 = multiply_add(row, b0, t0), multiply_add(row, b1, t1)
        if KEY_BLOCK == 4:
            t2, t3 = multiply_add(row, b2, t2), multiply_add(row, b3, t3)
        row = _query_values(a, q_at + 2 * a_row + x, count)
        u0, u1 = multiply_add(row, b0, u0), multiply_add(row, b1, u1)
        if KEY_BLOCK == 4:
            u2, u3 = multiply_add(row, b2, u2), multiply_add(row, b3, u3)
        row = _query_values(a, q_at + 3 * a_row + x, count)
        w0, w1 = multiply_add(row, b0, w0), multiply_add(row, b1, w1)
        if KEY_BLOCK == 4:
            w2, w3 = multiply_add(row, b2, w2), multiply_add(row, b3, w3)
    return s0, s1, s2, s3, t0, t1, t2, t3, u0, u1, u2, u3, w0, w1, w2, w3


@helper
def _key_values(codes, row, x, count, like, decode):
    """:func:`_values` (``count`` 0) or :func:`_values_first` of ``count`` lanes."""
    always_inline()
    if count:
        return _values_first(codes, row, x, count, like, decode)
    return _values(codes, row, x, like, decode)


@helper
def _query_values(a, at, count):
    """The vector of ``a`` at ``at`` (``count`` 0), or its first ``count`` lanes (masked)."""
    always_inline()
    if count:
        return load_first(a, at, count, 0.0)
    return load(a, at)


def code_product(p, p_offset, p_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c, c_offset, c_row,
                 rows, cols, width, decode, ahead=0):
    """``C[r, x] += sum_j (P[r, j] * scale_j) * B[j, x]`` for r < rows, j < cols,
    x < width, where ``P[r, j] = p[p_offset + r * p_row + j]`` (floats), ``B[j, x]`` value
    x of the row of codes whose bytes start at ``codes[b_offset + j * b_row]`` (read by
    ``decode``), ``scale_j`` as in :func:`code_dot_products` and
    ``C[r, x] = c[c_offset + r * c_row + x]``; a 16-bit ``width`` that is not whole vectors
    ends in a vector of B and C read and written masked, as
    :func:`~npattn.cpu.microkernels.product` does (one-byte codes' are whole). Leaves each
    ``P[r, j]`` times its scale (times :data:`E4M3_UNIT` for e4m3) in ``p`` for one-byte
    codes: the forward is done with the probabilities by then. With ``ahead`` > 0, asks L2
    for the value rows (and scales) ``ahead`` rows on as it goes, as
    :func:`code_dot_products` does. float32 only, as :func:`code_dot_products`."""
    raise NotImplementedError


@overload(code_product, jit_options=OPTIONS)
def _code_product_overload(p, p_offset, p_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c, c_offset,
                           c_row, rows, cols, width, decode, ahead=0):
    if c.dtype != types.float32:
        return lambda p, p_offset, p_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c, c_offset, \
            c_row, rows, cols, width, decode, ahead=0: None

    def implementation(p, p_offset, p_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c, c_offset,
                       c_row, rows, cols, width, decode, ahead=0):
        _code_product(p, plain_int(p_offset), plain_int(p_row), as_readonly(codes), plain_int(b_offset),
                      plain_int(b_row), as_readonly(scales), plain_int(scale_offset), plain_int(scale_step), c,
                      plain_int(c_offset), plain_int(c_row), plain_int(rows), plain_int(cols), plain_int(width),
                      plain_int(decode), plain_int(ahead))
    return implementation


@inlined_helper
def _code_product(p, p_offset, p_row, codes, b_offset, b_row, scales, scale_offset, scale_step, c, c_offset, c_row,
                  rows, cols, width, decode, ahead):
    """The columns and keys in the pieces :func:`~npattn.cpu.microkernels.product` sums them
    in, so a 16-bit cache's P V gives the bits of its values' float32 rows: a single row's
    first columns, as many as its wide chunks cover, over every key in one chain; the other
    columns (every column of several rows) over slices of :data:`DEPTH_BLOCK` keys, each
    slice's sums added to C in turn. One-byte codes' probabilities are scaled first, once
    (:func:`_scale_probabilities`). Each block of columns asks, key by key, for its columns
    of the key ``ahead`` rows on."""
    never_inline()
    if cols <= 0:
        return
    if decode == _INT8 or decode == _FLOAT8:
        _scale_probabilities(p, p_offset, p_row, scales, scale_offset, scale_step, rows, cols,
                             E4M3_UNIT if decode == _FLOAT8 else _ONE, ahead)
    ahead_bytes = ahead * b_row
    wide = WIDE_VECTORS * lanes_in(c)
    wide_end = (width // wide) * wide if rows <= WIDE_ROWS else 0
    if wide_end > 0:  # (x_start a plain int: a literal 0 compiled every decode's P V a second time)
        _decoded_product(p, p_offset, p_row, codes, b_offset, b_row, c, c_offset, c_row, rows, cols, plain_int(0),
                         wide_end, ahead_bytes, decode)
    if wide_end < width:
        for j0 in range(0, cols, DEPTH_BLOCK):
            _decoded_product(p, p_offset + j0, p_row, codes, b_offset + j0 * b_row, b_row, c, c_offset, c_row, rows,
                             smaller(DEPTH_BLOCK, cols - j0), wide_end, width, ahead_bytes, decode)


@helper
def _decoded_product(p, p_offset, p_row, codes, b_offset, b_row, c, c_offset, c_row, rows, cols, x_start, x_stop,
                     ask_bytes, decode):
    """:func:`_product_of` compiled once per decode."""
    never_inline()
    if decode == _FLOAT16:
        _product_of(p, p_offset, p_row, codes, b_offset, b_row, c, c_offset, c_row, rows, cols, x_start, x_stop,
                    ask_bytes, _FLOAT16)
    elif decode == _BFLOAT16:
        _product_of(p, p_offset, p_row, codes, b_offset, b_row, c, c_offset, c_row, rows, cols, x_start, x_stop,
                    ask_bytes, _BFLOAT16)
    elif decode == _FLOAT8:
        _product_of(p, p_offset, p_row, codes, b_offset, b_row, c, c_offset, c_row, rows, cols, x_start, x_stop,
                    ask_bytes, _FLOAT8)
    else:
        _product_of(p, p_offset, p_row, codes, b_offset, b_row, c, c_offset, c_row, rows, cols, x_start, x_stop,
                    ask_bytes, _INT8)


@helper
def _scale_probabilities(p, p_offset, p_row, scales, scale_offset, scale_step, rows, cols, unit, ahead):
    """``P[r, j] *= scale_j * unit`` for r < rows, j < cols (``P`` and ``scale_j`` as in
    :func:`code_product`): a vector of keys' scales gathered once for every row, then the
    keys left one by one; each product rounded once, as a block's multiply rounds it. Asks
    for the scales of the keys ``ahead`` rows on (none where 0)."""
    always_inline()
    lanes = lanes_in(p)
    j = 0
    while j + lanes <= cols:
        if ahead > 0:
            _ask_for_scales(scales, scale_offset + (j + ahead) * scale_step, lanes * scale_step)
        factor = multiply(load_strided(scales, scale_offset + j * scale_step, scale_step), fill(unit, p))
        for r in range(rows):
            at = p_offset + r * p_row + j
            store(p, at, multiply(load(p, at), factor))
        j += lanes
    while j < cols:
        factor = scales[as_offset(scale_offset + j * scale_step)] * unit
        for r in range(rows):
            at = as_offset(p_offset + r * p_row + j)
            p[at] = scalar_like(p[at] * factor, p)
        j += 1


@helper
def _product_of(p, p_offset, p_row, codes, b_offset, b_row, c, c_offset, c_row, rows, cols, x_start, x_stop, ask_bytes,
                decode):
    """Columns ``[x_start, x_stop)``: for fewer rows than a block, first
    :data:`~npattn.cpu.microkernels.WIDE_VECTORS` vectors at a time, one row at a time;
    then :data:`VECTOR_BLOCK` vectors at a time, blocks of :data:`ROW_BLOCK` rows of C
    (then single rows) held in registers over every key: each key's codes of those columns
    converted once per block, its probabilities (scaled already, for one-byte codes)
    broadcast from ``p``; then the columns left a vector at a time. The blocks of the
    first row (block) ask, key by key, for their columns of the key ``ask_bytes`` on
    (none where 0)."""
    always_inline()
    lanes = lanes_in(c)
    x0 = x_start
    if rows < ROW_BLOCK:  # each row alone anyway: WIDE_VECTORS chains in flight
        while x0 + WIDE_VECTORS * lanes <= x_stop:
            for r in range(rows):
                _wide_vector_block(p, p_offset + r * p_row, codes, b_offset, x0, b_row, c, c_offset + r * c_row + x0,
                                   cols, lanes, ask_bytes if r == 0 else 0, decode)
            x0 += WIDE_VECTORS * lanes
    while x0 + VECTOR_BLOCK * lanes <= x_stop:
        r = 0
        while r + ROW_BLOCK <= rows:
            _vector_block(p, p_offset + r * p_row, p_row, codes, b_offset, x0, b_row, c, c_offset + r * c_row + x0,
                          c_row, ROW_BLOCK, cols, lanes, ask_bytes if r == 0 else 0, VECTOR_BLOCK, decode)
            r += ROW_BLOCK
        while r < rows:
            _vector_block(p, p_offset + r * p_row, p_row, codes, b_offset, x0, b_row, c, c_offset + r * c_row + x0,
                          c_row, 1, cols, lanes, ask_bytes if r == 0 else 0, VECTOR_BLOCK, decode)
            r += 1
        x0 += VECTOR_BLOCK * lanes
    # two whole vectors short of a block (AVX-512's head dims 32 and 48, 16-bit values: every
    # 16-bit prefill's P V) in 4-row blocks of their own: _tail_vectors, whose counts and
    # decode are not constants, branches at every FMA (one core, 32 x 32 keys x 32 columns:
    # 668 -> 330 ns, float32's product 337). Rows left, single vectors and one-byte codes
    # stay with it: each block here compiles into every forward kernel once per decode
    if VECTOR_BLOCK > 2 and (decode == _FLOAT16 or decode == _BFLOAT16) and x0 + 2 * lanes <= x_stop and rows >= 4:
        r = 0
        while r + ROW_BLOCK <= rows:
            _vector_block(p, p_offset + r * p_row, p_row, codes, b_offset, x0, b_row, c, c_offset + r * c_row + x0,
                          c_row, ROW_BLOCK, cols, lanes, ask_bytes if r == 0 else 0, 2, decode)
            r += ROW_BLOCK
        _tail_rows(p, p_offset, p_row, codes, b_offset, x0, b_row, c, c_offset, c_row, r, rows, cols, 2, 0, decode)
        x0 += 2 * lanes
    if x0 < x_stop:  # the columns left together, a last partial vector (16-bit values) masked
        _tail_rows(p, p_offset, p_row, codes, b_offset, x0, b_row, c, c_offset, c_row, 0, rows, cols,
                   (x_stop - x0) // lanes, _partial_lanes(x_stop - x0, lanes, decode), decode)


@helper
def _tail_rows(p, p_offset, p_row, codes, b_offset, x0, b_row, c, c_offset, c_row, first, rows, cols, vectors, count,
               decode):
    """Rows ``first`` to ``rows`` of :func:`_tail_vectors`' columns from ``x0``: blocks of
    :data:`ROW_BLOCK`, then of 2 and 1."""
    always_inline()
    r = first
    while r + ROW_BLOCK <= rows:
        _tail_vectors(p, p_offset + r * p_row, p_row, codes, b_offset, x0, b_row, c, c_offset + r * c_row + x0, c_row,
                      ROW_BLOCK, cols, vectors, count, decode)
        r += ROW_BLOCK
    if rows - r >= 2:
        _tail_vectors(p, p_offset + r * p_row, p_row, codes, b_offset, x0, b_row, c, c_offset + r * c_row + x0, c_row,
                      2, cols, vectors, count, decode)
        r += 2
    if r < rows:
        _tail_vectors(p, p_offset + r * p_row, p_row, codes, b_offset, x0, b_row, c, c_offset + r * c_row + x0, c_row,
                      1, cols, vectors, count, decode)


@helper
def _vector_block(p, p_at, p_row, codes, b_at, x0, b_row, c, c_at, c_row, rows, cols, lanes, ask_bytes, vectors,
                  decode):
    """``vectors`` (:data:`VECTOR_BLOCK` or 2) vectors of columns from ``x0`` of ``rows``
    (1 or :data:`ROW_BLOCK`) rows of :func:`_product_of`, both constants where inlined:
    the accumulators of row r are s, t, u, w, numbered by vector."""
    always_inline()
    zero = fill(0.0, c)
    s0 = s1 = s2 = s3 = t0 = t1 = t2 = t3 = u0 = u1 = u2 = u3 = w0 = w1 = w2 = w3 = b1 = b2 = b3 = zero
    for j in range(cols):
        at = b_at + j * b_row
        _ask_for_block(codes, at + x0 * code_bytes(decode), vectors * lanes * code_bytes(decode), ask_bytes)
        b0 = _values(codes, at, x0, zero, decode)
        if vectors >= 2:
            b1 = _values(codes, at, x0 + lanes, zero, decode)
        if vectors == 4:
            b2, b3 = _values(codes, at, x0 + 2 * lanes, zero, decode), _values(codes, at, x0 + 3 * lanes, zero, decode)
        s0, s1, s2, s3 = _block_step(broadcast_element(p, p_at + j, c), b0, b1, b2, b3, s0, s1, s2, s3, vectors)
        if rows == 4:
            t0, t1, t2, t3 = _block_step(broadcast_element(p, p_at + p_row + j, c), b0, b1, b2, b3, t0, t1, t2, t3,
                                         vectors)
            u0, u1, u2, u3 = _block_step(broadcast_element(p, p_at + 2 * p_row + j, c), b0, b1, b2, b3, u0, u1, u2,
                                         u3, vectors)
            w0, w1, w2, w3 = _block_step(broadcast_element(p, p_at + 3 * p_row + j, c), b0, b1, b2, b3, w0, w1, w2,
                                         w3, vectors)
    _add_block(c, c_at, lanes, s0, s1, s2, s3, vectors)
    if rows == 4:
        _add_block(c, c_at + c_row, lanes, t0, t1, t2, t3, vectors)
        _add_block(c, c_at + 2 * c_row, lanes, u0, u1, u2, u3, vectors)
        _add_block(c, c_at + 3 * c_row, lanes, w0, w1, w2, w3, vectors)


@helper
def _block_step(weight, b0, b1, b2, b3, s0, s1, s2, s3, vectors):
    """One row's first ``vectors`` accumulators of a block after one key: ``weight`` times
    each of the key's values added by a FMA."""
    always_inline()
    s0 = multiply_add(weight, b0, s0)
    if vectors >= 2:
        s1 = multiply_add(weight, b1, s1)
    if vectors == 4:
        s2, s3 = multiply_add(weight, b2, s2), multiply_add(weight, b3, s3)
    return s0, s1, s2, s3


@helper
def _wide_vector_block(p, p_at, codes, b_at, x0, b_row, c, c_at, cols, lanes, ask_bytes, decode):
    """:data:`~npattn.cpu.microkernels.WIDE_VECTORS` vectors of columns from ``x0`` of one
    row of :func:`_product_of` (8, or 6 with AVX2's 16 registers): as many FMA chains as
    float32's single-row products keep."""
    always_inline()
    zero = fill(0.0, c)
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = zero
    for j in range(cols):
        weight = broadcast_element(p, p_at + j, c)
        at = b_at + j * b_row
        _ask_for_block(codes, at + x0 * code_bytes(decode), WIDE_VECTORS * lanes * code_bytes(decode), ask_bytes)
        s0 = multiply_add(weight, _values(codes, at, x0, zero, decode), s0)
        s1 = multiply_add(weight, _values(codes, at, x0 + lanes, zero, decode), s1)
        s2 = multiply_add(weight, _values(codes, at, x0 + 2 * lanes, zero, decode), s2)
        s3 = multiply_add(weight, _values(codes, at, x0 + 3 * lanes, zero, decode), s3)
        s4 = multiply_add(weight, _values(codes, at, x0 + 4 * lanes, zero, decode), s4)
        s5 = multiply_add(weight, _values(codes, at, x0 + 5 * lanes, zero, decode), s5)
        if WIDE_VECTORS == 8:
            s6 = multiply_add(weight, _values(codes, at, x0 + 6 * lanes, zero, decode), s6)
            s7 = multiply_add(weight, _values(codes, at, x0 + 7 * lanes, zero, decode), s7)
    _add_into(c, c_at, s0)
    _add_into(c, c_at + lanes, s1)
    _add_into(c, c_at + 2 * lanes, s2)
    _add_into(c, c_at + 3 * lanes, s3)
    _add_into(c, c_at + 4 * lanes, s4)
    _add_into(c, c_at + 5 * lanes, s5)
    if WIDE_VECTORS == 8:
        _add_into(c, c_at + 6 * lanes, s6)
        _add_into(c, c_at + 7 * lanes, s7)


@helper
def _tail_vectors(p, p_at, p_row, codes, b_at, x0, b_row, c, c_at, c_row, rows, cols, vectors, count, decode):
    """The columns from ``x0`` left after :func:`_product_of`'s blocks, for ``rows`` (1, 2
    or :data:`ROW_BLOCK`, a constant) rows: ``vectors`` whole vectors (fewer than a
    block's), then the first ``count`` columns of one more, its codes and C read and C
    written masked. Each vector of each row its own FMA chain, s, t, u and w by row (one
    vector at a time, a row's one chain waited on the FMA's latency at every key). Not
    asked for (a few columns). The same chains per column as a block's, so the same bits."""
    never_inline()
    lanes = lanes_in(c)
    zero = fill(0.0, c)
    s = t = u = w = (zero, zero, zero, zero)
    for j in range(cols):
        at = b_at + j * b_row
        values = (_values(codes, at, x0, zero, decode) if vectors > 0 else zero,
                  _values(codes, at, x0 + lanes, zero, decode) if vectors > 1 else zero,
                  _values(codes, at, x0 + 2 * lanes, zero, decode) if vectors > 2 else zero,
                  _values_first(codes, at, x0 + vectors * lanes, count, zero, decode) if count else zero)
        s = tail_step(broadcast_element(p, p_at + j, c), values, s, vectors, count)
        if rows >= 2:
            t = tail_step(broadcast_element(p, p_at + p_row + j, c), values, t, vectors, count)
        if rows == 4:
            u = tail_step(broadcast_element(p, p_at + 2 * p_row + j, c), values, u, vectors, count)
            w = tail_step(broadcast_element(p, p_at + 3 * p_row + j, c), values, w, vectors, count)
    _add_tail(c, c_at, s, vectors, count)
    if rows >= 2:
        _add_tail(c, c_at + c_row, t, vectors, count)
    if rows == 4:
        _add_tail(c, c_at + 2 * c_row, u, vectors, count)
        _add_tail(c, c_at + 3 * c_row, w, vectors, count)


@helper
def _add_tail(c, at, sums, vectors, count):
    """A row's tail sums added into C from ``at``: ``vectors`` whole vectors of ``sums``,
    then the first ``count`` lanes of its last, masked."""
    always_inline()
    lanes = lanes_in(c)
    for n in range(vectors):
        _add_into(c, at + n * lanes, sums[n])
    if count:
        store_first(c, at + vectors * lanes, add(load_first(c, at + vectors * lanes, count, 0.0), sums[3]), count)


@helper
def _add_block(c, at, lanes, s0, s1, s2, s3, vectors):
    """A row's first ``vectors`` accumulators of a block added into ``c`` from ``at``."""
    always_inline()
    _add_into(c, at, s0)
    if vectors >= 2:
        _add_into(c, at + lanes, s1)
    if vectors == 4:
        _add_into(c, at + 2 * lanes, s2)
        _add_into(c, at + 3 * lanes, s3)


@helper
def _add_into(c, at, total):
    """The vector ``total`` added into ``c`` at ``at``."""
    always_inline()
    store(c, at, add(load(c, at), total))
