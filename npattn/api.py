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
from .results import ForwardResult
from .types import Array, ArrayLike, Outputs, Vjp
from .validation import build_problem, check_cotangent


def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, **options: Any) -> Outputs:
    """Scaled dot-product attention with every option fused.

    Shapes in layout "bhsd" (torch SDPA): q (B, H, Sq, D), k (B, Hkv, Sk, D),
    v (B, Hkv, Sk, Dv); in "bshd" (FlashAttention, JAX): q (B, Sq, H, D), k and v
    likewise. ``H % Hkv == 0``; query head h reads kv head ``h // (H // Hkv)``
    (Hkv == H: MHA, Hkv == 1: MQA, between: GQA).

    Query row i sits at position ``p_i = i + Sk - Sq`` (bottom-right alignment);
    key j is visible to it when ``j <= p_i`` (causal), ``p_i - left <= j <= p_i + right``
    or ``j < sinks`` (window), ``mask[b, h, i, j]`` (True = may attend),
    ``j < kv_lengths[b]`` and ``i < q_lengths[b]``.

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
    """
    key = _plans.call_key(q, k, v, options)
    if key is not None:  # a call like an earlier one: its checks' outcome is known
        plan = _plans.lookup(key)
        outputs = None if plan is None else plan(q, k, v)
        if outputs is not None:
            return outputs
    backend = options.pop("backend", "auto")
    problem = build_problem(q, k, v, **options)
    implementation = _backends.resolve(backend, array_kind(problem.q))
    _limits.check_memory(problem, implementation.NAME)
    result, used = _nonfinite.forward(problem, implementation)
    if key is not None and used is implementation:
        _plans.remember(key, _repeated_forward(problem, implementation))
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
    weights are outputs only: no gradient flows back through them.

    Args:
{arguments}
    """
    options = dict(options)
    backend = options.pop("backend", "auto")
    problem = build_problem(q, k, v, **options)
    implementation = _backends.resolve(backend, array_kind(problem.q))
    _limits.check_memory(problem, implementation.NAME)
    result, implementation = _nonfinite.forward(problem, implementation)
    outputs = _public_outputs(OutputForm.of(problem), result)
    out_shape = (outputs[0] if isinstance(outputs, tuple) else outputs).shape

    def vjp(dout: ArrayLike) -> tuple[Array, ...]:
        dout = check_cotangent("dout", dout, problem.q, out_shape)
        if problem.layout == "bshd":
            dout = dout.transpose(0, 2, 1, 3)
        grads = _nonfinite.backward(problem, implementation, result.saved, dout)
        form = OutputForm.of(problem)
        with np.errstate(over="ignore"):  # as in _public_outputs
            public = [_user_array(form, grads.dq, problem.q.dtype),
                      _user_array(form, grads.dk, problem.k.dtype),
                      _user_array(form, grads.dv, problem.v.dtype)]
            if problem.bias is not None:
                public.append(grads.dbias.astype(problem.bias.dtype, copy=False))
            if problem.sink_logits is not None:
                public.append(grads.dsink_logits.astype(problem.sink_logits.dtype, copy=False))
        return tuple(public)

    return outputs, vjp


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


def _public_outputs(form: OutputForm, result: ForwardResult) -> Outputs:
    # a float64 reference answer (non-finite inputs) may pass the user dtype's range: inf
    with np.errstate(over="ignore"):
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


def _repeated_forward(problem: AttentionProblem, implementation: Any) -> Callable[..., Outputs | None] | None:
    """What a later call of ``problem``'s structure runs (:mod:`npattn.plans`): the
    backend's forward plan between the user's layout and outputs; None for a backend
    without plans."""
    planner = getattr(implementation, "forward_plan", None)
    backend_plan = None if planner is None else planner(problem)
    if backend_plan is None:
        return None
    form = OutputForm.of(problem)
    bshd = problem.layout == "bshd"

    def forward(q: Any, k: Any, v: Any) -> Outputs | None:
        """``attention``'s outputs, or None where the full path must answer (a result that
        is not all finite, or a plan made under another tuning)."""
        if bshd:
            q, k, v = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        result = backend_plan(q, k, v)
        if result is None or not all_finite(result.out):
            return None
        return _public_outputs(form, result)
    return forward
