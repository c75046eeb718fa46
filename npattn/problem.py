"""The validated, normalized description of one attention call that every backend consumes.

:func:`npattn.validation.build_problem` turns user arguments into an
:class:`AttentionProblem`; backends never look at raw keywords. Arrays keep the
user's dtype and memory: ``q``, ``k`` and ``v`` are bhsd-ordered *views* (a
bshd input is transposed, never copied), ``mask`` and ``bias`` are 4-D views
that broadcast to (B, H, Sq, Sk) without being expanded.
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .dropout import keep_threshold
from .masks import Visibility


def accumulate_dtype_of(dtype) -> np.dtype:
    """The dtype the kernels compute in for inputs of ``dtype``: float64 stays float64;
    float32, float16 and bfloat16 compute in float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


@dataclass(frozen=True)
class AttentionProblem:
    """Shapes, in bhsd order: q (B, H, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv).

    Optional arrays: ``mask`` bool and ``bias`` float, both 4-D and broadcastable to
    (B, H, Sq, Sk); ``sink_logits`` (H,); ``alibi_slopes`` (B, H) (a broadcast view
    of a (H,) input); ``q_lengths`` / ``kv_lengths`` int64 (B,).
    """

    xp: Any
    q: Any
    k: Any
    v: Any
    layout: str
    scale: float
    visibility: Visibility
    sink_logits: Any = None
    mask: Any = None
    bias: Any = None
    bias_shape: tuple | None = None
    alibi_slopes: Any = None
    q_lengths: Any = None
    kv_lengths: Any = None
    softcap: float | None = None
    dropout_p: float = 0.0
    seed: int = 0
    dropout_offset: tuple = (0, 0, 0, 0)
    return_lse: bool = False
    return_weights: bool = False

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def heads(self) -> int:
        return self.q.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def group_size(self) -> int:
        """Query heads per key/value head: query head h reads kv head h // group_size."""
        return self.heads // self.kv_heads

    @property
    def q_len(self) -> int:
        return self.q.shape[2]

    @property
    def kv_len(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.q.shape[3]

    @property
    def value_dim(self) -> int:
        return self.v.shape[3]

    @property
    def dtype(self):
        return self.q.dtype

    @property
    def accumulate_dtype(self):
        """float64 for float64 inputs, float32 for float32/float16/bfloat16."""
        return accumulate_dtype_of(self.q.dtype)

    @property
    def dropout_threshold(self) -> int:
        """The integer keep threshold of :mod:`npattn.dropout`."""
        return keep_threshold(self.dropout_p)


# The fields that hold arrays (or None) and those that hold plain values (every other
# field but the module ``xp``): everything a backend derives from a problem, its data
# aside, is a function of the arrays' shapes, strides and dtypes and of the values
# (:func:`signature`). tests/test_cpu_kernels.py keeps ARRAY_FIELDS complete.
ARRAY_FIELDS = ("q", "k", "v", "sink_logits", "mask", "bias", "alibi_slopes", "q_lengths", "kv_lengths")
VALUE_FIELDS = tuple(field.name for field in dataclasses.fields(AttentionProblem)
                     if field.name not in ("xp", *ARRAY_FIELDS))
_arrays_of = operator.attrgetter(*ARRAY_FIELDS)
_values_of = operator.attrgetter(*VALUE_FIELDS)


def signature(problem, seed: bool = True) -> tuple:
    """A hashable key equal for two problems exactly when they differ in array contents
    only (and, with ``seed=False``, in their dropout seed): each array's (shape, strides,
    dtype) or None, then every value field."""
    values = _values_of(problem)
    if not seed:
        values = values[:_SEED] + (0,) + values[_SEED + 1:]
    return (tuple(None if a is None else (a.shape, a.strides, a.dtype) for a in _arrays_of(problem)), values)


_SEED = VALUE_FIELDS.index("seed")


def to_user_layout(array_bhsd, layout: str):
    """The inverse of the bhsd view taken on input: a (B, H, S, X) array as the user's layout."""
    return array_bhsd.transpose(0, 2, 1, 3) if layout == "bshd" else array_bhsd
