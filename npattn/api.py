"""The public functions: validate once, pick a backend, run it, hand back the user's layout."""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, NamedTuple

import numpy as np

from . import backends as _backends
from .core import checks
from .runtime import limits as _limits
from .runtime import nonfinite as _nonfinite
from .core import options as _options
from .runtime import plans as _plans
from .core.arrays import array_kind, check_native
from .core.problem import ARRAY_FIELDS, AttentionProblem, to_user_layout, with_arrays
from .core.results import ForwardResult, Gradients, out_is_finite
from .types import Array, ArrayLike, Outputs, Vjp
from .core.validation import build_problem, check_cotangent


def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, **options: Any) -> Outputs:
    """Scaled dot-product attention with every option fused.

    Shapes in layout "bhsd" (torch SDPA): q (B, H, Sq, D), k (B, Hkv, Sk, D),
    v (B, Hkv, Sk, Dv); in "bshd" (FlashAttention, JAX): q (B, Sq, H, D), k and v
    likewise. ``H % Hkv == 0``; query head h reads kv head ``h // (H // Hkv)``
    (Hkv == H: MHA, Hkv == 1: MQA, between: GQA).

    Query row i sits at position ``p_i = i + Sk - Sq`` (bottom-right alignment;
    ``p_i = i + q_offset`` when given, per batch entry for an array; ``causal="top_left"``
    is ``q_offset=0``; with left padding, ``q_offset`` counts from the first real row and
    key: ``p_i = i + q_offset[b] + kv_start[b] - q_start[b]``);
    key j is visible to it when ``j <= p_i`` (causal), ``p_i - left <= j <= p_i + right``
    or one of the first ``sinks`` real keys (window), ``mask[b, h, i, j]`` (True = may
    attend), ``kv_start[b] <= j < kv_lengths[b]`` and ``q_start[b] <= i < q_lengths[b]``.
    With ``block_table``, k and v are pools of pages (forward only).

    Scores: {scores};
    invisible keys removed; softmax over keys, with ``sink_logits[h]`` as one extra
    value-less column; dropout with probability ``dropout_p`` (mask a pure function of
    ``(seed, b, h, i, j)``, see :mod:`npattn.core.dropout`; inverted scaling); then ``@ v``.

    Args:
{arguments}

    Returns:
        ``out`` in q's dtype and layout: (B, H, Sq, Dv) or (B, Sq, H, Dv). With
        ``return_lse`` / ``return_weights``, the tuple ``(out, lse?, weights?)``:
        lse (B, H, Sq) in float32 (float64 for float64 inputs), including the sink
        logit, -inf for rows with no visible key; weights (B, H, Sq, Sk) in q's dtype,
        the probabilities after masking and before dropout.

    A row with no visible key outputs zeros, never NaN. NaN and inf in the inputs
    propagate by IEEE arithmetic to exactly the outputs that read them, the same on
    every backend (see :mod:`npattn.runtime.nonfinite`); ``check_finite=True`` rejects them
    instead. Raises ValueError or
    TypeError naming the argument before any kernel runs, and MemoryError when the
    weights (or the reference backend's score arrays), 16 MiB or more, cannot fit in the
    free memory (:mod:`npattn.runtime.limits`). Inputs are never modified.

    Arrays of other kinds that speak DLPack (torch tensors, JAX arrays) run on the
    backend of their memory (host: cpu, CUDA: gpu) and the outputs come back in q's
    kind, on its device (:mod:`npattn.adapters.arrays`); a torch tensor that requires
    grad goes through :func:`npattn.torch.attention`, a JAX tracer (under ``jit``,
    ``grad``, ``vmap``) through :func:`npattn.jax.attention`.
    """
    key = _plans.call_key(q, k, v, options)
    if key is not None:  # a call like an earlier one: its checks' outcome is known
        planned = _plans.lookup(key)
        result = None if planned is None else planned.planned_forward(q, k, v)
        if result is not None:  # finite, from the kernels: out is a mean of v's rows, in v's range
            return _public_outputs(planned.form, result, finite=True)
    problem, _, result = _checked_forward(q, k, v, options, key, backward=False)
    return _public_outputs(OutputForm.of(problem), result)


def attention_vjp(q: ArrayLike, k: ArrayLike, v: ArrayLike, **options: Any) -> tuple[Outputs, Vjp]:
    """``(outputs, vjp)``: :func:`attention`'s outputs and a function of ``dout``.

    ``outputs`` is exactly what ``attention(q, k, v, **options)`` returns. ``vjp(dout)``
    takes the gradient of ``out`` (out's shape and layout) and returns
    ``(dq, dk, dv)``, followed by ``dbias`` when ``bias`` was given and by
    ``dsink_logits`` (H,) when ``sink_logits`` was given. Each gradient has the shape,
    layout and dtype of its input: dk and dv have the kv head count (summed over the
    query heads of a group), dbias is summed over the dimensions it was broadcast along.
    The dropout mask of the forward is reused, also when ``seed`` was None. lse and
    weights are outputs only: no gradient flows back through them. Arrays of other
    kinds than NumPy and CuPy get outputs and gradients of their own kind, as for
    :func:`attention`.

    Args:
{arguments}
    """
    key = _plans.call_key(q, k, v, options)
    if key is not None:
        planned = _plans.lookup(key)
        has_plans = planned is not None and planned.backward_plan(q, k, v) is not None
        result = planned.planned_forward(q, k, v, for_gradients=True) if has_plans else None
        if result is not None:
            return _planned_vjp(planned, result, q, k, v, options)
    problem, implementation, result = _checked_forward(q, k, v, options, key, backward=True)
    return _outputs_and_vjp(problem, implementation, result)


def plan(q: ArrayLike, k: ArrayLike, v: ArrayLike, **options: Any) -> "Plan":
    """Check ``attention(q, k, v, **options)`` once and keep what its structure decides:
    a :class:`Plan` whose :meth:`~Plan.run` and :meth:`~Plan.vjp` take new q, k and v of
    the same structure (array kind, dtype, shape, strides) and run with no argument check
    beyond that structure.

    Every check of :func:`attention` runs here, with the same errors: shapes, every
    option, the backend, the memory the weights need. q, k and v give the structure;
    their values are not used (``check_finite=True`` checks each run's arrays instead).
    Option arrays (``mask``, ``bias``, lengths, ALiBi slopes, sink logits,
    ``block_table``) belong to the plan: those whose values are checked (lengths, starts,
    ``q_offset`` arrays, slopes, sink logits, ``block_table``) are copied now, so later
    changes to the caller's arrays cannot bypass the checks; ``mask`` and ``bias`` are read
    where they lie at each run. With dropout and ``seed=None`` each run draws a fresh
    seed (its vjp reuses it).

    A serving loop plans once per structure and runs once per layer; :func:`attention` is
    the same path, planning a structure at its second call (:mod:`npattn.runtime.plans`).

    Args:
{arguments}
    """
    check_native("npattn.plan", "plans of torch and JAX programs: npattn.torch.attention, npattn.jax.attention",
                 (q, k, v, *options.values()))
    return Plan.of(q, k, v, options)


class Plan:
    """A checked attention call's structure (see :func:`plan`): ``run(q, k, v)`` returns
    what :func:`attention` returns, ``vjp(q, k, v)`` what :func:`attention_vjp` returns,
    for arrays of the structure the plan was made for; arrays of another structure raise
    ValueError naming the argument (a plan never re-plans silently).

    Attributes: ``backend`` (the backend's name), ``layout``, ``shapes`` (q, k, v as
    given)."""

    def __init__(self, problem: AttentionProblem, implementation: Any, fresh_seed: bool = False,
                 check_finite: bool = False, user_bias: Any = None):
        self._problem, self._implementation, self._fresh_seed = problem, implementation, fresh_seed
        self._check_finite, self._user_bias = check_finite, user_bias
        self._form = OutputForm.of(problem)
        self._structure = tuple(checks.structure_of(to_user_layout(x, problem.layout))
                                for x in (problem.q, problem.k, problem.v))
        self._exact = tuple(exact for exact, _ in self._structure)
        # the backend's own plans of the structure (the CPU's tiles, work items, scratch):
        # the forward's now, the backward's at the first vjp
        self._forward_plan = (implementation.forward_plan(problem)
                              if hasattr(implementation, "forward_plan") else None)
        self._backward_plan: Any = None
        # q, k and v (and a quantized cache's scales) only gave the structure: stand-ins of
        # their shape and dtype (one element of memory each) keep the plan from holding the
        # caller's arrays alive; every run puts its own arrays in their place before anything
        # reads them (a quantized step's runs pass their scales: RunScales)
        self._problem = problem = without_data(problem, _STRUCTURE_ONLY)
        # what the backend's plans read of the problem they are given: its option arrays and
        # seed; a call with neither passes None (the plans then skip them)
        self._reads_problem = fresh_seed or problem.dropout_p > 0 or any(
            getattr(problem, name) is not None for name in (*_CHECKED_ARRAY_FIELDS, "mask", "bias", "k_scale")) or (
            problem.row_shifts is not None)
        # the backend's plan, where a run is its call on the arrays as given (bhsd: no
        # transposes; no option arrays or seed to pass); else None
        self._plain_forward = (self._forward_plan if not self._reads_problem and problem.layout == "bhsd"
                               else None)

    @classmethod
    def of(cls, q: Any, k: Any, v: Any, options: dict) -> "Plan":
        """Every check of ``attention(q, k, v, **options)``, then the plan of its structure."""
        options = dict(options)
        fresh_seed = _options.dropout_requested(options) and options.get("seed") is None
        problem, implementation = _checked_problem(q, k, v, options)
        _limits.check_memory(problem, implementation.NAME)
        return cls(owned(problem), implementation, fresh_seed, bool(options.get("check_finite", False)),
                   options.get("bias"))

    @classmethod
    def cached(cls, problem: AttentionProblem, implementation: Any) -> "Plan | None":
        """The plan :func:`attention` keeps for a structure it saw twice (a call of plain
        option values: :mod:`npattn.runtime.plans`); None for a backend without plans of its own,
        and for a structure whose weights' size makes every call check the free memory."""
        if not hasattr(implementation, "forward_plan") or _limits.checks_memory(problem, implementation.NAME):
            return None
        return cls(owned(problem), implementation)  # (its option arrays: the call's, copied)

    @property
    def form(self) -> "OutputForm":
        """What the plan's calls return (layout, dtypes, extras)."""
        return self._form

    @property
    def backend(self) -> str:
        return self._implementation.NAME

    @property
    def layout(self) -> str:
        return self._problem.layout

    @property
    def shapes(self) -> tuple:
        return tuple(exact[2] for exact, _ in self._structure)

    def run(self, q: ArrayLike, k: ArrayLike, v: ArrayLike) -> Outputs:
        """:func:`attention`'s outputs for ``q``, ``k``, ``v`` (this plan's structure)."""
        self._check(q, k, v)
        plain = self._plain_forward
        if plain is not None:  # the backend's plan called as planned_forward would call it, less its layers
            result = plain(q, k, v, None)
            if result is not None and out_is_finite(result):
                return _public_outputs(self._form, result, finite=True)
            # (None: plans of another tuning; not finite: the general path answers, from the reference)
        result, _, _, _ = self._forward(q, k, v)
        return _public_outputs(self._form, result)

    def moved(self, **arrays: Any) -> "Plan":
        """This plan for its problem with other values of the option arrays ``arrays`` (of
        the same dtypes and shapes, checked by the caller: a kv-cache step's ``kv_lengths``
        and ``row_shifts`` as its decode loop moves on), sharing the backend's plans, which
        take the problem of each run (the CPU's key what they keep of one by identity).
        Only for a plan that reads its problem at every run, whose problem has those arrays."""
        assert self._reads_problem and all(getattr(self._problem, name) is not None for name in arrays)
        plan = copy.copy(self)
        plan._problem = with_arrays(self._problem, **arrays)
        plan._backward_plan = None  # (made from a run's problem: the moved plan makes its own)
        return plan

    def run_trusted(self, q: Any, k: Any, v: Any) -> Outputs:
        """:meth:`run` for callers that checked the arrays' structure themselves (the
        serving calls' plans): no check of them here."""
        result, _, _, _ = self._forward(q, k, v)
        return _public_outputs(self._form, result)

    def vjp(self, q: ArrayLike, k: ArrayLike, v: ArrayLike) -> tuple[Outputs, Vjp]:
        """:func:`attention_vjp`'s ``(outputs, vjp)`` for ``q``, ``k``, ``v``."""
        self._check(q, k, v)
        _forward_only(self._problem)
        result, used, seeded, problem = self._forward(q, k, v, for_gradients=True)

        def gradients(dout: Any) -> Gradients:
            if problem is None:  # the forward ran on the backend's plan: so may the backward
                grads = self.gradients(q, k, v, result.saved, dout, seeded)
                if grads is not None:
                    return grads
            return _nonfinite.backward(problem or self._problem_of(q, k, v, seeded), used, result.saved, dout)

        return _with_vjp(self._form, result, q, gradients, _gradient_dtypes(self._problem))

    def _check(self, q: Any, k: Any, v: Any) -> None:
        """The structure check (and ``check_finite``'s), naming the first array that differs."""
        if checks.exact_structures(q, k, v) != self._exact:
            for name, array, expected in zip("qkv", (q, k, v), self._structure):
                checks.check_structure(name, array, expected)
        if self._check_finite:
            for name, array in (("q", q), ("k", k), ("v", v), ("bias", self._user_bias)):
                checks.check_all_finite(name, array)

    def _seeded(self) -> AttentionProblem:
        """The plan's problem with this run's seed (a fresh one where the plan draws them)."""
        if not self._fresh_seed:
            return self._problem
        return dataclasses.replace(self._problem, seed=_options.fresh_seed())

    def _problem_of(self, q: Any, k: Any, v: Any, seeded: AttentionProblem) -> AttentionProblem:
        form = self._form
        return with_arrays(seeded, q=_to_bhsd(form, q), k=_to_bhsd(form, k), v=_to_bhsd(form, v))

    def _forward(self, q: Any, k: Any, v: Any, for_gradients: bool = False
                 ) -> tuple[ForwardResult, Any, AttentionProblem, Any]:
        """(result, the backend that gave it, the plan's problem with the run's seed, the
        run's problem where one was built, else None): the backend's plan, else its
        forward; the reference where the result is not finite (:mod:`npattn.runtime.nonfinite`).
        ``for_gradients``: a backward follows (:meth:`planned_forward`)."""
        seeded = self._seeded()
        result = self.planned_forward(q, k, v, seeded, for_gradients)
        if result is not None:
            return result, self._implementation, seeded, None
        problem = self._problem_of(q, k, v, seeded)
        result, used = _nonfinite.forward(problem, self._implementation, for_gradients)
        return result, used, seeded, problem

    def planned_forward(self, q: Any, k: Any, v: Any, seeded: AttentionProblem | None = None,
                        for_gradients: bool = False) -> ForwardResult | None:
        """The forward's result from the backend's plan, for arrays of the plan's structure
        in the user's layout (unchecked: the caller knows them to be), or None where the
        full path must answer (no backend plan, a result that is not all finite, plans made
        under another tuning). ``for_gradients``: a backward follows, from the backend
        plan's ``for_gradients()`` where it has one (the CPU's: a 16-bit out's float32
        product saved, which its backward's exact gradients need)."""
        plan = self._forward_plan
        if plan is None:
            return None
        if for_gradients and hasattr(plan, "for_gradients"):
            plan = plan.for_gradients()
        form = self._form
        arrays = (seeded or self._problem) if self._reads_problem else None
        result = plan(_to_bhsd(form, q), _to_bhsd(form, k), _to_bhsd(form, v), arrays)
        if result is None or not out_is_finite(result):
            return None
        return result

    def outputs(self, result: ForwardResult) -> Outputs:
        """What :meth:`run` returns for a :meth:`planned_forward` result (finite)."""
        return _public_outputs(self._form, result, finite=True)

    def backward_plan(self, q: Any, k: Any, v: Any) -> Any:
        """The backend's plan of the backward (made at the first use, from the first
        run's arrays in the user's layout), or None for a backend without one."""
        if self._backward_plan is None and hasattr(self._implementation, "backward_plan"):
            self._backward_plan = self._implementation.backward_plan(self._problem_of(q, k, v, self._problem))
        return self._backward_plan

    def saved_gradients(self, q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any) -> Gradients | None:
        """:meth:`gradients` from the user's ``out``, ``lse`` and ``dout`` (as
        :func:`attention_backward` takes them), or None where the full path must answer:
        any of them not a NumPy array of the shape and dtype the structure's forward gives
        (out: also the compute dtype, :func:`attention_for_backward`'s)."""
        form = self._form
        out_shape = (*q.shape[:-1], v.shape[-1])
        lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if form.layout == "bshd" else q.shape[:3]
        for array, shape, dtypes in ((out, out_shape, (form.dtype, form.lse_dtype)), (dout, out_shape, (form.dtype,)),
                                     (lse, lse_shape, (form.lse_dtype,))):
            if type(array) is not np.ndarray or array.shape != shape or array.dtype not in dtypes:
                return None
        compute = form.lse_dtype
        saved = (_to_bhsd(form, out).astype(compute, copy=False), lse)
        return self.gradients(q, k, v, saved, _to_bhsd(form, dout))

    def gradients(self, q: Any, k: Any, v: Any, saved: Any, dout: Any, arrays: Any = None) -> Gradients | None:
        """The gradients for bhsd ``dout`` from the backend's plan (``arrays``: the run's
        problem, for its option arrays and seed; None: the plan's own, a run with no seed
        of its own), or None where the full path must answer: the plan checks that dout
        and the gradients are all finite (it returns None where not), on work it does
        anyway."""
        backward_plan = self.backward_plan(q, k, v)
        if backward_plan is None:
            return None
        form = self._form
        if not self._reads_problem:
            arrays = None
        elif arrays is None:  # (the option arrays a planned call was keyed by)
            arrays = self._problem
        return backward_plan(_to_bhsd(form, q), _to_bhsd(form, k), _to_bhsd(form, v), saved, dout, arrays)


# the arrays a plan's problem holds for their structure only (a kv-cache step's scales held
# a cache's memory alive through the plan its layers share until 2026-11-30)
_STRUCTURE_ONLY = ("q", "k", "v", "k_scale", "v_scale")


def without_data(problem: AttentionProblem, names: tuple = ("q", "k", "v")) -> AttentionProblem:
    """``problem`` with its arrays ``names`` (those not None) replaced by stand-ins of their
    shape and dtype (one element of memory each, broadcast): for a plan that keeps a
    structure without holding the caller's arrays alive. Nothing may read a stand-in's
    values or strides: every run puts its own arrays in their place first."""
    return with_arrays(problem, **{name: _stand_in(problem.xp, getattr(problem, name)) for name in names
                                   if getattr(problem, name) is not None})


_STAND_IN_BYTES = np.zeros(16, np.uint8)  # (a NumPy stand-in's one element: any dtype's first bytes)


def _stand_in(xp: Any, array: Any) -> Any:
    """A read-only array of ``array``'s shape and dtype whose elements are all one element of
    memory (strides 0). NumPy's made directly: 0.6 us, where ``broadcast_to`` costs 4."""
    if xp is not np:
        return xp.broadcast_to(xp.zeros((), array.dtype), array.shape)
    stand_in = np.ndarray(array.shape, array.dtype, _STAND_IN_BYTES, 0, (0,) * array.ndim)
    stand_in.flags.writeable = False
    return stand_in


def owned(problem: AttentionProblem) -> AttentionProblem:
    """``problem`` with its value-checked option arrays as the plan's own copies: for a
    plan made from a problem of :func:`checked_problem` (the serving calls' plans), so that
    a caller's later change to them cannot reach runs that no longer check them."""
    xp = problem.xp
    copies = {name: xp.array(getattr(problem, name), copy=True) for name in _CHECKED_ARRAY_FIELDS
              if getattr(problem, name) is not None}
    return with_arrays(problem, **copies) if copies else problem


# The problem's option arrays whose values the checks read: all but mask and bias (which
# have no value checks), row_shifts (derived from q_offset when checked, the plan's own)
# and the scales of quantized k and v (the keys' data, each run's own like k and v)
_CHECKED_ARRAY_FIELDS = tuple(name for name in ARRAY_FIELDS if name not in ("q", "k", "v", "mask", "bias",
                                                                             "row_shifts", "k_scale", "v_scale"))


def _outputs_and_vjp(problem: AttentionProblem, implementation: Any, result: ForwardResult) -> tuple[Outputs, Vjp]:
    """attention_vjp's answer from the forward ``result`` of ``problem`` that
    ``implementation`` gave: the outputs, and the vjp on the same backend."""
    return _with_vjp(OutputForm.of(problem), result, problem.q,
                     lambda dout: _nonfinite.backward(problem, implementation, result.saved, dout),
                     _gradient_dtypes(problem))


def _gradient_dtypes(problem: AttentionProblem) -> tuple:
    """The dtypes of the gradients the user gets: q's, k's, v's, bias's and the sink logits'."""
    return (problem.q.dtype, problem.k.dtype, problem.v.dtype, None if problem.bias is None else problem.bias.dtype,
            None if problem.sink_logits is None else problem.sink_logits.dtype)


def _planned_vjp(planned: "Plan", result: ForwardResult, q: Any, k: Any, v: Any,
                 options: dict) -> tuple[Outputs, Vjp]:
    """attention_vjp's answer for a planned call: its outputs, and a vjp on the backward plan."""
    def gradients(dout: Any) -> Gradients:
        grads = planned.gradients(q, k, v, result.saved, dout)
        if grads is not None:
            return grads
        # a non-finite dout or gradient, or other tuning: the full path answers
        problem, implementation = _checked_problem(q, k, v, options)
        return _nonfinite.backward(problem, implementation, result.saved, dout)
    dtype = planned.form.dtype
    return _with_vjp(planned.form, result, q, gradients, (dtype, dtype, dtype, None, None), finite=True)


def _checked_problem(q: Any, k: Any, v: Any, options: dict) -> tuple[AttentionProblem, Any]:
    """Every check of the call, then the backend module that runs it."""
    options = dict(options)
    backend = options.pop("backend", "auto")
    problem = build_problem(q, k, v, **options)
    return problem, _backends.resolve(backend, array_kind(problem.q))


def checked_problem(q: Any, k: Any, v: Any, options: dict) -> tuple[AttentionProblem, Any]:
    """``(problem, backend)``: every check of ``attention(q, k, v, **options)`` (NumPy or
    CuPy arrays), nothing run; :func:`run_problem` runs it. For the calls built on
    attention that must know a call is valid before they act
    (:func:`npattn.attention_with_kvcache` writes its cache only then) or that set what no
    option says (:func:`npattn.attention_varlen`'s packed rows)."""
    return _checked_problem(q, k, v, options)


def run_problem(problem: AttentionProblem, implementation: Any, with_vjp: bool = False) -> Any:
    """What :func:`attention` (``with_vjp``: :func:`attention_vjp`) returns for a problem of
    :func:`checked_problem`, whose arrays hold the call's values now."""
    if with_vjp:
        _forward_only(problem)
    _limits.check_memory(problem, implementation.NAME)
    result, used = _nonfinite.forward(problem, implementation, with_vjp)
    if with_vjp:
        return _outputs_and_vjp(problem, used, result)
    return _public_outputs(OutputForm.of(problem), result)


def _checked_forward(q: Any, k: Any, v: Any, options: dict, key: tuple | None,
                     backward: bool) -> tuple[AttentionProblem, Any, ForwardResult]:
    """The full path: check everything, pick the backend, run it (the reference where the
    result is not finite); then plan the structure ``key`` for later calls (``backward``:
    their gradients too). Returns (problem, the backend that ran, result)."""
    problem, implementation = _checked_problem(q, k, v, options)
    if backward:
        _forward_only(problem)
    _limits.check_memory(problem, implementation.NAME)
    result, used = _nonfinite.forward(problem, implementation, backward)
    if key is not None and used is implementation:
        _plans.remember(key, lambda: Plan.cached(problem, implementation))
    return problem, used, result


def _forward_only(problem: AttentionProblem) -> None:
    """Reject gradients of a call that has none: paged k and v (``block_table``)."""
    if problem.block_table is not None:
        raise TypeError("block_table (paged k and v) is for the forward only: attention_vjp and "
                        "attention_backward need k and v as (B, Hkv, Sk, D) arrays")


def _with_vjp(form: "OutputForm", result: ForwardResult, q_like: Any, gradients: Callable[[Any], Gradients],
              dtypes: tuple, finite: bool = False) -> tuple[Outputs, Vjp]:
    """``(outputs, vjp)``: the public outputs of ``result`` (``finite``: as for
    :func:`_public_outputs`), and the vjp that checks dout against them (an array of
    ``q_like``'s kind), takes ``gradients(dout as bhsd)`` and hands them back in the
    user's layout, in ``dtypes`` (q, k, v, bias, sink logits)."""
    outputs = _public_outputs(form, result, finite)
    out_shape = (outputs[0] if isinstance(outputs, tuple) else outputs).shape

    def vjp(dout: ArrayLike) -> tuple[Array, ...]:
        dout = check_cotangent("dout", dout, q_like, out_shape)
        return _public_gradients(form, gradients(_to_bhsd(form, dout)), dtypes)

    return outputs, vjp


def _to_bhsd(form: "OutputForm", array: Any) -> Any:
    """A (B, ., ., D) array of the user's layout as a bhsd view."""
    return array.transpose(0, 2, 1, 3) if form.layout == "bshd" else array


def _public_gradients(form: "OutputForm", grads: Gradients, dtypes: tuple) -> tuple[Array, ...]:
    """``grads`` as the user gets them: (dq, dk, dv, dbias?, dsink_logits?) in the user's
    layout and ``dtypes`` (q, k, v, bias, sink logits; None: no such gradient)."""
    q_dtype, k_dtype, v_dtype, bias_dtype, sink_dtype = dtypes
    with np.errstate(over="ignore"):  # as in _public_outputs
        public = [_user_array(form, grads.dq, q_dtype), _user_array(form, grads.dk, k_dtype),
                  _user_array(form, grads.dv, v_dtype)]
        if bias_dtype is not None:
            public.append(grads.dbias.astype(bias_dtype, copy=False))
        if sink_dtype is not None:
            public.append(grads.dsink_logits.astype(sink_dtype, copy=False))
    return tuple(public)


def attention_backward(q: ArrayLike, k: ArrayLike, v: ArrayLike, out: ArrayLike, lse: ArrayLike,
                       dout: ArrayLike, **options: Any) -> tuple[Array, ...]:
    """The gradients ``attention_vjp(q, k, v, **options)[1](dout)`` returns, from the
    forward's ``out`` and ``lse`` instead of a closure: for frameworks that keep arrays,
    not functions, between a forward and its backward (:mod:`npattn.torch`,
    :mod:`npattn.jax`).

    ``out`` and ``lse`` are what ``attention(q, k, v, return_lse=True, **options)``
    returned: out (q's shape with v's last dimension, in q's layout), lse (B, H, Sq).
    ``dout`` has out's shape. Returns ``(dq, dk, dv)``, then ``dbias`` and
    ``dsink_logits`` when those options were given, as :func:`attention_vjp`'s vjp.
    With ``dropout_p > 0``, ``seed`` must be the forward's (an int): the backward
    regenerates its mask. ``return_lse`` and ``return_weights`` are ignored.

    ``out`` may be given in q's dtype or in the compute dtype (lse's). The kernels'
    backward reads it in the compute dtype: a float16 or bfloat16 out is widened, and the
    gradients may then differ from the vjp's by out's rounding (a row one key dominates:
    see :func:`attention_for_backward`, whose ``out_for_backward`` gives the vjp's).
    """
    options = {name: value for name, value in options.items() if name not in ("return_lse", "return_weights")}
    key = _plans.call_key(q, k, v, options)
    if key is not None:  # a structure seen before: its plans, when out, lse and dout are as they were
        planned = _plans.lookup(key)
        if planned is not None:
            grads = planned.saved_gradients(q, k, v, out, lse, dout)
            if grads is not None:
                dtype = planned.form.dtype
                return _public_gradients(planned.form, grads, (dtype, dtype, dtype, None, None))
    if _options.dropout_requested(options) and options.get("seed") is None:
        raise ValueError("attention_backward with dropout_p > 0 needs seed, the forward's int seed: "
                         "it regenerates the forward's dropout mask")
    problem, implementation = _checked_problem(q, k, v, options)
    _forward_only(problem)
    _plans.remember(key, lambda: Plan.cached(problem, implementation))
    form = OutputForm.of(problem)
    user_shape = to_user_layout(problem.q, form.layout).shape
    out_shape = (*user_shape[:3], problem.value_dim)
    out = _to_bhsd(form, check_cotangent("out", out, problem.q, out_shape))
    dout = _to_bhsd(form, check_cotangent("dout", dout, problem.q, out_shape))
    lse = check_cotangent("lse", lse, problem.q, (problem.batch, problem.heads, problem.q_len))
    compute = problem.accumulate_dtype
    saved = (out.astype(compute, copy=False), lse.astype(compute, copy=False))
    grads = _nonfinite.backward(problem, implementation, saved, dout)
    dtypes = (problem.q.dtype, problem.k.dtype, problem.v.dtype,
              None if problem.bias is None else problem.bias.dtype,
              None if problem.sink_logits is None else problem.sink_logits.dtype)
    return _public_gradients(form, grads, dtypes)


def attention_for_backward(q: ArrayLike, k: ArrayLike, v: ArrayLike, **options: Any) -> tuple[Outputs, Array]:
    """``(outputs, out_for_backward)``: what ``attention(q, k, v, **options)`` returns,
    and out as :func:`attention_backward` should be given it, for frameworks that keep
    arrays between the passes (:mod:`npattn.torch`, :mod:`npattn.jax`).

    ``out_for_backward`` has out's shape and layout: for float32 and float64 inputs it is
    out itself; for float16 and bfloat16 inputs on the cpu backend it is the kernel's
    float32 out before rounding (B x H x Sq x Dv x 4 bytes more to keep), so that
    ``attention_backward`` gives the gradients :func:`attention_vjp` gives, bit for
    bit. A rounded out would move them by out's
    rounding: where one key holds a row's weight, dq is the difference of two nearly
    equal terms, and a float16 out leaves it about 2**-11 of the inputs' size instead of
    near zero. (The gpu backend's backward reads a 16-bit out, as FlashAttention's does;
    its ``out_for_backward`` is out itself.) With dropout, give an int ``seed``:
    the backward regenerates the mask from it.

    Args:
{arguments}
    """
    key = _plans.call_key(q, k, v, options)
    if key is not None:
        planned = _plans.lookup(key)
        result = None if planned is None else planned.planned_forward(q, k, v, for_gradients=True)
        if result is not None:
            return _with_out_for_backward(planned.form, result, _public_outputs(planned.form, result, finite=True))
    problem, _, result = _checked_forward(q, k, v, options, key, backward=True)
    form = OutputForm.of(problem)
    return _with_out_for_backward(form, result, _public_outputs(form, result))


def _with_out_for_backward(form: "OutputForm", result: ForwardResult, outputs: Outputs) -> tuple[Outputs, Array]:
    """``(outputs, out_for_backward)``: the out the backend saved for its own backward
    (the CPU's float32 out of a 16-bit call; else out, or the reference's float64 one) in
    the user's layout and the compute dtype; the public out itself where that is the same."""
    saved = result.saved[0] if isinstance(result.saved, tuple) else result.out
    out = outputs[0] if isinstance(outputs, tuple) else outputs
    if saved.dtype == form.dtype:  # nothing wider than out (float32 and float64, the GPU's 16-bit out)
        return outputs, out
    return outputs, _user_array(form, saved, form.lse_dtype)


# One list of options, from the table: the signatures help() and IDEs show, and the docs.
for _function in (attention, attention_vjp, attention_for_backward, plan):
    setattr(_function, "__signature__", _options.signature())
    if _function.__doc__:  # None under python -OO
        _function.__doc__ = _function.__doc__.format(arguments=_options.argument_docs(" " * 8),
                                                      scores=_options.score_steps_doc())


class OutputForm(NamedTuple):
    """What the user gets back, as decided by the call's checks: the array module, the
    layout, out's dtype (q's), lse's (the compute dtype) and which extras."""

    xp: Any
    layout: str
    dtype: Any
    lse_dtype: Any
    return_lse: bool
    return_weights: bool
    # out alone, bhsd: a backend's contiguous out of the user's dtype is the answer itself
    out_alone: bool

    @classmethod
    def of(cls, problem: AttentionProblem) -> "OutputForm":
        return cls(problem.xp, problem.layout, problem.dtype, problem.accumulate_dtype, problem.return_lse,
                   problem.return_weights,
                   problem.layout == "bhsd" and not (problem.return_lse or problem.return_weights))


def _public_outputs(form: OutputForm, result: ForwardResult, finite: bool = False) -> Outputs:
    """``result`` as the user gets it. Not ``finite`` (unknown), a float64 reference answer
    (non-finite inputs) may pass the user dtype's range: inf, without a warning."""
    out = result.out
    if form.out_alone and (out.dtype is form.dtype or out.dtype == form.dtype) and out.flags.c_contiguous:
        return out  # (what the general path returns, without its 0.4 us of calls)
    if not finite and _narrows(form, result):
        with np.errstate(over="ignore"):
            return _public_outputs(form, result, finite=True)
    out = _user_array(form, result.out, form.dtype)
    extras = []
    if form.return_lse:
        extras.append(result.lse.astype(form.lse_dtype, copy=False))
    if form.return_weights:
        extras.append(result.weights.astype(form.dtype, copy=False))
    return (out, *extras) if extras else out


def _narrows(form: OutputForm, result: ForwardResult) -> bool:
    """Whether :func:`_public_outputs` converts an array of ``result`` to another dtype
    (where a value may pass the dtype's range; the kernels' own results need none, and
    skip the 1.5 us of ``np.errstate``)."""
    return (result.out.dtype != form.dtype or (form.return_lse and result.lse.dtype != form.lse_dtype)
            or (form.return_weights and result.weights.dtype != form.dtype))


def _user_array(form: OutputForm, array_bhsd: Any, dtype: Any) -> Array:
    """A bhsd-ordered result as a C-contiguous array in the user's layout and ``dtype``
    (no copy when a kernel already wrote it that way)."""
    array = to_user_layout(array_bhsd.astype(dtype, copy=False), form.layout)
    return form.xp.ascontiguousarray(array)
