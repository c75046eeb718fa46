"""The dropout mask: a counter-based hash, so every backend draws the same bits.

The keep/drop decision for one attention probability is a pure function of
``(seed, b, h, i, j)``: the batch index, the *query* head index, the query row
index and the key index (0-based array indices, the same in both layouts), each plus
the call's ``dropout_offset`` (0 by default; a block of a larger problem passes its
place in it, so that it draws the larger problem's mask, as ring attention's blocks do).
No random state is carried between calls, so the reference, the CPU kernels
and the CUDA kernels reproduce one another bit for bit, tile order does not
matter, and the backward pass regenerates the forward's mask instead of
storing it.

Specification (all arithmetic on unsigned 32-bit integers, wrapping mod 2**32)::

    fmix32(x):                      # MurmurHash3's finalizer, a bijection
        x ^= x >> 16;  x *= 0x85EBCA6B
        x ^= x >> 13;  x *= 0xC2B2AE35
        x ^= x >> 16;  return x

    seed_lo = seed mod 2**32;  seed_hi = (seed >> 32) mod 2**32   # seed taken mod 2**64
    b, h, i, j = (b, h, i, j) + dropout_offset, each mod 2**32
    x = 0
    for word in (seed_lo, seed_hi, b, h, i, j):
        x = fmix32((x ^ word) + 0x9E3779B9)

    threshold = floor(dropout_p * 2**24 + 0.5)      # an integer in [0, 2**24]
    keep      = (x >> 8) >= threshold               # P(keep) = 1 - threshold / 2**24

Kept probabilities are multiplied by ``1 / (1 - dropout_p)`` (inverted dropout).
A kernel absorbs the first five words once per query row and pays one
``fmix32`` per score. The threshold is computed once, here, in float64, and
handed to every backend as an integer, so no backend compares floats.
"""
from __future__ import annotations

import contextlib

MIX_INCREMENT = 0x9E3779B9
MIX_MULTIPLIER_1 = 0x85EBCA6B
MIX_MULTIPLIER_2 = 0xC2B2AE35
THRESHOLD_BITS = 24
_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF


def keep_threshold(dropout_p: float) -> int:
    """The integer threshold of the specification: keep when ``hash >> 8 >= threshold``."""
    return int(dropout_p * 2**THRESHOLD_BITS + 0.5)


def seed_words(seed: int) -> tuple[int, int]:
    """``(seed_lo, seed_hi)``: the seed reduced mod 2**64 and split into 32-bit words."""
    seed &= _MASK64
    return seed & _MASK32, seed >> 32


def fmix32(xp, x):
    """MurmurHash3's 32-bit finalizer on a uint32 array of module ``xp``, wrapping."""
    x = x ^ (x >> xp.uint32(16))
    x = x * xp.uint32(MIX_MULTIPLIER_1)
    x = x ^ (x >> xp.uint32(13))
    x = x * xp.uint32(MIX_MULTIPLIER_2)
    return x ^ (x >> xp.uint32(16))


def absorb(xp, state, word):
    """One absorption step of the specification: ``fmix32((state ^ word) + 0x9E3779B9)``."""
    return fmix32(xp, (state ^ word) + xp.uint32(MIX_INCREMENT))


def keep_mask(xp, seed: int, dropout_p: float, batch: int, heads: int, q_len: int, kv_len: int,
              offset=(0, 0, 0, 0)):
    """Boolean keep mask of shape (batch, heads, q_len, kv_len) for array module ``xp``;
    ``offset`` (the ``dropout_offset`` option) is added to (b, h, i, j) before hashing."""
    seed_lo, seed_hi = seed_words(seed)
    with _wrapping_uint32(xp):
        state = xp.zeros((1, 1, 1, 1), dtype=xp.uint32)
        state = absorb(xp, state, xp.uint32(seed_lo))
        state = absorb(xp, state, xp.uint32(seed_hi))
        for axis, (size, start) in enumerate(zip((batch, heads, q_len, kv_len), offset)):
            shape = [1, 1, 1, 1]
            shape[axis] = size
            # uint64 first: an offset near 2**32 wraps mod 2**32, as the spec's words do
            index = ((xp.arange(size, dtype=xp.uint64) + xp.uint64(start)) & xp.uint64(_MASK32)).astype(xp.uint32)
            index = index.reshape(shape)
            state = absorb(xp, state, index)
    return (state >> xp.uint32(8)) >= keep_threshold(dropout_p)



def _wrapping_uint32(xp):
    """Silence NumPy's overflow warnings: uint32 wrap-around is the specified arithmetic."""
    return xp.errstate(over="ignore") if hasattr(xp, "errstate") else contextlib.nullcontext()
