"""The public calls as users reach them (``npattn.attention`` and the rest): arrays of any
kind that speaks DLPack in, the caller's kind out.

:mod:`npattn.api`, :mod:`npattn.serving.varlen` and :mod:`npattn.serving.kvcache` take NumPy and CuPy
arrays and know nothing of other frameworks. Each function here wraps one of them: NumPy
and CuPy arrays go straight through; torch tensors and JAX arrays are viewed natively and
their results handed back (:mod:`.arrays`), or the call goes to the framework's adapter
where autograd or tracing needs one (:mod:`.torch`, :mod:`.jax`, imported then). So the
layers import downwards only: the adapters import the API, never the reverse.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import numpy as np

from .. import api
from ..serving import kvcache, varlen
from ..core import merging
from . import arrays


def _public(native: Callable) -> Callable:
    """``native`` with its name, docs and signature, preceded by the dispatch ``route``."""
    def wrap(route: Callable) -> Callable:
        wrapper = functools.wraps(native)(route)
        wrapper.__signature__ = getattr(native, "__signature__", None) or inspect.signature(native)
        return wrapper
    return wrap


@_public(api.attention)
def attention(q: Any, k: Any, v: Any, **options: Any) -> Any:
    if type(q) is not np.ndarray and (kind := arrays.foreign_kind(q)) is not None:
        return arrays.attention(kind, api.attention, q, k, v, options)
    return api.attention(q, k, v, **options)


@_public(api.attention_vjp)
def attention_vjp(q: Any, k: Any, v: Any, **options: Any) -> Any:
    if type(q) is not np.ndarray and (kind := arrays.foreign_kind(q)) is not None:
        return arrays.attention_vjp(kind, api.attention_vjp, q, k, v, options)
    return api.attention_vjp(q, k, v, **options)


def _varlen_route(native: Callable, with_vjp: bool) -> Callable:
    @_public(native)
    def route(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any = None, max_seqlen_q: int | None = None,
              max_seqlen_k: int | None = None, **options: Any) -> Any:
        given = dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                     max_seqlen_k=max_seqlen_k)
        kind = arrays.foreign_kind_of(given.values(), options.values())
        if kind is not None:
            return arrays.varlen_call(kind, native, given, options, with_vjp=with_vjp)
        return native(**given, **options)
    return route


attention_varlen = _varlen_route(varlen.attention_varlen, with_vjp=False)
attention_varlen_vjp = _varlen_route(varlen.attention_varlen_vjp, with_vjp=True)


@_public(kvcache.attention_with_kvcache)
def attention_with_kvcache(q: Any, k_cache: Any, v_cache: Any, k: Any = None, v: Any = None, *, cache_seqlens: Any,
                           block_table: Any = None, cache_batch_idx: Any = None, rotary_cos: Any = None,
                           rotary_sin: Any = None, rotary_interleaved: bool = False, cache_leftpad: Any = None,
                           prefix_k: Any = None, prefix_v: Any = None, k_scale: Any = None, v_scale: Any = None,
                           **options: Any) -> Any:
    given = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=cache_seqlens,
                 block_table=block_table, cache_batch_idx=cache_batch_idx, rotary_cos=rotary_cos,
                 rotary_sin=rotary_sin, cache_leftpad=cache_leftpad, prefix_k=prefix_k, prefix_v=prefix_v,
                 k_scale=k_scale, v_scale=v_scale)
    kind = arrays.foreign_kind_of(given.values(), options.values())
    if kind is not None:
        written = ((("k_cache", "v_cache") + (() if k_scale is None else ("k_scale", "v_scale")))
                   if k is not None or v is not None else ())
        return arrays.forward_only_call(kind, "attention_with_kvcache", kvcache.attention_with_kvcache, given,
                                        dict(options, rotary_interleaved=rotary_interleaved), written)
    return kvcache.attention_with_kvcache(**given, rotary_interleaved=rotary_interleaved, **options)


@_public(merging.merge_states)
def merge_states(outs: Any, lses: Any, *, layout: str = "bhsd") -> tuple[Any, Any]:
    outs, lses = list(outs), list(lses)
    kind = arrays.foreign_kind_of(outs, lses)
    if kind is None:
        return merging.merge_states(outs, lses, layout=layout)
    native = lambda name, values: [kind.native(f"{name}[{i}]", x) for i, x in enumerate(values)]  # noqa: E731
    return kind.back_all(merging.merge_states(native("outs", outs), native("lses", lses), layout=layout))

