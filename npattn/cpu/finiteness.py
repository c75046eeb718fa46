"""Whether a plan's own float array is all finite, by one jitted pass.

:func:`npattn.core.arrays.all_finite` serves every caller with NumPy alone: a BLAS sum of
squares, 3-4 us of Python and BLAS set-up for a small array. The CPU plans check arrays
they made themselves (delta, float32 and float64 gradients: flat, C-contiguous, of a
dtype known when planning), so they call this kernel's machine code directly: 2.7 us for
three arrays of 8192 values where ``all_finite_arrays`` took 15.8 (2-core Zen 3 VM).
"""
from __future__ import annotations

import numpy as np

from .jit import kernel
from .threads import direct_entry


@kernel
def _all_finite(values):
    """No NaN or infinity in ``values`` (flat, C-contiguous, float32 or float64). ``x * 0``
    is 0 for every finite x and NaN for NaN and both infinities, so their sum is 0 exactly
    when every value is finite: a reduction the compiler vectorizes, and may not fold
    (no fast-math flag assumes finite values)."""
    total = np.float32(0.0)
    for i in range(values.size):
        total += values[i] * np.float32(0.0)
    return total == 0.0


def finiteness_entry(dtype):
    """``check(values) -> bool``: whether a flat, C-contiguous, writable, aligned array
    of float32 or float64 ``dtype`` is all finite, as the kernel's typed entry point (no
    dispatcher typing the argument). Any other array gives wrong answers: callers pass
    only arrays they allocated in that form."""
    sample = np.zeros(8, dtype)
    _all_finite(sample)  # (compiled, or loaded from the cache, for this type)
    return direct_entry(_all_finite, (sample,))
