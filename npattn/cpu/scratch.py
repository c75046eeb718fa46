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


# Small scratch sets are kept per calling thread and handed out again, in the same
# order, by the next call's requests (see :func:`reused`): a small call's allocations
# cost more than its kernel. Larger ones (a big problem's tiles) are allocated fresh,
# so a thread keeps at most a few small sets alive.
_REUSE_BYTES = 1 << 18
_ARENA = threading.local()


def begin_reuse() -> None:
    """From here until :func:`end_reuse`, this thread's small scratch requests return the
    sets the previous such span's requests made at the same positions (when sizes and
    dtypes match). The kernels that got them must be done by :func:`end_reuse`, as
    run_items ensures. (Two calls rather than a context manager: a ``with`` of
    contextlib costs a small call 3 us.)"""
    if getattr(_ARENA, "sets", None) is None:
        _ARENA.sets = []
    _ARENA.cursor = 0


def end_reuse() -> None:
    _ARENA.cursor = None


@contextlib.contextmanager
def reused():
    """:func:`begin_reuse` and :func:`end_reuse` around the block."""
    begin_reuse()
    try:
        yield
    finally:
        end_reuse()


def scratch_set(specs: tuple) -> tuple:
    """One uninitialized 1-D array per ``(size, dtype)`` of ``specs``, each starting on
    a cache line; between :func:`begin_reuse` and :func:`end_reuse`, the set this
    position got last time when ``specs`` are the same and small."""
    cursor = getattr(_ARENA, "cursor", None)
    if cursor is not None:
        _ARENA.cursor = cursor + 1
        sets = _ARENA.sets
        if cursor < len(sets) and sets[cursor][0] == specs:  # only small sets are kept
            return sets[cursor][1]
    arrays = tuple(_allocate(size, np.dtype(dtype)) for size, dtype in specs)
    if cursor is None or sum(array.nbytes for array in arrays) > _REUSE_BYTES:
        return arrays
    if cursor < len(sets):
        sets[cursor] = (specs, arrays)
    else:
        sets.append((specs, arrays))
    return arrays


def _allocate(size: int, dtype: np.dtype) -> np.ndarray:
    raw = np.empty(size * dtype.itemsize + _ALIGN_BYTES, np.uint8)
    # the address through the array interface: ``raw.ctypes`` builds a ctypes object, 5 us
    start = -raw.__array_interface__["data"][0] % _ALIGN_BYTES
    return raw[start:start + size * dtype.itemsize].view(dtype)


def score_tile_specs(ints, dtype) -> tuple:
    """The ``(size, dtype)`` of each array of :func:`score_tile_scratch`."""
    size = int(ints[Int.BLOCK_Q] * ints[Int.SCORE_LD])
    packed = int((ints[Int.HEAD_DIM] + ints[Int.VALUE_DIM]) * ints[Int.SCORE_LD]) if ints[Int.VECTOR_SCORES] else 1
    return (size, dtype), (size if ints[Int.SAVES_SCORES] else 1, dtype), (packed, dtype)


def score_tile_scratch(ints, dtype):
    """``(s, tanh, packed)``: scores (BLOCK_Q x SCORE_LD), the value the score step keeps
    of each for the gradient step (the same size where an option needs one, else 1
    element: a small call's scratch stays small enough to be reused), and the packed key
    tile with its value
    tile after it ((D + Dv) x SCORE_LD; 1 element when products go through BLAS)."""
    return scratch_set(score_tile_specs(ints, dtype))


def forward_scratch(ints, dtype):
    """:func:`score_tile_scratch`, then per row of a query tile (BLOCK_Q each) the running
    max ``m``, the running sum ``total``, one tile's sums, and whether any key was seen."""
    return scratch_set(forward_scratch_specs(ints, dtype))


def forward_scratch_specs(ints, dtype) -> tuple:
    """The ``(size, dtype)`` of each array of :func:`forward_scratch`."""
    rows = int(ints[Int.BLOCK_Q])
    return (*score_tile_specs(ints, dtype), (rows, dtype), (rows, dtype), (rows, dtype), (rows, np.bool_))


def _gradient_tile_specs(ints, dtype) -> tuple:
    score, tanh, packed = score_tile_specs(ints, dtype)
    return score, (score[0] if ints[Int.HAS_DROPOUT] else 0, dtype), score, tanh, packed


def _without_dropout_copy(arrays: tuple) -> tuple:
    """``dropped`` is ``p`` itself without dropout (its spec asks for 0 elements)."""
    p, dropped, *rest = arrays
    return (p, dropped if dropped.size else p, *rest)


def gradient_tile_scratch(ints, dtype):
    """``(p, dropped, ds, tanh, packed)``: probabilities, them after dropout (``p`` itself
    without dropout) and the scores' gradient (BLOCK_Q x SCORE_LD each), and ``tanh``
    and ``packed`` as in :func:`score_tile_scratch`."""
    return _without_dropout_copy(scratch_set(_gradient_tile_specs(ints, dtype)))


def backward_scratch(ints, dtype):
    """:func:`gradient_tile_scratch`, then one key tile's dK and dV sums (BLOCK_K x D and
    BLOCK_K x Dv)."""
    keys = int(ints[Int.BLOCK_K])
    return _without_dropout_copy(scratch_set((*_gradient_tile_specs(ints, dtype),
                                               (keys * int(ints[Int.HEAD_DIM]), dtype),
                                               (keys * int(ints[Int.VALUE_DIM]), dtype))))
