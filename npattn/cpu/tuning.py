"""The CPU kernels' tuning: tile sizes and the product path, per thread of control.

A :class:`Tuning` is an immutable value held in a :mod:`contextvars` variable, so
:func:`npattn.cpu.tile_sizes` and :func:`npattn.cpu.products` change it for the calling
thread (or asyncio task) inside their ``with`` block only: calls made meanwhile from
other threads keep their own settings. Every value is a runtime parameter of the
kernels (nothing recompiles), and results agree to rounding for any of them.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass

import numpy as np

# Tile sizes (rows of queries x columns of keys), runtime values of the kernels (no
# recompilation); :func:`npattn.cpu.tile_sizes` changes them. Measured on the 2-core
# AVX-512 machine with the micro-kernels (medians of 5, interleaved): the forward with
# 192 x 384 against 256 x 512 takes 101 against 129 ms at (4, 16, 1024, 64) causal (a
# smaller diagonal tile computes fewer masked scores), 542 against 577 ms at GQA
# (1, 32/8, 2048, 128), and is within noise elsewhere; 192 rows are whole 6-row blocks.
# The backward (one backward, best of 3 rounds interleaved over the candidates, with the
# vector exp): 64 x 192 against 64 x 128 takes 156-160 against 179-184 ms at
# (1, 8, 2048, 64), 300 against 309 at (4, 16, 1024, 64) and 1223 against 1340 at GQA
# (1, 32/8, 2048, 128); 128 x 128 and 96 x 192 were as fast or slower, 64 x 256 slower.
# Re-measured after the scratch and edge-band changes (same method, best of 5): 96 x 192
# against 64 x 192 won 5 of 6 runs, by 3-12%: 135-156 against 151-165 ms at
# (1, 8, 2048, 64), 289-344 against 293-354 at (4, 16, 1024, 64), 1079-1168 against
# 1109-1226 at GQA (1, 32/8, 2048, 128) (the one loss: 1168 against 1109).
FORWARD_TILES = (192, 384)
BACKWARD_TILES = (96, 192)
# A backward whose visible keys form a band (causal, or a sliding window) computes every
# score of each live tile and masks the invisible ones: one 96 x 192 tile held every key of
# a 128-key causal problem, its masked half computed and dropped, and a 128-key window's
# tiles are mostly outside it. 64 x 64 tiles compute fewer masked scores and pay more per
# tile, so a backward takes them where they compute at most 1/1.1 of the scores the default
# tiles would (scores_computed, a rule of the shape: the same bits on every machine).
# Measured on the 2-core Intel Emerald Rapids VM, one backward (vjp), 96 x 192 against
# 64 x 64, medians of interleaved rounds (the scores ratio in brackets):
# causal (1, 8, 128, 64) 505 / 444 us (1.33), (1, 8, 256, 64) 1355 / 1177 (1.30),
# (1, 8, 512, 64) 4371 / 4030 (1.19), (1, 8, 1024, 64) 12.2 / 11.5 ms (1.11), 2048 keys
# 1.00x (1.06); window (128, 0) at (1, 8, 2048, 64) 18.3 / 11.3 ms (1.95), (256, 0)
# 20.2 / 15.9 (1.48), (1024, 0) 37.1 / 34.6 (1.13), (128, 128) 34.4 / 15.4 (1.74),
# (512, 0) at (1, 8, 4096, 64) 71.5 / 60.6 (1.32); non-causal (equal scores) 64 x 64
# 1-2% slower (npattn/cpu/TUNING.md). Not measured on the Zen 4.
SMALL_BACKWARD_TILES = (64, 64)
SMALL_TILES_SCORE_RATIO = 1.1
# The forward runs a tile the causal or window edge cuts in bands of edge_band rows, each
# stopping at its last visible key, so only a window's left edge leaves masked scores to
# compute: from the start of the first key tile a query tile touches. A prefill forward
# with a sliding window takes 64 x 128 tiles where 192 x 384 ones would compute 1.2x the
# scores or more (scores_computed with the bands). Measured on the 2-core Emerald Rapids
# VM, one forward, medians of 7 interleaved rounds, 192 x 384 against 64 x 128 (the
# scores ratio in brackets): causal window (128, 0) at (1, 8, 2048, 64) 5.01 / 4.17 ms
# (1.84), (256, 0) 6.86 / 6.07 (1.65), (384, 0) 8.54 / 7.85 (1.24), (512, 0) 9.80 / 9.28 (1.26);
# (128, 0) at (1, 32/8, 2048, 128) 41.9 / 35.9 and at (4, 16, 1024, 64) 20.4 / 17.5;
# (512, 0) at (1, 32/8, 2048, 128) 75.1 / 73.8; causal without a window (ratio 1.00)
# 0.96x at 2048 keys. Only from WINDOWED_FORWARD_ROWS query rows (decode steps and short
# chunks keep their tiles: not measured).
SMALL_FORWARD_TILES = (64, 128)
SMALL_FORWARD_SCORE_RATIO = 1.2
WINDOWED_FORWARD_ROWS = 128
# Query tiles of at most DOT_ROWS rows take their scores from microkernels.dot_products.
# Measured on one core of the AVX2 VM, the forward kernel alone over 1024 cache-resident
# keys, ns per key with packed key tiles -> dot products, by rows per tile (GQA heads
# folded into rows), two runs: D = 128: 1 row 52-69 -> 25-39, 2 rows 67-83 -> 33-53,
# 4 rows 70-98 -> 45-53, 8 rows 104-109 -> 82-98, 12 rows 120-129 -> 107-124, 16 rows
# 157-161 -> 142-222 (a loss in one run); D = 64: 1 row 37 -> 22, 4 rows 38 -> 27,
# 8 rows 64 -> 57, 12 rows 62 -> 61, 16 rows 81 -> 89.
DOT_ROWS = 8
# The most a thread keeps of a kv head's key tiles packed (npattn.cpu.tiles.key_cache):
# a forward packs each key tile it reads (K^T; a bfloat16 one's in pairs, with its values
# in pairs of keys), and every query tile of a head and every head of a kv group reads the
# same tiles. Packing took 5% of a (4, 16, 1024, 64) causal forward on the 2-core Zen 4 VM
# (bfloat16), K^T 5.5% of a float32 one on the Zen 5 VM (npattn/cpu/TUNING.md).
KEY_CACHE_BYTES = 1 << 20


@dataclass(frozen=True)
class Tuning:
    """``forward`` / ``backward``: (query rows, keys) per tile (None: chosen by the
    problem's shape, :meth:`forward_tiles` and :meth:`backward_tiles`); ``edge_band``: rows per band
    of a tile the causal or window edge cuts; ``vector``: products on the register-blocked
    micro-kernels (True), SciPy's BLAS (False), or None: the micro-kernels where the CPU
    has AVX-512 or AVX2 (:data:`npattn.cpu.simd.MICROKERNELS`); ``dot_rows``: forwards of
    at most this many rows per kv head (Sq x H / Hkv: a decode step, the GQA heads of a
    group folded in) take their scores as dot products of the key rows, with no packed
    key tile (0: never); ``bf16_products``: a bfloat16 forward multiplies in bfloat16 where
    the CPU can (:func:`npattn.cpu.operands.bf16_products`; False: in float32; None: where
    that is the faster, :data:`npattn.cpu.simd.BF16_PAIRS_BY_DEFAULT`);
    ``key_cache_bytes``: the most a forward keeps per thread of a kv head's key tiles
    packed (K^T; bfloat16 pairs with their values) for its next query tile or head (0:
    none, each tile packed where read);
    ``converted_value_rows``: a forward reading 16-bit values a tile at a time converts
    them once for query tiles of at least this many rows and reads them in registers for
    shorter ones (None: as pays on this CPU, :func:`npattn.cpu.isa.converted_value_rows`)."""

    forward: tuple | None = None
    backward: tuple | None = None
    edge_band: int = 48
    vector: bool | None = None
    dot_rows: int = DOT_ROWS
    bf16_products: bool | None = None
    key_cache_bytes: int = KEY_CACHE_BYTES
    converted_value_rows: int | None = None

    def forward_tiles(self, visibility, q_len: int, kv_len: int, folded: bool = False) -> tuple:
        """The forward's (query rows, keys) per tile for a problem of ``q_len`` rows,
        ``kv_len`` keys and ``visibility`` (:class:`~npattn.core.masks.Visibility`):
        ``forward`` where set, else :data:`SMALL_FORWARD_TILES` for a prefill (at least
        :data:`WINDOWED_FORWARD_ROWS` rows, not ``folded`` GQA rows, which fit one default
        query tile: :mod:`npattn.cpu.folding`) with a window's left edge where
        :data:`FORWARD_TILES` would compute at least :data:`SMALL_FORWARD_SCORE_RATIO` times
        their scores (:func:`scores_computed` with bands of ``edge_band`` rows), else
        FORWARD_TILES."""
        if self.forward is not None:
            return self.forward
        if folded or visibility.window_left is None or q_len < WINDOWED_FORWARD_ROWS:
            return FORWARD_TILES
        return _tiles_for_band(visibility, q_len, kv_len, FORWARD_TILES, SMALL_FORWARD_TILES,
                               SMALL_FORWARD_SCORE_RATIO, self.edge_band)

    def backward_tiles(self, visibility, q_len: int, kv_len: int, folded: bool = False) -> tuple:
        """The backward's (query rows, keys) per tile (arguments as :meth:`forward_tiles`;
        the backward never folds): ``backward`` where set, else
        :data:`SMALL_BACKWARD_TILES` where they compute at most 1 /
        :data:`SMALL_TILES_SCORE_RATIO` of the scores :data:`BACKWARD_TILES` would
        (:func:`scores_computed`), else BACKWARD_TILES."""
        if self.backward is not None:
            return self.backward
        if visibility.window_left is None and visibility.window_right is None:  # every key visible
            return BACKWARD_TILES
        return _tiles_for_band(visibility, q_len, kv_len, BACKWARD_TILES, SMALL_BACKWARD_TILES,
                               SMALL_TILES_SCORE_RATIO)

    @property
    def pair_products(self) -> bool:
        """``bf16_products``, None resolved for this CPU."""
        if self.bf16_products is None:
            from .simd import BF16_PAIRS_BY_DEFAULT  # imports Numba: only when a kernel is about to run

            return BF16_PAIRS_BY_DEFAULT
        return self.bf16_products

    @property
    def value_rows_converted(self) -> int:
        """``converted_value_rows``, None resolved for this CPU."""
        if self.converted_value_rows is None:
            from .isa import converted_value_rows

            return converted_value_rows()
        return self.converted_value_rows

    @property
    def vector_products(self) -> bool:
        if self.vector is None:
            from .simd import MICROKERNELS  # imports Numba: only when a kernel is about to run

            return MICROKERNELS
        return self.vector


def scores_computed(visibility, q_len: int, kv_len: int, tiles: tuple, edge_band: int | None = None) -> int:
    """The scores a tiled pass over ``q_len`` rows and ``kv_len`` keys computes with
    ``tiles`` (query rows, keys), each query tile over the key tiles its rows' band of
    visible keys touches (``visibility``'s window and causal edge at its scalar shift:
    sinks, lengths and masks left out, as an estimate for choosing tiles). With
    ``edge_band`` (the forward's bands), each band of that many rows of a query tile stops
    at its last row's right edge (its last visible key, where it sees one) instead of at
    the end of that key's tile."""
    block_q, block_k = tiles
    starts = np.arange(0, q_len, block_q)
    stops = np.minimum(starts + block_q, q_len)
    first = _first_visible(visibility, q_len, kv_len, starts)
    tile_start = first // block_k * block_k
    if edge_band is None:
        last = _last_visible(visibility, q_len, kv_len, stops)
        keys = np.minimum(-(-last // block_k) * block_k, kv_len) - tile_start
        return int(np.sum(np.where(last > first, (stops - starts) * keys, 0)))
    total = 0
    for offset in range(0, block_q, edge_band):  # (the tiles' bands, all tiles at once)
        band_starts = np.minimum(starts + offset, stops)
        band_stops = np.minimum(band_starts + edge_band, stops)
        last = _last_visible(visibility, q_len, kv_len, band_stops)
        total += int(np.sum(np.where((last > first) & (band_stops > band_starts),
                                     (band_stops - band_starts) * (last - tile_start), 0)))
    return total


def _tiles_for_band(visibility, q_len, kv_len, default, small, ratio, edge_band=None) -> tuple:
    """``small`` where ``default`` tiles would compute at least ``ratio`` times the scores
    they compute over the problem's band of visible keys (:func:`scores_computed`), else
    ``default``."""
    default_scores, small_scores = (scores_computed(visibility, q_len, kv_len, tiles, edge_band)
                                    for tiles in (default, small))
    return small if 0 < ratio * small_scores <= default_scores else default


def _first_visible(visibility, q_len, kv_len, rows):
    """The first key that query rows ``rows`` (an array) may see, clipped to [0, kv_len]."""
    left = visibility.window_left
    shift = visibility.shift(q_len, kv_len)
    return np.zeros_like(rows) if left is None else np.clip(rows + shift - left, 0, kv_len)


def _last_visible(visibility, q_len, kv_len, row_stops):
    """One past the last key that the row before each of ``row_stops`` may see, in [0, kv_len]."""
    right = visibility.window_right
    shift = visibility.shift(q_len, kv_len)
    return np.full_like(row_stops, kv_len) if right is None else np.clip(row_stops + shift + right, 0, kv_len)


_CURRENT = contextvars.ContextVar("npattn_cpu_tuning", default=Tuning())


def current() -> Tuning:
    """The calling context's tuning."""
    return _CURRENT.get()


@contextlib.contextmanager
def tuned(**changes):
    """Run the block with :class:`Tuning` fields replaced by ``changes`` in this context."""
    token = _CURRENT.set(dataclasses.replace(_CURRENT.get(), **changes))
    try:
        yield
    finally:
        _CURRENT.reset(token)
