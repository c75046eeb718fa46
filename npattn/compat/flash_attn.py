"""FlashAttention 2's ``flash_attn_func``, ``flash_attn_varlen_func`` and
``flash_attn_with_kvcache``, on npattn.

Their conventions, translated once here: q (B, Sq, H, D), k and v (B, Sk, Hkv, D) is
npattn's ``layout="bshd"``; ``softmax_scale`` is ``scale``; ``window_size=(left, right)``
with -1 for an unbounded side is ``window`` with None there (causal forces right to 0);
``softcap=0.0`` is no softcap; ``alibi_slopes`` (H,) or (B, H) add
``-slope * |i + Sk - Sq - j|``, npattn's ALiBi at its bottom-right positions; causal masks
align bottom-right, as npattn's ``causal=True``.
"""
from __future__ import annotations

from typing import Any

from ..adapters import dispatch


def _window(window_size, causal: bool):
    """npattn's ``window`` for FlashAttention's ``window_size`` (-1: unbounded)."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError(f"window_size must be a pair (left, right) with -1 for an unbounded side, "
                        f"got {window_size!r}") from None
    for name, value in (("left", left), ("right", right)):
        if isinstance(value, bool) or not isinstance(value, int) or value < -1:
            raise ValueError(f"window_size {name} must be an int >= -1 (-1: unbounded), got {value!r}")
    if causal:
        right = 0
    if left == -1 and right == -1:
        return None
    return (None if left == -1 else left, None if right == -1 else right)


def _options(softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p=0.0) -> dict:
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    options: dict[str, Any] = {"causal": causal, "scale": softmax_scale}
    window = _window(window_size, causal)
    if window is not None:
        options["window"] = window
    if softcap:  # FlashAttention's 0.0 is none
        options["softcap"] = softcap
    if alibi_slopes is not None:
        options["alibi_slopes"] = alibi_slopes
    if dropout_p:
        options["dropout_p"] = dropout_p
    return options


def _check_bool(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def flash_attn_func(q: Any, k: Any, v: Any, dropout_p: float = 0.0, softmax_scale: float | None = None,
                    causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Any = None, deterministic: bool = False, return_attn_probs: bool = False) -> Any:
    """FlashAttention 2's ``flash_attn_func``: q (B, Sq, H, D), k and v (B, Sk, Hkv, D), H a
    multiple of Hkv (MQA/GQA). Returns out (B, Sq, H, D); with ``return_attn_probs``,
    ``(out, softmax_lse, attn_probs)``: lse (B, H, Sq) float32 and the probabilities
    (B, H, Sq, Sk) after masking, before dropout (FlashAttention's testing-only
    ``S_dmask`` encodes its dropout pattern instead)."""
    _check_bool("deterministic", deterministic)
    _check_bool("return_attn_probs", return_attn_probs)
    options = _options(softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p)
    if return_attn_probs:
        options.update(return_lse=True, return_weights=True)
    return dispatch.attention(q, k, v, layout="bshd", **options)


def flash_attn_varlen_func(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int,
                           max_seqlen_k: int, dropout_p: float = 0.0, softmax_scale: float | None = None,
                           causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Any = None, deterministic: bool = False, return_attn_probs: bool = False,
                           block_table: Any = None) -> Any:
    """FlashAttention 2's ``flash_attn_varlen_func``: packed q (total_q, H, D), k and v
    (total_k, Hkv, D), sequence b's rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``; each
    sequence's causal mask and window align at its own bottom-right corner. Returns out
    (total_q, H, D); with ``return_attn_probs``, ``(out, softmax_lse, None)``, lse
    (H, total_q) float32 (a packed batch has no (total, total) probabilities to return)."""
    _check_bool("deterministic", deterministic)
    _check_bool("return_attn_probs", return_attn_probs)
    if block_table is not None:
        raise TypeError("flash_attn_varlen_func: block_table (paged keys for a packed batch) is not supported yet; "
                        "page through flash_attn_with_kvcache, or pass k and v packed")
    options = _options(softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p)
    if return_attn_probs:
        out, lse = dispatch.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                             return_lse=True, **options)
        return out, lse, None
    return dispatch.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **options)


def flash_attn_with_kvcache(q: Any, k_cache: Any, v_cache: Any, k: Any = None, v: Any = None, rotary_cos: Any = None,
                            rotary_sin: Any = None, cache_seqlens: Any = None, cache_batch_idx: Any = None,
                            cache_leftpad: Any = None, block_table: Any = None, softmax_scale: float | None = None,
                            causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes: Any = None, num_splits: int = 0,
                            return_softmax_lse: bool = False) -> Any:
    """FlashAttention 2's ``flash_attn_with_kvcache``: q (B, Sq, H, D) against each
    sequence's cached keys, after appending ``k`` and ``v`` (B, Sn, Hkv, D) in place at
    ``cache_seqlens`` (and rotating q and the new k by ``rotary_cos`` / ``rotary_sin``,
    interleaved by default). ``cache_seqlens`` None: every cache row is full (nothing can
    be appended). ``block_table`` (B, P): paged caches (pages, page_size, Hkv, D);
    ``cache_batch_idx``: each sequence's cache row; ``cache_leftpad`` (B,): the keys of
    sequence b start at slot ``cache_leftpad[b]`` of its row (positions count from there).
    ``num_splits`` is accepted and changes nothing. Returns out (B, Sq, H, D), or
    ``(out, softmax_lse)`` with lse (B, H, Sq). A call that raises leaves the caches as they
    were."""
    _check_bool("return_softmax_lse", return_softmax_lse)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0, got {num_splits!r}")
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("flash_attn_with_kvcache: new keys (k, v) need cache_seqlens, the slot each sequence "
                             "appends at (None means every cache row is full)")
        cache_seqlens = _full_length(k_cache, block_table)
    options = _options(softmax_scale, causal, window_size, softcap, alibi_slopes)
    if return_softmax_lse:
        options["return_lse"] = True
    return dispatch.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                           block_table=block_table, cache_batch_idx=cache_batch_idx,
                                           rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                                           rotary_interleaved=rotary_interleaved, cache_leftpad=cache_leftpad,
                                           **options)


def _full_length(k_cache, block_table) -> int:
    """The key count of a full cache row: S, or P * page_size when paged."""
    shape = tuple(getattr(k_cache, "shape", ()))
    if len(shape) != 4:
        raise ValueError(f"k_cache must be 4-D (B, S, Hkv, D) or (pages, page_size, Hkv, D), got shape {shape}")
    if block_table is None:
        return int(shape[1])
    return int(shape[1]) * int(tuple(block_table.shape)[1])
