"""Hypothesis strategies for attention problems: dimensions drawn once, then matching arrays.

Values come from a NumPy generator seeded by hypothesis (bounded and finite), while
shapes and options are drawn by hypothesis itself, so failures shrink to small
shapes and few options. Every option of the API can be switched on or off per test.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import ml_dtypes  # noqa: F401  (registers the NumPy dtype name "bfloat16")
import numpy as np
from hypothesis import strategies as st

import npattn

# Options that tie a key to its index; without them, keys may be permuted freely.
POSITIONAL_OPTIONS = ("causal", "q_offset", "window", "sinks", "alibi_slopes", "kv_lengths", "q_start", "kv_start",
                      "dropout")
VALUE_RANGE = 2.0
layouts = st.sampled_from(["bhsd", "bshd"])


@dataclass(frozen=True)
class Dims:
    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    value_dim: int

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def scores_shape(self):
        return (self.batch, self.heads, self.q_len, self.kv_len)


@dataclass(frozen=True)
class Case:
    """One attention call: q, k, v in bhsd order plus keyword options."""

    dims: Dims
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    options: dict = field(default_factory=dict)

    @property
    def dtype(self):
        return self.q.dtype

    def run(self, backend="reference", layout="bhsd", **overrides):
        """Call npattn.attention with this case in ``layout`` (bhsd arrays transposed as views)."""
        q, k, v = (to_layout(a, layout) for a in (self.q, self.k, self.v))
        return npattn.attention(q, k, v, **{**self.options, **overrides}, layout=layout, backend=backend)

    def vjp(self, backend="reference", layout="bhsd", **overrides):
        q, k, v = (to_layout(a, layout) for a in (self.q, self.k, self.v))
        return npattn.attention_vjp(q, k, v, **{**self.options, **overrides}, layout=layout,
                                    backend=backend)

    def with_options(self, **options):
        return replace(self, options={**self.options, **options})

    def without(self, *names):
        return replace(self, options={k: v for k, v in self.options.items() if k not in names})


def to_layout(array_bhsd, layout):
    return array_bhsd.transpose(0, 2, 1, 3) if layout == "bshd" else array_bhsd


@st.composite
def dims(draw, max_batch=2, max_kv_heads=2, max_group=3, min_len=1, max_len=9, max_dim=8):
    kv_heads = draw(st.integers(1, max_kv_heads))
    return Dims(batch=draw(st.integers(1, max_batch)),
                heads=kv_heads * draw(st.integers(1, max_group)),
                kv_heads=kv_heads,
                q_len=draw(st.integers(min_len, max_len)),
                kv_len=draw(st.integers(min_len, max_len)),
                head_dim=draw(st.integers(1, max_dim)),
                value_dim=draw(st.integers(1, max_dim)))


@st.composite
def cases(draw, options=None, dtypes=("float64",), dims_strategy=None):
    """A :class:`Case` whose options are a random subset of ``options`` (names of
    :data:`ALL_OPTIONS`; None: all of them)."""
    options = ALL_OPTIONS if options is None else options
    d = draw(dims_strategy if dims_strategy is not None else dims())
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    def uniform(*shape):
        return rng.uniform(-VALUE_RANGE, VALUE_RANGE, size=shape).astype(dtype)

    q = uniform(d.batch, d.heads, d.q_len, d.head_dim)
    k = uniform(d.batch, d.kv_heads, d.kv_len, d.head_dim)
    v = uniform(d.batch, d.kv_heads, d.kv_len, d.value_dim)
    chosen = {}
    for name in options:
        if draw(st.booleans()):
            chosen.update(_OPTION_DRAWERS[name](draw, rng, d, dtype))
    if chosen.get("causal") == "top_left" and "q_offset" in chosen:  # both place the rows: one must go
        chosen["causal"] = True
    return Case(d, q, k, v, chosen)


def broadcast_shape(draw, full_shape):
    """A shape that broadcasts to ``full_shape``: some axes 1, maybe fewer leading axes."""
    rank = draw(st.integers(2, 4))
    shape = tuple(size if draw(st.booleans()) else 1 for size in full_shape)
    return shape[4 - rank:] if all(s == 1 for s in shape[:4 - rank]) else shape


def _draw_window(draw, rng, d, dtype):
    bound = st.integers(0, max(d.q_len, d.kv_len))
    return {"window": draw(st.one_of(bound, st.tuples(st.none() | bound, st.none() | bound)))}


def _draw_mask(draw, rng, d, dtype):
    mask = rng.random(broadcast_shape(draw, d.scores_shape)) < draw(st.sampled_from([0.3, 0.7, 1.0]))
    if mask.shape[-2] > 1 and draw(st.booleans()):
        mask[..., rng.integers(mask.shape[-2]), :] = False  # a fully masked row
    return {"mask": mask}


def _draw_bias(draw, rng, d, dtype):
    bias_dtype = np.dtype(draw(st.sampled_from(sorted({dtype.name, "float64"}))))
    bias = rng.normal(0.0, 1.0, broadcast_shape(draw, d.scores_shape)).astype(bias_dtype)
    if draw(st.booleans()):
        bias[rng.random(bias.shape) < 0.2] = -np.inf  # an additive float mask
    return {"bias": bias}


def _draw_alibi(draw, rng, d, dtype):
    shape = draw(st.sampled_from([(d.heads,), (d.batch, d.heads)]))
    return {"alibi_slopes": rng.uniform(0.0, 1.0, shape)}


def _draw_lengths(name, size_attr):
    def draw_lengths(draw, rng, d, dtype):
        return {name: rng.integers(0, getattr(d, size_attr) + 1, size=d.batch)}
    return draw_lengths


# offsets near 2**32 make the indices wrap, as the hash's 32-bit words do
_dropout_offsets = st.one_of(st.just((0, 0, 0, 0)),
                             st.tuples(*[st.sampled_from([0, 1, 5, 2**31, 2**32 - 3])] * 4))

_OPTION_DRAWERS = {
    "causal": lambda draw, rng, d, dtype: {"causal": draw(st.sampled_from([True, "bottom_right", "top_left"]))},
    "q_offset": lambda draw, rng, d, dtype: {"q_offset": draw(
        st.integers(-d.q_len - 2, d.kv_len + 2)
        | st.lists(st.integers(-d.q_len - 2, d.kv_len + 2), min_size=d.batch, max_size=d.batch).map(np.array))},
    "window": _draw_window,
    "sinks": lambda draw, rng, d, dtype: {"sinks": draw(st.integers(0, 3))},
    "sink_logits": lambda draw, rng, d, dtype: {"sink_logits": rng.normal(0.0, 2.0, d.heads)},
    "mask": _draw_mask,
    "bias": _draw_bias,
    "alibi_slopes": _draw_alibi,
    "q_lengths": _draw_lengths("q_lengths", "q_len"),
    "kv_lengths": _draw_lengths("kv_lengths", "kv_len"),
    "q_start": _draw_lengths("q_start", "q_len"),
    "kv_start": _draw_lengths("kv_start", "kv_len"),
    "scale": lambda draw, rng, d, dtype: {"scale": float(rng.uniform(0.05, 1.0))},
    "softcap": lambda draw, rng, d, dtype: {"softcap": float(rng.uniform(0.5, 5.0))},
    "dropout": lambda draw, rng, d, dtype: {"dropout_p": draw(st.sampled_from([0.1, 0.5, 0.8])),
                                             "seed": draw(st.integers(-2**70, 2**70)),
                                             "dropout_offset": draw(_dropout_offsets)},
}
# every option a case may draw (dropout draws dropout_p and seed together): a drawer added
# above is drawn by every property test that does not exclude it
ALL_OPTIONS = tuple(_OPTION_DRAWERS)


# One decisive example per option that changes what is computed, as (baseline options,
# the option's change) for q (B, H, Sq, D) and k, v (B, Hkv, Sk, D) of EXAMPLE_DIMS:
# tests/test_options.py checks that the change moves every backend's output and
# gradients, and fails when an option of the table has no entry here.
EXAMPLE_DIMS = B, H, HKV, SQ, SK, D = 2, 2, 1, 5, 7, 4
_RNG = np.random.default_rng(3)
DECISIVE_EXAMPLES = {
    "causal": ({}, {"causal": True}),
    "q_offset": ({"causal": True}, {"causal": True, "q_offset": 0}),
    "window": ({}, {"window": 1}),
    "sinks": ({"window": 1}, {"sinks": 2}),
    "sink_logits": ({}, {"sink_logits": np.array([1.0, -0.5])}),
    "mask": ({}, {"mask": np.c_[np.ones((SQ, 1), bool), _RNG.random((SQ, SK - 1)) < 0.5]}),
    "bias": ({}, {"bias": _RNG.normal(size=(B, H, SQ, SK))}),
    "alibi_slopes": ({}, {"alibi_slopes": np.array([0.5, 0.25])}),
    "q_lengths": ({}, {"q_lengths": np.array([3, SQ])}),
    "kv_lengths": ({}, {"kv_lengths": np.array([4, SK])}),
    "q_start": ({}, {"q_start": np.array([2, 0])}),
    "kv_start": ({}, {"kv_start": np.array([3, 1])}),
    "scale": ({}, {"scale": 0.3}),
    "softcap": ({}, {"softcap": 0.5}),
    "dropout_p": ({}, {"dropout_p": 0.3, "seed": 1}),
    "seed": ({"dropout_p": 0.3, "seed": 1}, {"seed": 2}),
    "dropout_offset": ({"dropout_p": 0.3, "seed": 1}, {"dropout_offset": (0, 1, 2, 3)}),
}


@st.composite
def packed_batches(draw):
    """(lengths_q, lengths_k, H, Hkv, D, Dv, options) for a packed batch of 1-4 sequences."""
    sequences = draw(st.integers(1, 4))
    lengths_q = draw(st.lists(st.integers(0, 9), min_size=sequences, max_size=sequences))
    lengths_k = draw(st.lists(st.integers(0, 9), min_size=sequences, max_size=sequences))
    kv_heads = draw(st.integers(1, 2))
    heads = kv_heads * draw(st.integers(1, 2))
    options = {}
    if draw(st.booleans()):
        options["causal"] = draw(st.sampled_from([True, "top_left"]))
    if draw(st.booleans()):
        options["window"] = draw(st.integers(0, 4))
        options["sinks"] = draw(st.integers(0, 2))
    if draw(st.booleans()):
        options["alibi_slopes"] = draw(st.sampled_from([(heads,), (sequences, heads)]))
    if draw(st.booleans()):
        options["softcap"] = 2.0
    if draw(st.booleans()):
        options["sink_logits"] = (heads,)
    if draw(st.booleans()):
        options.update(dropout_p=0.3, seed=draw(st.integers(0, 2**40)))
    return lengths_q, lengths_k, heads, kv_heads, draw(st.integers(1, 8)), draw(st.integers(1, 8)), options
