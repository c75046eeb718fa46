"""Prefill and decode in one call: a packed batch of query chunks against paged caches.

``attention_varlen(q, k_cache, v_cache, cu_seqlens_q, seqused_k=..., block_table=...)``
(FlashAttention's varlen call with a ``block_table``): q (total_q, H, D) holds every
sequence's new queries end to end, sequence b's ``seqused_k[b]`` keys are read from its
pages of the pools (pages, page_size, Hkv, D), and its queries sit bottom-right among them.
A continuous-batching server puts prefill chunks of hundreds of tokens and single decode
tokens in one such call. On the CPU the whole batch is one call of the kernels (each
sequence a batch entry whose live rows are its own rows of the packed queries, whose keys
are its pages); elsewhere each sequence runs as its own paged call. Forward only.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from .. import api
from ..core import arrays as _arrays
from ..runtime import limits as _limits
from ..core import checks
from ..core import options as _options
from . import quantized as _quantized
from .kvcache import _used_pages


def checked_paged_varlen(q, k_cache, v_cache, starts, seqused_k, block_table, options: dict, reserved: dict,
                         offsets_of, scales: "_quantized.Scales | None" = None) -> Callable[[], Any]:
    """Every check of attention_varlen with paged keys (see the module), then the function
    that runs it and returns what attention_varlen returns: a caller that writes the keys
    first (:meth:`npattn.nn.PagedKVCache.attend_varlen`) checks everything before it writes.
    ``starts``: the checked cumulative query lengths (B + 1,); ``reserved``: the options the
    packed call refuses, and why; ``offsets_of(value, B, q)``: a ``q_offset`` option as an
    int64 (B,) array. ``scales``: a quantized pool's (k_cache and v_cache int8 or e4m3
    codes, :mod:`npattn.serving.quantized`), read by the kernels a tile at a time."""
    for name, why in reserved.items():
        if name in options and name != "block_table":
            raise TypeError(f"attention_varlen does not take {name}: {why} (got {name}={options[name]!r})")
    if _options.dropout_requested(options):
        raise TypeError("attention_varlen with block_table is for inference: it takes no dropout_p")
    q, k_cache, v_cache = checks.as_arrays(q=q, k_cache=k_cache, v_cache=v_cache)
    checks.check_float_dtype("q", q)
    if q.ndim != 3:
        raise ValueError(f"q must be 3-D (total_q, H, D) (packed tokens), got shape {tuple(q.shape)}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if scales is None:
            _quantized.check_float_cache(name, cache, q)
        if cache.ndim != 4:
            raise ValueError(f"{name} must be 4-D (pages, page_size, Hkv, D) with block_table, got shape "
                             f"{tuple(cache.shape)}")
    if scales is not None:
        scales = _quantized.checked_scales(q, k_cache, v_cache, scales.k_scale, scales.v_scale, False, None)
    if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[3] != q.shape[2]:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must share (pages, "
                         f"page_size, Hkv), and k_cache's head dim must be q's {q.shape[2]}")
    batch = len(starts) - 1
    pool_pages, page_size = k_cache.shape[:2]
    table = checks.int_array("block_table", block_table, q, "(B, pages per sequence)")
    if table.ndim != 2 or table.shape[0] != batch:
        raise ValueError(f"block_table must have shape (B, pages per sequence) = ({batch}, P), got "
                         f"{tuple(table.shape)}")
    if seqused_k is None:
        raise TypeError("attention_varlen with block_table needs seqused_k (B,): the keys each sequence holds")
    used = _arrays.to_numpy(checks.int_array("seqused_k", seqused_k, q, "(B,)"))
    if used.shape != (batch,):
        raise ValueError(f"seqused_k must have shape (B,) = ({batch},), got {used.shape}")
    checks.check_int_range("seqused_k", used, 0, table.shape[1] * page_size,
                           f" (the keys a sequence's {table.shape[1]} pages of {page_size} hold)")
    used = used.astype(np.int64)
    pages, _ = _used_pages(table, used, page_size, pool_pages)
    if pages.shape[1] == 0:  # no sequence reads a key: one column of page 0, never read
        pages = np.zeros((batch, 1), np.int64)
    lengths = np.diff(starts)
    options = dict(options)
    if _options.is_top_left(options.get("causal")):
        options["causal"], offsets = True, np.zeros(batch, np.int64)
    elif options.get("q_offset") is None:
        offsets = used - lengths  # each sequence's last query level with its last key
    else:
        offsets = offsets_of(options["q_offset"], batch, q)
    xp = _arrays.array_module(q)
    # Decode steps (one query row) run as one dense paged call of their own, where a GQA
    # group's heads fold into one kv head's rows and its keys stream once (a packed batch
    # cannot fold: 30 decode steps against 512-4096 keys took 1.16x the two calls); the
    # packed call then holds the longer chunks, the decode rows left empty in it.
    steps = np.flatnonzero(lengths == 1) if batch > 1 else np.zeros(0, np.int64)
    packed_stops = starts[1:].copy()
    packed_stops[steps] = starts[steps]
    options.update(layout="bshd", block_table=xp.asarray(pages), q_offset=xp.asarray(offsets),
                   q_start=xp.asarray(starts[:-1]), q_lengths=xp.asarray(packed_stops), kv_lengths=xp.asarray(used))
    shared_q = xp.broadcast_to(q[None], (max(batch, 1),) + q.shape)
    if not batch:
        options.update({name: xp.zeros(1, np.int64) for name in ("q_offset", "q_start", "q_lengths", "kv_lengths")})
        options["block_table"] = xp.zeros((1, 1), np.int64)
    # a quantized pool: the checks on float stand-ins of its shapes, then the codes in their place
    keys, values = (k_cache, v_cache) if scales is None else _quantized.stand_ins(xp, k_cache, v_cache, q.dtype)
    coded = (lambda problem: problem) if scales is None else (
        lambda problem: _quantized.with_codes(problem, k_cache, v_cache, scales))
    problem, implementation = api.checked_problem(shared_q, keys, values, options)
    problem = coded(problem)
    if scales is not None:
        _quantized.check_backend(implementation)
    want_lse = bool(options.get("return_lse"))
    if not (batch and getattr(implementation, "PACKED_ROWS", False)):
        # (one call per sequence; a quantized pool's each reading the codes as they lie)
        return lambda: _per_sequence(q, k_cache, v_cache, starts, used, offsets, pages, options, want_lse, xp,
                                     scales)
    _limits.check_memory(problem, implementation.NAME)
    rows, steps_problem = starts[steps], None
    if steps.size:  # the decode steps' own dense call, checked now too
        single = {name: value for name, value in options.items() if name not in ("q_start", "q_lengths")}
        single.update(block_table=xp.asarray(pages[steps]), kv_lengths=xp.asarray(used[steps]),
                      q_offset=xp.asarray(offsets[steps]))
        steps_problem = api.checked_problem(q[rows][:, None], keys, values, single)
        steps_problem = (coded(steps_problem[0]), steps_problem[1])
        _limits.check_memory(steps_problem[0], steps_problem[1].NAME)

    def run():
        outputs = api.run_problem(dataclasses.replace(problem, packed_rows=True), implementation)
        out, lse = (outputs[0][0], outputs[1][0]) if want_lse else (outputs[0], None)
        if steps_problem is not None:
            step_outputs = api.run_problem(*steps_problem)
            if want_lse:
                out[rows], lse[:, rows] = step_outputs[0][:, 0], step_outputs[1][:, :, 0].T
            else:
                out[rows] = step_outputs[:, 0]
        return (out, lse) if want_lse else out
    return run


def _per_sequence(q, k_cache, v_cache, starts, used, offsets, pages, options, want_lse, xp, scales=None):
    """One paged attention call per sequence, its rows copied into place (every row is some
    sequence's); the options are the checked packed call's. A quantized pool's
    (``scales``) calls read its codes (checked on float stand-ins of their shapes, as the
    packed call is), never a float copy of the pool."""
    compute = np.float64 if q.dtype == np.float64 else np.float32
    out = xp.zeros((q.shape[0], q.shape[1], v_cache.shape[3]), q.dtype)
    lse = xp.full((q.shape[1], q.shape[0]), -np.inf, compute) if want_lse else None
    single = {name: value for name, value in options.items()
              if name not in ("q_start", "q_lengths", "kv_lengths", "q_offset", "block_table")}
    for b in range(len(starts) - 1):
        q0, q1 = int(starts[b]), int(starts[b + 1])
        if q1 == q0:
            continue
        sequence = dict(block_table=xp.asarray(pages[b:b + 1]), kv_lengths=xp.asarray(used[b:b + 1]),
                        q_offset=xp.asarray(offsets[b:b + 1]), **single)
        if scales is None:
            result = api.attention(q[None, q0:q1], k_cache, v_cache, **sequence)
        else:
            problem, implementation = api.checked_problem(
                q[None, q0:q1], *_quantized.stand_ins(xp, k_cache, v_cache, q.dtype), sequence)
            result = api.run_problem(_quantized.with_codes(problem, k_cache, v_cache, scales), implementation)
        if want_lse:
            out[q0:q1], lse[:, q0:q1] = result[0][0], result[1][0]
        else:
            out[q0:q1] = result[0]
    return (out, lse) if want_lse else out
