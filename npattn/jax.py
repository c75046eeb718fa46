"""npattn inside JAX programs: :func:`attention` as a ``jax.custom_vjp`` for ``jit``, ``grad`` and ``vmap``.

See :mod:`npattn.adapters.jax`. Importing this module imports JAX.
"""
from .adapters.jax import attention, attention_varlen

__all__ = ["attention", "attention_varlen"]
