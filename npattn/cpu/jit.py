"""How every Numba function of the CPU backend is compiled: one set of options for all.

Numba compiles an ``@overload`` (``np.empty``, ``min``, ...) once per set of options
of its caller, so helpers that differ only in, say, ``nogil`` each pay for their own
copies of the same library code: the options live here, shared.

- :data:`kernel`: entry points that Python calls (with a CPython wrapper).
- :data:`helper`: everything only jitted code calls: no CPython or C wrappers, each
  of which would cost compile time and never be used. Calling a helper from Python
  crashes the interpreter; nothing outside this package should.
- :data:`inlined_helper`: a helper with one call site, which Numba types and inlines
  there (no library of its own: see the comment at its definition).
"""
from __future__ import annotations

from . import _cache  # noqa: F401  (before any @njit: stamps caches with the package hash)
from numba import njit

try:  # the dispatcher's own key of an argument's type (0.15 us; typeof costs tens of us)
    from numba._dispatcher import compute_fingerprint as type_fingerprint
except ImportError:  # (not public: a Numba without it keys by type)
    from numba import typeof as type_fingerprint

# Never "ninf" or "nnan" on code that meets -inf: -inf is how a score is masked.
FASTMATH = {"reassoc", "contract", "nsz", "arcp", "afn"}
# error_model "numpy": a float division by zero gives inf or NaN as IEEE says, never a
# Python ZeroDivisionError from inside a kernel (non-finite inputs reach those divisions).
# _nrt False: no reference counting of arrays. The kernels allocate nothing (their scratch
# comes from Python, which holds every array for the call), and each helper call or slice
# otherwise paid an atomic increment and decrement per array: 9% of a small call's time.
OPTIONS = {"cache": True, "fastmath": FASTMATH, "nogil": True, "error_model": "numpy", "_nrt": False}
HELPER_OPTIONS = {**OPTIONS, "no_cpython_wrapper": True, "no_cfunc_wrapper": True}
kernel = njit(**OPTIONS)
helper = njit(**HELPER_OPTIONS)
# A helper with one call site, typed and inlined there by Numba: no library of its own.
# Numba optimizes each library with everything it calls linked in, and makes its machine
# code, once for itself and again in every caller; a wrapper (an overload's implementation
# that only casts its arguments for a helper) costs its whole call tree's compile again
# (1.7 s of the float32 forward's first compile, each, on the 2-core Zen 3 VM).
inlined_helper = njit(**HELPER_OPTIONS, inline="always")
