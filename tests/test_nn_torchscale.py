"""torchscale's options: XPOS against a NumPy transcription of its steps (fixed_pos_embedding,
duplicate_interleave, rotate_every_two), decoding with it, and multiway projections."""
import numpy as np
import pytest

import npattn
from npattn.autograd import Tensor
from npattn.nn import KVCache, MultiHeadAttention
from npattn.nn.rotary import apply_xpos
from module_checks import assert_same_composition, gradcheck_module

RNG = np.random.default_rng(29)


def torchscale_xpos(x, offset=0, downscale=False, scale_base=512):
    """x (B*H, L, D) as torchscale's XPOS.forward computes it, step by step."""
    length, head_dim = x.shape[1], x.shape[2]
    scale_vector = (np.arange(0, head_dim, 2) + 0.4 * head_dim) / (1.4 * head_dim)
    min_pos = -(length + offset) // 2
    max_pos = length + offset + min_pos
    scale = scale_vector ** (np.arange(min_pos, max_pos, 1) / scale_base)[:, None]
    seq_len, dim = scale.shape
    inverse_frequency = 1.0 / (10000 ** (np.arange(0, dim) / dim))
    sinusoid = np.einsum("i,j->ij", np.arange(0, seq_len, dtype=float), inverse_frequency)
    sin, cos = np.sin(sinusoid), np.cos(sinusoid)
    if scale.shape[0] > length:
        scale, sin, cos = scale[-length:], sin[-length:], cos[-length:]
    if downscale:
        scale = 1 / scale
    sin, cos = (np.repeat((t * scale).reshape(-1, 1), 2, axis=1).reshape(t.shape[0], -1) for t in (sin, cos))
    rotated = np.stack((-x[:, :, 1::2], x[:, :, ::2]), axis=-1).reshape(x.shape)
    return x * cos + rotated * sin


@pytest.mark.parametrize("offset, downscale", [(0, False), (0, True), (6, False), (7, False)])
def test_xpos_equals_torchscale(offset, downscale):
    x = RNG.standard_normal((2, 5, 3, 8))  # (B, S, H, D)
    ours = apply_xpos(Tensor(x), offset, downscale, scale_base=64).data
    flat = x.transpose(0, 2, 1, 3).reshape(6, 5, 8)
    theirs = torchscale_xpos(flat, offset, downscale, scale_base=64).reshape(2, 3, 5, 8).transpose(0, 2, 1, 3)
    assert_same_composition(ours, theirs, 8, "xpos")  # a few products per element; pow and trig of 8 lanes


def test_xpos_scores_depend_on_relative_position_and_decay():
    q, k = RNG.standard_normal((1, 1, 1, 8)), RNG.standard_normal((1, 1, 1, 8))
    qs = apply_xpos(Tensor(np.repeat(q, 12, axis=1)), scale_base=16).data
    ks = apply_xpos(Tensor(np.repeat(k, 12, axis=1)), downscale=True, scale_base=16).data
    score = lambda m, n: float((qs[0, m, 0] * ks[0, n, 0]).sum())
    assert_same_composition(score(5, 2), score(9, 6), 8, "relative score")  # 8 rotated, scaled lanes
    assert_same_composition(score(3, 3), float((q * k).sum()), 8, "same-position score")


@pytest.mark.parametrize("chunks", [[1] * 7, [3, 1, 3]], ids=["tokens", "mixed"])
def test_xpos_decoding_equals_the_full_pass(chunks):
    module = MultiHeadAttention(16, 2, causal=True, rotary="xpos", xpos_scale_base=32, dtype="float64", seed=7)
    x = RNG.standard_normal((2, 7, 16))
    cache = KVCache(2, 2, 8, capacity=7, dtype="float64")
    outputs, start = [], 0
    for size in chunks:
        outputs.append(module(x[:, start:start + size], cache=cache).data)
        start += size
    assert_same_composition(np.concatenate(outputs, axis=1), module(x), 2 * 16 + 8 + 7, "decoded")
    windowed = MultiHeadAttention(16, 2, causal=True, window=3, rotary="xpos", dtype="float64", seed=7)
    with pytest.raises(ValueError, match="rotary='xpos' decodes with a KVCache without a window"):
        windowed(x[:, :1], cache=KVCache(2, 2, 8, capacity=7, window=3))


@pytest.mark.parametrize("split", [-1, 0, 3])
def test_multiway_routes_positions_to_their_projections(split):
    module = MultiHeadAttention(8, 2, multiway=True, subln=True, dtype="float64", seed=8)
    names = [name for name, _ in module.named_parameters()]
    assert "q_proj.A.weight" in names and "q_proj.B.weight" in names and "inner_attn_ln.B.bias" in names
    single = MultiHeadAttention(8, 2, subln=True, dtype="float64", seed=9)
    x = RNG.standard_normal((2, 5, 8))
    state = module.state_dict()

    def through(way):  # the whole sequence through one set of weights
        single.load_state_dict({name.replace(f".{way}.", "."): value for name, value in state.items()
                                if f".{way}." in name})
        return single

    if split in (-1, 0):
        expected = through("A" if split == -1 else "B")(x).data
        assert_same_composition(module(x, split_position=split), expected, 2 * 8 + 4 + 5 + 8, "out")
    else:
        def per_position(name, y, apply):
            return np.concatenate([apply(y[:, :split], "A"), apply(y[:, split:], "B")], axis=1)

        linear = lambda name: lambda y, way: y @ state[f"{name}.{way}.weight"].T + state[f"{name}.{way}.bias"]

        def norm(y, way):
            centered = y - y.mean(-1, keepdims=True)
            normalized = centered / np.sqrt((centered ** 2).mean(-1, keepdims=True) + 1e-5)
            return normalized * state[f"inner_attn_ln.{way}.weight"] + state[f"inner_attn_ln.{way}.bias"]

        q, k, v = (per_position(name, x, linear(name)).reshape(2, 5, 2, 4) for name in ("q_proj", "k_proj", "v_proj"))
        attended = npattn.attention(q, k, v, layout="bshd", backend="reference").reshape(2, 5, 8)
        expected = per_position("out_proj", per_position("ln", attended, norm), linear("out_proj"))
        assert_same_composition(module(x, split_position=split), expected, 2 * 8 + 4 + 5 + 8, "out")
    gradcheck_module(module, Tensor(x, requires_grad=True), split_position=split)
