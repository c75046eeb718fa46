"""delta = rowsum(dout * out), the softmax backward's row term, for a 16-bit problem.

A float16 or bfloat16 backward gets the forward's out (float32 from a vjp's forward, which
keeps it for the dominant keys' gradients; 16-bit where a caller of attention_backward
passes the rounded one) and a dout, of q's dtype or float32. Its kernels read out in float32 (the gradient of
a dominant key subtracts it), and delta is a dot product of each dout row with its out
row. One jitted pass reads them as they lie (dout copied into out's memory order where
the two differ), widens a 16-bit out into the thread's kept float32 array and sums each
row's products from the same registers: no float32 copy of dout, and one call where the widening, dout's block
conversions and einsum took four (a (1, 8, 16 x 16, 64) float16 backward's delta and out
took 18 us that way on the 2-core Zen 3 VM).

The products are summed in vector lanes, then the lanes in a fixed order, whichever
dtypes the rows are read in (16-bit values widen exactly): a row's delta has the same
bits in every layout, on every call, and whether the backward reads its 16-bit arrays
in place or widened copies, so its gradients do too. (Not einsum's bits: within
float32's rounding of the same sum. Where the pass does not apply, both take einsum.)
"""
from __future__ import annotations

import numpy as np

from .conversion import BYTES
from .jit import inlined_helper, kernel
from .operands import flat_memory, memory_order, widened as widened_array
from .simd import MICROKERNELS, VECTOR_BYTES, fill, horizontal_sum, load, load_float16_bits, multiply_add, store

_LANES = VECTOR_BYTES // 4  # float32 lanes of a vector
_FLOAT32 = np.dtype(np.float32)
_BRAIN = {"float16": False, "bfloat16": True}  # the 16-bit dtypes, by name: whether bfloat16


@inlined_helper
def _widened_vector(codes, i, like, brain):
    """Values ``i : i + lanes`` of 16-bit memory ``codes`` (bytes) as a float32 vector."""
    if brain:  # (the widening is a compile-time choice: a literal in each branch)
        return load_float16_bits(codes, 2 * i, like, True)
    return load_float16_bits(codes, 2 * i, like, False)


@inlined_helper
def _sixteen_bit_sums(dout, out, width, widened, sums, brain):
    """For each row r of ``width`` values (whole vectors) of 16-bit ``dout`` and ``out``
    (their memory as bytes, rows back to back): ``widened``'s row = out's row in float32,
    ``sums[r]`` = the sum of the rows' products."""
    like = fill(0.0, widened)
    for r in range(sums.size):
        total = like
        for i in range(r * width, (r + 1) * width, _LANES):
            value = _widened_vector(out, i, like, brain)
            store(widened, i, value)
            total = multiply_add(_widened_vector(dout, i, like, brain), value, total)
        sums[r] = horizontal_sum(total)


@inlined_helper
def _sixteen_bit_dout_sums(dout, out, width, sums, brain):
    """:func:`_sixteen_bit_sums` of a 16-bit ``dout`` and a float32 ``out``."""
    like = fill(0.0, out)
    for r in range(sums.size):
        total = like
        for i in range(r * width, (r + 1) * width, _LANES):
            total = multiply_add(_widened_vector(dout, i, like, brain), load(out, i), total)
        sums[r] = horizontal_sum(total)


@kernel
def _float16_sums(dout, out, width, widened, sums):
    _sixteen_bit_sums(dout, out, width, widened, sums, False)


@kernel
def _bfloat16_sums(dout, out, width, widened, sums):
    _sixteen_bit_sums(dout, out, width, widened, sums, True)


@kernel
def _float16_dout_sums(dout, out, width, sums):
    _sixteen_bit_dout_sums(dout, out, width, sums, False)


@kernel
def _bfloat16_dout_sums(dout, out, width, sums):
    _sixteen_bit_dout_sums(dout, out, width, sums, True)


@kernel
def _float32_sums(dout, out, width, sums):
    """:func:`_sixteen_bit_sums` of float32 rows."""
    like = fill(0.0, out)
    for r in range(sums.size):
        total = like
        for i in range(r * width, (r + 1) * width, _LANES):
            total = multiply_add(load(dout, i), load(out, i), total)
        sums[r] = horizontal_sum(total)


def _brain(dtype):
    """Whether ``dtype`` is bfloat16 (True) or float16 (False); None for any other. By the
    dtype object once it was seen: NumPy 2.4's ``dtype.name`` takes 5 us, a third of a
    small call's delta."""
    try:
        return _BRAIN_OF_DTYPE[dtype]
    except KeyError:
        brain = _BRAIN_OF_DTYPE[dtype] = _BRAIN.get(dtype.name) if dtype.isnative else None
        return brain


_BRAIN_OF_DTYPE: dict = {}


def delta_of_rows(dout, out, empty=np.empty):
    """``(delta, out32)`` for a 16-bit problem's bhsd ``dout`` and ``out``, each float32
    or the problem's 16-bit dtype: delta (B, H, Sq) float32 C-contiguous, and out in float32 (``out``
    itself where it is float32; else widened, laid out in memory as ``out`` is, into
    ``empty(memory shape, float32)``). None where the pass does not apply (the caller
    widens and uses einsum): no vector kernels, a head dim that is not whole vectors, or
    other dtypes. dout and out in two memory orders are read in out's (a copy of dout):
    delta's bits never depend on the layouts."""
    width = dout.shape[-1]
    if not MICROKERNELS or width % _LANES or not dout.size:
        return None
    if dout.flags.c_contiguous and out.flags.c_contiguous:  # (the usual case, first: 2.7 us of a small call's 6)
        order, memory_shape = None, dout.shape
        dout_flat, out_flat = flat_memory(dout, None), flat_memory(out, None)
    else:
        order = memory_order(out, out.dtype)
        if order is None:  # (out in no memory order: a C-contiguous copy)
            out, order = np.ascontiguousarray(out), (0, 1, 2, 3)
        if memory_order(dout, dout.dtype) != order:
            # dout copied into out's memory order: the same arithmetic, so the same bits, whatever
            # the two arrays' layouts (the orders memory_order gives are their own inverses)
            dout = np.ascontiguousarray(dout.transpose(order)).transpose(order)
        memory_shape = tuple(dout.shape[axis] for axis in order)
        dout_flat, out_flat = flat_memory(dout, order), flat_memory(out, order)
    dout_brain, out_brain = _brain(dout.dtype), _brain(out.dtype)
    sums = np.empty(dout.size // width, np.float32)  # the rows in memory order
    if out_brain is not None and dout_brain == out_brain:  # both 16-bit, of one dtype
        widened = empty(memory_shape, _FLOAT32)
        (_bfloat16_sums if out_brain else _float16_sums)(dout_flat.view(BYTES), out_flat.view(BYTES), width,
                                                         widened.reshape(-1), sums)
        # (the orders memory_order gives are their own inverses)
        out = widened if order is None else widened.transpose(order)
    elif dout_brain is not None and out.dtype == _FLOAT32:
        (_bfloat16_dout_sums if dout_brain else _float16_dout_sums)(dout_flat.view(BYTES), out_flat, width, sums)
    elif dout.dtype == _FLOAT32 and (out.dtype == _FLOAT32 or out_brain is not None):
        out = widened_array(out, _FLOAT32, empty)  # (out itself where float32; the vector conversion's bits)
        _float32_sums(dout_flat, flat_memory(out, order), width, sums)
    else:
        return None
    # delta C-contiguous in (B, H, S) whatever the layout: the kernels read it so, and the sink
    # logits' gradient sums it over rows, in an order (and so bits) that a view would change
    if order is None:
        return sums.reshape(memory_shape[:-1]), out
    return np.ascontiguousarray(sums.reshape(memory_shape[:-1]).transpose(order[:-1])), out
