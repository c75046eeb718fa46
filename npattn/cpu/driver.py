"""The CPU backend's entry points: allocate outputs, run the kernels, package results."""
from __future__ import annotations

import contextlib
import copy
import functools
import threading
import weakref

import numpy as np

from ..core.arrays import all_finite, all_finite_arrays
from ..core.kernel_params import OPERAND_NAMES, sink_logits_gradient
from ..runtime.plans import PlanCache
from ..core.problem import signature
from ..core.quantization import RunScales
from ..core.results import ForwardResult, Gradients
from .backward_kernel import backward_items, backward_kernel, dbias_kernel
from . import folding, splitting
from .blas import single_threaded_blas
from .conversion import BYTES, NARROW, conversion_entry, converted, kept_widened
from .delta import delta_of_rows
from .finiteness import finiteness_entry
from .forward_kernel import forward_items, forward_kernel, weights_kernel
from .threads import NON_FINITE, configured_threads, direct_entry, new_counter, run_items, runs_inline
from .scratch import (backward_scratch_specs, begin_reuse, dbias_scratch_specs, end_reuse, forward_scratch_specs, fresh_set,
                      scratch_set, weights_scratch_specs, with_dropout_copy, zeros_maker)
from .operands import (WORDS, Int, KvCodes, flat_memory, memory_order, pair_words, read_only, operand_plan, row_order,
                       row_strides, row_view_strides, widened)
from .tuning import Tuning, current


def forward(problem, for_gradients: bool = False) -> ForwardResult:
    """out (B, H, Sq, Dv) as a bhsd view of an array in the user's layout, lse (B, H, Sq),
    and weights when asked; ``saved`` keeps (out, lse) for the backward (``for_gradients``:
    a forward whose backward follows, whose saved out is in the compute dtype:
    :meth:`ForwardPlan.for_gradients`)."""
    plan = forward_plan(problem, current())
    if for_gradients:
        plan = plan.for_gradients()
    return plan(problem.q, problem.k, problem.v, problem)


def forward_plan(problem, tuning: Tuning) -> "ForwardPlan":
    """The :class:`ForwardPlan` of ``problem``'s signature under ``tuning``, made on first
    use and kept (the newest 256)."""
    return _FORWARD_PLANS.get_or_make((tuning, signature(problem, seed=False)),
                                      lambda: ForwardPlan(problem, tuning))


_FORWARD_PLANS = PlanCache()


class ForwardPlan:
    """Everything a forward derives from its problem's signature (shapes, strides, dtypes,
    option values) under one tuning, worked out once: whether GQA heads fold into rows,
    the kernels' parameters, the work items, the scratch sizes, the outputs' shapes. A
    call (:meth:`__call__`) then only views its arrays, allocates the outputs and runs the
    kernels: a small call's cost is the kernel's, not Python's."""

    def __init__(self, problem, tuning: Tuning):
        self.tuning = tuning
        self.dtype = dtype = np.dtype(problem.accumulate_dtype)
        # out's 16-bit dtype, or None (the dtype asked once here: 0.5 us of a small call)
        self.narrow = _narrow_dtype(problem)
        self.group = problem.group_size if folding.foldable(problem, tuning) else 1
        self.layout = problem.layout
        self.fold_shape = None
        if self.group > 1:  # GQA: the query heads of a group as rows of one kv head
            self.fold_shape = folding.fold_shape(problem)
            problem = folding.fold(problem)
        self.operands = operand_plan(problem, "forward", tuning, self.group)
        ints = self.operands.ints
        self.items = int(forward_items(ints))
        self.splits = int(ints[Int.KEY_SPLITS])
        self.blas = not (ints[Int.VECTOR_SCORES] and ints[Int.VECTOR_VALUES] and ints[Int.VECTOR_KEYS])
        flops = _forward_flops(problem)
        self.inline = runs_inline(flops, self.items)
        self.pool_inline = runs_inline(flops, self.items, pool=True)
        self.weights = problem.return_weights
        self.bshd = problem.layout == "bshd"
        heads, q_len, value_dim = problem.heads, problem.q_len, problem.value_dim
        batch = _memory_batches(problem)
        self.out_shape = (batch, q_len, heads, value_dim) if self.bshd else (batch, heads, q_len, value_dim)
        self.lse_shape = (batch, heads, q_len)
        self.lse_empty = functools.partial(np.empty, self.lse_shape, dtype)
        self.packed_rows = problem.packed_rows
        self.weights_shape = (batch, heads, q_len, problem.kv_len)
        # 16-bit weights are rounded by the weights kernel as it stores each row
        # (tiles.store_weights_row), into their own memory seen as float32 words
        self.weights_codes, self.weights_size = KvCodes.NONE, int(np.prod(self.weights_shape))
        if self.narrow is not None:
            self.weights_codes = KvCodes.BFLOAT16 if self.narrow.name == "bfloat16" else KvCodes.FLOAT16
        self._weights_code = np.int64(self.weights_codes)  # (the weights kernel's argument)
        # each key range's rows go to their own (out, lse) slice, merged after the kernel
        self.parts_shape = (self.splits, batch, heads, q_len, value_dim)
        # element strides of out's batch, head and row, and of a key range's slice
        if self.splits > 1:
            strides = [heads * q_len * value_dim, q_len * value_dim, value_dim, batch * heads * q_len * value_dim]
        elif self.bshd:
            strides = [q_len * heads * value_dim, value_dim, heads * value_dim, 0]
        else:
            strides = [heads * q_len * value_dim, q_len * value_dim, value_dim, 0]
        if problem.packed_rows:  # every entry writes its own rows of the one batch
            strides[0] = 0
        self.out_strides = read_only(np.array(strides, np.int64))
        self._alone = not self.blas and self.splits == 1 and self.inline
        self._for_out(ints)
        self._gradient_plan = None  # (for_gradients', made on first use)

    def _for_out(self, ints) -> None:
        """What depends on how the kernel writes out (``Int.OUT_CODES`` of ``ints``, this
        plan's operands' parameters): the scratch, out's allocation, the kernels' typed entry
        points and a 16-bit out's conversion."""
        dtype = self.dtype
        self.scratch_specs = forward_scratch_specs(ints, dtype)
        self.weights_specs = weights_scratch_specs(ints, dtype)
        # out straight in its 16-bit dtype (OUT_CODES: the kernel rounds each row it sums),
        # else in the compute dtype
        self.out_codes = bool(ints[Int.OUT_CODES])
        # which is made as the float32 words the kernel takes (half as many a row: OUT_CODES
        # has an even Dv) and handed back viewed as its dtype: a view to the smaller item
        # costs 0.2 us, where the kernel's view of a 16-bit array as words cost a small call 1 us
        made_shape = (*self.out_shape[:-1], self.out_shape[-1] // 2) if self.out_codes else self.out_shape
        made_dtype = WORDS if self.out_codes else dtype
        self.out_zeros = zeros_maker(made_shape, made_dtype)
        # (a call whose rows are all live: the kernel writes both whole)
        self.out_empty = zeros_maker(made_shape, made_dtype, zeroed=False)
        # calls whose whole work is one inline kernel call (no BLAS to pin, no key ranges
        # to merge), and the weights kernel's after it where asked, run, from the second
        # plain call on, the kernels' entry points (threads.direct_entry, typed after the
        # first) on the plan's own scratch: no dispatcher, item runner or arena. The entries
        # (forward's, weights' or None) by the kind of run they were typed for, (a plain call,
        # the alignment of q, k and v): a plain call's operands and a kept run's need not be
        # of one type, and the first runs of a structure that npattn.attention plans are the
        # full path's (kept runs), its later ones plain calls; None where a kernel was never
        # compiled for those types
        self._entries: dict = {}
        # (the runs of one problem: a weak reference to it, and its option operands)
        self._kept_options = None
        # and a 16-bit out's conversion on that path: the conversion's entry point, into a
        # fresh array of out's memory shape (2.3 us of converted() become 0.7)
        self._narrow_out = (conversion_entry(dtype, self.narrow, int(np.prod(self.out_shape)))
                            if self.narrow is not None and self._alone and not self.out_codes else None)
        self._scratch = threading.local()

    def for_gradients(self) -> "ForwardPlan":
        """The plan of this signature's forwards whose backward follows: this one, or where
        it writes a 16-bit out (OUT_CODES), one that writes out in float32 and rounds it
        afterwards, whose saved out is that float32 product. The backward's gradient of a
        row's dominant key subtracts O from the key's value (``dO . (z v - O)``:
        :func:`~npattn.cpu.backward_kernel.dominant_key_gradient`), exact only for the
        forward's own product: a rounded O left its rounding, times the scale and |q| or
        |k|, in dq and dk of nearly one-hot rows (a float16 dq of 0.8 where the exact
        one is 0, at scale 1e4 with dropout). Made from this plan on first use (a decode
        loop whose key count grows makes a plan a step, and most never run a backward)."""
        if not self.out_codes:
            return self
        plan = self._gradient_plan
        if plan is None:  # (two threads may both make one: either serves)
            plan = copy.copy(self)
            plan.operands = self.operands.with_float_out()
            plan._for_out(plan.operands.ints)
            self._gradient_plan = plan
        return plan

    def __call__(self, q, k, v, arrays=None) -> ForwardResult | None:
        """The forward of bhsd ``q``, ``k``, ``v`` (this plan's shapes, strides and dtypes)
        with the option arrays and seed of ``arrays`` (a problem of this plan's signature;
        None: no option arrays). None when the calling context's tuning is no longer the
        plan's (the caller plans again)."""
        tuning = current()
        if tuning is not self.tuning and tuning != self.tuning:
            return None
        dtype = self.dtype
        if self.group > 1:
            q = folding.fold_rows(q, self.fold_shape)
        # a quantized step's run (its plan's problem with the run's scales), or a run of a
        # plan's own problem whose option arrays are the plan's copies (lengths, starts,
        # offsets, pages, ALiBi slopes, sink logits; no mask or bias, which are read where
        # they lie, nor dropout's per-run seed): the option operands of that problem are
        # the same on every run, kept from the first
        run = arrays if type(arrays) is RunScales else None
        if run is not None:
            owner = run.problem
        elif arrays is not None and self._keeps_options(arrays):
            owner = arrays
        else:
            owner = None
        # the kernel's machine code called directly: a plain call (no option arrays, whose
        # views are the caller's; 16-bit keys read as bytes have none either, and their byte
        # views are always aligned), or such a run, on arrays of the kind and alignment the
        # entry was typed for
        direct = self._alone and (arrays is None or owner is not None)
        entry = None
        if direct and self._entries:
            if arrays is None:
                ops = self.operands.entry_operands(q, k, v)
            else:
                kept = self._kept_options
                ops = None
                if kept is not None and kept[0]() is owner:
                    ops = (self.operands.scale_run_operands(q, k, v, run, kept[1]) if run is not None
                           else self.operands.kept_operands(q, k, v, kept[1]))
            if ops is not None:
                entry = self._entries.get((arrays is None, _alignment(ops, run)))
        if entry is None:
            if self.group > 1 and arrays is not None:
                arrays = folding.FoldedArrays.of(arrays, self.group)
            ops = self.operands.operands(q, k, v, arrays)
            if owner is not None:  # (held weakly: a plan's problem may hold a caller's arrays)
                self._kept_options = (weakref.ref(owner), tuple(ops[_OPTIONS]))
            if self._every_row_written(arrays):  # (zeroing out cost a big call 1-2 ms)
                out, lse = self.out_empty(), self.lse_empty()
            else:
                out = self.out_zeros()
                lse = np.empty(self.lse_shape, dtype)
                lse.fill(-np.inf)  # (np.full, in Python, costs a small call 4 us more)
        else:  # every row is live: the kernel writes out and lse whole
            out, lse = self.out_empty(), self.lse_empty()
        if self.splits > 1:
            out_parts = np.zeros(self.parts_shape, dtype)
            lse_parts = np.full(self.parts_shape[:-1], -np.inf, dtype)
        else:
            out_parts, lse_parts = out, lse
        flat_out = out_parts.reshape(-1)  # (out's words, with OUT_CODES)
        if self.out_codes:
            out = out.view(self.narrow)
        if entry is not None:
            # one inline kernel call (two with weights) on the plan's own scratch: no reuse arena,
            # no item runner
            forward_entry, weights_entry = entry
            configured_threads()  # (a bad NPATTN_NUM_THREADS fails every call)
            status = new_counter(1)
            flat_lse = lse.reshape(-1)
            forward_entry(*ops, flat_out, self.out_strides, flat_lse, *self._own_scratch(), status, self.items)
            weights = None
            if weights_entry is not None:
                weights, memory = self._new_weights()
                weights_entry(*ops, flat_lse, memory, self._weights_code, *self._own_scratch(True), new_counter(1),
                              self.items)
            narrow = None
            if self._narrow_out is not None:
                narrow = np.empty(self.out_shape, self.narrow)
                self._narrow_out(flat_out, narrow.reshape(-1).view(BYTES))
            if self.bshd:
                out = out.transpose(0, 2, 1, 3)
                narrow = None if narrow is None else narrow.transpose(0, 2, 1, 3)
            return self._result(out, lse, weights, status, narrow)
        pin = single_threaded_blas() if self.blas else _NO_PIN
        with pin:
            begin_reuse()
            try:
                arguments = (*ops, flat_out, self.out_strides, lse_parts.reshape(-1))
                status = run_items(forward_kernel, arguments, self.items, lambda: scratch_set(self.scratch_specs),
                                   self.inline, self.pool_inline)
                kind = (arrays is None, _alignment(ops, run)) if direct else None
                if self.bshd:
                    out = out.transpose(0, 2, 1, 3)
                if self.splits > 1:
                    splitting.merge(out_parts, lse_parts, out, lse, self._sink_rows(arrays))
                weights, weights_arguments = None, None
                if self.weights:
                    weights, memory = self._new_weights()
                    weights_arguments = (*ops, lse.reshape(-1), memory, self._weights_code)
                    run_items(weights_kernel, weights_arguments, self.items, lambda: scratch_set(self.weights_specs),
                              self.inline, self.pool_inline)
                if kind is not None and kind not in self._entries:
                    self._entries[kind] = self._typed_entries(arguments, weights_arguments, status)
            finally:
                end_reuse()
        return self._result(out, lse, weights, status)

    def _new_weights(self):
        """``(weights, memory)``: zeroed weights of the call, in the compute dtype or (16-bit
        results) the 16-bit one, and the flat array the weights kernel writes: the weights
        themselves, or their 16-bit memory seen as float32 words (one spare element where
        their count is odd)."""
        if self.weights_codes == KvCodes.NONE:
            weights = np.zeros(self.weights_shape, self.dtype)
            return weights, weights.reshape(-1)
        size = self.weights_size
        memory = np.zeros(size + size % 2, self.narrow)
        return memory[:size].reshape(self.weights_shape), memory.view(WORDS)

    def _sink_rows(self, arrays):
        """The sink logit of every (folded) row, (H', Sq') as out's heads and rows lie,
        for the merge of key ranges; None without sink logits. A folded row r of kv head h
        is query head h * group + r % group."""
        if arrays is None or arrays.sink_logits is None:
            return None
        sink = np.asarray(arrays.sink_logits, self.dtype)
        group = self.group
        q_len = self.fold_shape[3] if group > 1 else 1  # (unfolded: one column, broadcast over the rows)
        return np.tile(sink.reshape(-1, group), (1, q_len))

    def _keeps_options(self, arrays) -> bool:
        """Whether the option operands of the plain problem ``arrays`` may be kept for the
        runs that pass it again: no mask or bias (views of arrays the caller may write
        between runs), no dropout (a seed per run), and every row written (the direct
        entry allocates out and lse without zeros)."""
        return (arrays.mask is None and arrays.bias is None and not self.operands.dropout
                and self._every_row_written(arrays))

    def _every_row_written(self, arrays) -> bool:
        """Whether this call writes every row of out and lse, so they need no zeros first:
        the merge of key ranges writes them whole, and the kernel writes every live row,
        which is every row unless query lengths or starts (``arrays``'), or packed
        entries, leave some out."""
        if self.splits > 1 or arrays is None:
            return True
        return not self.packed_rows and arrays.q_start is None and arrays.q_lengths is None

    def _result(self, out, lse, weights, status, narrow=None) -> ForwardResult:
        """The :class:`ForwardResult` of a run's out, lse, weights (all bhsd as the kernel
        wrote them, folded rows included) and the kernel's status; ``narrow``: out in its
        16-bit dtype already, viewed as out is (else converted here where out needs it; out
        itself with OUT_CODES)."""
        if self.group > 1:
            weights = None if weights is None else folding.unfold_rows(weights, self.fold_shape)
            out = folding.in_layout(folding.unfold_rows(out, self.fold_shape), self.layout)
            if narrow is not None:
                narrow = folding.in_layout(folding.unfold_rows(narrow, self.fold_shape), self.layout)
            lse = folding.unfold_rows(lse, self.fold_shape)
        if self.out_codes:  # (a plain call's: a vjp's forward runs for_gradients', without OUT_CODES)
            narrow = out
        # a 16-bit out converted here, on the vector units (the backward keeps float32's; with
        # OUT_CODES the kernel wrote the 16-bit one, and there is no float32 one)
        shown = narrow if narrow is not None or self.narrow is None else converted(out, self.narrow)
        # the kernel saw every out row it wrote; merged key ranges are new rows it did not see
        finite = not status[NON_FINITE] if self.splits == 1 else None
        # (positional: keywords cost a small call 0.2 us)
        return ForwardResult(out if shown is None else shown, lse, weights, (out, lse), finite)

    def _typed_entries(self, arguments, weights_arguments, counter) -> tuple | None:
        """``(forward's, weights' or None)`` entry points for kernel arguments of these types
        (:func:`~npattn.cpu.threads.direct_entry`), or None where one was never compiled."""
        forward = direct_entry(forward_kernel, (*arguments, *self._own_scratch(), counter, self.items))
        if weights_arguments is None:
            return None if forward is None else (forward, None)
        weights = direct_entry(weights_kernel, (*weights_arguments, *self._own_scratch(True), counter, self.items))
        return None if forward is None or weights is None else (forward, weights)

    def _own_scratch(self, weights: bool = False) -> tuple:
        """This plan's scratch set for the calling thread, the forward kernel's or (``weights``)
        the weights kernel's (a plan may run on several threads at once; each call on one
        thread is done with it before the next starts)."""
        name = "weights_set" if weights else "set"
        scratch = getattr(self._scratch, name, None)
        if scratch is None:
            scratch = fresh_set(self.weights_specs if weights else self.scratch_specs)
            setattr(self._scratch, name, scratch)
        return scratch


_NO_PIN = contextlib.nullcontext()


def _narrow_dtype(problem):
    """The 16-bit dtype (float16 or bfloat16) a float32 computation of ``problem`` hands its
    results back in, or None."""
    return problem.dtype if problem.dtype.name in NARROW and problem.accumulate_dtype == np.float32 else None


# The gradients of a backward whose dq, dk and dv take at most this many bytes together (in
# the compute dtype, one key chunk) share one block: a small call's per-array costs (the
# allocations, the checks, a 16-bit call's three roundings) were a fifth of a (1, 8, 16 x 16,
# 64) float16 forward and backward. Larger ones own their memory, so that a caller who keeps
# one gradient keeps no other alive.
_GRADIENT_BLOCK_BYTES = 1 << 20
_KEPT_DOUT, _KEPT_OUT = kept_widened("dout"), kept_widened("out")
# Values of a 16-bit dout widened at a time for delta (1 MiB of float32, kept per thread)
_DELTA_BLOCK = 1 << 18


def _delta_of_16_bit(dout, out):
    """delta = rowsum(dout * out), (B, H, Sq) float32, for a bhsd 16-bit ``dout`` and
    float32 ``out``: where both lie in one memory order, dout's rows widened a block at a
    time into a kept array, each block's row sums by einsum in float32, the bits of a
    float32 copy's. einsum's own casts of a 16-bit operand (NumPy's scalar float16 loop)
    took 5.6-6x as long: on the 2-core Zen 3 VM, 2.7-3.6 ms against 0.45-0.64 ms here at
    (1, 8, 2048, 64), 22 against 11 us at (1, 8, 16, 64). The blocks keep dout's float32
    copy to 1 MiB; a dout of one block, or of another memory order than out, is widened whole."""
    dtype, width = out.dtype, dout.shape[-1]
    order = None if dout.size <= _DELTA_BLOCK else memory_order(dout, dout.dtype)
    if order is None or order != memory_order(out, dtype):
        return np.einsum("bhsd,bhsd->bhs", widened(dout, dtype, _KEPT_DOUT), out)
    words, values = flat_memory(dout, order), flat_memory(out, order)
    sums = np.empty(dout.size // width, dtype)  # the rows in memory order
    step = max(1, _DELTA_BLOCK // width) * width
    for start in range(0, words.size, step):
        block = widened(words[start:start + step], dtype, _KEPT_DOUT)
        rows = block.size // width
        first = start // width
        np.einsum("rd,rd->r", block.reshape(rows, width), values[start:start + step].reshape(rows, width),
                  out=sums[first:first + rows])
    # (the orders memory_order gives are their own inverses; C-contiguous in (B, H, S) as
    # einsum's: the sink logits' gradient sums it over rows, in an order a view would change)
    return np.ascontiguousarray(sums.reshape([dout.shape[axis] for axis in order[:-1]]).transpose(order[:-1]))


def _narrowed(gradient, dtype, entry) -> tuple:
    """``(narrow, finite)``: a C-contiguous float32 gradient in the 16-bit ``dtype``, and
    whether every value of it is finite (none NaN or infinite, none rounded past the
    16-bit range). ``entry``: the conversion's entry point for the gradient's size
    (:func:`~npattn.cpu.conversion.conversion_entry`, which checks as it rounds), or None:
    :func:`~npattn.cpu.conversion.converted` or NumPy's astype, then a pass to check."""
    if entry is not None:
        narrow = np.empty(gradient.shape, dtype)
        return narrow, not entry(gradient.reshape(-1), narrow.reshape(-1).view(BYTES))
    narrow = converted(gradient, dtype)
    if narrow is None:
        with np.errstate(over="ignore"):
            narrow = gradient.astype(dtype)
    return narrow, all_finite(narrow)


def _memory_batches(problem) -> int:
    """The batch entries of out, lse and the gradients: B, or 1 for packed rows
    (``problem.packed_rows``: each entry's live rows are its own rows of one batch)."""
    return 1 if problem.packed_rows else problem.batch


def _forward_flops(problem) -> float:
    """The forward's dense work, 2 B H Sq Sk (D + Dv): what decides running inline."""
    return 2.0 * problem.batch * problem.heads * problem.q_len * problem.kv_len * (problem.head_dim + problem.value_dim)


# Enough (batch, kv head, key chunk) items to keep this many cores busy, fixed so that
# the chunking, and so the summation order of dq, never depends on the machine.
_BACKWARD_ITEMS = 8
# The most memory the key chunks' extra copies of dQ may take before a backward splits
# its GQA groups' query heads instead (BackwardPlan)
_DQ_COPIES_BYTES = 64 << 20


def backward(problem, saved, dout) -> Gradients:
    """Gradients of ``sum(out * dout)`` from the saved (out, lse); ``dout`` is bhsd."""
    return backward_plan(problem, current())(problem.q, problem.k, problem.v, saved, dout, problem, checked=False)


def backward_plan(problem, tuning: Tuning) -> "BackwardPlan":
    """The :class:`BackwardPlan` of ``problem``'s signature under ``tuning``, made on first
    use and kept (the newest 256)."""
    return _BACKWARD_PLANS.get_or_make((tuning, signature(problem, seed=False)),
                                       lambda: BackwardPlan(problem, tuning))


_BACKWARD_PLANS = PlanCache()


class BackwardPlan:
    """The backward's counterpart of :class:`ForwardPlan`: parameters, key chunks, work
    items, scratch sizes and gradient shapes of one signature under one tuning."""

    def __init__(self, problem, tuning: Tuning):
        self.tuning = tuning
        self.dtype = dtype = problem.accumulate_dtype
        self.operands = operand_plan(problem, "backward", tuning)
        self.narrow = _narrow_dtype(problem)
        ints = self.operands.ints
        heads, q_len, head_dim = problem.heads, problem.q_len, problem.head_dim
        kv_heads, kv_len, value_dim = problem.kv_heads, problem.kv_len, problem.value_dim
        batch = problem.batch
        key_tiles = -(-kv_len // int(ints[Int.BLOCK_K]))
        wanted = -(-_BACKWARD_ITEMS // max(1, batch * kv_heads))  # work items per kv head
        # key chunks each keep a copy of dQ; where those copies would pass _DQ_COPIES_BYTES
        # (MQA's 8 were 268 MB at (1, 32/1, 2048, 128)), the query heads of the GQA group
        # are cut into parts instead, each with its own dK and dV, where those are the
        # smaller (key chunks were 5-15% faster where both fit: npattn/cpu/TUNING.md)
        group = heads // kv_heads
        gradient_batch = _memory_batches(problem)
        copies = (min(key_tiles, wanted) - 1) * gradient_batch * heads * q_len * head_dim
        self.head_parts = head_parts = (
            min(group, wanted) if (group > 1 and copies * np.dtype(dtype).itemsize > _DQ_COPIES_BYTES
                                   and kv_len * (head_dim + value_dim) < group * q_len * head_dim) else 1)
        self.chunks = chunks = max(1, min(key_tiles, -(-wanted // head_parts)))
        self.items = int(backward_items(ints, chunks, head_parts))
        self.blas = not (ints[Int.VECTOR_SCORES] and ints[Int.VECTOR_VALUES] and ints[Int.VECTOR_KEYS])
        self.flops = _forward_flops(problem)
        self.inline = runs_inline(self.flops, self.items, backward=True)
        self.pool_inline = runs_inline(self.flops, self.items, pool=True)
        self.scratch_specs = backward_scratch_specs(ints, dtype)
        self.dq_shape = (chunks, gradient_batch, heads, q_len, head_dim)
        self.dk_shape = (head_parts, gradient_batch, kv_heads, kv_len, head_dim)
        self.dv_shape = (head_parts, gradient_batch, kv_heads, kv_len, value_dim)
        self.dbias = None
        if problem.bias is not None:  # (shape as 4-D, its array for the kernel, items, user shape,
            # scratch, and whether its kernel runs inline with the crew and with the pool)
            shape = (1,) * (4 - len(problem.bias_shape)) + tuple(problem.bias_shape)
            items = int(shape[0] * shape[1] * (-(-q_len // int(ints[Int.BLOCK_Q])) if shape[2] > 1 else 1)
                        * (key_tiles if shape[3] > 1 else 1))
            self.dbias = (shape, read_only(np.array(shape, np.int64)), items, tuple(problem.bias_shape),
                          dbias_scratch_specs(ints, dtype), runs_inline(self.flops, items, backward=True),
                          runs_inline(self.flops, items, pool=True))
        # a 16-bit bias's gradient rounded into its dtype here, on the vector units, and
        # checked as it rounds (NumPy's float16 astype in the public layer, a scalar loop, had
        # taken a (1, 8, 256 x 256, 64) float16 forward and backward with a bias 1.6x float32's
        # time): (its dtype, the conversion's entry point for its size or None), or None
        self._dbias_narrowing = None
        if problem.bias is not None and problem.bias.dtype.name in NARROW and dtype == np.float32:
            size = int(np.prod(problem.bias_shape))
            self._dbias_narrowing = (problem.bias.dtype, conversion_entry(dtype, problem.bias.dtype, size))
        # a small call's dq, dk and dv: consecutive parts of one block (one allocation, one
        # pass to check or round them); None: three arrays (a large call's gradients each own
        # their memory, so keeping one of them keeps no other alive)
        shapes = (self.dq_shape, self.dk_shape, self.dv_shape)
        sizes = [int(np.prod(shape)) for shape in shapes]
        self._block = None
        if chunks == 1 and head_parts == 1 and sum(sizes) * np.dtype(dtype).itemsize <= _GRADIENT_BLOCK_BYTES:
            starts = np.cumsum([0, *sizes]).tolist()
            self._block = (starts[-1], tuple(map(slice, starts, starts[1:])), tuple(shape[1:] for shape in shapes))
        # a 16-bit problem's dk and dv rounded by the kernel as it writes each key tile's rows,
        # and checked as they round (one head part: parts are summed afterwards; not a small
        # call's block, which one pass rounds; even head dims, so that the 16-bit arrays are
        # whole float32 words: a tile's rows are one run, its last vector masked where the
        # run is not whole vectors): no float32 dk and dv,
        # nor a pass over them (which had taken (1, 8, 16 x 1024, 64)'s float16 backward
        # 0.11 of 0.66 ms, and its float32 dk and dv 4 MB of fresh memory): a KvCodes
        self.gradient_codes = KvCodes.NONE
        if (self.narrow is not None and dtype == np.float32 and self._block is None and head_parts == 1
                and head_dim % 2 == 0 and value_dim % 2 == 0):
            self.gradient_codes = KvCodes.BFLOAT16 if np.dtype(self.narrow).name == "bfloat16" else KvCodes.FLOAT16
        # the other 16-bit gradients rounded, and checked, by the conversion's entry points
        # (no dispatcher: 1.5-2 us of each of a small call's three), the block's in one call
        # (a (1, 8, 16 x 16, 64) float16 call: 6.1 us for its three arrays, 4.0 for their block)
        self._narrowings = tuple(None if self.narrow is None or self._block is not None
                                 or (self.gradient_codes and index > 0)
                                 else conversion_entry(dtype, self.narrow, int(np.prod(shape)))
                                 for index, shape in enumerate((self.dq_shape[1:], self.dk_shape[1:],
                                                                self.dv_shape[1:])))
        self._block_narrowing = (None if self.narrow is None or self._block is None
                                 else conversion_entry(dtype, self.narrow, self._block[0]))
        # and delta and float32 or float64 gradients checked by a jitted pass's entry point
        self._finite = finiteness_entry(dtype)
        # row strides of dout and out by layout (the kernel's int64 arrays, kept: a layout
        # seen before is viewed with no stride arithmetic)
        self._layouts: dict = {}
        # a plain call whose whole work is one inline kernel call runs, from the second on,
        # the kernel's entry point (threads.direct_entry) on the plan's own scratch, as the
        # forward's do: (the alignment of the arrays it was typed for, the entry point or None)
        self._alone = not self.blas and self.dbias is None and self.inline
        self._entry = None
        self._scratch = threading.local()

    def __call__(self, q, k, v, saved, dout, arrays=None, checked=True) -> Gradients | None:
        """The gradients for bhsd ``q``, ``k``, ``v``, the forward's ``saved`` (out, lse)
        and bhsd ``dout``, with the option arrays and seed of ``arrays`` (as for
        :meth:`ForwardPlan.__call__`). None when the tuning changed since planning, and,
        ``checked``, where ``dout`` or a gradient is not all finite (the caller's full
        path answers: :mod:`npattn.runtime.nonfinite`). The checks ride on work the
        backward does anyway: dout's on delta = rowsum(dout * out), which is NaN or
        infinite in every row where dout is, and so is checked before the kernels run
        (a delta that overflowed float32 from finite values fails it too, and the full
        path answers that call); a 16-bit problem's gradients' as they are rounded
        (their own pass over a small call's float16 gradients took 3 times the
        conversion's time)."""
        tuning = current()
        if tuning is not self.tuning and tuning != self.tuning:
            return None
        out, lse = saved
        dtype = self.dtype
        # a plain call whose plan ran the kernel's entry point before: q, k and v viewed for it
        # as a forward's entry views them, not marked read-only (operands' setflags and views
        # took a (1, 8, 16 x 16, 64) float16 backward 3.2 us, these 1.0; the kernel was typed
        # read-only, so it never writes them); the full operands where the entry is not taken
        kept = self._entry
        viewed = self._alone and arrays is None and kept is not None and kept[1] is not None
        ops = self.operands.entry_operands(q, k, v) if viewed else self.operands.operands(q, k, v, arrays)
        # out is the forward's float32 (a vjp's forward keeps it: ForwardPlan.for_gradients), or
        # a 16-bit out (attention_backward given one) widened into an array this thread keeps
        # for the next call
        codes = self.operands.q_codes
        pairs = self.operands.pairs
        dout_strides = self._sixteen_bit_strides(dout) if (codes or pairs) and dout.dtype == q.dtype else None
        if dout_strides is not None:
            # a 16-bit dout read as it lies where q is (Q_CODES), its rows converted where the
            # kernel uses them; delta and the widened out in one pass over both where it can,
            # else delta from dout widened a block of rows at a time
            dout_flat = pair_words(dout)
            rows = delta_of_rows(dout, out, _KEPT_OUT) if self.narrow is not None else None
            if rows is not None:
                delta, out = rows
            else:
                out = widened(out, dtype, _KEPT_OUT)
                delta = _delta_of_16_bit(dout, out)
        else:
            out = widened(out, dtype, _KEPT_OUT)
            # a 16-bit dout widened once, for the kernels and for delta (it was widened twice: a
            # second copy, 4 MB of fresh pages at (1, 8, 2048, 64)), into a kept array
            dout = widened(dout, dtype, _KEPT_DOUT)
            dout_flat, dout_strides = self._rows(dout, dtype, KvCodes.NONE)
            # rowsum(dO * O), the softmax's backward term: a 16-bit problem's in the order of
            # the pass that reads 16-bit rows (the same bits whichever way its arrays are read)
            rows = delta_of_rows(dout, out) if self.narrow is not None else None
            delta = np.einsum("bhsd,bhsd->bhs", dout, out) if rows is None else rows[0]
            if pairs:  # the products' bfloat16 words of dout (the values they rounded it to anyway)
                dout = np.ascontiguousarray(dout, dtype=q.dtype)
                dout_flat, dout_strides = pair_words(dout), (*(n // 2 for n in row_view_strides(dout, q.dtype)),
                                                            KvCodes.NONE, self.gradient_codes)
        delta_flat = delta.reshape(-1)  # (C-contiguous, as the kernels and the check read it)
        if checked and not self._finite(delta_flat):
            return None
        out_flat, out_strides = self._rows(out, dtype)
        block = None
        if self._block is not None:
            size, parts, _ = self._block
            block = np.zeros(size, dtype)
            flat_dq, flat_dk, flat_dv = block[parts[0]], block[parts[1]], block[parts[2]]
        else:
            dq = np.zeros(self.dq_shape, dtype)
            if self.gradient_codes:  # (whole vectors of 16-bit elements: an even count, whole words)
                dk, dv = np.zeros(self.dk_shape, self.narrow), np.zeros(self.dv_shape, self.narrow)
                flat_dk, flat_dv = dk.reshape(-1).view(WORDS), dv.reshape(-1).view(WORDS)
            else:
                dk, dv = np.zeros(self.dk_shape, dtype), np.zeros(self.dv_shape, dtype)
                flat_dk, flat_dv = dk.reshape(-1), dv.reshape(-1)
            flat_dq = dq.reshape(-1)
        # lse as one type whatever the caller's (writable or not, a slice of a longer one): each
        # distinct array type would compile the backward kernels once more (5-10 s each)
        lse_flat = read_only(np.ascontiguousarray(lse, dtype).reshape(-1))
        if type(dout_strides) is tuple:
            dout_strides = np.array(dout_strides, np.int64)
        direct, entry = self._alone and arrays is None, None
        if direct:  # (the entry point is typed for q, k, v, dout, out and lse of one alignment)
            aligned = (ops[0].flags.aligned, ops[1].flags.aligned, ops[2].flags.aligned, dout_flat.flags.aligned,
                       out_flat.flags.aligned, lse_flat.flags.aligned)
            entry = kept if kept is not None and kept[0] == aligned else None
        if viewed and entry is None:  # (the dispatcher types what it is given: read-only operands, as planned)
            ops = self.operands.operands(q, k, v, arrays)
        common = (*ops, dout_flat, dout_strides, out_flat, out_strides, lse_flat, delta_flat)
        arguments = (*common, flat_dq, flat_dk, flat_dv, self.chunks, self.head_parts)
        dbias = None
        with single_threaded_blas() if self.blas else _NO_PIN:
            begin_reuse()
            try:
                if entry is not None and entry[1] is not None:  # one inline call of the machine code
                    configured_threads()  # (a bad NPATTN_NUM_THREADS fails every call)
                    status = new_counter(1)
                    entry[1](*arguments, *self._own_scratch(), status, self.items)
                else:
                    status = run_items(backward_kernel, arguments, self.items,
                                       lambda: with_dropout_copy(scratch_set(self.scratch_specs)), self.inline,
                                       self.pool_inline)
                    if direct and entry is None:  # typed once per alignment, on the plan's own scratch (None:
                        # those types were never compiled, and every such call keeps the path above)
                        self._entry = (aligned, direct_entry(backward_kernel, (*arguments, *self._own_scratch(),
                                                                               new_counter(1), self.items)))
                if self.dbias is not None:
                    shape, shape_array, items, user_shape, specs, inline, pool_inline = self.dbias
                    dbias = np.zeros(shape, dtype)
                    run_items(dbias_kernel, (*common, dbias.reshape(-1), shape_array), items,
                              lambda: with_dropout_copy(scratch_set(specs)), inline, pool_inline)
                    dbias = dbias.reshape(user_shape)
            finally:
                end_reuse()
        dbias_finite = True
        if dbias is not None and self._dbias_narrowing is not None:
            dbias, dbias_finite = _narrowed(dbias, *self._dbias_narrowing)
        dsink_logits = (None if arrays is None or arrays.sink_logits is None
                        else sink_logits_gradient(np, arrays, lse, delta))
        if block is not None:
            _, parts, shapes = self._block
            if self._block_narrowing is not None:  # the block in q's dtype, rounded and checked in one pass
                narrow = np.empty(block.size, self.narrow)
                finite = not self._block_narrowing(block, narrow.view(BYTES))
                block = narrow
            elif self.narrow is not None:
                narrow, finite = _narrowed(block, self.narrow, None)
                block = narrow
            else:
                finite = not checked or self._finite(block)
            dq, dk, dv = (block[part].reshape(shape) for part, shape in zip(parts, shapes))
        elif self.gradient_codes:  # dk and dv rounded by the kernel (and checked: the status); dq here
            dq, dk, dv = self._summed(dq, dk, dv)
            dq, dq_finite = _narrowed(dq, self.narrow, self._narrowings[0])
            finite = dq_finite and not status[NON_FINITE]
        elif self.narrow is not None:  # the gradients in q's dtype, on the vector units
            dq, dk, dv = self._summed(dq, dk, dv)
            (dq, dq_finite), (dk, dk_finite), (dv, dv_finite) = (
                _narrowed(gradient, self.narrow, entry) for gradient, entry in zip((dq, dk, dv), self._narrowings))
            finite = dq_finite and dk_finite and dv_finite
        else:
            dq, dk, dv = self._summed(dq, dk, dv)
            check = self._finite
            finite = not checked or (check(dq.reshape(-1)) and check(dk.reshape(-1)) and check(dv.reshape(-1)))
        if checked and not (finite and dbias_finite and all_finite_arrays(
                (dbias if self._dbias_narrowing is None else None, dsink_logits))):
            return None
        return Gradients(dq=dq, dk=dk, dv=dv, dbias=dbias, dsink_logits=dsink_logits)

    def _summed(self, dq, dk, dv) -> tuple:
        """dq summed over its key chunks and dk and dv over their head parts, in order (the
        kernel's separate buffers of one problem split further than its kv heads)."""
        dq = dq.sum(axis=0) if self.chunks > 1 else dq[0]
        if self.head_parts > 1:
            return dq, dk.sum(axis=0), dv.sum(axis=0)
        return dq, dk[0], dv[0]

    def _rows(self, array, dtype, code=None) -> tuple:
        """``(flat, strides)`` of :func:`~npattn.cpu.operands.row_strides`, the strides as the
        kernel's int64 array (with ``code`` appended where given: dout's, then the gradients'
        :attr:`gradient_codes`), kept per layout
        that needs no copy: dout and out of a layout seen before cost a view (their stride
        arithmetic and arrays had taken 3 us of a small call each)."""
        key = (array.shape, array.strides, array.dtype, code)
        kept = self._layouts.get(key)
        if kept is not None:
            return flat_memory(array, kept[0]), kept[1]
        flat, strides = row_strides(array, dtype)
        strides = np.array(strides if code is None else (*strides, code, self.gradient_codes), np.int64)
        order = row_order(array, dtype)
        if order is not None and len(self._layouts) < _KEPT_LAYOUTS:
            self._layouts[key] = (order, strides)
        return flat, strides

    def _sixteen_bit_strides(self, dout):
        """The kernel's strides array of a 16-bit ``dout`` (q's dtype) read as it lies: byte
        strides and the codes (Q_CODES), or with bfloat16 pairs strides in words; None where
        its rows cannot be read so (:func:`~npattn.cpu.operands.row_order`). Kept per layout."""
        key = (dout.shape, dout.strides, dout.dtype)
        kept = self._layouts.get(key, False)
        if kept is not False:
            return kept
        strides = None
        if row_order(dout, dout.dtype) is not None:
            elements = row_view_strides(dout, dout.dtype)
            # (with pairs, bfloat16 words the products read as they lie: strides in words)
            strides = np.array((*(n // 2 for n in elements), KvCodes.NONE, self.gradient_codes) if self.operands.pairs
                               else (*(2 * n for n in elements), self.operands.q_codes, self.gradient_codes),
                               np.int64)
        if len(self._layouts) < _KEPT_LAYOUTS:
            self._layouts[key] = strides
        return strides

    def _own_scratch(self) -> tuple:
        """This plan's scratch set for the calling thread, as the kernel takes it
        (:meth:`ForwardPlan._own_scratch`)."""
        scratch = getattr(self._scratch, "set", None)
        if scratch is None:
            scratch = self._scratch.set = with_dropout_copy(fresh_set(self.scratch_specs))
        return scratch


_KEPT_LAYOUTS = 8  # layouts of dout and out a backward plan keeps the strides of


def _alignment(ops, run) -> tuple:
    """Whether q, k and v of ``ops`` are aligned (and, for a quantized step's ``run``, the
    scales: the codes are bytes), as an entry point's types say."""
    if run is None:
        return ops[0].flags.aligned, ops[1].flags.aligned, ops[2].flags.aligned
    return ops[0].flags.aligned, ops[_K_SCALE].flags.aligned, ops[_V_SCALE].flags.aligned


# where a kernel's operands hold the options (bias to reals: the same every run of a
# quantized step) and the scales
_OPTIONS = slice(OPERAND_NAMES.index("bias"), OPERAND_NAMES.index("k_codes"))
_K_SCALE, _V_SCALE = OPERAND_NAMES.index("k_scale"), OPERAND_NAMES.index("v_scale")
