"""The CPU backend's entry points: allocate outputs, run the kernels, package results."""
from __future__ import annotations

import contextlib

import numpy as np

from ..kernel_params import sink_logits_gradient
from ..plans import PlanCache
from ..problem import signature
from ..results import ForwardResult, Gradients
from .backward_kernel import backward_items, backward_kernel, dbias_kernel
from . import folding, splitting
from .blas import single_threaded_blas
from .forward_kernel import forward_items, forward_kernel, weights_kernel
from .threads import run_items
from .scratch import (backward_scratch, begin_reuse, end_reuse, forward_scratch_specs, gradient_tile_scratch,
                      reused, scratch_set, score_tile_specs)
from .operands import Int, _read_only, build_operands, operand_plan, row_strides
from .tuning import Tuning, current


def forward(problem) -> ForwardResult:
    """out (B, H, Sq, Dv) as a bhsd view of an array in the user's layout, lse (B, H, Sq),
    and weights when asked; ``saved`` keeps (out, lse) for the backward."""
    return forward_plan(problem, current())(problem.q, problem.k, problem.v, problem)


def forward_plan(problem, tuning: Tuning) -> "ForwardPlan":
    """The :class:`ForwardPlan` of ``problem``'s signature under ``tuning``, made on first
    use and kept (the newest 256)."""
    key = (tuning, signature(problem, seed=False))
    plan = _FORWARD_PLANS.get(key)
    if plan is None:
        plan = ForwardPlan(problem, tuning)
        _FORWARD_PLANS.put(key, plan)
    return plan


_FORWARD_PLANS = PlanCache()


class ForwardPlan:
    """Everything a forward derives from its problem's signature (shapes, strides, dtypes,
    option values) under one tuning, worked out once: whether GQA heads fold into rows,
    the kernels' parameters, the work items, the scratch sizes, the outputs' shapes. A
    call (:meth:`__call__`) then only views its arrays, allocates the outputs and runs the
    kernels: a small call's cost is the kernel's, not Python's."""

    def __init__(self, problem, tuning: Tuning):
        self.tuning = tuning
        self.dtype = dtype = problem.accumulate_dtype
        self.group = problem.group_size if folding.foldable(problem, tuning) else 1
        self.layout = problem.layout
        self.fold_shape = None
        if self.group > 1:  # GQA: the query heads of a group as rows of one kv head
            self.fold_shape = (problem.batch, problem.kv_heads, problem.group_size, problem.q_len, problem.head_dim)
            problem = folding.fold(problem)
        self.operands = operand_plan(problem, "forward", tuning, self.group)
        ints = self.operands.ints
        self.items = int(forward_items(ints))
        self.splits = int(ints[Int.KEY_SPLITS])
        self.blas = not (ints[Int.VECTOR_SCORES] and ints[Int.VECTOR_VALUES] and ints[Int.VECTOR_KEYS])
        self.flops = _forward_flops(problem)
        self.scratch_specs = forward_scratch_specs(ints, dtype)
        self.weights_specs = score_tile_specs(ints, dtype)
        self.weights = problem.return_weights
        self.bshd = problem.layout == "bshd"
        batch, heads, q_len, value_dim = problem.batch, problem.heads, problem.q_len, problem.value_dim
        self.out_shape = (batch, q_len, heads, value_dim) if self.bshd else (batch, heads, q_len, value_dim)
        self.lse_shape = (batch, heads, q_len)
        self.weights_shape = (batch, heads, q_len, problem.kv_len)
        # each key range's rows go to their own (out, lse) slice, merged after the kernel
        self.parts_shape = (self.splits, batch, heads, q_len, value_dim)
        if self.splits > 1:
            parts_strides = np.zeros(self.parts_shape, dtype).strides
            strides = [*parts_strides[1:4], parts_strides[0]]
        else:
            out = np.zeros(self.out_shape, dtype)
            strides = [*(out.transpose(0, 2, 1, 3) if self.bshd else out).strides[:3], 0]
        self.out_strides = _read_only(np.array([stride // dtype.itemsize for stride in strides], np.int64))

    def __call__(self, q, k, v, arrays=None) -> ForwardResult | None:
        """The forward of bhsd ``q``, ``k``, ``v`` (this plan's shapes, strides and dtypes)
        with the option arrays and seed of ``arrays`` (a problem of this plan's signature;
        None: no option arrays). None when the calling context's tuning is no longer the
        plan's (the caller plans again)."""
        tuning = current()
        if tuning is not self.tuning and tuning != self.tuning:
            return None
        dtype = self.dtype
        q_lengths = None if arrays is None else arrays.q_lengths
        if self.group > 1:
            q = folding.fold_rows(q, self.fold_shape)
            if q_lengths is not None:
                arrays = folding.FoldedArrays(q_lengths * self.group, arrays.kv_lengths)
        ops = self.operands.operands(q, k, v, arrays)
        out = np.zeros(self.out_shape, dtype)
        lse = np.full(self.lse_shape, -np.inf, dtype)
        if self.splits > 1:
            out_parts = np.zeros(self.parts_shape, dtype)
            lse_parts = np.full(self.parts_shape[:-1], -np.inf, dtype)
        else:
            out_parts, lse_parts = out, lse
        pin = single_threaded_blas() if self.blas else _NO_PIN
        with pin:
            begin_reuse()
            try:
                run_items(forward_kernel, (*ops, out_parts.reshape(-1), self.out_strides, lse_parts.reshape(-1)),
                          self.items, lambda: scratch_set(self.scratch_specs), self.flops)
                if self.bshd:
                    out = out.transpose(0, 2, 1, 3)
                if self.splits > 1:
                    splitting.merge(out_parts, lse_parts, out, lse)
                weights = None
                if self.weights:
                    weights = np.zeros(self.weights_shape, dtype)
                    run_items(weights_kernel, (*ops, lse.reshape(-1), weights.reshape(-1)), self.items,
                              lambda: scratch_set(self.weights_specs), self.flops)
            finally:
                end_reuse()
        if self.group > 1:
            weights = None if weights is None else folding.unfold_rows(weights, self.fold_shape)
            out = folding.in_layout(folding.unfold_rows(out, self.fold_shape), self.layout)
            lse = folding.unfold_rows(lse, self.fold_shape)
        return ForwardResult(out=out, lse=lse, weights=weights, saved=(out, lse))


_NO_PIN = contextlib.nullcontext()


def _blas_pinned(ints):
    """:func:`single_threaded_blas` where some product of the kernels runs on BLAS; a no-op
    (2 us saved on a small call) where the micro-kernels do them all."""
    if ints[Int.VECTOR_SCORES] and ints[Int.VECTOR_VALUES] and ints[Int.VECTOR_KEYS]:
        return contextlib.nullcontext()
    return single_threaded_blas()


def _forward_flops(problem) -> float:
    """The forward's dense work, 2 B H Sq Sk (D + Dv): what decides running inline."""
    return 2.0 * problem.batch * problem.heads * problem.q_len * problem.kv_len * (problem.head_dim + problem.value_dim)


def _flat(array):
    """A writable 1-D view of the whole memory behind a (possibly transposed) contiguous array."""
    base = array if array.flags.c_contiguous else array.transpose(0, 2, 1, 3)
    return base.reshape(-1)


# Enough (batch, kv head, key chunk) items to keep this many cores busy, fixed so that
# the chunking, and so the summation order of dq, never depends on the machine.
_BACKWARD_ITEMS = 8


def backward(problem, saved, dout) -> Gradients:
    """Gradients of ``sum(out * dout)`` from the saved (out, lse); ``dout`` is bhsd."""
    out, lse = saved
    ops = build_operands(problem, "backward")
    dtype = problem.accumulate_dtype
    batch, heads, q_len, head_dim = problem.q.shape
    kv_heads, kv_len, value_dim = problem.kv_heads, problem.kv_len, problem.value_dim
    dout_flat, dout_strides = row_strides(dout, dtype)
    dout_strides = np.array(dout_strides, np.int64)
    out_flat, out_strides = row_strides(out, dtype)
    out_strides = np.array(out_strides, np.int64)
    # delta = rowsum(dO * O): the softmax's backward term, O(Sq * Dv) work
    delta = np.einsum("bhsd,bhsd->bhs", dout.astype(dtype, copy=False), out)
    key_tiles = -(-kv_len // int(ops.ints[Int.BLOCK_K]))
    chunks = max(1, min(key_tiles, -(-_BACKWARD_ITEMS // max(1, batch * kv_heads))))
    dq = np.zeros((chunks, batch, heads, q_len, head_dim), dtype)
    dk = np.zeros((batch, kv_heads, kv_len, head_dim), dtype)
    dv = np.zeros((batch, kv_heads, kv_len, value_dim), dtype)
    common = (*ops, dout_flat, dout_strides, out_flat, out_strides, lse.reshape(-1), delta.reshape(-1))
    flops = _forward_flops(problem)
    with _blas_pinned(ops.ints), reused():
        run_items(backward_kernel, (*common, dq.reshape(-1), dk.reshape(-1), dv.reshape(-1), chunks),
                  backward_items(ops.ints, chunks), lambda: backward_scratch(ops.ints, dtype), flops)
        dbias = None
        if problem.bias is not None:
            dbias_shape = (1,) * (4 - len(problem.bias_shape)) + tuple(problem.bias_shape)
            dbias = np.zeros(dbias_shape, dtype)
            shape = np.array(dbias_shape, np.int64)
            items = (shape[0] * shape[1] * (-(-q_len // int(ops.ints[Int.BLOCK_Q])) if shape[2] > 1 else 1)
                     * (key_tiles if shape[3] > 1 else 1))
            run_items(dbias_kernel, (*common, dbias.reshape(-1), shape), int(items),
                      lambda: gradient_tile_scratch(ops.ints, dtype), flops)
            dbias = dbias.reshape(problem.bias_shape)
    dsink_logits = None if problem.sink_logits is None else sink_logits_gradient(np, problem, lse, delta)
    return Gradients(dq=dq.sum(axis=0) if chunks > 1 else dq[0], dk=dk, dv=dv, dbias=dbias,
                     dsink_logits=dsink_logits)
