"""An independent, deliberately naive oracle for ``npattn.attention``.

This is a *second formulation* of the attention math, written without looking
at ``npattn/reference.py``, so the two can cross-check each other. Where the
reference materializes (Sq, Sk) score matrices and masks them with array
operations, this oracle walks one query row at a time with explicit Python
loops and works in log space: it gathers the scores of the visible keys,
computes ``lse = logsumexp(scores [+ sink])`` with ``math.fsum`` of shifted
exponentials, and then forms ``w_j = exp(s_j - lse)``. The dropout hash is
re-implemented here in plain Python integers from the specification in the
docstring of ``npattn/core/dropout.py`` (that module is not imported).

It is slow on purpose; use it only on tiny problems.
"""

import math

import numpy as np

_M32 = 0xFFFFFFFF


def _fmix32(x):
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & _M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & _M32
    x ^= x >> 16
    return x


def dropout_hash(seed, b, h, i, j) -> int:
    """The 32-bit hash of (seed, b, h, i, j); seed is taken mod 2**64."""
    seed = int(seed) % (1 << 64)
    x = 0
    for word in (seed & _M32, seed >> 32, b, h, i, j):
        x = _fmix32(((x ^ (int(word) & _M32)) + 0x9E3779B9) & _M32)
    return x


def keep(seed, dropout_p, b, h, i, j) -> bool:
    """Whether the probability at (b, query head h, row i, key j) survives dropout."""
    threshold = math.floor(dropout_p * 2**24 + 0.5)
    return (dropout_hash(seed, b, h, i, j) >> 8) >= threshold


def _logsumexp(values):
    m = max(values)
    if m == -math.inf:
        return -math.inf
    return m + math.log(math.fsum(math.exp(x - m) for x in values))


def loop_attention(q, k, v, *, causal=False, q_offset=None, window=None, sinks=0, sink_logits=None, mask=None,
                   bias=None, alibi_slopes=None, q_lengths=None, kv_lengths=None, q_start=None, kv_start=None,
                   scale=None, softcap=None, dropout_p=0.0, seed=None, dropout_offset=(0, 0, 0, 0), layout="bhsd"):
    """returns (out, lse, weights) as float64 NumPy arrays, always in bhsd logical shapes:
    out (B,H,Sq,Dv), lse (B,H,Sq), weights (B,H,Sq,Sk)"""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    if layout == "bshd":
        q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
    elif layout != "bhsd":
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    B, H, Sq, D = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
    group = H // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)

    if causal == "top_left":  # the first row level with the first (real) key
        q_offset = 0
    if window is None:
        left = right = None
    elif isinstance(window, (tuple, list)):
        left, right = window
    else:
        left, right = int(window), (0 if causal else int(window))

    full = (B, H, Sq, Sk)
    mask = None if mask is None else np.broadcast_to(np.asarray(mask, dtype=bool), full)
    bias = None if bias is None else np.broadcast_to(np.asarray(bias, dtype=np.float64), full)
    if alibi_slopes is not None:
        alibi_slopes = np.broadcast_to(np.asarray(alibi_slopes, dtype=np.float64), (B, H))
    if dropout_p > 0 and not isinstance(seed, (int, np.integer)):
        raise ValueError("the oracle needs an int seed when dropout_p > 0")

    out = np.zeros((B, H, Sq, Dv))
    lse = np.full((B, H, Sq), -np.inf)
    weights = np.zeros((B, H, Sq, Sk))

    for b in range(B):
        for h in range(H):
            kh = h // group
            for i in range(Sq):
                if q_lengths is not None and i >= q_lengths[b]:
                    continue
                first_row = 0 if q_start is None else int(q_start[b])  # left padding
                first_key = 0 if kv_start is None else int(kv_start[b])
                if i < first_row:
                    continue
                if q_offset is None:  # bottom-right: the last row level with the last key
                    p = i + Sk - Sq
                else:  # row i - first_row of the real rows at key q_offset of the real keys
                    offset = q_offset if np.ndim(q_offset) == 0 else q_offset[b]
                    p = (i - first_row) + int(offset) + first_key
                cols, scores = [], []
                for j in range(first_key, Sk):
                    if causal and j > p:
                        continue
                    in_window = (left is None or p - left <= j) and (right is None or j <= p + right)
                    if not (in_window or j - first_key < sinks):
                        continue
                    if mask is not None and not mask[b, h, i, j]:
                        continue
                    if kv_lengths is not None and j >= kv_lengths[b]:
                        continue
                    s = scale * math.fsum(float(x) * float(y) for x, y in zip(q[b, h, i], k[b, kh, j]))
                    if softcap:
                        s = softcap * math.tanh(s / softcap)
                    if bias is not None:
                        s += float(bias[b, h, i, j])
                    if alibi_slopes is not None:
                        s -= float(alibi_slopes[b, h]) * abs(p - j)
                    if s == -math.inf:
                        continue  # probability 0, and it does not count as visible
                    cols.append(j)
                    scores.append(s)
                if not cols:
                    continue  # empty row: out 0, lse -inf, weights 0
                terms = scores + ([float(sink_logits[h])] if sink_logits is not None else [])
                row_lse = _logsumexp(terms)
                lse[b, h, i] = row_lse
                terms = [[] for _ in range(Dv)]
                for j, s in zip(cols, scores):
                    w = math.exp(s - row_lse)
                    weights[b, h, i, j] = w
                    if dropout_p > 0:
                        hashed = (index + offset for index, offset in zip((b, h, i, j), dropout_offset))
                        if not keep(seed, dropout_p, *hashed):
                            continue
                        w = w / (1.0 - dropout_p)
                    for d in range(Dv):
                        terms[d].append(w * float(v[b, kh, j, d]))
                out[b, h, i] = [math.fsum(t) for t in terms]
    return out, lse, weights
