"""torch's ``scaled_dot_product_attention``, on npattn."""
from __future__ import annotations

from typing import Any

from ..adapters import dispatch


def _is_bool(mask) -> bool:
    return str(getattr(mask, "dtype", "")) in ("bool", "torch.bool")


def scaled_dot_product_attention(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> Any:
    """torch's ``scaled_dot_product_attention``: query (N, H, L, E), (N, L, E) or (L, E);
    key (..., Hkv, S, E) and value (..., Hkv, S, Ev) alike. ``attn_mask`` broadcastable to
    the scores (..., L, S): boolean, True where a query may attend, or float, added to the
    scores. ``is_causal``: the top-left causal mask (row i sees keys j <= i, whatever L and
    S), with no ``attn_mask``. ``enable_gqa``: key and value may have fewer heads than query
    (a divisor of them). Returns (..., L, Ev) in query's array kind and dtype. Rows that see
    no key give zeros (torch's math path gives NaN there); dropout draws npattn's own mask."""
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__} {is_causal!r}")
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be a bool, got {type(enable_gqa).__name__} {enable_gqa!r}")
    if attn_mask is not None and is_causal:
        raise ValueError("scaled_dot_product_attention: attn_mask and is_causal cannot both be set (as in torch)")
    shapes = [tuple(getattr(x, "shape", ())) for x in (query, key, value)]
    ndim = len(shapes[0])
    if ndim not in (2, 3, 4) or any(len(shape) != ndim for shape in shapes):
        raise ValueError(f"query, key and value must all be 2-D (L, E), 3-D (N, L, E) or 4-D (N, H, L, E), "
                         f"got shapes {shapes[0]}, {shapes[1]}, {shapes[2]}")
    if ndim == 4 and shapes[1][1] != shapes[0][1] and not enable_gqa:
        raise ValueError(f"key has {shapes[1][1]} heads but query has {shapes[0][1]}: pass enable_gqa=True for "
                         "grouped-query attention")
    options: dict[str, Any] = {"scale": scale}
    if is_causal:
        options["causal"] = "top_left"
    if dropout_p:
        options["dropout_p"] = dropout_p
    if attn_mask is not None:
        mask_ndim = len(tuple(getattr(attn_mask, "shape", ())))
        if ndim == 3 and mask_ndim == 3:  # (N, L, S) against (N, 1, L, S) scores
            attn_mask = attn_mask[:, None]
        options["mask" if _is_bool(attn_mask) else "bias"] = attn_mask
    if ndim == 4:
        return dispatch.attention(query, key, value, **options)
    lift = (lambda x: x[:, None]) if ndim == 3 else (lambda x: x[None, None])
    out = dispatch.attention(lift(query), lift(key), lift(value), **options)
    return out[:, 0] if ndim == 3 else out[0, 0]
