"""Train a small transformer to sort sequences of digits, with npattn alone (no torch).

Two pre-norm encoder layers from npattn.nn, learned token and position embeddings,
AdamW from npattn.nn.optim. To emit the k-th smallest digit, a position must count, through
attention, how many digits of each value the sequence holds.

    python examples/train_sort.py                            # full run, 9-11 s on 2 cores
    NPATTN_EXAMPLE_QUICK=1 python examples/train_sort.py     # a short run (the test suite's)

Exits with status 1 if the full run misses its stated accuracy, or the short run's loss
does not fall.
"""
from __future__ import annotations

import math
import os
import sys
import time

import numpy as np

from npattn import autograd as ag
from npattn.nn import Embedding, Linear, Module, TransformerEncoderLayer
from npattn.nn.optim import AdamW, clip_grad_norm

VOCAB, LENGTH, WIDTH, HEADS = 10, 8, 64, 4
TARGET_ACCURACY = 0.98  # whole sequences sorted exactly, on 1000 fresh ones
PEAK_LR, WARMUP = 3e-3, 50


def learning_rate(step, steps):
    """Linear warm-up, then a cosine decay to 1% of the peak: a constant rate kept the loss
    jumping near the end (0.0007 -> 0.02 in 100 steps), so the final accuracy depended on
    where a jump fell, which differs with the CPU's rounding (1200 constant-rate steps:
    94.7% with AVX-512 against 99.9% with AVX2 at the same seed; 600 decayed steps: 100%
    on both)."""
    warm = min(1.0, (step + 1) / WARMUP)
    return PEAK_LR * warm * (0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * step / steps)))


class Sorter(Module):
    def __init__(self, seed=0):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.tokens = Embedding(VOCAB, WIDTH, seed=rng)
        self.positions = Embedding(LENGTH, WIDTH, seed=rng)
        self.layer1 = TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, activation="gelu",
                                              norm_first=True, seed=rng)
        self.layer2 = TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, activation="gelu",
                                              norm_first=True, seed=rng)
        self.head = Linear(WIDTH, VOCAB, seed=rng)

    def forward(self, sequences):
        x = self.tokens(sequences) + self.positions(np.arange(sequences.shape[1]))
        return self.head(self.layer2(self.layer1(x)))  # (B, L, VOCAB) logits


def batch(rng, size):
    sequences = rng.integers(0, VOCAB, (size, LENGTH))
    return sequences, np.sort(sequences, axis=1)


def main() -> int:
    quick = os.environ.get("NPATTN_EXAMPLE_QUICK") == "1"
    steps = 40 if quick else 600
    rng = np.random.default_rng(0)
    model = Sorter(seed=0)
    optimizer = AdamW(model.parameters(), lr=PEAK_LR, weight_decay=0.01)
    start, losses = time.perf_counter(), []
    for step in range(steps):
        optimizer.lr = learning_rate(step, steps)
        sequences, targets = batch(rng, 64)
        logits = model(sequences)
        loss = ag.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        clip_grad_norm(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if step % 100 == 0:
            print(f"step {step:4d}  loss {loss.item():.4f}")
    model.eval()
    with ag.no_grad():
        sequences, targets = batch(np.random.default_rng(1), 1000)
        predicted = model(sequences).data.argmax(axis=-1)
    accuracy = float((predicted == targets).all(axis=1).mean())
    seconds = time.perf_counter() - start
    print(f"{steps} steps in {seconds:.1f} s; loss {np.mean(losses[:5]):.3f} -> {np.mean(losses[-5:]):.3f}; "
          f"sequences sorted exactly: {accuracy:.1%} (target {TARGET_ACCURACY:.0%})")
    if quick:
        return 0 if np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]) else 1
    return 0 if accuracy >= TARGET_ACCURACY else 1


if __name__ == "__main__":
    sys.exit(main())
