"""npattn.merge_states: attention over disjoint key sets, merged by their log-sum-exp, is
attention over their union (forward; every layout; sets whose rows see no key included)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import npattn
import tolerances


@given(parts=st.integers(1, 4), q_len=st.integers(1, 6), kv_len=st.integers(1, 12), layout=st.sampled_from(
           ["bhsd", "bshd"]), causal=st.booleans(), dtype=st.sampled_from(["float32", "float64"]),
       empty_part=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_merged_parts_are_the_call_over_the_union(parts, q_len, kv_len, layout, causal, dtype, empty_part, seed):
    """Keys split into disjoint sets by masks (plus, maybe, a set with no key: lse -inf),
    each set's (out, lse), merged, against one call over all keys."""
    rng = np.random.default_rng(seed)
    batch, heads, dim = 2, 4, 8
    shape = (batch, heads, q_len, dim) if layout == "bhsd" else (batch, q_len, heads, dim)
    kv_shape = (batch, 2, kv_len, dim) if layout == "bhsd" else (batch, kv_len, 2, dim)
    q = rng.standard_normal(shape).astype(dtype)
    k, v = (rng.standard_normal(kv_shape).astype(dtype) for _ in range(2))
    owner = rng.integers(0, parts, kv_len)  # the part each key belongs to
    outs, lses = [], []
    for part in range(parts + (1 if empty_part else 0)):  # the extra part owns no key: lse -inf
        mask = np.broadcast_to(owner == part, (q_len, kv_len))
        out, lse = npattn.attention(q, k, v, mask=mask, causal=causal, layout=layout, return_lse=True)
        outs.append(out)
        lses.append(lse)
    merged, merged_lse = npattn.merge_states(outs, lses, layout=layout)
    want, want_lse = npattn.attention(q, k, v, causal=causal, layout=layout, return_lse=True)
    out_bound, lse_bound = tolerances.attention_bounds(dtype, q, k, v, kv_len + parts)  # (the merge's sums: parts)
    np.testing.assert_allclose(merged, want, rtol=0, atol=out_bound)
    np.testing.assert_allclose(merged_lse, want_lse, rtol=0, atol=lse_bound)
    assert merged.dtype == want.dtype and merged_lse.dtype == want_lse.dtype


def test_rows_no_part_saw_stay_empty_and_varlen_layout_lines_up():
    out = np.ones((5, 2, 3), np.float32)       # varlen: (T, H, Dv), lse (H, T)
    lse = np.full((2, 5), -np.inf, np.float32)
    merged, merged_lse = npattn.merge_states([out, 2 * out], [lse, lse], layout="varlen")
    assert not merged.any() and np.isneginf(merged_lse).all() and merged_lse.shape == (2, 5)
    lse_a = np.zeros((2, 5), np.float32)
    lse_b = np.full((2, 5), np.log(3.0), np.float32)  # b holds three times a's mass
    merged, merged_lse = npattn.merge_states([out, 2 * out], [lse_a, lse_b], layout="varlen")
    # (1 * 1 + 3 * 2) / 4, and log 4: a float32 rounding of float64 sums of two terms
    np.testing.assert_allclose(merged, 1.75, rtol=0, atol=tolerances.bound(np.float32, 2, 2.0))
    np.testing.assert_allclose(merged_lse, np.log(4.0), rtol=0, atol=tolerances.bound(np.float32, 2, np.log(4.0)))


def test_bad_parts_are_named():
    out, lse = np.zeros((1, 2, 3, 4)), np.zeros((1, 2, 3))
    with pytest.raises(ValueError, match="pair up"):
        npattn.merge_states([out, out], [lse])
    with pytest.raises(ValueError, match=r"outs\[1\] has shape \(1, 2, 3, 5\)"):
        npattn.merge_states([out, np.zeros((1, 2, 3, 5))], [lse, lse])
    with pytest.raises(ValueError, match="does not match outs"):
        npattn.merge_states([out], [np.zeros((1, 3, 2))])
    with pytest.raises(ValueError, match="layout must be"):
        npattn.merge_states([out], [lse], layout="sbhd")


def test_torch_tensors_come_back_as_tensors():
    torch = pytest.importorskip("torch")
    out, lse = torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3)
    merged, merged_lse = npattn.merge_states([out, out + 1], [lse, lse])
    assert isinstance(merged, torch.Tensor) and torch.allclose(merged, torch.full_like(out, 0.5))
    assert torch.allclose(merged_lse, torch.full_like(lse, float(np.log(2.0))))
