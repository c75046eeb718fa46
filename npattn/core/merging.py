"""Partial attention results merged by their log-sum-exp: one function for every place that
splits a row's keys, the CPU's split-KV decoding (:mod:`npattn.cpu.splitting`) and ring
attention across processes (:mod:`npattn.distributed`).

Parts ``c`` each hold the output rows ``O_c``, normalized over the part's keys, and their
``lse_c``; the merge is ``lse = log sum_c exp(lse_c)`` and ``O = sum_c exp(lse_c - lse) O_c``,
summed in part order, so the bits never depend on timing or thread counts. A part whose
row saw no key (lse -inf) contributes exactly 0; a row no part saw keeps out 0 and lse -inf.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .arrays import array_module


def merge(out_parts, lse_parts, out, lse, sink=None) -> None:
    """Write the merged ``out`` (..., Dv), any strides, and ``lse`` (...) from the n parts'
    ``out_parts`` and ``lse_parts``: stacked (n, ..., Dv) and (n, ...) arrays or sequences of
    n arrays, summed in order in out's dtype (a part of another dtype is promoted as it is
    multiplied, with no copy of it). ``out`` and ``lse`` may share memory with the parts:
    every part is read before either is written. NumPy or CuPy arrays, all of one kind.
    ``sink``: sink logits broadcastable to lse's shape, each a value-less part of its row
    (weight, no output) after the others, in rows that some part saw (a row that sees no
    key keeps out 0 and lse -inf, as without parts)."""
    xp = array_module(out)
    top = lse_parts[0]
    for part_lse in lse_parts[1:]:
        top = xp.maximum(top, part_lse)
    seen = top > -np.inf
    if sink is not None:
        top = xp.where(seen, xp.maximum(top, sink), top)
    shift = xp.where(seen, top, 0.0)
    total = xp.zeros(top.shape, top.dtype)
    merged = xp.zeros(out.shape, out.dtype)
    for part_lse, part in zip(lse_parts, out_parts):  # in part order: the same bits on every run
        weight = xp.exp(part_lse - shift)  # exactly 0 for a part that saw no key
        total += weight
        merged += weight[..., None] * part
    if sink is not None:
        total += xp.exp(xp.where(seen, sink - shift, -np.inf)).astype(total.dtype, copy=False)  # (0 where unseen)
    lse[...] = xp.where(seen, shift + xp.log(xp.where(seen, total, 1.0)), -np.inf)
    out[...] = merged / xp.where(seen, total, 1.0)[..., None]


# How a layout's lse (B, H, Sq) or (H, T) lines up with its out's leading axes: the axes of
# lse in the order of out's (B, Sq, H) for "bshd", (T, H) for "varlen").
_LSE_ORDER = {"bhsd": None, "bshd": (0, 2, 1), "varlen": (1, 0)}


def merge_states(outs: Sequence[Any], lses: Sequence[Any], *, layout: str = "bhsd") -> tuple[Any, Any]:
    """``(out, lse)`` of attention over the union of disjoint key sets, from each set's
    ``(out_c, lse_c)`` (what a call with ``return_lse=True`` over those keys returns):

        lse = log sum_c exp(lse_c),    out = sum_c exp(lse_c - lse) out_c

    This is exact because a set's softmax is normalized by exp(lse_c): exp(lse_c - lse) is
    the share of the union's probability mass its keys hold. Parts are summed in the order
    given, in float64, so the bits never depend on timing; a part whose row saw no key
    (lse -inf) adds exactly nothing, and a row no part saw gets out 0 and lse -inf.

    ``outs``: arrays (..., Dv) of one shape, ``lses``: their lse arrays, as ``layout`` pairs
    them: "bhsd" (npattn's default, and any lse of out's shape without its last axis, such
    as FlashInfer's (seq, heads) for (seq, heads, dim)), "bshd" (out (B, Sq, H, Dv), lse
    (B, H, Sq)) or "varlen" (out (T, H, Dv), lse (H, T), attention_varlen's). NumPy or
    CuPy arrays (npattn.merge_states also takes torch tensors and JAX arrays). Returns
    out in the outs' dtype and lse in the lses', laid out as given."""
    from .arrays import array_kind
    from . import checks

    outs, lses = list(outs), list(lses)
    if layout not in _LSE_ORDER:
        raise ValueError(f'layout must be "bhsd", "bshd" or "varlen", got {layout!r}')
    if not outs or len(outs) != len(lses):
        raise ValueError(f"outs and lses must be non-empty and pair up, got {len(outs)} outs and {len(lses)} lses")
    outs = list(checks.as_arrays(**{f"outs[{i}]": x for i, x in enumerate(outs)}, reference=outs[0]))
    lses = list(checks.as_arrays(**{f"lses[{i}]": x for i, x in enumerate(lses)}, reference=outs[0]))
    for name, arrays in (("outs", outs), ("lses", lses)):
        for index, array in enumerate(arrays):
            checks.check_float_dtype(f"{name}[{index}]", array)
            if array.shape != arrays[0].shape:
                raise ValueError(f"{name}[{index}] has shape {tuple(array.shape)} but {name}[0] has "
                                 f"{tuple(arrays[0].shape)}: the parts must cover the same rows")
    if array_kind(lses[0]) != array_kind(outs[0]):
        raise TypeError(f"lses are {array_kind(lses[0])} arrays but outs are {array_kind(outs[0])} arrays")
    order = _LSE_ORDER[layout]
    expected = tuple(outs[0].shape[:-1])
    if order is not None:
        if len(lses[0].shape) != len(order):
            raise ValueError(f"layout {layout!r} takes lse of {len(order)} dims, got shape {tuple(lses[0].shape)}")
        lines_up = tuple(lses[0].shape[axis] for axis in order) == expected
    else:
        lines_up = tuple(lses[0].shape) == expected
    if not lines_up:
        raise ValueError(f"lses have shape {tuple(lses[0].shape)}, which does not match outs of shape "
                         f"{tuple(outs[0].shape)} in layout {layout!r}")
    xp = array_module(outs[0])
    lse_parts = [(x if order is None else x.transpose(order)).astype(np.float64) for x in lses]
    out = xp.empty(outs[0].shape, np.float64)  # each part promoted to float64 as it is weighted
    lse = xp.empty(lse_parts[0].shape, np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        merge(outs, lse_parts, out, lse)
    lse = lse if order is None else lse.transpose(np.argsort(order))
    out_dtype = np.result_type(*(x.dtype for x in outs))
    lse_dtype = np.result_type(*(x.dtype for x in lses))
    return out.astype(out_dtype), xp.ascontiguousarray(lse.astype(lse_dtype))
