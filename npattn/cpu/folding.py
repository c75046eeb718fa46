"""Decode steps of grouped-query attention as one query head per kv head.

A single query row (Sq = 1, a decode step) of H query heads over Hkv kv heads is the
same arithmetic as ``group = H / Hkv`` query rows of Hkv heads: query head
``kv_head * group + g`` becomes row ``g`` of kv head ``kv_head``. Folded, the kernels
pack each key tile once per kv head rather than once per query head, read each K/V byte
once per group, and run the products on ``group`` rows at once. Measured on the 2-core
VM, float32, causal: (1, 32/8, 1 x 4096, 128) 5.9 -> 2.2 ms and (16, 32/8, 1 x 1024, 128)
16.1 -> 10.9 ms, with the same bits (each row's arithmetic is unchanged).

Folding applies when nothing depends on the query head or position beyond that: no
mask, bias, ALiBi, sink logits, dropout or left window bound. A single row sits at the
last position (bottom-right), so no key lies to its right: causal and a right window
bound hide nothing and are dropped (and sinks only act with a left bound).
``q_lengths`` (0 or 1 per batch) scale by the group.

Only the forward folds: the backward's dK/dV would then sum a group's rows in one product
rather than head by head, a different rounding, and decode steps are rarely trained.
"""
from __future__ import annotations

import dataclasses

from ..masks import Visibility


def foldable(problem) -> bool:
    return (problem.q_len == 1 and problem.group_size > 1 and problem.mask is None and problem.bias is None
            and problem.alibi_slopes is None and problem.sink_logits is None and problem.dropout_p == 0
            and problem.visibility.window_left is None)


def fold(problem):
    """The folded problem: q (B, Hkv, group, D) as a view of q (B, H, 1, D), bhsd layout."""
    batch, kv_heads, group = problem.batch, problem.kv_heads, problem.group_size
    q = problem.q.reshape(batch, kv_heads, group, problem.head_dim)
    q_lengths = None if problem.q_lengths is None else problem.q_lengths * group
    return dataclasses.replace(problem, q=q, layout="bhsd", visibility=Visibility(), q_lengths=q_lengths)


def unfold_rows(array, problem):
    """A folded (B, Hkv, group, X) or (B, Hkv, group) result as (B, H, 1, X) or (B, H, 1)."""
    shape = (problem.batch, problem.heads, 1) + tuple(array.shape[3:])
    return array.reshape(shape)
