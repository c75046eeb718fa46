"""Continuous batching: requests of different lengths arrive and finish at different steps
and share one paged KV cache; each step prefills the new prompts and decodes every active
request in one call.

A toy one-layer language model (random embeddings and projections, rotary positions,
greedy decoding) serves eight requests. Each step gathers the prompts of the requests
that arrive (a prefill chunk each) and one token of every active request (a decode step
each), runs them all in one call of :meth:`npattn.nn.PagedKVCache.attend_varlen` (one
packed :func:`npattn.attention_varlen` over the pool's pages), and frees the pages of
the requests that are done. Every generated token is then checked against decoding that
request alone, with plain causal attention over its whole sequence at each step.

Run: python examples/continuous_batching.py
"""
import numpy as np

import npattn
from npattn.serving.kvcache import apply_rotary
from npattn.nn import PagedKVCache

VOCAB, EMBED, HEADS, KV_HEADS, HEAD_DIM, PAGE = 97, 64, 4, 2, 16, 8
rng = np.random.default_rng(0)
embedding = rng.standard_normal((VOCAB, EMBED)) / np.sqrt(EMBED)
w_q, w_k, w_v = (rng.standard_normal((EMBED, n * HEAD_DIM)) / np.sqrt(EMBED) for n in (HEADS, KV_HEADS, KV_HEADS))
w_out = rng.standard_normal((HEADS * HEAD_DIM, VOCAB)) / np.sqrt(HEADS * HEAD_DIM)
angles = np.arange(256)[:, None] / 10000 ** (np.arange(HEAD_DIM // 2) / (HEAD_DIM // 2))
ROTARY = dict(rotary_cos=np.cos(angles), rotary_sin=np.sin(angles))


def project(tokens):
    """q (B, S, H, D), k and v (B, S, Hkv, D) of token ids (B, S), not yet rotated."""
    x = embedding[tokens]
    batch, length = tokens.shape
    return (x @ w_q).reshape(batch, length, HEADS, HEAD_DIM), (x @ w_k).reshape(batch, length, KV_HEADS, HEAD_DIM), \
        (x @ w_v).reshape(batch, length, KV_HEADS, HEAD_DIM)


def next_tokens(attended):
    """Greedy choice from the last position's attention output (B, S, H, D)."""
    return (attended[:, -1].reshape(len(attended), -1) @ w_out).argmax(axis=-1)


# (arrival step, prompt length, tokens to generate) of each request
REQUESTS = [(0, 5, 6), (0, 12, 3), (1, 3, 8), (2, 20, 4), (2, 1, 7), (4, 9, 5), (5, 15, 2), (6, 4, 6)]
prompts = [rng.integers(0, VOCAB, length) for _, length, _ in REQUESTS]


def serve():
    """Every request's generated tokens, served in continuous batches from one paged cache."""
    cache = PagedKVCache(num_pages=24, page_size=PAGE, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="float64")
    generated = {r: [] for r in range(len(REQUESTS))}
    active, last_token, step, peak_pages = [], {}, 0, 0
    while len(active) or any(arrival >= step for arrival, _, _ in REQUESTS):
        arriving = [r for r, (arrival, _, _) in enumerate(REQUESTS) if arrival == step]
        decoding = [r for r in active if len(generated[r]) < REQUESTS[r][2]]
        for r in arriving:
            cache.add(r)
        batch = arriving + decoding  # prefill chunks and decode steps, one call for all
        if batch:
            tokens = [prompts[r] for r in arriving] + [np.array([last_token[r]]) for r in decoding]
            q, k, v = project(np.concatenate(tokens)[None])
            cu_seqlens = np.concatenate([[0], np.cumsum([len(t) for t in tokens])])
            out = cache.attend_varlen(batch, q[0], k[0], v[0], cu_seqlens, causal=True, **ROTARY)
            last_rows = cu_seqlens[1:] - 1  # each sequence's last position picks its next token
            for r, token in zip(batch, next_tokens(out[last_rows][:, None])):
                last_token[r] = int(token)
                generated[r].append(int(token))
        active += arriving
        peak_pages = max(peak_pages, 24 - cache.free_pages)
        for r in [r for r in active if len(generated[r]) == REQUESTS[r][2]]:  # done: pages back to the pool
            cache.free(r)
            active.remove(r)
        step += 1
    assert cache.free_pages == 24 and not cache.sequences
    return generated, peak_pages


def decode_alone(r):
    """Request r's tokens, each step attending over its whole sequence from scratch."""
    sequence = list(prompts[r])
    tokens = []
    for _ in range(REQUESTS[r][2]):
        q, k, v = project(np.array([sequence]))
        q, k = (apply_rotary(x, np.zeros(1, np.int64), ROTARY["rotary_cos"], ROTARY["rotary_sin"]) for x in (q, k))
        tokens.append(int(next_tokens(npattn.attention(q, k, v, causal=True, layout="bshd"))[0]))
        sequence.append(tokens[-1])
    return tokens


if __name__ == "__main__":
    served, peak = serve()
    for r in range(len(REQUESTS)):
        alone = decode_alone(r)
        assert served[r] == alone, (r, served[r], alone)
    total = sum(len(p) + n for p, (_, _, n) in zip(prompts, REQUESTS))
    print(f"served {len(REQUESTS)} requests ({total} tokens) in continuous batches from one pool of "
          f"24 pages of {PAGE} keys (at most {peak} in use), each step's prefills and decodes in one call; "
          "every token equals decoding its request alone: ok")
