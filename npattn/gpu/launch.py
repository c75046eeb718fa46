"""Compiling the CUDA sources with CuPy (lazily, one instantiation at a time) and
launching one kernel.

Each (device, instantiation) pair gets its own module compiled on its first launch, so
a call waits only for the kernels it runs (the tensor-core forward has an instantiation
per tile shape and option set: a plain float16 call compiles one). The cubins are kept
on disk by :mod:`npattn.gpu.kernel_cache`, so later processes skip NVRTC; without an
NVRTC library of its own npattn falls back to CuPy's compiler, which recompiles in
every process.
"""
from __future__ import annotations

import numpy as np

from . import kernel_cache, sources

_MODULES = {}
# CUDA's limit on dynamic shared memory without an opt-in
_DEFAULT_SHARED_BYTES = 48 * 1024


def forward_shared_bytes(head_dim: int, value_dim: int, dtype) -> int:
    """Dynamic shared memory of forward_kernel and weights_kernel: ``ForwardLayout`` in
    forward.cu (query tile, key tile with a padded row, value tile, score tile with a
    padded row, four per-row values)."""
    block_k = sources.FORWARD_BLOCK_K["double" if np.dtype(dtype) == np.float64 else "float"]
    rows = sources.BLOCK_Q
    elements = (rows * head_dim + block_k * (head_dim + 1) + block_k * value_dim
                + rows * (block_k + 1) + 4 * rows)
    return elements * np.dtype(dtype).itemsize


def combine_shared_bytes(value_dim: int, dtype, warps: int) -> int:
    """Dynamic shared memory of combine_kernel (repair.cu) on blocks of ``warps`` warps:
    each warp's sums (value_dim columns and l); the first pass's maxima reuse the same bytes."""
    return warps * (value_dim + 1) * np.dtype(dtype).itemsize


# bytes after each row of a quantized cache's staged codes (CODE_ROW_PAD in tensor_core.cuh)
_CODE_ROW_PAD = 16


def forward_tc_shared_bytes(head_dim: int, value_dim: int, tile: sources.ForwardTile, codes: bool = False,
                            register_codes: bool = False, transposed: bool = False) -> int:
    """Dynamic shared memory of forward_tc_kernel with ``tile``: ``ForwardTensorCoreLayout`` in
    forward_tc.cu (swizzled 16-bit tiles: Q of tile.block_q rows, tile.stages K and V tiles
    of block_k rows; head dims rounded up to 16, rows to 64 values; with ``codes``, a
    quantized cache's, a K and a V tile of its byte codes after them, rows padded), or
    the output tile staged in the same bytes, if that is larger. With ``register_codes``
    (Option.REGISTER_CODES) no 16-bit K or V tile: Q's tile and two stages of raw codes
    (K's and V's rows, CODE_ROW_PAD bytes longer, and their scales). The bytes decide how
    many blocks an SM holds: a decode step's 29.7 KB with 16-bit and code tiles fit 7 on
    an H200's SM, below the 8 its registers allow; its 22.5 KB now fit 9. ``transposed``
    (Option.TRANSPOSED, decode_tc.cu) keeps Q in registers and writes out from them: two
    stages for each warp alone (18.5 KB a warp at 128-wide heads)."""
    def row(dim):
        return -(-(-(-dim // 16) * 16) // 64) * 64
    block_q, keys = tile.block_q, tile.stages * tile.block_k
    if register_codes:
        stages = 2 * (2 * tile.block_k * (row(head_dim) + _CODE_ROW_PAD) + 2 * tile.block_k * 4)
        if transposed:  # (two stages a warp: each warp streams its own share of the keys)
            return tile.warps * stages
        return max(2 * block_q * row(head_dim) + stages, 2 * block_q * row(value_dim))
    code_bytes = tile.block_k * (row(head_dim) + row(value_dim) + 2 * _CODE_ROW_PAD) if codes else 0
    return max(2 * (block_q * row(head_dim) + keys * (row(head_dim) + row(value_dim))) + code_bytes,
               2 * block_q * row(value_dim))


def backward_tc_shared_bytes(kind: str, head_dim: int, value_dim: int) -> int:
    """Dynamic shared memory of dkdv_tc_kernel or dq_tc_kernel (``kind``): the swizzled
    16-bit tiles of ``TensorCoreBackwardLayout`` in backward_tc.cu (Q, K, V and dO, 64
    rows each; head dims rounded up to 16, rows to 64 values), plus dkdv's lse, delta and
    the dQ pass's dominant key and its gradient (4 bytes each) per query row."""
    def row(dim):
        return -(-(-(-dim // 16) * 16) // 64) * 64
    block = sources.TENSOR_CORE_BLOCK
    tiles = 2 * 2 * block * (row(head_dim) + row(value_dim))
    if kind == "dkdv_tc":
        return tiles + 4 * 4 * block
    return tiles


def backward_shared_bytes(head_dim: int, value_dim: int, dtype) -> int:
    """Dynamic shared memory of the backward kernels: ``BackwardLayout`` in backward.cu
    (query and dout tiles, key and value tiles with padded rows, three score-shaped
    tiles with padded rows, lse and delta per row)."""
    rows, keys = sources.BLOCK_Q, sources.BACKWARD_BLOCK_K
    elements = (rows * head_dim + rows * value_dim + keys * (head_dim + 1) + keys * (value_dim + 1)
                + 3 * rows * (keys + 1) + 2 * rows)
    return elements * np.dtype(dtype).itemsize


def _kernel(name: str):
    import cupy

    device = cupy.cuda.Device()
    key = (device.id, name)
    if key not in _MODULES:
        try:
            path, symbol = kernel_cache.cubin(f"sm_{device.compute_capability}", name)
        except RuntimeError as no_nvrtc:
            if isinstance(no_nvrtc, kernel_cache.nvrtc.CompileError):
                raise
            module = cupy.RawModule(code=sources.source(), options=("--std=c++17",), name_expressions=(name,))
            _MODULES[key] = module.get_function(name)
        else:
            _MODULES[key] = cupy.RawModule(path=str(path)).get_function(symbol)
    return _MODULES[key]


def threads_of(kind: str, tile: sources.ForwardTile | None = None) -> int:
    """Threads per block of ``kind``'s kernels where the caller names none: the
    tensor-core forward's tile's, else :data:`~npattn.gpu.sources.THREADS`."""
    return tile.threads if kind == "forward_tc" else sources.THREADS


def kernel(kind: str, storage: str, bound: int, shared_bytes: int, threads: int | None = None, **config):
    """A callable ``launch(blocks, arguments)`` that runs ``kind``'s instantiation (see
    :func:`run`) on the current device, on blocks of ``threads`` threads (default
    :func:`threads_of`): compiled or loaded now, so a plan keeps it and each call pays
    only CuPy's launch (no name formatting or module lookup)."""
    function = _kernel(sources.kernel_name(kind, storage, bound, **config))
    threads = threads or threads_of(kind, config.get("tile"))
    if shared_bytes > _DEFAULT_SHARED_BYTES:
        function.max_dynamic_shared_size_bytes = shared_bytes
    block = (threads,)

    def launch(blocks: int, arguments) -> None:
        if blocks > 0:
            function((int(blocks),), block, tuple(arguments), shared_mem=shared_bytes)
    return launch


def run(kind: str, storage: str, bound: int, blocks: int, shared_bytes: int, arguments, threads: int | None = None,
        **config) -> None:
    """Launch ``kind``'s instantiation for ``storage`` (a dtype name) and head-dim ``bound``
    on ``blocks`` blocks of ``threads`` threads (default :func:`threads_of`); ``config``
    (tile, options) picks the tensor-core forward's."""
    if blocks > 0:
        kernel(kind, storage, bound, shared_bytes, threads, **config)(blocks, arguments)
