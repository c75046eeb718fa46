"""A failing call changes nothing, and says what is wrong: one test per class of fault a
fuzz of the serving calls, the adapters and the environment found (each failed on the
code before the fix). tests/test_serving_fuzz.py draws many more calls of each kind.

Setup of the repros: q (1, 2, 1, 4), k and v (1, 1, 1, 4) in the "bshd" layout of
attention_with_kvcache, caches (1, 8, 1, 4) of zeros.
"""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import npattn
from npattn.nn.cache import KVCache, PagedKVCache


def _setup(dtype=np.float32):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 1, 4)).astype(dtype)
    k = rng.standard_normal((1, 1, 1, 4)).astype(dtype)
    v = rng.standard_normal((1, 1, 1, 4)).astype(dtype)
    return q, k, v, np.zeros((1, 8, 1, 4), dtype), np.zeros((1, 8, 1, 4), dtype)


def _bytes(*arrays):
    return [np.ascontiguousarray(a).tobytes() for a in arrays]


# ---- data changed by a call that fails -----------------------------------------------------

def test_a_read_only_v_cache_is_refused_before_k_cache_is_written():
    q, k, v, kc, vc = _setup()
    vc.flags.writeable = False
    before = _bytes(kc, vc)
    with pytest.raises(ValueError, match="v_cache is read-only"):
        npattn.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=0)
    assert _bytes(kc, vc) == before


def test_a_broadcast_or_shared_cache_is_refused_before_any_write():
    q, k, v, kc, vc = _setup()
    broadcast = np.broadcast_to(np.zeros((1, 1, 1, 4), np.float32), (1, 8, 1, 4))
    with pytest.raises(ValueError, match="k_cache is read-only"):
        npattn.attention_with_kvcache(q, broadcast, vc, k, v, cache_seqlens=0)
    strided = np.lib.stride_tricks.as_strided(np.zeros(4, np.float32), (1, 8, 1, 4), (0, 0, 0, 4), writeable=True)
    with pytest.raises(ValueError, match="k_cache has stride 0 along axis 1"):
        npattn.attention_with_kvcache(q, strided, vc, k, v, cache_seqlens=0)
    before = _bytes(kc)
    with pytest.raises(ValueError, match="k_cache and v_cache share memory"):
        npattn.attention_with_kvcache(q, kc, kc, k, v, cache_seqlens=0)
    assert _bytes(kc) == before
    both = np.zeros((1, 8, 2, 1, 4), np.float32)  # keys and values interleaved in one buffer: apart, so fine
    npattn.attention_with_kvcache(q, both[:, :, 0], both[:, :, 1], k, v, cache_seqlens=0)
    np.testing.assert_array_equal(both[0, 0, 0], k[0, 0])
    np.testing.assert_array_equal(both[0, 0, 1], v[0, 0])


def test_the_memory_check_runs_before_the_append():
    q = np.ones((1, 4000, 4000, 1), np.float32)
    kc, vc = np.zeros((1, 4096, 1, 1), np.float32), np.zeros((1, 4096, 1, 1), np.float32)
    new = np.ones((1, 1, 1, 1), np.float32)
    with pytest.raises(MemoryError, match="return_weights=True needs"):
        npattn.attention_with_kvcache(q, kc, vc, new, new, cache_seqlens=4095, return_weights=True)
    assert not kc.any() and not vc.any()


@pytest.mark.parametrize("paged", [False, True])  # slots as slices (views), as index arrays (copies)
def test_an_error_after_the_append_puts_the_old_bytes_back(monkeypatch, paged):
    q, k, v, kc, vc = _setup()
    layout = {}
    if paged:  # the same slots as pages of 2: the new key lands on page 1, slot 0
        kc, vc = kc.reshape(4, 2, 1, 4), vc.reshape(4, 2, 1, 4)
        layout = dict(block_table=np.array([[3, 1, 0, 2]]))
    kc[:] = 7.0
    vc[:] = 3.0
    before = _bytes(kc, vc)

    def failing_run(*arguments):
        assert _bytes(kc, vc) != before  # the append has happened by now
        raise MemoryError("out of memory in the kernel")

    monkeypatch.setattr(npattn.api, "run_problem", failing_run)  # the call's own run
    monkeypatch.setattr(npattn.api.Plan, "run_trusted", failing_run)  # a kv-cache plan's later runs
    with pytest.raises(MemoryError, match="out of memory in the kernel"):
        npattn.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=2, **layout)
    assert _bytes(kc, vc) == before
    plan = npattn.plan_with_kvcache(q, kc, vc, k, v, cache_seqlens=2, **layout)
    for _ in range(2):  # the first run checks in Python, later runs in the append's compiled call
        with pytest.raises(MemoryError, match="out of memory in the kernel"):
            plan.run(q, kc, vc, k, v)
        assert _bytes(kc, vc) == before


@pytest.mark.parametrize("broken", ["dtype", "shape", "k without v", "window"])
def test_a_failing_paged_attend_keeps_its_pages_and_lengths(broken):
    q, k, v, _, _ = _setup()
    cache = PagedKVCache(num_pages=4, page_size=2, num_kv_heads=1, head_dim=4)
    cache.add("a")
    two = np.ones((1, 2, 1, 4), np.float32)
    cache.attend(["a"], q[:, :1], two, two)  # page 0 full: the next key needs a new page
    before = (cache.free_pages, cache.block_table(["a"]).tolist(), cache.length("a"), *_bytes(cache.keys, cache.values))
    options = {"dtype": dict(k=k.astype(np.float64), v=v), "shape": dict(k=np.ones((1, 1, 2, 4), np.float32), v=v),
               "k without v": dict(k=np.ones((1, 3, 1, 4), np.float32)), "window": dict(k=k, v=v, window=-2)}[broken]
    with pytest.raises((TypeError, ValueError)):
        cache.attend(["a"], q[:, :1], **options)
    after = (cache.free_pages, cache.block_table(["a"]).tolist(), cache.length("a"), *_bytes(cache.keys, cache.values))
    assert after == before


def test_an_unknown_sequence_is_named_and_both_a_key_and_a_value_error():
    cache = PagedKVCache(num_pages=2, page_size=2, num_kv_heads=1, head_dim=4)
    for error in (KeyError, ValueError):
        with pytest.raises(error, match="no sequence 'b'"):
            cache.attend(["b"], np.zeros((1, 1, 1, 4), np.float32))


# ---- appends silently lost ------------------------------------------------------------------

def test_a_cache_the_call_cannot_write_in_place_is_refused():
    q, k, v, kc, vc = _setup()
    with pytest.raises(TypeError, match="k_cache has non-native byte order"):
        npattn.attention_with_kvcache(q, kc.astype(">f4"), vc.astype(">f4"), k, v, cache_seqlens=0)
    with pytest.raises(TypeError, match="k_cache must be a NumPy or CuPy array to take the new keys in place"):
        npattn.attention_with_kvcache(q, kc.tolist(), vc.tolist(), k, v, cache_seqlens=0)
    # without new keys nothing is written: a big-endian or nested-list cache is read as a copy
    reference = npattn.attention_with_kvcache(q, kc, vc, cache_seqlens=3)
    np.testing.assert_array_equal(npattn.attention_with_kvcache(q, kc.astype(">f4"), vc.astype(">f4"), cache_seqlens=3),
                                  reference)


# ---- silent wrong answers --------------------------------------------------------------------

def test_two_sequences_writing_one_page_or_row_are_refused():
    rng = np.random.default_rng(1)
    q, new = rng.standard_normal((2, 1, 1, 4)).astype(np.float32), rng.standard_normal((2, 1, 1, 4)).astype(np.float32)
    pool = np.zeros((4, 2, 1, 4), np.float32)
    with pytest.raises(ValueError, match="sequences 0 and 1 share page 0"):
        npattn.attention_with_kvcache(q, pool, pool.copy(), new, new, cache_seqlens=[0, 0], block_table=[[0], [0]])
    with pytest.raises(ValueError, match="sequences 0 and 1 share page 0"):  # 0 writes slot 1, which 1 reads
        npattn.attention_with_kvcache(q, pool, pool.copy(), new, new, cache_seqlens=[1, 3],
                                      block_table=[[0, 3], [0, 1]])
    with pytest.raises(ValueError, match=r"block_table\[0\] lists page 2 at columns 1 and 0"):
        npattn.attention_with_kvcache(q[:1], pool, pool.copy(), new[:1], new[:1], cache_seqlens=[2],
                                      block_table=[[2, 2]])
    rows = np.zeros((2, 8, 1, 4), np.float32)
    with pytest.raises(ValueError, match=r"cache_batch_idx gives sequences \[0, 1\] the same cache row 0"):
        npattn.attention_with_kvcache(q, rows, rows.copy(), new, new, cache_seqlens=[0, 0], cache_batch_idx=[0, 0])
    assert not pool.any() and not rows.any()
    # a prefix page both only read, each writing its own page after it: fine, and equal to unshared copies
    pool[0] = rng.standard_normal((2, 1, 4))
    values = pool * 2
    shared = npattn.attention_with_kvcache(q, pool, values, new, new, cache_seqlens=[2, 2],
                                           block_table=[[0, 1], [0, 2]])
    apart = [npattn.attention_with_kvcache(q[b:b + 1], pool.copy(), values.copy(), new[b:b + 1], new[b:b + 1],
                                           cache_seqlens=[2], block_table=[[0, 3]]) for b in range(2)]
    np.testing.assert_array_equal(shared, np.concatenate(apart))
    # a table padded with -1 past the pages a sequence holds
    padded = npattn.attention_with_kvcache(q, pool, values, cache_seqlens=[3, 2], block_table=[[0, 1], [0, -1]])
    assert np.isfinite(padded).all()


def test_varlen_checks_its_options_on_every_path():
    q = np.ones((5, 2, 4), np.float32)
    k = np.ones((6, 1, 4), np.float32)
    cu_q, cu_k = np.array([0, 2, 5]), np.array([0, 3, 6])
    for options, error, message in (
            (dict(q_offset=1.5), TypeError, "q_offset must be an int"),
            (dict(q_offset=2**63), ValueError, r"q_offset must lie in .* 9223372036854775808"),
            (dict(q_offset=np.array([1, 2, 3])), ValueError, r"q_offset as an array must have shape \(B,\) = \(2,\)"),
            (dict(max_seqlen_q="7"), TypeError, "max_seqlen_q must be None or an int"),
            (dict(alibi_slopes=np.ones((3, 2))), ValueError, "alibi_slopes must have shape"),
            (dict(dropout_p=np.array([0.1, 0.2])), TypeError, "dropout_p must be a real number"),
            (dict(window=-1), ValueError, "window must be non-negative")):
        with pytest.raises(error, match=message):
            npattn.attention_varlen(q, k, k, cu_q, cu_k, **options)
    with pytest.raises(ValueError, match="cu_seqlens_q must run from 0 to Tq = 5, got 0 ... 18446744073709551615"):
        npattn.attention_varlen(q, k, k, np.array([0, 2, 2**64 - 1], np.uint64), cu_k)
    with pytest.raises(ValueError, match="window must be non-negative"):  # no sequence to run: still checked
        npattn.attention_varlen(q[:0], k[:0], k[:0], np.array([0]), np.array([0]), window=-1)


def test_integer_limits_are_compared_without_overflow():
    q = np.random.default_rng(2).standard_normal((1, 1, 3, 4)).astype(np.float32)
    with pytest.raises(ValueError, match=r"q_offset\[0\] = -9223372036854775808"):
        npattn.attention(q, q, q, q_offset=np.array([-2**63]), alibi_slopes=[0.5])
    with pytest.raises(ValueError, match=r"q_offset\[0\] = 9223372036854775808"):
        npattn.attention(q, q, q, q_offset=np.array([2**63], np.uint64))
    with pytest.raises(ValueError, match=r"kv_lengths\[0\] = 18446744073709551615"):
        npattn.attention(q, q, q, kv_lengths=np.array([2**64 - 1], np.uint64))
    limit = npattn.core.options.Q_OFFSET_LIMIT
    np.testing.assert_array_equal(npattn.attention(q, q, q, q_offset=np.array([-limit]), alibi_slopes=[0.5]),
                                  npattn.attention(q, q, q, q_offset=-limit, alibi_slopes=[0.5]))
    # a 0-d integer array or a NumPy integer is an int
    np.testing.assert_array_equal(npattn.attention(q, q, q, window=np.array(1), q_offset=np.int8(2)),
                                  npattn.attention(q, q, q, window=1, q_offset=2))


# ---- errors that do not say what is wrong ----------------------------------------------------

@pytest.mark.parametrize("seqlens, message", [
    (2**63, r"cache_seqlens\[0\] \+ 1 new keys = 9223372036854775809 exceeds the cache's 8 keys"),
    (np.array([2**63 - 1]), r"cache_seqlens\[0\] \+ 1 new keys = 9223372036854775808 exceeds"),
    (np.array([2**63], np.uint64), r"cache_seqlens\[0\] \+ 1 new keys = 9223372036854775809 exceeds"),
    (np.array([-2**63]), r"cache_seqlens must be >= 0, got cache_seqlens\[0\] = -9223372036854775808"),
    (np.array([1.0]), "cache_seqlens must be an int or an int array of shape"),
    ("3", "cache_seqlens must be an int or an int array of shape"),
])
def test_cache_seqlens_out_of_range_is_named_as_given(seqlens, message):
    q, k, v, kc, vc = _setup()
    with pytest.raises((ValueError, TypeError), match=message):
        npattn.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens)
    assert not kc.any()


def test_positions_past_the_kernels_limit_name_cache_seqlens():
    limit = npattn.core.options.Q_OFFSET_LIMIT
    pool = np.broadcast_to(np.zeros((1, 1, 1, 1), np.float32), (1, limit, 1, 1))  # read only: no memory
    table = np.zeros((1, 2), np.int64)
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] \+ 0 new keys = 536870917: npattn's kernels count"):
        npattn.attention_with_kvcache(np.ones((1, 1, 1, 1), np.float32), pool, pool, cache_seqlens=limit + 5,
                                      block_table=table)


def test_pools_and_pages_of_impossible_sizes_are_named():
    q, _, _, _, _ = _setup()
    empty_pages = np.zeros((2, 0, 1, 4), np.float32)
    with pytest.raises(ValueError, match="k_cache's page size"):
        npattn.attention_with_kvcache(q, empty_pages, empty_pages, cache_seqlens=0, block_table=[[0]])
    for pages, page_size in ((2**62, 1), (1, 2**63), (2**40, 1)):
        with pytest.raises(MemoryError, match="PagedKVCache: num_pages .* x page_size"):
            PagedKVCache(num_pages=pages, page_size=page_size, num_kv_heads=1, head_dim=4)
    with pytest.raises(MemoryError, match="KVCache: batch 1 x capacity"):
        KVCache(batch=1, num_kv_heads=1, head_dim=4, capacity=2**62)


def test_check_finite_checks_what_the_call_reads():
    q, k, v, kc, vc = _setup()
    kc[0, 5:] = np.nan  # past cache_seqlens: never read
    npattn.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=3, check_finite=True)
    pool = np.zeros((4, 2, 1, 4), np.float32)
    pool[3] = np.inf  # a page no table uses
    npattn.attention_with_kvcache(q, pool, pool.copy(), k, v, cache_seqlens=2, block_table=[[0, 1]],
                                  check_finite=True)
    kc[0, 1, 0, 2] = np.nan
    before = _bytes(kc, vc)
    with pytest.raises(ValueError, match=r"k_cache must be finite where the call reads it .* k_cache\[0, 1, 0, 2\]"):
        npattn.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=3, check_finite=True)
    assert _bytes(kc, vc) == before
    with pytest.raises(ValueError, match=r"v must be finite .* v\[0, 0, 0, 0\] = inf"):
        npattn.attention_with_kvcache(q, kc, vc, k, np.full_like(v, np.inf), cache_seqlens=0, check_finite=True)


def test_torch_options_and_caches_get_named_errors():
    torch = pytest.importorskip("torch")
    q, k, v, kc, vc = (torch.from_numpy(x) for x in _setup())
    kc.requires_grad_(True)
    with pytest.raises(TypeError, match="k_cache requires grad"):
        npattn.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=0)
    with torch.no_grad():  # inference: the cache is written through a view of its memory
        out = npattn.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=0)
    assert isinstance(out, torch.Tensor) and torch.equal(kc.detach()[0, 0], k[0, 0])
    qt = torch.randn(1, 2, 3, 4, requires_grad=True)
    for option, value, message in (("scale", float("inf"), "scale must be finite"),
                                   ("softcap", float("nan"), "softcap must be finite"),
                                   ("window", object(), "window must be a number")):
        with pytest.raises((ValueError, TypeError), match=message):
            npattn.torch.attention(qt, qt, qt, **{option: value})
    expected = npattn.torch.attention(qt, qt, qt, window=1, q_offset=2)
    torch.testing.assert_close(npattn.torch.attention(qt, qt, qt, window=np.array(1), q_offset=torch.tensor(2)),
                               expected, rtol=0, atol=0)
    with pytest.raises(TypeError, match="q_offset must be"):
        npattn.torch.attention(qt, qt, qt, q_offset=torch.tensor([1.5]))


def test_jax_calls_raise_npattns_errors_before_any_callback():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    q = jnp.ones((1, 2, 3, 4), jnp.float32)
    for options, error, message in ((dict(window=-1), ValueError, "window must be non-negative"),
                                    (dict(causal="maybe"), ValueError, "causal must be"),
                                    (dict(scale=float("nan")), ValueError, "scale must be finite"),
                                    (dict(layout="x"), ValueError, "layout must be one of")):
        with pytest.raises(error, match=message):
            npattn.jax.attention(q, q, q, **options)
        with pytest.raises(error, match=message):
            jax.jit(lambda x, o=options: npattn.jax.attention(x, x, x, **o))(q)
    for arrays, error, message in (((q[0], q, q), ValueError, "q must be 4-D"),
                                   ((q.astype(jnp.int32), q, q), TypeError, "q must be a floating-point array"),
                                   ((q, q.astype(jnp.float16), q), TypeError, "k has dtype float16")):
        with pytest.raises(error, match=message):
            npattn.jax.attention(*arrays)
    with pytest.raises(TypeError, match="q_offset must be static under jit"):
        jax.jit(lambda x, o: npattn.jax.attention(x, x, x, q_offset=o))(q, jnp.array([1]))


def test_a_bad_thread_count_fails_small_calls_too(monkeypatch):
    q = np.ones((1, 1, 2, 4), np.float32)
    monkeypatch.setenv("NPATTN_NUM_THREADS", "abc")
    with pytest.raises(ValueError, match="NPATTN_NUM_THREADS must be a positive integer"):
        npattn.attention(q, q, q, backend="cpu")


# ---- found as a new user would -----------------------------------------------------------------

def test_fake_and_real_torch_ops_agree_on_permuted_views():
    """torch.compile's inductor asserts the strides the fake implementations declare: they
    must be what the real ops return, for the usual qkv.view(...).permute(...) views too."""
    torch = pytest.importorskip("torch")
    import npattn.adapters.torch as adapter

    qkv = torch.randn(2, 5, 3, 2, 4, dtype=torch.float64)
    q, k, v = (qkv[:, :, i].permute(0, 2, 1, 3) for i in range(3))  # (B, H, S, D) views, not contiguous
    settings = repr({"causal": True, "return_weights": False})
    arrays = [None] * len(adapter.ARRAY_OPTIONS)
    torch.library.opcheck(torch.ops.npattn.attention_forward.default, (q, k, v, *arrays, settings),
                          test_utils=("test_schema", "test_faketensor"))
    out, lse, _, _ = torch.ops.npattn.attention_forward(q, k, v, *arrays, settings)
    dout = torch.randn_like(out).permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    torch.library.opcheck(torch.ops.npattn.attention_backward.default, (dout, q, k, v, out, lse, *arrays, settings),
                          test_utils=("test_schema", "test_faketensor"))


def test_serving_calls_keep_the_callers_kind_and_torch_autograd():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((5, 2, 4)), rng.standard_normal((6, 1, 4))
    cu_q, cu_k = np.array([0, 2, 5]), np.array([0, 3, 6])
    out, vjp = npattn.attention_varlen_vjp(q, k, k, cu_q, cu_k, causal=True)
    dout = rng.standard_normal(out.shape)
    dq, dk, dv = vjp(dout)
    qt, kt = torch.tensor(q, requires_grad=True), torch.tensor(k, requires_grad=True)
    packed = npattn.attention_varlen(qt, kt, kt, torch.tensor(cu_q), torch.tensor(cu_k), causal=True)
    assert isinstance(packed, torch.Tensor)
    torch.testing.assert_close(packed.detach(), torch.from_numpy(out), rtol=0, atol=0)
    (packed * torch.from_numpy(dout)).sum().backward()
    torch.testing.assert_close(qt.grad, torch.from_numpy(dq), rtol=0, atol=0)
    torch.testing.assert_close(kt.grad, torch.from_numpy(dk + dv), rtol=1e-12, atol=1e-12)
    cache = PagedKVCache(num_pages=4, page_size=2, num_kv_heads=1, head_dim=4)
    cache.add("a")
    new = torch.ones(1, 1, 1, 4)
    assert isinstance(cache.attend(["a"], torch.ones(1, 1, 2, 4), new, new), torch.Tensor)
    kc, vc = torch.zeros(1, 8, 1, 4), torch.zeros(1, 8, 1, 4)
    assert isinstance(npattn.attention_with_kvcache(torch.ones(1, 1, 2, 4), kc, vc, new, new, cache_seqlens=0),
                      torch.Tensor)
    assert torch.equal(kc[0, 0], new[0, 0])


def test_jax_serving_calls_return_jax_arrays_and_differentiate():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    rng = np.random.default_rng(4)
    q, k = rng.standard_normal((5, 2, 4)).astype(np.float32), rng.standard_normal((6, 1, 4)).astype(np.float32)
    cu_q, cu_k = np.array([0, 2, 5]), np.array([0, 3, 6])
    out, vjp = npattn.attention_varlen_vjp(q, k, k, cu_q, cu_k, causal=True)
    dq = vjp(np.ones_like(out))[0]
    packed = npattn.attention_varlen(jnp.asarray(q), jnp.asarray(k), jnp.asarray(k), cu_q, cu_k, causal=True)
    assert isinstance(packed, jax.Array)
    np.testing.assert_array_equal(np.asarray(packed), out)
    grad = jax.jit(jax.grad(lambda x: npattn.attention_varlen(x, jnp.asarray(k), jnp.asarray(k), jnp.asarray(cu_q),
                                                               jnp.asarray(cu_k), causal=True).sum()))(jnp.asarray(q))
    np.testing.assert_array_equal(np.asarray(grad), dq)
    kc = jnp.zeros((1, 8, 1, 4), jnp.float32)
    with pytest.raises(TypeError, match="k_cache is a JAX array, which cannot be written in place"):
        npattn.attention_with_kvcache(jnp.ones((1, 1, 2, 4)), kc, kc, jnp.ones((1, 1, 1, 4)), jnp.ones((1, 1, 1, 4)),
                                      cache_seqlens=0)
    read = npattn.attention_with_kvcache(jnp.ones((1, 1, 2, 4)), kc, kc, cache_seqlens=3)
    assert isinstance(read, jax.Array)


@pytest.mark.parametrize("name, equivalent", [("softmax_scale", "scale="), ("attn_mask", "mask= for a boolean mask"),
                                              ("is_causal", 'causal="top_left"'), ("window_size", "window=(left"),
                                              ("return_softmax_lse", "return_lse=True"),
                                              ("cache_leftpad", "kv_start=")])
def test_other_libraries_keywords_name_npattns_equivalent(name, equivalent):
    q = np.ones((1, 1, 2, 4), np.float32)
    with pytest.raises(TypeError, match=re.escape(f"unknown option '{name}': npattn's equivalent is {equivalent}")):
        npattn.attention(q, q, q, **{name: 0.1})


def test_the_framework_adapters_are_attributes_of_npattn():
    code = ("import sys, npattn; assert 'torch' not in sys.modules and 'jax' not in sys.modules; "
            "print(npattn.torch.attention.__module__, npattn.jax.attention.__module__)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if "No module named" in result.stderr:
        pytest.skip("torch or JAX is not installed")
    assert result.stdout.split() == ["npattn.adapters.torch", "npattn.adapters.jax"], result.stderr
    with pytest.raises(AttributeError, match="module 'npattn' has no attribute 'tensorflow'"):
        npattn.tensorflow  # noqa: B018


def test_python_m_npattn_runs_from_the_folder_above_a_clone_named_npattn(tmp_path):
    clone = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    (tmp_path / "npattn").symlink_to(clone, target_is_directory=True)
    result = subprocess.run([sys.executable, "-m", "npattn", "--version"], capture_output=True, text=True,
                            cwd=tmp_path, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == f"npattn {npattn.__version__}", result.stderr


def test_a_first_call_that_compiles_says_so(monkeypatch, caplog, capsys):
    from npattn.cpu import compiling, threads

    monkeypatch.setattr(threads, "_PREPARED", set())
    monkeypatch.setattr(compiling, "_noted", False)
    monkeypatch.setattr(compiling, "NOTE_SECONDS", -1.0)  # any first call counts as slow here
    q = np.ones((1, 1, 2, 4), np.float32)
    with caplog.at_level(logging.INFO, logger="npattn"):
        npattn.attention(q, q, q, backend="cpu")
        npattn.attention(q, q, q, backend="cpu")
    lines = [record.getMessage() for record in caplog.records if "forward_kernel" in record.getMessage()]
    assert len(lines) == 2 and "npattn.warmup()" in lines[0], lines  # one before, one with the time
    note = capsys.readouterr().err
    assert note.count("npattn: compiled the CPU kernel") == 1 and "python -m npattn compile" in note
    monkeypatch.setattr(threads, "_PREPARED", set())
    npattn.warmup(("float32",))  # asked for: quiet
    assert "compiled" not in capsys.readouterr().err
