"""Array-kind helpers: NumPy or CuPy, decided by the arrays themselves, cupy never imported eagerly."""
from __future__ import annotations

import functools
import math

import numpy as np


def is_cupy(array) -> bool:
    """True for a CuPy ndarray, without importing CuPy."""
    return type(array).__module__.split(".")[0] == "cupy"


def array_module(array):
    """``numpy`` or ``cupy``, whichever owns ``array``."""
    if is_cupy(array):
        import cupy

        return cupy
    return np


def array_kind(array) -> str:
    """"numpy" or "cupy": the name used in error messages and backend dispatch."""
    return "cupy" if is_cupy(array) else "numpy"


def to_numpy(array):
    """A NumPy copy of a NumPy or CuPy array (a no-op view for NumPy)."""
    return array.get() if is_cupy(array) else np.asarray(array)


def check_native(function: str, instead: str, values) -> None:
    """Raise TypeError when any of ``values`` is another framework's array (it speaks
    DLPack but is neither NumPy nor CuPy): the plans take NumPy and CuPy arrays only, and
    ``instead`` names the calls such programs use."""
    if any(type(value) is not np.ndarray and not is_cupy(value) and hasattr(value, "__dlpack__") for value in values):
        raise TypeError(f"{function} takes NumPy or CuPy arrays ({instead})")


def all_finite(array) -> bool:
    """No NaN or inf in ``array`` (None passes). A float32 or float64 NumPy array first
    takes one BLAS pass, the sum of its squares: finite, every element is (a NaN or an
    inf makes it NaN or inf), 2 us on a (1, 8, 16, 64) array. Otherwise (a sum that
    overflowed, another dtype, a large strided array) its min and max decide: two
    reductions that neither warn nor overflow, and no boolean mask (``isfinite(a).all()``
    writes one), 3-4 us there. A CuPy array takes one fused reduction and one wait for
    the device."""
    if array is None or array.size == 0:
        return True
    if is_cupy(array) and array.dtype.kind == "f":
        return bool(_device_all_finite()(array))
    if array.dtype in _BLAS_FLOATS and (array.flags.c_contiguous or array.flags.f_contiguous
                                         or array.size <= _SMALL_COPY or _one_block(array)):
        flat = array.ravel(order="K")  # a view in memory order (a small copy otherwise)
        with np.errstate(all="ignore"):
            if math.isfinite(np.dot(flat, flat)):
                return True
    exponent = _exponent_bits(array.dtype)
    if exponent is not None and type(array) is np.ndarray:
        # 16-bit floats: NumPy's min and max run scalar loops there (6 ms for a million);
        # a value is NaN or inf exactly when its exponent bits are all ones
        bits = array.view(np.uint16) if array.flags.c_contiguous else np.ascontiguousarray(array).view(np.uint16)
        return int(np.bitwise_and(bits, exponent).max(initial=0)) < exponent
    return math.isfinite(array.min()) and math.isfinite(array.max())


# The exponent bits of the 16-bit floats (bfloat16's name is ml_dtypes')
_EXPONENT_BITS = {"float16": 0x7C00, "bfloat16": 0x7F80}
_EXPONENT_BITS_OF_DTYPE: dict = {}


def _exponent_bits(dtype):
    """:data:`_EXPONENT_BITS` of a 16-bit float ``dtype`` in the machine's byte order, None
    for others (a byte-swapped one's words are not its bits: its min and max decide); by
    the dtype object once it was seen (NumPy 2.4's ``dtype.name`` takes 5 us, half a small
    float16 array's check)."""
    try:
        return _EXPONENT_BITS_OF_DTYPE[dtype]
    except KeyError:
        bits = _EXPONENT_BITS.get(dtype.name) if dtype.isnative else None
        _EXPONENT_BITS_OF_DTYPE[dtype] = bits
        return bits


def _one_block(array) -> bool:
    """Whether ``array``'s elements fill one block of memory in some order of its axes
    (a bhsd view of a bshd array does): ``ravel(order="K")`` is then a view."""
    expected = array.itemsize
    for stride, extent in sorted(zip(array.strides, array.shape)):
        if extent != 1 and stride != expected:
            return False
        expected *= extent
    return True


_BLAS_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
# Elements of a strided array (a bhsd view of a bshd output) flattened by a copy for the dot:
# up to 64 KiB, a copy is cheaper than the second reduction.
_SMALL_COPY = 1 << 13


def all_finite_arrays(arrays) -> bool:
    """:func:`all_finite` of every array of ``arrays`` (None entries pass); CuPy arrays
    are reduced on the device side by side and read back together: one synchronization
    for them all, where a min and a max each would wait for the device."""
    on_device = []
    for array in arrays:
        if array is None or array.size == 0:
            continue
        if is_cupy(array) and array.dtype.kind == "f":
            on_device.append(array)
        elif not all_finite(array):
            return False
    if len(on_device) <= 1:
        return not on_device or all_finite(on_device[0])
    import cupy

    flags = cupy.empty(len(on_device), bool)  # one flag each, read back in one copy
    for index, array in enumerate(on_device):
        _device_all_finite()(array, out=flags[index])
    return bool(flags.get().all())


@functools.lru_cache(maxsize=None)
def _device_all_finite():
    """A CuPy reduction to a 0-d bool: whether every element is finite (``x - x`` is 0
    exactly for finite x, NaN for NaN and inf; in double, so float16 and float32 are exact)."""
    import cupy

    return cupy.ReductionKernel("T x", "bool y", "(double)x - (double)x == 0.0", "a && b", "y = a", "true",
                                "npattn_all_finite")


def is_torch_bfloat16(value) -> bool:
    """A torch tensor of dtype bfloat16 (checked without importing torch)."""
    return type(value).__module__.startswith("torch") and str(getattr(value, "dtype", "")) == "torch.bfloat16"


def torch_bfloat16_to_numpy(name: str, tensor):
    """A CPU torch bfloat16 tensor as a NumPy array of ml_dtypes' bfloat16, sharing its
    memory (torch's own ``.numpy()`` refuses bfloat16; its bits go through int16)."""
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError(f"{name} is a torch bfloat16 tensor: reading it needs ml_dtypes (pip install ml_dtypes), "
                        "or pass tensor.float()") from None
    import torch

    if tensor.device.type != "cpu":
        raise TypeError(f"{name} is a torch bfloat16 tensor on {tensor.device}: move it to the CPU "
                        "(tensor.cpu()) or pass a CuPy array")
    return tensor.detach().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
