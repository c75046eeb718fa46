"""Per-thread scratch of the kernels, allocated in Python and passed in.

Each thread of :func:`npattn.cpu.threads.run_items` gets its own set, sized for the
largest tile from the parameter array ``ints`` (see :mod:`npattn.cpu.operands`):
one score tile and one packed key and value tile (and a bfloat16 forward's kept key
tiles, up to 1 MiB), never a sequence x sequence array. Allocating here rather than with ``np.empty`` inside the kernels spares
the first call's compile Numba's allocation functions, one per dtype, each a
function of its own that every kernel links and optimizes again.
"""
from __future__ import annotations

import functools
import math
import threading
from typing import Callable

import numpy as np

from .operands import Int, cache_slot_words

# Cache-line alignment: the micro-kernels' 64-byte vector loads and stores would each
# touch two lines where a row starts off a line (NumPy's own alignment is 16 bytes
# below its large-allocation threshold).
_ALIGN_BYTES = 64


# Small scratch sets are kept per calling thread and handed out again by the next call's
# requests for the same sizes (see :func:`begin_reuse`): a small call's allocations
# cost more than its kernel. Sets up to _REUSE_BYTES are kept, the most recent first, as
# long as a thread keeps at most _KEPT_BYTES and _REUSE_KINDS sizes; larger ones (a big
# problem's tiles) are allocated fresh. (A fresh set of a few hundred KiB is mapped and
# page-faulted in anew: measured on the 2-core Zen 4 VM, a (1, 8, 128 x 128, 64) causal
# float16 forward, whose set holds its 16-bit tiles converted, 302 us against float32's
# 244 while only sets up to 256 KiB were kept, 251 against 238 with 512 KiB.)
_REUSE_BYTES = 1 << 20
_KEPT_BYTES = 2 << 20
_REUSE_KINDS = 8
_ARENA = threading.local()


def begin_reuse() -> None:
    """From here until :func:`end_reuse`, this thread's small scratch requests return sets
    made by earlier requests of the same sizes: the n-th request for some sizes gets the
    n-th set ever made for them. The kernels that got them must be done by
    :func:`end_reuse`, as run_items ensures. (Two calls rather than a context manager: a
    ``with`` of contextlib costs a small call 3 us.)"""
    if getattr(_ARENA, "sets", None) is None:
        _ARENA.sets = {}  # specs -> [set, set, ...], the most recently used specs last
    _ARENA.taken = {}     # specs -> sets handed out since begin_reuse


def end_reuse() -> None:
    _ARENA.taken = None


def scratch_set(specs: tuple) -> tuple:
    """One uninitialized 1-D array per ``(size, dtype)`` of ``specs``, each starting on
    a cache line; between :func:`begin_reuse` and :func:`end_reuse`, a kept set of these
    sizes that this span has not handed out yet, when there is one and they are small."""
    taken = getattr(_ARENA, "taken", None)
    if taken is not None:
        index = taken.get(specs, 0)
        taken[specs] = index + 1
        kept = _ARENA.sets.get(specs)
        if kept is not None and index < len(kept):
            return kept[index]
    arrays = tuple(_allocate(size, np.dtype(dtype)) for size, dtype in specs)
    if taken is None or sum(array.nbytes for array in arrays) > _REUSE_BYTES:
        return arrays
    sets = _ARENA.sets
    kept = sets.pop(specs, [])
    kept.append(arrays)
    sets[specs] = kept  # most recent last
    while len(sets) > _REUSE_KINDS or (len(sets) > 1 and _kept_bytes(sets) > _KEPT_BYTES):
        del sets[next(iter(sets))]
    return arrays


def _kept_bytes(sets: dict) -> int:
    """The bytes of every set a thread keeps."""
    return sum(len(kept) * sum(array.nbytes for array in kept[0]) for kept in sets.values())


def fresh_set(specs: tuple) -> tuple:
    """A new set of :func:`scratch_set`'s arrays (each on a cache line), outside any arena:
    for an owner that keeps it (a plan's inline calls)."""
    return tuple(_allocate(size, np.dtype(dtype)) for size, dtype in specs)


def _allocate(size: int, dtype: np.dtype) -> np.ndarray:
    raw = np.empty(size * dtype.itemsize + _ALIGN_BYTES, np.uint8)
    # (``raw.ctypes.data``: 1 us on NumPy 2, where the array interface's dict took 2)
    start = -raw.ctypes.data % _ALIGN_BYTES
    return raw[start:start + size * dtype.itemsize].view(dtype)


def zeros_maker(shape: tuple, dtype, zeroed: bool = True) -> Callable[[], np.ndarray]:
    """A function making ``np.zeros(shape, dtype)`` (``zeroed`` False: ``np.empty``, for
    a kernel that writes every element) starting on a cache line: a result array
    the kernels store whole vectors into, and that JAX takes without a copy (it copies a
    buffer off a 64-byte boundary; NumPy's own arrays start 16 bytes past one). Below
    :data:`_ALIGNED_FROM` bytes, NumPy's own: aligning costs a small call 2 us, more
    than the straddled cache lines and a copy of so small an array cost. Decided once, by
    a plan (the decision itself cost a small call 0.4 us)."""
    dtype = np.dtype(dtype)
    size = math.prod(shape)
    if size * dtype.itemsize < _ALIGNED_FROM:
        return functools.partial(np.zeros if zeroed else np.empty, shape, dtype)

    def aligned() -> np.ndarray:
        array = _allocate(size, dtype).reshape(shape)
        if zeroed:  # (as bytes: ml_dtypes' bfloat16 fill takes 4x as long)
            array.view(np.uint8).fill(0)
        return array
    return aligned


_ALIGNED_FROM = 1 << 16


def score_tile_specs(ints, dtype) -> tuple:
    """``(s, tanh, packed)``: scores (BLOCK_Q x SCORE_LD), the value the score step keeps
    of each for the gradient step (the same size where an option needs one, else 1
    element: a small call's scratch stays small enough to be reused), and the packed key
    tile with its value tile after it ((D + Dv) x SCORE_LD; 1 element when products go
    through BLAS). Like every ``*_specs`` here: a ``(size, dtype)`` per array, for
    :func:`scratch_set`."""
    size = int(ints[Int.BLOCK_Q] * ints[Int.SCORE_LD])
    packed = int((ints[Int.HEAD_DIM] + ints[Int.VALUE_DIM]) * ints[Int.SCORE_LD]) if ints[Int.VECTOR_SCORES] else 1
    return (size, dtype), (size if ints[Int.SAVES_SCORES] else 1, dtype), (packed, dtype)


def forward_scratch_specs(ints, dtype) -> tuple:
    """:func:`score_tile_specs`, then per row of a query tile (BLOCK_Q each, times
    HEAD_GROUP heads) the running max ``m``, the running sum ``total``, one tile's sums
    (one head at a time), and whether any key was seen; last :func:`dequantized_tile_spec`."""
    rows = int(ints[Int.BLOCK_Q])
    heads = rows * int(ints[Int.HEAD_GROUP])  # m, total and seen: one set per head of an item
    return (*score_tile_specs(ints, dtype), (heads, dtype), (heads, dtype), (rows, dtype), (heads, np.bool_),
            dequantized_tile_spec(ints, dtype))


def weights_scratch_specs(ints, dtype) -> tuple:
    """:func:`score_tile_specs`, then :func:`dequantized_tile_spec`: the weights kernel's."""
    return (*score_tile_specs(ints, dtype), dequantized_tile_spec(ints, dtype))


def dequantized_tile_spec(ints, dtype) -> tuple:
    """A key tile read from codes (KV_CODES) as float rows, keys then values (BLOCK_K x
    (D + Dv), :func:`npattn.cpu.tiles.dequantize_tile`); with BF16_PRODUCTS the bfloat16
    pair tiles instead (:func:`npattn.cpu.tiles.pair_tiles`); nothing otherwise. With
    Q_CODES, a work item's queries as float rows after them (HEAD_GROUP x BLOCK_Q x D,
    :func:`npattn.cpu.tiles.convert_query_rows`), and with OUT_CODES its out rows' sums
    (HEAD_GROUP x BLOCK_Q x Dv); with KEY_CACHE_SLOTS, the key tiles a forward
    keeps packed (:func:`npattn.cpu.tiles.key_cache`, at most ``Tuning.key_cache_bytes``);
    last, with QUERY_COPY_WORDS, a work item's query rows copied onto cache lines
    (:func:`npattn.cpu.tiles.copy_query_rows`); at least 1 element."""
    rows, keys, head_dim, value_dim = (int(ints[name]) for name in (Int.BLOCK_Q, Int.BLOCK_K, Int.HEAD_DIM,
                                                                     Int.VALUE_DIM))
    # (with OUT_CODES the float32 sums of an item's out rows last: forward_kernel._sums_rows)
    sums = rows * int(ints[Int.HEAD_GROUP]) * value_dim if ints[Int.OUT_CODES] else 0
    if ints[Int.BF16_PRODUCTS]:
        from .tiles import pair_tile_sizes  # (its Python function: one formula for the kernel and here)

        ld = int(ints[Int.SCORE_LD])
        cache = int(ints[Int.KEY_CACHE_SLOTS]) * sum(cache_slot_words(head_dim, value_dim, keys, ld, True))
        # (and an item's query rows copied onto lines, from the first line after the rest:
        # tiles.copy_query_rows)
        copy = rows * int(ints[Int.HEAD_GROUP]) * int(ints[Int.QUERY_COPY_WORDS])
        copy += _ALIGN_BYTES // 4 - 1 if copy else 0
        return sum(pair_tile_sizes.py_func(rows, keys, value_dim, ld)) + sums + cache + copy, dtype
    if not ints[Int.KV_CODES]:  # float keys: the kept key tiles alone (tiles.key_cache)
        ld = int(ints[Int.SCORE_LD])
        return max(1, int(ints[Int.KEY_CACHE_SLOTS]) * sum(cache_slot_words(head_dim, value_dim, keys, ld,
                                                                               False))), dtype
    # (and with Q_CODES an item's queries, HEAD_GROUP x BLOCK_Q rows: tiles.convert_query_rows)
    queries = rows * int(ints[Int.HEAD_GROUP]) * head_dim if ints[Int.Q_CODES] else 0
    return keys * (head_dim + value_dim) + queries + sums, dtype


def gradient_tile_specs(ints, dtype) -> tuple:
    """``(p, dropped, ds, tanh, packed)``: probabilities, them after dropout (0 elements
    without dropout: see :func:`with_dropout_copy`) and the scores' gradient (BLOCK_Q x
    SCORE_LD each), and ``tanh`` and ``packed`` as in :func:`score_tile_specs`."""
    score, tanh, packed = score_tile_specs(ints, dtype)
    return score, (score[0] if ints[Int.HAS_DROPOUT] else 0, dtype), score, tanh, packed


def dbias_scratch_specs(ints, dtype) -> tuple:
    """:func:`gradient_tile_specs`, then where k and v are read a 16-bit tile at a time
    (KV_CODES) a key tile's keys and values as float rows, with Q_CODES a query tile's q
    and dout rows after them (as :func:`backward_scratch_specs` lays them out); 1 element
    otherwise: the bias gradient's kernel's."""
    size = 1
    if ints[Int.KV_CODES] and not ints[Int.BF16_PRODUCTS]:
        size, _ = dequantized_tile_spec(ints, dtype)
        if ints[Int.Q_CODES]:
            size += int(ints[Int.BLOCK_Q]) * int(ints[Int.VALUE_DIM])
    return (*gradient_tile_specs(ints, dtype), (size, dtype))


def backward_scratch_specs(ints, dtype) -> tuple:
    """:func:`gradient_tile_specs`, then one key tile's dK and dV sums (BLOCK_K x D and
    BLOCK_K x Dv), then its keys and values as float rows where k and v are read a 16-bit
    tile at a time (KV_CODES: :func:`dequantized_tile_spec`, with Q_CODES a query tile's q
    and dout rows after them; with BF16_PRODUCTS the tiles of bfloat16 pairs,
    :func:`npattn.cpu.pair_gradients.backward_pair_tiles`; 1 element otherwise)."""
    keys = int(ints[Int.BLOCK_K])
    if ints[Int.BF16_PRODUCTS]:
        from .pair_gradients import backward_pair_sizes

        tile_size = sum(backward_pair_sizes(int(ints[Int.BLOCK_Q]), keys, int(ints[Int.HEAD_DIM]),
                                            int(ints[Int.VALUE_DIM]), int(ints[Int.SCORE_LD])))
    else:
        tile_size, _ = dequantized_tile_spec(ints, dtype)
    if ints[Int.Q_CODES]:  # and a query tile's 16-bit dout rows, converted after its q rows
        tile_size += int(ints[Int.BLOCK_Q]) * int(ints[Int.VALUE_DIM])
    return (*gradient_tile_specs(ints, dtype), (keys * int(ints[Int.HEAD_DIM]), dtype),
            (keys * int(ints[Int.VALUE_DIM]), dtype), (tile_size, dtype))


def with_dropout_copy(arrays: tuple) -> tuple:
    """A scratch set of :func:`gradient_tile_specs` (or :func:`backward_scratch_specs`) as
    the kernels take it: ``dropped`` is ``p`` itself without dropout."""
    p, dropped, *rest = arrays
    return (p, dropped if dropped.size else p, *rest)
