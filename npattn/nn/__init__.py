"""Modules with parameters and state dicts, built only from :mod:`npattn.autograd` functions.

- ``module.py``: :class:`Module` (parameters, submodules, train/eval, state dicts,
  seeded initialization).
- ``layers.py``: :class:`Linear`, :class:`Embedding`, :class:`LayerNorm`,
  :class:`RMSNorm`, :class:`Dropout`, :class:`MLP`.

The attention modules of API.md section 4 (MultiHeadAttention and its variants,
KVCache, transformer layers) are not implemented yet (issue 5).
"""
from .layers import MLP, Dropout, Embedding, LayerNorm, Linear, RMSNorm
from .module import Module

__all__ = ["Module", "Linear", "Embedding", "LayerNorm", "RMSNorm", "Dropout", "MLP"]
