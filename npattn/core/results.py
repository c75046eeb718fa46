"""What a backend hands back: the forward's outputs and the backward's gradients."""
from __future__ import annotations

from typing import Any, NamedTuple

from .arrays import all_finite


class ForwardResult(NamedTuple):
    """bhsd-ordered arrays: ``out`` (B, H, Sq, Dv), ``lse`` (B, H, Sq) or None,
    ``weights`` (B, H, Sq, Sk) or None; ``saved`` is whatever the same backend's
    backward needs (kernels keep out and lse; nothing Sq x Sk). ``finite``: whether
    ``out`` needs no check for NaN and inf, where the backend knows it: True where the
    kernel found it all finite, or where the backend already gave every row that is not
    finite the reference's answer (the GPU's repair pass); False where a row may hold a
    NaN or inf the reference would not (None: unknown, :func:`out_is_finite` reads out)."""

    out: Any
    lse: Any = None
    weights: Any = None
    saved: Any = None
    finite: bool | None = None


def out_is_finite(result: ForwardResult) -> bool:
    """Whether ``result.out`` stands as it is: what the backend reported
    (``ForwardResult.finite``), else whether a pass over out finds no NaN or inf
    (:func:`~npattn.core.arrays.all_finite`)."""
    if result.finite is not None:
        return result.finite
    return all_finite(result.out)


class Gradients(NamedTuple):
    """bhsd-ordered gradients: ``dq`` (B, H, Sq, D), ``dk`` (B, Hkv, Sk, D),
    ``dv`` (B, Hkv, Sk, Dv); ``dbias`` in the bias's given shape; ``dsink_logits`` (H,)."""

    dq: Any
    dk: Any
    dv: Any
    dbias: Any = None
    dsink_logits: Any = None
