"""Quantized key/value caches: int8 codes with a float32 scale per key and kv head.

A cache entry ``x`` (D values of one key of one kv head) is stored as
``codes = round(x / scale)`` in int8 with ``scale = max |x| / 127`` (symmetric: no zero
point; an all-zero entry gets scale 0 and codes 0). It reads back as ``codes * scale``:
each value within ``scale / 2 = max |x| / 254`` of the original, a relative error of at
most 0.4% of the entry's largest value. The kernels dequantize a key tile at a time
into float32 registers and scratch; no float copy of a cache is ever made.

Shapes: ``x`` (..., D) gives ``codes`` (..., D) int8 and ``scales`` (...) float32. For a
cache (B, S, Hkv, D) that is a scale per (entry, slot, kv head); for a paged pool
(pages, page_size, Hkv, D), per (page, slot, kv head): the scales are laid out as the
cache without its last axis.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import arrays as _arrays
from . import checks

# int8 codes use [-127, 127]: symmetric, so -x quantizes to -codes exactly
CODE_LIMIT = 127
CODE_DTYPES = (np.dtype(np.int8),)
SCALE_DTYPE = np.dtype(np.float32)
# The kernels read whole vectors of a dequantized row: the head dims of a quantized cache
# are whole multiples of the widest (16 float32 lanes on AVX-512).
HEAD_DIM_MULTIPLE = 16


def quantize_kv(x: Any, dtype: str = "int8") -> tuple[Any, Any]:
    """``(codes, scales)`` of float keys or values ``x`` (..., D), NumPy or CuPy:
    ``codes`` int8 (..., D) and ``scales`` float32 (...), with ``codes * scales[..., None]``
    within ``scales / 2`` of ``x`` elementwise (see the module's docs). ``x`` must be finite."""
    if dtype not in ("int8", np.int8, np.dtype(np.int8)):
        raise ValueError(f"dtype must be 'int8' (the cache's code type), got {dtype!r}")
    (x,) = checks.as_arrays(x=x)
    if x.dtype.kind != "f":
        raise TypeError(f"x must be a float array (keys or values to quantize), got dtype {x.dtype}")
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"x must have a last axis of head-dim values, got shape {tuple(x.shape)}")
    checks.check_all_finite("x", x)
    return quantize_rows(x)


def quantize_rows(x: Any) -> tuple[Any, Any]:
    """:func:`quantize_kv` of a checked float array (no checks): the one rounding rule
    the kv-cache call uses for the keys it appends."""
    xp = _arrays.array_module(x)
    values = x.astype(np.float32, copy=False)
    largest = xp.abs(values).max(axis=-1)
    scales = (largest / np.float32(CODE_LIMIT)).astype(np.float32)
    safe = xp.where(scales > 0, scales, np.float32(1.0))[..., None]
    codes = xp.clip(xp.rint(values / safe), -CODE_LIMIT, CODE_LIMIT).astype(np.int8)
    return codes, scales


def dequantize_kv(codes: Any, scales: Any, dtype: Any = np.float32) -> Any:
    """``codes * scales[..., None]`` in ``dtype`` (float32 by default): what the kernels
    read of a quantized cache, as a new array (for checks and tests; the kernels never
    make one)."""
    (codes,) = checks.as_arrays(codes=codes)
    (scales,) = checks.as_arrays(scales=scales, reference=codes)
    check_codes("codes", codes, "scales", scales)
    compute = np.dtype(dtype)
    return codes.astype(compute) * scales.astype(compute)[..., None]


def check_codes(name: str, codes: Any, scale_name: str, scales: Any) -> None:
    """Raise naming the argument unless ``codes`` are int8 and ``scales`` float32 shaped
    as ``codes`` without its last axis (checked arrays of one kind)."""
    if codes.dtype not in CODE_DTYPES:
        raise TypeError(f"{name} must be int8 codes (with {scale_name}), got dtype {codes.dtype}")
    if scales.dtype != SCALE_DTYPE:
        raise TypeError(f"{scale_name} must be float32 (a scale per key and kv head), got dtype {scales.dtype}")
    if tuple(scales.shape) != tuple(codes.shape[:-1]):
        raise ValueError(f"{scale_name} must have {name}'s shape without its last axis, "
                         f"{tuple(codes.shape[:-1])}, got {tuple(scales.shape)}")
