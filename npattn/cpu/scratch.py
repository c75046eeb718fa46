"""Per-thread scratch of the kernels, allocated in Python and passed in.

Each thread of :func:`npattn.cpu.threads.run_items` gets its own set, sized for the
largest tile from the parameter array ``ints`` (see :mod:`npattn.cpu.operands`):
one score tile and one packed key and value tile, never a sequence x sequence
array. Allocating here rather than with ``np.empty`` inside the kernels spares
the first call's compile Numba's allocation functions, one per dtype, each a
function of its own that every kernel links and optimizes again.
"""
from __future__ import annotations

import contextlib
import threading

import numpy as np

from .operands import Int

# Cache-line alignment: the micro-kernels' 64-byte vector loads and stores would each
# touch two lines where a row starts off a line (NumPy's own alignment is 16 bytes
# below its large-allocation threshold).
_ALIGN_BYTES = 64


# Small scratch arrays are kept per calling thread and handed out again, in the same
# order, by the next call's allocations (see :func:`reused`): a small call's seven
# allocations cost more than its kernel. Larger ones (a big problem's tiles) are
# allocated fresh, so a thread keeps at most a few small arrays alive.
_REUSE_BYTES = 1 << 18
_ARENA = threading.local()


@contextlib.contextmanager
def reused():
    """Within the block, this thread's small scratch allocations return the arrays the
    previous block's allocations made at the same positions (when size and dtype match).
    The kernels that got them must be done when the block ends, as run_items ensures."""
    arrays = getattr(_ARENA, "arrays", None)
    if arrays is None:
        arrays = _ARENA.arrays = []
    _ARENA.cursor = 0
    try:
        yield
    finally:
        _ARENA.cursor = None


def _empty(size: int, dtype) -> np.ndarray:
    """An uninitialized 1-D array of ``size`` elements whose data starts on a cache line."""
    dtype = np.dtype(dtype)
    cursor = getattr(_ARENA, "cursor", None)
    if cursor is None or size * dtype.itemsize > _REUSE_BYTES:
        return _allocate(size, dtype)
    _ARENA.cursor = cursor + 1
    arrays = _ARENA.arrays
    if cursor < len(arrays) and arrays[cursor].size == size and arrays[cursor].dtype == dtype:
        return arrays[cursor]
    array = _allocate(size, dtype)
    if cursor < len(arrays):
        arrays[cursor] = array
    else:
        arrays.append(array)
    return array


def _allocate(size: int, dtype: np.dtype) -> np.ndarray:
    raw = np.empty(size * dtype.itemsize + _ALIGN_BYTES, np.uint8)
    # the address through the array interface: ``raw.ctypes`` builds a ctypes object, 5 us
    start = -raw.__array_interface__["data"][0] % _ALIGN_BYTES
    return raw[start:start + size * dtype.itemsize].view(dtype)


def score_tile_scratch(ints, dtype):
    """``(s, tanh, packed)``: scores (BLOCK_Q x SCORE_LD), softcap's tanh of them (the
    same size, or 1 element without softcap), and the packed key tile with its value
    tile after it ((D + Dv) x SCORE_LD; 1 element when products go through BLAS)."""
    size = int(ints[Int.BLOCK_Q] * ints[Int.SCORE_LD])
    packed = int((ints[Int.HEAD_DIM] + ints[Int.VALUE_DIM]) * ints[Int.SCORE_LD]) if ints[Int.VECTOR_SCORES] else 1
    return _empty(size, dtype), _empty(size if ints[Int.HAS_SOFTCAP] else 1, dtype), _empty(packed, dtype)


def forward_scratch(ints, dtype):
    """:func:`score_tile_scratch`, then per row of a query tile (BLOCK_Q each) the running
    max ``m``, the running sum ``total``, one tile's sums, and whether any key was seen."""
    rows = int(ints[Int.BLOCK_Q])
    return (*score_tile_scratch(ints, dtype), _empty(rows, dtype), _empty(rows, dtype), _empty(rows, dtype),
            _empty(rows, np.bool_))


def gradient_tile_scratch(ints, dtype):
    """``(p, dropped, ds, tanh, packed)``: probabilities, them after dropout (``p`` itself
    without dropout) and the scores' gradient (BLOCK_Q x SCORE_LD each), and ``tanh``
    and ``packed`` as in :func:`score_tile_scratch`."""
    p, tanh, packed = score_tile_scratch(ints, dtype)
    dropped = _empty(p.size, dtype) if ints[Int.HAS_DROPOUT] else p
    return p, dropped, _empty(p.size, dtype), tanh, packed


def backward_scratch(ints, dtype):
    """:func:`gradient_tile_scratch`, then one key tile's dK and dV sums (BLOCK_K x D and
    BLOCK_K x Dv)."""
    keys = int(ints[Int.BLOCK_K])
    return (*gradient_tile_scratch(ints, dtype), _empty(keys * int(ints[Int.HEAD_DIM]), dtype),
            _empty(keys * int(ints[Int.VALUE_DIM]), dtype))
