"""from_torch: an npattn module with the weights of a torch ``nn.MultiheadAttention`` or
``nn.TransformerEncoderLayer``.

torch is imported only by the caller's object; nothing here imports it.
"""
from __future__ import annotations

import numpy as np

from .attention import MultiHeadAttention
from .module import Module
from .transformer import TransformerEncoderLayer


def from_torch(module, *, backend: str = "auto", mask_convention: str = "torch") -> Module:
    """The npattn module computing what ``module`` computes, with its weights copied
    (float32 or float64, as the module's):

    - ``torch.nn.MultiheadAttention`` -> :class:`~npattn.nn.MultiHeadAttention`;
    - ``torch.nn.TransformerEncoderLayer`` -> :class:`~npattn.nn.TransformerEncoderLayer`
      (activation relu, gelu or tanh-approximated gelu; pre- or post-norm).

    Differences of convention to keep in mind when calling it: npattn's inputs are always
    batch-first (B, S, E), whatever ``module.batch_first`` says, and the encoder layer's
    mask keyword is ``attn_mask`` (torch's ``src_mask``). A boolean ``attn_mask`` means
    what it means to the torch module (True = masked out) under the default
    ``mask_convention="torch"``; pass ``"allow"`` for SDPA's and npattn's True = may
    attend. ``key_padding_mask`` (True = padding) and float masks mean the same in both.
    Given torch tensors, the module returns torch tensors.

    Raises ValueError for ``add_bias_kv`` and ``add_zero_attn``, which npattn lacks, and
    for other module types.
    """
    if hasattr(module, "self_attn") and hasattr(module, "linear1"):
        return _encoder_layer(module, backend, mask_convention)
    if hasattr(module, "in_proj_weight") and hasattr(module, "out_proj"):
        return _multihead_attention(module, backend, mask_convention)
    raise ValueError(f"from_torch takes a torch.nn.MultiheadAttention or TransformerEncoderLayer; "
                     f"got {type(module).__name__}")


def _array(tensor):
    return tensor.detach().cpu().numpy()


def _float_dtype(tensor) -> str:
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in ("float32", "float64"):
        raise ValueError(f"from_torch: the module's weights must be float32 or float64; got {dtype}")
    return dtype


def _attention_state(module, prefix: str = "") -> tuple[dict, bool]:
    """The state of a torch MultiheadAttention under npattn's names, and whether it has biases."""
    if module.in_proj_weight is not None:
        weights = np.split(_array(module.in_proj_weight), 3)
    else:
        weights = [_array(module.q_proj_weight), _array(module.k_proj_weight), _array(module.v_proj_weight)]
    state = {f"{prefix}{name}_proj.weight": weight for name, weight in zip("qkv", weights)}
    state[f"{prefix}out_proj.weight"] = _array(module.out_proj.weight)
    has_bias = module.in_proj_bias is not None
    if has_bias:
        state.update({f"{prefix}{name}_proj.bias": bias for name, bias in zip("qkv", np.split(_array(module.in_proj_bias), 3))})
        state[f"{prefix}out_proj.bias"] = _array(module.out_proj.bias)
    return state, has_bias


def _check_attention(module) -> None:
    if getattr(module, "bias_k", None) is not None or getattr(module, "add_zero_attn", False):
        raise ValueError("from_torch: add_bias_kv and add_zero_attn have no npattn equivalent")


def _multihead_attention(module, backend: str, mask_convention: str) -> MultiHeadAttention:
    _check_attention(module)
    state, has_bias = _attention_state(module)
    result = MultiHeadAttention(module.embed_dim, module.num_heads, kdim=module.kdim, vdim=module.vdim,
                                bias=has_bias, dropout=module.dropout, mask_convention=mask_convention,
                                dtype=_float_dtype(module.out_proj.weight),
                                backend=backend)
    result.load_state_dict(state)
    return result.train(module.training)


# torch's activation (a function's or module's name) -> npattn's
_ACTIVATIONS = {"relu": "relu", "ReLU": "relu", "gelu": "gelu", "GELU": "gelu", "tanh": "tanh", "Tanh": "tanh"}


def _activation(layer) -> str:
    activation = layer.activation
    name = getattr(activation, "__name__", type(activation).__name__)
    if getattr(activation, "approximate", "none") == "tanh":
        return "gelu_tanh"
    if name not in _ACTIVATIONS:
        raise ValueError(f"from_torch: activation {activation!r} has no npattn equivalent "
                         "(relu, gelu, gelu with approximate='tanh', tanh)")
    return _ACTIVATIONS[name]


def _encoder_layer(layer, backend: str, mask_convention: str) -> TransformerEncoderLayer:
    attention = layer.self_attn
    _check_attention(attention)
    state, has_bias = _attention_state(attention, "self_attn.")
    state.update({"mlp.fc1.weight": _array(layer.linear1.weight), "mlp.fc2.weight": _array(layer.linear2.weight)})
    for index in (1, 2):
        norm = getattr(layer, f"norm{index}")
        state[f"norm{index}.weight"] = _array(norm.weight)
        if norm.bias is not None:
            state[f"norm{index}.bias"] = _array(norm.bias)
    if has_bias:
        state.update({"mlp.fc1.bias": _array(layer.linear1.bias), "mlp.fc2.bias": _array(layer.linear2.bias)})
    result = TransformerEncoderLayer(attention.embed_dim, attention.num_heads, layer.linear1.out_features,
                                     dropout=layer.dropout.p, activation=_activation(layer),
                                     norm_first=layer.norm_first, layer_norm_eps=layer.norm1.eps, bias=has_bias,
                                     dtype=_float_dtype(attention.out_proj.weight), backend=backend,
                                     mask_convention=mask_convention)
    result.load_state_dict(state)
    return result.train(layer.training)
