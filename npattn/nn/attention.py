"""MultiHeadAttention and its MQA, GQA and sliding-window variants (API.md section 4).

The module projects batch-first inputs, runs :func:`npattn.autograd.attention` once in
the "bshd" layout (the projections' own layout: no transposes or copies), and
projects back. Every option becomes a keyword of that one fused call: masks and
padding become its ``mask``, float masks and biases its ``bias``. A cached step with no
gradient to record (inference) goes through :meth:`npattn.nn.KVCache.attend` instead
(:func:`npattn.attention_with_kvcache`): the new keys are written into the cache and the
kernels read it in place, where the recording path concatenates it with them.
"""
from __future__ import annotations

import numpy as np

from .. import autograd as ag
from ..core import arguments
from .layers import LayerNorm, Linear, RMSNorm
from .module import Module, parameter
from .multiway import Multiway
from .rotary import apply_rope, apply_xpos, rope_tables

_NORMS = {"layernorm": LayerNorm, "rmsnorm": RMSNorm}
MASK_CONVENTIONS = ("allow", "torch")


class MultiHeadAttention(Module):
    """Multi-head attention with grouped key/value heads and every fused option.

    Args:
        embed_dim: E, the width of the query input and of the output.
        num_heads: H query heads of ``head_dim = E // H``.
        num_kv_heads: Hkv key/value heads (H divisible by it); None for H.
        kdim, vdim: widths of the key and value inputs (cross attention); None for E.
        bias: biases in the four projections.
        dropout: attention-probability dropout in training mode.
        causal: bottom-right causal masking (overridable per call).
        window, sinks: sliding window and attention sinks, as :func:`npattn.attention`.
        qk_norm: False, "layernorm" or "rmsnorm": normalize each head's queries and keys
            over the head dimension (parameters ``q_norm.*``, ``k_norm.*``).
        clip_qkv: clamp the q, k and v projections to [-clip_qkv, clip_qkv].
        softmax_scale: the score scale; None for 1 / sqrt(head_dim).
        subln: a LayerNorm (``inner_attn_ln``) on the attention output before out_proj.
        rotary: None, "rope" (HF Llama's rotate-half) or "xpos" (torchscale's XPOS, with
            ``xpos_scale_base``); positions of queries and keys from 0, bottom-right aligned.
        multiway: two sets of projections (and subln norms), ``A`` for positions before
            the call's ``split_position`` and ``B`` after (torchscale's multiway).
        sink_logits: learn one sink logit per head (parameter ``sink_logits``, zeros).
        mask_convention: what True means in a boolean ``attn_mask``: "allow" (may attend,
            as :func:`npattn.attention` and torch's ``scaled_dot_product_attention``) or
            "torch" (masked out, as ``torch.nn.MultiheadAttention`` and
            ``torch.nn.TransformerEncoderLayer``; :func:`~npattn.nn.from_torch` sets it).
        dtype, seed: parameter dtype; ``reset_parameters(seed)`` at construction.
        backend: the backend of the attention call.

    Call: ``mha(query (B, Sq, E), key (B, Sk, kdim) = query, value (B, Sk, vdim) = key,
    *, key_padding_mask (B, Sk) bool True = padding, attn_mask bool (True = may attend,
    or masked out with ``mask_convention="torch"``) or float additive (broadcastable to (B, H, Sq, Sk)), bias (same), cache=None,
    causal=None, need_weights=False, average_attn_weights=True)`` -> out (B, Sq, E), or
    ``(out, weights)`` with weights (B, Sq, Sk) averaged over heads or (B, H, Sq, Sk).
    With ``cache`` (a :class:`~npattn.nn.KVCache`, self-attention only) the new positions'
    keys and values are appended to it and the queries attend over everything it holds:
    decoding token by token equals one causal pass.
    """

    def __init__(self, embed_dim: int, num_heads: int, *, num_kv_heads=None, kdim=None, vdim=None,
                 bias: bool = True, dropout: float = 0.0, causal: bool = False, window=None, sinks: int = 0,
                 qk_norm=False, clip_qkv=None, softmax_scale=None, subln: bool = False, rotary=None,
                 xpos_scale_base: float = 512.0, multiway: bool = False, sink_logits: bool = False,
                 mask_convention: str = "allow", dtype="float32", seed=None, backend: str = "auto"):
        super().__init__()
        owner = type(self).__name__
        embed_dim, num_heads = arguments.size(owner, "embed_dim", embed_dim), arguments.size(owner, "num_heads", num_heads)
        num_kv_heads = num_heads if num_kv_heads is None else arguments.size(owner, self._KV_HEADS, num_kv_heads)
        kdim, vdim = arguments.optional_size(owner, "kdim", kdim), arguments.optional_size(owner, "vdim", vdim)
        sinks = arguments.size(owner, "sinks", sinks, minimum=0)
        dropout = arguments.probability(owner, "dropout", dropout)
        dtype = arguments.float_dtype(owner, "dtype", dtype)
        xpos_scale_base = arguments.positive(owner, "xpos_scale_base", xpos_scale_base)
        if softmax_scale is not None:
            softmax_scale = arguments.positive(owner, "softmax_scale", softmax_scale)
        if embed_dim % num_heads:
            raise ValueError(f"{owner}: embed_dim must be divisible by num_heads "
                             f"({num_heads}); got {embed_dim}")
        if num_heads % num_kv_heads:
            raise ValueError(f"{owner}: {self._KV_HEADS} must divide num_heads ({num_heads}); "
                             f"got {num_kv_heads}")
        if qk_norm not in (False, None, "layernorm", "rmsnorm"):
            raise ValueError(f"{owner}: qk_norm must be False, 'layernorm' or 'rmsnorm'; "
                             f"got {qk_norm!r}")
        if mask_convention not in MASK_CONVENTIONS:
            raise ValueError(f"{owner}: mask_convention must be one of {MASK_CONVENTIONS}; got {mask_convention!r}")
        if rotary not in (None, "rope", "xpos"):
            raise ValueError(f"{owner}: rotary must be None, 'rope' or 'xpos'; got {rotary!r}")
        if clip_qkv is not None and not clip_qkv > 0:
            raise ValueError(f"{owner}: clip_qkv must be positive or None; got {clip_qkv}")
        rng = np.random.default_rng(seed)
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.dropout, self.causal, self.window, self.sinks = dropout, causal, window, sinks
        self.clip_qkv, self.softmax_scale, self.rotary, self.backend = clip_qkv, softmax_scale, rotary, backend
        self.xpos_scale_base, self.multiway, self.dtype = xpos_scale_base, multiway, np.dtype(dtype)
        self.mask_convention = mask_convention
        kv_width = num_kv_heads * self.head_dim
        self._key_width = embed_dim if kdim is None else kdim
        self._value_width = embed_dim if vdim is None else vdim

        def layer(kind, *args):
            make = lambda: kind(*args, dtype=dtype, seed=rng)
            return Multiway(make) if multiway else make()

        self.q_proj = layer(Linear, embed_dim, embed_dim, bias)
        self.k_proj = layer(Linear, embed_dim if kdim is None else kdim, kv_width, bias)
        self.v_proj = layer(Linear, embed_dim if vdim is None else vdim, kv_width, bias)
        if qk_norm:
            self.q_norm = _NORMS[qk_norm](self.head_dim, dtype=dtype)
            self.k_norm = _NORMS[qk_norm](self.head_dim, dtype=dtype)
        self.qk_norm = qk_norm or False
        self.sink_logits = parameter((num_heads,), dtype) if sink_logits else None
        if subln:
            self.inner_attn_ln = Multiway(lambda: LayerNorm(embed_dim, dtype=dtype)) if multiway else \
                LayerNorm(embed_dim, dtype=dtype)
        self.subln = subln
        self.out_proj = layer(Linear, embed_dim, embed_dim, bias)
        self._dropout_rng = np.random.default_rng(rng.integers(2 ** 63))

    def _reset_own(self, rng):
        if self.sink_logits is not None:
            self.sink_logits.data[...] = 0

    # the constructor's name for the kv head count (GroupedQueryAttention calls it num_groups)
    _KV_HEADS = "num_kv_heads"

    def _check_inputs(self, query, key, value):
        """(B, S, features) inputs with the projections' feature counts, before any work."""
        owner = type(self).__name__
        arguments.features(owner, "query", query, 3, self.embed_dim, "(B, S, embed_dim)")
        for name, x, width in (("key", key, self._key_width), ("value", value, self._value_width)):
            if x is not None:
                arguments.features(owner, name, x, 3, width, f"(B, S, {'kdim' if name == 'key' else 'vdim'})")

    def forward(self, query, key=None, value=None, *, key_padding_mask=None, attn_mask=None, bias=None,
                cache=None, causal=None, need_weights: bool = False, average_attn_weights: bool = True,
                split_position: int = -1):
        query = ag.Tensor(query) if not isinstance(query, ag.Tensor) else query
        self._check_inputs(query, key, value)
        if self.multiway:
            for _, module in self.named_modules():
                if isinstance(module, Multiway):
                    module.split_position = split_position
        if cache is not None and (key is not None or value is not None or key_padding_mask is not None):
            raise ValueError(f"{type(self).__name__}: a cache serves self-attention only: key, value and "
                             f"key_padding_mask must be None with cache=")
        key = query if key is None else key
        value = key if value is None else value
        batch, q_len = query.shape[0], query.shape[1]
        kv_len = key.shape[1]
        q = self._project(self.q_proj, query, self.num_heads)
        k = self._project(self.k_proj, key, self.num_kv_heads)
        v = self._project(self.v_proj, value, self.num_kv_heads)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        causal = self.causal if causal is None else causal
        window, sinks = self.window, self.sinks
        if cache is not None and self._decodes_in_place(cache, (q, k, v, bias, attn_mask)):
            result = self._attend_in_place(cache, query, q, k, v, causal, attn_mask, bias, need_weights)
            return self._project_out(result, batch, q_len, need_weights, average_attn_weights)
        if cache is None:
            # bottom-right: the last query is level with the last key
            q, k = self._rotate(q, k, kv_len - q_len)
            mask, total_bias = self._masks(query, key_padding_mask, attn_mask, bias, batch, kv_len)
        else:
            q, k, v, visible = self._with_cache(cache, q, k, v, causal)
            if visible is not None:  # a rolling cache: positions decide, not array indices
                causal, window, sinks = False, None, 0
            mask, total_bias = self._masks(query, None, attn_mask, bias, batch, k.shape[1])
            if visible is not None:
                mask = visible if mask is None else mask & visible
        training_dropout = self.dropout if self.training else 0.0
        result = ag.attention(
            q, k, v, causal=causal, window=window, sinks=sinks,
            mask=mask, bias=total_bias, sink_logits=self.sink_logits, scale=self.softmax_scale,
            dropout_p=training_dropout, seed=int(self._dropout_rng.integers(2 ** 63)) if training_dropout else None,
            layout="bshd", return_weights=need_weights, backend=self.backend)
        return self._project_out(result, batch, q_len, need_weights, average_attn_weights)

    def _project_out(self, result, batch, q_len, need_weights, average_attn_weights):
        """The attention call's result (out (B, Sq, H, D), and the weights when asked) through
        the output projection: what :meth:`forward` returns."""
        attended, weights = result if need_weights else (result, None)
        out = attended.reshape(batch, q_len, self.embed_dim)
        if self.subln:
            out = self.inner_attn_ln(out)
        out = self.out_proj(out)
        if not need_weights:
            return out
        return out, (weights.mean(axis=1) if average_attn_weights else weights)

    def _decodes_in_place(self, cache, inputs) -> bool:
        """Whether a cached call runs :meth:`KVCache.attend` (npattn.attention_with_kvcache:
        the new keys written in place, the cache read where it lies, no copy of it): a
        prefix cache, rope or no rotary embedding, and no gradient to record."""
        recording = ag.is_grad_enabled() and any(isinstance(x, ag.Tensor) and x.requires_grad for x in inputs)
        return cache.window is None and self.rotary != "xpos" and not recording

    def _attend_in_place(self, cache, query, q, k, v, causal, attn_mask, bias, need_weights):
        """One cached step through :meth:`KVCache.attend`, as (B, Sq, H, D) Tensors (and the
        weights when asked): the same answer as the concatenating path, row i at position
        ``cache.position + i``, rope rotating the new queries and keys there."""
        batch, new = q.shape[0], q.shape[1]
        cache.check(batch, self.num_kv_heads, self.head_dim, new)
        mask, total_bias = self._masks(query, None, attn_mask, bias, batch, cache.position + new)
        training_dropout = self.dropout if self.training else 0.0
        options = dict(causal=causal, window=self.window, sinks=self.sinks, mask=mask,
                       bias=total_bias.data if isinstance(total_bias, ag.Tensor) else total_bias,
                       sink_logits=None if self.sink_logits is None else self.sink_logits.data,
                       scale=self.softmax_scale, dropout_p=training_dropout,
                       seed=int(self._dropout_rng.integers(2 ** 63)) if training_dropout else None,
                       return_weights=need_weights, backend=self.backend)
        if self.rotary == "rope":  # the tables of every position the cache can hold
            cos, sin = rope_tables(max(cache.capacity, cache.position + new), self.head_dim)
            options.update(rotary_cos=q.xp.asarray(cos), rotary_sin=q.xp.asarray(sin))
        result = cache.attend(q.data, k.data, v.data, **options)
        if need_weights:
            return ag.Tensor(result[0]), ag.Tensor(result[1])
        return ag.Tensor(result)

    def _with_cache(self, cache, q, k, v, causal):
        """Rotate the new positions, prepend the cached keys and values, store the new ones.
        Returns ``(q, keys, values, visible)``: ``visible`` (Sq, Sk) bool for a rolling
        cache, from absolute positions (the module's causal window and sinks), else None."""
        batch, new = q.shape[0], q.shape[1]
        cache.check(batch, self.num_kv_heads, self.head_dim, new)
        left = self._causal_window_left(causal)
        if cache.window is not None and (left != cache.window or self.sinks != cache.sinks):
            raise ValueError(f"{type(self).__name__}: a rolling KVCache needs the module's causal window "
                             f"and sinks (window={left}, sinks={self.sinks}); got window={cache.window}, "
                             f"sinks={cache.sinks}")
        if self.rotary == "xpos" and cache.window is not None:
            raise ValueError(f"{type(self).__name__}: rotary='xpos' decodes with a KVCache without a window "
                             f"(its key scales are centred on the whole sequence)")
        positions = cache.position + np.arange(new)
        if self.rotary == "rope":  # keys are cached rotated; xpos keys raw, rotated with all the others
            q, k = apply_rope(q, positions), apply_rope(k, positions)
        cached_keys, cached_values, cached_positions = cache.retained()
        cache.append(k.data, v.data)
        if len(cached_positions):
            k = ag.concat([ag.Tensor(cached_keys), k], axis=1)
            v = ag.concat([ag.Tensor(cached_values), v], axis=1)
        if self.rotary == "xpos":
            q, k = self._rotate(q, k, cache.position - new)
        if cache.window is None:
            return q, k, v, None
        key_positions = np.concatenate([cached_positions, positions])
        behind = positions[:, None] - key_positions[None, :]
        visible = (behind >= 0) & ((behind <= cache.window) | (key_positions[None, :] < cache.sinks))
        return q, k, v, q.xp.asarray(visible)

    def _rotate(self, q, k, offset):
        """Rotary embeddings of all of k (positions from 0) and of q (from ``offset``)."""
        if self.rotary == "rope":
            return apply_rope(q, offset + np.arange(q.shape[1])), apply_rope(k, np.arange(k.shape[1]))
        if self.rotary == "xpos":
            return (apply_xpos(q, offset, scale_base=self.xpos_scale_base),
                    apply_xpos(k, 0, downscale=True, scale_base=self.xpos_scale_base))
        return q, k

    def _causal_window_left(self, causal):
        """The keys behind a query that the module's window shows (None: unbounded); a
        rolling cache needs causal attention with such a window."""
        if self.window is None:
            return None
        left, right = (self.window, 0 if causal else self.window) if isinstance(self.window, int) else self.window
        if not causal and right not in (0, None):
            raise ValueError(f"{type(self).__name__}: a KVCache needs causal attention or a window with "
                             f"no right side; got window={self.window}, causal={causal}")
        return left

    def kv_cache_bytes(self, batch: int, seq_len: int) -> int:
        """Bytes of a KVCache holding ``seq_len`` positions for this module (a causal window
        bounds it by ``sinks + window``)."""
        held = seq_len
        left = self._causal_window_left(True) if self.causal and self.window is not None else None
        if left is not None:
            held = min(seq_len, self.sinks + left)
        return 2 * batch * held * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def _project(self, projection, x, heads):
        """(B, S, width) -> (B, S, heads, head_dim), clipped when asked."""
        y = projection(x)
        if self.clip_qkv is not None:
            y = ag.clip(y, -self.clip_qkv, self.clip_qkv)
        return y.reshape(y.shape[0], y.shape[1], heads, self.head_dim)

    def _masks(self, query, key_padding_mask, attn_mask, bias, batch, kv_len):
        """``(mask, bias)`` for the attention call: padding and boolean masks AND-ed (True =
        may attend), float masks added to the bias."""
        xp = query.xp
        mask = None
        if key_padding_mask is not None:
            padding = xp.asarray(key_padding_mask)
            if padding.dtype != bool or padding.shape != (batch, kv_len):
                raise ValueError(f"{type(self).__name__}: key_padding_mask must be bool of shape "
                                 f"({batch}, {kv_len}); got {padding.dtype} of shape {padding.shape}")
            mask = ~padding[:, None, None, :]
        if attn_mask is not None:
            attn_mask = attn_mask.data if isinstance(attn_mask, ag.Tensor) else xp.asarray(attn_mask)
            if attn_mask.dtype == bool:
                if self.mask_convention == "torch":  # True = masked out
                    attn_mask = ~attn_mask
                mask = attn_mask if mask is None else mask & attn_mask
            else:
                bias = attn_mask if bias is None else ag.add(bias, attn_mask)
        return mask, bias

    def extra_repr(self):
        convention = "" if self.mask_convention == "allow" else f", mask_convention={self.mask_convention!r}"
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}, causal={self.causal}{convention}")


class MultiQueryAttention(MultiHeadAttention):
    """One key/value head shared by every query head (``num_kv_heads=1``)."""

    def __init__(self, embed_dim: int, num_heads: int, **kwargs):
        super().__init__(embed_dim, num_heads, num_kv_heads=1, **kwargs)


class GroupedQueryAttention(MultiHeadAttention):
    """``num_groups`` key/value heads, each shared by ``num_heads // num_groups`` query heads."""

    _KV_HEADS = "num_groups"

    def __init__(self, embed_dim: int, num_heads: int, num_groups: int, **kwargs):
        super().__init__(embed_dim, num_heads, num_kv_heads=num_groups, **kwargs)


class SlidingWindowAttention(MultiHeadAttention):
    """Attention over ``|i - j| <= window_size // 2``, or with ``causal=True`` over the last
    ``window_size`` keys, the query's own position included."""

    def __init__(self, embed_dim: int, num_heads: int, window_size: int, **kwargs):
        window_size = arguments.size("SlidingWindowAttention", "window_size", window_size)
        causal = kwargs.get("causal", False)
        window = (window_size - 1, 0) if causal else window_size // 2
        super().__init__(embed_dim, num_heads, window=window, **kwargs)
