"""GPU backend: CuPy ``RawModule`` CUDA kernels compiled from the package's .cu files.

Modules: :mod:`.sources` (the CUDA translation unit and every instantiation),
:mod:`.nvrtc` (compiling it to machine code with no GPU), :mod:`.sass` (reading that
machine code: spills, tensor-core instructions), :mod:`.options` (the option sets a
kernel is specialized on), :mod:`.kernel_cache` (cubins kept on disk per
instantiation), :mod:`.launch` (modules per device and instantiation, shared-memory
sizes, one launch) and :mod:`.driver` (operands, outputs, gradients). The kernels are
FlashAttention-2 style: tensor cores for float16/bfloat16 (``tensor_core.cuh``,
``forward_tc.cu``, ``decode_tc.cu``, ``backward_tc.cu``), SIMT otherwise (``forward.cu``,
``backward.cu``), all on ``common.cuh``'s score pipeline; float32 accumulation (float64
for float64), every option of :func:`npattn.attention` fused, a deterministic
backward, head dims up to 256. Importing this package imports nothing but the standard library; CuPy is
imported on first use.
"""
from __future__ import annotations

import importlib.util

NAME = "gpu"
# int8 and float8 e4m3 kv caches with per-row scales: the SIMT forward dequantizes their
# tiles as it loads them (common.cuh, load_key_tile)
QUANTIZED_KV = True


def unavailable_reason(array_kind: str = "cupy") -> str | None:
    if array_kind != "cupy":
        return f"the gpu backend takes CuPy arrays, got {array_kind} arrays"
    if importlib.util.find_spec("cupy") is None:
        return "needs CuPy (pip install 'npattn[gpu]'); it is not installed"
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # no driver, no runtime library: CuPy raises several kinds
        return f"CUDA is not usable here: {error}"
    if count == 0:
        return "no CUDA device is visible"
    return None


def forward(problem):
    from .driver import forward as run
    return run(problem)


def forward_plan(problem):
    """A callable ``(q, k, v, arrays) -> ForwardResult | None`` running the forward of any
    problem of ``problem``'s structure (see :class:`.driver.ForwardPlan`)."""
    from .driver import ForwardPlan
    return ForwardPlan(problem)


def backward(problem, saved, dout):
    from .driver import backward as run
    return run(problem, saved, dout)
