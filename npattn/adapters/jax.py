"""npattn inside JAX programs: ``npattn.jax.attention(q, k, v, **options)``.

A ``jax.custom_vjp`` whose forward and backward are ``jax.pure_callback`` calls into
npattn on the host (the cpu backend): usable under ``jit``, ``grad`` and ``vmap``
(``vmap`` runs the callback once per mapped element). The backward is npattn's fused
backward (:func:`npattn.attention_backward`) from the forward's out and lse, which JAX
keeps as residuals. Gradients flow to q, k, v, ``bias`` and ``sink_logits``; the other
option arrays (mask, lengths, ALiBi slopes) are constants to it (zero cotangents).

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
from .. import options as _options
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
    _options.check_names(options)
    if options.get("dropout_p") and options.get("seed") is None:
        raise ValueError("npattn.jax.attention with dropout_p > 0 needs seed, an int: under jit a seed "
                         "drawn at trace time would repeat at every call")
    options = with_plain_offsets(options)
    names = tuple(name for name in ARRAY_OPTIONS if options.get(name) is not None)
    arrays = tuple(jnp.asarray(options.pop(name)) for name in names)
    for name in ARRAY_OPTIONS:
        options.pop(name, None)
    wanted = tuple(bool(options.pop(flag, False)) for flag in _OUTPUT_FLAGS)
    static = _Static(names, wanted[1], tuple(sorted(options.items())))
    out, lse, weights = _attention(static, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), *arrays)
    extras = [array for array, want in zip((lse, weights), wanted) if want]
    return (out, *extras) if extras else out


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


def _host_backward(static: _Static, q, k, v, out, lse, dout, *arrays):
    """npattn.attention_backward on the host: (dq, dk, dv, d<option> for each differentiable given)."""
    options = {**static.options, **dict(zip(static[0], (np.asarray(a) for a in arrays)))}
    return tuple(_api.attention_backward(*(np.asarray(a) for a in (q, k, v, out, lse, dout)), **options))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(static, q, k, v, *arrays):
    return jax.pure_callback(functools.partial(_host_forward, static), _shapes(static, q, k, v), q, k, v, *arrays,
                             vmap_method="sequential")


def _attention_forward(static, q, k, v, *arrays):
    outputs = _attention(static, q, k, v, *arrays)
    return outputs, (q, k, v, outputs[0], outputs[1], arrays)


def _attention_backward(static, residuals, cotangents):
    q, k, v, out, lse, arrays = residuals
    dout = cotangents[0]  # lse and weights are outputs only
    given = [name for name in DIFFERENTIABLE if name in static[0]]
    option_arrays = dict(zip(static[0], arrays))
    shapes = (*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (q, k, v)),
              *(jax.ShapeDtypeStruct(option_arrays[name].shape, option_arrays[name].dtype) for name in given))
    grads = jax.pure_callback(functools.partial(_host_backward, static), shapes, q, k, v, out, lse,
                              dout.astype(out.dtype), *arrays, vmap_method="sequential")
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
