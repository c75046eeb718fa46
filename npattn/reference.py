"""The oracle: attention as textbook float64 math, every option materialized.

Everything else in npattn is tested against this module, so it favours being
obviously right over being fast: it builds the full (B, H, Sq, Sk) score
matrix in float64 and applies each option as one readable step, in the order
the API fixes:

1. ``s = scale * q @ k^T``                        (query head h reads kv head h // group)
2. ``s = softcap * tanh(s / softcap)``            if softcap
3. ``s = s + bias - alibi_slope * |p_i - j|``     if bias / alibi_slopes
4. ``s = -inf`` where the key is not visible      (:mod:`npattn.core.masks`, mask, lengths)
5. ``P = softmax(s)`` over keys, with ``sink_logit[h]`` as an extra value-less column
6. ``P~ = P * keep / (1 - p)``                    dropout (:mod:`npattn.core.dropout`)
7. ``out = P~ @ v``

A row with no visible key (or whose visible scores are all -inf) outputs zeros,
has lse = -inf and passes no gradient. The backward is the analytic derivative
of these steps (with ``delta = rowsum(dout * out)``), not finite differences.

Non-finite inputs follow IEEE arithmetic through these steps, with one rule of
dependence: a row reads only the keys it sees. A NaN or +inf among a row's visible
scores makes its softmax, ``out`` row and lse NaN; a NaN or inf in ``v[j]`` reaches
every row that sees key j, even at weight 0 (``0 * NaN`` is NaN), and no row that
does not. The backends compute the same (see :mod:`npattn.runtime.nonfinite`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .core.dropout import keep_mask
from .core.problem import dense_keys
from .core.results import ForwardResult, Gradients

NAME = "reference"
QUANTIZED_KV = True  # int8 kv caches, dequantized in float64 (problem.dense_keys)


def unavailable_reason(array_kind: str = "numpy") -> str | None:
    """Always available: plain NumPy (or CuPy) array math."""
    return None


def forward(problem) -> ForwardResult:
    """float64 ``out`` (B, H, Sq, Dv), ``lse`` (B, H, Sq) and, when asked, ``weights``
    (B, H, Sq, Sk), the probabilities after masking and before dropout (out and lse of
    one batch entry for ``packed_rows``)."""
    with np.errstate(all="ignore"):  # non-finite inputs give NaN and inf as documented, silently
        state = _forward_state(problem)
        if problem.packed_rows:  # each row is live in one entry, zero and -inf in the others
            return ForwardResult(out=state.out.sum(axis=0, keepdims=True), lse=state.lse.max(axis=0, keepdims=True))
    return ForwardResult(out=state.out, lse=state.lse,
                         weights=state.probs if problem.return_weights else None)


def backward(problem, saved, dout) -> Gradients:
    """Gradients of ``sum(out * dout)``; ``dout`` is (B, H, Sq, Dv) in bhsd order.

    The reference keeps nothing from the forward (``saved`` is unused) and recomputes
    it in float64. dk/dv are summed over the query heads that share a kv head; dbias is
    summed over the dimensions the bias was broadcast along.
    """
    with np.errstate(all="ignore"):  # non-finite inputs give NaN and inf as documented, silently
        grads = _backward(problem, dout)
    if problem.packed_rows:  # each row and key is live in one entry, zero in the others
        grads = grads._replace(dq=grads.dq.sum(axis=0, keepdims=True), dk=grads.dk.sum(axis=0, keepdims=True),
                               dv=grads.dv.sum(axis=0, keepdims=True))
    return grads


def _backward(problem, dout) -> Gradients:
    xp = problem.xp
    state = _forward_state(problem)
    dout = dout.astype(np.float64)
    group = problem.group_size

    visible, visible_t = state.visible, _transpose_keys(state.visible)
    dv_per_query_head = _visible_matmul(xp, _transpose_keys(state.dropped_probs), dout, visible_t)
    # a key a row cannot see passes it nothing, not even the NaN of a value
    dprobs_dropped = xp.where(visible, _matmul(xp, dout, _transpose_keys(state.v)), 0.0)
    dprobs = dprobs_dropped if state.keep_scale is None else dprobs_dropped * state.keep_scale
    # softmax backward: dS = P * (dP - delta), where delta = sum_j P_j dP_j = rowsum(dout * out);
    # the sink column has no value, so dP_sink = 0 and it adds nothing to delta.
    delta = xp.sum(dout * state.out, axis=-1, keepdims=True)
    dscores = xp.where(visible, state.probs * (dprobs - delta), 0.0)

    dbias = None if problem.bias is None else _sum_to_shape(xp, dscores, problem.bias_shape)
    dsink_logits = None
    if problem.sink_logits is not None:
        dsink_logits = -xp.sum(state.sink_probs * delta[..., 0], axis=(0, 2))
    if problem.softcap is not None:
        dscores = dscores * (1.0 - state.softcapped_tanh ** 2)
    dscores = dscores * problem.scale
    dq = _visible_matmul(xp, dscores, state.k, visible)
    dk_per_query_head = _visible_matmul(xp, _transpose_keys(dscores), state.q, visible_t)
    return Gradients(dq=dq, dk=_sum_groups(dk_per_query_head, group),
                     dv=_sum_groups(dv_per_query_head, group), dbias=dbias,
                     dsink_logits=dsink_logits)


@dataclass
class _ForwardState:
    """The materialized forward, everything in float64 and bhsd order."""

    q: Any                # (B, H, Sq, D)
    k: Any                # (B, H, Sk, D), kv heads repeated per query head
    v: Any                # (B, H, Sk, Dv), likewise
    softcapped_tanh: Any  # tanh(s / softcap) of step 2, or None
    probs: Any            # (B, H, Sq, Sk) softmax over keys, 0 where invisible
    sink_probs: Any       # (B, H, Sq) probability of the sink column, or None
    keep_scale: Any       # (B, H, Sq, Sk) keep / (1 - p), or None without dropout
    dropped_probs: Any    # probs * keep_scale
    out: Any              # (B, H, Sq, Dv)
    lse: Any              # (B, H, Sq)
    visible: Any          # (B, H, Sq, Sk) bool: which keys each row sees


def _forward_state(problem) -> _ForwardState:
    xp = problem.xp
    q = xp.ascontiguousarray(problem.q, dtype=np.float64)
    k, v = dense_keys(xp, problem)
    k = _repeat_kv_heads(xp, k.astype(np.float64), problem.group_size)
    v = _repeat_kv_heads(xp, v.astype(np.float64), problem.group_size)

    scores = problem.scale * _matmul(xp, q, _transpose_keys(k))
    softcapped_tanh = None
    if problem.softcap is not None:
        softcapped_tanh = xp.tanh(scores / problem.softcap)
        scores = problem.softcap * softcapped_tanh
    if problem.bias is not None:
        scores = scores + problem.bias.astype(np.float64)
    if problem.alibi_slopes is not None:
        scores = scores - _alibi(xp, problem)

    sink = None
    if problem.sink_logits is not None:
        sink = xp.broadcast_to(problem.sink_logits.astype(np.float64)[None, :, None], scores.shape[:3])
    visible = visible_keys(problem)
    probs, sink_probs, lse = _masked_softmax(xp, xp.where(visible, scores, -np.inf), sink)
    # a row whose visible scores are all -inf sees nothing: it outputs zeros whatever its
    # values hold; and unseen keys weigh 0 also in a NaN row
    visible = visible & (lse != -np.inf)[..., None]
    probs = xp.where(visible, probs, 0.0)

    keep_scale = None
    dropped_probs = probs
    if problem.dropout_p > 0:
        keep = keep_mask(xp, problem.seed, problem.dropout_p, *probs.shape, offset=problem.dropout_offset)
        keep_scale = keep / (1.0 - problem.dropout_p)
        dropped_probs = probs * keep_scale
    return _ForwardState(q=q, k=k, v=v, softcapped_tanh=softcapped_tanh, probs=probs,
                         sink_probs=sink_probs, keep_scale=keep_scale, dropped_probs=dropped_probs,
                         out=_visible_matmul(xp, dropped_probs, v, visible), lse=lse, visible=visible)


def visible_keys(problem):
    """Boolean (B, H, Sq, Sk): causal, window and sinks at each row's position, the mask,
    the lengths and the left padding."""
    xp = problem.xp
    shape = (problem.batch, problem.heads, problem.q_len, problem.kv_len)
    row = xp.arange(problem.q_len)[None, :, None]             # (1, Sq, 1)
    key = xp.arange(problem.kv_len)[None, None, :]            # (1, 1, Sk)
    key_start = _per_entry(xp, problem.kv_start, 0)           # (B or 1, 1, 1)
    visible = problem.visibility.allowed(xp, row_positions(problem)[:, :, None], key, key_start)
    visible = visible & (key >= key_start) & (key < _per_entry(xp, problem.kv_lengths, problem.kv_len))
    visible = visible & (row >= _per_entry(xp, problem.q_start, 0)) & (row < _per_entry(xp, problem.q_lengths,
                                                                                         problem.q_len))
    visible = visible[:, None]                                # (B or 1, 1, Sq, Sk)
    if problem.mask is not None:
        visible = visible & problem.mask
    return xp.broadcast_to(visible, shape)


def row_positions(problem):
    """int64 (B or 1, Sq): the key position of each query row (see :mod:`npattn.core.masks`)."""
    xp = problem.xp
    shift = (problem.visibility.shift(problem.q_len, problem.kv_len) if problem.row_shifts is None
             else xp.asarray(problem.row_shifts)[:, None])
    return xp.arange(problem.q_len)[None, :] + shift


def _per_entry(xp, values, default):
    """A per-batch-entry int array (B,) as (B, 1, 1), or ``default`` as (1, 1, 1)."""
    return xp.full((1, 1, 1), default) if values is None else xp.asarray(values)[:, None, None]


def _masked_softmax(xp, scores, sink):
    """Softmax over the last axis of ``scores`` (-inf = invisible), with ``sink`` (B, H, Sq)
    as an extra column when given. Returns (probs, sink_probs, lse); empty rows give
    probs 0, sink_probs 0 and lse -inf."""
    row_has_key = xp.any(scores != -np.inf, axis=-1)  # a NaN score counts: its row is NaN
    if scores.shape[-1]:
        row_max = xp.max(scores, axis=-1)
    else:  # no keys at all (Sk = 0): every row is empty
        row_max = xp.full(scores.shape[:-1], -np.inf)
    if sink is not None:
        row_max = xp.maximum(row_max, sink)
    row_max = xp.where(row_has_key, row_max, 0.0)
    exps = xp.exp(scores - row_max[..., None])
    total = xp.sum(exps, axis=-1)
    sink_exps = None
    if sink is not None:
        sink_exps = xp.exp(sink - row_max)
        total = total + sink_exps
    total = xp.where(row_has_key, total, 1.0)
    probs = xp.where(row_has_key[..., None], exps / total[..., None], 0.0)
    sink_probs = None if sink is None else xp.where(row_has_key, sink_exps / total, 0.0)
    lse = xp.where(row_has_key, row_max + xp.log(total), -np.inf)
    return probs, sink_probs, lse


def _alibi(xp, problem):
    """``slope[b, h] * |p_i - j|`` as (B, H, Sq, Sk), with p_i the row's key position
    (:func:`row_positions`)."""
    positions = row_positions(problem).astype(np.float64)[:, None, :, None]
    distance = xp.abs(positions - xp.arange(problem.kv_len, dtype=np.float64))
    return problem.alibi_slopes.astype(np.float64)[:, :, None, None] * distance


def _repeat_kv_heads(xp, x, group):
    """(B, Hkv, S, X) -> (B, Hkv * group, S, X): query head h reads kv head h // group."""
    return xp.repeat(x, group, axis=1) if group > 1 else x


def _sum_groups(x, group):
    """(B, H, S, X) -> (B, H // group, S, X): the adjoint of :func:`_repeat_kv_heads`."""
    b, h, s, d = x.shape
    return x.reshape(b, h // group, group, s, d).sum(axis=2)


def _sum_to_shape(xp, x, shape):
    """Sum a (B, H, Sq, Sk) array down to a shape that broadcasts to it (the adjoint of broadcasting)."""
    padded = (1,) * (4 - len(shape)) + tuple(shape)
    axes = tuple(axis for axis, size in enumerate(padded) if size == 1 and x.shape[axis] != 1)
    return xp.sum(x, axis=axes, keepdims=True).reshape(shape)


def _transpose_keys(x):
    return x.swapaxes(-1, -2)


def _visible_matmul(xp, a, b, visible):
    """``a @ b`` summing, for each row of ``a``, only the terms its ``visible`` entries
    select: a (..., M, N) with 0 (or anything) where not visible, b (..., N, P),
    visible (..., M, N). A NaN or inf in a row n of ``b`` reaches exactly the rows m
    with ``visible[m, n]``, by IEEE arithmetic (``0 * NaN`` is NaN), and no other: four
    boolean products find where, so a ``b`` full of NaN costs what a finite one does.
    (An infinite ``a`` against an infinite ``b`` gives NaN, not inf.)"""
    a = xp.where(visible, a, 0.0)
    finite = xp.isfinite(b)
    if bool(finite.all()):
        return _matmul(xp, a, b)
    result = _matmul(xp, a, xp.where(finite, b, 0.0))

    def reaches(rows, entries):
        """Whether some n with ``rows[m, n]`` has ``entries[n, p]``, for every (m, p)."""
        return _matmul(xp, rows.astype(np.float64), entries.astype(np.float64)) > 0

    # what the non-finite entries of b add, by IEEE: a * NaN and 0 * inf are NaN, a * inf
    # is inf of a's sign times inf's, and +inf plus -inf is NaN
    positive, negative = visible & (a > 0), visible & (a < 0)
    up = reaches(positive, b == np.inf) | reaches(negative, b == -np.inf)
    down = reaches(positive, b == -np.inf) | reaches(negative, b == np.inf)
    nan = reaches(visible, xp.isnan(b)) | reaches(visible & (a == 0), xp.isinf(b)) | (up & down)
    return result + xp.where(nan, np.nan, xp.where(up, np.inf, xp.where(down, -np.inf, 0.0)))


def _matmul(xp, a, b):
    """Batched ``a @ b`` on C-contiguous operands: NumPy's batched matmul leaves BLAS (and
    runs ~100x slower) when an operand is a transposed view."""
    return xp.matmul(xp.ascontiguousarray(a), xp.ascontiguousarray(b))
