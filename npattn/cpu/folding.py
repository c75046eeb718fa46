"""Grouped-query attention forward with each kv head's query heads folded into its rows.

The ``group = H / Hkv`` query heads that read one kv head are the same arithmetic as
``Sq * group`` query rows of that kv head, position-major: folded row ``i * group + g``
is query head ``kv_head * group + g`` at position ``i``. Folded, the kernels pack each
key tile once per kv head rather than once per query head, read each K/V byte once per
group, and run the products on ``group`` times the rows. The kernels read a row's
position as ``row // group`` (``Int.ROW_GROUP``), so causal, windows, sinks and
``q_lengths`` and ``q_start`` (scaled by the group) keep their meaning, and every row's arithmetic is
unchanged: the bits are those of the unfolded kernels.

Measured on the 2-core VM, float32, causal: decode (1, 32/8, 1 x 4096, 128)
5.9 -> 2.2 ms and (16, 32/8, 1 x 1024, 128) 16.1 -> 10.9 ms; a chunked prefill
(1, 32/8, 16 x 4096, 128) 8.6 -> 7.0 ms (AVX2: 10.2 -> 7.8 ms). Folding applies while a
group's rows fit one query tile (Sq x group <= 192 by default): past that each tile
already reuses its keys over many rows, and 128 x 4 or 2048 x 4 rows ran no faster
folded (within 3%), so the copies of q and out would be spent for nothing.

It also needs nothing else per score to depend on the query head (no mask, bias or
dropout) and, past one query row, no left window bound nor attention sinks: their band
of keys starts where a tile's first or last row says, so folded tiles could cut the keys
elsewhere (the same result to rounding, not the same bits); a decode step's folded rows
share their one position, and so their band. ALiBi slopes and sink logits, one value per
query head, fold: the kernels read folded row ``i``'s head as ``h * group + i % group``
(``h`` the kv head), so each row gets its own head's slope and logit. For one query row
the fold is a view of q; for more, q and out are reordered (a copy of each, small beside
K and V).

Only the forward folds: the backward's dK/dV would then sum a group's rows in one product
rather than head by head, a different rounding, and decode steps are rarely trained.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from ..core.options import FOLD_CONDITIONS


def foldable(problem, tuning) -> bool:
    """Whether ``problem``'s forward folds under ``tuning``: a GQA group whose rows fit one
    query tile, no packed rows, and every option as the table's ``folds`` allows."""
    rows = tuning.forward_tiles(problem.visibility, problem.q_len, problem.kv_len, folded=True)[0]
    return (problem.group_size > 1 and problem.q_len * problem.group_size <= rows
            and not problem.packed_rows and all(allows(problem) for allows in FOLD_CONDITIONS))


def fold(problem):
    """The folded problem: q (B, Hkv, Sq * group, D), bhsd, rows position-major."""
    q = fold_rows(problem.q, fold_shape(problem))
    # positions stay those of the unfolded rows: the shift is fixed before q_len grows
    visibility = dataclasses.replace(problem.visibility,
                                     q_offset=problem.visibility.shift(problem.q_len, problem.kv_len))
    return dataclasses.replace(problem, q=q, layout="bhsd", visibility=visibility,
                               **FoldedArrays.of(problem, problem.group_size)._asdict())


def fold_shape(problem) -> tuple:
    """(B, Hkv, group, Sq, D): q's shape with its heads split into kv heads and groups."""
    return (problem.batch, problem.kv_heads, problem.group_size, problem.q_len, problem.head_dim)


def fold_rows(q, shape):
    """q (B, H, Sq, D) as (B, Hkv, Sq * group, D), rows position-major; ``shape``:
    :func:`fold_shape`. A view for Sq = 1, else a copy."""
    batch, kv_heads, group, q_len, head_dim = shape
    if q_len == 1:  # a decode step: folded row g is head g of the group, one reshape
        return q.reshape(batch, kv_heads, group, head_dim)
    return q.reshape(shape).swapaxes(2, 3).reshape(batch, kv_heads, q_len * group, head_dim)


class FoldedArrays(NamedTuple):
    """The option arrays a foldable problem can have, its q_lengths and q_start counted in
    folded rows (what :meth:`npattn.cpu.operands.OperandPlan.operands` reads of a
    problem); row shifts stay in positions, which a folded row's index divides into."""

    q_lengths: Any
    kv_lengths: Any
    q_start: Any
    kv_start: Any
    row_shifts: Any
    block_table: Any
    k_scale: Any
    v_scale: Any
    alibi_slopes: Any  # (per query head, as given: the kernels read a folded row's head)
    sink_logits: Any

    @classmethod
    def of(cls, arrays, group: int) -> "FoldedArrays":
        """``arrays``' (a problem's) with its rows counted ``group`` to a position."""
        def rows(values):
            return None if values is None else values * group
        return cls(rows(arrays.q_lengths), arrays.kv_lengths, rows(arrays.q_start), arrays.kv_start,
                   arrays.row_shifts, arrays.block_table, arrays.k_scale, arrays.v_scale, arrays.alibi_slopes,
                   arrays.sink_logits)

    # what a foldable problem never has (foldable)
    bias = mask = None
    seed = 0


def unfold_rows(array, shape):
    """A folded (B, Hkv, Sq * group, ...) result as (B, H, Sq, ...): a view for Sq = 1;
    ``shape``: :func:`fold_shape`."""
    batch, kv_heads, group, q_len, _ = shape
    rest = tuple(array.shape[3:])
    if q_len == 1:  # a decode step: one reshape (three views cost a small call 1 us)
        return array.reshape((batch, kv_heads * group, 1) + rest)
    split = array.reshape((batch, kv_heads, q_len, group) + rest).swapaxes(2, 3)
    return split.reshape((batch, kv_heads * group, q_len) + rest)


def in_layout(out, layout: str):
    """``out`` (B, H, Sq, Dv) as a bhsd view of memory in ``layout``'s order, as the
    unfolded kernels write it (the user gets a contiguous array back)."""
    if layout == "bshd" and not out.transpose(0, 2, 1, 3).flags.c_contiguous:
        return np.ascontiguousarray(out.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    return out
