"""Adapters: npattn for arrays and programs of other frameworks.

- ``arrays.py``: any array that speaks DLPack (torch, JAX, ...) in, the caller's kind out;
  :func:`npattn.attention` and :func:`npattn.attention_vjp` go through it for such arrays.
- ``torch.py``: :func:`npattn.torch.attention`, a ``torch.library`` custom op with autograd.
- ``jax.py``: :func:`npattn.jax.attention`, a ``jax.custom_vjp`` for ``jit``, ``grad`` and ``vmap``.

Neither torch nor JAX is imported by npattn unless one of these is used.
"""
