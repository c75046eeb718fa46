"""npattn: fast, exact attention for plain arrays (NumPy on CPUs, CuPy on NVIDIA GPUs).

Public names: :func:`attention`, :func:`attention_vjp`, :func:`attention_backward` and
:func:`attention_for_backward`;
for serving, :func:`attention_varlen` / :func:`attention_varlen_vjp` (packed
variable-length batches) and :func:`attention_with_kvcache` (decoding against a
contiguous or paged cache); :func:`backends`, :func:`warmup`; :mod:`npattn.torch` and :mod:`npattn.jax` for programs of
those frameworks. Importing npattn needs only NumPy; Numba and CuPy load when a backend
needs them, torch and JAX when their adapters are used.
"""
from .adapters.dispatch import (attention, attention_varlen, attention_varlen_vjp, attention_vjp,
                                attention_with_kvcache, merge_states)
from .api import Plan, attention_backward, attention_for_backward, plan
from .core.quantization import dequantize_kv, quantize_kv
from .backends import BackendStatus, backends
from .serving.kvcache import KVCachePlan, plan_with_kvcache
from .serving.varlen import VarlenPlan, plan_varlen
from .warmup import warmup

__version__ = "0.1.0"

# Subpackages and modules that load on first use (PEP 562), so ``npattn.torch.attention``
# works after ``import npattn`` alone; importing npattn still imports none of them (nor torch
# or JAX, which npattn.torch and npattn.jax import).
_LAZY_SUBMODULES = ("torch", "jax", "nn", "autograd", "distributed", "cpu", "gpu", "core", "runtime", "serving",
                    "tools", "testing", "compat")


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'npattn' has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *_LAZY_SUBMODULES})
__all__ = ["attention", "attention_vjp", "attention_backward", "attention_for_backward", "plan", "Plan", "attention_varlen", "attention_varlen_vjp",
           "plan_varlen", "VarlenPlan", "attention_with_kvcache", "plan_with_kvcache", "KVCachePlan", "merge_states",
           "quantize_kv", "dequantize_kv", "backends", "BackendStatus", "warmup", "__version__"]
