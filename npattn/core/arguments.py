"""Checks of the arguments of modules, layers, caches and optimizers (npattn.nn, npattn.nn.optim).

Each check returns the normalized value or raises an error naming the class, the
argument, what it must be and what it got, e.g.
``KVCache: capacity must be an int >= 1; got -1``: a TypeError for a value of the
wrong kind, a ValueError for one out of range. Constructors run them before they
allocate anything.
"""
from __future__ import annotations

import math
from numbers import Integral, Real

import numpy as np

from .checks import FLOAT_DTYPE_NAMES


def size(owner: str, name: str, value, minimum: int = 1) -> int:
    """An int (not a bool) of at least ``minimum``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, Integral):
        raise TypeError(f"{owner}: {name} must be an int >= {minimum}; got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{owner}: {name} must be an int >= {minimum}; got {value}")
    return int(value)


def optional_size(owner: str, name: str, value, minimum: int = 1):
    return None if value is None else size(owner, name, value, minimum)


def real(owner: str, name: str, value, *, low=-math.inf, high=math.inf, low_open=False, high_open=False) -> float:
    """A finite real number in the interval given (closed ends unless ``*_open``)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, Real):
        raise TypeError(f"{owner}: {name} must be a real number; got {type(value).__name__} {value!r}")
    value = float(value)
    below = value <= low if low_open else value < low
    above = value >= high if high_open else value > high
    if not math.isfinite(value) or below or above:
        if math.isinf(high) and low == 0 and low_open:
            wanted = "positive and finite"
        elif math.isinf(high):
            wanted = f"finite and {'>' if low_open else '>='} {low:g}"
        else:
            wanted = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"{owner}: {name} must be {wanted}; got {value!r}")
    return value


def positive(owner: str, name: str, value) -> float:
    """A finite real number > 0."""
    return real(owner, name, value, low=0.0, low_open=True)


def probability(owner: str, name: str, value) -> float:
    """A dropout probability: in [0, 1)."""
    return real(owner, name, value, low=0.0, high=1.0, high_open=True)


def float_dtype(owner: str, name: str, value) -> np.dtype:
    """A floating dtype the library computes with (float16, bfloat16, float32, float64)."""
    try:
        dtype = np.dtype(value)
    except TypeError:
        raise TypeError(f"{owner}: {name} must be one of {', '.join(FLOAT_DTYPE_NAMES)}; got {value!r}") from None
    if dtype.name not in FLOAT_DTYPE_NAMES:
        raise TypeError(f"{owner}: {name} must be one of {', '.join(FLOAT_DTYPE_NAMES)}; got {dtype.name}")
    return dtype


def features(owner: str, name: str, x, ndim: int, last: int, described: str) -> None:
    """An input of ``ndim`` axes whose last one has ``last`` features."""
    shape = tuple(x.shape)
    if len(shape) != ndim or shape[-1] != last:
        raise ValueError(f"{owner}: {name} must be {described} with {last} features last; got shape {shape}")


def zeros(owner: str, names: tuple, shape: tuple, dtype, xp=np):
    """``xp.zeros(shape, dtype)`` for a buffer whose axes are the arguments ``names``: a
    size the allocator refuses (NumPy's "array is too big", an out-of-memory error) is
    reported as a MemoryError naming the arguments and the bytes they ask for."""
    nbytes = math.prod(int(n) for n in shape) * np.dtype(dtype).itemsize
    described = " x ".join(f"{name} {size}" for name, size in zip(names, shape))
    try:
        if nbytes >= 2 ** 63:
            raise ValueError("array is too big")
        return xp.zeros(shape, dtype)
    except (MemoryError, ValueError) as error:
        if isinstance(error, ValueError) and "too big" not in str(error) and "maximum" not in str(error):
            raise
        raise MemoryError(f"{owner}: {described} in {np.dtype(dtype).name} needs {nbytes / 2**30:.4g} GiB, which "
                          f"cannot be allocated here ({error.__class__.__name__}: {error}); make "
                          f"{' or '.join(names[:2])} smaller") from None
    except Exception as error:  # CuPy's OutOfMemoryError is not a MemoryError
        if type(error).__name__ != "OutOfMemoryError":
            raise
        raise MemoryError(f"{owner}: {described} in {np.dtype(dtype).name} needs {nbytes / 2**30:.4g} GiB, more than "
                          f"the device has free; make {' or '.join(names[:2])} smaller") from None
