"""npattn.compat: FlashAttention 2's and torch SDPA's calls, with their names, defaults and
layouts. SDPA is held to torch's own function; the FlashAttention names to the semantics
FlashAttention's documentation states (written out below as a materialized float64
formula), and to each other (varlen per sequence, the kv-cache call on concatenated keys)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import npattn
from npattn import compat
import tolerances


def flash_semantics(q, k, v, causal=False, window=(-1, -1), scale=None, softcap=0.0, alibi=None):
    """FlashAttention 2's documented attention, float64: q (B, Sq, H, D), k, v (B, Sk, Hkv, D).
    Row i sits at key position i + Sk - Sq (bottom-right); a window keeps keys in
    [i + Sk - Sq - left, i + Sk - Sq + right] (-1: unbounded); ALiBi adds
    -slope * |i + Sk - Sq - j|; softcap s -> softcap * tanh(s / softcap) (before ALiBi)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, q_len, heads, dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    k, v = (np.repeat(x, heads // kv_heads, axis=2) for x in (k, v))
    scale = 1 / math.sqrt(dim) if scale is None else scale
    s = np.einsum("bihd,bjhd->bhij", q, k) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    position = np.arange(q_len)[:, None] + kv_len - q_len
    key = np.arange(kv_len)[None, :]
    if alibi is not None:
        slopes = np.broadcast_to(np.asarray(alibi, np.float64), (batch, heads))
        s = s - slopes[:, :, None, None] * np.abs(position - key)
    left, right = window
    if causal:
        right = 0
    visible = np.ones((q_len, kv_len), bool)
    if left >= 0:
        visible &= key >= position - left
    if right >= 0:
        visible &= key <= position + right
    s = np.where(visible, s, -np.inf)
    top = s.max(axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(top), top, 0))
    total = e.sum(axis=-1, keepdims=True)
    p = np.where(total > 0, e / np.where(total > 0, total, 1), 0)
    return np.einsum("bhij,bjhd->bihd", p, v)


def _close(actual, expected, length, magnitude=1.0, dtype=np.float32):
    tolerances.assert_close(actual, expected, dtype, length, magnitude)


@given(batch=st.integers(1, 2), q_len=st.integers(1, 9), kv_len=st.integers(1, 9), kv_heads=st.integers(1, 2),
       group=st.integers(1, 2), causal=st.booleans(), window=st.sampled_from([(-1, -1), (2, -1), (-1, 1), (1, 3)]),
       softcap=st.sampled_from([0.0, 3.0]), alibi=st.booleans(), scale=st.sampled_from([None, 0.4]),
       seed=st.integers(0, 2**32 - 1))
def test_flash_attn_func_follows_flash_attentions_documented_semantics(batch, q_len, kv_len, kv_heads, group, causal,
                                                                       window, softcap, alibi, scale, seed):
    rng = np.random.default_rng(seed)
    heads, dim = kv_heads * group, 8
    q = rng.standard_normal((batch, q_len, heads, dim)).astype(np.float32)
    k, v = (rng.standard_normal((batch, kv_len, kv_heads, dim)).astype(np.float32) for _ in range(2))
    slopes = rng.uniform(0.1, 1.0, heads) if alibi else None
    out = compat.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, window_size=window, softcap=softcap,
                                 alibi_slopes=slopes)
    expected = flash_semantics(q, k, v, causal, window, scale, softcap, slopes)
    score = (scale or 1 / math.sqrt(dim)) * dim * np.abs(q).max() * np.abs(k).max()
    _close(out, expected, kv_len + dim, np.abs(v).max() * (1 + score))
    assert out.shape == q.shape and out.dtype == np.float32
    out2, lse, probs = compat.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert lse.shape == (batch, heads, q_len) and probs.shape == (batch, heads, q_len, kv_len)
    np.testing.assert_array_equal(out2, compat.flash_attn_func(q, k, v, causal=causal))


@given(lengths=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7)), min_size=1, max_size=4),
       causal=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_flash_attn_varlen_func_is_flash_attn_func_per_sequence(lengths, causal, seed):
    rng = np.random.default_rng(seed)
    cu_q = np.r_[0, np.cumsum([a for a, _ in lengths])].astype(np.int32)
    cu_k = np.r_[0, np.cumsum([b for _, b in lengths])].astype(np.int32)
    q = rng.standard_normal((int(cu_q[-1]), 4, 8)).astype(np.float32)
    k, v = (rng.standard_normal((int(cu_k[-1]), 2, 8)).astype(np.float32) for _ in range(2))
    out, lse, none = compat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(a for a, _ in lengths),
                                                   max(b for _, b in lengths), causal=causal, window_size=(3, -1),
                                                   return_attn_probs=True)
    assert none is None and lse.shape == (4, q.shape[0])
    for b in range(len(lengths)):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if q1 == q0:
            continue
        alone = compat.flash_attn_func(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=causal,
                                       window_size=(3, -1))
        _close(out[q0:q1], alone[0], 16, 10.0)
    with pytest.raises(TypeError, match="block_table .* not supported yet"):
        compat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 7, block_table=np.zeros((1, 1), np.int32))


def test_flash_attn_with_kvcache_appends_rotates_interleaved_and_defaults_to_full_caches():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 1, 4, 8)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((2, 1, 2, 8)).astype(np.float32) for _ in range(2))
    k_cache, v_cache = (rng.standard_normal((2, 12, 2, 8)).astype(np.float32) for _ in range(2))
    cos, sin = np.cos(np.outer(np.arange(16), [1.0, 0.1])), np.sin(np.outer(np.arange(16), [1.0, 0.1]))
    seqlens = np.array([5, 9], np.int32)
    kc, vc = k_cache.copy(), v_cache.copy()
    out = compat.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                         cache_seqlens=seqlens, causal=True)
    expected = npattn.attention_with_kvcache(q, k_cache.copy(), v_cache.copy(), k_new, v_new, cache_seqlens=seqlens,
                                             rotary_cos=cos, rotary_sin=sin, rotary_interleaved=True, causal=True)
    np.testing.assert_array_equal(out, expected)
    for b, n in enumerate(seqlens):  # the new value appended (values are not rotated)
        np.testing.assert_array_equal(vc[b, n], v_new[b, 0])
    full = compat.flash_attn_with_kvcache(q, k_cache, v_cache)  # cache_seqlens None: all 12 keys
    np.testing.assert_allclose(full, flash_semantics(q, k_cache, v_cache), rtol=0,
                               atol=tolerances.attention_bounds(np.float32, q, k_cache, v_cache, 12)[0])
    with pytest.raises(ValueError, match="need cache_seqlens"):
        compat.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new)


def _sdpa_cases():
    return st.fixed_dictionaries({
        "ndim": st.sampled_from([2, 3, 4]), "batch": st.integers(1, 2), "heads": st.integers(1, 2),
        "group": st.integers(1, 2), "q_len": st.integers(1, 7), "kv_len": st.integers(1, 7),
        "mask": st.sampled_from([None, "bool", "float", "bool_2d"]), "causal": st.booleans(),
        "scale": st.sampled_from([None, 0.3]), "seed": st.integers(0, 2**32 - 1)})


@given(case=_sdpa_cases())
def test_scaled_dot_product_attention_matches_torch(case):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    rng = np.random.default_rng(case["seed"])
    batch, heads, q_len, kv_len, dim = case["batch"], case["heads"], case["q_len"], case["kv_len"], 8
    ndim, gqa = case["ndim"], case["ndim"] == 4 and case["group"] > 1
    q_heads = heads * (case["group"] if gqa else 1)
    lead_q = {2: (), 3: (batch,), 4: (batch, q_heads)}[ndim]
    lead_k = {2: (), 3: (batch,), 4: (batch, heads)}[ndim]
    q = rng.standard_normal((*lead_q, q_len, dim)).astype(np.float32)
    k, v = (rng.standard_normal((*lead_k, kv_len, dim)).astype(np.float32) for _ in range(2))
    mask, causal = None, case["causal"] and case["mask"] is None
    if case["mask"] in ("bool", "bool_2d"):
        shape = (q_len, kv_len) if case["mask"] == "bool_2d" else (*lead_q, q_len, kv_len)
        mask = rng.random(shape) < 0.7
        mask[..., 0] = True  # every row sees a key: torch's math path gives NaN for a row that sees none
    elif case["mask"] == "float":
        mask = rng.standard_normal((*lead_q, q_len, kv_len)).astype(np.float32)
    options = dict(attn_mask=mask, is_causal=causal, scale=case["scale"], enable_gqa=gqa)
    out = compat.scaled_dot_product_attention(q, k, v, **options)
    tensors = [torch.from_numpy(x) for x in (q, k, v)]
    t_options = dict(options, attn_mask=None if mask is None else torch.from_numpy(mask))
    expected = F.scaled_dot_product_attention(*tensors, **t_options).numpy()
    assert type(out) is np.ndarray and out.shape == expected.shape
    bias = mask if case["mask"] == "float" else None
    # two float32 kernels, each within the bound of the float64 answer
    np.testing.assert_allclose(out, expected, rtol=0, atol=2 * tolerances.attention_bounds(
        np.float32, q, k, v, kv_len, case["scale"], bias)[0])
    through_torch = compat.scaled_dot_product_attention(*tensors, **t_options)
    assert isinstance(through_torch, torch.Tensor)
    np.testing.assert_array_equal(through_torch.numpy(), out)


def test_sdpa_refuses_what_torch_refuses():
    q = np.ones((1, 2, 3, 4), np.float32)
    with pytest.raises(ValueError, match="attn_mask and is_causal cannot both be set"):
        compat.scaled_dot_product_attention(q, q, q, attn_mask=np.ones((3, 3), bool), is_causal=True)
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        compat.scaled_dot_product_attention(q, q[:, :1], q[:, :1])
    with pytest.raises(ValueError, match="must all be 2-D"):
        compat.scaled_dot_product_attention(q[None], q[None], q[None])


def test_flash_argument_errors_are_named():
    q = np.ones((1, 3, 2, 4), np.float32)
    with pytest.raises(TypeError, match="window_size must be a pair"):
        compat.flash_attn_func(q, q, q, window_size=3)
    with pytest.raises(ValueError, match="window_size left must be an int >= -1"):
        compat.flash_attn_func(q, q, q, window_size=(-2, 0))
    with pytest.raises(TypeError, match="causal must be a bool"):
        compat.flash_attn_func(q, q, q, causal="yes")


def test_the_flash_names_keep_the_callers_array_kind():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 5, 4, 8)).astype(np.float32)
    k, v = (rng.standard_normal((1, 7, 2, 8)).astype(np.float32) for _ in range(2))
    out = compat.flash_attn_func(*(torch.from_numpy(x) for x in (q, k, v)), causal=True)
    assert isinstance(out, torch.Tensor)
    np.testing.assert_array_equal(out.numpy(), compat.flash_attn_func(q, k, v, causal=True))
    jnp = pytest.importorskip("jax.numpy")
    out = compat.flash_attn_func(*(jnp.asarray(x) for x in (q, k, v)), causal=True)
    assert type(out).__module__.startswith("jax")
    np.testing.assert_array_equal(np.asarray(out), compat.flash_attn_func(q, k, v, causal=True))
