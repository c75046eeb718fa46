"""Compiling the CUDA sources with CuPy (lazily, memoized per device and dtype) and
launching one kernel.

Each (device, dtype) pair gets its own ``cupy.RawModule`` holding that dtype's
instantiations only (about a quarter of :func:`~npattn.gpu.sources.name_expressions`),
so a first float16 call does not wait for float64 kernels to compile. CuPy keeps the
compiled code in its on-disk kernel cache, so later processes skip NVRTC.
"""
from __future__ import annotations

import numpy as np

from . import sources

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


def forward_tc_shared_bytes(head_dim: int, value_dim: int) -> int:
    """Dynamic shared memory of forward_tc_kernel: ``TensorCoreLayout`` in forward_tc.cu
    (Q and K tiles of 64 rows and V^T of Dv rows, 16-bit values, head dims rounded up
    to whole mma tiles, 8 values of padding per row)."""
    block, pad = sources.TENSOR_CORE_BLOCK, 8
    head_dim, value_dim = -(-head_dim // 16) * 16, -(-value_dim // 8) * 8
    return 2 * (2 * block * (head_dim + pad) + value_dim * (block + pad))


def backward_tc_shared_bytes(kind: str, head_dim: int, value_dim: int) -> int:
    """Dynamic shared memory of dkdv_tc_kernel or dq_tc_kernel (``kind``): the 16-bit tiles
    of ``TensorCoreBackwardLayout`` in backward_tc.cu (64-row tiles of D and Dv columns,
    transposed tiles of D and Dv rows), plus dkdv's lse and delta per query row."""
    block, pad = sources.TENSOR_CORE_BLOCK, 8
    head_dim, value_dim = -(-head_dim // 16) * 16, -(-value_dim // 16) * 16
    rows_d, rows_dv = block * (head_dim + pad), block * (value_dim + pad)
    transposed_d, transposed_dv = head_dim * (block + pad), value_dim * (block + pad)
    if kind == "dkdv_tc":
        return 2 * (2 * rows_d + 2 * rows_dv + transposed_d + transposed_dv) + 4 * 2 * block
    return 2 * (2 * rows_d + 2 * rows_dv + transposed_d)


def backward_shared_bytes(head_dim: int, value_dim: int, dtype) -> int:
    """Dynamic shared memory of the backward kernels: ``BackwardLayout`` in backward.cu
    (query and dout tiles, key and value tiles with padded rows, three score-shaped
    tiles with padded rows, lse and delta per row)."""
    rows, keys = sources.BLOCK_Q, sources.BACKWARD_BLOCK_K
    elements = (rows * head_dim + rows * value_dim + keys * (head_dim + 1) + keys * (value_dim + 1)
                + 3 * rows * (keys + 1) + 2 * rows)
    return elements * np.dtype(dtype).itemsize


def _module(storage: str):
    import cupy

    device = cupy.cuda.Device().id
    key = (device, storage)
    if key not in _MODULES:
        names = tuple(name for name in sources.name_expressions()
                      if name.split("<", 1)[1].startswith(sources.STORAGE[storage][0] + ","))
        _MODULES[key] = cupy.RawModule(code=sources.source(), options=("--std=c++17",), name_expressions=names)
    return _MODULES[key]


def run(kind: str, storage: str, bound: int, blocks: int, shared_bytes: int, arguments) -> None:
    """Launch ``kind``'s instantiation for ``storage`` (a dtype name) and head-dim ``bound``
    on ``blocks`` blocks of :data:`~npattn.gpu.sources.THREADS` threads (every kernel,
    the tensor-core forward's 4 warps included, runs 128)."""
    if blocks <= 0:
        return
    kernel = _module(storage).get_function(sources.kernel_name(kind, storage, bound))
    if shared_bytes > _DEFAULT_SHARED_BYTES:
        kernel.max_dynamic_shared_size_bytes = shared_bytes
    kernel((int(blocks),), (sources.THREADS,), tuple(arguments), shared_mem=shared_bytes)
