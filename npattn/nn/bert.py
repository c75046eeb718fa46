"""BERT-family encoders (BERT, MiniLM, sentence-transformers' checkpoints) on npattn.

:class:`BertModel` is BERT's encoder built from npattn's own modules: word, position and
token-type embeddings with a LayerNorm, then post-norm :class:`TransformerEncoderLayer`
blocks (exact GELU). :meth:`BertModel.from_directory` reads a Hugging Face checkpoint
directory (``config.json`` and ``model.safetensors``, with safetensors' NumPy loader;
``pip install safetensors``), so a sentence-embedding model runs with no torch:
:func:`mean_pool` and :func:`normalize` finish what sentence-transformers' Pooling and
Normalize modules do.
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from .. import autograd as ag
from .layers import Embedding, LayerNorm
from .module import Module
from .transformer import TransformerEncoderLayer


class BertModel(Module):
    """BERT's encoder: ``input_ids`` (B, S) int -> hidden states (B, S, hidden_size).

    Args mirror ``transformers.BertConfig``: vocab_size, hidden_size, num_hidden_layers,
    num_attention_heads, intermediate_size, max_position_embeddings, type_vocab_size,
    layer_norm_eps, hidden_act ("gelu" is BERT's exact GELU)."""

    def __init__(self, vocab_size: int, hidden_size: int, num_hidden_layers: int, num_attention_heads: int,
                 intermediate_size: int, max_position_embeddings: int = 512, type_vocab_size: int = 2,
                 layer_norm_eps: float = 1e-12, hidden_act: str = "gelu", *, dtype="float32", seed=None):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.word_embeddings = Embedding(vocab_size, hidden_size, dtype=dtype, seed=rng)
        self.position_embeddings = Embedding(max_position_embeddings, hidden_size, dtype=dtype, seed=rng)
        self.token_type_embeddings = Embedding(type_vocab_size, hidden_size, dtype=dtype, seed=rng)
        self.embedding_norm = LayerNorm(hidden_size, layer_norm_eps, dtype=dtype)
        self.num_hidden_layers = num_hidden_layers
        for index in range(num_hidden_layers):
            setattr(self, f"layer{index}", TransformerEncoderLayer(
                hidden_size, num_attention_heads, intermediate_size, dropout=0.0, activation=hidden_act,
                layer_norm_eps=layer_norm_eps, dtype=dtype, seed=rng))

    @classmethod
    def from_config(cls, config: dict, *, dtype="float32") -> "BertModel":
        """An untrained model of a ``config.json``'s fields."""
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"BertModel: position_embedding_type must be 'absolute'; got "
                             f"{config['position_embedding_type']!r}")
        names = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                 "max_position_embeddings", "type_vocab_size", "layer_norm_eps", "hidden_act")
        return cls(**{name: config[name] for name in names if name in config}, dtype=dtype)

    @classmethod
    def from_directory(cls, path: str | os.PathLike, *, dtype="float32") -> "BertModel":
        """The model of a Hugging Face checkpoint directory: ``config.json`` and
        ``model.safetensors`` (read with safetensors' NumPy loader; no torch)."""
        try:
            from safetensors.numpy import load_file
        except ImportError:
            raise ImportError("BertModel.from_directory reads model.safetensors with safetensors: "
                              "pip install safetensors") from None
        with open(os.path.join(path, "config.json")) as file:
            model = cls.from_config(json.load(file), dtype=dtype)
        model.load_state_dict(model.state_dict_from_bert(load_file(os.path.join(path, "model.safetensors"))))
        return model.eval()

    def state_dict_from_bert(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """This model's state dict from a Hugging Face BERT checkpoint's tensor names (with or
        without a ``bert.`` prefix; the pooler and any head are left out)."""
        prefix = "bert." if any(name.startswith("bert.") for name in tensors) else ""
        renamed = {"word_embeddings.weight": "embeddings.word_embeddings.weight",
                   "position_embeddings.weight": "embeddings.position_embeddings.weight",
                   "token_type_embeddings.weight": "embeddings.token_type_embeddings.weight",
                   "embedding_norm.weight": "embeddings.LayerNorm.weight",
                   "embedding_norm.bias": "embeddings.LayerNorm.bias"}
        parts = {"self_attn.q_proj": "attention.self.query", "self_attn.k_proj": "attention.self.key",
                 "self_attn.v_proj": "attention.self.value", "self_attn.out_proj": "attention.output.dense",
                 "norm1": "attention.output.LayerNorm", "mlp.fc1": "intermediate.dense",
                 "mlp.fc2": "output.dense", "norm2": "output.LayerNorm"}
        for index in range(self.num_hidden_layers):
            for ours, theirs in parts.items():
                for kind in ("weight", "bias"):
                    renamed[f"layer{index}.{ours}.{kind}"] = f"encoder.layer.{index}.{theirs}.{kind}"
        missing = [theirs for theirs in renamed.values() if prefix + theirs not in tensors]
        if missing:
            raise KeyError(f"BertModel: the checkpoint lacks {missing[:3]}{' ...' if len(missing) > 3 else ''}")
        return {ours: tensors[prefix + theirs] for ours, theirs in renamed.items()}

    def forward(self, input_ids, attention_mask=None, token_type_ids=None):
        """Hidden states (B, S, hidden_size) as an autograd Tensor. ``attention_mask`` (B, S):
        1 for tokens, 0 for padding (never attended to); ``token_type_ids`` default 0."""
        input_ids = np.asarray(input_ids)
        batch, length = input_ids.shape
        positions = np.broadcast_to(np.arange(length), (batch, length))
        types = np.zeros_like(input_ids) if token_type_ids is None else np.asarray(token_type_ids)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings(types)
        x = self.embedding_norm(x)
        padding = None if attention_mask is None else np.asarray(attention_mask) == 0  # True: masked out
        for index in range(self.num_hidden_layers):
            x = getattr(self, f"layer{index}")(x, key_padding_mask=padding)
        return x

    def extra_repr(self):
        return f"layers={self.num_hidden_layers}"


def mean_pool(hidden, attention_mask) -> np.ndarray:
    """The mean of each sequence's token states over its real tokens: (B, S, E), (B, S) -> (B, E)
    (sentence-transformers' ``pooling_mode_mean_tokens``)."""
    hidden = hidden.numpy() if isinstance(hidden, ag.Tensor) else np.asarray(hidden)
    weights = np.asarray(attention_mask, hidden.dtype)[..., None]
    return (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)


def normalize(embeddings: np.ndarray) -> np.ndarray:
    """Each row scaled to unit length (sentence-transformers' Normalize)."""
    return embeddings / np.maximum(np.linalg.norm(embeddings, axis=-1, keepdims=True), 1e-12)
