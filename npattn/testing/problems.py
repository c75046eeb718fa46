"""The problems :func:`attention_problems` draws, and what one holds (:class:`Problem`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
from hypothesis import strategies as st

# The options a user may ask attention_problems to draw, each as npattn.attention's keyword.
OPTION_NAMES = ("causal", "q_offset", "window", "sinks", "scale", "softcap", "alibi_slopes", "bias", "mask",
                "kv_lengths", "q_lengths", "sink_logits", "dropout_p", "return_lse")
_DTYPES = ("float16", "bfloat16", "float32", "float64")
_LAYOUTS = ("bhsd", "bshd")


@dataclass(frozen=True)
class Problem:
    """One drawn attention problem: ``q`` (B, H, Sq, D), ``k`` (B, Hkv, Sk, D) and ``v``
    (B, Hkv, Sk, Dv) as NumPy arrays of ``dtype`` in ``layout`` ("bhsd", or "bshd":
    (B, S, H, D)); ``options``, :func:`npattn.attention` keywords (without ``layout``) for
    the options asked for. Query head h reads kv head ``h // (H // Hkv)``; with ``causal``,
    query row i sits at key position ``i + Sk - Sq`` (bottom-right) unless ``q_offset``
    says otherwise."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    layout: str = "bhsd"
    options: dict = field(default_factory=dict)

    @property
    def dtype(self) -> np.dtype:
        return self.q.dtype

    @property
    def shape(self) -> tuple[int, int, int, int, int, int, int]:
        """``(B, H, Hkv, Sq, Sk, D, Dv)``, whatever the layout."""
        q, k, v = (self.q, self.k, self.v) if self.layout == "bhsd" else (
            x.transpose(0, 2, 1, 3) for x in (self.q, self.k, self.v))
        return (q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3])

    def arrays(self, dtype=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(q, k, v)``, converted to ``dtype`` when given."""
        if dtype is None:
            return self.q, self.k, self.v
        return tuple(x.astype(dtype) for x in (self.q, self.k, self.v))  # type: ignore[return-value]

    def _repr_pretty_(self, printer, cycle) -> None:  # hypothesis and IPython print the summary
        printer.text(repr(self))

    def __repr__(self) -> str:
        batch, heads, kv_heads, q_len, kv_len, dim, value_dim = self.shape
        shown = {name: (f"array{np.shape(value)}" if hasattr(value, "shape") else value)
                 for name, value in self.options.items()}
        return (f"Problem({self.dtype.name} {self.layout}, B={batch}, H={heads}, Hkv={kv_heads}, Sq={q_len}, "
                f"Sk={kv_len}, D={dim}, Dv={value_dim}, options={shown})")


def attention_problems(dtypes: Iterable[str] = ("float32",), options: Iterable[str] = (),
                       layouts: Iterable[str] = ("bhsd",), max_batch: int = 2, max_heads: int = 4,
                       max_seq: int = 16, head_dims: Iterable[int] = (8, 16, 32, 64), gqa: bool = True,
                       large_logits: bool = True) -> st.SearchStrategy[Problem]:
    """A hypothesis strategy of :class:`Problem`.

    Args:
        dtypes: the dtypes of q, k and v (drawn among them): "float16", "bfloat16"
            (needs ml_dtypes), "float32", "float64".
        options: the :func:`npattn.attention` keywords to draw values for (see
            :data:`OPTION_NAMES`); each is sometimes left out, so both paths are tested.
            ``sinks`` and ``q_offset`` come with a causal mask or window where drawn.
        layouts: "bhsd" and/or "bshd".
        max_batch, max_heads, max_seq: bounds of B, H and the sequence lengths (Sq and Sk
            are drawn apart, from 1).
        head_dims: the head dims D (Dv is D).
        gqa: draw H as a multiple of Hkv (grouped-query and multi-query attention); else
            H = Hkv.
        large_logits: also draw q and k whose scores pass 88, where float32's ``exp``
            overflows unless the row max is subtracted.
    """
    dtypes, options, layouts, head_dims = tuple(dtypes), tuple(options), tuple(layouts), tuple(head_dims)
    for name, values, allowed in (("dtypes", dtypes, _DTYPES), ("layouts", layouts, _LAYOUTS),
                                  ("options", options, OPTION_NAMES)):
        unknown = [value for value in values if value not in allowed]
        if unknown or not values and name != "options":
            raise ValueError(f"attention_problems: {name} must be a non-empty selection of {allowed}, "
                             f"got {values!r}")
    if "bfloat16" in dtypes:
        import ml_dtypes  # noqa: F401  (registers the NumPy dtype)
    for name, value in (("max_batch", max_batch), ("max_heads", max_heads), ("max_seq", max_seq)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"attention_problems: {name} must be an int >= 1, got {value!r}")
    if not head_dims or any(not isinstance(d, int) or d < 1 for d in head_dims):
        raise ValueError(f"attention_problems: head_dims must be ints >= 1, got {head_dims!r}")
    return _problems(dtypes, options, layouts, max_batch, max_heads, max_seq, head_dims, gqa, large_logits)


@st.composite
def _problems(draw, dtypes, options, layouts, max_batch, max_heads, max_seq, head_dims, gqa, large_logits):
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    layout = draw(st.sampled_from(layouts))
    batch = draw(st.integers(1, max_batch))
    kv_heads = draw(st.integers(1, max_heads))
    group = draw(st.sampled_from([g for g in range(1, max_heads // kv_heads + 1)])) if gqa else 1
    heads = kv_heads * group
    q_len, kv_len = draw(st.integers(1, max_seq)), draw(st.integers(1, max_seq))
    dim = draw(st.sampled_from(head_dims))
    # q and k of spread a give scores of spread ~a^2: up to ~100 at the widest
    spread = draw(st.sampled_from([1.0, 1.0, 3.0, 12.0] if large_logits else [1.0, 1.0, 3.0]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((batch, heads, q_len, dim)) * spread).astype(dtype)
    k = (rng.standard_normal((batch, kv_heads, kv_len, dim)) * spread).astype(dtype)
    v = rng.standard_normal((batch, kv_heads, kv_len, dim)).astype(dtype)
    drawn = _options(draw, options, rng, batch, heads, q_len, kv_len, dim)
    if layout == "bshd":
        q, k, v = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v))
    return Problem(q, k, v, layout, drawn)


def _options(draw, names, rng, batch, heads, q_len, kv_len, dim) -> dict[str, Any]:
    """Values for the options ``names`` (each present or not), valid for the shapes."""
    chosen: dict[str, Any] = {}
    present = {name: draw(st.booleans()) for name in names}
    if present.get("causal"):
        chosen["causal"] = True
    if present.get("window"):
        chosen["window"] = (draw(st.integers(0, q_len + kv_len)), draw(st.integers(0, q_len + kv_len)))
    if present.get("sinks"):
        chosen["sinks"] = draw(st.integers(0, 3))
        chosen.setdefault("window", (draw(st.integers(0, 4)), 0))
    if present.get("q_offset"):
        chosen["q_offset"] = draw(st.integers(-q_len, kv_len))
    if present.get("scale"):
        chosen["scale"] = draw(st.sampled_from([0.05, 0.3, 1.0, 1.7]))
    if present.get("softcap"):
        chosen["softcap"] = draw(st.sampled_from([1.0, 5.0, 30.0]))
    if present.get("alibi_slopes"):
        chosen["alibi_slopes"] = np.array([2.0 ** (-8 * (h + 1) / heads) for h in range(heads)])
    if present.get("bias"):
        chosen["bias"] = rng.standard_normal((batch, heads, q_len, kv_len))
    if present.get("mask"):
        chosen["mask"] = rng.random((batch, heads, q_len, kv_len)) < 0.7
    if present.get("kv_lengths"):
        chosen["kv_lengths"] = np.array([draw(st.integers(0, kv_len)) for _ in range(batch)])
    if present.get("q_lengths"):
        chosen["q_lengths"] = np.array([draw(st.integers(0, q_len)) for _ in range(batch)])
    if present.get("sink_logits"):
        chosen["sink_logits"] = rng.standard_normal(heads)
    if present.get("dropout_p"):
        chosen["dropout_p"] = draw(st.sampled_from([0.1, 0.5]))
        chosen["seed"] = draw(st.integers(0, 2**63 - 1))
    if present.get("return_lse"):
        chosen["return_lse"] = True
    return chosen
