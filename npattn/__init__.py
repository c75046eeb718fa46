"""npattn: fast, exact attention for plain arrays (NumPy on CPUs, CuPy on NVIDIA GPUs).

Public names: :func:`attention`, :func:`attention_vjp`, :func:`backends`, :func:`warmup`.
Importing npattn needs only NumPy; Numba and CuPy load when a backend needs them.
"""
from .api import attention, attention_vjp
from .backends import BackendStatus, backends
from .warmup import warmup

__version__ = "0.1.0"
__all__ = ["attention", "attention_vjp", "backends", "BackendStatus", "warmup", "__version__"]
