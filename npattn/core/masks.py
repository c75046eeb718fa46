"""One description of which keys a query row may see, shared by every backend.

Positions are bottom-right aligned by default (FlashAttention's convention): query
row ``i`` of ``q_len`` rows sits at position ``p_i = i + kv_len - q_len``, so the last
query row is level with the last key. That is what KV-cache decoding and chunked
prefill need; with ``q_len == kv_len`` it is the ordinary alignment. ``q_offset``
places row 0 elsewhere: ``p_i = i + q_offset`` (0: top-left, torch's ``is_causal``;
a block of a longer sequence: its query start minus its key start).

Key ``j`` is visible to row ``i`` when all of these hold:

- causal: ``j <= p_i``;
- window ``(left, right)``: ``p_i - left <= j <= p_i + right``, or ``j < sinks``
  (either bound may be ``None``: unbounded on that side);
- the user's boolean mask, ``kv_lengths`` and ``q_lengths`` (applied by the backends);
- left padding: ``kv_start[b] <= j`` and ``q_start[b] <= i``; the sinks are then the keys
  ``kv_start[b] <= j < kv_start[b] + sinks``.

Positions are array indices. Left padding leaves the default (bottom-right) alignment
as it is (the last real row is still level with the last key); a ``q_offset`` counts
from each entry's first real row and key, so batch entry ``b`` places row ``i`` at
``i + q_offset[b] + kv_start[b] - q_start[b]`` (:func:`row_shifts`).

The structural part (causal, window, sinks) is described by :class:`Visibility`.
Its :meth:`Visibility.key_range` gives, per row, the contiguous band of keys
that causal and window allow; kernels use it to skip whole tiles, which is why
the band is an interval and the sinks a separate prefix.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import arrays as _arrays


@dataclass(frozen=True)
class Visibility:
    """Causal, window and sink structure of the score matrix.

    ``window_left`` / ``window_right`` are ``None`` when unbounded; with ``causal``
    the right bound is folded to 0 (a causal row never sees past itself).
    """

    causal: bool = False
    window_left: int | None = None
    window_right: int | None = None
    sinks: int = 0
    q_offset: int | None = None  # None: bottom-right, kv_len - q_len

    @classmethod
    def from_options(cls, causal: bool, window, sinks: int, q_offset: int | None = None) -> "Visibility":
        """Normalize API options. ``window`` is None, an int ``w`` (``(w, w)``, or
        ``(w, 0)`` when causal) or a ``(left, right)`` pair whose entries may be None.
        Validation of types and signs happens in :mod:`npattn.core.validation`."""
        if window is None:
            left = right = None
        elif isinstance(window, tuple):
            left, right = window
        else:
            left, right = window, (0 if causal else window)
        if causal:
            right = 0 if right is None else min(right, 0)
        return cls(bool(causal), left, right, int(sinks), q_offset)

    def shift(self, q_len: int, kv_len: int) -> int:
        """Where query row 0 sits among the keys: ``p_i = i + shift``."""
        return kv_len - q_len if self.q_offset is None else self.q_offset

    @property
    def is_full(self) -> bool:
        """True when causal and window rule out nothing (sinks are then irrelevant)."""
        return not self.causal and self.window_left is None and self.window_right is None

    @property
    def has_window(self) -> bool:
        return self.window_left is not None or self.window_right is not None

    def key_range(self, row: int, q_len: int, kv_len: int) -> tuple[int, int]:
        """Half-open band ``[lo, hi)`` of keys that causal and window allow row ``row``
        to see, clipped to ``[0, kv_len)``; empty when ``lo >= hi``. Keys ``j < sinks``
        are visible in addition whenever a window is set (see :meth:`sink_end`)."""
        position = row + self.shift(q_len, kv_len)
        lo = 0 if self.window_left is None else min(kv_len, max(0, position - self.window_left))
        hi = kv_len if self.window_right is None else min(kv_len, position + self.window_right + 1)
        if self.causal:
            hi = min(hi, position + 1)
        return lo, max(lo, hi)

    def sink_end(self, row: int, q_len: int, kv_len: int) -> int:
        """Keys ``[0, sink_end)`` are visible to ``row`` through the sinks: the first
        ``sinks`` keys, but never past what causality allows."""
        if not self.has_window:
            return 0
        end = min(self.sinks, kv_len)
        if self.causal:
            end = min(end, max(0, row + self.shift(q_len, kv_len) + 1))
        return end

    def matrix(self, xp, q_len: int, kv_len: int):
        """Boolean (q_len, kv_len) array of module ``xp``: True where causal/window/sinks allow."""
        return self.allowed(xp, xp.arange(q_len)[:, None] + self.shift(q_len, kv_len), xp.arange(kv_len)[None, :])

    def allowed(self, xp, position, key, sink_start=0):
        """Boolean array of module ``xp``, the broadcast shape of integer arrays ``position``
        (rows' key positions) and ``key`` (key indices): True where causal, window and
        sinks allow, the sinks being the keys ``[sink_start, sink_start + sinks)``."""
        shape = np.broadcast_shapes(position.shape, key.shape, getattr(sink_start, "shape", ()))
        allowed = xp.ones(shape, dtype=bool)
        if self.window_left is not None:
            allowed &= key >= position - self.window_left
        if self.window_right is not None:
            allowed &= key <= position + self.window_right
        if self.has_window and self.sinks:
            allowed |= (key >= sink_start) & (key < sink_start + self.sinks)
        if self.causal:
            allowed &= key <= position
        return allowed


def row_shifts(q_offset, q_start, kv_start):
    """int64 (B,) NumPy array: where query row 0 of each batch entry sits among the keys
    (row i at ``i + shift[b]``), for a per-entry ``q_offset`` (int (B,)) or one counted
    from the first real row and key; None when one shift serves every entry (no
    q_offset, or an int one without q_start / kv_start): then
    :meth:`Visibility.shift` gives it. Arrays may be CuPy's (read back here, once)."""
    if q_offset is None or (isinstance(q_offset, int) and q_start is None and kv_start is None):
        return None
    shifts = np.asarray(_arrays.to_numpy(q_offset) if not isinstance(q_offset, int) else q_offset, np.int64)
    if kv_start is not None:
        shifts = shifts + _arrays.to_numpy(kv_start).astype(np.int64)
    if q_start is not None:
        shifts = shifts - _arrays.to_numpy(q_start).astype(np.int64)
    batch = next(len(a) for a in (q_offset, q_start, kv_start) if a is not None and not isinstance(a, int))
    if shifts.shape == (batch,):  # (the usual case: broadcast_to alone costs 4 us)
        return np.ascontiguousarray(shifts)
    return np.ascontiguousarray(np.broadcast_to(shifts, (batch,)))
