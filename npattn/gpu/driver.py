"""The GPU backend's entry points: operands on the device, kernel launches, results.

Arrays reach the kernels as device pointers to their element [0, 0, 0, 0] plus element
strides in the ``ints`` parameter array (:mod:`npattn.core.kernel_params`), so both layouts,
broadcast masks and biases (stride 0) and GQA's shared K/V heads are read in place.
Copies are made only to change a dtype (a bias or dout into the compute dtype) or to
give q, k, v a unit stride along the head dimension.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading

import numpy as np

from ..core.kernel_params import OPERAND_NAMES, Int, default_spans, element_strides, problem_pages, problem_parameters, problem_spans, sink_logits_gradient, spans_are_default
from ..core.problem import ARRAY_FIELDS
from ..core.quantization import RunScales
from ..core.results import ForwardResult, Gradients
from . import launch, sources
from ..core.dropout import seed_words
from .options import ALL, Option, _address, _strides_aligned, options_of
from .sources import (BACKWARD_BLOCK_K, BLOCK_Q, COMBINE_CHUNK, COMBINE_THREADS, FORWARD_BLOCK_K, TENSOR_CORE_BLOCK, THREADS,
                      backward_kinds, forward_kind, forward_tc_config, head_dim_bound, reads_codes_into_registers,
                      TRANSPOSED_TILE, transposes_decode)


def _on_device(problem):
    """The CUDA device of the problem's arrays as a context; none for NumPy arrays (only
    the tests' host emulation of the kernels passes those)."""
    device = getattr(problem.q, "device", None)
    return problem.xp.cuda.Device(device.id) if hasattr(device, "id") else contextlib.nullcontext()


# Small read-only device arrays the kernels take, kept per device and value: placeholders,
# full lengths, parameter and stride arrays. Each CuPy upload or fill costs 20-60 us of
# host time, which a decode step or a small call pays several times over otherwise. The
# kernels never write them (their parameters are const). Bounded: cleared when full.
_CONSTANTS: dict = {}
_CONSTANTS_LIMIT = 4096
# the ways of reading a quantized cache's codes that need 16-byte aligned rows
_READS_CODES_INTO_REGISTERS = Option.REGISTER_CODES | Option.TRANSPOSED
# what a call whose arrays start off 16 bytes drops (its codes staged; its splits merged by the combine)
_ALIGNED_ONLY = _READS_CODES_INTO_REGISTERS | Option.MERGES


def _constant(cp, key, make):
    """The device array ``make()`` gives for ``key`` on the current device, made once
    (``cp`` NumPy: the tests' host emulation)."""
    cuda = getattr(cp, "cuda", None)
    key = (None if cuda is None else cuda.Device().id, *key)
    array = _CONSTANTS.get(key)
    if array is None:
        if len(_CONSTANTS) >= _CONSTANTS_LIMIT:
            _CONSTANTS.clear()
        array = _CONSTANTS[key] = make()
    return array


def _int64s(cp, values):
    """``values`` (ints) as a device int64 array, uploaded once per value."""
    values = tuple(int(x) for x in values)
    return _constant(cp, ("int64", values), lambda: cp.asarray(np.array(values, np.int64)))


def _scalars_by_value(ints, reals) -> np.ndarray:
    """``ints`` and ``reals`` as one struct passed by value (the tensor-core forward's last
    parameter under NPATTN_PARAMETER_SCALARS: ``ParameterScalars`` in common.cuh, ints
    then reals, each field aligned as C aligns it).

    A one-element structured array, not a ``np.void`` scalar: CuPy passes a size-one NumPy
    array by value from its own bytes (whatever its itemsize), while a NumPy scalar goes
    through CuPy's scalar conversion, whose buffer holds 64 bytes (this struct has over 500)."""
    layout = np.dtype([("ints", np.int64, ints.shape), ("reals", reals.dtype, reals.shape)], align=True)
    value = np.zeros(1, layout)
    value["ints"], value["reals"] = ints, reals
    return value


def _parameters(cp, ints, reals):
    """The device copies of the kernels' ``ints`` and ``reals``: one upload of both (packed
    into one buffer, reals 8-byte aligned after the int64s), kept per value."""
    packed = np.concatenate([ints.view(np.uint8), reals.view(np.uint8)])

    def upload():
        device = cp.asarray(packed)
        return device[:ints.nbytes].view(cp.int64), device[ints.nbytes:].view(reals.dtype)
    return _constant(cp, ("parameters", reals.dtype.str, packed.tobytes()), upload)


def _unit_last_axis(cp, array):
    if array.shape[-1] > 1 and array.strides[-1] != array.itemsize:
        return cp.ascontiguousarray(array)
    return array


def _operands(problem):
    """``(storage dtype name, operands tuple)``: the leading arguments of every kernel, in
    :data:`npattn.core.kernel_params.OPERANDS` order."""
    cp = problem.xp
    dtype = problem.accumulate_dtype
    q, k, v = _qkv(problem)
    ints, reals = problem_parameters(problem, dtype)
    _set_qkv_strides(ints, q, k, v)
    named = _option_operands(cp, problem, dtype, ints)
    named["ints"], named["reals"] = _parameters(cp, ints, reals)
    return q.dtype.name, _in_kernel_order(q, k, v, named)


def _qkv(problem):
    """q, k, v with a unit stride along the head dimension (copied where they lack one),
    checked to share one dtype."""
    cp = problem.xp
    q, k, v = (_unit_last_axis(cp, x) for x in (problem.q, problem.k, problem.v))
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype for the gpu backend, got {q.dtype}, {k.dtype}, {v.dtype}")
    return q, k, v


def _set_qkv_strides(ints, q, k, v) -> None:
    ints[Int.Q_STRIDE_B:Int.Q_STRIDE_S + 1] = element_strides(q)[:3]
    ints[Int.K_STRIDE_B:Int.K_STRIDE_S + 1] = element_strides(k)[:3]
    ints[Int.V_STRIDE_B:Int.V_STRIDE_S + 1] = element_strides(v)[:3]


def _option_operands(cp, problem, dtype, ints) -> dict:
    """The operands from the problem's option arrays (placeholders where it has none):
    bias, mask, alibi, sink, spans and pages on the device; the bias's and mask's element
    strides go into ``ints``."""
    placeholder = _constant(cp, ("zeros", np.dtype(dtype).str), lambda: cp.zeros(1, dtype))
    bias = placeholder
    if problem.bias is not None:
        bias = problem.bias.astype(dtype, copy=False)
        ints[Int.BIAS_STRIDE_B:Int.BIAS_STRIDE_K + 1] = element_strides(bias)
    mask = _constant(cp, ("ones", "u1"), lambda: cp.ones(1, cp.uint8))
    if problem.mask is not None:
        mask = problem.mask.view(cp.uint8)
        ints[Int.MASK_STRIDE_B:Int.MASK_STRIDE_K + 1] = element_strides(mask)
    alibi = (placeholder if problem.alibi_slopes is None
             else cp.ascontiguousarray(problem.alibi_slopes.astype(dtype, copy=False)).reshape(-1))
    sink = (placeholder if problem.sink_logits is None
            else cp.ascontiguousarray(problem.sink_logits.astype(dtype, copy=False)))
    pages = (_constant(cp, ("pages", problem.batch), lambda: cp.arange(problem.batch, dtype=cp.int64))
             if problem.block_table is None else cp.asarray(problem_pages(problem)))
    # a quantized cache's scales (its codes are the call's k and v: ForwardPlan puts them in
    # place); placeholders otherwise, as for the codes
    no_codes = _constant(cp, ("zeros", "|u1"), lambda: cp.zeros(1, cp.uint8))
    k_scale = v_scale = _constant(cp, ("zeros", "<f4"), lambda: cp.zeros(1, cp.float32))
    if problem.k_scale is not None:
        k_scale, v_scale = problem.k_scale, problem.v_scale
        ints[Int.K_SCALE_STRIDE_B:Int.K_SCALE_STRIDE_S + 1] = element_strides(k_scale)
        ints[Int.V_SCALE_STRIDE_B:Int.V_SCALE_STRIDE_S + 1] = element_strides(v_scale)
    return dict(bias=bias, mask=mask, alibi=alibi, sink=sink, spans=_spans(cp, problem), pages=pages,
                k_codes=no_codes, v_codes=no_codes, k_scale=k_scale, v_scale=v_scale)


def _in_kernel_order(q, k, v, named) -> tuple:
    return tuple({**named, "q": q, "k": k, "v": v}[name] for name in OPERAND_NAMES)


_Q_SLOT, _K_SLOT, _V_SLOT = (OPERAND_NAMES.index(name) for name in "qkv")
_K_CODES_SLOT, _V_CODES_SLOT = OPERAND_NAMES.index("k_codes"), OPERAND_NAMES.index("v_codes")


def _widened_q(cp, q, dtype):
    """A quantized call's q in the compute dtype, C-contiguous in its (bhsd) order: the SIMT
    forward that reads the codes computes in its inputs' dtype (a decode step's q is small)."""
    return cp.ascontiguousarray(q, dtype=dtype)


def _unfilled(cp, shape, dtype):
    """An output array the kernel writes every element of (the tests' emulation fills it
    with NaN first, so an element the kernel leaves shows)."""
    return cp.empty(shape, dtype)


def _spans(cp, problem):
    """The kernels' spans (:func:`npattn.core.kernel_params.problem_spans`) on the device: one
    upload, kept per value when the problem has no lengths, starts or per-entry shifts."""
    if spans_are_default(problem):
        shift = problem.visibility.shift(problem.q_len, problem.kv_len)
        return _constant(cp, ("spans", problem.batch, problem.q_len, problem.kv_len, shift),
                         lambda: cp.asarray(default_spans(problem).reshape(-1)))
    return cp.asarray(problem_spans(problem).reshape(-1))


# Split-KV decoding: aim for this many warps (8 per SM on a 132-SM H100: enough loads
# in flight to stream K/V at the memory's speed), and no more, giving each split at least
# MIN_KEY_TILES_PER_SPLIT key tiles. Constants, not the device's SM count, so a
# problem's summation order (and so its bits) is the same on every GPU. (Rounding the
# splits up overshot: (16, 32/8, 1 x 2048, 128) took 9 splits, 1152 one-warp blocks for
# 1056 places, and its step 61.3 us on an H200 against 45.8 with 8; TUNING.md.)
DECODE_TARGET_WARPS = 1056
MIN_KEY_TILES_PER_SPLIT = 4


def decode_splits(blocks: int, rows: int, kv_len: int, block_q: int, block_k: int, warps: int = THREADS // 32) -> int:
    """How many key splits the forward uses: more than 1 only for short queries (one tile
    of ``block_q`` rows per head, or per kv head for packed GQA rows; ``rows`` of them)
    whose ``blocks`` blocks of ``warps`` warps leave the GPU mostly idle; ``block_k``:
    keys per tile."""
    target_blocks = DECODE_TARGET_WARPS // warps
    if rows > block_q or blocks >= target_blocks:
        return 1
    key_tiles = -(-kv_len // block_k)
    return max(1, min(key_tiles // MIN_KEY_TILES_PER_SPLIT, target_blocks // blocks))


# A split step's tensor-core forward merges its own partials where a row has at most this
# many splits (Option.MERGES: the last block of each work item to finish merges the item's
# rows, merge.cuh) and launches no combine_kernel: the combine's launch and its chain of
# dependent loads were most of its 6-7 us at 2 splits a row (16, 32/8, 1 x 2048, 128;
# H200, 2026-11-30). Up to COMBINE_CHUNK the merge takes the combine's one-warp steps in
# its order, so the bits are the same either way; more splits a row keep the combine,
# whose warps share a row's chunks (a device session times a larger setting too: a merge
# of more splits takes a row's chunks one after another in one warp, its own fixed order,
# so its bits are its own). 0: always the combine (how a device session times the two
# side by side). Heads of up to 128 dims only: the 256-wide tiles already keep values in
# local memory inside their key loops (sm_90), and the merge's code added more.
MERGED_SPLITS = COMBINE_CHUNK


def merges_in_forward(bound: int, splits: int) -> bool:
    """Whether a tensor-core forward of head-dim ``bound`` with ``splits`` key splits
    merges them itself (Option.MERGES, no combine_kernel): 2 to :data:`MERGED_SPLITS`
    splits, heads of up to 128 dims."""
    return bound <= 128 and 1 < splits <= MERGED_SPLITS


def combine_warps(splits: int) -> int:
    """Warps of combine_kernel's block per query row: one per COMBINE_CHUNK splits (a
    warp's loads of a chunk's rows are in flight together), at most COMBINE_THREADS / 32.
    The sums' order, and so the bits, follow from ``splits`` alone."""
    return max(1, min(COMBINE_THREADS // 32, -(-splits // COMBINE_CHUNK)))


def forward(problem) -> ForwardResult:
    """out (B, H, Sq, Dv) as a bhsd view of an array in the user's layout, lse (B, H, Sq),
    and weights when asked; ``saved`` keeps (out, lse) for the backward."""
    return ForwardPlan(problem)(problem.q, problem.k, problem.v, problem)


def _device_id(array):
    """The CUDA device id of a CuPy array; None for NumPy (the tests' host emulation)."""
    device = getattr(array, "device", None)
    return device.id if hasattr(device, "id") else None


class ForwardPlan:
    """Everything a forward derives from its problem's structure (shapes, strides, dtypes,
    which options it has), worked out once: the kernel and its compile-time options, the
    launch geometry and key splits, the output shapes, and the parameter arrays and
    placeholders on the device. A call (:meth:`__call__`) then makes the operands of its
    option arrays (when it has any), allocates the outputs and launches: :func:`forward`
    is one call of a plan made for it, and :class:`npattn.Plan` keeps one for every run."""

    def __init__(self, problem):
        cp = self.xp = problem.xp
        self.device = _device_id(problem.q)
        self.bound = bound = head_dim_bound(problem.head_dim, problem.value_dim)
        self.dtype = dtype = problem.accumulate_dtype
        self.layout = problem.layout
        batch, heads, q_len, value_dim = problem.batch, problem.heads, problem.q_len, problem.value_dim
        # a quantized cache (k and v int8 or float8 e4m3 codes with scales): the forward
        # dequantizes its tiles as it stages them, the tensor-core one (16-bit q; CODES) to
        # q's type, the SIMT one (any other q, widened to its compute dtype) to that
        self.quantized = problem.k_scale is not None
        self.widens_q = self.quantized and forward_kind(problem.q.dtype.name) != "forward_tc"
        with _on_device(problem):
            if self.quantized:
                q = _widened_q(cp, problem.q, dtype) if self.widens_q else _unit_last_axis(cp, problem.q)
                k, v = _unit_last_axis(cp, problem.k), _unit_last_axis(cp, problem.v)
                self._stand_in = _constant(cp, ("zeros", q.dtype.str), lambda: cp.zeros(1, q.dtype))
            else:
                q, k, v = _qkv(problem)
            self.storage = q.dtype.name
            self.kind = kind = forward_kind(self.storage)
            self.config = {}
            self.head_dims = (problem.head_dim, value_dim)
            if kind == "forward_tc":
                # packed rows: the query heads of a GQA group times the query rows, per kv head
                rows = q_len * (heads // problem.kv_heads)
                # the options the problem's structure needs; UNALIGNED also depends on where
                # each call's rows lie, so the call adds it (see _options)
                options = options_of(problem, (), bound)
                # rows whose strides break 16-byte alignment (after the last-axis copy a
                # call makes) stay unaligned at every call: plain loads, decided once (a
                # quantized cache's codes too: a decode step reads aligned codes into
                # registers by 16-byte loads, and the others by plain loads)
                if not all(_strides_aligned(_unit_last_axis(cp, x)) for x in (q, k, v)):
                    options |= Option.UNALIGNED
                tile = forward_tc_config(rows, bound, options)
                if reads_codes_into_registers(tile, options, bound):
                    options |= Option.REGISTER_CODES
                    if transposes_decode(options, rows):
                        options |= Option.TRANSPOSED
                        tile = TRANSPOSED_TILE
                self.config = dict(tile=tile, options=options)
                warps, block_q, block_k = tile.warps, tile.block_q, tile.block_k
                self.shared = self._shared_bytes(self.config)
                blocks = batch * problem.kv_heads * -(-rows // block_q)
            else:
                rows, warps = q_len, THREADS // 32
                block_q, block_k = BLOCK_Q, FORWARD_BLOCK_K["double" if dtype == np.float64 else "float"]
                self.shared = launch.forward_shared_bytes(problem.head_dim, value_dim, dtype)
                blocks = batch * heads * -(-q_len // block_q)
            self.splits = splits = decode_splits(blocks, rows, problem.kv_len, block_q, block_k, warps)
            self.blocks = blocks * splits
            # out in the inputs' dtype (the tensor-core forward, or the combine after split
            # keys, rounds each value once; the SIMT kernels' inputs are their Acc)
            self.out_dtype = problem.q.dtype if kind == "forward_tc" else dtype
            # the tensor-core forward without splits, and the merge of split keys (its own or
            # the combine's), write every element of out and lse of the live rows, which are
            # all rows without per-entry starts and stops: no fill
            self.writes_every_row = (kind == "forward_tc" or splits > 1) and spans_are_default(problem)
            self.out_shape = ((batch, q_len, heads, value_dim) if self.layout == "bshd"
                              else (batch, heads, q_len, value_dim))
            self.lse_shape = (batch, heads, q_len)
            # (with the forward's own merge, a counter a work item after the rows: merge.cuh)
            self.merged = kind == "forward_tc" and merges_in_forward(bound, splits)
            if self.merged:
                self.config["options"] |= Option.MERGES
            self.counters_at = batch * heads * q_len * splits * (value_dim + 3) if splits > 1 else 0
            self.partial_size = max(1, self.counters_at + (blocks if self.merged else 0))
            # the combine: one block per query row, a warp per COMBINE_CHUNK splits (combine_warps); the
            # repair: one warp per query row
            self.combine_blocks = batch * heads * q_len
            merging_warps = combine_warps(splits)
            self.combine_threads = 32 * merging_warps
            self.combine_shared = launch.combine_shared_bytes(value_dim, dtype, merging_warps)
            self.repair_blocks = -(-batch * heads * q_len * 32 // THREADS)
            self.weights_shape = (batch, heads, q_len, problem.kv_len) if problem.return_weights else None
            self.weights_shared = launch.forward_shared_bytes(problem.head_dim, value_dim, dtype)
            self.weights_blocks = batch * heads * -(-q_len // BLOCK_Q)
            # rows of out that are not finite are recomputed on the device as the reference
            # does (repair.cu), so no call waits for the device to check out; a call that
            # returns the weights keeps the host's check (they are computed from lse)
            self.repairs = self.weights_shape is None
            # the parameters (q, k and v strides included: a structure fixes them) and, for
            # calls without option arrays, every other operand, on the device once
            self.ints, self.reals = problem_parameters(problem, dtype)
            _set_qkv_strides(self.ints, q, k, v)
            self.ints[Int.SPLIT_COUNTERS] = self.counters_at if self.merged else 0
            # (NPATTN_PARAMETER_SCALARS: the combine, and the tensor-core forward, take them by value too)
            self.scalars_by_value = sources.switched_on("NPATTN_PARAMETER_SCALARS")
            self.forward_takes_scalars = kind == "forward_tc" and self.scalars_by_value
            self.dropout = bool(problem.dropout_p)
            # (q, k and v as stand-ins of their shapes: the plan keeps no caller's array alive)
            self._plain_problem = dataclasses.replace(problem, **{name: None for name in _OPTION_ARRAYS},
                                                      dropout_p=0.0, **{
                name: cp.broadcast_to(cp.zeros((), x.dtype), x.shape) for name, x in zip("qkv", (q, k, v))})
            self._plain_operands = None
            self._launchers, self._out_strides, self._partial_stand_in, self._plain_order = {}, None, None, None
            self._partials = {}  # (thread, stream) -> the split partials' buffer
            self._scaled_operands = None  # (the problem of a quantized step's runs, its operands)
            self._combine = self._repair = None

    def __call__(self, q, k, v, arrays=None) -> ForwardResult | None:
        """The forward of bhsd ``q``, ``k``, ``v`` (this plan's structure) with the option
        arrays and seed of ``arrays`` (a problem of this plan's signature; None: none of
        them, no dropout). None for arrays on another device than the plan's (the caller
        plans again)."""
        if _device_id(q) != self.device:
            return None
        cp = self.xp
        with _device_context(cp, self.device):
            q, k, v = (_unit_last_axis(cp, x) for x in (q, k, v))
            if self.widens_q:
                q = _widened_q(cp, q, self.dtype)
            if arrays is None:
                named = self._plain_operands or self._make_plain_operands()
            elif type(arrays) is RunScales and not self.dropout:
                named = self._run_scales_operands(arrays)
            else:
                ints = self.ints.copy()
                if self.dropout:  # the seed is the one per-call value among the parameters
                    ints[Int.SEED_LO], ints[Int.SEED_HI] = seed_words(arrays.seed)
                named = self._operands_of(arrays, ints)
            if arrays is None:  # the plan's own operands in kernel order, made once
                if self._plain_order is None:
                    self._plain_order = [named.get(name) for name in OPERAND_NAMES]
                operands = self._plain_order.copy()
            else:
                operands = [named.get(name) for name in OPERAND_NAMES]
            operands[_Q_SLOT], operands[_K_SLOT], operands[_V_SLOT] = q, k, v
            if self.quantized:  # k and v are the codes: read as bytes, the float slots stand-ins
                operands[_K_CODES_SLOT], operands[_V_CODES_SLOT] = k.view(cp.uint8), v.view(cp.uint8)
                operands[_K_SLOT] = operands[_V_SLOT] = self._stand_in
            config = self.config
            # the structure fixed the strides (a plan of unaligned ones has UNALIGNED already):
            # a call's rows are aligned when its arrays start on 16 bytes
            if config and not (config["options"] & Option.UNALIGNED) and (_address(q) | _address(k) | _address(v)) % 16:
                # (codes off 16 bytes are staged: no 16-byte loads of them into registers)
                config = dict(config, options=config["options"] & ~_ALIGNED_ONLY | Option.UNALIGNED)
            if self.writes_every_row:
                out, lse = _unfilled(cp, self.out_shape, self.out_dtype), _unfilled(cp, self.lse_shape, self.dtype)
            else:
                out, lse = cp.zeros(self.out_shape, self.out_dtype), cp.full(self.lse_shape, -np.inf, self.dtype)
            if self.layout == "bshd":
                out = out.transpose(0, 2, 1, 3)
            if self._out_strides is None:  # the same for every call: the layout fixes them
                self._out_strides = tuple(np.int64(s) for s in element_strides(out)[:3])
            # rows of (Dv outputs, max, sum, seen) per split; unread without splits
            partial = self._partial() if self.splits > 1 else self._no_partial()
            outputs = (out, *self._out_strides, lse, np.int64(self.splits), partial)
            # (NPATTN_PARAMETER_SCALARS: the ints and reals by value too)
            by_value = ()
            if self.scalars_by_value:
                if "by_value" not in named:  # (kept with the plan's own operands)
                    named["by_value"] = _scalars_by_value(named["scalars"], self.reals)
                by_value = (named["by_value"],)
            self._launcher(config)(self.blocks, (*operands, *outputs, *(by_value if self.forward_takes_scalars else ())))
            # (a call off 16 bytes runs without the merge: config dropped MERGES above)
            if self.splits > 1 and not (config and config["options"] & Option.MERGES):
                if self._combine is None:
                    self._combine = launch.kernel("combine", self.storage, self.bound, self.combine_shared,
                                                  threads=self.combine_threads)
                self._combine(self.combine_blocks, (*operands, *outputs, *by_value))
            if self.repairs and self.splits == 1:  # (the combine repairs the rows it merges)
                if self._repair is None:
                    self._repair = launch.kernel("repair", self.storage, 0, 0)
                self._repair(self.repair_blocks, (*operands, out, *self._out_strides, lse))
            weights = None
            if self.weights_shape is not None:
                weights = cp.zeros(self.weights_shape, self.dtype)
                launch.run("weights", self.storage, 0, self.weights_blocks, self.weights_shared,
                           (*operands, lse, weights))
        # finite=True: out needs no check (its non-finite rows already are the reference's)
        return ForwardResult(out=out, lse=lse, weights=weights, saved=(out, lse),
                             finite=True if self.repairs else None)

    def _launcher(self, config: dict):
        """The forward kernel's launch for ``config`` (this plan's, or with UNALIGNED added),
        looked up once per option set and kept (a plan runs on one device)."""
        key = config.get("options")
        launcher = self._launchers.get(key)
        if launcher is None:
            launcher = self._launchers[key] = launch.kernel(self.kind, self.storage, self.bound,
                                                            self._shared_bytes(config), **config)
        return launcher

    def _shared_bytes(self, config: dict) -> int:
        """The tensor-core forward's dynamic shared memory for ``config``: its tile's, with
        a quantized cache's staged codes unless it reads them into registers."""
        if self.kind != "forward_tc":
            return self.shared
        options = config["options"]
        return launch.forward_tc_shared_bytes(*self.head_dims, config["tile"], bool(options & Option.CODES),
                                              bool(options & Option.REGISTER_CODES), bool(options & Option.TRANSPOSED))

    def _partial(self):
        """The split partials' buffer of the calling thread and stream, kept by the plan. A
        call captured in a CUDA graph writes it at every replay, so it must outlive the call
        (memory handed back to CuPy's pool could be another array's by then); calls of other
        threads or streams get buffers of their own, so none overwrites partials another's
        combine has yet to read. Where the forward merges its splits itself, the buffer ends
        in a counter per work item, zeroed here once (each launch's last block of an item
        sets its counter back to 0)."""
        cuda = getattr(self.xp, "cuda", None)
        key = (threading.get_ident(), None if cuda is None else cuda.get_current_stream().ptr)
        buffer = self._partials.get(key)
        if buffer is None:
            buffer = self.xp.empty(self.partial_size, self.dtype)
            buffer[self.counters_at:] = 0  # (float zeros: unsigned zeros, bit for bit)
            self._partials[key] = buffer
        return buffer

    def _no_partial(self):
        """A one-element stand-in for the split partials, kept per plan (unread with one split)."""
        if self._partial_stand_in is None:
            self._partial_stand_in = self.xp.empty(1, self.dtype)
        return self._partial_stand_in

    def _run_scales_operands(self, run: RunScales) -> dict:
        """The operands of a quantized step's run (:class:`~npattn.core.quantization.RunScales`:
        its plan's problem, the same object at every run, with this run's scales): those of
        the problem, made at its first run and kept, with the run's scales in place (their
        strides, which the step's plan holds fixed, are in the kept parameters). Making them
        at every run (lengths and pages uploaded, parameters packed) was most of a step's
        host time: 49 against a float16 step's 18 us, measured with NumPy standing in for
        CuPy."""
        kept = self._scaled_operands
        if kept is None or kept[0] is not run.problem:
            kept = self._scaled_operands = (run.problem, self._operands_of(run, self.ints.copy()))
        named = dict(kept[1])
        named["k_scale"], named["v_scale"] = run.k_scale, run.v_scale
        return named

    def _make_plain_operands(self) -> dict:
        """The operands of calls without option arrays (placeholders, whole spans, one page
        per entry, the parameters) on the device, made at the first such call and kept."""
        self._plain_operands = self._operands_of(self._plain_problem, self.ints.copy())
        return self._plain_operands

    def _operands_of(self, arrays, ints) -> dict:
        """The named operands of ``arrays`` (a problem of this plan's signature) with this
        call's ``ints`` (a copy of the plan's, which the option arrays' strides go into):
        the option arrays and the parameters on the device, and the host ints as
        ``scalars`` (NPATTN_PARAMETER_SCALARS passes them by value)."""
        named = _option_operands(self.xp, arrays, self.dtype, ints)
        named["ints"], named["reals"] = _parameters(self.xp, ints, self.reals)
        named["scalars"] = ints
        return named


# The problem's option arrays (a call with none of them runs on the plan's own operands)
_OPTION_ARRAYS = tuple(name for name in ARRAY_FIELDS if name not in ("q", "k", "v"))


def _device_context(cp, device):
    return contextlib.nullcontext() if device is None else cp.cuda.Device(device)


def backward(problem, saved, dout) -> Gradients:
    """Gradients of ``sum(out * dout)`` from the saved (out, lse); ``dout`` is bhsd."""
    cp = problem.xp
    out, lse = saved
    bound = head_dim_bound(problem.head_dim, problem.value_dim)
    dtype = problem.accumulate_dtype
    batch, heads, q_len, head_dim = problem.q.shape
    kv_heads, kv_len, value_dim = problem.kv_heads, problem.kv_len, problem.value_dim
    with _on_device(problem):
        # the kernels index lse as (B, H, Sq) C-contiguous; attention_backward's may be any view
        lse = cp.ascontiguousarray(lse)
        storage, operands = _operands(problem)
        dout = _unit_last_axis(cp, dout.astype(dtype, copy=False))
        dout_strides = _int64s(cp, element_strides(dout)[:3])
        # delta = rowsum(dO * O): the softmax's backward term, O(Sq * Dv) work
        delta = cp.ascontiguousarray((dout * out).sum(axis=-1))
        # O in the input's dtype (as the forward rounded it), (B, H, Sq, Dv) C-contiguous:
        # the kernels read it for the one key per row with P > 3/4 (DominantKey, common.cuh)
        out_rounded = cp.ascontiguousarray(out.astype(problem.q.dtype, copy=False))
        dq = cp.zeros((batch, heads, q_len, head_dim), dtype)
        dk = cp.zeros((batch, kv_heads, kv_len, head_dim), dtype)
        dv = cp.zeros((batch, kv_heads, kv_len, value_dim), dtype)
        common = (*operands, dout, dout_strides, lse, delta, out_rounded)
        shared = launch.backward_shared_bytes(head_dim, value_dim, dtype)
        key_tiles = -(-kv_len // BACKWARD_BLOCK_K)
        query_tiles = -(-q_len // BLOCK_Q)
        dkdv_kind, dq_kind = backward_kinds(storage, bound)
        if dkdv_kind == "dkdv_tc":
            # the tensor-core kernels stage dO like Q (cp.async into 16-bit tiles): pass it
            # in the input's dtype, C-contiguous (rows 16-byte aligned when Dv % 8 == 0)
            dout_bits = cp.ascontiguousarray(dout.astype(problem.q.dtype))
            bits_strides = _int64s(cp, element_strides(dout_bits)[:3])
            tc_common = (*operands, dout_bits, bits_strides, lse, delta)
            block = TENSOR_CORE_BLOCK
            # the dQ pass records the gradient of each row's key with P > 3/4, which the
            # dK/dV pass then reads instead of computing (see DominantLookup): dQ goes first
            dominant_gradients = cp.zeros((batch, heads, q_len), np.uint64)
            # compiled with the score options the call has (a plain call runs none of their code)
            options = options_of(problem) & ALL
            launch.run(dq_kind, storage, bound, batch * heads * -(-q_len // block),
                       launch.backward_tc_shared_bytes(dq_kind, head_dim, value_dim),
                       (*tc_common, out_rounded, dominant_gradients, dq), options=options)
            launch.run(dkdv_kind, storage, bound, batch * kv_heads * -(-kv_len // block),
                       launch.backward_tc_shared_bytes(dkdv_kind, head_dim, value_dim),
                       (*tc_common, dominant_gradients, dk, dv), options=options)
        else:
            launch.run(dkdv_kind, storage, bound, batch * kv_heads * key_tiles, shared, (*common, dk, dv))
            launch.run(dq_kind, storage, bound, batch * heads * query_tiles, shared, (*common, dq))
        dbias = None
        if problem.bias is not None:
            shape = (1,) * (4 - len(problem.bias_shape)) + tuple(problem.bias_shape)
            dbias = cp.zeros(shape, dtype)
            blocks = (shape[0] * shape[1] * (query_tiles if shape[2] > 1 else 1)
                      * (key_tiles if shape[3] > 1 else 1))
            launch.run("dbias", storage, 0, blocks, shared,
                       (*common, dbias, _int64s(cp, shape)))
            dbias = dbias.reshape(problem.bias_shape)
        dsink_logits = None if problem.sink_logits is None else sink_logits_gradient(cp, problem, lse, delta)
    return Gradients(dq=dq, dk=dk, dv=dv, dbias=dbias, dsink_logits=dsink_logits)
