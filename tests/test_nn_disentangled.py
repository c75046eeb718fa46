"""DisentangledAttention against a NumPy transcription of HF transformers' DebertaV2
DisentangledSelfAttention (its bmm/gather/transpose steps, one by one), and its gradients."""
import numpy as np
import pytest

from npattn.autograd import Tensor
from npattn.nn import DisentangledAttention, get_attention
from npattn.nn.disentangled import log_bucket_positions
from module_checks import assert_same_composition, gradcheck_module

RNG = np.random.default_rng(23)


def hf_bucket(relative, bucket_size, max_position):
    """make_log_bucket_position, element by element in float32 as torch computes it."""
    out = np.empty_like(relative)
    mid = bucket_size // 2
    for index, r in np.ndenumerate(relative):
        a = mid - 1 if -mid < r < mid else abs(r)
        if a <= mid:
            out[index] = r
        else:
            ratio = np.float32(np.log(np.float32(a) / np.float32(mid))) / np.float32(
                np.log(np.float32((max_position - 1) / mid)))
            out[index] = int(np.ceil(np.float32(ratio * np.float32(mid - 1))) + mid) * int(np.sign(r))
    return out


def hf_context(module, x, rel_embeddings, padding=None):
    """The context layer as HF computes it (then npattn's out_proj), from the module's weights."""
    p = {name: t.data for name, t in module.named_parameters()}
    H, D, (B, N, E) = module.num_heads, module.head_dim, x.shape
    linear = lambda name, y: y @ p[f"{name}.weight"].T + p[f"{name}.bias"]
    heads = lambda y: y.reshape(y.shape[0], y.shape[1], H, D).transpose(0, 2, 1, 3).reshape(-1, y.shape[1], D)
    q, k, v = (heads(linear(name, x)) for name in ("q_proj", "k_proj", "v_proj"))  # (B*H, N, D)
    factor = 1 + len(module.pos_att_type)
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(D * factor)
    relative = np.arange(N)[:, None] - np.arange(N)[None, :]
    if module.position_buckets > 0:
        relative = hf_bucket(relative, module.position_buckets, module.max_relative_positions)
    span = module.span
    rel = rel_embeddings[:2 * span][None]
    repeat = lambda y: np.tile(heads(y), (B, 1, 1))
    if "c2p" in module.pos_att_type:
        pos_key = repeat(linear("k_proj" if module.share_att_key else "pos_key_proj", rel))
        c2p = q @ pos_key.transpose(0, 2, 1)
        c2p_pos = np.clip(relative + span, 0, 2 * span - 1)
        scores = scores + np.take_along_axis(c2p, np.broadcast_to(c2p_pos, (B * H, N, N)), -1) / np.sqrt(D * factor)
    if "p2c" in module.pos_att_type:
        pos_query = repeat(linear("q_proj" if module.share_att_key else "pos_query_proj", rel))
        p2c_pos = np.clip(-relative + span, 0, 2 * span - 1)
        p2c = k @ pos_query.transpose(0, 2, 1)
        gathered = np.take_along_axis(p2c, np.broadcast_to(p2c_pos, (B * H, N, N)), -1).transpose(0, 2, 1)
        scores = scores + gathered / np.sqrt(D * factor)
    scores = scores.reshape(B, H, N, N)
    if padding is not None:
        scores = np.where(padding[:, None, None, :], -np.inf, scores)
    probabilities = np.exp(scores - scores.max(-1, keepdims=True))
    probabilities /= probabilities.sum(-1, keepdims=True)
    context = (probabilities.reshape(B * H, N, N) @ v).reshape(B, H, N, D).transpose(0, 2, 1, 3).reshape(B, N, E)
    return linear("out_proj", context), probabilities


CONFIGS = {
    "shared-both": dict(max_relative_positions=4),
    "separate-both": dict(max_relative_positions=3, share_att_key=False),
    "c2p-only": dict(max_relative_positions=5, pos_att_type=("c2p",)),
    "p2c-only-separate": dict(max_relative_positions=2, pos_att_type=("p2c",), share_att_key=False),
    "log-buckets": dict(max_relative_positions=16, position_buckets=4),
    "none": dict(max_relative_positions=2, pos_att_type=()),
}


@pytest.mark.parametrize("options", list(CONFIGS.values()), ids=list(CONFIGS))
def test_equals_hf_computation(options):
    module = DisentangledAttention(16, 4, dtype="float64", seed=0, **options)
    for _, parameter in module.named_parameters():  # nonzero biases, so their use is checked too
        parameter.data[...] = RNG.standard_normal(parameter.shape) * 0.3
    x = RNG.standard_normal((2, 11, 16))
    rel = RNG.standard_normal((2 * module.span + 3, 16))
    padding = np.zeros((2, 11), bool)
    padding[1, 7:] = True
    out, weights = module(x, rel, key_padding_mask=padding, need_weights=True, average_attn_weights=False)
    expected, expected_weights = hf_context(module, x, rel, padding)
    # chains: projections (E), scores and position terms (D each, three of them), 11 keys, out (E)
    chain = 2 * 16 + 3 * 4 + 11
    assert_same_composition(out, expected, chain, "out")
    assert_same_composition(weights, expected_weights, chain, "weights")


def test_log_buckets_match_the_elementwise_float32_formula():
    relative = np.arange(-300, 301)[None, :]
    for bucket_size, max_position in [(256, 512), (4, 16), (32, 128)]:
        np.testing.assert_array_equal(log_bucket_positions(relative, bucket_size, max_position),
                                      hf_bucket(relative, bucket_size, max_position))
    assert log_bucket_positions(np.array([3, -3, 0]), 256, 512).tolist() == [3, -3, 0]  # near: unchanged


@pytest.mark.parametrize("share", [True, False], ids=["shared", "separate"])
def test_gradients_reach_projections_and_embeddings(share):
    module = DisentangledAttention(8, 2, max_relative_positions=3, share_att_key=share, dtype="float64", seed=1)
    x = Tensor(RNG.standard_normal((2, 5, 8)), requires_grad=True)
    rel = Tensor(RNG.standard_normal((6, 8)), requires_grad=True)
    gradcheck_module(module, x, rel)


def test_configuration_errors_and_factory():
    assert isinstance(get_attention("disentangled", embed_dim=8, num_heads=2, max_relative_positions=4),
                      DisentangledAttention)
    with pytest.raises(ValueError, match="pos_att_type"):
        DisentangledAttention(8, 2, max_relative_positions=2, pos_att_type=("p2p",))
    with pytest.raises(ValueError, match="do not apply"):
        DisentangledAttention(8, 2, max_relative_positions=2, causal=True)
    with pytest.raises(ValueError, match=r"rel_embeddings must be \(>= 8, 8\)"):
        DisentangledAttention(8, 2, max_relative_positions=4)(np.ones((1, 3, 8)), np.ones((6, 8)))
    separate = DisentangledAttention(8, 2, max_relative_positions=2, share_att_key=False, seed=3)
    assert not np.array_equal(separate.pos_key_proj.weight.data, separate.q_proj.weight.data)
