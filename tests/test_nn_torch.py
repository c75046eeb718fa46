"""Parity with torch.nn.MultiheadAttention through from_torch (skipped without torch)."""
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
        ours["attn_mask"] = allowed
        theirs["attn_mask"] = torch.from_numpy(~allowed)  # the torch module's True = masked out
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
