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
BACKWARD_TILES = (96, 192)
# A causal backward over few keys computes much of its one or two tiles' area only to mask
# it: at 128 keys one 96 x 192 tile holds every key, and the masked half is computed and
# dropped, where 64 x 64 tiles skip the dead quarter. Those small problems take 64 x 64
# (a rule of the shape, so the same bits on every machine). Measured on the 2-core Intel
# Emerald Rapids VM, one causal backward (vjp), medians of 9 rounds interleaved over the
# candidates, 96 x 192 against 64 x 64: (1, 8, 128, 64) 505 against 444 us, (1, 8, 256, 64)
# 1355 / 1177, (1, 8, 512, 64) 4371 / 4030, (4, 8, 192, 64) 3568 / 2939, (1, 32/8, 256, 128)
# 9647 / 7762; at 1024 keys 1.02x, at 2048 none; non-causal, 64 x 64 was 1-2% slower
# (npattn/cpu/TUNING.md). Not measured on the Zen 4.
SMALL_CAUSAL_BACKWARD_TILES = (64, 64)
SMALL_CAUSAL_KEYS = 512
# Query tiles of at most DOT_ROWS rows take their scores from microkernels.dot_products.
# Measured on one core of the AVX2 VM, the forward kernel alone over 1024 cache-resident
# keys, ns per key with packed key tiles -> dot products, by rows per tile (GQA heads
# folded into rows), two runs: D = 128: 1 row 52-69 -> 25-39, 2 rows 67-83 -> 33-53,
# 4 rows 70-98 -> 45-53, 8 rows 104-109 -> 82-98, 12 rows 120-129 -> 107-124, 16 rows
# 157-161 -> 142-222 (a loss in one run); D = 64: 1 row 37 -> 22, 4 rows 38 -> 27,
# 8 rows 64 -> 57, 12 rows 62 -> 61, 16 rows 81 -> 89.
DOT_ROWS = 8
# The most a thread keeps of a kv head's key tiles packed (npattn.cpu.tiles.key_cache):
# a bfloat16 forward packs each key tile it reads (K^T in pairs, and its values in pairs
# of keys), and every query tile of a head and every head of a kv group reads the same
# tiles. Packing took 5% of a (4, 16, 1024, 64) causal forward on the 2-core Zen 4 VM.
KEY_CACHE_BYTES = 1 << 20


@dataclass(frozen=True)
class Tuning:
    """``forward`` / ``backward``: (query rows, keys) per tile (``backward`` None: chosen by
    the problem's shape, :meth:`backward_tiles`); ``edge_band``: rows per band
    of a tile the causal or window edge cuts; ``vector``: products on the register-blocked
    micro-kernels (True), SciPy's BLAS (False), or None: the micro-kernels where the CPU
    has AVX-512 or AVX2 (:data:`npattn.cpu.simd.MICROKERNELS`); ``dot_rows``: forwards of
    at most this many rows per kv head (Sq x H / Hkv: a decode step, the GQA heads of a
    group folded in) take their scores as dot products of the key rows, with no packed
    key tile (0: never); ``bf16_products``: a bfloat16 forward multiplies in bfloat16 where
    the CPU can (:func:`npattn.cpu.operands.bf16_products`; False: in float32; None: where
    that is the faster, :data:`npattn.cpu.simd.BF16_PAIRS_BY_DEFAULT`);
    ``key_cache_bytes``: the most a bfloat16 forward keeps per thread of a kv head's key
    tiles packed for its next query tile or head (0: none, each tile packed where read)."""

    forward: tuple = (192, 384)
    backward: tuple | None = None
    edge_band: int = 48
    vector: bool | None = None
    dot_rows: int = DOT_ROWS
    bf16_products: bool | None = None
    key_cache_bytes: int = KEY_CACHE_BYTES

    def backward_tiles(self, causal: bool, kv_len: int) -> tuple:
        """The backward's (query rows, keys) per tile: ``backward`` where set, else
        :data:`SMALL_CAUSAL_BACKWARD_TILES` for a causal problem of at most
        :data:`SMALL_CAUSAL_KEYS` keys and :data:`BACKWARD_TILES` for the rest."""
        if self.backward is not None:
            return self.backward
        return SMALL_CAUSAL_BACKWARD_TILES if causal and kv_len <= SMALL_CAUSAL_KEYS else BACKWARD_TILES

    @property
    def pair_products(self) -> bool:
        """``bf16_products``, None resolved for this CPU."""
        if self.bf16_products is None:
            from .simd import BF16_PAIRS_BY_DEFAULT  # imports Numba: only when a kernel is about to run

            return BF16_PAIRS_BY_DEFAULT
        return self.bf16_products

    @property
    def vector_products(self) -> bool:
        if self.vector is None:
            from .simd import MICROKERNELS  # imports Numba: only when a kernel is about to run

            return MICROKERNELS
        return self.vector


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
