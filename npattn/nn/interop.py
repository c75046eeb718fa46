"""from_torch: an npattn module with the weights of a ``torch.nn.MultiheadAttention``.

torch is imported only by the caller's object; nothing here imports it.
"""
from __future__ import annotations

import numpy as np

from .attention import MultiHeadAttention


def from_torch(module, *, backend: str = "auto") -> MultiHeadAttention:
    """The :class:`~npattn.nn.MultiHeadAttention` computing what ``module`` (a
    ``torch.nn.MultiheadAttention``) computes, with its weights copied (float32 or float64,
    as the module's).

    Differences of convention to keep in mind when calling it: npattn's inputs are always
    batch-first (B, S, E), whatever ``module.batch_first`` says; a boolean ``attn_mask``
    means "may attend" (SDPA's convention), the negation of the torch module's.
    ``key_padding_mask`` (True = padding) and float masks mean the same in both.
    Raises ValueError for ``add_bias_kv`` and ``add_zero_attn``, which npattn lacks.
    """
    if getattr(module, "bias_k", None) is not None or getattr(module, "add_zero_attn", False):
        raise ValueError("from_torch: add_bias_kv and add_zero_attn have no npattn equivalent")

    def array(tensor):
        return tensor.detach().cpu().numpy()

    embed_dim, num_heads = module.embed_dim, module.num_heads
    if module.in_proj_weight is not None:
        weights = np.split(array(module.in_proj_weight), 3)
    else:
        weights = [array(module.q_proj_weight), array(module.k_proj_weight), array(module.v_proj_weight)]
    has_bias = module.in_proj_bias is not None
    dtype = str(weights[0].dtype)
    if dtype not in ("float32", "float64"):
        raise ValueError(f"from_torch: the module's weights must be float32 or float64; got {dtype}")
    result = MultiHeadAttention(embed_dim, num_heads, kdim=module.kdim, vdim=module.vdim, bias=has_bias,
                                dropout=module.dropout, dtype=dtype, backend=backend)
    state = {"q_proj.weight": weights[0], "k_proj.weight": weights[1], "v_proj.weight": weights[2],
             "out_proj.weight": array(module.out_proj.weight)}
    if has_bias:
        q_bias, k_bias, v_bias = np.split(array(module.in_proj_bias), 3)
        state.update({"q_proj.bias": q_bias, "k_proj.bias": k_bias, "v_proj.bias": v_bias,
                      "out_proj.bias": array(module.out_proj.bias)})
    result.load_state_dict(state)
    return result.train(module.training)
