"""Partial attention results merged by their log-sum-exp: one function for every place that
splits a row's keys, the CPU's split-KV decoding (:mod:`npattn.cpu.splitting`) and ring
attention across processes (:mod:`npattn.distributed`).

Parts ``c`` each hold the output rows ``O_c``, normalized over the part's keys, and their
``lse_c``; the merge is ``lse = log sum_c exp(lse_c)`` and ``O = sum_c exp(lse_c - lse) O_c``,
summed in part order, so the bits never depend on timing or thread counts. A part whose
row saw no key (lse -inf) contributes exactly 0; a row no part saw keeps out 0 and lse -inf.
"""
from __future__ import annotations

import numpy as np

from ..runtime.arrays import array_module


def merge(out_parts, lse_parts, out, lse) -> None:
    """Write the merged ``out`` (B, H, Sq, Dv), any strides, and ``lse`` (B, H, Sq) from
    ``out_parts`` (n, B, H, Sq, Dv) and ``lse_parts`` (n, B, H, Sq), summing over the n
    parts in order. ``out`` and ``lse`` may share memory with the parts: every part is
    read before either is written. NumPy or CuPy arrays, all of one kind."""
    xp = array_module(out_parts)
    top = lse_parts.max(axis=0)
    seen = top > -np.inf
    shift = xp.where(seen, top, 0.0)
    weights = xp.exp(lse_parts - shift)  # exactly 0 for a part that saw no key
    total = xp.zeros_like(top)
    merged = xp.zeros(out_parts.shape[1:], out_parts.dtype)
    for weight, part in zip(weights, out_parts):  # in part order: the same bits on every run
        total += weight
        merged += weight[..., None] * part
    lse[...] = xp.where(seen, shift + xp.log(xp.where(seen, total, 1.0)), -np.inf)
    out[...] = merged / xp.where(seen, total, 1.0)[..., None]
