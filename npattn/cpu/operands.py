"""An :class:`~npattn.core.problem.AttentionProblem` as the flat operands the Numba kernels take.

Every array goes to the kernels as a 1-D view of the memory it already occupies plus
its element strides, so one compiled kernel per dtype serves both layouts, any
broadcast mask or bias (stride 0 along broadcast axes: a (1, 1, Sq, Sk) bias is
read in place, never expanded), and any option set (options are runtime flags,
absent arrays are 1-element placeholders). Nothing is copied except to change a
dtype (float16 inputs, a bias of another float type) or to give BLAS a unit
stride along the head dimension.
"""
from __future__ import annotations

import copy
import functools
import math
from collections import namedtuple

import numpy as np

from ..core.dropout import seed_words
from ..core.kernel_params import OPERAND_NAMES, SPAN_FIELDS, Int, KvCodes, Real, Span, quantized_codes, default_spans, element_strides, problem_int_values, problem_pages, problem_reals, spans_with  # (Int, Real, Span: the kernels import them from here)
from ..runtime.plans import PlanCache
from ..core.problem import signature
from .conversion import BYTES, converted, kept_widened
from .isa import row_prefetch_pays, tile_prefetch_pays
from .microkernels import chunk_columns
from .simd import BF16_DOT, lanes_of as vector_lanes
from .splitting import key_splits
from .tuning import Tuning, current



# What every kernel takes first, in :data:`npattn.core.kernel_params.OPERANDS` order
# (``kernel(*operands, ...)``): q, k, v, bias, mask as flat views (strides in ``ints``);
# bias in the compute dtype, mask as uint8, alibi (B * H,) and sink (H,), each a
# 1-element placeholder when absent; spans int64 (B * SPAN_FIELDS,) (the live rows and
# keys and row 0's position per batch entry, :func:`npattn.core.kernel_params.problem_spans`);
# pages int64 (B * PAGES,) (:func:`npattn.core.kernel_params.problem_pages`); ints (int64, by
# :class:`Int`) and reals (compute dtype, by :class:`Real`).
#
# Then the last four: a quantized cache's codes of k and v (int8 here, whatever the codes
# are) and their float32 scales (flat views; strides in ``ints``), each a 1-element
# placeholder otherwise (k and v are then the placeholders: one compiled kernel serves
# both kinds of cache); 16-bit float keys read a tile at a time come as codes too, unscaled.
Operands = namedtuple("Operands", OPERAND_NAMES)
_SCALED = (KvCodes.INT8, KvCodes.FLOAT8)  # codes with scales
CODE_DTYPE, SCALE_DTYPE = np.dtype(np.int8), np.dtype(np.float32)
WORDS = np.dtype(np.float32)  # 16-bit memory seen as float32 words (pair_words, a dtype object: a view's lookup less)


def widened(array, dtype, empty=np.empty):
    """``array.astype(dtype)`` in ``array``'s memory order (float16 on the vector units,
    :func:`~npattn.cpu.conversion.converted`, into ``empty(shape, dtype)``, where NumPy's
    scalar loop would be slower); ``array`` itself where it has ``dtype`` already."""
    if array.dtype == dtype:
        return array
    fast = converted(array, dtype, empty)
    return array.astype(dtype) if fast is None else fast


def flat_view(array, dtype, unit_last_axis=False, empty=np.empty):
    """``(flat, strides)``: a read-only 1-D view spanning ``array``'s memory and its element
    strides (read-only, as every operand, so that one compiled kernel serves all).

    Copies only when the dtype differs (into ``empty(shape, dtype)`` where the vector units
    convert), a stride is negative or not a whole number of elements, or
    (``unit_last_axis``) the last axis is not contiguous."""
    order = memory_order(array, dtype, unit_last_axis)
    if order is not None:  # the common cases, first: no copy, no stride arithmetic
        return flat_memory(array, order), element_strides(array)
    array = np.asarray(array)
    if array.dtype != dtype:
        array = widened(array, dtype, empty)
    if _unreadable_strides(array, unit_last_axis):
        array = np.ascontiguousarray(array)
    elements = element_strides(array)
    if array.size == 0:
        return _placeholders(np.dtype(dtype))[0], elements
    if array.flags.c_contiguous:  # a copy made above, or a contiguous view of another dtype's
        return _frozen(array.reshape(-1)), elements
    extent = 1 + sum((n - 1) * s for n, s in zip(array.shape, elements))
    flat = _within_base(array, extent)
    if flat is None:
        flat = np.lib.stride_tricks.as_strided(array, shape=(extent,), strides=(array.itemsize,), writeable=False)
    return flat, elements


def _unreadable_strides(array, unit_last_axis) -> bool:
    """Whether :func:`flat_view` copies ``array`` (of its dtype) for its strides: a
    negative one, one that is not a whole number of elements, or (``unit_last_axis``) a
    last axis that is not contiguous."""
    itemsize = array.itemsize
    return (any(s < 0 or s % itemsize for s in array.strides)
            or (unit_last_axis and array.shape[-1] > 1 and array.strides[-1] != itemsize))


def flat_view_strides(array, dtype, unit_last_axis=False) -> tuple:
    """The element strides :func:`flat_view` gives for ``array`` (the same arguments),
    without its copy: those of a C-contiguous array of its shape where flat_view copies it
    (another dtype, or :func:`_unreadable_strides`), else its own. A plan's parameters take
    a scales array's strides from here, so that they are the strides of the operand its
    calls hand the kernel."""
    if memory_order(array, dtype, unit_last_axis) is None and (array.dtype != dtype
                                                               or _unreadable_strides(array, unit_last_axis)):
        return element_strides(np.empty(array.shape, np.dtype(dtype)))
    return element_strides(array)


def _within_base(array, extent):
    """``extent`` elements from ``array``'s first, as a read-only slice of the contiguous
    array it is a view of (a KV cache's filled part, ``cache[:, :, :n]``), or None where it
    is no such view. A slice costs a few us; ``as_strided``, the general way, 20."""
    base = array
    while isinstance(base.base, np.ndarray):
        base = base.base
    if base is array or base.dtype != array.dtype or not base.flags.c_contiguous:
        return None
    start, rest = divmod(array.__array_interface__["data"][0] - base.__array_interface__["data"][0],
                         array.itemsize)
    if rest or start < 0 or start + extent > base.size:
        return None
    return _frozen(base.reshape(-1)[start:start + extent])


_BSHD, _BSH = (0, 2, 1, 3), (0, 2, 1)


def memory_order(array, dtype, unit_last_axis=False):
    """The axis order in which ``array`` is C-contiguous: ``(0, 1, 2, 3)`` for its own, or
    (0, 2, 1, 3) for a bshd array seen as bhsd (the usual cases; (0, 2, 1) for a (B, S, H)
    array of scales seen as bhs); None otherwise, or when it
    is empty or not of ``dtype``: then :func:`flat_memory` cannot view it. With
    ``unit_last_axis``, also None unless the last axis has unit stride."""
    if array.dtype != dtype or not array.size:
        return None
    if array.flags.c_contiguous:
        return tuple(range(array.ndim))
    if unit_last_axis and array.shape[-1] > 1 and array.strides[-1] != array.itemsize:
        return None
    if array.ndim == 4 and array.transpose(_BSHD).flags.c_contiguous:
        return _BSHD
    if array.ndim == 3 and array.transpose(_BSH).flags.c_contiguous:  # a (B, S, H) cache's scales seen as bhs
        return _BSH
    return None  # other orders (views into a larger array) are read by flat_view's slower path


def flat_memory(array, order):
    """A read-only 1-D view of the memory of ``array``, C-contiguous in axis ``order``
    (:func:`memory_order`; None: its own axes, for an array known to be C-contiguous),
    starting at its first element."""
    return _frozen((array if order is None else array.transpose(order)).reshape(-1))


def row_strides(array, dtype, empty=np.empty):
    """``(flat, (batch, head, row))`` for a bhsd (B, H, S, X) array whose rows feed BLAS:
    the row stride is at least X (BLAS's leading-dimension rule). Rows that overlap (a
    row stride below X, as a ``np.broadcast_to`` along the sequence gives with stride 0)
    are copied once to whole rows; a single row has no row stride to obey."""
    rows, width = array.shape[-2], array.shape[-1]
    if rows > 1 and 0 <= array.strides[-2] < width * array.itemsize:
        array = np.ascontiguousarray(array)
    flat, (sb, sh, sr, _) = flat_view(array, dtype, unit_last_axis=True, empty=empty)
    return flat, (sb, sh, max(sr, width, 1))


def view_strides(array, dtype, unit_last_axis=False) -> tuple:
    """``flat_view(array, dtype, unit_last_axis)[1]``, without making the view where it
    would copy nothing (a plan for a new structure needs the strides only)."""
    itemsize = array.itemsize
    if (array.dtype == dtype and array.size and all(s >= 0 and s % itemsize == 0 for s in array.strides)
            and not (unit_last_axis and array.shape[-1] > 1 and array.strides[-1] != itemsize)):
        return element_strides(array)
    return flat_view(array, dtype, unit_last_axis)[1]


def row_view_strides(array, dtype) -> tuple:
    """``row_strides(array, dtype)[1]``, without the view where it would copy nothing."""
    rows, width = array.shape[-2], array.shape[-1]
    if rows > 1 and 0 <= array.strides[-2] < width * array.itemsize:
        return row_strides(array, dtype)[1]
    sb, sh, sr, _ = view_strides(array, dtype, unit_last_axis=True)
    return sb, sh, max(sr, width, 1)


def build_operands(problem, kind: str = "forward", tuning: Tuning | None = None,
                   rows_per_position: int = 1) -> Operands:
    """The kernels' operands for ``problem``, with the tiles of ``kind`` ("forward" or
    "backward") and the product path of ``tuning`` (default: the calling context's,
    :func:`npattn.cpu.tuning.current`); ``rows_per_position`` > 1 for a problem whose
    query rows are a GQA group's heads folded in (:mod:`npattn.cpu.folding`).

    Every operand is read-only: Numba types read-only and writable arrays differently,
    so placeholders and views share one compiled kernel."""
    plan = operand_plan(problem, kind, current() if tuning is None else tuning, rows_per_position)
    return plan.operands(problem.q, problem.k, problem.v, problem)


class OperandPlan:
    """What the kernels take for every problem of one :func:`~npattn.core.problem.signature`
    (shapes, strides, dtypes and option values), made once: the parameter arrays, the
    spans of a problem without lengths or starts, and how q, k and v are viewed
    flat. :meth:`operands` adds a call's arrays."""

    def __init__(self, problem, kind, tuning, rows_per_position):
        self.dtype = dtype = problem.accumulate_dtype  # float32 for float16 inputs
        self.codes = codes = kv_codes(problem, kind, tuning)
        self.keys_dtype = keys_dtype = self._keys_dtype(problem)  # k and v as the kernels read them
        # bfloat16 q, k and v read as they lie, in float32 words of two (strides in words)
        self.pairs = pairs = bf16_products(problem, kind, tuning, codes)
        # 16-bit q read as it lies, each work item's rows converted in the kernel
        self.q_codes = q_codes = query_codes(problem, kind, codes)
        # a 16-bit bias read as it lies, each value converted where a score adds it
        self.bias_codes = bias_codes(problem, kind)
        # where q, k and v are widened (a 16-bit backward's, a 16-bit forward's q where it is
        # not read as it lies): into arrays this thread keeps for the next call
        # (conversion.kept_widened; the kernels are done with them when the call returns). A
        # forward's fresh q had cost a float16 prefill its pages: (1, 8, 2048, 64) causal
        # 1.07-1.08x float32's time in one process, 1.025-1.027x kept (three alternating
        # processes, 20 rounds each); read as it lies (query_codes, out written in float16 by
        # the kernel), 0.951-0.982x
        self.empties = (tuple(kept_widened(name) for name in "qkv") if kind == "backward"
                        else (kept_widened("forward q"), np.empty, np.empty))
        no_strides = (0, 0, 0, 0)
        if pairs:
            row_words = [tuple(n // 2 for n in row_view_strides(x, x.dtype)) for x in (problem.q, problem.k, problem.v)]
        else:  # (16-bit codes are read as bytes: their strides in bytes)
            bytes_per_value = 2 if codes in (KvCodes.FLOAT16, KvCodes.BFLOAT16) else 1
            row_words = [tuple(2 * n for n in row_view_strides(problem.q, problem.q.dtype)) if q_codes
                         else row_view_strides(problem.q, dtype),
                         tuple(bytes_per_value * n for n in row_view_strides(problem.k, keys_dtype)),
                         tuple(bytes_per_value * n for n in row_view_strides(problem.v, keys_dtype))]
        strides = (*row_words,
                   no_strides if problem.bias is None else view_strides(problem.bias, self._bias_dtype(problem)),
                   no_strides if problem.mask is None else view_strides(problem.mask.view(np.uint8), np.uint8))
        self.ints, self.reals = _parameters(problem, kind, tuning, rows_per_position, strides, codes, pairs, q_codes,
                                            self.bias_codes)
        self.spans = default_spans(problem)  # with the call's lengths and starts, per call
        self.plain_spans = _frozen(self.spans.reshape(-1))
        self.plain_pages = _frozen(np.arange(problem.batch, dtype=np.int64))  # not paged: entry b's keys in k[b]
        # q, k, v read in place (the usual case), else through row_strides on every call
        # (:func:`flat_memory` written out in :meth:`operands`: a small call's every us counts)
        self.orders = (row_order(problem.q, dtype), row_order(problem.k, keys_dtype),
                       row_order(problem.v, keys_dtype))
        # a 16-bit q in a known memory order (float16 computed in float32): widened per call,
        # read in that order, as flat_view would copy and read it
        self.widened_q = (self.orders[0] is None and problem.q.dtype != dtype
                          and row_order(problem.q, problem.q.dtype) is not None)
        self.placeholders = _placeholders(dtype)
        self.code_placeholder, self.scale_placeholder = _placeholders(CODE_DTYPE)[0], _placeholders(SCALE_DTYPE)[0]
        # whether a quantized run's scales are in a known memory order (RunScales: every
        # run's have the problem's structure; scale_run_operands)
        self.scales_in_order = (codes in _SCALED and problem.k_scale is not None
                                and memory_order(problem.k_scale, SCALE_DTYPE) is not None
                                and memory_order(problem.v_scale, SCALE_DTYPE) is not None)
        self.dropout = bool(problem.dropout_p)
        placeholder, mask_placeholder = self.placeholders
        # the operands after q, k and v of a call with no option arrays and float keys: one tuple
        self.plain_rest = (placeholder, mask_placeholder, placeholder, placeholder, self.plain_spans,
                           self.plain_pages, self.ints, self.reals, self.code_placeholder, self.code_placeholder,
                           self.scale_placeholder, self.scale_placeholder)
        # and of a small 16-bit call's (entry_operands): those between q and the key bytes, and after them
        self.coded_middle = (placeholder, placeholder, *self.plain_rest[:8])
        self.coded_tail = (self.scale_placeholder, self.scale_placeholder)

    def with_float_out(self) -> "OperandPlan":
        """This plan with out in the compute dtype (no OUT_CODES): a 16-bit forward whose out
        the backward reads, which its dominant keys' gradients need as the float32 product
        the forward computed (:func:`npattn.cpu.backward_kernel.dominant_key_gradient`);
        itself where out is not 16-bit."""
        if not self.ints[Int.OUT_CODES]:
            return self
        plan = copy.copy(self)
        ints = self.ints.copy()
        ints[Int.OUT_CODES] = KvCodes.NONE
        plan.ints = _frozen(ints)
        plan.plain_rest = (*self.plain_rest[:6], plan.ints, *self.plain_rest[7:])
        plan.coded_middle = (*self.coded_middle[:2], *plan.plain_rest[:8])
        return plan

    def _keys_dtype(self, problem):
        """The dtype the kernels read k and v in: their own where they are codes (int8, e4m3 or 16-bit floats
        read as bytes), else the compute dtype (converted where it differs)."""
        return problem.k.dtype if self.codes else self.dtype

    def operands(self, q, k, v, arrays=None) -> Operands:
        """The operands for bhsd ``q``, ``k``, ``v`` of this plan's shapes, strides and
        dtype, with the bias, mask, ALiBi slopes, sink logits, lengths and seed of
        ``arrays`` (a problem of this plan's signature; None: none of them, no dropout)."""
        dtype = self.dtype
        keys_dtype = self.keys_dtype
        q_order, k_order, v_order = self.orders
        # (contiguous in some order of axes, so ravel in memory order is a view: the
        # transpose and reshape of flat_memory, at a fifth of the cost)
        if self.pairs:  # bfloat16 read as it lies
            q, k, v = pair_words(q), pair_words(k), pair_words(v)
        else:
            empty_q, empty_k, empty_v = self.empties
            if self.q_codes:  # 16-bit q as it lies (query_codes)
                q = pair_words(q)
            elif q_order is not None:
                q = _frozen(q.ravel(order="K"))
            elif self.widened_q:  # (flat_view's copy, in memory order: 3 us less of a small call)
                q = _frozen(widened(q, dtype, empty_q).ravel(order="K"))
            else:
                q = row_strides(q, dtype, empty_q)[0]
            k = _frozen(k.ravel(order="K")) if k_order is not None else row_strides(k, keys_dtype, empty_k)[0]
            v = _frozen(v.ravel(order="K")) if v_order is not None else row_strides(v, keys_dtype, empty_v)[0]
        if arrays is None and not self.codes:  # (a small call's usual case: 0.5 us less)
            return Operands._make((q, k, v, *self.plain_rest))
        placeholder, mask_placeholder = self.placeholders
        quantized = (self.code_placeholder, self.code_placeholder, self.scale_placeholder, self.scale_placeholder)
        if self.codes:  # the codes as bytes (int8, e4m3 or 16-bit floats; kv_codes: always in a known memory
            # order) with their scales where they have them; k and v are placeholders, which nothing reads
            scales = ((flat_view(arrays.k_scale, SCALE_DTYPE)[0], flat_view(arrays.v_scale, SCALE_DTYPE)[0])
                      if self.codes in _SCALED else (self.scale_placeholder, self.scale_placeholder))
            quantized = (_frozen(k.view(np.int8)), _frozen(v.view(np.int8)), *scales)
            k = v = placeholder
        if arrays is None:
            return Operands(q, k, v, *self.plain_rest[:8], *quantized)
        bias = placeholder if arrays.bias is None else self._bias_operand(arrays.bias, dtype)
        mask = mask_placeholder if arrays.mask is None else flat_view(arrays.mask.view(np.uint8), np.uint8)[0]
        alibi = (placeholder if arrays.alibi_slopes is None
                 else read_only(np.ascontiguousarray(arrays.alibi_slopes, dtype=dtype).reshape(-1)))
        sink = (placeholder if arrays.sink_logits is None
                else read_only(np.ascontiguousarray(arrays.sink_logits, dtype=dtype)))
        spans = spans_with(self.spans, arrays)
        spans = self.plain_spans if spans is self.spans else _frozen(spans.reshape(-1))
        pages = self.plain_pages if arrays.block_table is None else _frozen(problem_pages(arrays))
        ints = self.ints
        if self.dropout:  # the seed is the one per-call value among the parameters
            ints = ints.copy()
            ints[Int.SEED_LO], ints[Int.SEED_HI] = seed_words(arrays.seed)
            ints = _frozen(ints)
        return Operands(q, k, v, bias, mask, alibi, sink, spans, pages, ints, self.reals, *quantized)

    def _bias_dtype(self, problem):
        """The dtype whose elements the kernels' bias strides count: the bias's own with
        BIAS_CODES, else the compute dtype."""
        return problem.bias.dtype if self.bias_codes else self.dtype

    def _bias_operand(self, bias, dtype):
        """A call's bias as the kernels read it: its flat view in the compute dtype (a
        converted copy where its dtype differs), or with BIAS_CODES its 16-bit memory seen
        as float32 words, as it lies. Where that memory is not a whole number of words on a
        4-byte boundary, a copy of the flat 16-bit span one element longer: the same
        element offsets, so the plan's strides hold."""
        if not self.bias_codes or bias.size == 0:  # (an empty bias is never read)
            return flat_view(bias, dtype)[0]
        span = flat_view(bias, bias.dtype)[0]
        if span.size % 2 or span.ctypes.data % 4:
            padded = np.zeros(span.size + span.size % 2, bias.dtype)
            padded[:span.size] = span
            span = padded
        return _frozen(span.view(WORDS))

    def entry_operands(self, q, k, v) -> tuple:
        """:meth:`operands` of a plain call (no option arrays) for a kernel's typed entry
        point (:func:`~npattn.cpu.threads.direct_entry`), which reads no array's flags: q,
        k and v viewed as :meth:`operands` views them, but not marked read-only where
        they are read in place (three ``setflags``: 0.3 us of a small call). Jitted code
        typed them read-only, so it never writes them."""
        if self.pairs:  # bfloat16 as it lies, in words of two (pair_words' views; an unaligned one's
            # words are another type: the caller's alignment check sends it on). 2 us of a small call less
            return (q.ravel(order="K").view(WORDS), k.ravel(order="K").view(WORDS), v.ravel(order="K").view(WORDS),
                    *self.plain_rest)
        q_order, k_order, v_order = self.orders
        if self.q_codes:  # a small 16-bit call: q's words and the keys' bytes as they lie (an
            # unaligned q's words are another type: the caller's alignment check sends it on)
            return (q.ravel(order="K").view(WORDS), *self.coded_middle, k.ravel(order="K").view(BYTES),
                    v.ravel(order="K").view(BYTES), *self.coded_tail)
        if q_order is None or k_order is None or v_order is None or self.codes or self.pairs:
            return self.operands(q, k, v)
        return (q.ravel(order="K"), k.ravel(order="K"), v.ravel(order="K"), *self.plain_rest)

    def kept_operands(self, q, k, v, options) -> tuple | None:
        """:meth:`operands` of a run of a problem whose option operands ``options`` (bias to
        reals) an earlier run kept, for a kernel's typed entry point, as
        :meth:`entry_operands` gives a plain call's; None where q, k or v are not read in a
        memory order known at planning (or are codes, or bfloat16 words)."""
        q_order, k_order, v_order = self.orders
        if q_order is None or k_order is None or v_order is None or self.codes or self.pairs or self.q_codes:
            return None
        return (q.ravel(order="K"), k.ravel(order="K"), v.ravel(order="K"), *options, *self.plain_rest[8:])

    def scale_run_operands(self, q, k, v, run, options) -> tuple | None:
        """:meth:`operands` of a quantized run (:class:`~npattn.core.quantization.RunScales`:
        the planned problem with the run's scales) for a kernel's typed entry point, as
        :meth:`entry_operands` gives a plain call's: ``options``, the operands from bias to
        reals of an earlier run on the same problem (the same arrays every run), then q, the
        codes and the run's scales viewed as :meth:`operands` views them (those in a memory
        order known at planning not marked read-only). None where q is not read in place."""
        q_order, k_order, v_order = self.orders
        if q_order is None or self.pairs:
            return None
        placeholder = self.placeholders[0]
        # (ravel in memory order is a view where the order was known at planning: every
        # run's arrays have the planned structure; others, a cache's filled part say, are
        # viewed as operands() views them)
        k = k.ravel(order="K") if k_order is not None else row_strides(k, self.keys_dtype)[0]
        v = v.ravel(order="K") if v_order is not None else row_strides(v, self.keys_dtype)[0]
        if self.scales_in_order:
            k_scale, v_scale = run.k_scale.ravel(order="K"), run.v_scale.ravel(order="K")
        else:
            k_scale, v_scale = flat_view(run.k_scale, SCALE_DTYPE)[0], flat_view(run.v_scale, SCALE_DTYPE)[0]
        return (q.ravel(order="K"), placeholder, placeholder, *options, k.view(CODE_DTYPE), v.view(CODE_DTYPE),
                k_scale, v_scale)


def operand_plan(problem, kind: str, tuning: Tuning, rows_per_position: int = 1) -> OperandPlan:
    """The :class:`OperandPlan` of ``problem``'s signature, made on first use and kept
    (the newest 256); dropout seeds share one (:meth:`OperandPlan.operands` sets it)."""
    return _PLANS.get_or_make((kind, tuning, rows_per_position, signature(problem, seed=False)),
                              lambda: OperandPlan(problem, kind, tuning, rows_per_position))


def row_order(array, dtype):
    """:func:`memory_order` for an array whose rows feed the products, None where
    :func:`row_strides` would copy it (overlapping rows)."""
    rows, width = array.shape[-2], array.shape[-1]
    if rows > 1 and 0 <= array.strides[-2] < width * array.itemsize:
        return None
    return memory_order(array, dtype, unit_last_axis=True)


def kv_codes(problem, kind: str, tuning: Tuning) -> KvCodes:
    """How the forward and backward read ``problem``'s k and v: int8 codes with scales (a
    quantized cache); float16 or bfloat16 converted a tile at a time, where the head dims are
    even (tiles other than whole vectors are converted into float32 rows,
    :func:`~npattn.cpu.tiles.whole_vector_rows`, which a backward's BLAS products read too;
    (1, 8, 1024, 40) causal float16 1.07x -> 0.90x float32's time, a float16 cache's decode step
    at (4, 8, 1 x 1024, 40) 2.64x -> 1.04x, then 0.90x once decode tiles read such rows in
    registers too, :func:`~npattn.cpu.tiles.codes_in_registers`; a forward and backward at
    (4, 8, 128, 40) causal 1.15-1.20x -> 1.07-1.13x once the backward read them so) and k and v
    lie in a known memory order (a bfloat16
    forward that multiplies in bfloat16 reads them as they lie instead,
    :func:`bf16_products`: short queries and small calls too, where the tiles had been
    kept for them; measured on the 2-core Zen 4 VM, planned calls, bfloat16 over float32
    time: (4, 8, 32 x 32, 64) 1.11 -> 0.86x, (1, 8, 128 x 128, 64) causal 0.93 -> 0.77x,
    (1, 8, 16 x 1024, 64) 1.06 -> 0.73x, (1, 8, 16 x 16, 64) causal 1.15 -> 1.13x, and
    1.01x with :meth:`OperandPlan.entry_operands` viewing the pairs directly); else as
    they are (a converted float32 copy for 16-bit floats).
    Bits are the same either way: the conversion is exact and the products see the same
    values in the same order.

    Measured on the 2-core AVX-512 VM, a decode step at (1, 32/8, 16384, 128) with a
    float16 cache: 81 ms with the copy, 10.5 ms converted by tiles (float32: 13.7 ms;
    ``bench --caches``). A prefill converts each key tile once per query tile, in cache,
    where the copy allocated and page-faulted two arrays per call: (1, 8, 2048, 64) causal,
    float16 over float32 in one process, 1.20x -> 1.05-1.10x (medians of 9 rounds). A
    backward converts each key tile once per work item, and its bias gradient's kernel
    once per (head, query tile) it sums."""
    if problem.quantized:
        return KvCodes(quantized_codes(problem))
    name = problem.k.dtype.name
    if (kind not in ("forward", "backward") or name not in ("float16", "bfloat16") or problem.v.dtype != problem.k.dtype
            or problem.accumulate_dtype != np.float32 or not tuning.vector_products):
        return KvCodes.NONE
    # any even head dims: tiles that are not whole vectors are converted into float32 rows,
    # their last vector masked (tiles.whole_vector_rows), which the forward's products and
    # the backward's (BLAS for such dims) read; odd ones are copied (rows that are not whole
    # float32 words of q and out)
    even = problem.head_dim % 2 == 0 and problem.value_dim % 2 == 0
    if (not even
            or bf16_products(problem, kind, tuning)
            or row_order(problem.k, problem.k.dtype) is None or row_order(problem.v, problem.v.dtype) is None):
        return KvCodes.NONE
    return KvCodes.FLOAT16 if name == "float16" else KvCodes.BFLOAT16


def whole_vector_dims(problem) -> bool:
    """Whether the head dim and Dv are whole vectors of the compute dtype's lanes: the
    planning side of :func:`npattn.cpu.tiles.whole_vector_rows`, which the kernels ask."""
    lanes = vector_lanes(problem.accumulate_dtype)
    return problem.head_dim % lanes == 0 and problem.value_dim % lanes == 0


def query_codes(problem, kind: str, codes) -> KvCodes:
    """How the forward and backward read q: where they read float16 or bfloat16 k and v a
    tile at a time (``codes``, :func:`kv_codes`), a q of their dtype in a known memory order
    as it lies, each work item's rows converted to float32 once in the kernel
    (:func:`npattn.cpu.tiles.convert_query_rows`: exact, so the same bits), with no float32
    copy of q; else as it is (a float32 copy for 16-bit q). The weights kernel reads them
    the same way. A backward converts each (head, query tile)'s rows
    where a key tile uses them, and a dout of q's dtype likewise
    (:class:`~npattn.cpu.driver.BackwardPlan`)."""
    if (kind not in ("forward", "backward") or codes not in (KvCodes.FLOAT16, KvCodes.BFLOAT16)
            or problem.q.dtype != problem.k.dtype
            or row_order(problem.q, problem.q.dtype) is None):
        return KvCodes.NONE
    return codes


def bias_codes(problem, kind: str) -> KvCodes:
    """How the kernels read a bias (the forward's, the weights', the backward's and the bias
    gradient's: :func:`npattn.cpu.tiles.score_tile` is the one reader): a float16 or
    bfloat16 bias of a float32 computation as it lies, its 16-bit memory seen as float32
    words, each value converted exactly where a score adds it
    (:func:`npattn.cpu.tiles.add_bias_codes`: the scores of adding a float32 copy, without
    the copy); else in the compute dtype (a converted copy where its dtype differs)."""
    if kind not in ("forward", "backward") or problem.bias is None or problem.accumulate_dtype != np.float32:
        return KvCodes.NONE
    return {"float16": KvCodes.FLOAT16, "bfloat16": KvCodes.BFLOAT16}.get(problem.bias.dtype.name, KvCodes.NONE)


def bf16_products(problem, kind: str, tuning: Tuning, codes=KvCodes.NONE) -> bool:
    """Whether a bfloat16 forward or backward multiplies in bfloat16 (AVX512_BF16's
    vdpbf16ps, two products per float32 lane; P, and in the backward dS, rounded to
    bfloat16 as GPU kernels round them; the backward, and its bias gradient's kernel, not
    for head dims of part vectors: :mod:`npattn.cpu.pair_gradients`): where the
    CPU has the instruction and the tuning asks for it (by default where it is faster than
    float32's FMAs: :func:`npattn.cpu.isa.bf16_pairs_pay`), the products run on the
    micro-kernels with packed keys (not
    a decode step's dot products, nor 16-bit keys read by tiles), no weights are asked
    (whose recomputed scores must be the float32 ones), and q, k and v are bfloat16 in a
    known memory order with even head dims: the kernels then read their memory as it
    lies, as float32 words of two bfloat16 (:func:`pair_words`), with no float32 copy."""
    if not (kind in ("forward", "backward") and BF16_DOT and tuning.pair_products and codes == KvCodes.NONE
            and not problem.return_weights and problem.accumulate_dtype == np.float32):
        return False
    vector, vector_values, vector_keys, dot_scores = _product_paths(problem, kind, tuning)
    if kind == "backward" and not vector_keys:  # (dK and dQ need whole vectors)
        return False
    # (pair products take whole vectors of values: a forward's VECTOR_VALUES alone also
    # holds for a Dv that is not, whose last vector microkernels.product masks)
    whole_values = problem.value_dim % vector_lanes(problem.accumulate_dtype) == 0
    return (vector and vector_values and whole_values and not dot_scores and problem.head_dim % 2 == 0
            and problem.value_dim % 2 == 0
            and all(x.dtype.name == "bfloat16" and row_order(x, x.dtype) is not None
                    for x in (problem.q, problem.k, problem.v)))


def pair_words(array):
    """A bfloat16 array in a known memory order (:func:`bf16_products`) as a read-only flat
    float32 view of its memory, each word two bfloat16 of one row; an aligned copy of that
    memory where the array starts off a 4-byte boundary (the kernels are typed for
    aligned arrays: another alignment would compile them again)."""
    flat = array.ravel(order="K")
    words = flat.view(np.float32)
    return _frozen(words if words.flags.aligned else flat.copy().view(np.float32))


def head_group(problem, kind: str, ints) -> tuple[int, int]:
    """``(heads per work item of the shape, of these strides)`` for the forward
    (``Int.HEAD_GROUP`` is the second). Decode tiles (DOT_SCORES: few rows per head) of
    a problem are items of every head by their shape: the key ranges a short query is cut into
    (:func:`npattn.cpu.splitting.key_splits`) count them so, whatever the memory layout,
    and so do its bits. Such an item visits each key tile head by head where k's and v's
    key rows hold every head (a head stride below the row stride: FlashAttention's
    (B, S, Hkv, D) caches, contiguous or paged) and each head reads its own kv head
    (MHA, or GQA folded into rows), and reads the cache in memory order
    (:func:`npattn.cpu.tiles.prefetch_key_rows`), where one item per head would read it
    a slice per row at half the bandwidth; elsewhere (head-major memory, which a head's
    pass reads in order) it stays one head per item. Each head's arithmetic is the same
    either way."""
    if kind != "forward" or not ints[Int.DOT_SCORES] or problem.return_weights:
        return 1, 1
    heads = int(ints[Int.HEADS])
    interleaved = (0 < ints[Int.K_STRIDE_H] < ints[Int.K_STRIDE_S] and 0 < ints[Int.V_STRIDE_H] < ints[Int.V_STRIDE_S])
    return heads, heads if interleaved and heads == ints[Int.KV_HEADS] else 1


def row_prefetch(problem, ints, codes, tiles) -> int:
    """``Int.ROW_PREFETCH``: the rows ahead (a key tile) whose slices a decode item of every
    head (``Int.HEAD_GROUP``) asks for key by key as its products read a contiguous cache's
    codes in registers (:func:`npattn.cpu.tiles.codes_in_registers`), where that pays
    (:func:`npattn.cpu.isa.row_prefetch_pays`); 0 elsewhere (paged caches too: a tile on
    may lie in another page)."""
    in_registers = (codes != KvCodes.NONE and ints[Int.DOT_SCORES] and ints[Int.VECTOR_VALUES]
                    and np.dtype(problem.accumulate_dtype) == np.float32 and whole_vector_dims(problem))
    if ints[Int.HEAD_GROUP] > 1 and in_registers and problem.block_table is None and row_prefetch_pays():
        return int(tiles[1])
    return 0


def _head_slice_bytes(problem, ints, codes, pairs) -> int:
    """The bytes of one head's keys (or values, the shorter) in a row of the cache as the
    forward reads it: k's own elements where it reads them as they lie (codes, 16-bit
    values, bfloat16 pairs), else floats of the sums' dtype (k itself or its converted copy)."""
    element = problem.k.itemsize if codes or pairs else np.dtype(problem.accumulate_dtype).itemsize
    return int(min(ints[Int.HEAD_DIM], ints[Int.VALUE_DIM])) * element


# Keys per tile of a decode step on an int8 (or e4m3) cache, whose products read the codes in
# registers (npattn.cpu.code_products): no staging to fill per tile, and the share of the
# next tile each head's pass asks memory for stays small. Measured on the 2-core Zen 4 VM,
# best of 7 x 5 steps, three alternating processes, since the next tile is asked for in
# two halves (forward_kernel): (16, 32/8, 2048, 128) 20.4-21.2 ns per key and kv head with
# 64 keys against 21.9-23.4 with 32; (1, 32/8, 16384, 128) 21.6-23.5 against 22.4-24.1
# (in one burst, 64 keys had been 20-35% slower than 32; 384, 1.4-1.8x)
CODE_TILE_KEYS = 64


def _product_paths(problem, kind, tuning) -> tuple:
    """``(vector, vector_values, vector_keys, dot_scores)``: whether the products run on the
    micro-kernels, whether the values' and keys' rows are whole vectors, and whether the
    scores are dot products of the key rows (a decode step's few rows)."""
    # a quantized cache's tiles are read as dequantized rows by the micro-kernels, never by
    # BLAS (its head dims are whole vectors: core.quantization.HEAD_DIM_MULTIPLE)
    vector = tuning.vector_products or problem.quantized
    lanes = vector_lanes(problem.accumulate_dtype)
    # rows counted as Sq x group both folded (Sq * group rows, group 1) and not (Sq rows
    # per head): the same problem takes the same path, so folding keeps the bits
    # (any head dim: the dot products read a last partial vector masked)
    dot_scores = kind == "forward" and vector and problem.q_len * problem.group_size <= tuning.dot_rows
    # a decode tile's P V runs on the micro-kernels for any Dv too, its last vector read and
    # written masked (microkernels.product, code_products.code_product): through BLAS, a
    # tile of a few rows paid a call per tile
    # (a prefill's too was 4-9% faster at (1, 8, 1024, 40) and (1, 8, 512, 72) causal, float32,
    # but 7-15% slower at (1, 8/2, 16 x 4096, 40), its 64 folded rows: left to BLAS)
    vector_values = vector and (problem.value_dim % lanes == 0 or dot_scores)
    vector_keys = vector and problem.head_dim % lanes == 0
    return vector, vector_values, vector_keys, dot_scores


def _parameters(problem, kind, tuning, rows_per_position, strides, codes=KvCodes.NONE, pairs=False,
                q_codes=KvCodes.NONE, bias_read=KvCodes.NONE):
    """``(ints, reals)``, read-only; ``strides``: the element strides of the flat views of
    q, k, v (3 each: float32 words with ``pairs``, :func:`bf16_products`; bytes for 16-bit
    codes, :func:`kv_codes` and :func:`query_codes`), bias and mask (4 each)."""
    tiles_of = tuning.forward_tiles if kind == "forward" else tuning.backward_tiles
    block_q, block_k = tiles_of(problem.visibility, problem.q_len, problem.kv_len, folded=rows_per_position > 1)
    dtype = problem.accumulate_dtype
    chunk = chunk_columns(dtype)
    vector, vector_values, vector_keys, dot_scores = _product_paths(problem, kind, tuning)
    if codes in _SCALED and dot_scores and vector_values and dtype == np.float32:
        block_k = min(block_k, CODE_TILE_KEYS)  # a decode tile read in registers (tiles.codes_in_registers)
    # A problem smaller than a tile gets a tile of its own size: the same single tile,
    # so the same arithmetic, with scratch a small call can allocate in microseconds
    tiles = (min(block_q, max(problem.q_len, 1)), min(block_k, max(problem.kv_len, 1)))
    q_strides, k_strides, v_strides, bias_strides, mask_strides = strides
    ints = problem_int_values(problem)
    ints[Int.Q_STRIDE_B:Int.Q_STRIDE_S + 1] = q_strides
    ints[Int.K_STRIDE_B:Int.K_STRIDE_S + 1] = k_strides
    ints[Int.V_STRIDE_B:Int.V_STRIDE_S + 1] = v_strides
    ints[Int.BIAS_STRIDE_B:Int.BIAS_STRIDE_K + 1] = bias_strides
    ints[Int.MASK_STRIDE_B:Int.MASK_STRIDE_K + 1] = mask_strides
    ints[Int.BLOCK_Q], ints[Int.BLOCK_K] = tiles
    ints[Int.EDGE_BAND] = tuning.edge_band
    ints[Int.VECTOR_SCORES], ints[Int.VECTOR_VALUES], ints[Int.VECTOR_KEYS] = vector, vector_values, vector_keys
    ints[Int.DOT_SCORES] = dot_scores
    ints[Int.SCORE_LD] = -(-tiles[1] // chunk) * chunk if vector else tiles[1]
    heads_per_item, ints[Int.HEAD_GROUP] = head_group(problem, kind, ints)
    ints[Int.ROW_PREFETCH] = row_prefetch(problem, ints, codes, tiles)
    ints[Int.TILE_PREFETCH] = (ints[Int.HEAD_GROUP] > 1 and not ints[Int.ROW_PREFETCH]
                               and tile_prefetch_pays(_head_slice_bytes(problem, ints, codes, pairs)))
    ints[Int.KEY_SPLITS], ints[Int.SPLIT_KEYS] = (key_splits(problem, tiles, heads_per_item) if kind == "forward"
                                                  else (1, 1))
    ints[Int.ROW_GROUP] = rows_per_position
    ints[Int.KV_CODES] = codes
    ints[Int.BF16_PRODUCTS] = pairs
    ints[Int.Q_CODES] = q_codes
    # out in q's 16-bit dtype straight from the kernel where it reads q in that dtype (one key
    # range: several are float32 parts merged afterwards)
    out_codes = KvCodes.BFLOAT16 if pairs else q_codes
    ints[Int.OUT_CODES] = out_codes if kind == "forward" and ints[Int.KEY_SPLITS] == 1 else KvCodes.NONE
    ints[Int.CONVERTED_VALUE_ROWS] = tuning.value_rows_converted
    # (K^T packed from k itself: bfloat16 pairs, or float keys whose scores take the packed tile)
    packs_keys = kind == "forward" and (pairs or (not codes and not q_codes and vector and not dot_scores))
    ints[Int.KEY_CACHE_SLOTS] = _key_cache_slots(problem, ints, tuning, pairs) if packs_keys else 0
    ints[Int.CLAIM_RUN] = kv_head_items(ints) if ints[Int.KEY_CACHE_SLOTS] else 1
    ints[Int.BIAS_CODES] = bias_read  # (bias_codes)
    ints[Int.KEY_SCALE_SHIFT] = key_scale_shift(problem, dtype) if kind == "forward" and pairs else 0
    ints[Int.SOFTMAX_SCALE] = (kind == "forward" and pairs and not ints[Int.KEY_SCALE_SHIFT]
                               and softmax_takes_scale(problem, ints))
    ints[Int.QUERY_COPY_WORDS] = query_copy_words(problem) if kind == "forward" and pairs else 0
    if problem.quantized:
        ints[Int.K_SCALE_STRIDE_B:Int.K_SCALE_STRIDE_S + 1] = flat_view_strides(problem.k_scale, SCALE_DTYPE)
        ints[Int.V_SCALE_STRIDE_B:Int.V_SCALE_STRIDE_S + 1] = flat_view_strides(problem.v_scale, SCALE_DTYPE)
    return _frozen(np.array(ints, np.int64)), _frozen(problem_reals(problem, dtype))


def key_scale_shift(problem, dtype) -> int:
    """``e`` where the forward's bfloat16 pair products run on AMX tiles and its scale (in the
    kernels' ``dtype``) is ``2**-e`` (1 <= e <= 30; the default 1/sqrt(D) at D = 64 and 256):
    the packed keys then carry the scale, exactly (:func:`npattn.cpu.tiles.pack_key_tile`),
    instead of a pass over each score tile after the tiles' products (about 8 us of a
    192 x 384 tile's 55 at D = 64, one core of the Sapphire Rapids VM). Else 0."""
    from .amx import TILES

    if not TILES:
        return 0
    mantissa, exponent = math.frexp(float(np.dtype(dtype).type(problem.scale)))
    return 1 - exponent if mantissa == 0.5 and 1 <= 1 - exponent <= 30 else 0


def query_copy_words(problem) -> int:
    """``Int.QUERY_COPY_WORDS`` of a forward with bfloat16 pair products: where they run on
    AMX tiles, the row stride (float32 words of pairs, whole 64-byte lines) of each work
    item's query rows copied onto lines where q's are not on them (a tile row across two
    lines loads at about half speed: :func:`npattn.cpu.tiles.queries_off_lines`); else 0."""
    from .amx import TILES

    if not TILES:
        return 0
    line = 16  # (float32 words)
    return -(-(problem.head_dim // 2) // line) * line


def softmax_takes_scale(problem, ints) -> bool:
    """Whether a bfloat16 forward on AMX tiles leaves the scale to its softmax: where the
    scores need it nowhere before exp (no softcap, bias, ALiBi; dropout's exp stores
    probabilities) and it is positive (the max pass keeps its place). The pass over each
    score tile after the tiles' products then goes (:func:`key_scale_shift` does that
    for powers of two, exactly)."""
    from .amx import TILES

    return bool(TILES and problem.scale > 0 and not ints[Int.HAS_SOFTCAP] and not ints[Int.HAS_BIAS]
                and not ints[Int.HAS_ALIBI] and not ints[Int.HAS_DROPOUT])


def _key_cache_slots(problem, ints, tuning: Tuning, pairs: bool) -> int:
    """How many key tiles a forward keeps packed per thread (:func:`npattn.cpu.tiles.
    cached_key_tile`; from the first, at most ``tuning.key_cache_bytes`` of them; ``pairs``:
    bfloat16 pairs'): 0 where no tile is read twice (one query tile per kv head)."""
    block_q, block_k, ld = int(ints[Int.BLOCK_Q]), int(ints[Int.BLOCK_K]), int(ints[Int.SCORE_LD])
    if -(-problem.q_len // block_q) * problem.group_size < 2:
        return 0
    element = 4 if pairs else np.dtype(problem.accumulate_dtype).itemsize
    slot_bytes = element * sum(cache_slot_words(problem.head_dim, problem.value_dim, block_k, ld, pairs))
    return min(-(-problem.kv_len // block_k), tuning.key_cache_bytes // slot_bytes)


def kv_head_items(ints) -> int:
    """The forward's work items of one entry's kv head (consecutive items: its heads' query
    tiles and key ranges, :func:`npattn.cpu.forward_kernel.forward_items`)."""
    heads_per_item = ints[Int.HEADS] // ints[Int.KV_HEADS] // ints[Int.HEAD_GROUP]
    return int(max(1, heads_per_item) * -(-ints[Int.Q_LEN] // ints[Int.BLOCK_Q]) * ints[Int.KEY_SPLITS])


def cache_slot_words(head_dim, value_dim, keys, ld, pairs):
    """The elements (float32 words with ``pairs``) of one slot of
    :func:`npattn.cpu.tiles.key_cache`, its key tile and its values: with ``pairs``
    (BF16_PRODUCTS) K^T in pairs as :func:`~npattn.cpu.tiles.pack_key_tile` packs it (D / 2
    x SCORE_LD) and the values as :func:`~npattn.cpu.tiles.pack_value_pairs` packs them
    (BLOCK_K / 2 x Dv); else K^T (D x SCORE_LD) and no values (P V reads v where it lies).
    Plain Python: the kernels compile it too."""
    if pairs:
        return head_dim // 2 * ld, (keys + 1) // 2 * value_dim
    return head_dim * ld, 0


# Plans by (kind, tuning, rows per position, problem signature without the seed)
_PLANS = PlanCache()


def _frozen(fresh_view):
    """``fresh_view``, a view made here, marked read-only (its base keeps its own flags).
    (``setflags``: 0.1 us less than setting ``flags.writeable``, which makes a flags
    object first; a small call makes three such views.)"""
    fresh_view.setflags(write=False)
    return fresh_view


def read_only(array):
    """``array`` if read-only, else a read-only view of it (the caller's flags untouched)."""
    if not array.flags.writeable:
        return array
    view = array.view()
    view.flags.writeable = False
    return view


@functools.lru_cache(maxsize=None)
def _placeholders(dtype):
    """Read-only 1-element stand-ins for absent arrays: ``(dtype, uint8)``, made once."""
    placeholder, mask = np.zeros(1, dtype), np.ones(1, np.uint8)
    placeholder.flags.writeable = mask.flags.writeable = False
    return placeholder, mask
