"""GPU backend: CuPy ``RawModule`` CUDA kernels compiled from the package's .cu files.

The kernels are not built yet, so this backend reports itself unavailable; CuPy
arrays run on the reference backend (float64 math on the device) meanwhile.
"""
NAME = "gpu"


def unavailable_reason(array_kind: str = "cupy") -> str | None:
    if array_kind != "cupy":
        return f"the gpu backend takes CuPy arrays, got {array_kind} arrays"
    return "the CUDA kernels are not implemented yet"
