"""What a backend hands back: the forward's outputs and the backward's gradients."""
from __future__ import annotations

from typing import Any, NamedTuple


class ForwardResult(NamedTuple):
    """bhsd-ordered arrays: ``out`` (B, H, Sq, Dv), ``lse`` (B, H, Sq) or None,
    ``weights`` (B, H, Sq, Sk) or None; ``saved`` is whatever the same backend's
    backward needs (kernels keep out and lse; nothing Sq x Sk)."""

    out: Any
    lse: Any = None
    weights: Any = None
    saved: Any = None


class Gradients(NamedTuple):
    """bhsd-ordered gradients: ``dq`` (B, H, Sq, D), ``dk`` (B, Hkv, Sk, D),
    ``dv`` (B, Hkv, Sk, Dv); ``dbias`` in the bias's given shape; ``dsink_logits`` (H,)."""

    dq: Any
    dk: Any
    dv: Any
    dbias: Any = None
    dsink_logits: Any = None
