"""Rotary position embeddings as autograd functions of (B, S, H, D) tensors: "rope"
(HF Llama) and "xpos" (torchscale).

"rope" is the rotate-half convention of Llama in HF transformers: the head dimension
is split in halves ``(x1, x2)`` and position ``p`` rotates pair ``(x1[i], x2[i])`` by
the angle ``p * base**(-2i / D)``. A query at position ``m`` and a key at ``n`` then
score ``q.k`` as a function of ``m - n`` only.

"xpos" is torchscale's XPOS: the rotation pairs adjacent lanes ``(x[2i], x[2i+1])``,
and queries are scaled by ``zeta ** (t / scale_base)`` and keys by its inverse, so
the product decays with distance and still depends on ``m - n`` only.
"""
from __future__ import annotations

import functools

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


@functools.lru_cache(maxsize=16)
def rope_tables(positions: int, head_dim: int, base: float = 10000.0):
    """``(cos, sin)``, each (positions, D/2) float64, read-only: the angles of
    :func:`rope_angles` for positions ``0 .. positions - 1``, one column per rotated pair, as
    :func:`npattn.attention_with_kvcache` takes them (``rotary_cos``, ``rotary_sin``). Kept:
    a decode loop asks for the same tables at every step."""
    cos, sin = rope_angles(np.arange(positions), head_dim, base)
    tables = np.ascontiguousarray(cos[:, :head_dim // 2]), np.ascontiguousarray(sin[:, :head_dim // 2])
    for table in tables:
        table.flags.writeable = False
    return tables


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


def xpos_factors(length: int, head_dim: int, offset: int = 0, downscale: bool = False, scale_base: float = 512.0):
    """``(cos, sin)``, each (length, D) float64, of torchscale's XPOS for the last ``length``
    of ``length + offset`` positions: the rotation angles ``p * 10000**(-2i / D)`` (p from 0)
    times the decay ``zeta_i ** (t / scale_base)``, where ``zeta_i = (2i + 0.4 D) / (1.4 D)``
    and t counts positions from the middle of the ``length + offset`` (its inverse with
    ``downscale``, for keys); each column is repeated for the two lanes of a pair."""
    if head_dim % 2:
        raise ValueError(f"xpos: the head dimension must be even; got {head_dim}")
    total = length + offset
    half = head_dim // 2
    zeta = (np.arange(0, head_dim, 2) + 0.4 * head_dim) / (1.4 * head_dim)
    first = -total // 2
    decay = zeta[None, :] ** (np.arange(first, first + total)[:, None] / scale_base)
    angles = np.arange(total)[:, None] * (1.0 / 10000 ** (np.arange(half) / half))[None, :]
    decay, angles = decay[-length:], angles[-length:]
    if downscale:
        decay = 1.0 / decay
    interleave = lambda m: np.repeat(m, 2, axis=-1)  # [a0, a0, a1, a1, ...]
    return interleave(np.cos(angles) * decay), interleave(np.sin(angles) * decay)


def apply_xpos(x, offset: int = 0, downscale: bool = False, scale_base: float = 512.0):
    """torchscale's XPOS on x (B, S, H, D): ``x * cos + rotate_every_two(x) * sin`` with the
    decayed factors of :func:`xpos_factors`, where ``rotate_every_two`` maps each pair
    ``(x[2i], x[2i+1])`` to ``(-x[2i+1], x[2i])``. Queries at the end of a longer key
    sequence pass ``offset`` = the positions before them."""
    x = x if isinstance(x, ag.Tensor) else ag.Tensor(x)
    batch, length, heads, head_dim = x.shape
    cos, sin = xpos_factors(length, head_dim, offset, downscale, scale_base)
    xp = x.xp
    cos = xp.asarray(cos[:, None, :], dtype=x.dtype)
    sin = xp.asarray(sin[:, None, :], dtype=x.dtype)
    pairs = x.reshape(batch, length, heads, head_dim // 2, 2)
    rotated = ag.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(batch, length, heads, head_dim)
    return x * cos + rotated * sin
