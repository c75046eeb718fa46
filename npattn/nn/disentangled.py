"""DeBERTa-v2's disentangled self-attention, as HF transformers' DebertaV2
``DisentangledSelfAttention`` computes it.

Scores are content-to-content plus content-to-position ("c2p": a query against the
embedding of its relative distance to the key) plus position-to-content ("p2c": a key
against the embedding of the distance), all divided by ``sqrt(D * (1 + number of
position terms))``. The two position terms are computed for all query/key pairs at
once, by matrix products against the 2k relative embeddings and one gather each, and
handed to the fused attention call as its additive bias.

Relative positions are ``i - j``; with ``position_buckets > 0`` distances beyond
``position_buckets // 2`` share logarithmic buckets (``log_bucket_positions``). The
p2c term indexes as HF's code does: the key ``j`` row of ``k . pos_query`` at the
clamped ``-(bucket(j - i)) + span``, transposed; the paper writes it differently.
"""
from __future__ import annotations

import numpy as np

from ..core import arguments
from .. import autograd as ag
from .attention import MultiHeadAttention
from .layers import Linear


def log_bucket_positions(relative, bucket_size: int, max_position: int):
    """DeBERTa's log buckets of integer relative positions: distances below
    ``bucket_size // 2`` are kept, larger ones are mapped logarithmically so that
    ``max_position`` lands near ``bucket_size - 1`` (float32 arithmetic, as HF's)."""
    relative = np.asarray(relative, np.int64)
    mid = bucket_size // 2
    sign = np.sign(relative)
    near = (relative < mid) & (relative > -mid)
    distance = np.where(near, mid - 1, np.abs(relative)).astype(np.float32)
    ratio = np.log(distance / np.float32(mid)) / np.log(np.float32((max_position - 1) / mid))
    log_position = np.ceil(ratio * np.float32(mid - 1)) + np.float32(mid)
    return np.where(distance <= mid, relative, (log_position * sign)).astype(np.int64)


def relative_positions(q_len: int, kv_len: int, bucket_size: int = 0, max_position: int = 0):
    """(q_len, kv_len) int64 ``i - j``, log-bucketed when both sizes are positive."""
    relative = np.arange(q_len)[:, None] - np.arange(kv_len)[None, :]
    if bucket_size > 0 and max_position > 0:
        relative = log_bucket_positions(relative, bucket_size, max_position)
    return relative


class DisentangledAttention(MultiHeadAttention):
    """DeBERTa-v2 disentangled self-attention (plus npattn's ``out_proj``, as every
    attention module here has).

    Args:
        embed_dim, num_heads: as :class:`MultiHeadAttention`.
        max_relative_positions: k; the relative embeddings span 2k rows.
        position_buckets: 0 for none, else the bucket count (then the span is it).
        pos_att_type: the position terms, a subset of ("c2p", "p2c").
        share_att_key: position embeddings projected by q_proj / k_proj; otherwise by
            their own ``pos_query_proj`` (p2c) and ``pos_key_proj`` (c2p).
        **kwargs: bias, dropout, dtype, seed, backend (no causal, window or rotary).

    Call: ``attention(hidden_states (B, N, E), rel_embeddings (>= 2 span, E), *,
    key_padding_mask=None, need_weights=False, average_attn_weights=True)``.
    """

    def __init__(self, embed_dim: int, num_heads: int, *, max_relative_positions: int, position_buckets: int = 0,
                 pos_att_type=("c2p", "p2c"), share_att_key: bool = True, **kwargs):
        unsupported = sorted(set(kwargs) & {"causal", "window", "sinks", "rotary", "num_kv_heads", "kdim", "vdim",
                                        "multiway", "xpos_scale_base"})
        if unsupported:
            raise ValueError(f"DisentangledAttention: {unsupported} do not apply to DeBERTa's self-attention")
        if not set(pos_att_type) <= {"c2p", "p2c"}:
            raise ValueError(f"DisentangledAttention: pos_att_type must be a subset of ('c2p', 'p2c'); "
                             f"got {pos_att_type!r}")
        max_relative_positions = arguments.size("DisentangledAttention", "max_relative_positions",
                                                max_relative_positions)
        position_buckets = arguments.size("DisentangledAttention", "position_buckets", position_buckets, minimum=0)
        super().__init__(embed_dim, num_heads, **kwargs)
        self.max_relative_positions, self.position_buckets = max_relative_positions, position_buckets
        self.pos_att_type, self.share_att_key = tuple(pos_att_type), share_att_key
        self.span = position_buckets if position_buckets > 0 else max_relative_positions
        seed = kwargs.get("seed")
        # a stream apart from the one the base class drew q/k/v/out from
        rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(
            None if seed is None else [seed, 1])
        dtype = self.dtype
        if not share_att_key:
            if "c2p" in self.pos_att_type:
                self.pos_key_proj = Linear(embed_dim, embed_dim, dtype=dtype, seed=rng)
            if "p2c" in self.pos_att_type:
                self.pos_query_proj = Linear(embed_dim, embed_dim, dtype=dtype, seed=rng)

    def forward(self, hidden_states, rel_embeddings, *, key_padding_mask=None, need_weights: bool = False,
                average_attn_weights: bool = True):
        x = hidden_states if isinstance(hidden_states, ag.Tensor) else ag.Tensor(hidden_states)
        self._check_inputs(x, None, None)
        batch, length = x.shape[0], x.shape[1]
        if rel_embeddings.shape[0] < 2 * self.span or rel_embeddings.shape[1] != self.embed_dim:
            raise ValueError(f"DisentangledAttention: rel_embeddings must be (>= {2 * self.span}, {self.embed_dim}); "
                             f"got {tuple(rel_embeddings.shape)}")
        q = self._project(self.q_proj, x, self.num_heads)
        k = self._project(self.k_proj, x, self.num_heads)
        v = self._project(self.v_proj, x, self.num_heads)
        factor = 1 + len(self.pos_att_type)
        scale = 1.0 / np.sqrt(self.head_dim * factor)
        bias = self._position_scores(q, k, rel_embeddings, length)
        mask, _ = self._masks(x, key_padding_mask, None, None, batch, length)
        result = ag.attention(q, k, v, bias=None if bias is None else bias * scale, mask=mask, scale=scale,
                              dropout_p=self.dropout if self.training else 0.0,
                              seed=int(self._dropout_rng.integers(2 ** 63)) if self.training and self.dropout else None,
                              layout="bshd", return_weights=need_weights, backend=self.backend)
        attended, weights = result if need_weights else (result, None)
        out = self.out_proj(attended.reshape(batch, length, self.embed_dim))
        if not need_weights:
            return out
        return out, (weights.mean(axis=1) if average_attn_weights else weights)

    def _position_scores(self, q, k, rel_embeddings, length):
        """c2p + p2c, unscaled: (B, H, N, N), or None without position terms."""
        if not self.pos_att_type:
            return None
        span = self.span
        embeddings = ag.getitem(rel_embeddings if isinstance(rel_embeddings, ag.Tensor)
                                else ag.Tensor(rel_embeddings), slice(0, 2 * span))
        relative = relative_positions(length, length, self.position_buckets, self.max_relative_positions)
        rows = np.arange(length)
        score = None
        if "c2p" in self.pos_att_type:
            projection = self.k_proj if self.share_att_key else self.pos_key_proj
            pos_key = self._heads_last(projection(embeddings))                   # (H, D, 2 span)
            c2p = q.transpose(0, 2, 1, 3) @ pos_key                              # (B, H, N, 2 span)
            index = np.clip(relative + span, 0, 2 * span - 1)                    # [i, j]
            score = c2p[:, :, rows[:, None], index]
        if "p2c" in self.pos_att_type:
            projection = self.q_proj if self.share_att_key else self.pos_query_proj
            pos_query = self._heads_last(projection(embeddings))
            p2c = k.transpose(0, 2, 1, 3) @ pos_query                            # (B, H, N keys, 2 span)
            index = np.clip(-relative + span, 0, 2 * span - 1)                   # [j, i] in HF's gather
            term = p2c[:, :, rows[None, :], index.T]                             # [i, j] = p2c[j, index[j, i]]
            score = term if score is None else score + term
        return score

    def _heads_last(self, projected):
        """(2 span, E) -> (H, D, 2 span): per head, the embeddings as columns."""
        return projected.reshape(projected.shape[0], self.num_heads, self.head_dim).transpose(1, 2, 0)
