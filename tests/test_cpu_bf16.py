"""bfloat16 computed in bfloat16 on CPUs with AVX512_BF16 (npattn.cpu.operands.bf16_products):
Q K^T and P V as vdpbf16ps pair products, P rounded to bfloat16. Held to the bfloat16
bound against the float64 reference (as every bfloat16 call is, tests/test_properties.py)
and, more tightly, near the float32-product path on the same inputs; the pair layouts
against their definition."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, strategies as st

import npattn
from npattn.cpu import simd
from npattn.cpu.tuning import tuned
import tolerances

needs_bf16 = pytest.mark.skipif(not simd.BF16_DOT, reason="the CPU has no AVX512_BF16")


@needs_bf16
@given(batch=st.integers(1, 2), heads=st.integers(1, 3), q_len=st.integers(1, 300), kv_len=st.integers(1, 300),
       head_dim=st.sampled_from([16, 32, 48, 64, 128]), causal=st.booleans(), paged=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_bfloat16_products_keep_the_bfloat16_bound(batch, heads, q_len, kv_len, head_dim, causal, paged, seed):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, heads, q_len, head_dim)).astype(ml_dtypes.bfloat16)
    k, v = (rng.normal(size=(batch, heads, kv_len, head_dim)).astype(ml_dtypes.bfloat16) for _ in range(2))
    options = dict(causal=causal)
    if paged and kv_len % 4 == 0:  # pools of 4-key pages, in a shuffled order
        per_entry = kv_len // 4
        table = rng.permutation(batch * per_entry).reshape(batch, per_entry)
        pool = lambda x: x.transpose(0, 2, 1, 3).reshape(batch * per_entry, 4, heads, head_dim)[  # noqa: E731
            np.argsort(table.reshape(-1))]
        arguments = (q.transpose(0, 2, 1, 3), pool(k), pool(v))
        options.update(block_table=table, layout="bshd")
    else:
        arguments = (q, k, v)
    out, lse = npattn.attention(*arguments, return_lse=True, **options)
    with tuned(bf16_products=False):
        plain = npattn.attention(*arguments, **options)
    expected, expected_lse = npattn.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                              causal=causal, return_lse=True, backend="reference")
    if options.get("layout") == "bshd":
        out, plain = out.transpose(0, 2, 1, 3), plain.transpose(0, 2, 1, 3)
    out_bound, lse_bound = tolerances.attention_bounds("bfloat16", q, k, v, kv_len)
    np.testing.assert_allclose(out.astype(np.float64), expected, rtol=0, atol=out_bound)
    finite = np.isfinite(expected_lse)
    np.testing.assert_allclose(lse[finite], expected_lse[finite], rtol=0, atol=lse_bound)
    # P rounded to bfloat16 moves each output by at most half a bfloat16 ulp of P's mass
    # times the values (plus both results' own rounding to bfloat16)
    eps = float(ml_dtypes.finfo(ml_dtypes.bfloat16).eps)
    near = eps * float(np.abs(v.astype(np.float64)).max(initial=1)) * 2
    np.testing.assert_allclose(out.astype(np.float64), plain.astype(np.float64), rtol=0, atol=near)


@needs_bf16
def test_bfloat16_products_are_taken_where_they_pay_and_nowhere_else():
    from npattn.core.validation import build_problem
    from npattn.cpu.operands import Int, operand_plan
    from npattn.cpu.tuning import current

    def taken(q_len, kv_len, dtype="bfloat16", kind="forward", **options):
        x = np.zeros((1, 2, q_len, 64), dtype)
        keys = np.zeros((1, 2, kv_len, 64), dtype)
        problem = build_problem(x, keys, keys, **options)
        return bool(operand_plan(problem, kind, current()).ints[Int.BF16_PRODUCTS])

    assert taken(256, 256) and taken(256, 256, causal=True)
    assert not taken(256, 256, dtype="float32") and not taken(256, 256, dtype="float16")
    assert not taken(256, 256, kind="backward") and not taken(256, 256, return_weights=True)
    assert not taken(1, 4096)  # a decode step's dot products (and 16-bit tiles) instead
    with tuned(bf16_products=False):
        assert not taken(256, 256)


def test_pair_layouts_hold_bfloat16_pairs_in_order():
    """pair_bits's word: bfloat16 of its first value in the low half, rounded to nearest
    even; the vector stores agree with it."""
    from numba import njit

    from npattn.cpu.microkernels import pair_bits
    from npattn.cpu.simd import VECTOR_BYTES, load, store_bfloat16, store_bfloat16_pairs

    lanes = VECTOR_BYTES // 4
    rng = np.random.default_rng(3)
    first = rng.normal(size=lanes).astype(np.float32)
    second = rng.normal(size=lanes).astype(np.float32)
    first[:3] = [1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -0.0]  # ties: to even, down then up

    @njit
    def words(first, second):
        scalar = np.empty(lanes, np.float32)
        for i in range(lanes):
            scalar[i] = pair_bits(first[i], second[i])
        rows = np.empty(lanes // 2, np.float32)
        store_bfloat16(rows, 0, load(first, 0))
        pairs = np.empty(lanes, np.float32)
        store_bfloat16_pairs(pairs, 0, load(first, 0), load(second, 0))
        return scalar, rows, pairs

    scalar, rows, pairs = (w.view(np.uint32) for w in words(first, second))
    low, high = first.astype(ml_dtypes.bfloat16).view(np.uint16), second.astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(scalar, low.astype(np.uint32) | (high.astype(np.uint32) << 16))
    np.testing.assert_array_equal(pairs, scalar)
    np.testing.assert_array_equal(rows, low[0::2].astype(np.uint32) | (low[1::2].astype(np.uint32) << 16))
