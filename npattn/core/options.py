"""Every keyword option of :func:`npattn.attention`, once: the table the rest is built from.

An :class:`Option` entry gives an option's name, default, kind, one line of
documentation, its check (a function of the user's value and the :class:`Call` being
checked, returning the normalized value or raising an error that names the option),
which :class:`~npattn.core.problem.AttentionProblem` field it fills, and, for options the
kernels switch on, when it is present in a problem, its ``HAS_*`` flag in the kernels'
integer parameters and its bit in the GPU kernels' option sets.

Built from the table: the public signatures and their argument docs
(:func:`signature`, :func:`argument_docs`; used by ``attention`` and
``attention_vjp``), the validation loop (:func:`npattn.core.validation.build_problem`),
the kernels' option flags (:func:`npattn.core.kernel_params.problem_parameters`) and the GPU
option sets (:func:`npattn.gpu.options.options_of`). The maths of each option stays
hand-written once per backend; ``tests/test_options.py`` fails when an option of the
table changes nothing in some backend's output or gradients, or is missing from the
test strategies.

The kernels' parameter positions (:class:`npattn.core.kernel_params.Int` and ``Real``) and
the GPU's option bits are numbered from it too, and the calls built on attention read
their facts about single options from it: which options have gradients and in what order
(the adapters, the vjps), which the serving calls set themselves or refuse
(:func:`set_by`, :func:`refused_by`), which are per batch entry or per head, and how ring
attention shards each (:func:`sharded`); ``tests/test_options.py`` holds the calls to them.

Adding an option: an entry here, its field in ``problem.py``, its maths in
``reference.py``, the CPU score step (``cpu/tiles.py``) and gradient step
(``cpu/backward_kernel.py``), the GPU's ``finish_score``/``score_gradient``
(``gpu/common.cuh``), and a drawer and decisive example in ``tests/strategies.py``.

Imports nothing from npattn but :mod:`.checks`, :mod:`._arrays` and :mod:`.masks`.
"""
from __future__ import annotations

import difflib
import inspect
import math
from numbers import Real
import textwrap
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from . import checks
from . import arrays as _arrays
from .masks import Visibility


@dataclass(frozen=True)
class Call:
    """What an option's check may need of the call being checked: q as a bhsd view (the
    array kind every array option must match), the sizes, the compute dtype, and the
    options checked before it (table order), normalized, by name."""

    q: Any
    batch: int
    heads: int
    q_len: int
    kv_len: int
    head_dim: int
    compute: np.dtype
    checked: dict
    pages: int = 0  # with block_table: the pools' page count (k's first axis)

    @property
    def reach(self) -> int:
        """Sq + Sk, plus the largest ``|q_offset|`` and, with q_start or kv_start, Sq + Sk
        again: more than any query-key distance, so a window past it bounds nothing.
        Clamping to it keeps the kernels' int64 (and the GPU's int32) positions from
        overflowing."""
        offset = self.checked.get("q_offset")
        if offset is None:
            return self.q_len + self.kv_len
        largest = int(np.abs(_arrays.to_numpy(offset)).max(initial=0))
        # counted from the first real row and key, a row's position moves by up to Sq + Sk more
        starts = self.checked.get("q_start") is not None or self.checked.get("kv_start") is not None
        return (2 if starts else 1) * (self.q_len + self.kv_len) + largest

    @property
    def scores_shape(self) -> tuple:
        return (self.batch, self.heads, self.q_len, self.kv_len)


@dataclass(frozen=True)
class Option:
    """One keyword of ``attention``. ``kind``: "visibility" (which keys a row sees),
    "score" (changes a visible score), "softmax" (changes the normalization), "randomness",
    "output" (what is returned), "layout" or "checking" (checks of the inputs only).
    ``field``: the AttentionProblem field the normalized value fills (None: composed by
    build_problem, as ``visibility`` is from causal, window and sinks). ``present``: when a problem uses it (None: always or
    never matters to the kernels); ``flag``: its ``HAS_*`` position name in
    :class:`npattn.core.kernel_params.Int`; ``real``: its slot name in
    :class:`npattn.core.kernel_params.Real` and the slot's value for a problem;
    ``gpu_option``: its bit name in :class:`npattn.gpu.options.Option` (options may
    share one); ``per_score``: the GPU's ``finish_score`` reads it at every score, so a
    tile inside the visible band may skip that step only when no such option is
    compiled in; ``saves_score``: its CPU score step keeps a value per score for its
    gradient step (softcap: the tanh), in a scratch tile allocated only then
    (``Int.SAVES_SCORES``); ``repeatable``: for which plain values the check and the
    backends read nothing but the value and the call's structure, so that a repeated call
    may skip them (:mod:`npattn.runtime.plans`; None: every plain value); ``keyed``: a
    NumPy array value a repeated call may be keyed by (its bytes, :func:`npattn.runtime.plans.call_key`):
    small, value-checked, copied by a plan (:func:`npattn.api.owned`) and with no
    gradient."""

    name: str
    default: Any
    kind: str
    doc: str
    check: Callable[[Any, Call], Any]
    field: str | None = None
    present: Callable | None = None
    flag: str | None = None
    real: tuple[str, Callable[[Any], float]] | None = None
    gpu_option: str | None = None
    per_score: bool = False
    saves_score: bool = False
    repeatable: Callable[[Any], bool] | None = None
    keyed: bool = False
    gradient: int | None = None
    per_entry: bool = False
    per_head: bool = False
    set_by: tuple[str, ...] = ()
    refused_by: tuple[tuple[str, str], ...] = ()
    sharding: str = "plain"
    folds: Callable[[Any], bool] | None = None


# Facts about single options that the calls built on attention read (the serving calls,
# the adapters, the distributed strategies), kept in the table with the option:
# - gradient: gradients flow to it: its place among those returned after dq, dk and dv;
# - per_entry: given as an array, its first axis may be the batch entries (one per
#   sequence of a packed batch, picked for each sequence's own call);
# - per_head: its last axis is the query heads (split with them by strategy="heads");
# - set_by: the calls that set it from their own arguments (their callers may not);
# - refused_by: (call, why) for the calls that cannot take it;
# - sharding: across the ranks of ring attention, "plain" (a value every rank passes alike),
#   "shared" (an array every rank passes alike) or "rows" (each rank passes its own query
#   rows of the whole problem's array);
# - folds: whether, as a problem uses it, the option lets the CPU fold a GQA group's query
#   heads into the rows of one kv head (a folded tile mixes the group's heads, and row r
#   sits at position r // group): None where it never stops the fold; an option that reads
#   a row's own head or row index per score (a mask, a bias, dropout's hash), or bounds a
#   row's keys on the left past one query row, stops it. A per-head value that enters each
#   row once (ALiBi slopes, sink logits) does not: the kernels read a folded row's head.
KVCACHE = "attention_with_kvcache"
VARLEN = "attention_varlen"
RING = "ring attention"
HEADS = "strategy='heads'"
_PACKED = "packed sequences replace a padded batch"
_WHOLE_ROWS = "a rank would need whole S x S rows of its heads; strategy='ring' takes it"
_LEFT_PADDING_RING = "left padding moves each entry's rows and keys; shard the real tokens instead"


def _has(field):
    return lambda problem: getattr(problem, field) is not None


def _lacks(field):
    return lambda problem: getattr(problem, field) is None


def _window_set(problem):
    return problem.visibility.window_left is not None or problem.visibility.window_right is not None


def _row_bounds(name: str, axis: str, doc: str, **entries) -> Option:
    """An int (B,) option of query rows (``axis`` "q", each in [0, Sq]) or keys ("kv", in
    [0, Sk]) per batch entry, filling the problem field of its name: the lengths and starts."""
    size, size_name = ("q_len", "Sq") if axis == "q" else ("kv_len", "Sk")
    return Option(name, None, "visibility", doc,
                  lambda value, call: checks.check_lengths(name, value, call.q, call.batch, getattr(call, size),
                                                           size_name),
                  field=name, keyed=True, **{"present": _has(name), **entries})


OPTIONS: tuple[Option, ...] = (
    Option("causal", False, "visibility",
           'bool, "bottom_right" or "top_left": row i sees keys j <= p_i. True and "bottom_right" '
           'put the last row level with the last key (FlashAttention); "top_left" puts the first '
           "row level with the first key (torch and JAX is_causal; the same as q_offset=0).",
           lambda value, call: _check_causal(value),
           present=lambda problem: problem.visibility.causal, flag="CAUSAL", gpu_option="BAND"),
    Option("q_offset", None, "visibility",
           "None, int or int (B,): query row i sits at key position p_i = i + q_offset (an array: "
           "per batch entry; None: Sk - Sq, bottom-right; 0: top left). With q_start / kv_start "
           "it counts from each entry's first real row and key.",
           lambda value, call: _check_q_offset(value, call), per_entry=True, keyed=True, set_by=(KVCACHE,),
           refused_by=((RING, "one int places the whole sequence; an array (one per batch entry) is not split"),)),
    _row_bounds("q_start", "q",
                "int (B,): rows before q_start[b] are left padding and output zeros; positions count "
                "from the first real row.", gpu_option="BAND", set_by=(KVCACHE, VARLEN),
                refused_by=((RING, _LEFT_PADDING_RING),)),
    _row_bounds("kv_start", "kv",
                "int (B,): keys before kv_start[b] are left padding and never seen; the sinks are the "
                "first real keys.", gpu_option="BAND", set_by=(KVCACHE, VARLEN),
                refused_by=((RING, _LEFT_PADDING_RING),)),
    Option("window", None, "visibility",
           "None, int w (-> (w, w), or (w, 0) when causal) or (left, right) with None for an "
           "unbounded side; bounds past Sq + Sk mean none.",
           lambda value, call: _check_window(value, call.reach),
           present=_window_set, gpu_option="BAND",
           folds=lambda problem: problem.visibility.window_left is None or problem.q_len == 1),
    Option("sinks", 0, "visibility",
           "int: the first keys stay visible despite the window (past Sk: all of them).",
           lambda value, call: min(checks.check_count("sinks", value), call.kv_len),
           folds=lambda problem: problem.q_len == 1 or problem.visibility.sinks == 0),
    Option("sink_logits", None, "softmax",
           "(H,) float, finite: a value-less logit per head in every row's softmax.",
           lambda value, call: checks.check_finite_values(
               "sink_logits", checks.check_vector("sink_logits", value, call.q, (call.heads,), "(H,)"),
               call.compute),
           field="sink_logits", present=_has("sink_logits"), flag="HAS_SINK", gpu_option="SINK",
           gradient=1, per_head=True, sharding="shared"),
    Option("mask", None, "visibility",
           "bool, broadcastable to (B, H, Sq, Sk); True = may attend.",
           lambda value, call: checks.check_broadcastable("mask", value, call.q, call.scores_shape,
                                                          want_bool=True),
           field="mask", present=_has("mask"), flag="HAS_MASK", gpu_option="MASK", per_score=True,
           refused_by=((VARLEN, _PACKED), (HEADS, _WHOLE_ROWS)), sharding="rows", folds=_lacks("mask")),
    Option("bias", None, "score",
           "float, broadcastable to (B, H, Sq, Sk), added to the scores (-inf hides a key).",
           lambda value, call: checks.check_broadcastable("bias", value, call.q, call.scores_shape,
                                                          want_bool=False),
           field="bias", present=_has("bias"), flag="HAS_BIAS", gpu_option="BIAS", per_score=True,
           gradient=0, refused_by=((VARLEN, _PACKED), (HEADS, _WHOLE_ROWS)), sharding="rows",
           folds=_lacks("bias")),
    Option("alibi_slopes", None, "score",
           "(H,) or (B, H) float: -slope * abs(p_i - j) added to the scores; finite even "
           "times Sq + Sk in the compute dtype.",
           lambda value, call: _check_alibi(value, call.q, call.batch, call.heads, call.reach,
                                                  call.compute),
           field="alibi_slopes", present=_has("alibi_slopes"), flag="HAS_ALIBI", gpu_option="ALIBI",
           per_score=True, per_entry=True, per_head=True, keyed=True),
    _row_bounds("q_lengths", "q", "int (B,): rows past q_lengths[b] are padding and output zeros.",
                present=None, set_by=(KVCACHE, VARLEN), sharding="shared"),
    _row_bounds("kv_lengths", "kv", "int (B,): keys past kv_lengths[b] are padding and never seen.",
                gpu_option="BAND", set_by=(KVCACHE, VARLEN), sharding="shared"),
    Option("scale", None, "score",
           "float, finite in the compute dtype (float32, or float64 for float64 inputs); "
           "None: 1/sqrt(D).",
           lambda value, call: _check_scale(value, call.head_dim, call.compute),
           field="scale", real=("SCALE", lambda problem: problem.scale)),
    Option("softcap", None, "score",
           "None or 0 for none, else positive and a normal number of the compute dtype: "
           "s -> softcap * tanh(s / softcap).",
           lambda value, call: _check_softcap(value, call.compute),
           field="softcap", present=_has("softcap"), flag="HAS_SOFTCAP", gpu_option="SOFTCAP",
           per_score=True, saves_score=True,
           real=("SOFTCAP", lambda problem: problem.softcap or 0.0)),  # 0 = off
    Option("dropout_p", 0.0, "randomness",
           "float in [0, 1): the probability of dropping each weight (inverted scaling).",
           lambda value, call: _check_dropout_p(value),
           field="dropout_p", present=lambda problem: problem.dropout_p > 0, flag="HAS_DROPOUT",
           gpu_option="DROPOUT", real=("KEEP_SCALE", lambda problem: 1.0 / (1.0 - problem.dropout_p)),
           repeatable=lambda value: not value,  # on: a fresh seed per call
           folds=lambda problem: problem.dropout_p == 0),  # the mask hashes each row's head and index
    Option("seed", None, "randomness",
           "int, or None for a fresh random seed (remembered by attention_vjp).",
           lambda value, call: _check_seed(value, call.checked["dropout_p"]),
           field="seed"),
    Option("dropout_offset", (0, 0, 0, 0), "randomness",
           "(b, h, i, j) ints >= 0: added to the batch, head, row and key indices the dropout "
           "mask hashes, so a block of a larger problem draws that problem's mask.",
           lambda value, call: _check_dropout_offset(value),
           field="dropout_offset"),
    Option("block_table", None, "layout",
           "int (B, P): k and v are pools of pages, (pages, page_size, Hkv, D) in layout "
           '"bshd", and batch entry b\'s key j is row j % page_size of page '
           "block_table[b, j // page_size] (Sk = P * page_size). Forward only.",
           lambda value, call: _check_block_table(value, call),
           field="block_table", present=_has("block_table"), gpu_option="PAGED", keyed=True,
           set_by=(KVCACHE, VARLEN),
           refused_by=((RING, "each rank holds its shard's keys as an array, not pages"),)),
    Option("layout", "bhsd", "layout",
           '"bhsd" (B, H, S, D) or "bshd" (B, S, H, D), for q, k, v and out.',
           lambda value, call: checks.check_layout(value),
           field="layout", set_by=(KVCACHE, VARLEN)),
    Option("return_lse", False, "output",
           "bool: also return lse (B, H, Sq).",
           lambda value, call: checks.check_bool("return_lse", value),
           field="return_lse"),
    Option("return_weights", False, "output",
           "bool: also return the weights (B, H, Sq, Sk).",
           lambda value, call: checks.check_bool("return_weights", value),
           field="return_weights",  # (on, a structure whose weights the free memory must hold is not planned)
           refused_by=((VARLEN, "its weights would be (total, total) per head; call attention on a sequence for "
                                "its own"), (RING, "they are S_local x S per rank"))),
    Option("check_finite", False, "checking",
           "bool: raise ValueError naming the first NaN or inf in q, k, v or bias (one pass over "
           "each); off, non-finite values propagate as documented.",
           lambda value, call: checks.check_bool("check_finite", value),
           repeatable=lambda value: not value),  # on: reads every input value
)
# The score pipeline, in the order every backend applies it (the docs of ``attention``).
SCORE_STEPS = (
    "``s = scale * q.k`` (scale defaults to 1/sqrt(D))",
    "softcap ``s -> softcap * tanh(s / softcap)``",
    "``+ bias - alibi_slopes[b, h] * abs(p_i - j)``",
)
BY_NAME = {option.name: option for option in OPTIONS}
NAMES = tuple(BY_NAME)
# the options with gradients, in the order the vjps return theirs (after dq, dk, dv)
DIFFERENTIABLE = tuple(option.name for option in sorted((o for o in OPTIONS if o.gradient is not None),
                                                        key=lambda o: o.gradient))


# the options that may stop a GQA fold (see Option.folds), each as its condition
FOLD_CONDITIONS = tuple(option.folds for option in OPTIONS if option.folds is not None)


def set_by(call: str) -> tuple[str, ...]:
    """The options ``call`` sets from its own arguments, in table order."""
    return tuple(option.name for option in OPTIONS if call in option.set_by)


def refused_by(call: str) -> dict[str, str]:
    """``{option: why}`` for the options ``call`` cannot take, in table order."""
    return {option.name: why for option in OPTIONS for who, why in option.refused_by if who == call}


def sharded(kind: str) -> tuple[str, ...]:
    """The options of ring attention's ``kind`` of sharding ("plain", "shared", "rows")."""
    return tuple(option.name for option in OPTIONS if option.sharding == kind)

BACKEND_DOC = ('"auto" (cpu for NumPy, gpu for CuPy, else reference), "reference", "cpu" or "gpu".')


def visibility(checked: dict) -> Visibility:
    """The :class:`~npattn.core.masks.Visibility` of the normalized causal, q_offset, window and
    sinks (a per-entry q_offset is the problem's ``row_shifts``, not part of it)."""
    offset = checked["q_offset"]
    return Visibility.from_options(bool(checked["causal"]), checked["window"], checked["sinks"],
                                   offset if offset is None or isinstance(offset, int) else None)


# Keywords of other libraries (FlashAttention, torch SDPA and nn.MultiheadAttention,
# FlashInfer, xFormers) that a ported call brings along: the error names npattn's
# equivalent and its convention, where a spelling match would mislead (softmax_scale is
# not softcap; a float attn_mask is a bias, not a mask).
FOREIGN_NAMES = {
    "softmax_scale": "scale= (the same: it multiplies q.k; None means 1/sqrt(D))",
    "sm_scale": "scale= (the same: it multiplies q.k; None means 1/sqrt(D))",
    "window_size": "window=(left, right), with None for an unbounded side where FlashAttention writes -1",
    "attn_mask": "mask= for a boolean mask (True = may attend, as torch SDPA's attn_mask) or bias= for an "
                 "additive float mask (-inf hides a key)",
    "attn_bias": "bias= (an additive float mask, broadcastable to (B, H, Sq, Sk))",
    "key_padding_mask": "kv_lengths= (trailing padding) or kv_start= (left padding) per batch entry, or a "
                        "boolean mask= with True = may attend (nn.MultiheadAttention's True means masked out)",
    "is_causal": 'causal="top_left" (torch SDPA\'s is_causal puts row 0 level with key 0; npattn\'s causal=True '
                 "is bottom-right, as FlashAttention's)",
    "return_softmax_lse": "return_lse=True (lse (B, H, Sq))",
    "return_attn_probs": "return_weights=True (the weights after masking, before dropout) and return_lse=True",
    "need_weights": "return_weights=True (the weights after masking, before dropout)",
    "dropout": "dropout_p= (with seed= for a reproducible mask)",
    "p": "dropout_p= (with seed= for a reproducible mask)",
    "cache_leftpad": "kv_start= (per batch entry: the keys before it are left padding)",
    "seqused_k": "kv_lengths= (the keys each batch entry uses)",
    "seqused_q": "q_lengths= (the query rows each batch entry uses)",
    "logits_soft_cap": "softcap= (the same: s -> softcap * tanh(s / softcap))",
    "deterministic": "nothing: npattn's backward is always deterministic (drop the argument)",
    "enable_gqa": "nothing: k and v with fewer heads than q are grouped-query attention already (drop the argument)",
    "num_splits": "nothing: npattn chooses its own key splits (drop the argument)",
}


def check_names(options: dict) -> None:
    """Reject a keyword that is not an option, naming it and, for another library's
    keyword, npattn's equivalent (else the option it resembles)."""
    for name in options:
        if name not in BY_NAME:
            if name in FOREIGN_NAMES:
                raise TypeError(f"unknown option {name!r}: npattn's equivalent is {FOREIGN_NAMES[name]}")
            close = difflib.get_close_matches(str(name), NAMES, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"unknown option {name!r}{hint} The options are {', '.join(NAMES)} and backend.")


def signature(*, with_backend: bool = True) -> inspect.Signature:
    """``(q, k, v, *, <every option>=<default>, [backend="auto"])``."""
    positional = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in "qkv"]
    keywords = [inspect.Parameter(option.name, inspect.Parameter.KEYWORD_ONLY, default=option.default)
                for option in OPTIONS]
    if with_backend:
        keywords.append(inspect.Parameter("backend", inspect.Parameter.KEYWORD_ONLY, default="auto"))
    return inspect.Signature(positional + keywords)


def score_steps_doc() -> str:
    """:data:`SCORE_STEPS` as one phrase."""
    return "; ".join(SCORE_STEPS)


def argument_docs(indent: str = "    ") -> str:
    """The Args section lines, one option each, with ``backend`` last."""
    entries = [(option.name, option.doc) for option in OPTIONS] + [("backend", BACKEND_DOC)]
    return "\n".join(textwrap.fill(f"{name}: {doc}", width=88, initial_indent=indent,
                                   subsequent_indent=indent + "    ") for name, doc in entries)


# ---- the checks that belong to one option ---------------------------------------------------

def _check_window(window, reach):
    """None, an int w >= 0, or a (left, right) pair of ints >= 0 or None; bounds above
    ``reach`` (Sq + Sk, beyond any query-key distance) become ``reach``."""
    if window is None:
        return None
    if isinstance(window, (tuple, list)):
        if len(window) != 2:
            raise ValueError(f"window must be None, an int or a (left, right) pair, got {window!r}")
        bounds = tuple(None if w is None else _window_bound(w, window, reach) for w in window)
        return bounds
    return _window_bound(window, window, reach)


def _window_bound(bound, window, reach):
    number = checks.as_int(bound)
    if number is None:
        raise TypeError(f"window must be None, an int or a (left, right) pair of ints or None, got {window!r}")
    bound = number
    if bound < 0:
        raise ValueError(f"window must be non-negative, got {window!r}")
    return min(int(bound), reach)


def _check_scale(scale, head_dim, compute):
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    return checks.check_representable("scale", checks.check_real("scale", scale), compute)


def _check_softcap(softcap, compute):
    """None or 0 turn soft-capping off (0 as in FlashAttention); otherwise it must be positive
    and a normal number of the ``compute`` dtype (scores are divided by it)."""
    if softcap is None:
        return None
    softcap = checks.check_representable("softcap", checks.check_real("softcap", softcap), compute)
    if softcap < 0:
        raise ValueError(f"softcap must be positive (or None/0 for none), got {softcap}")
    smallest = float(np.finfo(compute).tiny)
    if 0 < softcap < smallest:
        raise ValueError(f"softcap must be at least {smallest:.4g} for inputs computed in {compute} "
                         f"(scores are divided by it), got {softcap!r}")
    return softcap or None


def _check_dropout_p(dropout_p):
    dropout_p = checks.check_real("dropout_p", dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return dropout_p


# the dropout hash takes 32-bit words: an index plus its offset wraps past 2**32 - 1
DROPOUT_OFFSET_LIMIT = 2 ** 32 - 1


def _check_dropout_offset(value):
    """Four ints in [0, 2**32): the offsets of the batch, head, row and key indices."""
    if not isinstance(value, (tuple, list)) or len(value) != 4:
        raise ValueError(f"dropout_offset must be a (b, h, i, j) tuple of 4 ints, got {value!r}")
    offsets = tuple(checks.as_int(offset) for offset in value)
    for name, offset, given in zip("bhij", offsets, value):
        if offset is None:
            raise TypeError(f"dropout_offset must hold ints, got {type(given).__name__} {given!r} for {name}")
        if not 0 <= offset <= DROPOUT_OFFSET_LIMIT:
            raise ValueError(f"dropout_offset's {name} must be in [0, 2**32), got {offset}")
    return offsets


# |q_offset| at most this: positions, and the window bounds clamped to Sq + Sk + |q_offset|,
# stay far inside the GPU kernels' int32 arithmetic
Q_OFFSET_LIMIT = 2 ** 29


def _check_q_offset(value, call):
    """None, an int or an int (B,) array (of q's kind), within +-:data:`Q_OFFSET_LIMIT`;
    ``causal="top_left"`` means 0 and takes no q_offset of its own."""
    if call.checked["causal"] == "top_left":
        if value is not None:
            raise ValueError(f'causal="top_left" already places the rows (q_offset=0); got q_offset={value!r} '
                             'too: pass causal=True with q_offset instead')
        return 0
    if value is None:
        return None
    number = checks.as_int(value)
    if number is not None:
        if not -Q_OFFSET_LIMIT <= number <= Q_OFFSET_LIMIT:
            raise ValueError(f"q_offset must be within +-{Q_OFFSET_LIMIT} (2**29), got {number}")
        return number
    if isinstance(value, (bool, np.bool_)) or (not hasattr(value, "shape") and not isinstance(value, (list, tuple))):
        raise TypeError(f"q_offset must be an int, an int array of shape (B,) or None, "
                        f"got {type(value).__name__} {value!r}")
    offsets = checks.int_array("q_offset", value, call.q, "of shape (B,)")
    if tuple(offsets.shape) != (call.batch,):
        raise ValueError(f"q_offset as an array must have shape (B,) = ({call.batch},), got {tuple(offsets.shape)}")
    # compared in the array's own dtype: -2**63 has no absolute value in int64, 2**63 no int64 at all
    checks.check_int_range("q_offset", offsets, -Q_OFFSET_LIMIT, Q_OFFSET_LIMIT, " (+-2**29)")
    return offsets.astype(np.int64)


def dropout_requested(options: dict) -> bool:
    """Whether ``options`` ask for dropout with a real ``dropout_p > 0`` (a value of another
    kind is left for the option's check to name, not tested for truth here: an array's
    truth would raise NumPy's own error)."""
    value = options.get("dropout_p")
    return isinstance(value, Real) and not isinstance(value, (bool, np.bool_)) and value > 0


def is_top_left(value) -> bool:
    """Whether a ``causal`` value is the string "top_left" (any other value compares False,
    an array included)."""
    return isinstance(value, str) and value == "top_left"


CAUSAL_ALIGNMENTS = ("bottom_right", "top_left")


def _check_causal(value):
    """False, True / "bottom_right" (-> "bottom_right") or "top_left"."""
    if isinstance(value, str):
        if value not in CAUSAL_ALIGNMENTS:
            raise ValueError(f'causal must be a bool, "bottom_right" or "top_left", got {value!r}')
        return value
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f'causal must be a bool, "bottom_right" or "top_left", got {type(value).__name__} {value!r}')
    return "bottom_right" if value else False


def fresh_seed() -> int:
    """A random 64-bit dropout seed from the OS's entropy (seed=None)."""
    return int(np.random.SeedSequence().generate_state(1, np.uint64)[0])


def _check_seed(seed, dropout_p):
    """An int (any size: it is taken mod 2**64), or None: a fresh random seed when dropout is on."""
    if seed is None:
        return fresh_seed() if dropout_p else 0
    number = checks.as_int(seed)
    if number is None:
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__} {seed!r}")
    return number


def _check_alibi(slopes, q, batch, heads, reach, compute):
    """(H,) or (B, H) slopes, broadcast to (B, H); each times the longest distance
    (``reach`` = Sq + Sk) must stay finite in the ``compute`` dtype."""
    if slopes is None:
        return None
    (slopes,) = checks.as_arrays(alibi_slopes=slopes, reference=q)
    checks.check_float_dtype("alibi_slopes", slopes)
    if tuple(slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes must have shape (H,) = ({heads},) or (B, H) = ({batch}, {heads}), "
                         f"got {tuple(slopes.shape)}")
    checks.check_finite_values("alibi_slopes", slopes, compute, reach)
    xp = _arrays.array_module(slopes)
    return xp.broadcast_to(slopes, (batch, heads))


def _check_block_table(value, call):
    """None, or an int (B, P) array (of q's kind) of page indices below the pool's page count."""
    if value is None:
        return None
    (table,) = checks.as_arrays(block_table=value, reference=call.q)
    if table.dtype.kind not in "iu":
        raise TypeError(f"block_table must be an integer array (B, pages per entry), got dtype {table.dtype}")
    if table.ndim != 2 or table.shape[0] != call.batch:
        raise ValueError(f"block_table must have shape (B, pages per entry) = ({call.batch}, P), "
                         f"got {tuple(table.shape)}")
    checks.check_int_range("block_table", table, 0, call.pages - 1, " (page indices of the pool's pages)")
    return table.astype(np.int64)
