"""npattn as a torch operator: ``npattn.torch.attention(q, k, v, **options)``.

Two ``torch.library`` custom ops, ``npattn::attention_forward`` and
``npattn::attention_backward``, joined by a registered autograd formula, so torch
differentiates through npattn's fused, deterministic backward (not through a
recomputed forward). A float16 or bfloat16 forward of CPU tensors whose gradients are
needed keeps its float32 out for the backward (the op's fourth output, empty otherwise;
:func:`npattn.attention_for_backward`), so the gradients are attention_vjp's. Each op has
a fake implementation (shapes and dtypes only), so it traces under ``torch.compile`` and
``torch.export`` as one opaque call.

Tensors cross to npattn without a copy (DLPack, :mod:`npattn.adapters.arrays`): CPU
tensors run on the cpu backend, CUDA tensors on the gpu backend (CuPy needed). An
option given as an array becomes a tensor input of the op; ``bias`` and
``sink_logits`` get gradients when they require them. The other options cross as a
string (a dict's repr), the op's one non-tensor input.

Imported only when used (``import npattn.torch``, or npattn.attention given a tensor
that requires grad); it imports torch.
"""
from __future__ import annotations

import ast
import functools
import math
from typing import Any

import numpy as np
import torch

from .. import api as _api
from ..core import options as _options
from .arrays import ARRAY_OPTIONS, DIFFERENTIABLE, ForeignKind, with_plain_offsets
_KIND = ForeignKind(torch)
_OUTPUT_FLAGS = ("return_lse", "return_weights")


def takes(values: tuple) -> bool:
    """Whether a call on ``values`` must run as the op: autograd is recording a tensor of them."""
    return torch.is_grad_enabled() and any(isinstance(value, torch.Tensor) and value.requires_grad
                                           for value in values)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any) -> Any:
    """:func:`npattn.attention` on torch tensors, differentiable by torch's autograd.

    Takes the options of :func:`npattn.attention` (arrays may be tensors, NumPy arrays or
    lists) and returns what it returns, as tensors on q's device: ``out``, or
    ``(out, lse?, weights?)``. Gradients flow to q, k, v, and to ``bias`` and
    ``sink_logits`` when they require grad; lse and weights are outputs only. With
    dropout and ``seed=None``, the seed is drawn from torch's generator
    (``torch.manual_seed`` makes it repeatable), and the backward reuses its mask.
    """
    _options.check_names(options)
    options = with_plain_offsets(options)
    arrays = [_tensor(name, options.pop(name, None), q) for name in ARRAY_OPTIONS]
    wanted = [bool(options.pop(flag, False)) for flag in _OUTPUT_FLAGS]
    if _options.dropout_requested(options) and options.get("seed") is None:
        options["seed"] = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    # a 16-bit forward whose backward may follow keeps its float32 out for it
    # (npattn.attention_for_backward); one under no_grad, or of inputs that need no
    # gradient, does not pay for it
    # (CUDA tensors run the gpu backend, whose backward reads the 16-bit out: nothing to keep)
    keeps = q.dtype in _ROUNDED and q.device.type == "cpu" and takes((q, k, v, *arrays))
    settings = repr({name: _plain(name, value) for name, value in
                     {**options, "return_weights": wanted[1], _KEEPS_FLOAT_OUT: keeps}.items()})
    if torch.compiler.is_compiling():  # one opaque op in the graph, its fake shapes for tracing
        out, lse, weights, _ = torch.ops.npattn.attention_forward(q, k, v, *arrays, settings)
    else:  # eager: the same functions, without the dispatcher's two round trips
        out, lse, weights, _ = _EagerAttention.apply(q, k, v, *arrays, settings)
    extras = [array for array, want in zip((lse, weights), wanted) if want]
    return (out, *extras) if extras else out


def _tensor(name: str, value: Any, q: torch.Tensor) -> torch.Tensor | None:
    """An option's array as a tensor (None stays None), for the op's ``arrays`` input."""
    if value is None or isinstance(value, torch.Tensor):
        return value
    return torch.as_tensor(np.asarray(value), device=q.device)


def _plain(name: str, value: Any) -> Any:
    """A value the settings string can carry: Python's own scalars, None, strings and
    tuples of them (a NumPy scalar, or a 0-d array or tensor, becomes its Python value).
    A float must be finite (every real option must be; and ``repr`` of inf or NaN is no
    literal the settings could be read back from)."""
    if isinstance(value, np.generic) or (getattr(value, "ndim", None) == 0 and hasattr(value, "item")):
        value = value.item()
    if isinstance(value, (tuple, list)):
        return tuple(_plain(name, item) for item in value)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"npattn.torch.attention: {name} must be a number, a string, None or a tuple of them (or an "
                    f"array option's array), got {type(value).__name__} {value!r}")


def _settings(text: str) -> dict:
    """The options of a settings string (a dict's repr: torch.compile traces repr, not json)."""
    return dict(_parsed(text))


@functools.lru_cache(maxsize=256)
def _parsed(text: str) -> tuple:
    """The (name, value) pairs of a settings string: a call's settings repeat, their parse
    (20 us) need not."""
    return tuple(ast.literal_eval(text).items())


def _native(name: str, tensor: torch.Tensor) -> Any:
    """A tensor as npattn's array, sharing its memory: ``Tensor.numpy()`` for CPU tensors
    NumPy has the dtype of (1 us, where DLPack takes 9), DLPack otherwise."""
    if tensor.device.type == "cpu" and tensor.dtype != torch.bfloat16:
        return tensor.detach().numpy()
    return _KIND.native(name, tensor)


def _back(array: Any) -> torch.Tensor:
    """An npattn result as a tensor on the device of its memory (``torch.from_numpy`` for
    a NumPy array of a dtype torch shares)."""
    if isinstance(array, np.ndarray) and array.dtype in _SHARED_DTYPES:
        return torch.from_numpy(array)
    return _KIND.back(array)


_SHARED_DTYPES = frozenset(np.dtype(name) for name in ("float16", "float32", "float64"))
_ROUNDED = (torch.float16, torch.bfloat16)  # dtypes whose out rounds the kernels' float32 one
_KEEPS_FLOAT_OUT = "keeps_float_out"  # the forward op's setting (not an npattn option)


def _native_call(arrays: list, settings: str) -> dict:
    """npattn's keyword options from the op's inputs: native views of the arrays, then the
    settings (less the forward's own ``keeps_float_out``)."""
    options = {name: _native(name, array) for name, array in zip(ARRAY_OPTIONS, arrays) if array is not None}
    options.update(_settings(settings))
    options.pop(_KEEPS_FLOAT_OUT, None)
    return options


# The ops' schemas, one optional tensor per array option (a list of optional tensors
# would not do: torch's autograd wrapper flattens such a list in the gradients but not
# in the inputs).
_ARRAY_PARAMETERS = ", ".join(f"Tensor? {name}" for name in ARRAY_OPTIONS)
torch.library.define("npattn::attention_forward",
                     f"(Tensor q, Tensor k, Tensor v, {_ARRAY_PARAMETERS}, str settings) "
                     "-> (Tensor, Tensor, Tensor, Tensor)")
torch.library.define("npattn::attention_backward",
                     f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, {_ARRAY_PARAMETERS}, "
                     "str settings) -> Tensor[]")


def _forward(q, k, v, *arrays_and_settings):
    """(out, lse, weights, float_out): weights is empty unless the settings ask for them;
    float_out, the float32 out a 16-bit forward keeps for its backward
    (:func:`npattn.attention_for_backward`), is empty unless they say ``keeps_float_out``."""
    *arrays, settings = arrays_and_settings
    options = _native_call(arrays, settings)
    native = (_native("q", q), _native("k", k), _native("v", v))
    if _settings(settings).get(_KEEPS_FLOAT_OUT):
        results, float_out = _api.attention_for_backward(*native, return_lse=True, **options)
        float_out = _back(float_out).contiguous()
    else:
        results, float_out = _api.attention(*native, return_lse=True, **options), q.new_empty(0, dtype=torch.float32)
    out, lse = _back(results[0]).contiguous(), _back(results[1]).contiguous()  # as the fake says
    weights = _back(results[2]).contiguous() if options["return_weights"] else q.new_empty(0)
    return out, lse, weights, float_out


@torch.library.register_fake("npattn::attention_forward")
def _forward_shapes(q, k, v, *arrays_and_settings):
    settings = _settings(arrays_and_settings[-1])
    layout = settings.get("layout", "bhsd")
    batch, heads, q_len = (q.shape[0], q.shape[2], q.shape[1]) if layout == "bshd" else q.shape[:3]
    kv_len = k.shape[1] if layout == "bshd" else k.shape[2]
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    lse = q.new_empty((batch, heads, q_len), dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    weights = q.new_empty((batch, heads, q_len, kv_len) if settings["return_weights"] else (0,))
    float_out = out.new_empty(out.shape if settings.get(_KEEPS_FLOAT_OUT) else (0,), dtype=torch.float32)
    return out, lse, weights, float_out


def _backward(dout, q, k, v, out, lse, *arrays_and_settings):
    """[dq, dk, dv, dbias?, dsink_logits?]: npattn.attention_backward's gradients."""
    *arrays, settings = arrays_and_settings
    grads = _api.attention_backward(*(_native(name, tensor) for name, tensor in
                                      (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse),
                                       ("dout", dout))),
                                    **_native_call(arrays, settings))
    return [_back(grad).contiguous() for grad in grads]  # as the fake implementation says


@torch.library.register_fake("npattn::attention_backward")
def _backward_shapes(dout, q, k, v, out, lse, *arrays_and_settings):
    # contiguous, as _backward's gradients are, whatever the inputs' strides (a permuted
    # view's empty_like would keep its strides, and the compiled graph would then assert them)
    given = dict(zip(ARRAY_OPTIONS, arrays_and_settings))
    return [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            *(given[name].new_empty(given[name].shape) for name in DIFFERENTIABLE if given[name] is not None)]


# Registered as functions, not by decorator: torch.library.impl's decorator returns None.
torch.library.impl("npattn::attention_forward", "CompositeExplicitAutograd", func=_forward)
torch.library.impl("npattn::attention_backward", "CompositeExplicitAutograd", func=_backward)


def _setup_context(ctx, inputs, output):
    q, k, v, *arrays, settings = inputs
    out, lse, _, float_out = output
    # the backward reads the float32 out where the forward kept one (16-bit inputs)
    ctx.save_for_backward(q, k, v, float_out if float_out.numel() else out, lse)
    ctx.arrays, ctx.settings = arrays, settings


def _backward_formula(ctx, dout, dlse, dweights, dfloat_out, backward=torch.ops.npattn.attention_backward):
    """The gradients of the op's inputs: ``backward``'s (the backward op, or in eager mode
    its function) for q, k, v, bias and sink_logits; None for the rest."""
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:  # only lse or weights were used: no gradient flows through them
        dout = out.new_zeros(out.shape, dtype=q.dtype)  # (out may be the kept float32 one)
    grads = iter(backward(dout.contiguous(), q, k, v, out, lse, *ctx.arrays, ctx.settings))
    dq, dk, dv = next(grads), next(grads), next(grads)
    given = dict(zip(ARRAY_OPTIONS, ctx.arrays))
    option_grads = {name: next(grads) for name in DIFFERENTIABLE if given[name] is not None}
    return (dq, dk, dv, *(option_grads.get(name) for name in ARRAY_OPTIONS), None)


torch.library.register_autograd("npattn::attention_forward", _backward_formula, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The op's forward and backward as an autograd Function, for eager mode: a call
    through the dispatcher costs 0.2-0.4 ms more at (1, 8, 512, 64) on the 2-core VMs."""

    @staticmethod
    def forward(ctx, q, k, v, *arrays_and_settings):
        outputs = _forward(q, k, v, *arrays_and_settings)
        _setup_context(ctx, (q, k, v, *arrays_and_settings), outputs)
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs

    @staticmethod
    def backward(ctx, dout, dlse, dweights, dfloat_out):
        return _backward_formula(ctx, dout, dlse, dweights, dfloat_out, backward=_backward)


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: Any, cu_seqlens_k: Any,
                     max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, **options: Any) -> Any:
    """:func:`npattn.attention_varlen` on torch tensors, differentiable by torch's autograd:
    packed q (Tq, H, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv); returns ``out`` or
    ``(out, lse)`` as tensors. Gradients flow to q, k, v and ``sink_logits``; the
    backward is npattn's packed vjp (the forward's, kept by the autograd node)."""
    _options.check_names(options)
    sink_logits = options.pop("sink_logits", None)
    want_lse = options.pop("return_lse", False)
    _options.BY_NAME["return_lse"].check(want_lse, None)
    out, lse = _Varlen.apply(q, k, v, _tensor("sink_logits", sink_logits, q),
                             (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options))
    return (out, lse) if want_lse else out


class _Varlen(torch.autograd.Function):
    """attention_varlen_vjp as an autograd node: its forward's vjp runs the backward."""

    @staticmethod
    def forward(ctx, q, k, v, sink_logits, call):
        from ..serving.varlen import attention_varlen_vjp

        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options = call
        native = {name: _native(name, value) if isinstance(value, torch.Tensor) else value
                  for name, value in options.items()}
        if sink_logits is not None:
            native["sink_logits"] = _native("sink_logits", sink_logits)
        cu = [_native(name, value) if isinstance(value, torch.Tensor) else value
              for name, value in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k))]
        (out, lse), vjp = attention_varlen_vjp(_native("q", q), _native("k", k), _native("v", v), *cu, max_seqlen_q,
                                               max_seqlen_k, return_lse=True, **native)
        ctx.vjp, ctx.has_sink = vjp, sink_logits is not None
        out, lse = _back(out), _back(lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None:
            return None, None, None, None, None
        grads = [_back(grad) for grad in ctx.vjp(_native("dout", dout.contiguous()))]
        return grads[0], grads[1], grads[2], grads[3] if ctx.has_sink else None, None
