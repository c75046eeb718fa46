"""Drop-in calls with other libraries' names, defaults and layouts, computed by npattn.

Code written against FlashAttention 2 or torch's SDPA runs on npattn by changing an import:

- :func:`flash_attn_func`, :func:`flash_attn_varlen_func` and
  :func:`flash_attn_with_kvcache` take FlashAttention 2's arguments and conventions:
  (B, S, H, D) arrays, ``softmax_scale``, ``window_size=(-1, -1)`` for no window,
  ``softcap=0.0`` for none, ``alibi_slopes``, causal masks aligned bottom-right,
  ``rotary_interleaved=True`` by default, ``cache_seqlens`` optional.
- :func:`scaled_dot_product_attention` takes torch's ``(query, key, value, attn_mask,
  dropout_p, is_causal, scale, enable_gqa)``: (..., H, L, E) arrays, a top-left causal
  mask, a boolean ``attn_mask`` where True takes part, a float one added to the scores.

Any array kind goes in (NumPy, CuPy, torch tensors, JAX arrays) and the same kind comes
out, as everywhere in npattn. What differs from the originals, by design: dropout draws
npattn's counter-based mask (:mod:`npattn.core.dropout`), not the CUDA generator's; a row
that sees no key gives zeros (torch's math path gives NaN); every backward is
deterministic (``deterministic`` is accepted and changes nothing).
"""
from .flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from .torch_sdpa import scaled_dot_product_attention

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "scaled_dot_product_attention"]
