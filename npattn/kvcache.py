"""Decoding against a KV cache as one function call (FlashAttention's
``flash_attn_with_kvcache``): rotate the new queries and keys, append the new keys and
values in place at each sequence's own cache length, then attend.

Layouts are FlashAttention's, batch first and heads third ("bshd"):

- q (B, Sq, H, D): the new queries;
- a contiguous cache: k_cache (Bc, S, Hkv, D) and v_cache (Bc, S, Hkv, Dv); sequence b
  uses cache row ``cache_batch_idx[b]`` (default b);
- a paged cache: k_cache (pages, page_size, Hkv, D) and v_cache likewise, one pool for
  every sequence; ``block_table`` (B, pages per sequence) lists sequence b's pages, so
  its key t lives at ``k_cache[block_table[b, t // page_size], t % page_size]``;
- k (B, Sn, Hkv, D) and v (B, Sn, Hkv, Dv): the new keys and values (optional);
- cache_seqlens: int or int (B,): the keys each sequence has cached before the new ones.

Sequence b then has ``L_b = cache_seqlens[b] + Sn`` keys, and its query row i sits at key
position ``L_b - Sq + i`` (bottom-right within its own keys: with as many new keys as
queries, the usual decode step, row i is new key i, at ``cache_seqlens[b] + i``; with no
new keys the queries are the last Sq cached positions). Causal masking, windows and
ALiBi count from there, and rotary embeddings rotate each row of q and of the new k by
its position. The attention itself is :func:`npattn.attention` with a per-sequence
``q_offset`` and ``kv_lengths``, so every other option works as it does there.
"""
from __future__ import annotations

from numbers import Integral
from typing import Any

import numpy as np

from . import _arrays, api, checks
from .types import Outputs

# Options attention_with_kvcache sets from its own arguments.
_RESERVED = ("layout", "q_offset", "kv_lengths", "kv_start", "q_start", "q_lengths", "block_table")


def attention_with_kvcache(q: Any, k_cache: Any, v_cache: Any, k: Any = None, v: Any = None, *,
                           cache_seqlens: Any, block_table: Any = None, cache_batch_idx: Any = None,
                           rotary_cos: Any = None, rotary_sin: Any = None, rotary_interleaved: bool = False,
                           **options: Any) -> Outputs:
    """Append ``k`` and ``v`` to the caches (in place) after each sequence's cached keys,
    then return :func:`npattn.attention` of ``q`` against every sequence's keys.

    Shapes (see :mod:`npattn.kvcache`): q (B, Sq, H, D); k_cache, v_cache (Bc, S, Hkv, D/Dv)
    or, with ``block_table`` (B, P) int, paged pools (pages, page_size, Hkv, D/Dv); k, v
    (B, Sn, Hkv, D/Dv) or None (no append); ``cache_seqlens`` int or int (B,), with
    ``cache_seqlens + Sn`` at most the cache's length (S, or P * page_size);
    ``cache_batch_idx`` (B,) int: the contiguous cache row of each sequence (a batch of
    requests that occupy some of the cache's slots).

    ``rotary_cos`` and ``rotary_sin`` (positions, R / 2), R even and at most D: rotate the
    first R lanes of q and of the new k by their positions before anything else, as pairs
    ``(x[i], x[i + R/2])`` (GPT-NeoX, Llama) or, with ``rotary_interleaved``, as pairs
    ``(x[2i], x[2i + 1])`` (GPT-J); the tables must cover position
    ``cache_seqlens + Sn - 1`` of every sequence, and no query may sit before position 0
    (``Sq <= cache_seqlens + Sn``). Cached keys are never rotated again.

    ``options`` are those of :func:`npattn.attention` (``causal``, ``window``, ``sinks``,
    ``sink_logits``, ``alibi_slopes``, ``softcap``, ``scale``, ``return_lse``, ...) but
    ``layout``, ``q_offset``, ``q_lengths``, ``kv_lengths``, ``q_start``, ``kv_start``
    and ``block_table`` (an argument here), which this call sets; ``causal`` aligns each
    sequence bottom-right (``"top_left"`` does not apply). Returns out (B, Sq, H, Dv), or
    the tuple with lse (B, H, Sq) as ``attention`` does. Only the caches are modified; q,
    k and v are not.

    The kernels read a paged cache in place, page by page (the ``block_table`` option of
    :func:`npattn.attention`), and a contiguous one through ``cache_batch_idx`` as pages
    of one row each: nothing is gathered or copied.
    """
    for name in _RESERVED:
        if name in options:
            raise TypeError(f"attention_with_kvcache sets {name} itself (from cache_seqlens and the shapes); "
                            f"got {name}={options[name]!r}")
    if options.get("causal") == "top_left":
        raise ValueError('attention_with_kvcache aligns each sequence\'s queries with its last keys; '
                         'causal="top_left" does not apply (use causal=True)')
    q, k_cache, v_cache = checks.as_arrays(q=q, k_cache=k_cache, v_cache=v_cache)
    xp = _arrays.array_module(q)
    batch, q_len, heads, head_dim = _four_d("q", q, "(B, Sq, H, D)")
    paged = block_table is not None
    cache_shape = "(pages, page_size, Hkv, D)" if paged else "(Bc, S, Hkv, D)"
    cache_rows, cache_len, kv_heads, _ = _four_d("k_cache", k_cache, cache_shape)
    _four_d("v_cache", v_cache, cache_shape.replace("D)", "Dv)"))
    for name, array in (("k_cache", k_cache), ("v_cache", v_cache)):
        if array.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {array.dtype} but q has {q.dtype}; they must share one dtype")
    if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must agree on all but "
                         f"the last axis, and k_cache's last axis must be q's head dim {head_dim}")
    if paged:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx selects rows of a contiguous cache; a paged cache takes block_table only")
        (block_table,) = checks.as_arrays(block_table=block_table, reference=q)
        # (its entries are checked with attention's other options, before the cache is written)
        block_table = _int_array("block_table", block_table, (batch, None), "(B, pages per sequence)")
        capacity = block_table.shape[1] * cache_len
    else:
        capacity = cache_len
        if cache_batch_idx is not None:
            (cache_batch_idx,) = checks.as_arrays(cache_batch_idx=cache_batch_idx, reference=q)
            cache_batch_idx = _int_array("cache_batch_idx", cache_batch_idx, (batch,), "(B,)")
            _check_range("cache_batch_idx", cache_batch_idx, 0, cache_rows - 1)
        elif cache_rows != batch:
            raise ValueError(f"k_cache has {cache_rows} rows but q has batch {batch}: give cache_batch_idx (B,) "
                             f"to say which row each sequence uses")
    new_len = 0
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new keys and their values), or neither")
    if k is not None:
        k, v = checks.as_arrays(k=k, v=v, reference=q)
        for name, array, width in (("k", k, head_dim), ("v", v, v_cache.shape[3])):
            if array.dtype != q.dtype:
                raise TypeError(f"{name} has dtype {array.dtype} but q has {q.dtype}; they must share one dtype")
            if array.ndim != 4 or array.shape[0] != batch or array.shape[2:] != (kv_heads, width):
                raise ValueError(f"{name} must have shape (B, Sn, Hkv, {'D' if name == 'k' else 'Dv'}) = "
                                 f"({batch}, Sn, {kv_heads}, {width}), got {tuple(array.shape)}")
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"k and v must have the same number of new keys, got {k.shape[1]} and {v.shape[1]}")
        new_len = k.shape[1]
    seqlens = _cache_seqlens(cache_seqlens, batch)
    too_long = np.flatnonzero(seqlens + new_len > capacity)
    if too_long.size:
        b = int(too_long[0])
        raise ValueError(f"cache_seqlens[{b}] + {new_len} new keys = {seqlens[b] + new_len} exceeds the cache's "
                         f"{capacity} keys per sequence")
    first_query = seqlens + new_len - q_len  # each sequence's row 0, bottom-right among its keys
    rotary = _check_rotary(rotary_cos, rotary_sin, head_dim, int((seqlens + new_len).max(initial=0)), q)
    if rotary is not None:  # new arrays: the caller's q and k stay as they were
        early = np.flatnonzero(first_query < 0)
        if early.size:
            b = int(early[0])
            raise ValueError(f"rotary embeddings need every query at a position >= 0: sequence {b} has "
                             f"{seqlens[b] + new_len} keys for {q_len} queries")
        q = apply_rotary(q, first_query, *rotary, rotary_interleaved)
        if k is not None:
            k = apply_rotary(k, seqlens, *rotary, rotary_interleaved)
    keys_used = int((seqlens + new_len).max(initial=0))
    keys, values = k_cache, v_cache
    if block_table is not None:  # every page a sequence writes or reads, checked as attention's option
        options["block_table"] = block_table[:, :-(-keys_used // cache_len)]
    elif cache_batch_idx is not None:  # each sequence's cache row as its one page
        options["block_table"] = cache_batch_idx[:, None]
    else:  # the cached prefix of every row, a view
        keys, values = k_cache[:, :keys_used], v_cache[:, :keys_used]
    # every check of the attention call before the cache changes: a call that raises leaves it as it was
    problem, implementation = api.checked_problem(q, keys, values, dict(
        options, layout="bshd", q_offset=xp.asarray(first_query), kv_lengths=xp.asarray(seqlens + new_len)))
    if k is not None and new_len:
        if options.get("check_finite"):
            checks.check_all_finite("k", k)
            checks.check_all_finite("v", v)
        _append(xp, k_cache, v_cache, k, v, seqlens, block_table, cache_batch_idx)
    return api.run_problem(problem, implementation)


def apply_rotary(x: Any, starts: np.ndarray, cos: Any, sin: Any, interleaved: bool = False) -> Any:
    """``x`` (B, S, H, D) with row s of sequence b rotated by position ``starts[b] + s``:
    its first R lanes (``cos`` and ``sin`` (positions, R / 2)) as pairs ``(x[i], x[i + R/2])``,
    or ``(x[2i], x[2i + 1])`` when ``interleaved``; the other lanes as they are. A new
    array of x's dtype, computed in float32 (float64 for float64)."""
    xp = _arrays.array_module(x)
    compute = np.float64 if x.dtype == np.float64 else np.float32
    positions = xp.asarray(starts)[:, None] + xp.arange(x.shape[1])[None, :]  # (B, S)
    half = cos.shape[1]
    c = cos[positions].astype(compute)[:, :, None, :]  # (B, S, 1, R/2)
    s = sin[positions].astype(compute)[:, :, None, :]
    rotated = x.astype(compute, copy=True)
    if interleaved:
        first, second = rotated[..., 0:2 * half:2].copy(), rotated[..., 1:2 * half:2].copy()
        rotated[..., 0:2 * half:2] = first * c - second * s
        rotated[..., 1:2 * half:2] = first * s + second * c
    else:
        first, second = rotated[..., :half].copy(), rotated[..., half:2 * half].copy()
        rotated[..., :half] = first * c - second * s
        rotated[..., half:2 * half] = first * s + second * c
    return rotated.astype(x.dtype, copy=False)


def _append(xp, k_cache, v_cache, k, v, seqlens, block_table, cache_batch_idx):
    """Write k, v (B, Sn, Hkv, .) at keys ``[seqlens[b], seqlens[b] + Sn)`` of each sequence."""
    batch, new_len = k.shape[:2]
    positions = xp.asarray(seqlens)[:, None] + xp.arange(new_len)[None, :]  # (B, Sn)
    if block_table is not None:
        page_size = k_cache.shape[1]
        rows = xp.take_along_axis(block_table, positions // page_size, axis=1)
        positions = positions % page_size
    else:
        rows = xp.arange(batch) if cache_batch_idx is None else cache_batch_idx
        rows = xp.broadcast_to(rows[:, None], positions.shape)
    k_cache[rows, positions] = k
    v_cache[rows, positions] = v


def _four_d(name, array, described):
    checks.check_float_dtype(name, array)
    if array.ndim != 4:
        raise ValueError(f"{name} must be 4-D {described}, got {array.ndim}-D shape {tuple(array.shape)}")
    return tuple(array.shape)


def _int_array(name, array, shape, described):
    if array.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array {described}, got dtype {array.dtype}")
    if array.ndim != len(shape) or any(want is not None and got != want for got, want in zip(array.shape, shape)):
        raise ValueError(f"{name} must have shape {described}, got {tuple(array.shape)}")
    return array.astype(np.int64, copy=False)


def _check_range(name, array, lowest, highest):
    host = _arrays.to_numpy(array)
    bad = np.argwhere((host < lowest) | (host > highest))
    if bad.size:
        index = tuple(int(i) for i in bad[0])
        raise ValueError(f"{name} must lie in [{lowest}, {highest}], got {name}{list(index)} = {host[index]}")


def _cache_seqlens(value, batch):
    """cache_seqlens as an int64 (B,) NumPy array (>= 0)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"cache_seqlens must be an int or an int array of shape (B,), got bool {value!r}")
    if isinstance(value, Integral):
        seqlens = np.full(batch, int(value), np.int64)
    else:
        host = _arrays.to_numpy(value) if hasattr(value, "shape") else np.asarray(value)
        if host.dtype.kind not in "iu":
            raise TypeError(f"cache_seqlens must be an int or an int array of shape (B,), got dtype {host.dtype}")
        if host.shape != (batch,):
            raise ValueError(f"cache_seqlens must have shape (B,) = ({batch},), got {host.shape}")
        seqlens = host.astype(np.int64)
    negative = np.flatnonzero(seqlens < 0)
    if negative.size:
        raise ValueError(f"cache_seqlens must be >= 0, got cache_seqlens[{negative[0]}] = {seqlens[negative[0]]}")
    return seqlens


def _check_rotary(cos, sin, head_dim, positions_needed, q):
    """(cos, sin) as arrays of q's kind, or None; checks shapes and that they cover the positions."""
    if cos is None and sin is None:
        return None
    if cos is None or sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together")
    cos, sin = checks.as_arrays(rotary_cos=cos, rotary_sin=sin, reference=q)
    for name, array in (("rotary_cos", cos), ("rotary_sin", sin)):
        checks.check_float_dtype(name, array)
        if array.ndim != 2:
            raise ValueError(f"{name} must be 2-D (positions, R / 2), got shape {tuple(array.shape)}")
    if cos.shape != sin.shape:
        raise ValueError(f"rotary_cos {tuple(cos.shape)} and rotary_sin {tuple(sin.shape)} must have one shape")
    if 2 * cos.shape[1] > head_dim:
        raise ValueError(f"rotary_cos's {cos.shape[1]} columns rotate {2 * cos.shape[1]} lanes, more than the "
                         f"head dim {head_dim}")
    if cos.shape[0] < positions_needed:
        raise ValueError(f"rotary_cos has {cos.shape[0]} positions, but the last key or query sits at position "
                         f"{positions_needed - 1}")
    return cos, sin
