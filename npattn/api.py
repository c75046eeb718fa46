"""The public functions: validate once, pick a backend, run it, hand back the user's layout."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np

from . import backends as _backends
from . import limits as _limits
from . import nonfinite as _nonfinite
from . import options as _options
from . import plans as _plans
from ._arrays import all_finite, array_kind
from .problem import AttentionProblem, to_user_layout
from .results import ForwardResult, Gradients
from .types import Array, ArrayLike, Outputs, Vjp
from .adapters import arrays as _foreign
from .validation import build_problem, check_cotangent


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
    ``(seed, b, h, i, j)``, see :mod:`npattn.dropout`; inverted scaling); then ``@ v``.

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
    every backend (see :mod:`npattn.nonfinite`); ``check_finite=True`` rejects them
    instead. Raises ValueError or
    TypeError naming the argument before any kernel runs, and MemoryError when the
    weights (or the reference backend's score arrays) cannot fit in the free memory
    (:mod:`npattn.limits`). Inputs are never modified.

    Arrays of other kinds that speak DLPack (torch tensors, JAX arrays) run on the
    backend of their memory (host: cpu, CUDA: gpu) and the outputs come back in q's
    kind, on its device (:mod:`npattn.adapters.arrays`); a torch tensor that requires
    grad goes through :func:`npattn.torch.attention`, a JAX tracer (under ``jit``,
    ``grad``, ``vmap``) through :func:`npattn.jax.attention`.
    """
    if type(q) is not np.ndarray and (kind := _foreign.foreign_kind(q)) is not None:
        return _foreign.attention(kind, attention, q, k, v, options)
    key = _plans.call_key(q, k, v, options)
    if key is not None:  # a call like an earlier one: its checks' outcome is known
        planned = _plans.lookup(key)
        result = None if planned is None else planned.forward(q, k, v)
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
    if type(q) is not np.ndarray and (kind := _foreign.foreign_kind(q)) is not None:
        return _foreign.attention_vjp(kind, attention_vjp, q, k, v, options)
    key = _plans.call_key(q, k, v, options)
    if key is not None:
        planned = _plans.lookup(key)
        result = None if planned is None or planned.backward_plan is None else planned.forward(q, k, v)
        if result is not None:
            return _planned_vjp(planned, result, q, k, v, options)
    problem, implementation, result = _checked_forward(q, k, v, options, key, backward=True)
    return _outputs_and_vjp(problem, implementation, result)


def _outputs_and_vjp(problem: AttentionProblem, implementation: Any, result: ForwardResult) -> tuple[Outputs, Vjp]:
    """attention_vjp's answer from the forward ``result`` of ``problem`` that
    ``implementation`` gave: the outputs, and the vjp on the same backend."""
    dtypes = (problem.q.dtype, problem.k.dtype, problem.v.dtype,
              None if problem.bias is None else problem.bias.dtype,
              None if problem.sink_logits is None else problem.sink_logits.dtype)
    return _with_vjp(OutputForm.of(problem), result, problem.q,
                     lambda dout: _nonfinite.backward(problem, implementation, result.saved, dout), dtypes)


def _planned_vjp(planned: "_Planned", result: ForwardResult, q: Any, k: Any, v: Any,
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
    result, used = _nonfinite.forward(problem, implementation)
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
    result, used = _nonfinite.forward(problem, implementation)
    if key is not None and used is implementation:
        _plans.remember(key, lambda: _Planned.of(problem, implementation, backward))
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

    The kernels' backward reads out in the compute dtype; out given in float16 or
    bfloat16 is widened, so gradients may differ from the vjp's by out's rounding.
    """
    options = {name: value for name, value in options.items() if name not in ("return_lse", "return_weights")}
    key = _plans.call_key(q, k, v, options)
    if key is not None:  # a structure seen before: its plans, when out, lse and dout are as they were
        planned = _plans.lookup(key)
        if planned is not None and planned.backward_plan is not None:
            grads = planned.saved_gradients(q, k, v, out, lse, dout)
            if grads is not None:
                dtype = planned.form.dtype
                return _public_gradients(planned.form, grads, (dtype, dtype, dtype, None, None))
    if _options.dropout_requested(options) and options.get("seed") is None:
        raise ValueError("attention_backward with dropout_p > 0 needs seed, the forward's int seed: "
                         "it regenerates the forward's dropout mask")
    problem, implementation = _checked_problem(q, k, v, options)
    _forward_only(problem)
    _plans.remember(key, lambda: _Planned.of(problem, implementation, backward=True))
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


# One list of options, from the table: the signatures help() and IDEs show, and the docs.
for _function in (attention, attention_vjp):
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

    @classmethod
    def of(cls, problem: AttentionProblem) -> "OutputForm":
        return cls(problem.xp, problem.layout, problem.dtype, problem.accumulate_dtype, problem.return_lse,
                   problem.return_weights)


def _public_outputs(form: OutputForm, result: ForwardResult, finite: bool = False) -> Outputs:
    """``result`` as the user gets it. Not ``finite`` (unknown), a float64 reference answer
    (non-finite inputs) may pass the user dtype's range: inf, without a warning."""
    if not finite:
        with np.errstate(over="ignore"):
            return _public_outputs(form, result, finite=True)
    out = _user_array(form, result.out, form.dtype)
    extras = []
    if form.return_lse:
        extras.append(result.lse.astype(form.lse_dtype, copy=False))
    if form.return_weights:
        extras.append(result.weights.astype(form.dtype, copy=False))
    return (out, *extras) if extras else out


def _user_array(form: OutputForm, array_bhsd: Any, dtype: Any) -> Array:
    """A bhsd-ordered result as a C-contiguous array in the user's layout and ``dtype``
    (no copy when a kernel already wrote it that way)."""
    array = to_user_layout(array_bhsd.astype(dtype, copy=False), form.layout)
    return form.xp.ascontiguousarray(array)


class _Planned(NamedTuple):
    """What a later call of a planned structure runs (:mod:`npattn.plans`): the backend's
    forward (and backward) plans between the user's layout and outputs."""

    form: OutputForm
    forward_plan: Callable[..., Any]
    backward_plan: Callable[..., Any] | None

    @classmethod
    def of(cls, problem: AttentionProblem, implementation: Any, backward: bool) -> "_Planned | None":
        """The plans of ``problem``'s structure; None for a backend without plans."""
        if not hasattr(implementation, "forward_plan"):
            return None
        return cls(OutputForm.of(problem), implementation.forward_plan(problem),
                   implementation.backward_plan(problem) if backward else None)

    def forward(self, q: Any, k: Any, v: Any) -> ForwardResult | None:
        """The forward's result, or None where the full path must answer (a result that is
        not all finite, or plans made under another tuning)."""
        if self.form.layout == "bshd":
            q, k, v = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        result = self.forward_plan(q, k, v)
        if result is None or not all_finite(result.out):
            return None
        return result

    def saved_gradients(self, q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any) -> Gradients | None:
        """:meth:`gradients` from the user's ``out``, ``lse`` and ``dout`` (as
        :func:`attention_backward` takes them), or None where the full path must answer:
        any of them not a NumPy array of the shape and dtype the structure's forward gives."""
        form = self.form
        out_shape = (*q.shape[:-1], v.shape[-1])
        lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if form.layout == "bshd" else q.shape[:3]
        for array, shape, dtype in ((out, out_shape, form.dtype), (dout, out_shape, form.dtype),
                                    (lse, lse_shape, form.lse_dtype)):
            if type(array) is not np.ndarray or array.shape != shape or array.dtype != dtype:
                return None
        compute = form.lse_dtype
        saved = (_to_bhsd(form, out).astype(compute, copy=False), lse)
        return self.gradients(q, k, v, saved, _to_bhsd(form, dout))

    def gradients(self, q: Any, k: Any, v: Any, saved: Any, dout: Any) -> Gradients | None:
        """The gradients for bhsd ``dout``, or None where the full path must answer."""
        if not all_finite(dout):
            return None
        if self.form.layout == "bshd":
            q, k, v = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        grads = None if self.backward_plan is None else self.backward_plan(q, k, v, saved, dout)
        if grads is None or not (all_finite(grads.dq) and all_finite(grads.dk) and all_finite(grads.dv)):
            return None
        return grads
