"""Which optional code a tensor-core kernel instantiation is compiled with.

The float16/bfloat16 kernels take a bit set of :class:`Option` as a template argument:
an option's code (a bias read, a mask test, the dropout hash, ...) exists in an
instantiation only when its bit is set, so a plain call runs none of it. The driver
asks for the bits a call needs (:func:`options_of`); CuPy compiles each instantiation
on first use and caches it. :func:`npattn.gpu.sources.source` writes the bits into the
CUDA source as ``NPATTN_OPTION_*`` defines, so Python and CUDA cannot disagree.
"""
from __future__ import annotations

from enum import IntFlag

from ..core import options as _table
from ..core.arrays import is_cupy


def _bits(names) -> type[IntFlag]:
    bits = [(name, 1 << position) for position, name in enumerate(names)]
    return IntFlag("Option", bits)  # type: ignore[return-value]


# One bit per ``gpu_option`` of the options table (MASK, BIAS, ALIBI, SOFTCAP, DROPOUT,
# SINK, BAND: causal, a window with sinks, kv_lengths or left padding, keys a row may not
# see; PAGED: k and v in pages, looked up per key row; an entry's doc says what each
# does), then three of the operands: UNALIGNED (rows not 16-byte aligned: plain
# loads instead of cp.async), NARROW (head dims, rounded up to 16, below the kernel's
# bound: loops test them) and CODES (k and v a quantized cache's int8 or e4m3 codes with
# their scales, dequantized to the inputs' 16-bit type as their tiles are staged); and
# REGISTER_CODES, a way to read CODES that the driver picks with the tile
# (npattn.gpu.sources.reads_codes_into_registers): a decode step's codes loaded straight
# into the mma fragments' registers, no tile of them staged; and TRANSPOSED, which the
# driver adds to REGISTER_CODES for a step of at most 8 packed rows a kv head
# (npattn.gpu.sources.transposes_decode): its products with the keys on the mma's 16
# rows and the packed rows on its 8 columns (decode_tc.cu); and MERGES, which the driver
# adds to a split step of few splits a row (npattn.gpu.driver.merges_in_forward): the last
# block of each work item merges the item's partial rows, where combine_kernel would
# (merge.cuh). Kernels without it carry none of that code (the merge and the reference's
# recompute of a row: twice the kernel's instructions).
Option = _bits(dict.fromkeys([*(option.gpu_option for option in _table.OPTIONS if option.gpu_option),
                              "UNALIGNED", "NARROW", "CODES", "REGISTER_CODES", "TRANSPOSED", "MERGES"]))


def _union(selected) -> IntFlag:
    bits = Option(0)
    for option in _table.OPTIONS:
        if option.gpu_option and selected(option):
            bits |= Option[option.gpu_option]
    return bits


# every option that changes a score or its visibility (the SIMT kernels compile them all)
ALL = _union(lambda option: True)
# those ``finish_score`` reads at every score (a tile inside the band without them is plain)
PER_SCORE = _union(lambda option: option.per_score)


def defines() -> list[str]:
    """The ``#define NPATTN_OPTION_*`` lines of the CUDA source."""
    lines = [f"#define NPATTN_OPTION_{member.name} {member.value}u" for member in Option]
    return lines + [f"#define NPATTN_OPTION_ALL {ALL.value}u", f"#define NPATTN_OPTION_PER_SCORE {PER_SCORE.value}u"]


def _aligned(array) -> bool:
    """16-byte aligned rows: the base address and every stride but the last a multiple of
    16 bytes, and the last axis unit-stride (cp.async copies 16 bytes at a time)."""
    return _strides_aligned(array) and _address(array) % 16 == 0


def _strides_aligned(array) -> bool:
    """:func:`_aligned`'s part that the array's structure decides (a plan's, once)."""
    if array.shape[-1] > 1 and array.strides[-1] != array.itemsize:
        return False
    return all(s % 16 == 0 for n, s in zip(array.shape[:-1], array.strides[:-1]) if n > 1)


def _address(array) -> int:
    """Where the array's first element lies in (device) memory."""
    if is_cupy(array):  # its memory pointer, without building the interface dict
        return array.data.ptr
    interface = getattr(array, "__cuda_array_interface__", None) or array.__array_interface__
    return interface["data"][0]


def options_of(problem, arrays=(), bound: int = 0) -> Option:
    """The options ``problem`` (a validated :class:`npattn.core.problem.Problem`) needs;
    ``arrays``: the operands the kernel reads by rows (q, k, v as passed), which decide
    :attr:`Option.UNALIGNED`, as do head dims that are not a multiple of 8; ``bound``:
    the kernel's head-dim bound, which decides :attr:`Option.NARROW` (0: not set)."""
    def whole_tiles(dim):
        return -(-dim // 16) * 16

    needed = Option(0)
    for option in _table.OPTIONS:  # MASK, BIAS, ..., BAND: from the options table
        if option.gpu_option is not None and option.present(problem):
            needed |= Option[option.gpu_option]
    flags = {
        Option.UNALIGNED: (problem.head_dim % 8 != 0 or problem.value_dim % 8 != 0
                           or not all(_aligned(array) for array in arrays)),
        Option.NARROW: bound > 0 and min(whole_tiles(problem.head_dim), whole_tiles(problem.value_dim)) < bound,
        Option.CODES: problem.k_scale is not None,
    }
    for option, present in flags.items():
        if present:
            needed |= option
    return needed


def describe(options: int) -> str:
    """``options`` as names, for messages: "BAND|BIAS", or "none"."""
    names = [member.name for member in Option if options & member]
    return "|".join(names) if names else "none"

