"""KVCache: preallocated keys and values for token-by-token decoding; PagedKVCache: a
pool of pages shared by sequences that start and finish at different times.

Without a window the cache is a plain prefix: appends write in place after the
entries already there, and attention reads the filled part as a view. With a window
(``window`` past keys, plus ``sinks`` first keys kept for good) it is a rolling
buffer: the sinks sit in their own slots, later keys go to slot
``sinks + (position - sinks) % window``, and attention gets the retained keys in
position order with an explicit mask built from absolute positions, so every query
of a multi-token append sees exactly what a full causal pass would show it.

Both caches also decode through :func:`npattn.attention_with_kvcache` (``attend``): each
sequence (cache row, or page list) keeps its own length, the new keys are written in
place, and the kernels read the cache where it lies, pages included.
"""
from __future__ import annotations

import numpy as np

from ..core import arguments
from ..core.quantization import HEAD_DIM_MULTIPLE, code_dtype
from ..adapters.dispatch import attention_with_kvcache


class UnknownSequence(KeyError, ValueError):
    """A sequence id the :class:`PagedKVCache` does not hold (a KeyError, as for a dict,
    and a ValueError, as for any other bad argument)."""


def _shape(x) -> tuple:
    """The shape of an array or array-like, () for anything NumPy cannot read."""
    try:
        return tuple(np.shape(x))
    except (TypeError, ValueError):
        return ()


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
        self.keys = arguments.zeros("KVCache", ("batch", "capacity", "num_kv_heads", "head_dim"), shape, dtype, xp)
        self.values = arguments.zeros("KVCache", ("batch", "capacity", "num_kv_heads", "head_dim"), shape, dtype, xp)
        self.position = 0          # positions appended so far; the next one's index
        self.lengths = np.zeros(batch, np.int64)  # per row: positions held (attend moves rows apart)
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
        if (self.lengths != self.position).any():
            raise ValueError("KVCache: its rows hold different lengths (from attend); a module appends to "
                             "every row at once: keep decoding it through attend, or reset() it")
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
        self.lengths[:] = self.position

    def attend(self, q, k=None, v=None, *, rows=None, **options):
        """One step of :func:`npattn.attention_with_kvcache` on this cache: q (B', Sq, H, D)
        of the sequences in cache ``rows`` (B' ints; default every row, in order), their
        new k and v (B', Sn, Hkv, D) appended in place at each row's own length, then
        attention with each sequence's last query level with its last key (one new key per
        query: row i at ``lengths[b] + i``). ``options``: those of attention_with_kvcache
        (``causal``, ``rotary_cos``, ...). Returns what it returns. Not for a rolling cache
        (``window``)."""
        if self.window is not None:
            raise ValueError("KVCache.attend: a rolling cache (window) decodes through the modules only")
        if rows is None:
            rows = np.arange(self.batch)
        else:
            given = np.asarray(rows)
            if given.dtype.kind not in "iu":
                raise TypeError(f"KVCache.attend: rows must be ints (rows of the cache); got {rows!r}")
            rows = given.astype(np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= self.batch or np.unique(rows).size != rows.size):
            raise ValueError(f"KVCache.attend: rows must be distinct rows of the cache's {self.batch}; got "
                             f"{rows.tolist()}")
        # every row in order: the cache as it is (each row's first keys, read in key buckets,
        # so that a small step's work is estimated from the keys it holds, not the capacity)
        every_row = rows.size == self.batch and bool((rows == np.arange(self.batch)).all())
        result = attention_with_kvcache(q, self.keys, self.values, k, v, cache_seqlens=self.lengths[rows],
                                        cache_batch_idx=None if every_row else self._xp.asarray(rows), **options)
        if k is not None:
            self.lengths[rows] += np.shape(k)[1]
        self.position = int(self.lengths.max(initial=0))
        return result

    def reset(self, rows=None) -> None:
        """Forget what ``rows`` (default: every row) hold, for new sequences (their stale
        keys are never read: each row reads only its own length)."""
        rows = slice(None) if rows is None else np.asarray(rows, np.int64)
        self.lengths[rows] = 0
        self.position = int(self.lengths.max(initial=0))

    def _slot_of(self, position: int) -> int:
        if position < self.sinks:
            return position
        return self.sinks + (position - self.sinks) % self.window

    def _held_positions(self):
        """The sinks seen so far, then the last ``window`` positions after them."""
        sinks = np.arange(min(self.position, self.sinks))
        rolling = min(max(self.position - self.sinks, 0), self.window)
        return np.concatenate([sinks, np.arange(self.position - rolling, self.position)]).astype(np.int64)


class PagedKVCache:
    """Keys and values of many sequences in one pool of fixed-size pages, (pages,
    page_size, Hkv, D) each: a sequence takes pages as it grows and gives them back when
    it finishes, so sequences of any lengths share the memory without padding
    (continuous batching; see ``examples/continuous_batching.py``).

    Args:
        num_pages, page_size: the pool's size.
        num_kv_heads, head_dim: the shape of the keys and values it stores.
        dtype: the stored dtype: a float dtype, or ``"int8"`` / ``"float8_e4m3"`` for a quantized
            pool (int8 codes, or e4m3 bits as uint8, in ``keys`` / ``values`` with a float32 scale per slot and kv head in
            ``key_scales`` / ``value_scales``, (pages, page_size, Hkv); head_dim a multiple
            of 16; the new keys come as float and are quantized as they are written, see
            :func:`npattn.quantize_kv`). xp: ``numpy`` (default) or ``cupy``.

    Sequences are named by any hashable id: :meth:`add` one, :meth:`attend` with a list
    of ids (each step's batch), :meth:`free` it when done.
    """

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype="float32", xp=np):
        owner = "PagedKVCache"
        num_pages = arguments.size(owner, "num_pages", num_pages)
        page_size = arguments.size(owner, "page_size", page_size)
        num_kv_heads = arguments.size(owner, "num_kv_heads", num_kv_heads)
        head_dim = arguments.size(owner, "head_dim", head_dim)
        codes = code_dtype(dtype)
        quantized = codes is not None
        if quantized and head_dim % HEAD_DIM_MULTIPLE:
            raise ValueError(f"{owner}: head_dim must be a multiple of {HEAD_DIM_MULTIPLE} for a quantized pool, "
                             f"got {head_dim}")
        dtype = codes if quantized else arguments.float_dtype(owner, "dtype", dtype)
        self.page_size, self.num_kv_heads, self.head_dim = page_size, num_kv_heads, head_dim
        names, shape = ("num_pages", "page_size", "num_kv_heads", "head_dim"), (num_pages, page_size, num_kv_heads,
                                                                                head_dim)
        self.keys = arguments.zeros(owner, names, shape, dtype, xp)
        self.values = arguments.zeros(owner, names, shape, dtype, xp)
        # a quantized pool's scales: one per slot and kv head (None for a float pool)
        self.key_scales = self.value_scales = None
        if quantized:
            self.key_scales = arguments.zeros(owner, names[:3], shape[:3], np.float32, xp)
            self.value_scales = arguments.zeros(owner, names[:3], shape[:3], np.float32, xp)
        self._free = list(range(num_pages - 1, -1, -1))  # pages not in use, the next one last
        self._pages: dict = {}     # sequence id -> its pages, in order
        self._lengths: dict = {}   # sequence id -> keys held
        self._xp = xp

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def sequences(self) -> tuple:
        return tuple(self._pages)

    def length(self, sequence) -> int:
        """Keys held for ``sequence``."""
        return self._lengths[self._known(sequence)]

    def add(self, sequence) -> None:
        """Start an empty sequence named ``sequence``."""
        if sequence in self._pages:
            raise ValueError(f"PagedKVCache: sequence {sequence!r} is already in the cache")
        self._pages[sequence], self._lengths[sequence] = [], 0

    def free(self, sequence) -> None:
        """Drop ``sequence`` and give its pages back to the pool."""
        self._free.extend(reversed(self._pages.pop(self._known(sequence))))
        del self._lengths[sequence]

    def block_table(self, sequences):
        """int64 (len(sequences), most pages held) NumPy: each sequence's pages, padded
        with page 0 (never read: each sequence reads its own length)."""
        return self._table([self._pages[self._known(s)] for s in sequences])

    def attend(self, sequences, q, k=None, v=None, **options):
        """One step of :func:`npattn.attention_with_kvcache` for ``sequences`` (B ids, one
        per row of q (B, Sq, H, D)): their new k and v (B, Sn, Hkv, D) go into pages of
        the pool (taken as needed), then every row attends to its sequence's keys, the
        last query level with the last key (one new key per query: row i at ``length +
        i``). ``options``: those of attention_with_kvcache. Raises MemoryError, before
        writing anything, when the pool has too few free pages. A call that raises
        changes nothing: the pages it would have taken stay free, the lengths and the
        pool's bytes stay as they were."""
        sequences = list(sequences)
        for sequence in sequences:
            self._known(sequence)
        if len(set(sequences)) != len(sequences):
            raise ValueError(f"PagedKVCache.attend: sequences must be distinct; got {sequences!r}")
        shape = _shape(k)
        new = int(shape[1]) if k is not None and len(shape) >= 2 else 0  # (a bad k is named by the call below)
        wanted = [max(0, -(-(self._lengths[s] + new) // self.page_size) - len(self._pages[s])) for s in sequences]
        total = sum(wanted)
        if total > len(self._free):
            raise MemoryError(f"PagedKVCache: {total} more pages needed, {len(self._free)} free "
                              f"(free finished sequences, or make the pool larger)")
        taken = self._free[len(self._free) - total:][::-1]  # the pages pop() would hand out, in order
        pages, start = {}, 0
        for sequence, count in zip(sequences, wanted):
            pages[sequence] = self._pages[sequence] + taken[start:start + count]
            start += count
        lengths = np.array([self._lengths[s] for s in sequences], np.int64)
        if self.key_scales is not None:
            options = dict(options, k_scale=self.key_scales, v_scale=self.value_scales)
        result = attention_with_kvcache(q, self.keys, self.values, k, v, cache_seqlens=lengths,
                                        block_table=self._xp.asarray(self._table([pages[s] for s in sequences])),
                                        **options)
        # the call succeeded: now the pages and lengths change
        del self._free[len(self._free) - total:]
        for sequence in sequences:
            self._pages[sequence] = pages[sequence]
            self._lengths[sequence] += new
        return result

    def attend_varlen(self, sequences, q, k, v, cu_seqlens, **options):
        """One step for sequences with different numbers of new tokens (prefill chunks and
        decode steps together, as continuous batching schedules them), in one call of
        :func:`npattn.attention_varlen` on the pool's pages: q (T, H, D), k and v (T, Hkv,
        D) hold every sequence's new tokens end to end, sequence b's rows
        ``cu_seqlens[b]:cu_seqlens[b + 1]``; its new keys go after its cached ones (pages
        taken as needed), then each of its rows attends to its keys, the last level with
        the last key. ``rotary_cos`` / ``rotary_sin`` (and ``rotary_interleaved``) rotate q
        and the new k by their positions first. Returns out (T, H, Dv), or ``(out, lse)``.
        A quantized pool (``dtype="int8"`` or ``"float8_e4m3"``) takes float q, k and v: the
        new keys are quantized into its codes and scales, and the kernels read the codes.
        Every check runs before the first write; a call that raises changes nothing: the
        pages stay free, the lengths and the pool's bytes as they were (should the attention
        itself fail after the write, the slots it wrote get their old bytes back)."""
        from ..core import checks
        from ..serving.kvcache import _quantized_rows, apply_rotary
        from ..serving.quantized import Scales
        from ..serving.varlen import _cumulative, checked_paged_call

        sequences = list(sequences)
        for sequence in sequences:
            self._known(sequence)
        if len(set(sequences)) != len(sequences):
            raise ValueError(f"PagedKVCache.attend_varlen: sequences must be distinct; got {sequences!r}")
        xp = self._xp
        quantized = self.key_scales is not None
        q, k, v = (xp.asarray(x) for x in (q, k, v))
        for name, array, width in (("q", q, self.head_dim), ("k", k, self.head_dim), ("v", v, self.head_dim)):
            heads = q.shape[1] if name == "q" and q.ndim == 3 else self.num_kv_heads
            if array.ndim != 3 or array.shape[0] != q.shape[0] or array.shape[1:] != (heads, width):
                raise ValueError(f"PagedKVCache.attend_varlen: {name} must be (T, {'H' if name == 'q' else 'Hkv'}, "
                                 f"{width}) with T = q's {q.shape[0]} rows; got {tuple(array.shape)}")
            if quantized:  # floats, quantized into the pool's codes as they are written
                checks.check_float_dtype(name, array)
                if array.dtype != q.dtype:
                    raise TypeError(f"PagedKVCache.attend_varlen: {name} has dtype {array.dtype} but q has {q.dtype}")
            elif array.dtype != self.keys.dtype:
                raise TypeError(f"PagedKVCache.attend_varlen: {name} has dtype {array.dtype} but the pool stores "
                                f"{self.keys.dtype}")
        starts = _cumulative("cu_seqlens", cu_seqlens, q.shape[0], "T", None, "")
        if len(starts) != len(sequences) + 1:
            raise ValueError(f"PagedKVCache.attend_varlen: cu_seqlens must have {len(sequences) + 1} entries for "
                             f"{len(sequences)} sequences; got {len(starts)}")
        new = np.diff(starts)
        wanted = [max(0, -(-(self._lengths[s] + int(n)) // self.page_size) - len(self._pages[s]))
                  for s, n in zip(sequences, new)]
        total = sum(wanted)
        if total > len(self._free):
            raise MemoryError(f"PagedKVCache: {total} more pages needed, {len(self._free)} free "
                              f"(free finished sequences, or make the pool larger)")
        taken = self._free[len(self._free) - total:][::-1]
        pages, first = {}, 0
        for sequence, count in zip(sequences, wanted):
            pages[sequence] = self._pages[sequence] + taken[first:first + count]
            first += count
        lengths = np.array([self._lengths[s] for s in sequences], np.int64)
        rotary = {name: options.pop(name) for name in ("rotary_cos", "rotary_sin", "rotary_interleaved")
                  if name in options}
        if "rotary_cos" in rotary or "rotary_sin" in rotary:  # each row at its own position
            cos, sin = rotary.get("rotary_cos"), rotary.get("rotary_sin")
            interleaved = bool(rotary.get("rotary_interleaved", False))
            last = int((lengths + new).max(initial=0))
            for name, table in (("rotary_cos", cos), ("rotary_sin", sin)):
                if table is None or np.ndim(table) != 2 or np.shape(table)[0] < last or 2 * np.shape(table)[1] > self.head_dim:
                    raise ValueError(f"PagedKVCache.attend_varlen: {name} must be (positions >= {last}, R / 2) with R "
                                     f"<= {self.head_dim}; got {None if table is None else np.shape(table)}")
            q, k = q.copy(), k.copy()
            for b in range(len(sequences)):
                rows = slice(int(starts[b]), int(starts[b + 1]))
                at = lengths[b:b + 1]
                q[rows] = apply_rotary(q[None, rows], at, cos, sin, interleaved)[0]
                k[rows] = apply_rotary(k[None, rows], at, cos, sin, interleaved)[0]
        table = self._table([pages[s] for s in sequences])
        # every check of the call before the first write (check_finite: the new keys here, the
        # pool by the call's own check)
        if options.get("check_finite") is True:
            checks.check_all_finite("k", k)
            checks.check_all_finite("v", v)
            if quantized:  # (the codes are finite by construction, int8; the scales may not be)
                checks.check_all_finite("the pool's key_scales", self.key_scales)
                checks.check_all_finite("the pool's value_scales", self.value_scales)
        scales = Scales(self.key_scales, self.value_scales) if quantized else None
        run = checked_paged_call(q, self.keys, self.values, starts, lengths + new, xp.asarray(table), options,
                                 scales=scales)
        # what goes into the pool: the new keys, or their codes and scales
        pools, rows = (self.keys, self.values), (k, v)
        if quantized:
            pools += (self.key_scales, self.value_scales)
            rows = _quantized_rows(k, v, self.keys.dtype)
        # where each new key goes: page and slot of positions length_b + i
        positions = np.concatenate([lengths[b] + np.arange(n) for b, n in enumerate(new)]).astype(np.int64)
        owner = np.repeat(np.arange(len(sequences)), new)
        page_of, slot_of = table[owner, positions // self.page_size], positions % self.page_size
        old = [pool[page_of, slot_of] for pool in pools]  # copies
        try:  # (the attention itself may still fail: out of memory, an interrupt)
            for pool, part in zip(pools, rows):
                pool[page_of, slot_of] = part
            result = run()
        except BaseException:
            for pool, part in zip(pools, old):
                pool[page_of, slot_of] = part
            raise
        del self._free[len(self._free) - total:]
        for sequence, count in zip(sequences, new):
            self._pages[sequence] = pages[sequence]
            self._lengths[sequence] += int(count)
        return result

    @staticmethod
    def _table(pages):
        table = np.zeros((len(pages), max((len(p) for p in pages), default=0)), np.int64)
        for row, held in enumerate(pages):
            table[row, :len(held)] = held
        return table

    def _known(self, sequence):
        if sequence not in self._pages:
            raise UnknownSequence(f"PagedKVCache: no sequence {sequence!r} (add it first)")
        return sequence
