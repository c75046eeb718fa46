"""Array-kind helpers: NumPy or CuPy, decided by the arrays themselves, cupy never imported eagerly."""
from __future__ import annotations

import numpy as np


def is_cupy(array) -> bool:
    """True for a CuPy ndarray, without importing CuPy."""
    return type(array).__module__.split(".")[0] == "cupy"


def array_module(array):
    """``numpy`` or ``cupy``, whichever owns ``array``."""
    if is_cupy(array):
        import cupy

        return cupy
    return np


def array_kind(array) -> str:
    """"numpy" or "cupy": the name used in error messages and backend dispatch."""
    return "cupy" if is_cupy(array) else "numpy"


def to_numpy(array):
    """A NumPy copy of a NumPy or CuPy array (a no-op view for NumPy)."""
    return array.get() if is_cupy(array) else np.asarray(array)
