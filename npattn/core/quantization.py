"""Quantized key/value caches: int8 or float8 (e4m3) codes with a float32 scale per key and kv head.

A cache entry ``x`` (D values of one key of one kv head) is stored as
``codes = round(x / scale)`` in int8 with ``scale = max |x| / 127`` (symmetric: no zero
point; an all-zero entry gets scale 0 and codes 0). It reads back as ``codes * scale``:
each value within ``scale / 2 = max |x| / 254`` of the original, a relative error of at
most 0.4% of the entry's largest value. The kernels dequantize a key tile at a time
into float32 registers and scratch; no float copy of a cache is ever made.

float8 e4m3 codes (``dtype="float8_e4m3"``: 4 exponent bits, 3 mantissa bits, no
infinities, largest 448; ``ml_dtypes.float8_e4m3fn``'s bits, held as uint8) use ``scale = max
|x| / 448`` and round ``x / scale`` to the nearest e4m3 value (ties to even): a relative
error of at most 1/16 of each value, plus the smallest steps near zero, where int8's error is
a fixed half scale.

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
# float8 e4m3 codes: their values by bit pattern (0x7F and 0xFF are NaN; no infinities)
E4M3_LARGEST = 448.0


def _e4m3_values() -> np.ndarray:
    """float32 (256,): the value of every e4m3fn bit pattern."""
    bits = np.arange(256)
    exponent, mantissa = (bits >> 3) & 0xF, bits & 0x7
    magnitude = np.where(exponent == 0, mantissa / 8.0 * 2.0 ** -6, (1 + mantissa / 8.0) * 2.0 ** (exponent - 7.0))
    values = np.where(bits & 0x80, -magnitude, magnitude)
    values[(bits & 0x7F) == 0x7F] = np.nan
    return values.astype(np.float32)


E4M3_VALUES = _e4m3_values()
CODE_DTYPES = (np.dtype(np.int8), np.dtype(np.uint8))  # int8; float8 e4m3 bits
SCALE_DTYPE = np.dtype(np.float32)
# The kernels read whole vectors of a dequantized row: the head dims of a quantized cache
# are whole multiples of the widest (16 float32 lanes on AVX-512).
HEAD_DIM_MULTIPLE = 16


def code_dtype(kind: Any) -> np.dtype | None:
    """The codes' dtype of a quantized cache kind: int8 for ``"int8"`` (or ``np.int8``),
    uint8 holding e4m3 bits for ``"float8_e4m3"``; None for anything else (a float dtype)."""
    if isinstance(kind, str):
        return _CODE_DTYPES_BY_KIND.get(kind)
    return np.dtype(np.int8) if kind is np.int8 or (isinstance(kind, np.dtype) and kind == np.int8) else None


_CODE_DTYPES_BY_KIND = {"int8": np.dtype(np.int8), "float8_e4m3": np.dtype(np.uint8)}


def quantize_kv(x: Any, dtype: str = "int8") -> tuple[Any, Any]:
    """``(codes, scales)`` of float keys or values ``x`` (..., D), NumPy or CuPy:
    ``codes`` (..., D) and ``scales`` float32 (...). ``dtype="int8"``: int8 codes,
    ``codes * scales[..., None]`` within ``scales / 2`` of ``x`` elementwise;
    ``"float8_e4m3"``: uint8 codes holding e4m3 bits (view them as
    ``ml_dtypes.float8_e4m3fn`` if you like), each value rounded to the nearest e4m3 (see the
    module's docs). ``x`` must be finite."""
    codes_dtype = code_dtype(dtype)
    if codes_dtype is None:
        raise ValueError(f"dtype must be 'int8' or 'float8_e4m3' (the cache's code type), got {dtype!r}")
    (x,) = checks.as_arrays(x=x)
    if x.dtype.kind != "f":
        raise TypeError(f"x must be a float array (keys or values to quantize), got dtype {x.dtype}")
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"x must have a last axis of head-dim values, got shape {tuple(x.shape)}")
    checks.check_all_finite("x", x)
    return quantize_rows(x, codes_dtype)


def quantize_rows(x: Any, codes_dtype=np.dtype(np.int8)) -> tuple[Any, Any]:
    """:func:`quantize_kv` of a checked float array (no checks) into codes of
    ``codes_dtype`` (int8, or uint8 for e4m3): the one rounding rule the kv-cache call uses
    for the keys it appends."""
    xp = _arrays.array_module(x)
    values = x.astype(np.float32, copy=False)
    largest = xp.abs(values).max(axis=-1)
    e4m3 = np.dtype(codes_dtype) == np.uint8
    scales = (largest / np.float32(E4M3_LARGEST if e4m3 else CODE_LIMIT)).astype(np.float32)
    safe = xp.where(scales > 0, scales, np.float32(1.0))[..., None]
    if e4m3:
        return _nearest_e4m3(xp, values / safe), scales
    codes = xp.clip(xp.rint(values / safe), -CODE_LIMIT, CODE_LIMIT).astype(np.int8)
    return codes, scales


def _nearest_e4m3(xp, scaled):
    """The e4m3 bits (uint8) nearest each of ``scaled`` (|values| <= 448), ties to the even
    pattern (an even mantissa, as IEEE rounds)."""
    positive = xp.asarray(E4M3_VALUES[:0x7F])  # 0 .. 448, increasing
    magnitude = xp.minimum(xp.abs(scaled), np.float32(E4M3_LARGEST))
    above = xp.clip(xp.searchsorted(positive, magnitude), 1, 0x7E)
    below = above - 1
    to_below, to_above = magnitude - positive[below], positive[above] - magnitude
    take_below = (to_below < to_above) | ((to_below == to_above) & (below % 2 == 0))
    code = xp.where(take_below, below, above)
    code = xp.where(magnitude >= positive[0x7E], 0x7E, code)  # the largest (searchsorted's edge)
    return (code | xp.where(scaled < 0, 0x80, 0)).astype(np.uint8)


def code_values(codes: Any, dtype=np.float64) -> Any:
    """The values of ``codes`` (int8 themselves, uint8 as e4m3 bits) in ``dtype``, before
    their scales."""
    if codes.dtype == np.uint8:
        xp = _arrays.array_module(codes)
        return xp.asarray(E4M3_VALUES).astype(dtype)[codes]
    return codes.astype(dtype)


def dequantize_kv(codes: Any, scales: Any, dtype: Any = np.float32) -> Any:
    """``codes * scales[..., None]`` in ``dtype`` (float32 by default): what the kernels
    read of a quantized cache, as a new array (for checks and tests; the kernels never
    make one)."""
    (codes,) = checks.as_arrays(codes=codes)
    (scales,) = checks.as_arrays(scales=scales, reference=codes)
    check_codes("codes", codes, "scales", scales)
    compute = np.dtype(dtype)
    return code_values(codes, compute) * scales.astype(compute)[..., None]


def check_codes(name: str, codes: Any, scale_name: str, scales: Any) -> None:
    """Raise naming the argument unless ``codes`` are int8 and ``scales`` float32 shaped
    as ``codes`` without its last axis (checked arrays of one kind)."""
    if codes.dtype not in CODE_DTYPES:
        raise TypeError(f"{name} must be int8 codes or float8 e4m3 codes held as uint8 (with {scale_name}), "
                        f"got dtype {codes.dtype}")
    if scales.dtype != SCALE_DTYPE:
        raise TypeError(f"{scale_name} must be float32 (a scale per key and kv head), got dtype {scales.dtype}")
    if tuple(scales.shape) != tuple(codes.shape[:-1]):
        raise ValueError(f"{scale_name} must have {name}'s shape without its last axis, "
                         f"{tuple(codes.shape[:-1])}, got {tuple(scales.shape)}")


class RunScales:
    """A quantized step's planned ``problem`` with one run's scales, as a backend plan reads
    a problem (its option arrays: :meth:`npattn.api.Plan.planned_forward`): ``k_scale`` and
    ``v_scale`` the run's as bhs views of (B, S, Hkv) scales (``scales``: anything with
    ``k_scale`` and ``v_scale``), every other attribute the problem's own. A step's plan
    runs on every layer; a ``dataclasses.replace`` of the problem per run cost more than
    the step's kernel, and a backend may keep what it derives from ``problem`` (the same
    object on every run of a plan) for the next run."""

    __slots__ = ("problem", "k_scale", "v_scale")

    def __init__(self, problem: Any, scales: Any):
        self.problem = problem
        self.k_scale, self.v_scale = scales.k_scale.transpose(0, 2, 1), scales.v_scale.transpose(0, 2, 1)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.problem, name)
