"""The validated, normalized description of one attention call that every backend consumes.

:func:`npattn.core.validation.build_problem` turns user arguments into an
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
from .quantization import code_values


def accumulate_dtype_of(dtype) -> np.dtype:
    """The dtype the kernels compute in for inputs of ``dtype``: float64 stays float64;
    float32, float16 and bfloat16 compute in float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


@dataclass(frozen=True)
class AttentionProblem:
    """Shapes, in bhsd order: q (B, H, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv).

    With ``block_table`` int64 (B, P), k and v are pools of pages: (pages, Hkv, page_size,
    D/Dv) bhsd views, and Sk = P * page_size (entry b's key j: row j % page_size of page
    block_table[b, j // page_size]).

    Optional arrays: ``mask`` bool and ``bias`` float, both 4-D and broadcastable to
    (B, H, Sq, Sk); ``sink_logits`` (H,); ``alibi_slopes`` (B, H) (a broadcast view
    of a (H,) input); ``q_lengths`` / ``kv_lengths`` / ``q_start`` / ``kv_start`` int64
    (B,). Batch entry b's live rows are ``[q_start[b], q_lengths[b])``, its live keys
    ``[kv_start[b], kv_lengths[b])`` (0 and Sq / Sk where None).

    ``k_scale`` / ``v_scale``: None, or float32 (B, Hkv, Sk) (paged: (pages, Hkv,
    page_size)) bhs views with k / v int8 codes: key j of kv head h reads as
    ``k[b, h, j] * k_scale[b, h, j]`` (:mod:`npattn.core.quantization`).

    ``row_shifts``: None when query row i of every batch entry sits at key position
    ``i + visibility.shift(Sq, Sk)``; else int64 (B,) NumPy, row i of entry b at
    ``i + row_shifts[b]`` (a per-entry ``q_offset``, or one counted from the first real
    row and key; see :func:`npattn.core.masks.row_shifts`).
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
    q_start: Any = None
    kv_start: Any = None
    row_shifts: Any = None
    block_table: Any = None
    k_scale: Any = None
    v_scale: Any = None
    softcap: float | None = None
    dropout_p: float = 0.0
    seed: int = 0
    dropout_offset: tuple = (0, 0, 0, 0)
    return_lse: bool = False
    return_weights: bool = False
    # every entry's rows in one memory batch (set by attention_varlen, never by an option):
    # q, k, v are views whose batch axis has stride 0, the entries' live rows (spans) are
    # disjoint, and out, lse and the gradients come back with one batch entry
    packed_rows: bool = False

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
        """Sk: k's keys, or with ``block_table`` the pages per entry times the page size."""
        return self.k.shape[2] if self.block_table is None else self.block_table.shape[1] * self.k.shape[2]

    @property
    def page_size(self) -> int:
        """Keys per page of a paged k and v (``block_table``); 0 when not paged."""
        return 0 if self.block_table is None else self.k.shape[2]

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
    def quantized(self) -> bool:
        """Whether k and v are int8 codes with scales (a quantized kv cache)."""
        return self.k_scale is not None

    @property
    def accumulate_dtype(self):
        """float64 for float64 inputs, float32 for float32/float16/bfloat16."""
        return accumulate_dtype_of(self.q.dtype)

    @property
    def dropout_threshold(self) -> int:
        """The integer keep threshold of :mod:`npattn.core.dropout`."""
        return keep_threshold(self.dropout_p)


# The fields that hold arrays (or None) and those that hold plain values (every other
# field but the module ``xp``): everything a backend derives from a problem, its data
# aside, is a function of the arrays' shapes, strides and dtypes and of the values
# (:func:`signature`). tests/test_cpu_kernels.py keeps ARRAY_FIELDS complete.
ARRAY_FIELDS = ("q", "k", "v", "sink_logits", "mask", "bias", "alibi_slopes", "q_lengths", "kv_lengths",
                "q_start", "kv_start", "row_shifts", "block_table", "k_scale", "v_scale")
VALUE_FIELDS = tuple(field.name for field in dataclasses.fields(AttentionProblem)
                     if field.name not in ("xp", *ARRAY_FIELDS))
_arrays_of = operator.attrgetter(*ARRAY_FIELDS)
_values_of = operator.attrgetter(*VALUE_FIELDS)
_ARRAY_FIELD_NAMES = frozenset(ARRAY_FIELDS)


def with_arrays(problem: AttentionProblem, **arrays: Any) -> AttentionProblem:
    """``dataclasses.replace(problem, **arrays)`` for array fields only: the problem of
    the same call with other data (a plan's run, a stand-in). A copy of the instance's
    fields: 1 us, where ``replace`` runs the frozen dataclass's ``__init__``, field by
    field through ``object.__setattr__``, in 6-7 (a small decode step's kernel costs 10)."""
    unknown = arrays.keys() - _ARRAY_FIELD_NAMES
    if unknown:
        raise TypeError(f"with_arrays replaces array fields only, got {sorted(unknown)}")
    copy = object.__new__(type(problem))
    copy.__dict__.update(problem.__dict__)
    copy.__dict__.update(arrays)
    return copy


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


def dense_keys(xp, problem):
    """``(k, v)`` of ``problem`` as (B, Hkv, Sk, D/Dv) arrays: views, or with
    ``block_table`` each entry's pages gathered in order (a copy); quantized k and v
    (``k_scale``) dequantized in float64."""
    k, v = problem.k, problem.v
    if problem.quantized:  # codes times their scales, in float64 (the oracle's exact reading)
        k = code_values(k) * problem.k_scale.astype(np.float64)[..., None]
        v = code_values(v) * problem.v_scale.astype(np.float64)[..., None]
    if problem.block_table is None:
        return k, v

    def gather(pool):  # (pages, Hkv, page_size, X) -> (B, Hkv, P * page_size, X)
        pages = pool[problem.block_table]  # (B, P, Hkv, page_size, X)
        batch, count, heads, size, width = pages.shape
        return pages.transpose(0, 2, 1, 3, 4).reshape(batch, heads, count * size, width)
    return gather(k), gather(v)
