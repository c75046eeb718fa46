"""Short queries over long keys: each query tile's keys cut into ranges that run as separate
work items, then merged by their log-sum-exp (the CPU's flash-decoding).

A decode step is one query tile per (batch, kv head) once folded (:mod:`.folding`): one
work item at B = 1 with MQA, where every core but one would idle through the whole key
scan. Split into ``n`` ranges, each item computes its range's output rows ``O_c`` and
``lse_c``, and the merge takes ``lse = log sum_c exp(lse_c)`` and
``O = sum_c exp(lse_c - lse) O_c``.

The split depends on the shapes only, never on the thread count, and the merge sums the
ranges in order, so the bits are the same on every run and with any number of threads
(they differ from the unsplit call's by rounding). Rows with no visible key in a range
contribute exp(-inf) = 0; rows with none at all keep out 0 and lse -inf.

Not split: calls with more than one query tile per head (enough items already, and the
ranges' outputs would cost a full extra pass over O), windows of too few keys for two
ranges (:func:`_visible_keys`), calls that return the weights
(they need the whole row's lse first). Sink logits enter the merge, not a range: a row
that sees no key in any range must still give lse -inf, which a range holding the sink
could not tell (:func:`~npattn.core.merging.merge`'s ``sink``).
"""
from __future__ import annotations

from ..core.merging import merge  # noqa: F401  (the driver's merge of the ranges)

# Items enough to keep this many cores busy (like the backward's key chunks): fixed, so
# that the split, and with it the bits, never depend on the machine.
SPLIT_ITEMS = 8
# Keys per range at least, so a range's fixed costs (its rows' set-up, its share of the
# merge) stay small against its scan: 1024 keys x 128 dims is 0.5 MiB of float32 K.
MIN_SPLIT_KEYS = 1024


def key_splits(problem, tiles, heads_per_item: int = 1) -> tuple[int, int]:
    """``(ranges, keys per range)`` for ``problem`` with ``tiles`` = (block_q, block_k) and
    ``heads_per_item`` heads per work item (:func:`npattn.cpu.operands.head_group`: from
    the shape alone): ``(1, Sk)`` when it does not split. Ranges are whole key tiles,
    none empty."""
    block_q, block_k = tiles
    kv_len = problem.kv_len
    whole = (1, max(kv_len, 1))
    if problem.q_len > block_q or problem.return_weights or problem.packed_rows:
        return whole
    items = problem.batch * problem.heads // heads_per_item
    ranges = min(-(-SPLIT_ITEMS // max(items, 1)), _visible_keys(problem) // MIN_SPLIT_KEYS)
    if ranges < 2:
        return whole
    key_tiles = -(-kv_len // block_k)
    tiles_per_range = -(-key_tiles // ranges)
    return -(-key_tiles // tiles_per_range), tiles_per_range * block_k


def _visible_keys(problem) -> int:
    """The most keys a query tile's rows see together: all of them, or, in a window
    bounded on both sides, the band its rows span and the sinks. The ranges are cut from
    the whole key sequence, so a window narrower than two ranges would leave every range
    but one empty and the merge for nothing (a gpt-oss-like decode step, (4, 32/8, 1 x
    2048, 128) with a 128-key window: 214-222 us split against 146-148 unsplit)."""
    visibility = problem.visibility
    if visibility.window_left is None or visibility.window_right is None:
        return problem.kv_len
    band = visibility.window_left + visibility.window_right + problem.q_len
    return max(0, min(problem.kv_len, band + visibility.sinks))
