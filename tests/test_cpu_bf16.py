"""bfloat16 computed in bfloat16 on CPUs with AVX512_BF16 (npattn.cpu.operands.bf16_products):
Q K^T and P V as vdpbf16ps pair products, P rounded to bfloat16. Held to the bfloat16
bound against the float64 reference (as every bfloat16 call is, tests/test_properties.py)
and, more tightly, near the float32-product path on the same inputs; the pair layouts
against their definition."""
from __future__ import annotations

import functools
from unittest import mock

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, strategies as st

import npattn
from npattn.cpu import simd
from npattn.cpu.tuning import current, tuned
import tolerances
from test_cpu_key_cache import paged_pool

needs_bf16 = pytest.mark.skipif(not simd.BF16_DOT, reason="the CPU has no AVX512_BF16")


@pytest.fixture(autouse=True)
def pair_products():
    """Every test here takes the pair products wherever the CPU has them, on Intel's
    cores too, where bfloat16 computes in float32 by default (npattn.cpu.isa.bf16_pairs_pay)."""
    with npattn.cpu.bfloat16_products(True):
        yield


@needs_bf16
@given(batch=st.integers(1, 2), kv_heads=st.integers(1, 3), group=st.sampled_from([1, 1, 2, 3]),
       q_len=st.integers(1, 300), kv_len=st.integers(1, 300), head_dim=st.sampled_from([16, 32, 48, 64, 128]),
       causal=st.booleans(), paged=st.booleans(), dropout=st.sampled_from([0.0, 0.0, 0.3]),
       seed=st.integers(0, 2**32 - 1))
def test_bfloat16_products_keep_the_bfloat16_bound(batch, kv_heads, group, q_len, kv_len, head_dim, causal, paged,
                                                   dropout, seed):
    """(With dropout, the tiles' probabilities are dropped before they are rounded to
    pairs; without, they are rounded as exp makes them: both within the bounds.)"""
    rng = np.random.default_rng(seed)
    heads = kv_heads * group  # (GQA: groups folded into rows where a group's rows fit a tile)
    q = rng.normal(size=(batch, heads, q_len, head_dim)).astype(ml_dtypes.bfloat16)
    k, v = (rng.normal(size=(batch, kv_heads, kv_len, head_dim)).astype(ml_dtypes.bfloat16) for _ in range(2))
    options = dict(causal=causal)
    if dropout:
        options.update(dropout_p=dropout, seed=seed)
    if paged and kv_len % 4 == 0:  # pools of 4-key pages, in a shuffled order
        table = rng.permutation(batch * kv_len // 4).reshape(batch, kv_len // 4)
        arguments = (q.transpose(0, 2, 1, 3), paged_pool(k, table), paged_pool(v, table))
        options.update(block_table=table, layout="bshd")
    else:
        arguments = (q, k, v)
    out, lse = npattn.attention(*arguments, return_lse=True, **options)
    # the same values starting 2 bytes off a 4-byte boundary (read from an aligned copy):
    # the same bits
    np.testing.assert_array_equal(npattn.attention(*map(_off_boundary, arguments), **options).view(np.uint16),
                                  out.view(np.uint16))
    with tuned(bf16_products=False):
        plain = npattn.attention(*arguments, **options)
    expected, expected_lse = npattn.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                              return_lse=True, backend="reference",
                                              **{name: options[name] for name in ("causal", "dropout_p", "seed")
                                                 if name in options})
    if options.get("layout") == "bshd":
        out, plain = out.transpose(0, 2, 1, 3), plain.transpose(0, 2, 1, 3)
    # (kept probabilities are scaled by 1 / (1 - p): so are the values' share of the bound)
    out_bound, lse_bound = tolerances.attention_bounds("bfloat16", q, k, v.astype(np.float64) / (1 - dropout), kv_len)
    np.testing.assert_allclose(out.astype(np.float64), expected, rtol=0, atol=out_bound)
    finite = np.isfinite(expected_lse)
    np.testing.assert_allclose(lse[finite], expected_lse[finite], rtol=0, atol=lse_bound)
    # P rounded to bfloat16 moves each output by at most half a bfloat16 ulp of P's mass
    # times the values (plus both results' own rounding to bfloat16)
    eps = float(ml_dtypes.finfo(ml_dtypes.bfloat16).eps)
    near = eps * float(np.abs(v.astype(np.float64)).max(initial=1)) * 2 / (1 - dropout)
    np.testing.assert_allclose(out.astype(np.float64), plain.astype(np.float64), rtol=0, atol=near)


@needs_bf16
@given(q_len=st.integers(1, 200), kv_len=st.integers(385, 800), head_dim=st.sampled_from([64, 80, 128]),
       layout=st.sampled_from(["bhsd", "bshd"]), offset=st.sampled_from([16, 32, 48]), causal=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_bfloat16_forwards_give_the_same_bits_wherever_q_starts(q_len, kv_len, head_dim, layout, offset, causal,
                                                                 seed):
    """On AMX tiles a work item's query rows that start off 64-byte lines are copied onto
    them after its first key tile, which reads them where they lie (a tile row across two
    lines loads at about half speed: npattn.cpu.tiles.copy_query_rows); the later key tiles
    (more than 384 keys) read the copy: the same products, so the same bits as q on lines.
    Elsewhere nothing is copied, and the bits are the same all the same."""
    rng = np.random.default_rng(seed)
    heads, kv_heads = 2, 1
    values = rng.normal(size=(1, heads, q_len, head_dim)).astype(ml_dtypes.bfloat16)
    k, v = (rng.normal(size=(1, kv_heads, kv_len, head_dim)).astype(ml_dtypes.bfloat16) for _ in range(2))

    def q_at(line_offset):
        """``values`` in memory that starts ``line_offset`` bytes past a 64-byte line, in
        ``layout`` (bshd: heads interleaved in each row, head strides of D bytes x 2)."""
        in_memory = values.transpose(0, 2, 1, 3) if layout == "bshd" else values
        raw = np.empty(values.nbytes + 128, np.uint8)
        start = -raw.ctypes.data % 64 + line_offset
        placed = raw[start:start + values.nbytes].view(ml_dtypes.bfloat16).reshape(in_memory.shape)
        placed[...] = in_memory
        assert placed.ctypes.data % 64 == line_offset
        return placed.transpose(0, 2, 1, 3) if layout == "bshd" else placed

    on_lines = npattn.attention(q_at(0), k, v, causal=causal, return_lse=True)
    off_lines = npattn.attention(q_at(offset), k, v, causal=causal, return_lse=True)
    np.testing.assert_array_equal(off_lines[0].view(np.uint16), on_lines[0].view(np.uint16))
    np.testing.assert_array_equal(off_lines[1], on_lines[1])


def _off_boundary(array):
    """A C-contiguous copy of ``array`` whose data starts 2 bytes past a 4-byte boundary."""
    flat = np.empty(array.size + 2, array.dtype)
    start = 1 if flat.__array_interface__["data"][0] % 4 == 0 else 0
    copy = flat[start:start + array.size].reshape(array.shape)
    copy[...] = array
    assert copy.__array_interface__["data"][0] % 4 == 2
    return copy


@needs_bf16
def test_bfloat16_products_are_taken_where_they_pay_and_nowhere_else():
    from npattn.core.validation import build_problem
    from npattn.cpu.operands import Int, KvCodes, operand_plan
    from npattn.cpu.tuning import current

    def taken(q_len, kv_len, dtype="bfloat16", kind="forward", head_dim=64, every_other_key=False, **options):
        x = np.zeros((1, 2, q_len, head_dim), dtype)
        keys = np.zeros((1, 2, 2 * kv_len, head_dim), dtype)[:, :, ::2] if every_other_key else np.zeros(
            (1, 2, kv_len, head_dim), dtype)
        problem = build_problem(x, keys, keys, **options)
        return bool(operand_plan(problem, kind, current()).ints[Int.BF16_PRODUCTS])

    assert taken(256, 256) and taken(256, 256, causal=True)
    # and write out in bfloat16 themselves (each row's float32 sums rounded as it is done)
    x = np.zeros((1, 2, 256, 64), "bfloat16")
    assert operand_plan(build_problem(x, x, x), "forward", current()).ints[Int.OUT_CODES] == KvCodes.BFLOAT16
    assert not taken(256, 256, dtype="float32") and not taken(256, 256, dtype="float16")
    assert not taken(256, 256, return_weights=True)
    # the backward too (every product, pair_gradients; with a bias, its gradient's kernel
    # too), but not for head dims of part vectors
    bias = np.zeros((256, 256), np.float32)
    assert taken(256, 256, kind="backward") and taken(100, 37, kind="backward", causal=True)
    assert taken(256, 256, bias=bias) and taken(256, 256, kind="backward", bias=bias)
    narrow_keys = (np.zeros((1, 2, 256, 40), "bfloat16"),) * 2  # (dK and dQ need whole vectors of D)
    wide_values = np.zeros((1, 2, 256, 64), "bfloat16")
    assert operand_plan(build_problem(*narrow_keys, wide_values), "forward", current()).ints[Int.BF16_PRODUCTS]
    assert not operand_plan(build_problem(*narrow_keys, wide_values), "backward", current()).ints[Int.BF16_PRODUCTS]
    backward = operand_plan(build_problem(x, x, x), "backward", current()).ints
    assert backward[Int.KEY_CACHE_SLOTS] == 0 and backward[Int.OUT_CODES] == KvCodes.NONE
    assert not taken(1, 4096)  # a decode step's dot products (and 16-bit tiles) instead
    # from the first row past the dot products' on, short queries and small calls too
    assert not taken(8, 300) and taken(9, 300) and taken(16, 16) and taken(40, 40, causal=True)
    # the kernels read q, k and v as float32 words of two bfloat16, in a known memory
    # order: an odd head dim, or keys in no such order, take the float32 products on
    # converted copies
    assert taken(256, 256, head_dim=48) and not taken(256, 256, head_dim=47)
    assert not taken(256, 256, every_other_key=True)
    with tuned(bf16_products=False):
        assert not taken(256, 256)
    with npattn.cpu.bfloat16_products(None):  # this CPU's default
        assert taken(256, 256) == simd.BF16_PAIRS_BY_DEFAULT


@pytest.mark.parametrize("cpu_name, pay", [("znver4", True), ("znver5", True), ("sapphirerapids", False),
                                           ("emeraldrapids", False), ("graniterapids", False),
                                           ("cooperlake", False)])
def test_pairs_are_the_default_on_amds_cores_and_not_on_intels(cpu_name, pay):
    """vdpbf16ps makes twice the products of an FMA per cycle on Zen 4 and half on
    Sapphire and Emerald Rapids (npattn.cpu.isa.bf16_pairs_pay)."""
    from npattn.cpu import isa

    with mock.patch.object(isa, "host_cpu_name", return_value=cpu_name):
        assert isa.bf16_pairs_pay() is pay


def test_the_bfloat16_switch_takes_true_false_or_none():
    for value in (True, False, None):
        with npattn.cpu.bfloat16_products(value):
            assert current().bf16_products is value
    with pytest.raises(ValueError, match="enabled must be True, False or None, got 'yes'"):
        npattn.cpu.bfloat16_products("yes")


def test_pair_layouts_hold_bfloat16_pairs_in_order():
    """pair_bits's word: bfloat16 of its first value in the low half, rounded to nearest
    even; store_bfloat16 agrees with it; store_interleaved_pairs puts two rows of
    bfloat16 memory (seen as float32 words) side by side, pair by pair, and zeros for an
    absent second row."""
    from numba import njit

    from npattn.cpu.microkernels import pair_bits
    from npattn.cpu.simd import VECTOR_BYTES, load, store_bfloat16, store_interleaved_pairs

    lanes = VECTOR_BYTES // 4
    rng = np.random.default_rng(3)
    first = rng.normal(size=lanes).astype(np.float32)
    second = rng.normal(size=lanes).astype(np.float32)
    first[:3] = [1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -0.0]  # ties: to even, down then up
    # two rows of bfloat16 memory, each lanes values (lanes / 2 words), at odd word offsets
    memory = rng.normal(size=3 * lanes + 2).astype(ml_dtypes.bfloat16)

    @njit
    def words(first, second, memory_words):
        scalar = np.empty(lanes, np.float32)
        for i in range(lanes):
            scalar[i] = pair_bits(first[i], second[i])
        rows = np.empty(lanes // 2, np.float32)
        store_bfloat16(rows, 0, load(first, 0))
        pairs = np.empty(2 * lanes, np.float32)
        store_interleaved_pairs(pairs, 0, memory_words, 1, lanes + 1, True)
        store_interleaved_pairs(pairs, lanes, memory_words, 1, 1, False)
        return scalar, rows, pairs

    scalar, rows, pairs = (w.view(np.uint32) for w in words(first, second, memory.view(np.float32)))
    low, high = first.astype(ml_dtypes.bfloat16).view(np.uint16), second.astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(scalar, low.astype(np.uint32) | (high.astype(np.uint32) << 16))
    np.testing.assert_array_equal(rows, low[0::2].astype(np.uint32) | (low[1::2].astype(np.uint32) << 16))
    bits = memory.view(np.uint16).astype(np.uint32)
    row_one, row_two = bits[2:2 + lanes], bits[2 * lanes + 2:3 * lanes + 2]
    np.testing.assert_array_equal(pairs[:lanes], row_one | (row_two << 16))
    np.testing.assert_array_equal(pairs[lanes:], row_one)



@needs_bf16
@given(n=st.integers(1, 80), shift=st.floats(-3, 3), seed=st.integers(0, 2**32 - 1))
def test_probabilities_rounded_to_pairs_as_exp_makes_them_are_those_of_exp_then_pairs(n, shift, seed):
    """exp_tile_to_pairs (a bfloat16 forward's tiles without dropout): the sums and
    the pair words of exp_shifted (brief) followed by pair_rows, bit for bit, whole
    vectors and the last values alike (odd counts end on a pair with a zero), on two
    rows of a tile, each with a shift of its own; and the thread's MXCSR as it was."""
    rng = np.random.default_rng(seed)
    row = n + 5  # two rows of n scores, from 3 and row + 3
    scores = (rng.normal(size=2 * row) * 4).astype(np.float32)
    scores[rng.random(2 * row) < 0.2] = -np.inf  # masked keys: exactly 0
    # and scores whose exp lands about float32's least normal, 2**-126 (ln: -87.3), where
    # the tile's flushed subnormals must give the zeros of exp_shifted's compare
    edge = rng.random(2 * row) < 0.3
    scores[edge] = shift + rng.uniform(-90.0, -85.0, size=edge.sum())
    fused_sums, later_sums, fused_pairs, later_pairs, control_before, control_after = _fused_and_later()(
        scores, n, row, np.float32(shift))
    assert control_after == control_before
    np.testing.assert_array_equal(fused_sums.view(np.uint32), later_sums.view(np.uint32))
    np.testing.assert_array_equal(fused_pairs.view(np.uint32), later_pairs.view(np.uint32))


@functools.cache
def _fused_and_later():
    """A jitted ``(scores, n, row, shift) -> (fused sums, later sums, fused pairs, later
    pairs, MXCSR before, MXCSR after)``, compiled once (a dispatcher per example would compile per example)."""
    from numba import njit

    from npattn.cpu.rowmath import exp_shifted, exp_tile_to_pairs, flushing_subnormals, restore_control
    from npattn.cpu.tiles import pair_rows

    @njit
    def both(scores, n, row, shift):
        pair_row = (n + 1) // 2 + 3
        fused, later = scores.copy(), scores.copy()
        fused_pairs, later_pairs = np.full(2 * pair_row, np.float32(7.0)), np.full(2 * pair_row, np.float32(7.0))
        fused_sums, later_sums = np.empty(2, np.float32), np.empty(2, np.float32)
        shifts = np.array([shift, shift - np.float32(1.5)])
        before = flushing_subnormals()  # (and back: the control word the kernels found)
        restore_control(before)
        exp_tile_to_pairs(fused[3:], row, 2, n, shifts, fused_pairs, pair_row, 1.0, fused_sums)
        after = flushing_subnormals()
        restore_control(after)
        for r in range(2):
            later_sums[r] = exp_shifted(later, 3 + r * row, n, shifts[r], True)
        pair_rows(later, 3, row, 2, n, later_pairs, pair_row, 1.0)
        return fused_sums, later_sums, fused_pairs, later_pairs, before, after
    return both


@needs_bf16
@given(batch=st.integers(1, 2), kv_heads=st.integers(1, 2), group=st.sampled_from([1, 2, 3]),
       q_len=st.integers(1, 200), kv_len=st.integers(1, 200), head_dim=st.sampled_from([16, 32, 64, 128]),
       causal=st.booleans(), dropout=st.sampled_from([0.0, 0.0, 0.3]), softcap=st.sampled_from([None, None, 2.0]),
       bshd=st.booleans(), bias=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_bfloat16_backward_products_keep_the_pair_rounding_bound(batch, kv_heads, group, q_len, kv_len, head_dim,
                                                                 causal, dropout, softcap, bshd, bias, seed):
    """The backward on bfloat16 pairs (npattn.cpu.pair_gradients) against the float64
    gradients, element by element: within the rounding of P~ and dS to bfloat16 (half an
    ulp of each term summed into that element), float32's sums, and the result's own
    rounding to bfloat16; with a bias, its gradient too (float32 sums of dS, whose own
    error the bound counts). The terms' sizes come from the float64 probabilities, so a
    product that drops or misplaces a pair (a row, a key, a head) fails by the term's
    whole size."""
    rng = np.random.default_rng(seed)
    heads = kv_heads * group
    q = rng.normal(size=(batch, heads, q_len, head_dim)).astype(ml_dtypes.bfloat16)
    k, v = (rng.normal(size=(batch, kv_heads, kv_len, head_dim)).astype(ml_dtypes.bfloat16) for _ in range(2))
    dout = rng.normal(size=(batch, heads, q_len, head_dim)).astype(ml_dtypes.bfloat16)
    options = dict(causal=causal, softcap=softcap)
    if dropout:
        options.update(dropout_p=dropout, seed=seed)
    if bias:  # (Sq, Sk), broadcast over batch and heads: its gradient sums dS over both
        options.update(bias=rng.normal(size=(q_len, kv_len)).astype(np.float32))
    if bshd:  # (B, S, H, D) memory: rows of pairs a head stride apart, in words
        def swapped(x):
            return np.ascontiguousarray(x.transpose(0, 2, 1, 3))
        _, vjp = npattn.attention_vjp(swapped(q), swapped(k), swapped(v), layout="bshd", **options)
        grads = vjp(swapped(dout))
        dq, dk, dv = (g.transpose(0, 2, 1, 3) for g in grads[:3])
    else:
        _, vjp = npattn.attention_vjp(q, k, v, **options)
        grads = vjp(dout)
        dq, dk, dv = grads[:3]
    computed = [g.astype(np.float64) for g in (dq, dk, dv)] + ([grads[3].astype(np.float64)] if bias else [])
    terms = _pair_gradient_terms(*(x.astype(np.float64) for x in (q, k, v, dout)), **options)
    eps32, eps16 = float(np.finfo(np.float32).eps), float(ml_dtypes.finfo(ml_dtypes.bfloat16).eps)
    length = q_len * group + kv_len + head_dim + batch * heads
    for name, actual, (expected, size) in zip(("dq", "dk", "dv", "dbias"), computed, terms):
        tolerance = tolerances.SAFETY * (eps16 / 2 * (np.abs(expected) + size) + length * eps32 * size)
        assert (np.abs(actual - expected) <= tolerance).all(), (
            f"{name}: worst excess {np.max(np.abs(actual - expected) - tolerance):.3g}")


def _pair_gradient_terms(q, k, v, dout, causal, softcap, dropout_p=0.0, seed=0, bias=None):
    """``((dq, its terms' size), (dk, ...), (dv, ...), (dbias, ...))`` in float64,
    materialized: each gradient and, element by element, the sum of the magnitudes of the
    terms summed into it (for dq, dk and dbias with dS's own error, P (|dP| + |dO| . |O|),
    beside |dS|)."""
    from npattn.core.dropout import keep_mask

    batch, heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    group = heads // kv_heads
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scale = 1 / np.sqrt(head_dim)
    scores = scale * q @ k.swapaxes(-1, -2)
    tanh = np.tanh(scores / softcap) if softcap else None
    if softcap:
        scores = softcap * tanh
    if bias is not None:
        scores = scores + bias
    visible = np.ones((q_len, kv_len), bool)
    if causal:  # (bottom-right: the last query row sees every key)
        visible = np.arange(kv_len)[None, :] <= np.arange(q_len)[:, None] + (kv_len - q_len)
    scores = np.where(visible, scores, -np.inf)
    top = scores.max(-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    p = np.exp(scores - top)
    p = p / np.maximum(p.sum(-1, keepdims=True), np.finfo(np.float64).tiny)
    keep = (keep_mask(np, seed, dropout_p, batch, heads, q_len, kv_len) / (1 - dropout_p) if dropout_p
            else np.ones_like(p))
    dropped = p * keep
    out = dropped @ v
    dp = (dout @ v.swapaxes(-1, -2)) * keep
    delta = (dout * out).sum(-1, keepdims=True)
    ds = p * (dp - delta)
    # (dS's own error: float32's in dP - delta, and bfloat16's in delta, which the backward
    # takes from the forward's out as returned, rounded to bfloat16, as torch's does)
    ds_error = p * (np.abs(dp) + (np.abs(dout) * np.abs(out)).sum(-1, keepdims=True))
    # (the bias's gradient is dS before softcap's derivative, summed over batch and heads)
    dbias, dbias_size = ds.sum(axis=(0, 1)), (np.abs(ds) + ds_error).sum(axis=(0, 1))
    if softcap:
        ds, ds_error = ds * (1 - tanh ** 2), ds_error * (1 - tanh ** 2)

    def per_kv_head(x):  # (B, H, Sk, X) summed over each group's heads
        return x.reshape(batch, kv_heads, group, kv_len, -1).sum(axis=2)
    dq = scale * ds @ k
    dq_size = scale * (np.abs(ds) + ds_error) @ np.abs(k)
    dk = per_kv_head(scale * ds.swapaxes(-1, -2) @ q)
    dk_size = per_kv_head(scale * (np.abs(ds) + ds_error).swapaxes(-1, -2) @ np.abs(q))
    dv = per_kv_head(dropped.swapaxes(-1, -2) @ dout)
    dv_size = per_kv_head(dropped.swapaxes(-1, -2) @ np.abs(dout))
    return (dq, dq_size), (dk, dk_size), (dv, dv_size), (dbias, dbias_size)
