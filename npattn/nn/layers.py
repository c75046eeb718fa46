"""Building blocks: Linear, Embedding, LayerNorm, RMSNorm, Dropout and MLP.

Every layer takes ``dtype`` (default "float32") and ``seed`` (its parameters are drawn
from ``numpy.random.default_rng(seed)``); shapes are batch-first, features last.
"""
from __future__ import annotations

import numpy as np

from .. import autograd as ag
from ..core import arguments
from .module import Module, parameter, xavier_uniform


class Linear(Module):
    """``y = x @ weight.T + bias``: x (..., in_features) -> (..., out_features); weight
    (out_features, in_features), Xavier-uniform; bias zeros."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, dtype="float32",
                 seed=None):
        super().__init__()
        in_features = arguments.size("Linear", "in_features", in_features)
        out_features = arguments.size("Linear", "out_features", out_features)
        dtype = arguments.float_dtype("Linear", "dtype", dtype)
        self.in_features, self.out_features = in_features, out_features
        self.weight = parameter((out_features, in_features), dtype)
        self.bias = parameter((out_features,), dtype) if bias else None
        self.reset_parameters(seed)

    def _reset_own(self, rng):
        xavier_uniform(rng, self.weight)
        if self.bias is not None:
            self.bias.data[...] = 0

    def forward(self, x):
        return ag.linear(x, self.weight, self.bias)

    def extra_repr(self):
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}"


class Embedding(Module):
    """Rows of a (num_embeddings, embedding_dim) table, drawn from N(0, 1) as torch's:
    integer indices (...) -> (..., embedding_dim)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, dtype="float32", seed=None):
        super().__init__()
        num_embeddings = arguments.size("Embedding", "num_embeddings", num_embeddings)
        embedding_dim = arguments.size("Embedding", "embedding_dim", embedding_dim)
        dtype = arguments.float_dtype("Embedding", "dtype", dtype)
        self.weight = parameter((num_embeddings, embedding_dim), dtype)
        self.reset_parameters(seed)

    def _reset_own(self, rng):
        self.weight.data[...] = rng.standard_normal(self.weight.shape)

    def forward(self, indices):
        return ag.embedding(indices, self.weight)

    def extra_repr(self):
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}"


class LayerNorm(Module):
    """Layer normalization over the last axis, with a (dim,) weight (ones) and bias (zeros)."""

    def __init__(self, dim: int, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True, *,
                 dtype="float32", seed=None):
        super().__init__()
        dim, eps = arguments.size("LayerNorm", "dim", dim), arguments.positive("LayerNorm", "eps", eps)
        dtype = arguments.float_dtype("LayerNorm", "dtype", dtype)
        self.dim, self.eps = dim, eps
        self.weight = parameter((dim,), dtype) if elementwise_affine else None
        self.bias = parameter((dim,), dtype) if elementwise_affine and bias else None
        self.reset_parameters(seed)

    def _reset_own(self, rng):
        if self.weight is not None:
            self.weight.data[...] = 1
        if self.bias is not None:
            self.bias.data[...] = 0

    def forward(self, x):
        return ag.layer_norm(x, self.weight, self.bias, eps=self.eps)

    def extra_repr(self):
        return f"{self.dim}, eps={self.eps}"


class RMSNorm(Module):
    """Root-mean-square normalization over the last axis with a (dim,) weight (ones);
    ``eps`` None is the dtype's machine epsilon (torch's default)."""

    def __init__(self, dim: int, eps: float | None = None, *, dtype="float32", seed=None):
        super().__init__()
        dim, dtype = arguments.size("RMSNorm", "dim", dim), arguments.float_dtype("RMSNorm", "dtype", dtype)
        eps = None if eps is None else arguments.positive("RMSNorm", "eps", eps)
        self.dim, self.eps = dim, eps
        self.weight = parameter((dim,), dtype)
        self.reset_parameters(seed)

    def _reset_own(self, rng):
        self.weight.data[...] = 1

    def forward(self, x):
        return ag.rms_norm(x, self.weight, eps=self.eps)

    def extra_repr(self):
        return f"{self.dim}, eps={self.eps}"


class Dropout(Module):
    """Dropout with probability ``p`` in training mode, the identity in eval mode. Each call
    draws its mask's seed from the module's own generator (``seed``), so a seeded module
    repeats its sequence of masks."""

    def __init__(self, p: float = 0.5, *, seed=None):
        super().__init__()
        self.p = arguments.probability("Dropout", "p", p)
        self._rng = np.random.default_rng(seed)

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        return ag.dropout(x, self.p, seed=int(self._rng.integers(2 ** 63)))

    def extra_repr(self):
        return f"p={self.p}"


_ACTIVATIONS = {"gelu": ag.gelu, "relu": ag.relu, "tanh": ag.tanh,
                "gelu_tanh": lambda x: ag.gelu(x, approximate="tanh")}


class MLP(Module):
    """``fc2(dropout(activation(fc1(x))))``: dim -> hidden_dim -> dim (a transformer's
    feed-forward block)."""

    def __init__(self, dim: int, hidden_dim: int, activation: str = "gelu", bias: bool = True,
                 dropout: float = 0.0, *, dtype="float32", seed=None):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"MLP: activation must be one of {sorted(_ACTIVATIONS)}; got {activation!r}")
        dim, hidden_dim = arguments.size("MLP", "dim", dim), arguments.size("MLP", "hidden_dim", hidden_dim)
        dropout = arguments.probability("MLP", "dropout", dropout)
        rng = np.random.default_rng(seed)
        self.activation = activation
        self.fc1 = Linear(dim, hidden_dim, bias, dtype=dtype, seed=rng)
        self.fc2 = Linear(hidden_dim, dim, bias, dtype=dtype, seed=rng)
        self.dropout = Dropout(dropout, seed=rng)

    def forward(self, x):
        return self.fc2(self.dropout(_ACTIVATIONS[self.activation](self.fc1(x))))

    def extra_repr(self):
        return f"activation={self.activation!r}"
