"""Quantized kv caches in the kv-cache call: int8 codes with their scales.

A quantized cache is a pair per tensor: ``k_cache`` int8, or uint8 holding float8 e4m3
bits (``ml_dtypes.float8_e4m3fn`` arrays: pass ``.view(np.uint8)``), (Bc, S, Hkv, D) (paged: (pages,
page_size, Hkv, D)) and ``k_scale`` float32 shaped like it without the last axis, one
scale per key slot and kv head; the same for v (:mod:`npattn.core.quantization`).
:func:`npattn.attention_with_kvcache` checks them here, quantizes the float keys it
appends with :func:`npattn.core.quantization.quantize_rows` (codes and scales written at
the same slots, after every check), and attends through a problem whose k and v are the
codes and whose ``k_scale`` / ``v_scale`` are the scales: the kernels dequantize a tile
at a time, and the reference in float64.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from ..core import checks
from ..core.problem import with_arrays
from ..core.quantization import HEAD_DIM_MULTIPLE, check_codes


class Scales(NamedTuple):
    """A quantized cache's scales: ``k_scale`` and ``v_scale``, arrays of q's kind."""

    k_scale: Any
    v_scale: Any


def checked_scales(q: Any, k_cache: Any, v_cache: Any, k_scale: Any, v_scale: Any, written: bool,
                   check_cache) -> Scales | None:
    """The scales as arrays of q's kind (None for a float cache, whose integer codes
    without scales the caches' own checks refuse), after checking that the caches are
    int8 or e4m3 codes with float32 scales of their shape without the last axis and head
    dims that are whole multiples of 16. ``check_cache(name, array)``: the checks a cache
    the call writes must pass (writable, native, no broadcast axis); that no two written
    arrays overlap is the caller's check, once the scales are known."""
    if k_scale is None and v_scale is None:
        return None
    if k_scale is None or v_scale is None:
        raise ValueError("k_scale and v_scale must be given together (a quantized cache has both), or neither")
    if written:
        k_scale, v_scale = check_cache("k_scale", k_scale), check_cache("v_scale", v_scale)
    else:
        k_scale, v_scale = checks.as_arrays(k_scale=k_scale, v_scale=v_scale, reference=q)
    check_codes("k_cache", k_cache, "k_scale", k_scale)
    check_codes("v_cache", v_cache, "v_scale", v_scale)
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache holds {k_cache.dtype} codes but v_cache {v_cache.dtype}: a quantized cache's keys and "
                        "values share one code type (int8, or uint8 for float8 e4m3)")
    for name, width in (("k_cache", k_cache.shape[3]), ("v_cache", v_cache.shape[3])):
        if width % HEAD_DIM_MULTIPLE:
            raise ValueError(f"{name}'s head dim must be a multiple of {HEAD_DIM_MULTIPLE} for a quantized cache "
                             f"(the kernels read whole vectors of it), got {width}")
    return Scales(k_scale, v_scale)


def check_float_cache(name: str, cache: Any, q: Any) -> None:
    """Raise naming ``name`` unless a cache given without scales holds floats of q's dtype;
    integer codes get the hint that they need their scales."""
    if cache.dtype.kind in "iu":
        raise TypeError(f"{name} holds {cache.dtype} codes: pass k_scale and v_scale, the scale of every key "
                        "slot and kv head (npattn.quantize_kv makes both)")
    checks.check_float_dtype(name, cache)
    if cache.dtype != q.dtype:
        raise TypeError(f"{name} has dtype {cache.dtype} but q has {q.dtype}; they must share one dtype")


def stand_ins(xp: Any, keys: Any, values: Any, dtype: Any) -> tuple[Any, Any]:
    """Float arrays of the codes' shapes (one element of memory each) for the checks of
    :func:`npattn.api.checked_problem`, which take float keys: it checks shapes and
    options, and the codes take their place in the problem after (:func:`with_codes`)."""
    return (xp.broadcast_to(xp.zeros((), dtype), keys.shape), xp.broadcast_to(xp.zeros((), dtype), values.shape))


def with_codes(problem: Any, keys: Any, values: Any, scales: Scales) -> Any:
    """``problem`` (checked in layout "bshd") reading the codes ``keys`` and ``values``
    (bshd, or pools) and their scales: bhsd and bhs views, nothing copied."""
    return with_arrays(problem, k=keys.transpose(0, 2, 1, 3), v=values.transpose(0, 2, 1, 3),
                       k_scale=scales.k_scale.transpose(0, 2, 1), v_scale=scales.v_scale.transpose(0, 2, 1))


def check_backend(implementation: Any) -> None:
    """Raise unless the backend reads quantized caches (``QUANTIZED_KV``)."""
    if not getattr(implementation, "QUANTIZED_KV", False):
        raise ValueError(f"the {implementation.NAME} backend does not read quantized (int8 or float8) caches; "
                         "use backend='cpu', 'gpu' or 'reference', or a float cache")
