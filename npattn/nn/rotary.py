"""Rotary position embeddings as autograd functions of (B, S, H, D) tensors.

"rope" is the rotate-half convention of Llama in HF transformers: the head dimension
is split in halves ``(x1, x2)`` and position ``p`` rotates pair ``(x1[i], x2[i])`` by
the angle ``p * base**(-2i / D)``. A query at position ``m`` and a key at ``n`` then
score ``q.k`` as a function of ``m - n`` only.
"""
from __future__ import annotations

import numpy as np

from .. import autograd as ag


def rope_angles(positions, head_dim: int, base: float = 10000.0):
    """``(cos, sin)``, each (S, D) float64, for integer ``positions`` (S,): the angles
    ``positions[s] * base**(-2i / D)`` for i < D/2, repeated for both halves."""
    if head_dim % 2:
        raise ValueError(f"rope: the head dimension must be even; got {head_dim}")
    inverse_frequency = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.asarray(positions, np.float64)[:, None] * inverse_frequency[None, :]
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles), np.sin(angles)


def apply_rope(x, positions, base: float = 10000.0):
    """``x * cos + rotate_half(x) * sin`` for x (B, S, H, D) at ``positions`` (S,), where
    ``rotate_half(x) = concat(-x2, x1)``."""
    x = x if isinstance(x, ag.Tensor) else ag.Tensor(x)
    cos, sin = rope_angles(positions, x.shape[-1], base)
    xp = x.xp
    cos = xp.asarray(cos[:, None, :], dtype=x.dtype)  # (S, 1, D): broadcast over batch and heads
    sin = xp.asarray(sin[:, None, :], dtype=x.dtype)
    first, second = ag.split(x, 2, axis=-1)
    rotated = ag.concat([-second, first], axis=-1)
    return x * cos + rotated * sin
