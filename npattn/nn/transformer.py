"""Transformer encoder and decoder layers from the attention modules, pre- or post-norm.

Both are batch-first: x (B, S, E). Post-norm (``norm_first=False``, the original
Transformer and torch's default) normalizes after each residual sum; pre-norm
normalizes each sublayer's input.
"""
from __future__ import annotations

import numpy as np

from .attention import MultiHeadAttention
from .layers import MLP, Dropout, LayerNorm
from .module import Module


class _Block(Module):
    """What both layers share: the feed-forward sublayer and the residual/norm wiring."""

    def _init_common(self, d_model, dim_feedforward, dropout, activation, norm_first, layer_norm_eps,
                     bias, dtype, rng, norms):
        self.norm_first = norm_first
        self.mlp = MLP(d_model, dim_feedforward, activation, bias, dropout, dtype=dtype, seed=rng)
        for index in range(1, norms + 1):
            setattr(self, f"norm{index}", LayerNorm(d_model, layer_norm_eps, bias=bias, dtype=dtype))
        self.dropout = Dropout(dropout, seed=rng)

    def _sublayer(self, x, norm, sublayer):
        """``x + dropout(sublayer(norm(x)))`` (pre-norm) or ``norm(x + dropout(sublayer(x)))``."""
        if self.norm_first:
            return x + self.dropout(sublayer(norm(x)))
        return norm(x + self.dropout(sublayer(x)))


class TransformerEncoderLayer(_Block):
    """Self-attention then a feed-forward MLP, each with a residual connection.

    Args:
        d_model, nhead: width and query heads. dim_feedforward: the MLP's hidden width.
        dropout: on attention probabilities, inside the MLP and on each residual branch.
        activation: "relu" (torch's default), "gelu", "gelu_tanh" or "tanh".
        norm_first: pre-norm when True. attention: further keywords of
            :class:`~npattn.nn.MultiHeadAttention` (num_kv_heads, causal, window, rotary, ...).

    Call: ``layer(x, *, key_padding_mask=None, attn_mask=None, causal=None)`` -> (B, S, E).
    """

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: str = "relu", norm_first: bool = False, layer_norm_eps: float = 1e-5,
                 bias: bool = True, *, dtype="float32", seed=None, **attention):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.self_attn = MultiHeadAttention(d_model, nhead, bias=bias, dropout=dropout, dtype=dtype, seed=rng,
                                            **attention)
        self._init_common(d_model, dim_feedforward, dropout, activation, norm_first, layer_norm_eps, bias,
                          dtype, rng, norms=2)

    def forward(self, x, *, key_padding_mask=None, attn_mask=None, causal=None):
        x = self._sublayer(x, self.norm1, lambda h: self.self_attn(
            h, key_padding_mask=key_padding_mask, attn_mask=attn_mask, causal=causal))
        return self._sublayer(x, self.norm2, self.mlp)


class TransformerDecoderLayer(_Block):
    """Causal self-attention, cross attention over an encoder's output (``memory``), then a
    feed-forward MLP, each with a residual connection. Arguments as
    :class:`TransformerEncoderLayer`; ``attention`` keywords go to the self-attention
    (which is causal unless ``causal=False`` is among them).

    Call: ``layer(x, memory, *, key_padding_mask=None, memory_key_padding_mask=None,
    cache=None)`` -> (B, S, E); ``cache`` is the self-attention's
    :class:`~npattn.nn.KVCache` for decoding.
    """

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: str = "relu", norm_first: bool = False, layer_norm_eps: float = 1e-5,
                 bias: bool = True, *, dtype="float32", seed=None, **attention):
        super().__init__()
        rng = np.random.default_rng(seed)
        attention.setdefault("causal", True)
        self.self_attn = MultiHeadAttention(d_model, nhead, bias=bias, dropout=dropout, dtype=dtype, seed=rng,
                                            **attention)
        self.cross_attn = MultiHeadAttention(d_model, nhead, bias=bias, dropout=dropout, dtype=dtype, seed=rng)
        self._init_common(d_model, dim_feedforward, dropout, activation, norm_first, layer_norm_eps, bias,
                          dtype, rng, norms=3)

    def forward(self, x, memory, *, key_padding_mask=None, memory_key_padding_mask=None, cache=None):
        x = self._sublayer(x, self.norm1, lambda h: self.self_attn(h, key_padding_mask=key_padding_mask,
                                                                   cache=cache))
        x = self._sublayer(x, self.norm2, lambda h: self.cross_attn(
            h, memory, key_padding_mask=memory_key_padding_mask))
        return self._sublayer(x, self.norm3, self.mlp)
