"""The attention modules against a composition of reference calls, their gradients, and
rotary embeddings' dependence on relative position only."""
import numpy as np
import pytest

import npattn
from npattn.autograd import Tensor
from npattn.nn import GroupedQueryAttention, MultiHeadAttention, MultiQueryAttention, SlidingWindowAttention
from npattn.nn.rotary import apply_rope
from module_checks import assert_same_composition, gradcheck_module

RNG = np.random.default_rng(11)
B, SQ, SK, E, H = 2, 5, 7, 16, 4
# the longest chain of summed terms: input projection, scores, weighted values, output projection
CHAIN = 2 * E + E // H + 11  # (up to 11 keys)


def expected_output(module, query, key, value, *, key_padding_mask=None, attn_mask=None, bias=None,
                    causal=None):
    """The module's computation written out in NumPy around npattn's reference attention."""
    p = {name: t.data for name, t in module.named_parameters()}

    def project(name, x, heads):
        y = x @ p[f"{name}.weight"].T + p.get(f"{name}.bias", 0.0)
        if module.clip_qkv is not None:
            y = np.clip(y, -module.clip_qkv, module.clip_qkv)
        return y.reshape(x.shape[0], x.shape[1], heads, module.head_dim)

    q = project("q_proj", query, module.num_heads)
    k = project("k_proj", key, module.num_kv_heads)
    v = project("v_proj", value, module.num_kv_heads)
    if module.qk_norm == "rmsnorm":
        rms = lambda x, w: x / np.sqrt((x * x).mean(-1, keepdims=True) + np.finfo(x.dtype).eps) * w
        q, k = rms(q, p["q_norm.weight"]), rms(k, p["k_norm.weight"])
    if module.rotary == "rope":
        def rope(x, positions):
            half = x.shape[-1] // 2
            frequency = 10000.0 ** (-np.arange(half) * 2.0 / x.shape[-1])
            angle = positions[:, None] * frequency
            cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
            x1, x2 = x[..., :half], x[..., half:]
            return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        q_len, kv_len = q.shape[1], k.shape[1]
        q, k = rope(q, np.arange(kv_len - q_len, kv_len)), rope(k, np.arange(kv_len))
    mask = None
    if key_padding_mask is not None:
        mask = ~key_padding_mask[:, None, None, :]
    if attn_mask is not None and attn_mask.dtype == bool:
        mask = attn_mask if mask is None else mask & attn_mask
    elif attn_mask is not None:
        bias = attn_mask if bias is None else bias + attn_mask
    out, weights = npattn.attention(
        q, k, v, causal=module.causal if causal is None else causal, window=module.window, sinks=module.sinks,
        mask=mask, bias=bias, scale=module.softmax_scale, layout="bshd", return_weights=True,
        sink_logits=p.get("sink_logits"), backend="reference")
    out = out.reshape(query.shape[0], query.shape[1], E)
    if module.subln:
        mean = out.mean(-1, keepdims=True)
        out = (out - mean) / np.sqrt(((out - mean) ** 2).mean(-1, keepdims=True) + 1e-5)
        out = out * p["inner_attn_ln.weight"] + p["inner_attn_ln.bias"]
    return out @ p["out_proj.weight"].T + p["out_proj.bias"], weights


CONFIGS = {
    "mha": dict(),
    "gqa-causal-rope": dict(num_kv_heads=2, causal=True, rotary="rope"),
    "mqa-window-sinks": dict(num_kv_heads=1, causal=True, window=2, sinks=1),
    "qk-rmsnorm-clip-scale-subln": dict(qk_norm="rmsnorm", clip_qkv=0.8, softmax_scale=0.2, subln=True),
    "sink-logits": dict(sink_logits=True),
}


@pytest.mark.parametrize("options", list(CONFIGS.values()), ids=list(CONFIGS))
def test_self_attention_equals_its_composition(options):
    module = MultiHeadAttention(E, H, dtype="float64", seed=0, **options)
    if module.sink_logits is not None:
        module.sink_logits.data[...] = RNG.standard_normal(H)
    x = RNG.standard_normal((B, SQ, E))
    out, weights = module(x, need_weights=True, average_attn_weights=False)
    expected, expected_weights = expected_output(module, x, x, x)
    assert_same_composition(out, expected, CHAIN, "out")
    assert_same_composition(weights, expected_weights, CHAIN, "weights")


def test_cross_attention_with_kdim_vdim_padding_and_masks():
    module = MultiHeadAttention(E, H, kdim=6, vdim=3, num_kv_heads=2, dtype="float64", seed=1)
    query, key, value = RNG.standard_normal((B, SQ, E)), RNG.standard_normal((B, SK, 6)), RNG.standard_normal((B, SK, 3))
    padding = np.zeros((B, SK), bool)
    padding[1, 4:] = True
    allowed = RNG.random((SQ, SK)) > 0.2
    float_mask = RNG.standard_normal((1, H, SQ, SK))
    for attn_mask in (allowed, float_mask):
        out, weights = module(query, key, value, key_padding_mask=padding, attn_mask=attn_mask, causal=True,
                              need_weights=True)
        expected, expected_weights = expected_output(module, query, key, value, key_padding_mask=padding,
                                                     attn_mask=attn_mask, causal=True)
        assert_same_composition(out, expected, CHAIN, "out")
        assert_same_composition(weights, expected_weights.mean(axis=1), CHAIN, "weights")
    assert np.all(weights.data[1, :, 4:] == 0)  # padded keys get no weight


@pytest.mark.parametrize("options", [dict(), dict(num_kv_heads=2, causal=True, rotary="rope", qk_norm="layernorm"),
                                     dict(subln=True, clip_qkv=5.0, sink_logits=True, window=1, sinks=1),
                                     dict(num_kv_heads=1, rotary="xpos", qk_norm="rmsnorm", softmax_scale=0.4,
                                          multiway=True)],
                         ids=["mha", "gqa-rope-layernorm", "subln-clip-sinks", "mqa-xpos-rmsnorm-scale-multiway"])
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_module_gradients(options, backend):
    module = MultiHeadAttention(8, 2, dtype="float64", seed=2, backend=backend, **options)
    x = Tensor(RNG.standard_normal((2, 4, 8)), requires_grad=True)
    gradcheck_module(module, x, key_padding_mask=np.array([[False] * 4, [False, False, False, True]]))


def test_dropout_only_in_training_and_seeded():
    module = MultiHeadAttention(E, H, dropout=0.5, seed=3)
    twin = MultiHeadAttention(E, H, dropout=0.5, seed=3)
    x = RNG.standard_normal((B, SQ, E)).astype(np.float32)
    np.testing.assert_array_equal(module(x).data, twin(x).data)  # same seed, same masks
    assert not np.array_equal(module(x).data, module(x).data)
    module.eval()
    np.testing.assert_array_equal(module(x).data, module(x).data)


def test_variants_set_their_heads_and_windows():
    assert MultiQueryAttention(E, H).num_kv_heads == 1
    gqa = GroupedQueryAttention(E, H, 2)
    assert gqa.num_kv_heads == 2 and gqa.k_proj.weight.shape == (2 * E // H, E)
    assert SlidingWindowAttention(E, H, 5).window == 2
    assert SlidingWindowAttention(E, H, 5, causal=True).window == (4, 0)


def test_sliding_window_attends_to_its_band():
    module = SlidingWindowAttention(E, H, 3, dtype="float64", seed=4)
    x = RNG.standard_normal((1, 6, E))
    _, weights = module(x, need_weights=True)
    band = np.abs(np.subtract.outer(np.arange(6), np.arange(6))) <= 1
    assert np.all(weights.data[0][~band] == 0) and np.all(weights.data[0][band] > 0)


def test_rope_scores_depend_only_on_relative_position():
    q, k = RNG.standard_normal((1, 1, 1, 8)), RNG.standard_normal((1, 1, 1, 8))
    def score(m, n):
        return float((apply_rope(Tensor(q), np.array([m])).data * apply_rope(Tensor(k), np.array([n])).data).sum())
    assert_same_composition(score(3, 1), score(10, 8), 8, "relative score")  # 8 rotated lanes
    assert_same_composition(score(0, 0), float((q * k).sum()), 8, "unrotated score")
    assert score(3, 1) != pytest.approx(score(3, 2))


def test_bad_configurations_are_named():
    with pytest.raises(ValueError, match="embed_dim must be divisible by num_heads"):
        MultiHeadAttention(10, 4)
    with pytest.raises(ValueError, match="num_kv_heads must divide num_heads"):
        MultiHeadAttention(16, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match="qk_norm"):
        MultiHeadAttention(16, 4, qk_norm="batchnorm")
    with pytest.raises(ValueError, match="key_padding_mask must be bool of shape"):
        MultiHeadAttention(16, 4)(np.ones((2, 3, 16), np.float32), key_padding_mask=np.ones((2, 4), bool))


# ----- decoding with a KVCache -----------------------------------------------------------------

def decode(module, x, cache, chunks):
    """Feed x (B, S, E) through ``module`` with ``cache`` in chunks of the given sizes."""
    outputs, start = [], 0
    for size in chunks:
        outputs.append(module(x[:, start:start + size], cache=cache).data)
        start += size
    return np.concatenate(outputs, axis=1)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("chunks", [[1] * 9, [4, 1, 1, 3], [9]], ids=["tokens", "mixed", "prefill"])
def test_decoding_equals_the_full_causal_pass_gqa_rope(chunks, backend):
    from npattn.nn import KVCache

    module = GroupedQueryAttention(E, H, 2, causal=True, rotary="rope", dtype="float64", seed=5, backend=backend)
    x = RNG.standard_normal((B, 9, E))
    cache = KVCache(B, 2, E // H, capacity=12, dtype="float64")
    assert_same_composition(decode(module, x, cache, chunks), module(x), CHAIN, "decoded")
    assert cache.position == 9 and cache.length == 9


@pytest.mark.parametrize("chunks", [[1] * 11, [5, 1, 2, 3], [11]], ids=["tokens", "mixed", "prefill"])
def test_rolling_cache_with_window_and_sinks_equals_the_full_pass(chunks):
    from npattn.nn import KVCache

    module = SlidingWindowAttention(E, H, 4, causal=True, sinks=2, rotary="rope", dtype="float64", seed=6)
    x = RNG.standard_normal((B, 11, E))
    cache = KVCache(B, H, E // H, capacity=5, dtype="float64", window=3, sinks=2)  # 2 sinks + 3 past keys
    assert_same_composition(decode(module, x, cache, chunks), module(x), CHAIN, "decoded")
    assert cache.length == 5 and cache.keys.shape[1] == 5  # never more than sinks + window


def test_cache_errors_are_named():
    from npattn.nn import KVCache

    module = MultiHeadAttention(E, H, causal=True)
    x = np.zeros((B, 3, E), np.float32)
    with pytest.raises(ValueError, match="capacity 4 cannot take 3 more positions after 3"):
        cache = KVCache(B, H, E // H, capacity=4)
        module(x, cache=cache)
        module(x, cache=cache)
    with pytest.raises(ValueError, match=r"holds \(batch, kv heads, head dim\) \(2, 2, 4\)"):
        module(x, cache=KVCache(B, 2, E // H, capacity=8))
    with pytest.raises(ValueError, match="rolling KVCache needs the module's causal window"):
        module(x, cache=KVCache(B, H, E // H, capacity=8, window=3))
    with pytest.raises(ValueError, match="self-attention only"):
        module(x, x, cache=KVCache(B, H, E // H, capacity=8))
    with pytest.raises(ValueError, match="capacity must be at least sinks \\+ window = 5"):
        KVCache(B, H, E // H, capacity=4, window=3, sinks=2)


@pytest.mark.parametrize("kind, kv_heads", [(MultiHeadAttention, H), (GroupedQueryAttention, 2),
                                            (MultiQueryAttention, 1)])
def test_parameter_and_cache_sizes_match_their_formulas(kind, kv_heads):
    module = kind(E, H, 2) if kind is GroupedQueryAttention else kind(E, H)
    head_dim = E // H
    # q and out: E x E + E each; k and v: E x (Hkv D) + Hkv D each
    assert module.num_parameters() == 2 * (E * E + E) + 2 * (E * kv_heads * head_dim + kv_heads * head_dim)
    assert module.kv_cache_bytes(3, 100) == 2 * 3 * 100 * kv_heads * head_dim * 4
    from npattn.nn import KVCache
    assert KVCache(3, kv_heads, head_dim, 100).nbytes() == module.kv_cache_bytes(3, 100)
    windowed = SlidingWindowAttention(E, H, 8, causal=True, sinks=4)
    assert windowed.kv_cache_bytes(1, 1000) == 2 * (4 + 7) * H * head_dim * 4


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_cross_attention_gradients_with_masks_and_dropout(backend):
    module = MultiHeadAttention(8, 2, kdim=3, vdim=5, dropout=0.3, dtype="float64", seed=4, backend=backend)
    module._dropout_rng = _SameSeed()  # one dropout mask for every evaluation of gradcheck
    query = Tensor(RNG.standard_normal((2, 3, 8)), requires_grad=True)
    key = Tensor(RNG.standard_normal((2, 4, 3)), requires_grad=True)
    value = Tensor(RNG.standard_normal((2, 4, 5)), requires_grad=True)
    gradcheck_module(module, query, key, value, attn_mask=RNG.standard_normal((3, 4)),
                     bias=Tensor(RNG.standard_normal((1, 2, 1, 4))))


class _SameSeed:
    def integers(self, high):
        return 12345
