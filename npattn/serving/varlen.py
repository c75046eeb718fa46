"""Packed variable-length batches (FlashAttention's ``flash_attn_varlen_func``): the
sequences of a batch laid end to end, with no padding.

q (Tq, H, D), k (Tk, Hkv, D) and v (Tk, Hkv, Dv) hold the tokens of B sequences one
after the other; ``cu_seqlens_q`` and ``cu_seqlens_k`` (B + 1,) are the cumulative
lengths (``[0, L_0, L_0 + L_1, ..., T]``): sequence b's queries are rows
``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` and its keys rows ``cu_seqlens_k[b]:...``.
Each sequence attends to its own keys only, with every option applied within it (causal
and windows align at its own bottom-right corner, ALiBi counts its own positions, its
dropout mask is the one batch entry b of a padded call would draw): the answer is that
of each sequence called alone. Nothing is padded or materialized: the work and the
memory are those of the sequences themselves.

On the CPU the whole batch is one call of the kernels: each sequence is a batch entry
whose live rows and keys (the kernels' spans) are its own rows of the packed arrays,
and its outputs and gradients go straight into packed arrays. Elsewhere (the GPU, the
reference) and with dropout, each sequence runs as one call on views of the packed
arrays, its outputs copied into place.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from ..core import arrays as _arrays
from ..runtime import limits as _limits
from ..runtime import plans as _plans
from .. import api
from ..core import checks
from ..core import options as _options
from ..api import attention, attention_vjp
from ..types import Array
from .mixed import checked_paged_varlen
from .quantized import Scales

# Options the packed call sets itself or cannot take, and why (the options table says which):
# those of a padded batch, which a packed one replaces, and the weights (a (total, total)
# array per head, mostly zeros: call attention on a sequence for its own).
_RESERVED = {**{name: "packed sequences replace a padded batch" for name in _options.set_by(_options.VARLEN)},
             **_options.refused_by(_options.VARLEN)}


def attention_varlen(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any = None,
                     max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, *, seqused_k: Any = None,
                     block_table: Any = None, k_scale: Any = None, v_scale: Any = None, **options: Any) -> Any:
    """Attention over the packed sequences of ``q``, ``k``, ``v`` (see :mod:`npattn.serving.varlen`).

    q (Tq, H, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv); ``cu_seqlens_q`` and ``cu_seqlens_k``
    int (B + 1,), nondecreasing from 0 to Tq and Tk (a sequence may be empty).
    ``max_seqlen_q`` / ``max_seqlen_k``, when given, must bound the lengths (checked; the
    kernels need no padded size). ``options`` are :func:`npattn.attention`'s, per
    sequence: ``alibi_slopes`` (H,) or (B, H), ``q_offset`` an int or int (B,), a
    ``dropout_offset`` added to each sequence's (b, 0, 0, 0); not ``layout``, the
    lengths or starts, ``mask`` or ``bias`` (a padded batch's), nor ``return_weights``
    (``block_table`` is an argument: paged keys, below).

    Returns out (Tq, H, Dv) in q's dtype, or with ``return_lse`` the tuple
    ``(out, lse)``, lse (H, Tq) in the compute dtype (FlashAttention's layout).

    Torch tensors and JAX arrays come back as their kind; a tensor that requires grad
    goes through :func:`npattn.torch.attention_varlen` (torch's autograd differentiates
    it), JAX tracers through :func:`npattn.jax.attention_varlen`.

    Paged keys, prefill and decode in one call (:mod:`npattn.serving.mixed`): with
    ``block_table`` (B, P), k and v are pools (pages, page_size, Hkv, D/Dv),
    ``cu_seqlens_k`` is None and ``seqused_k`` (B,) says how many keys of its pages each
    sequence holds; each sequence's queries sit bottom-right among its keys. Forward only.
    Pools of int8 or float8 e4m3 codes take ``k_scale`` and ``v_scale`` (float32 (pages,
    page_size, Hkv), one scale per key slot and kv head: :func:`npattn.quantize_kv`); the
    kernels read the codes a tile at a time.
    """
    if block_table is not None or seqused_k is not None:
        if cu_seqlens_k is not None or max_seqlen_k is not None:
            raise TypeError("attention_varlen with block_table reads each sequence's keys from its pages: "
                            "pass seqused_k, not cu_seqlens_k or max_seqlen_k")
        if block_table is None:
            raise TypeError("seqused_k comes with block_table (paged keys); packed keys take cu_seqlens_k")
        scales = None if k_scale is None and v_scale is None else Scales(k_scale, v_scale)
        return checked_paged_call(q, k, v, cu_seqlens_q, seqused_k, block_table, options, max_seqlen_q, scales)()
    if k_scale is not None or v_scale is not None:
        raise TypeError("k_scale and v_scale come with block_table: quantized keys are read from a paged pool")
    if cu_seqlens_k is None:
        raise TypeError("attention_varlen needs cu_seqlens_k for packed keys (or block_table and seqused_k for "
                        "paged ones)")
    arguments = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options)
    key = _batch_key(*arguments)
    if key is not None:
        return _kept_plan(key, arguments).run(q, k, v)
    batch = _PackedCall.of(*arguments)
    fused = batch.fused(with_vjp=False)
    if fused is not None:
        return (fused[0][0], fused[1][0]) if isinstance(fused, tuple) else fused[0]
    return batch.run(lambda qb, kb, vb, opts: (attention(qb, kb, vb, **opts), None))[0]


# A model calls attention_varlen (or its vjp) once per layer with the batch's lengths: the
# layers after the first run the plan of the first one's checks (bench --plans: a layer of
# 3 decode steps and a 16-token chunk, 359 us checked, 114 kept). Keyed by everything the
# checks read but the arrays' data (_batch_key); a few batches are kept, the newest.
_BATCHES = _plans.PlanCache(limit=8)


def _kept_plan(key: tuple, arguments: tuple) -> "VarlenPlan":
    """The plan kept for ``key``; else every check of the call of ``arguments`` (those of
    :meth:`_PackedCall.of`), and the plan of the checked batch, kept for the next calls."""
    kept = _BATCHES.get(key)
    if kept is None:
        kept = VarlenPlan(_PackedCall.of(*arguments), fresh_seed=False)
        _BATCHES.put(key, kept)
    return kept


def _batch_key(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options) -> tuple | None:
    """The key of a packed (not paged) attention_varlen call, or None where it is not kept:
    q, k and v NumPy arrays by their exact structure, the lengths and bounds by value
    (:func:`npattn.runtime.plans.values_key`), the options plain values only (a plan holds
    its options as given)."""
    structures = _plans.numpy_structures(q, k, v)
    if structures is None or None in structures:
        return None
    values = _plans.values_key((cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
    options_part = None if values is None else _plans.options_key(options, arrays=False)
    return None if options_part is None else (structures, values, options_part)


def checked_paged_call(q: Any, k_cache: Any, v_cache: Any, cu_seqlens_q: Any, seqused_k: Any, block_table: Any,
                       options: dict, max_seqlen_q: int | None = None, scales: Any = None) -> Callable[[], Any]:
    """Every check of ``attention_varlen(q, k_cache, v_cache, cu_seqlens_q, seqused_k=...,
    block_table=..., **options)`` (paged keys; a quantized pool's codes with their
    ``scales``, :class:`npattn.serving.quantized.Scales`), then the function that runs it
    (:mod:`npattn.serving.mixed`)."""
    (q,) = checks.as_arrays(q=q)
    starts = _cumulative("cu_seqlens_q", cu_seqlens_q, q.shape[0], "Tq", max_seqlen_q, "max_seqlen_q")
    return checked_paged_varlen(q, k_cache, v_cache, starts, seqused_k, block_table, options, _RESERVED,
                                _packed_offsets, scales)


def attention_varlen_vjp(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any,
                         max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                         **options: Any) -> tuple[Any, Callable[[Any], tuple[Array, ...]]]:
    """``(outputs, vjp)``: :func:`attention_varlen`'s outputs and the function of ``dout``
    (Tq, H, Dv) that returns ``(dq, dk, dv)`` packed like q, k and v, then
    ``dsink_logits`` (H,) when ``sink_logits`` was given. A dropout mask is reused.
    Arrays of other kinds get outputs and gradients of their kind."""
    arguments = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options)
    key = _batch_key(*arguments)
    if key is not None:
        return _kept_plan(key, arguments).vjp(q, k, v)
    batch = _PackedCall.of(*arguments)
    fused = batch.fused(with_vjp=True)
    if fused is not None:
        return _packed_vjp(batch, fused)
    return _per_sequence_vjp(batch)


def _packed_vjp(batch: "_PackedCall", fused: tuple) -> tuple[Any, Callable[[Any], tuple[Array, ...]]]:
    """attention_varlen_vjp's answer from the fused call's ``(outputs, vjp)`` (batch axis 1)."""
    outputs, fused_vjp = fused
    outputs = (outputs[0][0], outputs[1][0]) if isinstance(outputs, tuple) else outputs[0]

    def packed_vjp(dout: Any) -> tuple[Array, ...]:
        grads = fused_vjp(_checked_dout(batch, dout, outputs)[None])
        return tuple(grad[0] for grad in grads[:3]) + tuple(grads[3:])
    return outputs, packed_vjp


def _per_sequence_vjp(batch: "_PackedCall") -> tuple[Any, Callable[[Any], tuple[Array, ...]]]:
    """attention_varlen_vjp's answer from one attention_vjp call per sequence."""
    outputs, vjps = batch.run(lambda qb, kb, vb, opts: attention_vjp(qb, kb, vb, **opts))

    def vjp(dout: Any) -> tuple[Array, ...]:
        dout = _checked_dout(batch, dout, outputs)
        xp = batch.xp
        dq, dk, dv = xp.zeros_like(batch.q), xp.zeros_like(batch.k), xp.zeros_like(batch.v)
        sink = batch.options.get("sink_logits")
        dsink = None if sink is None else xp.zeros(np.shape(sink), getattr(sink, "dtype", np.float64))
        for b, sequence_vjp in vjps:
            q0, q1, k0, k1 = batch.bounds(b)
            grads = sequence_vjp(dout[None, q0:q1])
            dq[q0:q1], dk[k0:k1], dv[k0:k1] = grads[0][0], grads[1][0], grads[2][0]
            if dsink is not None:
                dsink += grads[3]
        return (dq, dk, dv) if dsink is None else (dq, dk, dv, dsink)

    return outputs, vjp


def plan_varlen(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int | None = None,
                max_seqlen_k: int | None = None, **options: Any) -> "VarlenPlan":
    """Every check of ``attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, ...,
    **options)`` once, for a batch whose layers all run with these lengths: the returned
    :class:`VarlenPlan`'s ``run(q, k, v)`` and ``vjp(q, k, v)`` take each layer's packed
    arrays (of the structure of these: kind, dtype, shape, strides) and return what
    :func:`attention_varlen` and :func:`attention_varlen_vjp` return for them, bit for bit.
    A continuous-batching server plans once per step from the step's ``cu_seqlens`` and
    runs every layer on the plan (FlashInfer's plan/run wrappers). NumPy and CuPy arrays."""
    _arrays.check_native("plan_varlen", "torch tensors and JAX arrays: attention_varlen",
                         (q, k, v, cu_seqlens_q, cu_seqlens_k, *options.values()))
    fresh_seed = _options.dropout_requested(options) and options.get("seed") is None
    call = _PackedCall.of(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options)
    return VarlenPlan(call, fresh_seed)


class VarlenPlan:
    """A checked packed batch (:func:`plan_varlen`): ``run(q, k, v)`` returns what
    :func:`attention_varlen` returns and ``vjp(q, k, v)`` what
    :func:`attention_varlen_vjp` returns, for packed arrays of the plan's structure;
    arrays of another structure raise ValueError naming the argument. On the CPU (no
    dropout) every run is one planned call of the kernels over the whole batch; elsewhere
    each sequence runs as its own call. With dropout and no seed, each run draws one."""

    def __init__(self, call: "_PackedCall", fresh_seed: bool):
        self._structure = tuple(checks.structure_of(x) for x in (call.q, call.k, call.v))
        self._starts = (call.starts_q, call.starts_k)
        self._options, self._fresh_seed = call.options, fresh_seed
        problem, implementation = call.packed
        # the whole batch as one planned kernel call where the CPU would fuse it (see
        # _PackedCall.fused); the plan holds no array of this call (stand-ins of their shape)
        self._fused = None
        if call.fusable():
            _limits.check_memory(problem, implementation.NAME)
            self._fused = api.Plan(api.owned(dataclasses.replace(problem, packed_rows=True)), implementation)
        self._sequences = call.sequences

    def run(self, q: Any, k: Any, v: Any) -> Any:
        """:func:`attention_varlen`'s outputs for packed ``q``, ``k``, ``v``."""
        self._check(q, k, v)
        if self._fused is not None:
            outputs = self._fused.run_trusted(*self._shared(q, k, v))
            return (outputs[0][0], outputs[1][0]) if isinstance(outputs, tuple) else outputs[0]
        return self._call(q, k, v).run(lambda qb, kb, vb, opts: (attention(qb, kb, vb, **opts), None))[0]

    def vjp(self, q: Any, k: Any, v: Any) -> tuple[Any, Callable[[Any], tuple[Array, ...]]]:
        """:func:`attention_varlen_vjp`'s ``(outputs, vjp)`` for packed ``q``, ``k``, ``v``."""
        self._check(q, k, v)
        call = self._call(q, k, v)
        if self._fused is not None:
            return _packed_vjp(call, self._fused.vjp(*self._shared(q, k, v)))
        return _per_sequence_vjp(call)

    def _check(self, q: Any, k: Any, v: Any) -> None:
        for name, array, expected in zip("qkv", (q, k, v), self._structure):
            checks.check_structure(name, array, expected)

    def _shared(self, q: Any, k: Any, v: Any) -> list:
        """q, k, v as the fused problem's batch: one entry per sequence, each a view of the
        whole packed arrays (batch stride 0)."""
        xp, batch = _arrays.array_module(q), self._sequences
        return [xp.broadcast_to(x[None], (batch,) + x.shape) for x in (q, k, v)]

    def _call(self, q: Any, k: Any, v: Any) -> "_PackedCall":
        options = self._options
        if self._fresh_seed:
            options = dict(options, seed=_options.fresh_seed())
        return _PackedCall(q, k, v, *self._starts, options)


def _checked_dout(batch, dout, outputs):
    """``dout`` as an array of q's kind, checked against the packed out's shape."""
    out = outputs[0] if isinstance(outputs, tuple) else outputs
    (dout,) = checks.as_arrays(dout=dout, reference=batch.q)
    checks.check_float_dtype("dout", dout)
    if tuple(dout.shape) != tuple(out.shape):
        raise ValueError(f"dout must have the output's shape {tuple(out.shape)}, got {tuple(dout.shape)}")
    return dout


class _PackedCall:
    """A checked packed call: the arrays, the sequences' bounds, and the options of each."""

    def __init__(self, q, k, v, starts_q, starts_k, options):
        self.q, self.k, self.v = q, k, v
        self.xp = _arrays.array_module(q)
        self.starts_q, self.starts_k = starts_q, starts_k
        self.options = options

    @classmethod
    def of(cls, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options) -> "_PackedCall":
        """Every check of the packed call: its arrays, the cumulative lengths, and every
        option, the same on every backend (the options through one attention call over
        the whole packed batch, which the CPU then runs)."""
        for name, why in _RESERVED.items():
            if name in options:
                raise TypeError(f"attention_varlen does not take {name}: {why} (got {name}={options[name]!r})")
        q, k, v = checks.as_arrays(q=q, k=k, v=v)
        for name, array, described in (("q", q, "(Tq, H, D)"), ("k", k, "(Tk, Hkv, D)"), ("v", v, "(Tk, Hkv, Dv)")):
            checks.check_float_dtype(name, array)
            if array.ndim != 3:
                raise ValueError(f"{name} must be 3-D {described} (packed tokens), got shape {tuple(array.shape)}")
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"k and v must hold the same tokens, got {k.shape[0]} and {v.shape[0]}")
        starts_q = _cumulative("cu_seqlens_q", cu_seqlens_q, q.shape[0], "Tq", max_seqlen_q, "max_seqlen_q")
        starts_k = _cumulative("cu_seqlens_k", cu_seqlens_k, k.shape[0], "Tk", max_seqlen_k, "max_seqlen_k")
        if len(starts_q) != len(starts_k):
            raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe as many sequences, got "
                             f"{len(starts_q) - 1} and {len(starts_k) - 1}")
        if _options.is_top_left(options.get("causal")) and options.get("q_offset") is not None:
            raise ValueError(f'causal="top_left" already places each sequence\'s rows (q_offset=0); got '
                             f'q_offset={options["q_offset"]!r} too: pass causal=True with q_offset instead')
        options = dict(options)
        batch = len(starts_q) - 1
        if options.get("q_offset") is not None:
            options["q_offset"] = _packed_offsets(options["q_offset"], batch, q)
        slopes = options.get("alibi_slopes")
        if slopes is not None and np.ndim(slopes) == 2 and np.shape(slopes)[0] != batch:
            raise ValueError(f"alibi_slopes must have shape (H,) = ({q.shape[1]},) or (B, H) = ({batch}, "
                             f"{q.shape[1]}) for {batch} sequences, got {np.shape(slopes)}")
        if options.get("dropout_offset") is not None:
            options["dropout_offset"] = _options.BY_NAME["dropout_offset"].check(options["dropout_offset"], None)
        if _options.dropout_requested(options) and options.get("seed") is None:  # one seed for every sequence
            options["seed"] = int(np.random.SeedSequence().generate_state(1, np.uint64)[0])
        call = cls(q, k, v, starts_q, starts_k, options)
        call.packed = call._packed_problem()  # every option checked, whichever path runs
        return call

    @property
    def sequences(self) -> int:
        return len(self.starts_q) - 1

    def bounds(self, b: int) -> tuple[int, int, int, int]:
        """Sequence b's query rows [q0, q1) and key rows [k0, k1)."""
        return (int(self.starts_q[b]), int(self.starts_q[b + 1]), int(self.starts_k[b]), int(self.starts_k[b + 1]))

    def sequence_options(self, b: int) -> dict:
        """The options of sequence b's call: per-sequence entries picked, its dropout offset."""
        options = dict(self.options, layout="bshd")
        offset = options.get("dropout_offset", (0, 0, 0, 0))
        options["dropout_offset"] = (offset[0] + b, *offset[1:])
        slopes = options.get("alibi_slopes")
        if slopes is not None and np.ndim(slopes) == 2:
            options["alibi_slopes"] = slopes[b]
        q_offset = options.get("q_offset")
        if q_offset is not None:  # (B,) int64, checked
            options["q_offset"] = int(q_offset[b])
        return options

    def _packed_problem(self):
        """``(problem, backend)``: the whole batch as one attention problem, every sequence a
        batch entry whose live rows and keys are its own rows of the packed arrays (viewed
        with a batch stride of 0: nothing is copied), every option checked."""
        xp, batch = self.xp, self.sequences
        lengths_q, lengths_k = np.diff(self.starts_q), np.diff(self.starts_k)
        options = dict(self.options)
        if _options.is_top_left(options.get("causal")):  # row 0 of each sequence level with its key 0
            options["causal"], offset = True, np.zeros(batch, np.int64)
        elif options.get("q_offset") is None:  # bottom-right within each sequence
            offset = lengths_k - lengths_q
        else:
            offset = options["q_offset"]
        options.update(layout="bshd", q_offset=xp.asarray(offset), q_start=xp.asarray(self.starts_q[:-1]),
                       q_lengths=xp.asarray(self.starts_q[1:]), kv_start=xp.asarray(self.starts_k[:-1]),
                       kv_lengths=xp.asarray(self.starts_k[1:]))
        shared = [xp.broadcast_to(x[None], (max(batch, 1),) + x.shape) for x in (self.q, self.k, self.v)]
        if not batch:  # no sequence: check the options on one empty entry
            options.update({name: xp.zeros(1, np.int64) for name in ("q_offset", "q_start", "q_lengths", "kv_start",
                                                                      "kv_lengths")})
            if np.ndim(options.get("alibi_slopes")) == 2:
                options["alibi_slopes"] = None
        return api.checked_problem(*shared, options)

    def fused(self, with_vjp: bool):
        """The whole batch as one call of the CPU kernels (:meth:`_packed_problem`), its
        outputs and gradients straight into packed arrays; what
        :func:`npattn.api.run_problem` returns for it (batch axis 1). None where another
        backend runs the call, or with dropout (whose mask hashes each sequence's own row
        and key indices), or with no sequence: :meth:`run` answers."""
        if not self.fusable():
            return None
        problem, implementation = self.packed
        return api.run_problem(dataclasses.replace(problem, packed_rows=True), implementation, with_vjp)

    def fusable(self) -> bool:
        """Whether the backend runs the whole batch as one call (see :meth:`fused`)."""
        problem, implementation = self.packed
        return bool(self.sequences) and not problem.dropout_p and getattr(implementation, "PACKED_ROWS", False)

    def run(self, call):
        """``call(q_b, k_b, v_b, options_b)`` -> ``(outputs, extra)`` for every nonempty
        sequence b (views as one "bshd" batch entry); returns (the packed outputs,
        [(b, extra), ...])."""
        xp, q, v = self.xp, self.q, self.v
        compute = np.float64 if q.dtype == np.float64 else np.float32
        out = xp.empty((q.shape[0], q.shape[1], v.shape[2]), q.dtype)  # every row is some sequence's
        want_lse = bool(self.options.get("return_lse"))
        lse = xp.full((q.shape[1], q.shape[0]), -np.inf, compute) if want_lse else None
        extras = []
        for b in range(self.sequences):
            q0, q1, k0, k1 = self.bounds(b)
            if q1 == q0:
                continue
            outputs, extra = call(q[None, q0:q1], self.k[None, k0:k1], v[None, k0:k1], self.sequence_options(b))
            out[q0:q1] = (outputs[0] if want_lse else outputs)[0]
            if want_lse:
                lse[:, q0:q1] = outputs[1][0]
            extras.append((b, extra))
        return ((out, lse) if want_lse else out), extras


def _packed_offsets(value, batch, q):
    """A packed call's ``q_offset``: an int or an int (B,) array (one per sequence), each
    within +-2**29, as an int64 (B,) NumPy array."""
    number = checks.as_int(value)
    if number is not None:
        offsets = np.array([number] * batch, dtype=object)
    else:
        if not hasattr(value, "shape") and not isinstance(value, (list, tuple)):
            raise TypeError(f"q_offset must be an int, an int array of shape (B,) or None, "
                            f"got {type(value).__name__} {value!r}")
        offsets = _arrays.to_numpy(checks.int_array("q_offset", value, q, "of shape (B,)"))
        if offsets.shape != (batch,):
            raise ValueError(f"q_offset as an array must have shape (B,) = ({batch},) (one per sequence), "
                             f"got {offsets.shape}")
    checks.check_int_range("q_offset", offsets, -_options.Q_OFFSET_LIMIT, _options.Q_OFFSET_LIMIT, " (+-2**29)")
    return offsets.astype(np.int64)


def _cumulative(name, values, total, total_name, bound, bound_name):
    """``values`` as an int64 NumPy (B + 1,) array: 0 first, nondecreasing, ``total`` last,
    every step at most ``bound`` (when given). Checked in the caller's own integers, so a
    uint64 past 2**63 is reported as it is."""
    if bound is not None:
        number = checks.as_int(bound)
        if number is None or number < 0:
            raise TypeError(f"{bound_name} must be None or an int >= 0, got {type(bound).__name__} {bound!r}")
        bound = number
    try:
        host = _arrays.to_numpy(values) if hasattr(values, "shape") else np.asarray(values)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{name} must be an integer array (B + 1,), got {type(values).__name__}: {error}") from None
    host = _arrays.to_numpy(host) if not isinstance(host, np.ndarray) else host
    if host.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array (B + 1,), got dtype {host.dtype}")
    if host.ndim != 1 or host.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D (B + 1,), got shape {host.shape}")
    if host[0] != 0 or host[-1] != total:
        raise ValueError(f"{name} must run from 0 to {total_name} = {total}, got {int(host[0])} ... {int(host[-1])}")
    backwards = np.flatnonzero(host[1:] < host[:-1])  # compared before any subtraction could wrap
    if backwards.size:
        b = int(backwards[0])
        raise ValueError(f"{name} must be nondecreasing, got {name}[{b}] = {int(host[b])} > "
                         f"{name}[{b + 1}] = {int(host[b + 1])}")
    host = host.astype(np.int64)  # now within [0, total]
    steps = np.diff(host)
    if bound is not None and steps.size and steps.max() > bound:
        raise ValueError(f"{bound_name} = {bound} is less than sequence {int(steps.argmax())}'s length {steps.max()}")
    return host
