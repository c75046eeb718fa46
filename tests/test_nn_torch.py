"""Parity with torch.nn.MultiheadAttention and TransformerEncoderLayer through from_torch, and
modules called with torch tensors (skipped without torch: the test-frameworks extra installs it)."""
import numpy as np
import pytest

from npattn.nn import from_torch
from module_checks import assert_same_composition

torch = pytest.importorskip("torch")
RNG = np.random.default_rng(17)
B, SQ, SK, E, H = 2, 5, 7, 16, 4


@pytest.mark.parametrize("kdim, vdim", [(None, None), (6, 3)], ids=["self-dims", "kdim-vdim"])
@pytest.mark.parametrize("mask_kind", ["none", "padding", "bool", "float"])
@pytest.mark.parametrize("average", [True, False], ids=["averaged", "per-head"])
def test_outputs_and_weights_match_torch(kdim, vdim, mask_kind, average):
    torch.manual_seed(0)
    reference = torch.nn.MultiheadAttention(E, H, kdim=kdim, vdim=vdim, batch_first=True, dtype=torch.float64)
    for parameter in reference.parameters():  # nonzero biases, so their copy is checked too
        torch.nn.init.normal_(parameter, std=0.3)
    reference.eval()
    module = from_torch(reference)
    query = RNG.standard_normal((B, SQ, E))
    key = RNG.standard_normal((B, SK, kdim or E))
    value = RNG.standard_normal((B, SK, vdim or E))
    ours, theirs = {}, {}
    if mask_kind == "padding":
        padding = np.zeros((B, SK), bool)
        padding[1, 3:] = True
        ours["key_padding_mask"] = padding
        theirs["key_padding_mask"] = torch.from_numpy(padding)
    elif mask_kind == "bool":
        allowed = RNG.random((SQ, SK)) > 0.3
        allowed[:, 0] = True
        ours["attn_mask"] = theirs["attn_mask"] = torch.from_numpy(~allowed)  # torch's True = masked out
    elif mask_kind == "float":
        additive = RNG.standard_normal((SQ, SK))
        ours["attn_mask"] = additive
        theirs["attn_mask"] = torch.from_numpy(additive)
    out, weights = module(query, key, value, need_weights=True, average_attn_weights=average, **ours)
    with torch.no_grad():
        expected, expected_weights = reference(torch.from_numpy(query), torch.from_numpy(key),
                                               torch.from_numpy(value), need_weights=True,
                                               average_attn_weights=average, **theirs)
    chain = 2 * E + E // H + SK  # projections, scores, weighted values
    assert_same_composition(out, expected.numpy(), chain, "out")
    assert_same_composition(weights, expected_weights.numpy(), chain, "weights")


def test_unsupported_torch_options_are_refused():
    with pytest.raises(ValueError, match="add_bias_kv"):
        from_torch(torch.nn.MultiheadAttention(E, H, add_bias_kv=True))


def test_allow_convention_takes_true_as_may_attend():
    torch.manual_seed(0)
    reference = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64).eval()
    x = RNG.standard_normal((B, SQ, E))
    allowed = RNG.random((SQ, SQ)) > 0.3
    allowed[:, 0] = True
    torch_convention = from_torch(reference)(x, attn_mask=~allowed)
    allow_convention = from_torch(reference, mask_convention="allow")(x, attn_mask=allowed)
    np.testing.assert_array_equal(torch_convention.data, allow_convention.data)
    with pytest.raises(ValueError, match="mask_convention"):
        from_torch(reference, mask_convention="true_masks")


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
@pytest.mark.parametrize("activation", ["relu", "gelu", torch.nn.GELU(approximate="tanh")], ids=str)
@pytest.mark.parametrize("masks", ["none", "padding+bool"])
def test_encoder_layer_matches_torch(norm_first, activation, masks):
    torch.manual_seed(1)
    reference = torch.nn.TransformerEncoderLayer(E, H, dim_feedforward=24, activation=activation,
                                                 norm_first=norm_first, batch_first=True, dtype=torch.float64)
    for parameter in reference.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    reference.eval()
    layer = from_torch(reference)
    x = torch.from_numpy(RNG.standard_normal((B, SQ, E)))
    ours, theirs = {}, {}
    if masks != "none":
        padding = torch.zeros(B, SQ, dtype=torch.bool)
        padding[1, 3:] = True
        masked_out = torch.from_numpy(RNG.random((SQ, SQ)) < 0.3)
        masked_out[:, 0] = False
        ours = {"key_padding_mask": padding, "attn_mask": masked_out}
        theirs = {"src_key_padding_mask": padding, "src_mask": masked_out}
    out = layer(x, **ours)  # torch tensors in: a torch tensor out
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float64
    fast_path = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)  # torch's fused fast path takes any GELU as exact
    try:
        with torch.no_grad():
            expected = reference(x, **theirs)
    finally:
        torch.backends.mha.set_fastpath_enabled(fast_path)
    assert_same_composition(out.numpy(), expected.numpy(), 2 * E + 24 + SQ, "out")


def test_modules_hand_back_the_kind_of_their_inputs():
    torch.manual_seed(2)
    module = from_torch(torch.nn.MultiheadAttention(E, H, batch_first=True))
    x = torch.randn(B, SQ, E)
    out, weights = module(x, need_weights=True)
    assert isinstance(out, torch.Tensor) and isinstance(weights, torch.Tensor)
    np.testing.assert_array_equal(out.numpy(), module(x.numpy()).data)


def test_other_modules_are_refused():
    with pytest.raises(ValueError, match="MultiheadAttention or TransformerEncoderLayer"):
        from_torch(torch.nn.Linear(2, 2))
