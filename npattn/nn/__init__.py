"""Modules with parameters and state dicts, built only from :mod:`npattn.autograd` functions.

- ``module.py``: :class:`Module` (parameters, submodules, train/eval, state dicts,
  seeded initialization).
- ``layers.py``: :class:`Linear`, :class:`Embedding`, :class:`LayerNorm`,
  :class:`RMSNorm`, :class:`Dropout`, :class:`MLP`.
- ``attention.py``: :class:`MultiHeadAttention` and the :class:`MultiQueryAttention`,
  :class:`GroupedQueryAttention` and :class:`SlidingWindowAttention` variants.
- ``rotary.py``: rotary position embeddings ("rope", "xpos").
- ``multiway.py``: :class:`Multiway` (torchscale's two-way projections).
- ``cache.py``: :class:`KVCache` for decoding (prefix or rolling with sinks) and
  :class:`PagedKVCache`, a pool of pages shared by sequences that come and go.
- ``transformer.py``: :class:`TransformerEncoderLayer`, :class:`TransformerDecoderLayer`.
- ``interop.py``: :func:`from_torch` (a ``torch.nn.MultiheadAttention``'s weights).
- ``disentangled.py``: :class:`DisentangledAttention` (DeBERTa-v2, as HF computes it).
- ``registry.py``: :func:`get_attention` (a module by name).
- ``bert.py``: :class:`BertModel` (BERT-family encoders from safetensors checkpoints),
  :func:`mean_pool`, :func:`normalize`.
"""
from .bert import BertModel, mean_pool, normalize
from .attention import GroupedQueryAttention, MultiHeadAttention, MultiQueryAttention, SlidingWindowAttention
from .cache import KVCache, PagedKVCache
from .disentangled import DisentangledAttention
from .interop import from_torch
from .layers import MLP, Dropout, Embedding, LayerNorm, Linear, RMSNorm
from .module import Module
from .multiway import Multiway
from .registry import get_attention
from .transformer import TransformerDecoderLayer, TransformerEncoderLayer

__all__ = ["BertModel", "mean_pool", "normalize", "Module", "Multiway", "Linear", "Embedding", "LayerNorm", "RMSNorm", "Dropout", "MLP",
           "MultiHeadAttention", "KVCache", "PagedKVCache", "get_attention", "from_torch", "DisentangledAttention", "TransformerEncoderLayer", "TransformerDecoderLayer", "MultiQueryAttention", "GroupedQueryAttention", "SlidingWindowAttention"]
