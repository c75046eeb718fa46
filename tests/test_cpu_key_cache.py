"""The key tiles a CPU forward keeps packed per thread for a kv head's next query tile or
head (npattn.cpu.tiles.cached_key_tile, ``Tuning.key_cache_bytes``): bfloat16 pairs (K^T
and the values, with AVX512_BF16's products) and float32 / float64 K^T. A kept tile gives
the bits of one packed where it is read, and the plans keep tiles exactly where one is
read twice."""
from __future__ import annotations

import contextlib
import os
from unittest import mock

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, strategies as st

import npattn
from npattn.cpu import simd
from npattn.cpu.microkernels import chunk_columns
from npattn.cpu.operands import Int, cache_slot_words
from npattn.cpu.tuning import current, tuned

needs_bf16 = pytest.mark.skipif(not simd.BF16_DOT, reason="the CPU has no AVX512_BF16")
# bfloat16 keeps pairs only where it multiplies in pairs; float32 and float64 keep K^T
DTYPES = [pytest.param("bfloat16", marks=needs_bf16), "float32", "float64"]


def _dtype(name):
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


@pytest.mark.parametrize("dtype", DTYPES)
@given(batch=st.integers(1, 2), kv_heads=st.integers(1, 2), group=st.sampled_from([1, 2, 3]),
       q_len=st.integers(1, 90), kv_len=st.integers(1, 130), head_dim=st.sampled_from([16, 32, 64]),
       tiles=st.sampled_from([(8, 16), (16, 32), (24, 48), (5, 16)]), visibility=st.sampled_from(
           [{}, {"causal": True}, {"causal": "top_left"}, {"window": (20, 0), "sinks": 3}, {"window": (7, 9)}]),
       lengths=st.booleans(), paged=st.booleans(), slots=st.sampled_from([1, 2, None]),
       threads=st.sampled_from([1, 3]), seed=st.integers(0, 2**32 - 1))
def test_key_tiles_kept_packed_give_the_bits_of_tiles_packed_where_read(dtype, batch, kv_heads, group, q_len,
                                                                        kv_len, head_dim, tiles, visibility, lengths,
                                                                        paged, slots, threads, seed):
    """A forward keeps a kv head's key tiles packed for its next query tile and head
    (tuning.key_cache_bytes, here room for ``slots`` tiles or all of them):
    a tile read from there gives the same bits as one packed where read, on and off the
    tile grid (windows, left padding, lengths that cut a tile, odd key counts, pages),
    also with the kv heads' items claimed by 3 threads at once (these small calls would
    run on the calling thread alone: here they are shared whatever their work)."""
    rng = np.random.default_rng(seed)
    heads = kv_heads * group
    q = rng.normal(size=(batch, heads, q_len, head_dim)).astype(_dtype(dtype))
    k, v = (rng.normal(size=(batch, kv_heads, kv_len, head_dim)).astype(_dtype(dtype)) for _ in range(2))
    options = dict(visibility)
    if lengths:
        options.update(kv_lengths=rng.integers(0, kv_len + 1, batch), kv_start=rng.integers(0, 3, batch) % kv_len,
                       q_lengths=rng.integers(1, q_len + 1, batch))
        for x in (k, v):  # keys no row sees may hold anything: a whole tile kept reads them
            for b in range(batch):
                x[b, :, options["kv_lengths"][b]:] = np.nan
                x[b, :, :options["kv_start"][b]] = np.inf
    arguments = (q, k, v)
    if paged and kv_len % 4 == 0:  # pools of 4-key pages, in a shuffled order
        table = rng.permutation(batch * kv_len // 4).reshape(batch, kv_len // 4)
        arguments = (q.transpose(0, 2, 1, 3), *(paged_pool(x, table) for x in (k, v)))
        options.update(block_table=table, layout="bshd")
    block_q, block_k = tiles
    with npattn.cpu.tile_sizes(block_q, block_k), tuned(key_cache_bytes=0):
        expected = npattn.attention(*arguments, **options)
    budget = (slots or 1000) * _slot_bytes(head_dim, block_k, dtype)
    with npattn.cpu.tile_sizes(block_q, block_k), tuned(key_cache_bytes=budget), _shared_by(threads):
        out = npattn.attention(*arguments, **options)
    bits = np.dtype(f"u{out.dtype.itemsize}")
    np.testing.assert_array_equal(out.view(bits), expected.view(bits))


@contextlib.contextmanager
def _shared_by(threads):
    """Calls of any size run on ``threads`` threads (1: as they would). (No plan made
    outside is kept: a plan decides once whether its calls run inline.)"""
    from npattn.cpu import driver

    if threads == 1:
        yield
        return
    npattn.runtime.plans.clear()
    with (mock.patch.dict(os.environ, NPATTN_NUM_THREADS=str(threads)),
          mock.patch.object(driver, "runs_inline", lambda flops, items, backward=False, pool=False: items <= 1)):
        yield
    npattn.runtime.plans.clear()


def paged_pool(x, table):
    """bhsd ``x`` as a pool of 4-key pages (pages, 4, Hkv, D) that ``table`` lays out."""
    batch, kv_heads, kv_len, head_dim = x.shape
    pages = x.transpose(0, 2, 1, 3).reshape(batch * kv_len // 4, 4, kv_heads, head_dim)
    return pages[np.argsort(table.reshape(-1))]


def _slot_bytes(head_dim, block_k, dtype):
    """The bytes of a kept key tile (and its value pairs: bfloat16), at the score tiles'
    row stride."""
    compute = np.dtype(np.float32 if dtype == "bfloat16" else dtype)
    ld = -(-block_k // chunk_columns(compute)) * chunk_columns(compute)
    return compute.itemsize * sum(cache_slot_words(head_dim, head_dim, block_k, ld, dtype == "bfloat16"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prefill_keeps_its_key_tiles_packed_where_a_tile_is_read_twice(dtype):
    """(So the test above runs the kept tiles: a forward of several query tiles, or of
    several heads per kv head, keeps its key tiles up to its budget; one that reads each
    tile once, none. Where it keeps them, a thread claims a kv head's work items at once,
    so that it packs each of its tiles once.)"""
    from npattn.cpu.driver import forward_plan
    from npattn.core.validation import build_problem

    def slots_and_run(q_len, kv_len, heads=2, kv_heads=2, **options):
        q = np.zeros((1, heads, q_len, 64), _dtype(dtype))
        k = np.zeros((1, kv_heads, kv_len, 64), _dtype(dtype))
        problem = build_problem(q, k, k, **options)
        ints = forward_plan(problem, current()).operands.ints
        return int(ints[Int.KEY_CACHE_SLOTS]), int(ints[Int.CLAIM_RUN])

    with npattn.cpu.tile_sizes(16, 32), tuned(key_cache_bytes=5 * _slot_bytes(64, 32, dtype)):
        assert slots_and_run(40, 100) == (4, 3)  # 100 keys: 4 tiles (the last of 4 keys), all within the budget
        assert slots_and_run(40, 200) == (5, 3)  # 7 tiles, 5 within the budget
        assert slots_and_run(16, 100) == (0, 1)  # one query tile per head: each key tile read once
        assert slots_and_run(16, 100, heads=4, kv_heads=2) == (4, 2)  # GQA: read by each head of a group


def test_coded_keys_keep_no_packed_tiles():
    """float16 keys (and a quantized cache's codes) are packed through their staging rows at
    the scratch's start, where float keys' kept tiles would lie (tiles.key_cache): their
    plans keep none, whatever the budget."""
    from npattn.cpu.driver import forward_plan
    from npattn.core.validation import build_problem

    x = np.zeros((1, 2, 40, 64), np.float16)
    with npattn.cpu.tile_sizes(16, 32):
        ints = forward_plan(build_problem(x, x, x), current()).operands.ints
    assert int(ints[Int.KV_CODES]) and int(ints[Int.KEY_CACHE_SLOTS]) == 0
