"""Attention modules by name: :func:`get_attention`.

Its own module so that ``attention.py`` need not import ``disentangled.py``, which
builds on it (the lookup once imported it lazily, an import loop).
"""
from __future__ import annotations

from .attention import GroupedQueryAttention, MultiHeadAttention, MultiQueryAttention, SlidingWindowAttention
from .disentangled import DisentangledAttention

KINDS = {"mha": MultiHeadAttention, "mqa": MultiQueryAttention, "gqa": GroupedQueryAttention,
         "swa": SlidingWindowAttention, "disentangled": DisentangledAttention}


def get_attention(kind: str, **kwargs) -> MultiHeadAttention:
    """The attention module named ``kind`` ("mha", "mqa", "gqa", "swa", "disentangled"),
    built from the keywords of its class (``embed_dim``, ``num_heads``, ``num_groups``,
    ``window_size``, ``max_relative_positions``, ...)."""
    if kind not in KINDS:
        raise ValueError(f"get_attention: kind must be one of {sorted(KINDS)}; got {kind!r}")
    return KINDS[kind](**kwargs)
