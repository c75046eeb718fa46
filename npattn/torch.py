"""npattn inside torch programs: :func:`attention` as a torch operator with autograd.

See :mod:`npattn.adapters.torch`. Importing this module imports torch.
"""
from .adapters.torch import attention, attention_varlen

__all__ = ["attention", "attention_varlen"]
