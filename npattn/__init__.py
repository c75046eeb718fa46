"""npattn: fast, exact attention for plain arrays (NumPy on CPUs, CuPy on NVIDIA GPUs).

Public names: :func:`attention`, :func:`attention_vjp`, :func:`attention_backward`;
for serving, :func:`attention_varlen` / :func:`attention_varlen_vjp` (packed
variable-length batches) and :func:`attention_with_kvcache` (decoding against a
contiguous or paged cache); :func:`backends`, :func:`warmup`; :mod:`npattn.torch` and :mod:`npattn.jax` for programs of
those frameworks. Importing npattn needs only NumPy; Numba and CuPy load when a backend
needs them, torch and JAX when their adapters are used.
"""
from .api import attention, attention_backward, attention_vjp
from .backends import BackendStatus, backends
from .kvcache import attention_with_kvcache
from .varlen import attention_varlen, attention_varlen_vjp
from .warmup import warmup

__version__ = "0.1.0"
__all__ = ["attention", "attention_vjp", "attention_backward", "attention_varlen", "attention_varlen_vjp",
           "attention_with_kvcache", "backends", "BackendStatus", "warmup", "__version__"]
