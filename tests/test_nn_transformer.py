"""Transformer layers: their wiring, gradients and cached decoding; get_attention."""
import numpy as np
import pytest

from npattn.autograd import Tensor
from npattn.nn import (GroupedQueryAttention, KVCache, SlidingWindowAttention, TransformerDecoderLayer,
                       TransformerEncoderLayer, get_attention)
from module_checks import assert_same_composition, gradcheck_module

RNG = np.random.default_rng(13)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_encoder_layer_wiring(norm_first):
    layer = TransformerEncoderLayer(8, 2, 16, dropout=0.0, activation="gelu", norm_first=norm_first,
                                    dtype="float64", seed=0)
    x = RNG.standard_normal((2, 5, 8))
    attend = lambda h: layer.self_attn(h).data
    feed = lambda h: layer.mlp(h).data
    n1, n2 = (lambda h: layer.norm1(h).data), (lambda h: layer.norm2(h).data)
    if norm_first:
        h = x + attend(n1(x))
        expected = h + feed(n2(h))
    else:
        h = n1(x + attend(x))
        expected = n2(h + feed(h))
    assert_same_composition(layer(x), expected, 4 * 8 + 2 * 16 + 5, "layer")  # same ops, same order
    names = [name for name, _ in layer.named_parameters()]
    assert names[:2] == ["self_attn.q_proj.weight", "self_attn.q_proj.bias"] and "norm2.bias" in names


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_layer_gradients(norm_first):
    encoder = TransformerEncoderLayer(4, 2, 6, dropout=0.0, norm_first=norm_first, dtype="float64", seed=1,
                                      num_kv_heads=1, rotary="rope")
    gradcheck_module(encoder, Tensor(RNG.standard_normal((2, 3, 4)), requires_grad=True),
                     key_padding_mask=np.array([[False, False, True], [False, False, False]]))
    decoder = TransformerDecoderLayer(4, 2, 6, dropout=0.0, norm_first=norm_first, dtype="float64", seed=2)
    memory = Tensor(RNG.standard_normal((2, 5, 4)), requires_grad=True)
    gradcheck_module(decoder, Tensor(RNG.standard_normal((2, 3, 4)), requires_grad=True), memory)


def test_decoder_decoding_with_a_cache_equals_the_full_pass():
    decoder = TransformerDecoderLayer(8, 2, 16, dropout=0.0, norm_first=True, dtype="float64", seed=3,
                                      num_kv_heads=1, rotary="rope")
    x, memory = RNG.standard_normal((2, 6, 8)), RNG.standard_normal((2, 4, 8))
    cache = KVCache(2, 1, 4, capacity=6, dtype="float64")
    steps = [decoder(x[:, i:i + 1], memory, cache=cache).data for i in range(6)]
    chain = 8 * 8 + 2 * 16 + 6 + 4  # eight projections, two MLP sums, self and cross keys
    assert_same_composition(np.concatenate(steps, axis=1), decoder(x, memory), chain, "decoded")


def test_get_attention_builds_each_kind():
    assert isinstance(get_attention("gqa", embed_dim=8, num_heads=4, num_groups=2), GroupedQueryAttention)
    assert get_attention("mqa", embed_dim=8, num_heads=4).num_kv_heads == 1
    assert isinstance(get_attention("swa", embed_dim=8, num_heads=2, window_size=3), SlidingWindowAttention)
    assert get_attention("mha", embed_dim=8, num_heads=2, causal=True).causal
    with pytest.raises(ValueError, match="get_attention: kind must be one of"):
        get_attention("linear", embed_dim=8, num_heads=2)


@pytest.mark.parametrize("kind", ["encoder", "encoder-rope-gqa-dropout", "decoder"])
def test_float32_layers_train_in_float32(monkeypatch, kind):
    """A float32 layer's forward, and its backward from a float32 loss, stay float32: every
    gradient comes back float32 from the function that made it, none cast by the engine
    (a float64 gradient had made every gradient behind it float64, at twice the time)."""
    from npattn import autograd as ag
    from npattn.autograd import tensor as tensor_module

    casts, real = [], tensor_module.in_dtype
    monkeypatch.setattr(tensor_module, "in_dtype", lambda grad, dtype: grad if grad.dtype == dtype
                        else casts.append(grad.dtype) or real(grad, dtype))
    x = Tensor(RNG.standard_normal((2, 5, 16)).astype(np.float32), requires_grad=True)
    if kind == "decoder":
        layer = TransformerDecoderLayer(16, 4, 32, dropout=0.1, seed=3)
        memory = Tensor(RNG.standard_normal((2, 7, 16)).astype(np.float32), requires_grad=True)
        out, inputs = layer(x, memory), [x, memory]
    else:
        options = dict(num_kv_heads=2, rotary="rope", dropout=0.1) if kind != "encoder" else dict(dropout=0.0)
        layer = TransformerEncoderLayer(16, 4, 32, activation="gelu", norm_first=True, seed=3, **options)
        out, inputs = layer(x), [x]
    logits = ag.linear(out, Tensor(RNG.standard_normal((10, 16)).astype(np.float32)))
    ag.cross_entropy(logits.reshape(-1, 10), RNG.integers(0, 10, logits.shape[0] * logits.shape[1])).backward()
    assert casts == [] and out.dtype == np.float32
    grads = [x.grad for x in inputs] + [p.grad for p in layer.parameters()]
    assert all(g is not None and g.dtype == np.float32 for g in grads)
