"""The CPU backend's entry points: allocate outputs, run the kernels, package results."""
from __future__ import annotations

import contextlib

import numpy as np

from ..kernel_params import sink_logits_gradient
from ..results import ForwardResult, Gradients
from .backward_kernel import backward_items, backward_kernel, dbias_kernel
from . import folding, splitting
from .blas import single_threaded_blas
from .forward_kernel import forward_items, forward_kernel, weights_kernel
from .threads import run_items
from .scratch import backward_scratch, forward_scratch, gradient_tile_scratch, reused, score_tile_scratch
from .operands import Int, build_operands, row_strides


def forward(problem) -> ForwardResult:
    """out (B, H, Sq, Dv) as a bhsd view of an array in the user's layout, lse (B, H, Sq),
    and weights when asked; ``saved`` keeps (out, lse) for the backward."""
    if folding.foldable(problem):  # GQA: the query heads of a group as rows of one kv head
        result = _forward(folding.fold(problem), rows_per_position=problem.group_size)
        weights = None if result.weights is None else folding.unfold_rows(result.weights, problem)
        out = folding.in_layout(folding.unfold_rows(result.out, problem), problem.layout)
        lse = folding.unfold_rows(result.lse, problem)
        return ForwardResult(out=out, lse=lse, weights=weights, saved=(out, lse))
    return _forward(problem)


def _forward(problem, rows_per_position: int = 1) -> ForwardResult:
    ops = build_operands(problem, "forward", rows_per_position=rows_per_position)
    dtype = problem.accumulate_dtype
    batch, heads, q_len, value_dim = problem.batch, problem.heads, problem.q_len, problem.value_dim
    if problem.layout == "bshd":
        out = np.zeros((batch, q_len, heads, value_dim), dtype).transpose(0, 2, 1, 3)
    else:
        out = np.zeros((batch, heads, q_len, value_dim), dtype)
    lse = np.full((batch, heads, q_len), -np.inf, dtype)
    splits = int(ops.ints[Int.KEY_SPLITS])
    # each key range's rows go to their own (out, lse) slice, merged after the kernel
    out_parts = out if splits == 1 else np.zeros((splits, batch, heads, q_len, value_dim), dtype)
    lse_parts = lse if splits == 1 else np.full((splits, batch, heads, q_len), -np.inf, dtype)
    out_strides = np.array([s // dtype.itemsize for s in out_parts.strides[-4:-1]]
                           + [out_parts.strides[0] // dtype.itemsize if splits > 1 else 0], np.int64)
    with _blas_pinned(ops.ints), reused():
        items = forward_items(ops.ints)
        flops = _forward_flops(problem)
        run_items(forward_kernel, (*ops, _flat(out_parts), out_strides, lse_parts.reshape(-1)), items,
                  lambda: forward_scratch(ops.ints, dtype), flops)
        if splits > 1:
            splitting.merge(out_parts, lse_parts, out, lse)
        weights = None
        if problem.return_weights:
            weights = np.zeros((batch, heads, q_len, problem.kv_len), dtype)
            run_items(weights_kernel, (*ops, lse.reshape(-1), weights.reshape(-1)), items,
                      lambda: score_tile_scratch(ops.ints, dtype), flops)
    return ForwardResult(out=out, lse=lse, weights=weights, saved=(out, lse))


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
