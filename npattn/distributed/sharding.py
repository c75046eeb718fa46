"""Which global sequence positions each rank holds: contiguous or zigzag shards.

A rank's q, k and v hold its chunks of the sequence one after another along the sequence
axis; a chunk is ``(global start, local start, length)``.

- "contiguous": rank r holds one chunk, the positions after those of ranks 0..r-1 (ranks
  may hold different lengths).
- "zigzag": the sequence cut into 2R equal chunks; rank r holds chunks r and 2R-1-r. Under
  a causal mask every rank then has the same work (the early chunks see few keys, the late
  ones many), where contiguous shards leave rank 0 nearly idle and rank R-1 busiest.

:func:`shard` and :func:`unshard` move whole arrays between the two views, for callers
that hold the full sequence somewhere (tests, data loaders).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

SHARDINGS = ("contiguous", "zigzag")


class Chunk(NamedTuple):
    """A run of consecutive global positions a rank holds: ``global_start``, where it sits
    in the rank's own arrays (``local_start``) and its ``length``."""

    global_start: int
    local_start: int
    length: int


def check_sharding(sharding: str) -> str:
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
    return sharding


def chunks(rank: int, local_lengths: list[int], sharding: str) -> list[Chunk]:
    """The chunks of ``rank``, given every rank's local sequence length in rank order."""
    if sharding == "contiguous":
        return [Chunk(sum(local_lengths[:rank]), 0, local_lengths[rank])]
    half = local_lengths[rank] // 2
    ranks = len(local_lengths)
    return [Chunk(rank * half, 0, half), Chunk((2 * ranks - 1 - rank) * half, half, half)]


def shard(array, rank: int, ranks: int, axis: int, sharding: str = "zigzag"):
    """Rank ``rank``'s part of ``array`` (the whole sequence along ``axis``), a copy. For
    "zigzag" the sequence length must divide into 2 x ranks chunks; for "contiguous" the
    ranks hold ``np.array_split``'s parts."""
    check_sharding(sharding)
    length = array.shape[axis]
    if sharding == "contiguous":
        return np.array_split(array, ranks, axis=axis)[rank].copy()
    if length % (2 * ranks):
        raise ValueError(f"zigzag sharding cuts the sequence into 2 x {ranks} equal chunks; "
                         f"its length {length} does not divide")
    parts = np.split(array, 2 * ranks, axis=axis)
    return np.concatenate([parts[rank], parts[2 * ranks - 1 - rank]], axis=axis)


def unshard(parts, axis: int, sharding: str = "zigzag"):
    """The whole sequence from every rank's part (in rank order): :func:`shard`'s inverse."""
    check_sharding(sharding)
    if sharding == "contiguous":
        return np.concatenate(parts, axis=axis)
    ranks = len(parts)
    halves = [np.split(part, 2, axis=axis) for part in parts]
    ordered = [halves[r][0] for r in range(ranks)] + [halves[r][1] for r in reversed(range(ranks))]
    return np.concatenate(ordered, axis=axis)
