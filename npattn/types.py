"""The types of npattn's public signatures.

``ArrayLike`` is what the functions accept: NumPy arrays and anything ``numpy.asarray``
reads, and CuPy arrays (CuPy ships no type stubs, so a checker sees them as ``Any``).
``Array`` is what they return: a NumPy array for NumPy inputs, a CuPy array for CuPy ones.
"""
from __future__ import annotations

from typing import Any, Callable, Union

import numpy as np
import numpy.typing as npt

ArrayLike = Union[npt.ArrayLike, Any]
Array = np.ndarray
Outputs = Union[Array, tuple[Array, ...]]
Vjp = Callable[[ArrayLike], tuple[Array, ...]]
