"""KVCache: preallocated keys and values for token-by-token decoding.

Without a window the cache is a plain prefix: appends write in place after the
entries already there, and attention reads the filled part as a view. With a window
(``window`` past keys, plus ``sinks`` first keys kept for good) it is a rolling
buffer: the sinks sit in their own slots, later keys go to slot
``sinks + (position - sinks) % window``, and attention gets the retained keys in
position order with an explicit mask built from absolute positions, so every query
of a multi-token append sees exactly what a full causal pass would show it.
"""
from __future__ import annotations

import numpy as np

from .. import arguments


class KVCache:
    """Keys and values of past positions, (B, capacity, Hkv, D) each ("bshd", the
    projections' layout).

    Args:
        batch, num_kv_heads, head_dim: the shape of the keys and values it stores.
        capacity: the most positions it holds (without a window: the longest sequence).
        dtype: the stored dtype. xp: ``numpy`` (default) or ``cupy``.
        window: None, or the number of past keys a query sees besides its own (a causal
            window ``(window, 0)``); the cache then keeps ``sinks + window`` positions.
        sinks: with a window, the first ``sinks`` positions stay visible to every query.
    """

    def __init__(self, batch: int, num_kv_heads: int, head_dim: int, capacity: int, dtype="float32",
                 window=None, sinks: int = 0, xp=np):
        batch, num_kv_heads = arguments.size("KVCache", "batch", batch), arguments.size("KVCache", "num_kv_heads", num_kv_heads)
        head_dim, capacity = arguments.size("KVCache", "head_dim", head_dim), arguments.size("KVCache", "capacity", capacity)
        window = arguments.optional_size("KVCache", "window", window, minimum=0)
        sinks = arguments.size("KVCache", "sinks", sinks, minimum=0)
        dtype = arguments.float_dtype("KVCache", "dtype", dtype)
        if window is not None and capacity < sinks + window:
            raise ValueError(f"KVCache: capacity must be at least sinks + window = {sinks + window}; "
                             f"got {capacity}")
        self.batch, self.num_kv_heads, self.head_dim = batch, num_kv_heads, head_dim
        self.capacity, self.window, self.sinks = capacity, window, sinks
        shape = (batch, capacity, num_kv_heads, head_dim)
        self.keys = xp.zeros(shape, dtype)
        self.values = xp.zeros(shape, dtype)
        self.position = 0          # positions appended so far; the next one's index
        self._xp = xp

    @property
    def length(self) -> int:
        """Positions currently held."""
        if self.window is None:
            return self.position
        return min(self.position, self.sinks + self.window)

    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.values.nbytes)

    def check(self, batch, num_kv_heads, head_dim, new):
        """Raise ValueError unless ``new`` positions of this shape fit."""
        expected = (self.batch, self.num_kv_heads, self.head_dim)
        if (batch, num_kv_heads, head_dim) != expected:
            raise ValueError(f"KVCache: holds (batch, kv heads, head dim) {expected}; the module gives "
                             f"{(batch, num_kv_heads, head_dim)}")
        if self.window is None and self.position + new > self.capacity:
            raise ValueError(f"KVCache: capacity {self.capacity} cannot take {new} more positions after "
                             f"{self.position}")

    def retained(self):
        """``(keys, values, positions)`` of every held position, in position order:
        (B, length, Hkv, D) each and (length,) absolute positions."""
        if self.window is None:
            n = self.position
            return self.keys[:, :n], self.values[:, :n], np.arange(n)
        positions = self._held_positions()
        index = self._xp.asarray([self._slot_of(p) for p in positions], dtype=np.int64)
        return self.keys[:, index], self.values[:, index], positions

    def append(self, keys, values) -> None:
        """Store (B, S, Hkv, D) keys and values of the next S positions, in place."""
        new = keys.shape[1]
        self.check(keys.shape[0], keys.shape[2], keys.shape[3], new)
        if self.window is None:
            self.keys[:, self.position:self.position + new] = keys
            self.values[:, self.position:self.position + new] = values
        else:
            end = self.position + new
            for offset in range(new):
                position = self.position + offset
                # only sinks and the last `window` positions survive the append
                if position < self.sinks or position >= end - self.window:
                    slot = self._slot_of(position)
                    self.keys[:, slot] = keys[:, offset]
                    self.values[:, slot] = values[:, offset]
        self.position += new

    def _slot_of(self, position: int) -> int:
        if position < self.sinks:
            return position
        return self.sinks + (position - self.sinks) % self.window

    def _held_positions(self):
        """The sinks seen so far, then the last ``window`` positions after them."""
        sinks = np.arange(min(self.position, self.sinks))
        rolling = min(max(self.position - self.sinks, 0), self.window)
        return np.concatenate([sinks, np.arange(self.position - rolling, self.position)]).astype(np.int64)
