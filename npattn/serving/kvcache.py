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

A call that raises leaves the caches byte-identical: every check (shapes, dtypes,
writability, slots written twice or read by another sequence, the positions' range,
the free memory, ``check_finite``) runs before the first write, and should the
attention itself fail after the append (out of memory, an interrupt), the slots written
get their old bytes back before the error propagates.
"""
from __future__ import annotations

import copy
from typing import Any

import numpy as np

from ..core import arrays as _arrays
from .. import api
from .prefix import SharedPrefix
from . import quantized as _quantized
from ..core.problem import with_arrays
from ..core.quantization import RunScales, quantize_rows
from ..core import checks
from ..runtime import limits as _limits
from ..runtime import plans as _plans
from ..core import options as _options
from ..types import Outputs

# Options attention_with_kvcache sets from its own arguments (the options table says which).
_RESERVED = _options.set_by(_options.KVCACHE)
# Slots the caches hold at most as many as this per sequence: the kernels count positions in
# int32 arithmetic with room to spare (npattn.core.options.Q_OFFSET_LIMIT)
POSITION_LIMIT = _options.Q_OFFSET_LIMIT


def attention_with_kvcache(q: Any, k_cache: Any, v_cache: Any, k: Any = None, v: Any = None, *,
                           cache_seqlens: Any, block_table: Any = None, cache_batch_idx: Any = None,
                           rotary_cos: Any = None, rotary_sin: Any = None, rotary_interleaved: bool = False,
                           cache_leftpad: Any = None, prefix_k: Any = None, prefix_v: Any = None,
                           k_scale: Any = None, v_scale: Any = None, **options: Any) -> Outputs:
    """Append ``k`` and ``v`` to the caches (in place) after each sequence's cached keys,
    then return :func:`npattn.attention` of ``q`` against every sequence's keys.

    Shapes (see :mod:`npattn.serving.kvcache`): q (B, Sq, H, D); k_cache, v_cache (Bc, S, Hkv, D/Dv)
    or, with ``block_table`` (B, P) int, paged pools (pages, page_size, Hkv, D/Dv); k, v
    (B, Sn, Hkv, D/Dv) or None (no append); ``cache_seqlens`` int or int (B,), with
    ``cache_seqlens + Sn`` at most the cache's length (S, or P * page_size);
    ``cache_batch_idx`` (B,) int: the contiguous cache row of each sequence (a batch of
    requests that occupy some of the cache's slots). Entries of ``block_table`` past the
    pages a sequence holds are never read (padding such as -1 is fine there).
    ``cache_leftpad`` int or int (B,) (FlashAttention's left-padded caches): sequence b's
    keys start at slot ``cache_leftpad[b] <= cache_seqlens[b]`` of its row; the slots before
    are never read, and its positions (causal alignment, windows, ALiBi, rotary) count
    from there.
    ``prefix_k`` (Sp, Hkv, D) and ``prefix_v`` (Sp, Hkv, Dv): a prefix every sequence sees
    before its own keys (a shared system prompt; keys at positions 0 to Sp - 1, each
    sequence's own from Sp on), read once for the whole batch (:mod:`npattn.serving.prefix`):
    the same answer as the prefix copied in front of every sequence's cache. Not with
    ``mask``, ``bias`` or dropout.

    ``k_scale`` and ``v_scale``: a quantized cache (:mod:`npattn.core.quantization`):
    k_cache and v_cache hold int8 codes (or uint8 float8 e4m3 bits) and these float32 arrays, shaped like the caches
    without their last axis, a scale per key slot and kv head (key t of sequence b reads
    as ``k_cache[b, t] * k_scale[b, t][:, None]``); D and Dv must be multiples of 16. New
    k and v (q's float dtype) are quantized as :func:`npattn.quantize_kv` does and written,
    codes and scales, at their slots. The kernels dequantize a tile at a time (cpu and
    reference backends).

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
    sequence bottom-right (``"top_left"`` does not apply). ``check_finite=True`` checks
    what the call reads: q, the new k and v, and each sequence's cached keys and values
    (a NaN in a slot no sequence reads is no error). Returns out (B, Sq, H, Dv), or the
    tuple with lse (B, H, Sq) as ``attention`` does. Only the caches are modified; q, k
    and v are not.

    When new keys are appended the caches must be writable NumPy or CuPy arrays (or torch
    tensors, written through a view of their memory) in native byte order; a call that
    would write one slot twice, or a slot another sequence of the call reads (two
    sequences sharing a cache row or a page they write), raises. Shared pages that are
    only read (a common prompt prefix) are fine. A call that raises leaves the caches
    byte-identical.

    The kernels read a paged cache in place, page by page (the ``block_table`` option of
    :func:`npattn.attention`), and a contiguous one through ``cache_batch_idx`` as pages
    of one row each: nothing is gathered or copied. Without ``cache_batch_idx`` they read
    each row's first keys, as many as the longest sequence holds, rounded up to a multiple
    of :data:`KEY_BUCKET` on the CPU (each sequence bounded by its own length), so that a
    decode loop's steps share the CPU's plans of one shape.

    A call whose every argument equals an earlier successful call's but for the arrays'
    data (the same structures, metadata and plain option values: the step's next layer)
    runs the plan that call's checks made, which checks each run's arrays as
    :meth:`KVCachePlan.run` does; calls with rotary tables, a shared prefix, a mask, a
    bias, sink logits or dropout without a seed are checked in full every time
    (:func:`plan_with_kvcache` plans those). A call that differs from such a call in
    ``cache_seqlens`` alone (the next step's first layer) runs that plan moved on to its
    lengths (:meth:`KVCachePlan.advanced`: NumPy caches, contiguous within one
    :data:`KEY_BUCKET` of keys read, or paged while the longest sequence holds as many
    pages), which checks the lengths, and the pages and slots they reach, as the full
    checks do.

    Arrays of other kinds that speak DLPack (torch tensors, JAX arrays) are read where they
    lie and the outputs come back in q's kind; the call is forward-only (no gradients), and
    a JAX cache, which cannot be written in place, takes no new keys.
    """
    key = moving_key = None
    if rotary_cos is None and rotary_sin is None and prefix_k is None and prefix_v is None:
        arrays = (q, k_cache, v_cache, k, v, k_scale, v_scale)
        key = _step_key(arrays, (cache_seqlens, block_table, cache_batch_idx, cache_leftpad), rotary_interleaved,
                        options)
    if key is not None:
        step = _STEPS.get(key)
        if step is not None:  # another layer of a step checked before: its plan runs it
            return step.run(q, k_cache, v_cache, k, v, k_scale=k_scale, v_scale=v_scale)
        moving_key = _moving_key(key, cache_seqlens)
        moving = _MOVING.get(moving_key)
        step = None if moving is None else moving.advanced(cache_seqlens)
        if step is not None:  # the next step of a decode loop checked before: its plan, moved on
            result = step.run(q, k_cache, v_cache, k, v, k_scale=k_scale, v_scale=v_scale)
            _STEPS.put(key, step)
            _MOVING.put(moving_key, step)
            return result
    step = _checked(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx, rotary_cos, rotary_sin,
                    rotary_interleaved, cache_leftpad, (prefix_k, prefix_v), (k_scale, v_scale), options)
    result = step.run_checked()
    if key is not None:
        released = step.released()
        _STEPS.put(key, released)
        if released.moves:
            _MOVING.put(moving_key, released)
    return result


# A decoder calls attention_with_kvcache once per layer with the same metadata (the
# step's cache_seqlens, block_table, ...), on caches of one structure: the layers after
# the first run the plan the first one's checks made (20 us of a (1, 8/2, 1 + 40, 64)
# layer, where the checks and the plan cost 211; bench --plans). Keyed by everything those
# checks read (_step_key), and only after they passed; a few steps are kept, the newest.
_STEPS = _plans.PlanCache(limit=8)
# and the next step's first layer, whose cache_seqlens moved on, runs the plan of the step
# before it moved to the new lengths (KVCachePlan.advanced) where nothing else changed: the
# step's key with cache_seqlens by structure (_moving_key)
_MOVING = _plans.PlanCache(limit=8)


def _moving_key(key: tuple, cache_seqlens: Any) -> tuple:
    """``key`` (a :func:`_step_key`) with ``cache_seqlens`` by its kind, dtype and shape in
    place of its value: the steps of one decode loop share it."""
    structure = ((np.ndarray, cache_seqlens.dtype.str, cache_seqlens.shape) if type(cache_seqlens) is np.ndarray
                 else (type(cache_seqlens),))
    structures, kind, interleaved, values, options = key
    return (structures, kind, interleaved, (structure, values[1:]), options)


def _step_key(arrays: tuple, metadata: tuple, rotary_interleaved: Any, options: dict) -> tuple | None:
    """The key of an attention_with_kvcache call (no rotary tables or shared prefix) under
    which the plan of an earlier call with the same key runs it, or None where the call
    is not kept: every argument the checks read but the arrays' values, which the runs
    check themselves where they matter (writability and overlap of the caches). ``arrays``
    (q, k_cache, v_cache, k, v, k_scale, v_scale): NumPy arrays (or None where optional),
    by their exact structure; ``metadata`` (cache_seqlens, block_table, cache_batch_idx,
    cache_leftpad): by value (:func:`npattn.runtime.plans.values_key`); ``options``: as
    :func:`npattn.runtime.plans.call_key` keys them."""
    structures = _plans.numpy_structures(*arrays)
    if structures is None or structures[0] is None or structures[1] is None or structures[2] is None:
        return None
    values = _plans.values_key(metadata)
    options_part = None if values is None else _plans.options_key(options)
    if options_part is None:
        return None
    return (structures, type(rotary_interleaved), rotary_interleaved, values, options_part)


def plan_with_kvcache(q: Any, k_cache: Any, v_cache: Any, k: Any = None, v: Any = None, *, cache_seqlens: Any,
                      block_table: Any = None, cache_batch_idx: Any = None, rotary_cos: Any = None,
                      rotary_sin: Any = None, rotary_interleaved: bool = False, cache_leftpad: Any = None,
                      prefix_k: Any = None, prefix_v: Any = None, k_scale: Any = None, v_scale: Any = None,
                      **options: Any) -> "KVCachePlan":
    """Every check of ``attention_with_kvcache(q, k_cache, v_cache, k, v, ...)`` once, for a
    decode step that runs on every layer of a model: a :class:`KVCachePlan` whose
    :meth:`~KVCachePlan.run` takes each layer's q, caches and new keys (arrays of the
    structure given here: kind, dtype, shape, strides) and appends and attends as
    :func:`attention_with_kvcache` does, bit for bit, without checking again what depends
    on the step's metadata (``cache_seqlens``, ``block_table``, ``cache_batch_idx``, the
    rotary tables, the options). Nothing is written here: the arrays give the structure.

    The metadata belong to the plan (copied now): a step's plan serves that step only; the
    next step, whose ``cache_seqlens`` moved on, takes a new plan, or this one moved on to
    its lengths by :meth:`KVCachePlan.advanced` where that applies (NumPy caches, no
    left padding, rotary tables or prefix, ...: None where not). ``check_finite=True``
    checks what each run reads; ``bias`` is read where it lies at each run.
    """
    arguments = (q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx, rotary_cos, rotary_sin,
                 cache_leftpad, prefix_k, prefix_v, k_scale, v_scale)
    _arrays.check_native("plan_with_kvcache", "torch tensors and JAX arrays: attention_with_kvcache",
                         (*arguments, *options.values()))
    return _checked(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx, rotary_cos, rotary_sin,
                    rotary_interleaved, cache_leftpad, (prefix_k, prefix_v), (k_scale, v_scale), options)


class KVCachePlan:
    """A checked kv-cache step (:func:`plan_with_kvcache`): ``run(q, k_cache, v_cache, k, v)``
    appends and attends on arrays of the plan's structure; arrays of another structure
    raise ValueError naming the argument. A run that raises leaves the caches as they were.
    ``advanced(cache_seqlens)`` gives the plan of the decode loop's next step."""

    def __init__(self, checked: tuple, structure: dict, metadata: tuple, rotary: tuple | None, finite: bool,
                 bias: Any, shared: Any = None, prefix_arrays: tuple = ()):
        # (problem, backend, the checked caches (k_cache, v_cache[, k_scale, v_scale]) and
        # what the call appends to them (k rotated, v[, as codes and scales]) or None): what
        # the call that planned runs first; the api's Plan of the attention, made at a second run
        self._checked, self._attend, self._structure = checked, None, structure
        self._codes_plan = None  # a quantized step's api Plan of the codes' structure, made at a second run
        self._quantized = structure["k_scale"] is not None
        self._exact = tuple(None if structure[name] is None else structure[name][0]
                            for name in ("q", "k_cache", "v_cache", "k", "v", "k_scale", "v_scale"))
        self._planned_problem = api.owned(checked[0])  # for the runs, which check no option again
        (self._seqlens, self._starts, self._pages, self._rows, self._positions, self._keys_used, self._prefix,
         self._page_size) = metadata
        self._rotary, self._finite, self._bias = rotary, finite, bias
        self._shared = shared  # a SharedPrefix, or None
        self._prefix_arrays = prefix_arrays  # (q rotated, prefix_k, prefix_v) of the call that planned
        new_keys = 0 if structure["k"] is None else structure["k"][0][2][1]
        self._appends = new_keys > 0
        # where each new key goes: fixed by the step's metadata, worked out once; NumPy
        # caches take them through the backend's compiled writer where it has one
        problem, implementation, caches, new = checked
        xp = problem.xp
        compiled = self._appends and xp is np and hasattr(implementation, "slot_writer")
        self._slots = (_slots(xp, structure["q"][0][2][0], new_keys, self._seqlens, self._pages, self._rows,
                              self._page_size, views=not compiled) if self._appends else None)
        self._writer = implementation.slot_writer(caches, new, *self._slots) if compiled else None
        # a quantized cache's new float rows quantized in the writer's pass (its runs; the call
        # that planned has its codes already)
        self._quantizing = (self._writer is not None and self._quantized
                            and self._writer.quantizes(structure["k"][0][1]))
        # run's fast paths (_fast_path, _quantized_fast_path): made by the runs, from the
        # run that plans the attention on (the call that plans may be the only one)
        self._fast = None
        self._quick = _UNSET
        # (batch, capacity, new keys, query rows, the pool's pages, a paged call's table)
        # where the plan may move on to another step's cache_seqlens (advanced), set by
        # the checks that made it; else None
        self._advance = None

    def _fast_path(self):
        """What :meth:`run`'s fast path compares, or None where a run takes the full one: a
        plain step (NumPy arrays q, k_cache, v_cache, k, v, 4-D each; no quantized cache,
        shared prefix, rotary table or finite check) whose writer compares shapes and strides in
        its compiled call (:meth:`~npattn.cpu.slots.SlotWriter.write_checked`). The
        dtypes of the five arrays, their shapes and strides as the writer compares them, and
        the index of the keys the attention reads (a prefix of each cache, or all of it)."""
        exact = self._exact[:5]
        if (self._quantized or self._shared is not None or self._finite or self._rotary is not None
                or any(structure is None or structure[0] is not np.ndarray or len(structure[2]) != 4
                                       for structure in exact)):
            return None
        used = (slice(None), slice(None, self._keys_used)) if self._prefix else ...
        return tuple(dtype for _, dtype, _, _ in exact), _compared(exact), used, self._writer.write_checked

    def _quantized_fast_path(self):
        """What :meth:`run`'s fast path for an int8 or e4m3 cache whose writer quantizes the new rows
        compares, or None where a run takes the full one: a plain step (NumPy arrays, q,
        the caches, k and v 4-D, the scales 3-D; no shared prefix, rotary table or finite
        check) whose writer compares shapes and strides in its compiled call
        (:meth:`~npattn.cpu.slots.SlotWriter.quantize_checked`). The dtypes of the seven
        arrays (q, k_cache, v_cache, k, v, k_scale, v_scale), their shapes and strides as the
        writer compares them, and the index of the keys the attention reads (None: all)."""
        exact = self._exact
        if (self._shared is not None or self._finite or self._rotary is not None
                or any(structure is None or structure[0] is not np.ndarray or len(structure[2]) != ndim
                       for structure, ndim in zip(exact, _QUANTIZED_NDIMS))):
            return None
        # (q, the caches, the scales, k, v: the writer's order)
        expected = _compared([exact[index] for index in (0, 1, 2, 5, 6, 3, 4)])
        used = (slice(None), slice(None, self._keys_used)) if self._prefix else None
        return tuple(dtype for _, dtype, _, _ in exact), expected, used

    def run(self, q: Any, k_cache: Any, v_cache: Any, k: Any = None, v: Any = None, prefix_k: Any = None,
            prefix_v: Any = None, k_scale: Any = None, v_scale: Any = None) -> Outputs:
        """Append ``k`` and ``v`` in place after each sequence's cached keys, then return
        :func:`npattn.attention` of ``q`` against every sequence's keys (what
        :func:`attention_with_kvcache` returns; after ``prefix_k`` and ``prefix_v`` where the
        plan was made with a prefix; a quantized cache's ``k_scale`` and ``v_scale`` where it
        was made with them); the appended slots get their old bytes back if anything raises
        after the first write."""
        fast = self._fast
        if fast is not None and prefix_k is None and prefix_v is None and k_scale is None and v_scale is None:
            # a plain step whose shapes and strides the writer's compiled call compares: the
            # checks and the write cost 1.3 us, where the checks below and the dispatcher's
            # write cost 3.2 of a 14 us step; an array that differs takes the checks below,
            # which name it
            dtypes, expected, used, write_checked, attend = fast
            array = np.ndarray
            if (type(q) is array and type(k_cache) is array and type(v_cache) is array and type(k) is array
                    and type(v) is array and (q.dtype, k_cache.dtype, v_cache.dtype, k.dtype, v.dtype) == dtypes
                    and (q.ndim, k_cache.ndim, v_cache.ndim, k.ndim, v.ndim) == _FOUR_D
                    and k_cache.flags.writeable and v_cache.flags.writeable
                    # (_share_memory's first test written out: its call is 0.1 us of the step)
                    and ((k_cache.base is None and v_cache.base is None and k_cache is not v_cache)
                         or not _share_memory(k_cache, v_cache))):
                staged = write_checked(q, k_cache, v_cache, k, v, expected)
                if staged is not None:
                    try:
                        return attend(q, k_cache[used], v_cache[used])
                    except BaseException:
                        self._writer.restore((k_cache, v_cache), (k, v), (staged,))
                        raise
        quick = self._quick
        if quick is _UNSET:
            quick = self._quick = self._quantized_fast_path() if self._quantizing else None
        if quick is not None and prefix_k is None and prefix_v is None:
            # a plain step on an int8 or e4m3 cache: the checks and the quantizing write in one
            # compiled call (1.4 us of structures, 1.5 of checks and 2.6 of the write, the
            # dispatcher's typing most of it, became 2.2); an array that differs, or a row
            # not finite in float32, takes the checks below
            dtypes, expected, used = quick
            array = np.ndarray
            if (type(q) is array and type(k_cache) is array and type(v_cache) is array and type(k) is array
                    and type(v) is array and type(k_scale) is array and type(v_scale) is array
                    and (q.dtype, k_cache.dtype, v_cache.dtype, k.dtype, v.dtype, k_scale.dtype,
                         v_scale.dtype) == dtypes
                    and (q.ndim, k_cache.ndim, v_cache.ndim, k.ndim, v.ndim, k_scale.ndim,
                         v_scale.ndim) == _QUANTIZED_NDIMS
                    and k_cache.flags.writeable and v_cache.flags.writeable and k_scale.flags.writeable
                    and v_scale.flags.writeable and _own_apart((k_cache, v_cache, k_scale, v_scale))):
                caches = (k_cache, v_cache, k_scale, v_scale)
                olds = self._writer.quantize_checked(q, caches, (k, v), expected)
                if type(olds) is not int:
                    try:
                        if used is None:
                            return self._codes_attention(q, k_cache, v_cache, _quantized.Scales(k_scale, v_scale))
                        return self._codes_attention(q, k_cache[used], v_cache[used],
                                                     _quantized.Scales(k_scale[used], v_scale[used]))
                    except BaseException:
                        self._writer.restore(caches, (k, v), olds)
                        raise
        shared = self._shared
        if (shared is None) != (prefix_k is None and prefix_v is None):
            raise ValueError("prefix_k and prefix_v are given, but the plan was made without them" if shared is None
                             else "the plan was made with prefix_k and prefix_v: pass this layer's")
        if shared is not None:
            shared.check_run(prefix_k, prefix_v)
        if checks.exact_structures(q, k_cache, v_cache, k, v, k_scale, v_scale) != self._exact:
            structure, check = self._structure, checks.check_structure
            check("q", q, structure["q"])
            check("k_cache", k_cache, structure["k_cache"])
            check("v_cache", v_cache, structure["v_cache"])
            check("k", k, structure["k"])
            check("v", v, structure["v"])
            check("k_scale", k_scale, structure["k_scale"])
            check("v_scale", v_scale, structure["v_scale"])
        quantized = self._quantized
        if self._appends:
            _check_writable("k_cache", k_cache)
            _check_writable("v_cache", v_cache)
            if quantized:
                _check_writable("k_scale", k_scale)
                _check_writable("v_scale", v_scale)
                _check_apart({"k_cache": k_cache, "v_cache": v_cache, "k_scale": k_scale, "v_scale": v_scale})
            elif _share_memory(k_cache, v_cache):  # (the dict and loops of _check_apart: 0.5 us a step)
                _check_apart({"k_cache": k_cache, "v_cache": v_cache})
        scales = _quantized.Scales(k_scale, v_scale) if quantized else None
        if self._finite:
            _check_finite_reads(q, k, v, *_read_caches(k_cache, v_cache, scales), self._bias, self._seqlens,
                                self._starts, self._pages, self._rows, self._page_size)
        if self._rotary is not None:  # new arrays: the caller's q and k stay as they were
            cos, sin, interleaved = self._rotary
            query_positions, key_positions = self._positions
            q = apply_rotary(q, query_positions, cos, sin, interleaved)
            if k is not None:
                k = apply_rotary(k, key_positions, cos, sin, interleaved)
        keys, values = ((k_cache[:, :self._keys_used], v_cache[:, :self._keys_used]) if self._prefix
                        else (k_cache, v_cache))
        caches, new = (k_cache, v_cache), (None if k is None else (k, v))
        if quantized:
            caches += (k_scale, v_scale)
            if not self._quantizing:  # (else the writer quantizes k and v as it writes them)
                new = None if k is None else _quantized_rows(k, v, k_cache.dtype)
            if self._prefix:
                scales = _quantized.Scales(k_scale[:, :self._keys_used], v_scale[:, :self._keys_used])
            attention = lambda: self._codes_attention(q, keys, values, scales)  # noqa: E731
        else:
            if self._attend is None:  # (of this run's arrays: a released plan holds none)
                self._attend = api.Plan(with_arrays(self._planned_problem, q=q.transpose(0, 2, 1, 3),
                                                    k=keys.transpose(0, 2, 1, 3), v=values.transpose(0, 2, 1, 3)),
                                        self._checked[1])
                if self._writer is not None and self._writer.plain:
                    checked = self._fast_path()
                    if checked is not None:
                        self._fast = (*checked, self._attend.run_trusted)
            attention = lambda: self._attend.run_trusted(q, keys, values)  # noqa: E731
        if shared is None:
            return self._appended(caches, new, attention, self._quantizing)
        return self._appended(caches, new, lambda: shared.attend(q, prefix_k, prefix_v, attention()),
                              self._quantizing)

    def _codes_attention(self, q: Any, keys: Any, values: Any, scales: Any) -> Outputs:
        """The attention of a quantized step on this run's codes (``keys``, ``values``, bshd
        or pools) and ``scales``: through the api's Plan of the codes' structure with the
        run's scales in place of its problem's (:class:`~npattn.core.quantization.RunScales`);
        on a problem of this run's arrays where the plan gives no answer (a result that is
        not all finite, plans of another tuning, a backend without plans)."""
        def problem():  # of this run's arrays: the codes, their scales and q
            return _quantized.with_codes(with_arrays(self._planned_problem, q=q.transpose(0, 2, 1, 3)),
                                         keys, values, scales)

        plan = self._codes_plan
        if plan is None:
            plan = self._codes_plan = api.Plan(problem(), self._checked[1])
        result = plan.planned_forward(q, keys, values, RunScales(self._planned_problem, scales))
        if result is not None:
            return plan.outputs(result)
        return api.run_problem(problem(), self._checked[1])

    def run_checked(self) -> Outputs:
        """The run of the call that made the plan (:func:`attention_with_kvcache`), on the
        arrays its checks already hold (q and the new keys rotated, the caches as checked)."""
        problem, implementation, caches, new = self._checked
        if self._shared is None:
            return self._appended(caches, new, lambda: api.run_problem(problem, implementation))
        q, prefix_k, prefix_v = self._prefix_arrays
        return self._appended(caches, new, lambda: self._shared.attend(
            q, prefix_k, prefix_v, api.run_problem(problem, implementation)))

    @property
    def moves(self) -> bool:
        """Whether :meth:`advanced` can move this plan on to other ``cache_seqlens``."""
        return self._advance is not None

    def advanced(self, cache_seqlens: Any) -> "KVCachePlan | None":
        """This plan for the step after it, whose only change is ``cache_seqlens`` (a decode
        loop's next step): a plan of NumPy caches (contiguous, cache rows picked by
        ``cache_batch_idx``, or paged with the same ``block_table``) with no left padding,
        rotary tables, shared prefix, finite check, bias or asked weights (:attr:`moves`).
        What depends on the lengths is made again from them: their checks, as the full
        checks make them (raising as :func:`attention_with_kvcache` does, whose first
        failing checks they would be: the lengths' range, and with pages the pages they
        reach and the slots the new keys take), the slots of the new keys, the attention's
        kv_lengths, query positions and pages; the runs check their arrays as ever. None
        where the call needs the full checks: a contiguous cache's keys read leave the
        plan's bucket (:data:`KEY_BUCKET`) or every sequence ends at the bucket's end
        (whose full checks give no lengths); a paged step's longest sequence reaches more
        or fewer pages than the plan's."""
        if self._advance is None:
            return None
        batch, capacity, new_len, q_len, pool_pages, table = self._advance
        seqlens = _cache_seqlens(cache_seqlens, batch, capacity, new_len)
        lengths = seqlens + new_len
        pages = self._pages
        if table is not None:  # paged: the pages the lengths reach, checked as the full checks check them
            pages, held = _used_pages(table, lengths, self._page_size, pool_pages)
            if pages.shape != self._pages.shape:
                return None
            if new_len:
                _check_paged_writes(pages, held, seqlens, lengths, self._page_size)
        elif self._prefix:  # a contiguous cache's first keys, read in buckets
            keys_used = _keys_viewed(int(lengths.max(initial=0)), self._page_size, np, {})
            if keys_used != self._keys_used or bool((lengths == keys_used).all()):
                return None
        first_query = lengths - q_len
        placement = dict(kv_lengths=np.ascontiguousarray(lengths, np.int64),
                         row_shifts=np.ascontiguousarray(first_query, np.int64))
        if table is not None:
            placement["block_table"] = pages
        plan = copy.copy(self)
        plan._checked = (None, self._checked[1], None, None)  # (run_checked is its maker's call's alone)
        plan._seqlens, plan._positions, plan._pages = seqlens, (first_query, seqlens), pages
        plan._planned_problem = with_arrays(self._planned_problem, **placement)
        if self._appends:
            plan._slots = _slots(np, batch, new_len, seqlens, pages, self._rows, self._page_size,
                                 views=self._writer is None)
            plan._writer = None if self._writer is None else self._writer.moved(*plan._slots)
        # the attention's plans move on with it where they read lengths already (else the
        # first run makes them), and the fast path with them and the moved writer
        reads_lengths = self._planned_problem.kv_lengths is not None
        plan._attend = self._attend.moved(**placement) if reads_lengths and self._attend is not None else None
        plan._codes_plan = (self._codes_plan.moved(**placement) if reads_lengths and self._codes_plan is not None
                            else None)
        fast = self._fast
        plan._fast = (None if fast is None or plan._attend is None
                      else (*fast[:3], plan._writer.write_checked, plan._attend.run_trusted))
        return plan

    def released(self) -> "KVCachePlan":
        """This plan, for its runs only, without the arrays of the call that made it (which
        :meth:`run_checked` needs, and may no longer be called): q, the caches and the new
        keys give way to stand-ins of their structure, so that a plan kept for later calls
        (:func:`attention_with_kvcache`'s steps) holds no caller's array alive. Only plans
        without a shared prefix, rotary tables or a bias release (those hold what their runs
        read)."""
        assert self._shared is None and self._rotary is None and self._bias is None
        self._checked = (None, self._checked[1], None, None)
        self._planned_problem = api.without_data(self._planned_problem, ("q", "k", "v", "k_scale", "v_scale"))
        return self

    def _appended(self, caches, new, attend, quantize=False):
        """``attend()`` after appending ``new`` to ``caches`` (:func:`_append`) at the plan's
        slots (``quantize``: ``new`` is an int8 cache's float k and v, which the writer
        quantizes); the slots get their old bytes back if anything raises after the first write."""
        if not self._appends:
            return attend()
        writer = self._writer
        if writer is None:
            undo = _append(caches, new, self._slots)
            try:
                return attend()
            except BaseException:
                undo()
                raise
        olds = writer.quantize(caches, new) if quantize else None
        if olds is None:
            if quantize:  # a row not finite in float32: NumPy's rounding, as the call that planned has it
                new = _quantized_rows(*new, caches[0].dtype)
            olds = writer.write(caches, new)
        try:
            return attend()
        except BaseException:
            writer.restore(caches, new, olds)
            raise


def _compared(structures) -> np.ndarray:
    """int64 (n, 8), read-only: each of the checked ``structures``' shape, then its strides
    in bytes (zeros after): the rows a writer's compiled call compares each run's arrays
    with (:func:`npattn.cpu.slots._matches`)."""
    expected = np.zeros((len(structures), 8), np.int64)
    for row, (_, _, shape, strides) in enumerate(structures):
        expected[row, :2 * len(shape)] = (*shape, *strides)
    expected.setflags(write=False)
    return expected


_UNSET = object()  # (a lazy attribute not worked out yet)
_FOUR_D = (4, 4, 4, 4, 4)
_QUANTIZED_NDIMS = (4, 4, 4, 4, 4, 3, 3)  # q, k_cache, v_cache, k, v, k_scale, v_scale


def _checked(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx, rotary_cos, rotary_sin,
             rotary_interleaved, cache_leftpad, prefix, scales, options) -> "KVCachePlan":
    """Every check of the call, in the order a reader would check it, before anything is
    written: the call's plan, holding its arrays as checked for :meth:`KVCachePlan.run_checked`."""
    _check_options(options)
    checks.check_bool("rotary_interleaved", rotary_interleaved)
    finite = options.pop("check_finite", False)
    checks.check_bool("check_finite", finite)
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new keys and their values), or neither")
    appending = k is not None
    (q,) = checks.as_arrays(q=q)
    xp = _arrays.array_module(q)
    batch, q_len, _, head_dim = _four_d("q", q, "(B, Sq, H, D)")
    quantized = scales[0] is not None or scales[1] is not None
    k_cache, v_cache = _checked_caches(q, k_cache, v_cache, paged=block_table is not None, written=appending,
                                       quantized=quantized)
    scales = _quantized.checked_scales(q, k_cache, v_cache, *scales, appending,
                                       lambda name, array: _cache(name, array, q, True))
    if scales is not None and appending:
        _check_apart({"k_cache": k_cache, "v_cache": v_cache, "k_scale": scales.k_scale, "v_scale": scales.v_scale})
    cache_rows, cache_len = k_cache.shape[:2]
    block_table, cache_batch_idx, capacity = _checked_layout(q, k_cache, block_table, cache_batch_idx)
    k, v = _checked_new_keys(q, k_cache, v_cache, k, v) if appending else (None, None)
    new_len = 0 if k is None else k.shape[1]
    seqlens = _cache_seqlens(cache_seqlens, batch, capacity, new_len)
    starts = _cache_leftpad(cache_leftpad, batch, seqlens)
    lengths = seqlens + new_len  # each sequence's end slot after the append
    # the keys of each contiguous cache row the attention reads (the longest sequence's, bucketed)
    keys_used = _keys_viewed(int(lengths.max(initial=0)), cache_len, xp, options)
    # positions count from each sequence's first key: row 0 sits bottom-right among its keys
    first_query = lengths - q_len - (0 if starts is None else starts)
    new_positions = seqlens - (0 if starts is None else starts)
    shared = None
    if prefix[0] is not None or prefix[1] is not None:
        if prefix[0] is None or prefix[1] is None:
            raise ValueError("prefix_k and prefix_v must be given together, or neither")
        shared = SharedPrefix(q, k_cache, *prefix, first_query, options)
        options = shared.own_options(options)
    span = 0 if shared is None else shared.span  # the own keys' positions start after the prefix
    rotary = _check_rotary(rotary_cos, rotary_sin, head_dim, int((first_query + span + q_len).max(initial=0)), q)
    if rotary is not None:
        early = np.flatnonzero(first_query < 0)
        if early.size:
            b = int(early[0])
            raise ValueError(f"rotary_cos and rotary_sin rotate each query by its position, which must be >= 0: "
                             f"sequence {b} has {first_query[b] + q_len} keys for {q_len} queries")
    pages = None
    if block_table is not None:
        host_pages, held = _used_pages(block_table, lengths, cache_len, cache_rows)
        pages = host_pages if xp is np else xp.asarray(host_pages)
        if new_len:
            _check_paged_writes(host_pages, held, seqlens, lengths, cache_len)
    elif cache_batch_idx is not None and new_len:
        _check_distinct_rows(_arrays.to_numpy(cache_batch_idx))
    q_user, k_user, v_user = q, k, v
    if rotary is not None:  # new arrays: the caller's q and k stay as they were
        q = apply_rotary(q, first_query + span, *rotary, rotary_interleaved)
        if k is not None:
            k = apply_rotary(k, new_positions + span, *rotary, rotary_interleaved)
    caches, new = (k_cache, v_cache), (None if k is None else (k, v))
    if scales is not None:  # the codes and scales written together, at the same slots
        caches += tuple(scales)
        new = None if k is None else _quantized_rows(k, v, k_cache.dtype)
    keys, values = k_cache, v_cache
    used_scales = scales
    if pages is not None:  # every page a sequence writes or reads, checked as attention's option
        options["block_table"] = pages
    elif cache_batch_idx is not None:  # each sequence's cache row as its one page
        options["block_table"] = cache_batch_idx[:, None]
    else:  # the cached prefix of every row, a view
        keys, values = k_cache[:, :keys_used], v_cache[:, :keys_used]
        if scales is not None:
            used_scales = _quantized.Scales(scales.k_scale[:, :keys_used], scales.v_scale[:, :keys_used])
    if pages is None and cache_batch_idx is None and starts is None and bool((lengths == keys_used).all()):
        # every sequence has all keys_used keys: the default bottom-right alignment and no
        # lengths say the same as the arrays, and keep the step's attention off the per-entry
        # path (a planned (1, 8/2, 1 + 40, 64) layer 3 us faster)
        placement = {}
    else:
        placement = dict(q_offset=xp.asarray(first_query), kv_lengths=xp.asarray(lengths))
        if starts is not None:
            placement["kv_start"] = xp.asarray(starts)
    arguments = dict(options, layout="bshd", **placement)
    if scales is None:
        problem, implementation = api.checked_problem(q, keys, values, arguments)
    else:  # the checks of shapes and options on float stand-ins; then the codes in their place
        problem, implementation = api.checked_problem(q, *_quantized.stand_ins(xp, keys, values, q.dtype), arguments)
        _quantized.check_backend(implementation)
        problem = _quantized.with_codes(problem, keys, values, used_scales)
    _limits.check_memory(problem, implementation.NAME)
    structure = {name: checks.structure_of(array) for name, array in
                 (("q", q_user), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k_user), ("v", v_user),
                  ("k_scale", None if scales is None else scales.k_scale),
                  ("v_scale", None if scales is None else scales.v_scale))}
    metadata = (seqlens, starts, pages, cache_batch_idx, (first_query + span, new_positions + span), keys_used,
                pages is None and cache_batch_idx is None, cache_len)
    if finite:
        _check_finite_reads(q_user, k_user, v_user, *_read_caches(k_cache, v_cache, scales), options.get("bias"),
                            seqlens, starts, pages, cache_batch_idx, cache_len)
    prefix_arrays = () if shared is None else (q, *checks.as_arrays(prefix_k=prefix[0], prefix_v=prefix[1],
                                                                     reference=q))
    plan = KVCachePlan((problem, implementation, caches, new), structure, metadata,
                       None if rotary is None else (*rotary, rotary_interleaved), finite, options.get("bias"), shared,
                       prefix_arrays)
    if (xp is np and starts is None and rotary is None and shared is None and not finite
            and options.get("bias") is None and not options.get("return_weights")):
        # (a paged plan keeps its table, as the call gave it, to find the pages of the lengths
        # it moves on to: the moving key holds the table's value)
        table = None if pages is None else np.array(_arrays.to_numpy(block_table))
        plan._advance = (batch, capacity, new_len, q_len, cache_rows, table)
    return plan


# A contiguous cache's keys are read as every row's first keys, as many as the longest
# sequence holds rounded up to a whole number of these (on the CPU; each sequence's own
# length bounds its keys): a decode loop's steps then share the CPU's plans of one shape
# for this many steps, where each step's new key count had made its own (130-300 us of a
# (1, 8/2, 1 + 850, 64) step whose kernel costs 40). The lengths cost a planned layer 3 us.
KEY_BUCKET = 256


def _keys_viewed(keys_used: int, cache_len: int, xp, options: dict) -> int:
    """How many of each contiguous cache row's first keys a step's attention reads, for
    ``keys_used`` keys in its longest sequence: rounded up to a multiple of :data:`KEY_BUCKET`
    (at most the cache's length) for NumPy caches; as they are for CuPy's (the GPU's plans
    of the shapes, untimed) and for calls returning the weights (whose last axis has the
    keys read)."""
    if xp is not np or options.get("return_weights"):
        return keys_used
    return min(cache_len, -(-keys_used // KEY_BUCKET) * KEY_BUCKET)


def _checked_caches(q, k_cache, v_cache, paged, written, quantized=False):
    """The caches as arrays of q's kind and dtype (``quantized``: of codes, which
    :func:`npattn.serving.quantized.checked_scales` checks), shaped alike (see
    :func:`_cache` for those the call writes, which must also not share memory)."""
    shape = "(pages, page_size, Hkv, D)" if paged else "(Bc, S, Hkv, D)"
    k_cache = _cache("k_cache", k_cache, q, written)
    v_cache = _cache("v_cache", v_cache, q, written)
    _four_d("k_cache", k_cache, shape, float_values=False)  # (the dtypes next: codes or q's)
    _four_d("v_cache", v_cache, shape.replace("D)", "Dv)"), float_values=False)
    for name, array in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not quantized:
            _quantized.check_float_cache(name, array, q)
    if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[3] != q.shape[3]:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must agree on all but "
                         f"the last axis, and k_cache's last axis must be q's head dim {q.shape[3]}")
    if written and not quantized:  # (a quantized cache's: with its scales, once they are checked)
        _check_apart({"k_cache": k_cache, "v_cache": v_cache})
    if paged and k_cache.shape[1] < 1:
        raise ValueError(f"k_cache's page size (axis 1 of {shape}) must be at least 1, got shape "
                         f"{tuple(k_cache.shape)}")
    return k_cache, v_cache


def _checked_layout(q, k_cache, block_table, cache_batch_idx):
    """``(block_table, cache_batch_idx, capacity)``: the paged table (B, P) or the cache
    rows (B,) as integer arrays of q's kind (None where not given), and the keys each
    sequence can hold."""
    batch = q.shape[0]
    cache_rows, cache_len = k_cache.shape[:2]
    if block_table is not None:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx selects rows of a contiguous cache; a paged cache takes block_table only")
        block_table = checks.int_array("block_table", block_table, q, "(B, pages per sequence)")
        if block_table.ndim != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must have shape (B, pages per sequence) = ({batch}, P), "
                             f"got {tuple(block_table.shape)}")
        return block_table, None, block_table.shape[1] * cache_len
    if cache_batch_idx is not None:
        cache_batch_idx = checks.int_array("cache_batch_idx", cache_batch_idx, q, "(B,)")
        if tuple(cache_batch_idx.shape) != (batch,):
            raise ValueError(f"cache_batch_idx must have shape (B,) = ({batch},), got {tuple(cache_batch_idx.shape)}")
        checks.check_int_range("cache_batch_idx", cache_batch_idx, 0, cache_rows - 1, " (rows of k_cache)")
        return None, cache_batch_idx.astype(np.int64), cache_len
    if cache_rows != batch:
        raise ValueError(f"k_cache has {cache_rows} rows but q has batch {batch}: give cache_batch_idx (B,) "
                         f"to say which row each sequence uses")
    return None, None, cache_len


def _checked_new_keys(q, k_cache, v_cache, k, v):
    """k and v as arrays of q's kind and dtype, (B, Sn, Hkv, D) and (B, Sn, Hkv, Dv)."""
    batch, kv_heads = q.shape[0], k_cache.shape[2]
    k, v = checks.as_arrays(k=k, v=v, reference=q)
    for name, array, width in (("k", k, q.shape[3]), ("v", v, v_cache.shape[3])):
        checks.check_float_dtype(name, array)
        if array.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {array.dtype} but q has {q.dtype}; they must share one dtype")
        if array.ndim != 4 or array.shape[0] != batch or array.shape[2:] != (kv_heads, width):
            raise ValueError(f"{name} must have shape (B, Sn, Hkv, {'D' if name == 'k' else 'Dv'}) = "
                             f"({batch}, Sn, {kv_heads}, {width}), got {tuple(array.shape)}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same number of new keys, got {k.shape[1]} and {v.shape[1]}")
    return k, v


def _check_options(options):
    """The keywords passed on to attention: known options, none that this call sets."""
    for name in _RESERVED:
        if name in options:
            raise TypeError(f"attention_with_kvcache sets {name} itself (from cache_seqlens and the shapes); "
                            f"got {name}={options[name]!r}")
    if "backend" not in options:
        _options.check_names(options)
    else:
        _options.check_names({name: value for name, value in options.items() if name != "backend"})
    if isinstance(options.get("causal"), str) and options["causal"] == "top_left":
        raise ValueError('attention_with_kvcache aligns each sequence\'s queries with its last keys; '
                         'causal="top_left" does not apply (use causal=True)')


def _cache(name, value, q, written):
    """A cache as an array of q's kind. One that the call writes must be that array itself
    (a converted copy would take the new keys and lose them): a writable NumPy or CuPy
    array in native byte order whose slots do not overlap."""
    if not written:
        (array,) = checks.as_arrays(**{name: value}, reference=q)
        return array
    if not (isinstance(value, np.ndarray) or _arrays.is_cupy(value)):
        raise TypeError(f"{name} must be a NumPy or CuPy array to take the new keys in place, got "
                        f"{type(value).__name__}: a converted copy would receive them and the caller's cache "
                        "would never see them")
    if _arrays.array_kind(value) != _arrays.array_kind(q):
        raise TypeError(f"{name} is a {_arrays.array_kind(value)} array but q is a {_arrays.array_kind(q)} array; "
                        "mixing NumPy and CuPy arrays is not supported (move them to one device first)")
    if not value.dtype.isnative:
        raise TypeError(f"{name} has non-native byte order (dtype {value.dtype.str}): the kernels read native "
                        f"numbers and the new keys must be written in place; convert the cache once, "
                        f"{name} = {name}.astype({name}.dtype.newbyteorder('='))")
    _check_writable(name, value)
    overlapping = [axis for axis, (size, stride) in enumerate(zip(value.shape, value.strides)) if size > 1 and not stride]
    if overlapping and value.size:
        raise ValueError(f"{name} has stride 0 along axis {overlapping[0]} (a broadcast view): its slots share "
                         "memory, so new keys cannot be written to one slot each")
    return value


def _check_writable(name, cache):
    if not getattr(cache.flags, "writeable", True):  # (CuPy arrays have no such flag)
        raise ValueError(f"{name} is read-only (flags.writeable is False): it must be writable to take the new "
                         "keys (a broadcast view or a frozen array cannot be)")


def _check_apart(written: dict):
    """No two of the ``written`` arrays (name -> array: the caches, and a quantized cache's
    scales) may share memory: one's append would overwrite what another just took."""
    if _own_apart(tuple(written.values())):  # (the common case: no pair tested)
        return
    names = list(written)
    for i, first in enumerate(names):
        for second in names[i + 1:]:
            if _share_memory(written[first], written[second]):
                raise ValueError(f"{first} and {second} share memory: appending to {second} would overwrite what "
                                 f"{first} just took (pass separate arrays, or views of disjoint parts of one)")


def _own_apart(arrays: tuple) -> bool:
    """Whether ``arrays`` are distinct NumPy arrays that each own their memory (which
    never overlap)."""
    return (all(type(array) is np.ndarray and array.base is None for array in arrays)
            and len({id(array) for array in arrays}) == len(arrays))


def _share_memory(first, second) -> bool:
    """Whether two arrays overlap: two NumPy arrays that each own their memory never do
    (the common case, decided without reading a bound); else their bounds, then NumPy's
    exact test (disjoint interleaved views of one array pass)."""
    if (type(first) is np.ndarray and type(second) is np.ndarray and first.base is None and second.base is None
            and first is not second):
        return False
    xp = _arrays.array_module(first)
    if not getattr(xp, "may_share_memory", np.may_share_memory)(first, second):
        return False
    if xp is np:
        try:
            return bool(np.shares_memory(first, second, max_work=10**6))
        except np.exceptions.TooHardError:
            pass
    return True


def _four_d(name, array, described, float_values=True):
    if float_values:
        checks.check_float_dtype(name, array)
    if array.ndim != 4:
        raise ValueError(f"{name} must be 4-D {described}, got {array.ndim}-D shape {tuple(array.shape)}")
    return tuple(array.shape)


def _cache_seqlens(value, batch, capacity, new_len):
    """cache_seqlens as an int64 (B,) NumPy array, each in [0, capacity - new_len] and at
    most :data:`POSITION_LIMIT` keys after the append: checked in the caller's own
    integers (a Python int of any size, a uint64 past 2**63) before any conversion, so
    nothing wraps."""
    most = capacity - new_len
    host = _host_ints("cache_seqlens", value, batch)
    if batch and host.min() >= 0 and host.max() <= min(most, POSITION_LIMIT - new_len):  # the usual call
        return host.astype(np.int64, copy=False)
    negative = np.flatnonzero(host < 0)
    if negative.size:
        b = int(negative[0])
        raise ValueError(f"cache_seqlens must be >= 0, got cache_seqlens[{b}] = {int(host[b])}")
    too_long = np.flatnonzero(host > min(most, POSITION_LIMIT - new_len))
    if too_long.size:
        b = int(too_long[0])
        total = int(host[b]) + new_len
        if total > capacity:
            raise ValueError(f"cache_seqlens[{b}] + {new_len} new keys = {total} exceeds the cache's {capacity} keys "
                             "per sequence")
        raise ValueError(f"cache_seqlens[{b}] + {new_len} new keys = {total}: npattn's kernels count positions up "
                         f"to {POSITION_LIMIT} (2**29) keys per sequence")
    return host.astype(np.int64)


def _host_ints(name, value, batch):
    """An int or an int array (B,) as a NumPy array of B entries in the caller's own
    integers (a Python int of any size as objects, a uint64 as it is), for range checks
    that nothing has wrapped yet."""
    number = checks.as_int(value)
    if number is not None:  # any Python int: int64 where it fits, else compared as Python ints
        return np.full(batch, number, np.int64) if -2**62 < number < 2**62 else np.array([number] * batch, object)
    described = f"{name} must be an int or an int array of shape (B,)"
    if isinstance(value, (bool, np.bool_, str, bytes)) or value is None:
        raise TypeError(f"{described}, got {type(value).__name__} {value!r}")
    try:
        host = _arrays.to_numpy(value) if hasattr(value, "shape") else np.asarray(value)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{described}, got {type(value).__name__}: {error}") from None
    if host.dtype.kind not in "iu":
        raise TypeError(f"{described}, got dtype {host.dtype}")
    if host.shape != (batch,):
        raise ValueError(f"{name} must have shape (B,) = ({batch},), got {host.shape}")
    return host


def _cache_leftpad(value, batch, seqlens):
    """cache_leftpad as an int64 (B,) NumPy array, each in [0, cache_seqlens[b]]; None for
    None or all zeros (no left padding)."""
    if value is None:
        return None
    host = _host_ints("cache_leftpad", value, batch)
    outside = np.flatnonzero((host < 0) | (host > seqlens))
    if outside.size:
        b = int(outside[0])
        raise ValueError(f"cache_leftpad[{b}] = {int(host[b])} must lie in [0, cache_seqlens[{b}]] = "
                         f"[0, {int(seqlens[b])}]: a sequence's keys start there and end at its cache_seqlens")
    host = host.astype(np.int64)
    return host if host.any() else None


def _used_pages(table, lengths, page_size, pool_pages):
    """``(pages, held)``: the int64 (B, P') NumPy pages of ``table`` the sequences of
    ``lengths`` keys hold (P' the most any holds) and the bool (B, P') mask of those held;
    entries past a sequence's own pages are never read, so whatever they hold (-1, stale
    indices) becomes page 0. The held entries must lie in the pool's ``pool_pages``."""
    host = _arrays.to_numpy(table)
    columns = -(-int(lengths.max(initial=0)) // page_size)
    held = np.arange(columns)[None, :] < (-(-lengths // page_size))[:, None]  # (B, P')
    used = host[:, :columns]
    outside = held & ((used < 0) | (used > pool_pages - 1))  # compared in the table's own integers
    if outside.any():
        b, column = (int(i) for i in np.argwhere(outside)[0])
        raise ValueError(f"block_table must hold page indices in [0, {pool_pages}) (the pool's pages) where a "
                         f"sequence reads or writes, got block_table[{b}, {column}] = {int(used[b, column])}")
    pages = np.where(held, used, 0).astype(np.int64)
    return pages, held


def _check_paged_writes(pages, held, seqlens, lengths, page_size):
    """Refuse new keys that would land in a slot twice or in a slot another sequence holds:
    a page listed twice among the pages of a sequence that writes into it, or a page one
    sequence writes at offsets another sequence of the call holds (reads, or writes
    itself). Pages only read by several sequences (a shared prefix) are fine.

    ``pages`` (B, P') NumPy int64 and ``held`` (B, P') bool of :func:`_used_pages`;
    ``seqlens`` and ``lengths`` the keys before and after the append."""
    counts = np.bincount(pages[held])
    if counts.max(initial=0) <= 1:  # no page held twice (the usual step): nothing can collide
        return
    holders, holder_columns = np.nonzero(held)
    holder_pages = pages[holders, holder_columns]
    first, last = seqlens // page_size, (lengths - 1) // page_size  # the columns each sequence writes
    spans = np.where(lengths > seqlens, last - first + 1, 0)
    writers = np.repeat(np.arange(len(spans)), spans)
    columns = first[writers] + np.arange(spans.sum()) - np.repeat(np.cumsum(spans) - spans, spans)
    written = pages[writers, columns]
    for b, column, page in zip(*(x[counts[written] > 1].tolist() for x in (writers, columns, written))):
        low = max(int(seqlens[b]) - column * page_size, 0)  # the first offset b writes in the page
        for other, their_column in zip(holders[holder_pages == page].tolist(),
                                       holder_columns[holder_pages == page].tolist()):
            if other == b and their_column != column:
                raise ValueError(f"block_table[{b}] lists page {page} at columns {column} and {their_column}, and "
                                 f"sequence {b} writes new keys into it: they would land in slots it reads as other "
                                 "keys")
            holds = min(page_size, int(lengths[other]) - their_column * page_size)  # its offsets [0, holds)
            if other != b and low < holds:
                raise ValueError(f"block_table: sequences {b} and {other} share page {page}; sequence {b} writes "
                                 f"new keys at its offsets from {low}, which sequence {other} holds as its own keys "
                                 f"(offsets below {holds}): one would read or overwrite the other's. Pages written "
                                 "in a call must belong to one sequence (shared prefix pages are only read)")


def _check_distinct_rows(rows):
    """Two sequences appending to one contiguous cache row would write the same slots."""
    if len(set(rows.tolist())) == len(rows):
        return
    values, counts = np.unique(rows, return_counts=True)
    if (counts > 1).any():
        row = int(values[counts > 1][0])
        which = np.flatnonzero(rows == row).tolist()
        raise ValueError(f"cache_batch_idx gives sequences {which} the same cache row {row}, and the call appends "
                         "new keys: they would write the same slots (rows must be distinct when k and v are given)")


def _check_finite_reads(q, k, v, k_cache, v_cache, names, bias, seqlens, starts, pages, rows, page_size):
    """``check_finite``: q, the new k and v, the bias, and the cached keys and values each
    sequence reads (slots ``[starts[b], seqlens[b])``, in its row or pages; ``starts`` None:
    from 0); slots no sequence reads may hold anything."""
    for name, array in (("q", q), ("k", k), ("v", v), ("bias", bias)):
        if array is not None:
            checks.check_all_finite(name, array)
    for b, count in enumerate(int(n) for n in seqlens):
        first = 0 if starts is None else int(starts[b])
        if count <= first:
            continue
        for name, cache in zip(names, (k_cache, v_cache)):
            if pages is None:
                row = b if rows is None else int(_arrays.to_numpy(rows[b]))
                _check_slots_finite(name, cache, row, first, count, b)
            else:
                held = _arrays.to_numpy(pages[b])
                for column in range(first // page_size, -(-count // page_size)):
                    start = column * page_size
                    _check_slots_finite(name, cache, int(held[column]), max(first - start, 0),
                                        min(page_size, count - start), b)


def _check_slots_finite(name, cache, row, start, stop, sequence):
    """Slots ``[start, stop)`` of ``cache[row]`` finite, or a ValueError naming the first bad one."""
    slots = cache[row, start:stop]
    if _arrays.all_finite(slots):
        return
    finite = _arrays.to_numpy(_arrays.array_module(slots).isfinite(slots))
    where = np.unravel_index(int(np.argmin(finite)), finite.shape)
    index = (row, start + int(where[0]), *(int(i) for i in where[1:]))
    value = float(_arrays.to_numpy(cache[index]))
    raise ValueError(f"{name} must be finite where the call reads it (check_finite=True), got "
                     f"{name}[{', '.join(map(str, index))}] = {value!r} (a cached key of sequence {sequence})")


def _slots(xp, batch, new_len, seqlens, pages, rows, page_size, views=True):
    """The index of every new key in a cache (keys ``[seqlens[b], seqlens[b] + Sn)`` of
    each sequence b), as ``cache[index]`` takes it: ``(targets, positions)`` (B, Sn) each,
    the cache row or page and the slot in it (int64 and contiguous unless ``views``);
    or, with ``views``, where every sequence of a contiguous cache writes at one position,
    one basic slice of rows 0..B-1 (no gather)."""
    if views and pages is None and rows is None and seqlens.size and bool((seqlens == seqlens[0]).all()):
        start = int(seqlens[0])
        return slice(0, batch), slice(start, start + new_len)
    positions = xp.asarray(seqlens)[:, None] + xp.arange(new_len)[None, :]  # (B, Sn)
    if pages is not None:
        targets = xp.take_along_axis(pages, positions // page_size, axis=1)
        positions = positions % page_size
    else:
        targets = xp.broadcast_to((xp.arange(batch) if rows is None else xp.asarray(rows))[:, None], positions.shape)
    if views:
        return targets, positions
    return xp.ascontiguousarray(targets, dtype=np.int64), xp.ascontiguousarray(positions, dtype=np.int64)


def _append(caches, new, slots):
    """Write each of ``new`` (k, v (B, Sn, Hkv, .), then a quantized cache's scales
    (B, Sn, Hkv)) into its cache of ``caches`` at their ``slots`` (of :func:`_slots`);
    returns the function that puts the old bytes back."""
    parts = [cache[slots] for cache in caches]
    views = type(slots[0]) is slice  # parts are views of the caches (index arrays give copies)
    if type(caches[0]) is np.ndarray:  # the old bytes (tobytes: a third of a copy's cost)
        old = [part.tobytes() for part in parts]
    else:  # views, which the writes below would change: copies
        old = [part.copy() for part in parts] if views else parts

    def undo():
        for cache, saved, part in zip(caches, old, parts):
            cache[slots] = np.frombuffer(saved, part.dtype).reshape(part.shape) if type(saved) is bytes else saved

    try:
        for cache, part, target in zip(caches, new, parts):
            if views:  # (through the view already made: 0.2 us less than indexing again)
                target[...] = part
            else:
                cache[slots] = part
    except BaseException:
        undo()
        raise
    return undo


def _quantized_rows(k, v, codes_dtype):
    """What a quantized cache's call appends for new float k and v: (k codes, v codes,
    k scales, v scales), in the order of its caches, codes of ``codes_dtype`` (the cache's)."""
    (k_codes, k_scales), (v_codes, v_scales) = quantize_rows(k, codes_dtype), quantize_rows(v, codes_dtype)
    return k_codes, v_codes, k_scales, v_scales


def _read_caches(k_cache, v_cache, scales):
    """``(k_cache, v_cache, names)`` as ``check_finite`` reads them: a quantized cache's
    scales (its int8 codes are always finite)."""
    if scales is None:
        return k_cache, v_cache, ("k_cache", "v_cache")
    return scales.k_scale, scales.v_scale, ("k_scale", "v_scale")


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
