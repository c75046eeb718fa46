"""Prefill a prompt in chunks, then decode token by token, with plain arrays as the KV cache.

Causal attention in npattn is bottom-right aligned: the last query row is level with the
last key. So attending a chunk of new queries against everything cached so far (keys
included up to the chunk's end) is exactly the corresponding rows of one full causal pass.
"""
import numpy as np

import npattn


def main():
    rng = np.random.default_rng(0)
    batch, heads, kv_heads, head_dim, length = 1, 8, 2, 64, 96  # grouped-query: 4 heads per kv head
    q = rng.standard_normal((batch, heads, length, head_dim))
    k = rng.standard_normal((batch, kv_heads, length, head_dim))
    v = rng.standard_normal((batch, kv_heads, length, head_dim))
    full = npattn.attention(q, k, v, causal=True, window=31, sinks=4)

    pieces, start = [], 0
    for size in [32, 32, 16] + [1] * (length - 80):  # three prefill chunks, then one token at a time
        end = start + size
        pieces.append(npattn.attention(q[:, :, start:end], k[:, :, :end], v[:, :, :end],
                                       causal=True, window=31, sinks=4))
        start = end
    incremental = np.concatenate(pieces, axis=2)
    error = np.abs(incremental - full).max()
    print(f"{len(pieces)} calls reproduce one full causal pass: max difference {error:.1e}")
    return error <= 16 * np.finfo(np.float64).eps


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
