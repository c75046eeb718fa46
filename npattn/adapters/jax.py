"""npattn inside JAX programs: ``npattn.jax.attention(q, k, v, **options)``.

A ``jax.custom_vjp`` whose forward and backward are ``jax.pure_callback`` calls into
npattn on the host (the cpu backend): usable under ``jit``, ``grad`` and ``vmap``
(``vmap`` runs the callback once per mapped element). The backward is npattn's fused
backward (:func:`npattn.attention_backward`) from the forward's out and lse, which JAX
keeps as residuals (a float16 or bfloat16 call's out in float32, as
:func:`npattn.attention_for_backward` gives it: the gradients are attention_vjp's).
Gradients flow to q, k, v, ``bias`` and ``sink_logits``; the other option arrays (mask,
lengths, ALiBi slopes) are constants to it (zero cotangents).

Imported only when used (``import npattn.jax``, or npattn.attention given JAX tracers);
it imports JAX.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import api as _api
from ..core import options as _options
from ..core import validation
from .arrays import ARRAY_OPTIONS, DIFFERENTIABLE, with_plain_offsets

_OUTPUT_FLAGS = ("return_lse", "return_weights")


def takes(values: tuple) -> bool:
    """Whether a call on ``values`` must run through JAX: some value is a tracer."""
    return any(isinstance(value, jax.core.Tracer) for value in values)


def attention(q: Any, k: Any, v: Any, **options: Any) -> Any:
    """:func:`npattn.attention` on JAX arrays, differentiable by JAX and traceable.

    Takes the options of :func:`npattn.attention` and returns what it returns, as JAX
    arrays: ``out``, or ``(out, lse?, weights?)``. Arrays among the options may be JAX
    or NumPy arrays; the rest must be Python values (they are static: part of what
    ``jit`` compiles). Dropout needs an int ``seed``: a traced function has no fresh
    randomness of its own to draw one from at every call.
    """
    options = _static_options("attention", options)
    _check(q, k, v, options)  # npattn's own errors now, not an error from inside the host callback
    names = tuple(name for name in ARRAY_OPTIONS if options.get(name) is not None)
    arrays = tuple(jnp.asarray(options.pop(name)) for name in names)
    for name in ARRAY_OPTIONS:
        options.pop(name, None)
    wanted = tuple(bool(options.pop(flag, False)) for flag in _OUTPUT_FLAGS)
    static = _Static(names, wanted[1], tuple(sorted(options.items())))
    out, lse, weights = _attention(static, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), *arrays)
    extras = [array for array, want in zip((lse, weights), wanted) if want]
    return (out, *extras) if extras else out


def _static_options(entry: str, options: dict) -> dict:
    """The checks every call of the adapter makes before JAX sees it: known options, a
    seed for dropout, a static ``q_offset`` (a per-entry array becomes a tuple)."""
    _options.check_names(options)
    if _options.dropout_requested(options) and options.get("seed") is None:
        raise ValueError(f"npattn.jax.{entry} with dropout_p > 0 needs seed, an int: under jit a seed "
                         "drawn at trace time would repeat at every call")
    if isinstance(options.get("q_offset"), jax.core.Tracer):
        raise TypeError("q_offset must be static under jit, grad and vmap (a Python int or a tuple of ints, or a "
                        f"NumPy array): npattn.jax.{entry} passes it to the host as a setting, not as an array; "
                        "got a traced array")
    return with_plain_offsets(options)


def _check(q: Any, k: Any, v: Any, options: dict) -> None:
    """Every check of :func:`npattn.attention` on the call, before JAX sees it: concrete
    arrays by their values, traced ones by their shapes and dtypes (a traced value that is
    out of range is then reported from inside the callback)."""
    def host(value: Any) -> Any:
        if isinstance(value, jax.core.Tracer):  # shape and dtype only: a read-only view of one zero
            return np.broadcast_to(np.zeros((), np.dtype(value.dtype)), value.shape)
        if isinstance(value, jax.Array):
            return np.asarray(value)
        return value
    checked = {name: host(value) for name, value in options.items() if name != "backend"}
    if "backend" in options:
        from ..backends import resolve

        resolve(options["backend"], "numpy")
    validation.build_problem(host(q), host(k), host(v), **checked)


class _Static(tuple):
    """The call's static part, hashable for ``jit``: (array option names, whether weights
    are returned, the other options as sorted (name, value) pairs)."""

    def __new__(cls, names: tuple, weights: bool, settings: tuple) -> "_Static":
        return super().__new__(cls, (names, weights, settings))

    @property
    def options(self) -> dict:
        return dict(self[2])


def _shapes(static: _Static, q: Any, k: Any, v: Any) -> tuple:
    """The ShapeDtypeStructs of (out, lse, weights): weights (0,) unless asked for."""
    layout = static.options.get("layout", "bhsd")
    batch, heads, q_len = (q.shape[0], q.shape[2], q.shape[1]) if layout == "bshd" else q.shape[:3]
    kv_len = k.shape[1] if layout == "bshd" else k.shape[2]
    lse_dtype = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    return (jax.ShapeDtypeStruct((*q.shape[:-1], v.shape[-1]), q.dtype),
            jax.ShapeDtypeStruct((batch, heads, q_len), lse_dtype),
            jax.ShapeDtypeStruct((batch, heads, q_len, kv_len) if static[1] else (0,), q.dtype))


def _host_forward(static: _Static, q, k, v, *arrays):
    """npattn's forward on the host's NumPy views: (out, lse, weights)."""
    options = {**static.options, **dict(zip(static[0], (np.asarray(a) for a in arrays)))}
    results = _api.attention(np.asarray(q), np.asarray(k), np.asarray(v), return_lse=True,
                             return_weights=static[1], **options)
    out, lse = results[:2]
    weights = results[2] if static[1] else np.zeros((0,), out.dtype)
    return out, lse, weights


def _host_forward_for_backward(static: _Static, q, k, v, *arrays):
    """:func:`_host_forward`'s outputs and out as the backward reads it
    (:func:`npattn.attention_for_backward`: a 16-bit out's float32 product)."""
    options = {**static.options, **dict(zip(static[0], (np.asarray(a) for a in arrays)))}
    results, float_out = _api.attention_for_backward(np.asarray(q), np.asarray(k), np.asarray(v), return_lse=True,
                                                     return_weights=static[1], **options)
    out, lse = results[:2]
    weights = results[2] if static[1] else np.zeros((0,), out.dtype)
    return out, lse, weights, float_out


def _host_backward(static: _Static, q, k, v, out, lse, dout, *arrays):
    """npattn.attention_backward on the host: (dq, dk, dv, d<option> for each differentiable given)."""
    options = {**static.options, **dict(zip(static[0], (np.asarray(a) for a in arrays)))}
    return tuple(_api.attention_backward(*(np.asarray(a) for a in (q, k, v, out, lse, dout)), **options))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(static, q, k, v, *arrays):
    return jax.pure_callback(functools.partial(_host_forward, static), _shapes(static, q, k, v), q, k, v, *arrays,
                             vmap_method="sequential")


def _attention_forward(static, q, k, v, *arrays):
    """The forward under differentiation: a 16-bit call keeps its float32 out as the
    residual its backward reads (the primal call, :func:`_attention`, does not)."""
    shapes = _shapes(static, q, k, v)
    if q.dtype not in (jnp.float16, jnp.bfloat16):
        outputs = _attention(static, q, k, v, *arrays)
        return outputs, (q, k, v, outputs[0], outputs[1], arrays)
    *outputs, float_out = jax.pure_callback(
        functools.partial(_host_forward_for_backward, static),
        (*shapes, jax.ShapeDtypeStruct(shapes[0].shape, jnp.float32)), q, k, v, *arrays, vmap_method="sequential")
    return tuple(outputs), (q, k, v, float_out, outputs[1], arrays)


def _attention_backward(static, residuals, cotangents):
    q, k, v, out, lse, arrays = residuals
    dout = cotangents[0]  # lse and weights are outputs only
    given = [name for name in DIFFERENTIABLE if name in static[0]]
    option_arrays = dict(zip(static[0], arrays))
    shapes = (*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (q, k, v)),
              *(jax.ShapeDtypeStruct(option_arrays[name].shape, option_arrays[name].dtype) for name in given))
    grads = jax.pure_callback(functools.partial(_host_backward, static), shapes, q, k, v, out, lse,
                              dout.astype(q.dtype), *arrays, vmap_method="sequential")
    dq, dk, dv, *option_grads = grads
    by_name = dict(zip(given, option_grads))
    return (dq, dk, dv, *(by_name[name] if name in by_name else _zero_cotangent(array)
                          for name, array in zip(static[0], arrays)))


def _zero_cotangent(array: Any) -> Any:
    """The cotangent of a constant input: zeros, float0 for integer and boolean arrays."""
    if jnp.issubdtype(array.dtype, jnp.inexact):
        return jnp.zeros_like(array)
    return np.zeros(array.shape, dtype=jax.dtypes.float0)


_attention.defvjp(_attention_forward, _attention_backward)


def attention_varlen(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int | None = None,
                     max_seqlen_k: int | None = None, **options: Any) -> Any:
    """:func:`npattn.attention_varlen` on JAX arrays, differentiable by JAX and traceable:
    packed q (Tq, H, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv), ``cu_seqlens_q`` and
    ``cu_seqlens_k`` int (B + 1,) arrays (traced or not); returns ``out`` or ``(out, lse)``.
    Gradients flow to q, k, v and ``sink_logits``; the backward recomputes the forward
    on the host (a callback keeps no closure between the passes). Array options other
    than ``sink_logits`` and ``alibi_slopes`` must be static, as for :func:`attention`."""
    from ..serving.varlen import _PackedCall

    options = _static_options("attention_varlen", options)
    want_lse = options.pop("return_lse", False)
    _options.BY_NAME["return_lse"].check(want_lse, None)

    def host(value: Any, cumulative_total: int | None = None) -> Any:
        if isinstance(value, jax.core.Tracer):
            if cumulative_total is not None:  # a valid stand-in of its shape: 0, ..., 0, total
                stand_in = np.zeros(value.shape, np.dtype(value.dtype))
                stand_in[-1:] = cumulative_total
                return stand_in
            return np.broadcast_to(np.zeros((), np.dtype(value.dtype)), value.shape)
        return np.asarray(value) if isinstance(value, jax.Array) else value

    names = tuple(name for name in ("sink_logits", "alibi_slopes") if options.get(name) is not None)
    _PackedCall.of(host(q), host(k), host(v), host(cu_seqlens_q, np.shape(q)[0]), host(cu_seqlens_k, np.shape(k)[0]),
             max_seqlen_q, max_seqlen_k, {name: host(value) for name, value in options.items()})
    arrays = tuple(jnp.asarray(options.pop(name)) for name in names)
    static = _VarlenStatic(names, (max_seqlen_q, max_seqlen_k), tuple(sorted(options.items())))
    out, lse = _varlen(static, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(cu_seqlens_q),
                       jnp.asarray(cu_seqlens_k), *arrays)
    return (out, lse) if want_lse else out


class _VarlenStatic(tuple):
    """A packed call's static part: (array option names, (max_seqlen_q, max_seqlen_k), the
    other options as sorted (name, value) pairs)."""

    def __new__(cls, names: tuple, bounds: tuple, settings: tuple) -> "_VarlenStatic":
        return super().__new__(cls, (names, bounds, settings))

    def call(self, arrays: tuple) -> dict:
        """The keywords of the host call: the bounds, the options, the array options."""
        return {"max_seqlen_q": self[1][0], "max_seqlen_k": self[1][1], **dict(self[2]),
                **dict(zip(self[0], (np.asarray(a) for a in arrays)))}


def _varlen_host_forward(static: _VarlenStatic, q, k, v, cu_q, cu_k, *arrays):
    from ..serving.varlen import attention_varlen

    return attention_varlen(np.asarray(q), np.asarray(k), np.asarray(v), np.asarray(cu_q), np.asarray(cu_k),
                            return_lse=True, **static.call(arrays))


def _varlen_host_backward(static: _VarlenStatic, q, k, v, cu_q, cu_k, dout, *arrays):
    from ..serving.varlen import attention_varlen_vjp

    _, vjp = attention_varlen_vjp(np.asarray(q), np.asarray(k), np.asarray(v), np.asarray(cu_q), np.asarray(cu_k),
                                  **static.call(arrays))
    grads = vjp(np.asarray(dout))
    return tuple(grads[:3]) + ((grads[3],) if "sink_logits" in static[0] else ())


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _varlen(static, q, k, v, cu_q, cu_k, *arrays):
    lse_dtype = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    shapes = (jax.ShapeDtypeStruct((q.shape[0], q.shape[1], v.shape[2]), q.dtype),
              jax.ShapeDtypeStruct((q.shape[1], q.shape[0]), lse_dtype))
    return jax.pure_callback(functools.partial(_varlen_host_forward, static), shapes, q, k, v, cu_q, cu_k, *arrays,
                             vmap_method="sequential")


def _varlen_forward(static, q, k, v, cu_q, cu_k, *arrays):
    return _varlen(static, q, k, v, cu_q, cu_k, *arrays), (q, k, v, cu_q, cu_k, arrays)


def _varlen_backward(static, residuals, cotangents):
    q, k, v, cu_q, cu_k, arrays = residuals
    dout = cotangents[0].astype(q.dtype)  # lse is an output only
    option_arrays = dict(zip(static[0], arrays))
    shapes = (*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (q, k, v)),
              *((jax.ShapeDtypeStruct(option_arrays["sink_logits"].shape, option_arrays["sink_logits"].dtype),)
                if "sink_logits" in option_arrays else ()))
    grads = jax.pure_callback(functools.partial(_varlen_host_backward, static), shapes, q, k, v, cu_q, cu_k, dout,
                              *arrays, vmap_method="sequential")
    dq, dk, dv, *rest = grads
    by_name = dict(zip(("sink_logits",) if "sink_logits" in option_arrays else (), rest))
    return (dq, dk, dv, _zero_cotangent(cu_q), _zero_cotangent(cu_k),
            *(by_name[name] if name in by_name else _zero_cotangent(array) for name, array in zip(static[0], arrays)))


_varlen.defvjp(_varlen_forward, _varlen_backward)
