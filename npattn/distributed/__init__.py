"""Exact attention over a sequence split across processes: ring attention on MPI.

- ``ring.py``: :func:`ring_attention` and :func:`ring_attention_vjp`, mirroring
  :func:`npattn.attention` and :func:`npattn.attention_vjp` for a rank's shard.
- ``heads.py``: the head-parallel strategy (``strategy="heads"``), all-to-all.
- ``sharding.py``: which positions each rank holds ("contiguous" or "zigzag"), and
  :func:`shard` / :func:`unshard` between whole arrays and a rank's part.

Needs mpi4py (and an MPI library: the ``mpich`` wheel from PyPI serves); nothing in
npattn imports it until a ring call runs.
"""
from .ring import ring_attention, ring_attention_vjp
from .sharding import SHARDINGS, shard, unshard

__all__ = ["ring_attention", "ring_attention_vjp", "shard", "unshard", "SHARDINGS"]
