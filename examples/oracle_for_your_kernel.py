"""Use npattn's float64 reference as the oracle for an attention kernel of your own.

Here "your kernel" is a naive float32 NumPy implementation of causal attention; the same
pattern (run both, compare with a tolerance derived from your dtype's precision) applies
to any kernel that takes arrays.
"""
import numpy as np

import npattn


def my_causal_attention(q, k, v):
    """A float32 kernel under test: (B, H, S, D) arrays, top-left causal with Sq == Sk."""
    scores = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1], dtype=np.float32)
    scores = np.where(np.tril(np.ones(scores.shape[-2:], bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return (weights / weights.sum(-1, keepdims=True)) @ v


def main():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 4, 256, 64)).astype(np.float32) for _ in range(3))
    exact = npattn.attention(*(x.astype(np.float64) for x in (q, k, v)), causal=True, backend="reference")
    error = np.abs(my_causal_attention(q, k, v) - exact).max()
    # float32 rounding of a length-256 softmax-weighted sum of unit-size values
    tolerance = 256 * np.finfo(np.float32).eps
    print(f"max error {error:.2e} (tolerance {tolerance:.2e}): {'ok' if error <= tolerance else 'FAIL'}")
    return error <= tolerance


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
