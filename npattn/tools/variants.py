"""A catalogue of named attention variants on one problem size, shared by the demo and benchmarks.

Each variant is a function of the problem size that returns ``(q, k, v, options)``
ready for ``npattn.attention(q, k, v, **options)``, so every consumer exercises the
same configurations and a new variant is one entry here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class Size:
    """(B, H, S, D): batch, query heads, sequence length (queries and keys), head dim."""

    batch: int = 2
    heads: int = 4
    seq_len: int = 128
    head_dim: int = 32


@dataclass(frozen=True)
class Variant:
    name: str
    description: str
    build: Callable  # (size, rng, dtype) -> (q, k, v, options)


def _qkv(size: Size, rng, dtype, *, kv_heads=None, q_len=None, layout="bhsd"):
    kv_heads = size.heads if kv_heads is None else kv_heads
    q_len = size.seq_len if q_len is None else q_len

    def normal(b, h, s, d):
        shape = (b, s, h, d) if layout == "bshd" else (b, h, s, d)
        return rng.standard_normal(shape).astype(dtype)

    return (normal(size.batch, size.heads, q_len, size.head_dim),
            normal(size.batch, kv_heads, size.seq_len, size.head_dim),
            normal(size.batch, kv_heads, size.seq_len, size.head_dim))


def _variant(name, description, options=None, **qkv):
    def build(size, rng, dtype):
        chosen = options(size, rng) if options is not None else {}
        return (*_qkv(size, rng, dtype, **{k: (v(size) if callable(v) else v) for k, v in qkv.items()}),
                chosen)
    return Variant(name, description, build)


def _padding(size, rng):
    return {"q_lengths": rng.integers(size.seq_len // 2, size.seq_len + 1, size.batch),
            "kv_lengths": rng.integers(size.seq_len // 2, size.seq_len + 1, size.batch)}


VARIANTS = {v.name: v for v in [
    _variant("mha", "multi-head attention"),
    _variant("mqa", "multi-query: one kv head", kv_heads=1),
    _variant("gqa", "grouped-query: two query heads per kv head", kv_heads=lambda s: max(1, s.heads // 2)),
    _variant("causal", "causal self-attention", lambda s, r: {"causal": True}),
    _variant("decode", "one query against the cache, causal (Sq=1)", lambda s, r: {"causal": True}, q_len=1),
    _variant("chunked-prefill", "a chunk of Sk/4 queries, causal, bottom-right aligned",
             lambda s, r: {"causal": True}, q_len=lambda s: max(1, s.seq_len // 4)),
    _variant("sliding-window", "causal, window of 32 keys", lambda s, r: {"causal": True, "window": 32}),
    _variant("window+sinks", "causal window of 32 plus 4 attention sinks",
             lambda s, r: {"causal": True, "window": 32, "sinks": 4}),
    _variant("sink-logits", "a learned per-head sink logit (gpt-oss)",
             lambda s, r: {"causal": True, "sink_logits": r.standard_normal(s.heads)}),
    _variant("bool-mask", "a random boolean mask (1, 1, S, S)",
             lambda s, r: {"mask": r.random((1, 1, s.seq_len, s.seq_len)) < 0.7}),
    _variant("bias", "an additive bias (1, H, S, S)",
             lambda s, r: {"bias": r.standard_normal((1, s.heads, s.seq_len, s.seq_len)).astype(np.float32)}),
    _variant("alibi", "ALiBi slopes, causal",
             lambda s, r: {"causal": True, "alibi_slopes": 2.0 ** -np.arange(1, s.heads + 1)}),
    _variant("padding", "per-sequence q_lengths and kv_lengths", _padding),
    _variant("softcap", "soft-capped scores (softcap=5)", lambda s, r: {"softcap": 5.0}),
    _variant("dropout", "dropout p=0.1 with a seed", lambda s, r: {"dropout_p": 0.1, "seed": 1234}),
    _variant("bshd", "FlashAttention's (B, S, H, D) layout",
             lambda s, r: {"layout": "bshd"}, layout="bshd"),
]}
