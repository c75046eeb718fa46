"""BLAS matrix products callable from Numba kernels, and a guard against oversubscription.

:func:`gemm` is the Fortran ``?gemm`` of the BLAS that SciPy ships, reached
through Numba's own ``numba_xxgemm`` helper (the symbol ``np.dot`` uses inside
``@njit``). Calling it directly, rather than ``np.dot``, lets a kernel pass
leading dimensions, so row blocks of q, k, v and out are multiplied where they
lie, in either layout, with no copy, and lets it accumulate (``beta = 1``) into
an output block with no temporary. Linking by symbol name keeps the kernels
cacheable on disk (a ctypes function pointer would not be).

BLAS is column-major; every matrix here is row-major. A row-major (rows x cols)
block with row stride ``ld`` *is* the column-major (cols x rows) matrix with
leading dimension ``ld``, so each product below is written for the transposes.
"""
from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import threading


from numba import njit, types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic, overload

from numba.np.linalg import _BLAS, get_blas_kind

from .jit import OPTIONS
from .signatures import as_readonly, larger, plain_int, scalar_like


@njit(inline="always")
def gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    """Column-major ``C = alpha * op(A) @ op(B) + beta * C`` on the start of 1-D arrays
    ``a``, ``b`` and ``c`` (pass a slice ``x[offset:]`` to start inside an array).
    ``op(A)`` is (m x k), ``op(B)`` (k x n), ``C`` (m x n); ``trans_*`` is True to
    transpose. Only callable from Numba-jitted code."""
    _gemm(bool(trans_a), bool(trans_b), plain_int(m), plain_int(n), plain_int(k),
          scalar_like(alpha, c), as_readonly(a), plain_int(lda), as_readonly(b), plain_int(ldb),
          scalar_like(beta, c), c, plain_int(ldc))


def _gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    raise NotImplementedError("gemm is only callable from Numba-jitted code")


@intrinsic
def _by_reference(typingctx, value):
    """A pointer to a copy of the scalar ``value`` in the calling function's stack frame
    (valid until it returns): how Fortran's BLAS takes alpha and beta, with no array
    allocated (an ``np.empty`` costs the first call's compile a function of its own)."""
    if not isinstance(value, types.Float):
        return None

    def codegen(context, builder, signature, args):
        return cgutils.alloca_once_value(builder, args[0])
    return types.CPointer(value)(value), codegen


@overload(_gemm, jit_options=OPTIONS)
def _gemm_overload(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    if not isinstance(a, types.Array) or a.dtype not in (types.float32, types.float64):
        raise TypingError("gemm takes float32 or float64 arrays")
    dtype = a.dtype
    xxgemm = _BLAS().numba_xxgemm(dtype)
    kind = ord(get_blas_kind(dtype))
    transposed, plain = ord("t"), ord("n")

    def implementation(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
        if m == 0 or n == 0:
            return
        xxgemm(kind, transposed if trans_a else plain, transposed if trans_b else plain,
               m, n, k, _by_reference(alpha), a.ctypes, larger(lda, 1), b.ctypes, larger(ldb, 1),
               _by_reference(beta), c.ctypes, larger(ldc, 1))

    return implementation


def _scipy_openblas():
    """SciPy's bundled OpenBLAS, or None (another BLAS build, or none found)."""
    import scipy

    root = os.path.dirname(os.path.dirname(scipy.__file__))
    for path in sorted(glob.glob(os.path.join(root, "scipy.libs", "libscipy_openblas*.so*"))):
        try:
            library = ctypes.CDLL(path)  # already loaded by scipy.linalg: the same handle
            get, set_ = library.scipy_openblas_get_num_threads, library.scipy_openblas_set_num_threads
        except (OSError, AttributeError):
            continue
        get.restype = ctypes.c_int
        set_.argtypes = [ctypes.c_int]
        return get, set_
    return None


_OPENBLAS = None
_LOOKED_UP = False
# Calls inside single_threaded_blas() blocks, over all threads, and the setting to
# restore when the last one leaves: the pin is held for as long as any npattn kernel
# runs, so one call's exit never hands BLAS its threads back under another's kernels
# (their products would then split differently, and their bits differ).
_PIN_LOCK = threading.Lock()
_PINNED_CALLS = 0
_SAVED_THREADS = 1


@contextlib.contextmanager
def single_threaded_blas():
    """Run the block with SciPy's BLAS on one thread, restoring its setting when the
    last concurrent block (from any thread) leaves.

    The kernels already run one Numba thread per core; a multi-threaded BLAS call
    from each of them would put several threads on every core."""
    global _OPENBLAS, _LOOKED_UP, _PINNED_CALLS, _SAVED_THREADS
    with _PIN_LOCK:
        if not _LOOKED_UP:
            _OPENBLAS, _LOOKED_UP = _scipy_openblas(), True
        if _OPENBLAS is None:
            pinned = False
        else:
            pinned = True
            get, set_ = _OPENBLAS
            if _PINNED_CALLS == 0:
                _SAVED_THREADS = get()
                set_(1)
            _PINNED_CALLS += 1
    try:
        yield
    finally:
        if pinned:
            with _PIN_LOCK:
                _PINNED_CALLS -= 1
                if _PINNED_CALLS == 0:
                    set_(_SAVED_THREADS)
