"""A seeded fuzz of the serving calls and the framework adapters: valid and broken calls
mixed, each classified.

Every call is drawn from a seed: a valid call of one surface (attention_with_kvcache on a
contiguous cache, on cache rows picked by cache_batch_idx or on a paged pool, sometimes
after the decode loop's step before it, whose kept plan the call moves on;
PagedKVCache.attend; attention_varlen; npattn.torch and npattn.jax), then, for about half
of them, one argument broken by a mutation that names the argument(s) its error must
name. A call ends in one of these classes:

- ``ok``: a valid call whose outputs match the float64 reference of the call spelled out
  by hand (each sequence's keys gathered from the cache as it was, plus the new ones), and
  whose caches hold exactly the new keys where they belong, every other byte unchanged;
- ``rejected``: a broken call that raised ValueError, TypeError or MemoryError naming the
  argument, with every cache, pool and input byte-identical afterwards;
- the faults, which must never happen: ``hang`` (no answer within :data:`HANG_SECONDS`),
  ``changed by failure`` (a call raised but some byte or a pool's state changed),
  ``silent wrong answer`` (a broken call returned, or a valid call's outputs or cache are
  wrong), ``valid call refused``, ``foreign exception`` (any other exception from the
  library: IndexError, ZeroDivisionError, NumPy's own errors), ``unnamed`` (the message
  does not name the argument).

A crash takes the process with it, so a run that prints its table had none.
``python tests/serving_fuzz.py --calls 5000 --seed 7`` runs it alone and prints the table;
tests/test_serving_fuzz.py runs it in CI (and the ring's own fuzz under mpiexec).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import re
import signal
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

import npattn
from npattn.nn.cache import PagedKVCache

HANG_SECONDS = 30
FAULTS = ("hang", "changed by failure", "silent wrong answer", "valid call refused", "foreign exception", "unnamed")
CLASSES = ("ok", "rejected", *FAULTS)
ALLOWED = (ValueError, TypeError, MemoryError, TimeoutError)


@dataclass
class Call:
    """One drawn call: ``run()`` makes it; ``names``: the arguments a rejection must name
    (empty: the call is valid); ``state()``: every byte and every bit of state the call may
    touch (compared after a failure); ``verify(result)``: for a valid call, None or what is
    wrong with its result and its effects."""

    surface: str
    label: str
    run: Callable[[], Any]
    names: tuple = ()
    state: Callable[[], Any] = lambda: None
    verify: Callable[[Any], str | None] = lambda result: None


@dataclass
class Tally:
    counts: collections.Counter = field(default_factory=collections.Counter)
    by_surface: collections.Counter = field(default_factory=collections.Counter)
    examples: dict = field(default_factory=dict)

    def add(self, call: Call, klass: str, detail: str = "") -> None:
        self.counts[klass] += 1
        self.by_surface[call.surface] += 1
        if klass in FAULTS:
            self.examples.setdefault(klass, []).append(f"{call.surface} / {call.label}: {detail}"[:600])

    def table(self) -> str:
        lines = [f"serving fuzz: {sum(self.counts.values())} calls "
                 f"({', '.join(f'{n} {s}' for s, n in sorted(self.by_surface.items()))})"]
        lines += [f"  {klass:<20} {self.counts[klass]}" for klass in CLASSES]
        for klass, examples in self.examples.items():
            lines += [f"  {klass}: {example}" for example in examples[:5]]
        return "\n".join(lines)

    @property
    def faults(self) -> int:
        return sum(self.counts[klass] for klass in FAULTS)


class Hang(Exception):
    pass


@contextlib.contextmanager
def watchdog(seconds: int):
    """Raise :class:`Hang` in the main thread after ``seconds`` (SIGALRM, where there is one)."""
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def alarm(signum, frame):
        raise Hang(f"no answer in {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def names_any(message: str, names: tuple) -> bool:
    """Whether ``message`` names one of ``names`` as a word."""
    return any(re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", message) for name in names)


def classify(call: Call, tally: Tally) -> str:
    before = call.state()
    try:
        with watchdog(HANG_SECONDS):
            result = call.run()
    except Hang as error:
        tally.add(call, "hang", str(error))
        return "hang"
    except Exception as error:  # noqa: BLE001 (the point is to see every kind)
        message = f"{type(error).__name__}: {error}"
        after = call.state()
        if not _same(before, after):
            tally.add(call, "changed by failure", message)
            return "changed by failure"
        if not isinstance(error, ALLOWED):
            tally.add(call, "foreign exception", message)
            return "foreign exception"
        if not call.names:
            tally.add(call, "valid call refused", message)
            return "valid call refused"
        if not names_any(str(error), call.names):
            tally.add(call, "unnamed", f"wanted {call.names}; {message}")
            return "unnamed"
        tally.add(call, "rejected")
        return "rejected"
    if call.names:
        tally.add(call, "silent wrong answer", f"a call broken in {call.names} returned")
        return "silent wrong answer"
    try:
        problem = call.verify(result)
    except Exception as error:  # noqa: BLE001
        problem = f"verifying raised {type(error).__name__}: {error}"
    if problem:
        tally.add(call, "silent wrong answer", problem)
        return "silent wrong answer"
    tally.add(call, "ok")
    return "ok"


def _same(before, after) -> bool:
    if isinstance(before, (list, tuple)):
        return (isinstance(after, (list, tuple)) and len(before) == len(after)
                and all(_same(a, b) for a, b in zip(before, after)))
    if isinstance(before, dict):
        return isinstance(after, dict) and before.keys() == after.keys() and all(
            _same(before[key], after[key]) for key in before)
    return before == after


def snapshot(*values) -> list:
    """Bytes (with dtype and shape) of each array, the repr of anything else."""
    result = []
    for value in values:
        if isinstance(value, np.ndarray):
            result.append((value.dtype.str, value.shape, value.tobytes()))
        elif hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch tensor
            array = value.detach().cpu().numpy()
            result.append((array.dtype.str, array.shape, array.tobytes()))
        elif isinstance(value, (list, tuple)):
            result.append(snapshot(*value))
        else:
            result.append(repr(value))
    return result


# ---- the oracle: one sequence at a time, spelled out -------------------------------------------

def rotate(x, positions, cos, sin, interleaved):
    """x (S, H, D) float64, row s rotated by ``positions[s]`` (the harness's own rotation)."""
    x = np.array(x, np.float64)
    half = cos.shape[1]
    c, s = cos[positions][:, None, :].astype(np.float64), sin[positions][:, None, :].astype(np.float64)
    if interleaved:
        first, second = x[..., 0:2 * half:2].copy(), x[..., 1:2 * half:2].copy()
        x[..., 0:2 * half:2], x[..., 1:2 * half:2] = first * c - second * s, first * s + second * c
    else:
        first, second = x[..., :half].copy(), x[..., half:2 * half].copy()
        x[..., :half], x[..., half:2 * half] = first * c - second * s, first * s + second * c
    return x


def oracle(q, keys, values, options, q_offset):
    """float64 (out (Sq, H, Dv), lse (H, Sq)) of one sequence: q (Sq, H, D), keys (L, Hkv, D)."""
    options = {name: value for name, value in options.items() if name not in ("check_finite", "return_lse")}
    out, lse = npattn.attention(np.asarray(q, np.float64)[None], np.asarray(keys, np.float64)[None],
                                np.asarray(values, np.float64)[None], layout="bshd", q_offset=q_offset,
                                return_lse=True, backend="reference", **options)
    return out[0], lse[0]


def close(actual, expected, dtype, length, magnitude) -> str | None:
    """None when within the dtype's derived bound (tests/tolerances.py), else what differs."""
    from tolerances import bound

    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if actual.shape != expected.shape:
        return f"shape {actual.shape}, expected {expected.shape}"
    both = np.isneginf(actual) & np.isneginf(expected)
    difference = np.abs(np.where(both, 0, actual) - np.where(both, 0, expected))
    tolerance = bound(dtype, length, magnitude)
    if not (difference <= tolerance).all():
        return f"differs by {np.nanmax(np.where(np.isnan(difference), np.inf, difference)):.3g} (bound {tolerance:.3g})"
    return None


# ---- attention_with_kvcache ---------------------------------------------------------------------

def _options(rng, heads, batch):
    options = {}
    if rng.random() < 0.5:
        options["causal"] = True
    if rng.random() < 0.3:
        options["window"] = int(rng.integers(0, 5))
        if rng.random() < 0.5:
            options["sinks"] = int(rng.integers(0, 3))
    if rng.random() < 0.2:
        options["softcap"] = float(rng.uniform(1, 5))
    if rng.random() < 0.2:
        options["scale"] = float(rng.uniform(0.1, 1))
    if rng.random() < 0.2:
        options["alibi_slopes"] = rng.uniform(0, 1, (heads,) if rng.random() < 0.5 else (batch, heads))
    if rng.random() < 0.2:
        options["sink_logits"] = rng.normal(0, 1, heads)
    if rng.random() < 0.3:
        options["return_lse"] = True
    return options


@dataclass
class KVProblem:
    """A valid attention_with_kvcache call and everything the oracle needs."""

    layout: str
    dtype: Any
    q: np.ndarray
    k_cache: np.ndarray
    v_cache: np.ndarray
    k: np.ndarray | None
    v: np.ndarray | None
    seqlens: np.ndarray
    block_table: np.ndarray | None
    cache_batch_idx: np.ndarray | None
    rotary: tuple | None
    options: dict
    prefix: tuple | None = None  # (prefix_k, prefix_v) every sequence sees first, or None

    def arguments(self) -> dict:
        arguments = dict(q=self.q, k_cache=self.k_cache, v_cache=self.v_cache, k=self.k, v=self.v,
                         cache_seqlens=self.seqlens)
        if self.block_table is not None:
            arguments["block_table"] = self.block_table
        if self.cache_batch_idx is not None:
            arguments["cache_batch_idx"] = self.cache_batch_idx
        if self.rotary is not None:
            arguments.update(rotary_cos=self.rotary[0], rotary_sin=self.rotary[1], rotary_interleaved=self.rotary[2])
        if self.prefix is not None:
            arguments.update(prefix_k=self.prefix[0], prefix_v=self.prefix[1])
        return {**arguments, **self.options}

    def slot(self, b, t):
        """(row or page, offset) of sequence b's key t."""
        if self.block_table is not None:
            size = self.k_cache.shape[1]
            return int(self.block_table[b, t // size]), t % size
        return (b if self.cache_batch_idx is None else int(self.cache_batch_idx[b])), t


def kv_problem(rng, dims=None) -> KVProblem:
    """A valid call; ``dims``: its (head_dim, value_dim), else drawn."""
    dtype = np.dtype([np.float32, np.float64][rng.integers(2)])
    batch, kv_heads = int(rng.integers(1, 4)), int(rng.integers(1, 3))
    heads = kv_heads * int(rng.integers(1, 3))
    head_dim, value_dim = dims or (2 * int(rng.integers(1, 5)), int(rng.integers(1, 7)))
    q_len = int(rng.integers(1, 4))
    new = 0 if rng.random() < 0.3 else int(rng.integers(1, 4))
    layout = ["contiguous", "rows", "paged"][rng.integers(3)]
    normal = lambda *shape: rng.standard_normal(shape).astype(dtype)  # noqa: E731
    block_table = cache_batch_idx = None
    if layout == "paged":
        page_size = int(rng.integers(1, 5))
        longest = int(rng.integers(new, new + 10))
        per_sequence = -(-max(longest, 1) // page_size) + int(rng.integers(0, 2))
        pages = batch * per_sequence + int(rng.integers(0, 3))
        k_cache, v_cache = normal(pages, page_size, kv_heads, head_dim), normal(pages, page_size, kv_heads, value_dim)
        block_table = rng.permutation(pages)[:batch * per_sequence].reshape(batch, per_sequence).astype(np.int64)
        seqlens = rng.integers(0, longest - new + 1, batch)
        if batch > 1 and (seqlens >= page_size).all() and rng.random() < 0.5:
            block_table[:, 0] = block_table[0, 0]  # a shared prefix page, only read
        capacity = per_sequence * page_size
    else:
        rows = batch + (int(rng.integers(0, 3)) if layout == "rows" else 0)
        capacity = int(rng.integers(new, new + 10))
        k_cache, v_cache = normal(rows, capacity, kv_heads, head_dim), normal(rows, capacity, kv_heads, value_dim)
        seqlens = rng.integers(0, capacity - new + 1, batch)
        if layout == "rows":
            cache_batch_idx = rng.permutation(rows)[:batch].astype(np.int64)
    k = normal(batch, new, kv_heads, head_dim) if new or rng.random() < 0.5 else None
    v = normal(batch, new, kv_heads, value_dim) if k is not None else None
    rotary = None
    if rng.random() < 0.25:
        half = int(rng.integers(1, head_dim // 2 + 1))
        positions = capacity + 2
        angles = rng.uniform(0, 2 * np.pi, (positions, half))
        rotary = (np.cos(angles).astype(dtype), np.sin(angles).astype(dtype), bool(rng.random() < 0.5))
        seqlens = np.maximum(seqlens, q_len - new)  # no query before position 0
        if (seqlens + new > capacity).any():
            rotary = None
            seqlens = np.minimum(seqlens, capacity - new)
    options = _options(rng, heads, batch)
    if rng.random() < 0.15:  # a NaN where no sequence reads: check_finite must not mind it
        options["check_finite"] = True
        _poison_unread(rng, k_cache, seqlens + new, block_table, cache_batch_idx)
    prefix = None
    if rng.random() < 0.2:  # a prompt prefix every sequence shares (its keys come first)
        span = int(rng.integers(1, 5))
        prefix = (normal(span, kv_heads, head_dim), normal(span, kv_heads, value_dim))
        if rotary is not None:  # the tables must reach the prefix's span past the own keys
            angles = rng.uniform(0, 2 * np.pi, (capacity + span + 2, rotary[0].shape[1]))
            rotary = (np.cos(angles).astype(dtype), np.sin(angles).astype(dtype), rotary[2])
    return KVProblem(layout, dtype, normal(batch, q_len, heads, head_dim), k_cache, v_cache, k, v,
                     seqlens.astype(np.int64), block_table, cache_batch_idx, rotary, options, prefix)


def _poison_unread(rng, cache, lengths, block_table, rows):
    read = np.zeros(cache.shape[:2], bool)
    for b, length in enumerate(lengths):
        for t in range(int(length)):
            if block_table is not None:
                read[block_table[b, t // cache.shape[1]], t % cache.shape[1]] = True
            else:
                read[b if rows is None else rows[b], t] = True
    unread = np.argwhere(~read)
    if unread.size:
        row, slot = unread[rng.integers(len(unread))]
        cache[row, slot] = np.nan


def kv_verify(problem: KVProblem, before_k, before_v):
    """The oracle's check of a valid call's result and of the caches afterwards."""
    from tolerances import bound

    def verify(result):
        out, lse = (result if problem.options.get("return_lse") else (result, None))
        q_len = problem.q.shape[1]
        new = 0 if problem.k is None else problem.k.shape[1]
        expected_k, expected_v = before_k.astype(np.float64), before_v.astype(np.float64)
        span = 0 if problem.prefix is None else problem.prefix[0].shape[0]
        for b, cached in enumerate(problem.seqlens):
            length = int(cached) + new
            positions = np.arange(cached, length)
            new_k = None if problem.k is None else problem.k[b].astype(np.float64)
            if new_k is not None and problem.rotary is not None:
                new_k = rotate(new_k, positions + span, *problem.rotary)
            keys = [before_k[problem.slot(b, t)].astype(np.float64) for t in range(int(cached))]
            values = [before_v[problem.slot(b, t)].astype(np.float64) for t in range(int(cached))]
            for i, t in enumerate(positions):
                keys.append(new_k[i])
                values.append(problem.v[b, i].astype(np.float64))
                expected_k[problem.slot(b, t)], expected_v[problem.slot(b, t)] = new_k[i], problem.v[b, i]
            kv_heads, head_dim, value_dim = problem.k_cache.shape[2], problem.k_cache.shape[3], problem.v_cache.shape[3]
            keys = np.array(keys).reshape(length, kv_heads, head_dim)
            values = np.array(values).reshape(length, kv_heads, value_dim)
            if span:  # the prefix's keys first, then the sequence's own
                keys = np.concatenate([problem.prefix[0].astype(np.float64), keys])
                values = np.concatenate([problem.prefix[1].astype(np.float64), values])
                length += span
            q = problem.q[b].astype(np.float64)
            if problem.rotary is not None:
                q = rotate(q, np.arange(length - q_len, length), *problem.rotary)
            options = dict(problem.options)
            if np.ndim(options.get("alibi_slopes")) == 2:
                options["alibi_slopes"] = options["alibi_slopes"][b]
            want_out, want_lse = oracle(q, keys, values, options, length - q_len)
            magnitude = (1 + np.abs(values).max(initial=0)) * (1 + np.abs(q).sum(-1).max() * max(
                np.abs(keys).max(initial=0), 1)) * 4
            problem_text = close(out[b], want_out, problem.dtype, length + head_dim, magnitude)
            if problem_text:
                return f"out of sequence {b} {problem_text}"
            if lse is not None:
                problem_text = close(lse[b], want_lse, np.float64 if problem.dtype == np.float64 else np.float32,
                                     length + head_dim, magnitude)
                if problem_text:
                    return f"lse of sequence {b} {problem_text}"
        for name, cache, expected in (("k_cache", problem.k_cache, expected_k), ("v_cache", problem.v_cache,
                                                                                  expected_v)):
            same = (cache.astype(np.float64) == expected) | (np.isnan(cache) & np.isnan(expected))
            # new keys the call rotated in the cache's dtype, the harness in float64: within the
            # rounding of a rotation (two products summed) in that dtype
            loose = np.abs(np.nan_to_num(cache.astype(np.float64) - expected)) <= bound(
                problem.dtype, 2, 1 + np.abs(np.nan_to_num(expected)))
            if not (same | loose).all():
                return f"{name} after the call differs at {tuple(np.argwhere(~(same | loose))[0])}"
        return None
    return verify


def _kv_mutations(problem: KVProblem, rng):
    """(names, change of the arguments dict) pairs that each break the call."""
    q, kc, vc = problem.q, problem.k_cache, problem.v_cache
    batch = q.shape[0]
    new = problem.k is not None and problem.k.shape[1] > 0
    read_only = kc.copy()
    read_only.flags.writeable = False
    mutations = [
        (("q",), lambda a: a.update(q=q[0])),
        (("q",), lambda a: a.update(q=q.astype(np.int32))),
        (("q", "k_cache"), lambda a: a.update(q=q[..., :-1])),
        (("q",), lambda a: a.update(q="text")),
        (("k_cache", "q"), lambda a: a.update(k_cache=kc.astype(np.float16))),
        (("k_cache",), lambda a: a.update(k_cache=kc[0])),
        (("v_cache", "k_cache"), lambda a: a.update(v_cache=vc[:, :, :, :, None])),
        (("cache_seqlens",), lambda a: a.update(cache_seqlens=-1)),
        (("cache_seqlens",), lambda a: a.update(cache_seqlens=2**63)),
        (("cache_seqlens",), lambda a: a.update(cache_seqlens=np.full(batch, 2**63, np.uint64))),
        (("cache_seqlens",), lambda a: a.update(cache_seqlens=np.full(batch, -2**63))),
        (("cache_seqlens",), lambda a: a.update(cache_seqlens=np.zeros(batch + 1, np.int64))),
        (("cache_seqlens",), lambda a: a.update(cache_seqlens=np.zeros(batch, np.float32))),
        (("cache_seqlens",), lambda a: a.update(cache_seqlens="3")),
        (("cache_seqlens",), lambda a: a.update(cache_seqlens=problem.seqlens + 10**6)),
        (("window",), lambda a: a.update(window=-2)),
        (("causal",), lambda a: a.update(causal="maybe")),
        (("causal",), lambda a: a.update(causal="top_left")),
        (("scale",), lambda a: a.update(scale=float("nan"))),
        (("softcap",), lambda a: a.update(softcap=-1.0)),
        (("sinks",), lambda a: a.update(sinks=-1)),
        (("layout",), lambda a: a.update(layout="bshd")),
        (("q_offset",), lambda a: a.update(q_offset=0)),
        (("softmax_scale", "scale"), lambda a: a.update(softmax_scale=0.5)),
        (("alibi_slopes",), lambda a: a.update(alibi_slopes=np.ones(q.shape[2] + 1))),
        (("sink_logits",), lambda a: a.update(sink_logits=np.full(q.shape[2], np.nan))),
        (("return_lse",), lambda a: a.update(return_lse="yes")),
        (("backend",), lambda a: a.update(backend="tpu")),
        (("dropout_p",), lambda a: a.update(dropout_p=1.5)),
        (("rotary_cos", "rotary_sin"), lambda a: a.update(rotary_cos=np.ones((40, 1), problem.dtype))),
        (("rotary_cos", "rotary_sin"), lambda a: a.update(rotary_cos=np.ones((20, q.shape[3]), problem.dtype),
                                                         rotary_sin=np.zeros((20, q.shape[3]), problem.dtype))),
        (("rotary_interleaved",), lambda a: a.update(rotary_interleaved="yes")),
    ]
    if problem.prefix is not None:
        prefix_k, prefix_v = problem.prefix
        mutations += [
            (("prefix_k",), lambda a: a.update(prefix_k=prefix_k.astype(np.float16))),
            (("prefix_k", "prefix_v"), lambda a: a.update(prefix_v=prefix_v[:-1])),
            (("prefix_k", "prefix_v"), lambda a: a.update(prefix_v=None)),
            (("prefix_k",), lambda a: a.update(prefix_k=prefix_k[:, :, :1] if prefix_k.shape[2] > 1
                                               else prefix_k[..., None])),
            (("bias", "prefix_k"), lambda a: a.update(bias=np.zeros(1, problem.dtype))),
        ]
    if problem.k is not None:
        mutations += [
            (("k",), lambda a: a.update(k=problem.k.astype(np.float16))),
            (("k",), lambda a: a.update(k=problem.k[:, :, :, :1] if problem.k.shape[3] > 1 else problem.k[..., None])),
            (("k", "v"), lambda a: a.update(v=None)),
            (("v", "k"), lambda a: a.update(v=problem.v[:, :0] if new else problem.v[:, :, :, :, None])),
        ]
    if new:
        mutations += [
            (("v_cache",), lambda a: a.update(v_cache=_read_only(vc))),
            (("k_cache",), lambda a: a.update(k_cache=read_only)),
            (("k_cache",), lambda a: a.update(k_cache=kc.astype(kc.dtype.newbyteorder(">")))),
            (("k_cache",), lambda a: a.update(k_cache=kc.tolist())),
            (("k_cache", "v_cache"), lambda a: a.update(v_cache=kc)),
            (("k_cache",), lambda a: a.update(k_cache=np.broadcast_to(kc[:, :1], kc.shape))),
        ]
        if problem.options.get("check_finite") is None and (problem.seqlens > 0).any():
            mutations.append((("k_cache",), lambda a: (_poison_read(problem), a.update(check_finite=True))))
    if problem.block_table is not None:
        table = problem.block_table
        if (problem.seqlens + (problem.k.shape[1] if problem.k is not None else 0) > 0).any():
            mutations.append((("block_table",), lambda a: a.update(block_table=table + kc.shape[0])))
        mutations += [
            (("block_table",), lambda a: a.update(block_table=table.astype(np.float64))),
            (("block_table",), lambda a: a.update(block_table=table[0])),
            (("block_table", "cache_batch_idx"), lambda a: a.update(cache_batch_idx=np.arange(batch))),
        ]
        if new and batch > 1:
            mutations.append((("block_table",), lambda a: a.update(zip(("block_table", "cache_seqlens"),
                                                                       _colliding(problem)))))
    else:
        rows = kc.shape[0]
        mutations += [
            (("cache_batch_idx",), lambda a: a.update(cache_batch_idx=np.full(batch, rows))),
            (("cache_batch_idx",), lambda a: a.update(cache_batch_idx=np.zeros(batch, np.float32))),
        ]
        if (problem.seqlens + (problem.k.shape[1] if problem.k is not None else 0) > 0).any():
            mutations.append((("block_table", "k_cache"), lambda a: a.update(block_table=np.full((batch, 1),
                                                                                                  kc.shape[0]))))
        if new and batch > 1:
            mutations.append((("cache_batch_idx",), lambda a: a.update(cache_batch_idx=np.zeros(batch, np.int64))))
    return mutations


def _read_only(array):
    array = array.copy()
    array.flags.writeable = False
    return array


def _poison_read(problem: KVProblem):
    """A NaN in a slot some sequence reads (with check_finite=True the call must refuse)."""
    b = int(np.flatnonzero(problem.seqlens > 0)[0])
    problem.k_cache[problem.slot(b, int(problem.seqlens[b]) - 1)] = np.nan


def _colliding(problem: KVProblem):
    """(table, seqlens) in which the second sequence holds the first one's pages at its
    length: both write their new keys into the same slots."""
    table, seqlens = problem.block_table.copy(), problem.seqlens.copy()
    table[1], seqlens[1] = table[0], seqlens[0]
    return table, seqlens


def _earlier_step(rng, arguments, caches) -> None:
    """Sometimes, the call a decode loop made the step before this one (every sequence one
    key shorter, on copies of the caches ``caches`` names): the plan attention_with_kvcache
    keeps of it is the one this call's checks move on to its own lengths where nothing
    else changed (KVCachePlan.advanced), valid call or broken."""
    seqlens = arguments["cache_seqlens"]
    if rng.random() >= 0.5 or (seqlens < 1).any():
        return
    earlier = dict(arguments, cache_seqlens=seqlens - 1, **{name: arguments[name].copy() for name in caches})
    try:
        npattn.attention_with_kvcache(**earlier)
    except (ValueError, TypeError):  # (a call this one's lengths make valid may not be: rotary positions)
        pass


def kvcache_call(rng) -> Call:
    problem = kv_problem(rng)
    arguments = problem.arguments()
    _earlier_step(rng, arguments, ("k_cache", "v_cache"))
    names = ()
    label = f"{problem.layout} valid"
    if rng.random() < 0.5:
        mutations = _kv_mutations(problem, rng)
        names, mutate = mutations[rng.integers(len(mutations))]
        mutate(arguments)
        label = f"{problem.layout} broken in {names[0]}"
    before_k, before_v = problem.k_cache.copy(), problem.v_cache.copy()
    watched = [value for value in arguments.values() if isinstance(value, np.ndarray)] + [problem.k_cache,
                                                                                           problem.v_cache]
    return Call("attention_with_kvcache", label, lambda: npattn.attention_with_kvcache(**arguments), names,
                lambda: snapshot(*watched), kv_verify(problem, before_k, before_v))


# ---- attention_with_kvcache on int8 caches ---------------------------------------------------------

def quantized_kvcache_call(rng) -> Call:
    """A kv-cache call on int8 or float8 e4m3 codes with scales (head dims of 16), valid or broken in one
    argument; a valid call's oracle is the same call on copies through the reference backend
    (its float64 reading of the codes is tested against quantize_kv's definition in
    tests/test_quantized_cache.py): the same codes and scales written, out within the bound."""
    from npattn.core.quantization import quantize_rows

    problem = kv_problem(rng, dims=(16, 16))
    kind = np.dtype([np.int8, np.uint8][rng.integers(2)])  # int8, or float8 e4m3 bits
    (k_codes, k_scale), (v_codes, v_scale) = (quantize_rows(problem.k_cache, kind),
                                              quantize_rows(problem.v_cache, kind))
    arguments = dict(problem.arguments(), k_cache=k_codes, v_cache=v_codes, k_scale=k_scale, v_scale=v_scale)
    arguments.pop("backend", None)
    caches = (k_codes, v_codes, k_scale, v_scale)
    _earlier_step(rng, arguments, ("k_cache", "v_cache", "k_scale", "v_scale"))
    names, label = (), f"{kind} {problem.layout} valid"
    if rng.random() < 0.5:
        new = problem.k is not None and problem.k.shape[1] > 0
        frozen = _read_only(k_scale)
        mutations = [
            (("k_scale",), lambda a: a.update(k_scale=k_scale.astype(np.float64))),
            (("v_scale",), lambda a: a.update(v_scale=v_scale[:, :-1] if v_scale.shape[1] > 1 else v_scale[..., :0])),
            (("k_scale", "v_scale"), lambda a: a.update(v_scale=None)),
            (("k_cache", "k_scale"), lambda a: a.update(k_scale=None, v_scale=None)),
            (("k_cache",), lambda a: a.update(k_cache=k_codes.astype(np.int16))),
            (("q", "k_cache"), lambda a: a.update(q=problem.q[..., :8])),
            (("window",), lambda a: a.update(window=-2)),
            (("cache_seqlens",), lambda a: a.update(cache_seqlens=problem.seqlens + 10**6)),
        ]
        if new:
            mutations += [(("k_scale",), lambda a: a.update(k_scale=frozen)),
                          (("k_scale", "v_scale"), lambda a: a.update(v_scale=k_scale)),
                          (("k",), lambda a: a.update(k=problem.k.astype(np.float16)))]
        names, mutate = mutations[rng.integers(len(mutations))]
        mutate(arguments)
        label = f"{kind} {problem.layout} broken in {names[0]}"
    before = [array.copy() for array in caches]
    watched = [value for value in arguments.values() if isinstance(value, np.ndarray)] + list(caches)

    def verify(result):
        copies = [array.copy() for array in before]
        expected = npattn.attention_with_kvcache(**dict(arguments, k_cache=copies[0], v_cache=copies[1],
                                                        k_scale=copies[2], v_scale=copies[3], backend="reference"))
        out, want = ((result[0], expected[0]) if problem.options.get("return_lse") else (result, expected))
        for name, cache, wanted in zip(("k_cache", "v_cache", "k_scale", "v_scale"), caches, copies):
            if not np.array_equal(cache, wanted, equal_nan=True):
                return f"{name} after the call differs from the reference call's"
        keys = problem.k_cache.shape[1] * (1 if problem.block_table is None else problem.block_table.shape[1])
        magnitude = 4 * (1 + np.abs(problem.q).sum(-1).max()) * (1 + np.nanmax(np.abs(k_scale), initial=0) * 127)
        return close(out, want, problem.dtype, keys + 16, magnitude)
    return Call("attention_with_kvcache quantized", label, lambda: npattn.attention_with_kvcache(**arguments), names,
                lambda: snapshot(*watched), verify)


# ---- PagedKVCache.attend ---------------------------------------------------------------------------

def _pool(rng, most_pages):
    """``(pool, dtype, heads, kv_heads, head_dim, sequences)``: an empty float32 PagedKVCache of
    2 to ``most_pages`` pages and the names of 1-3 sequences to put in it."""
    dtype = np.float32
    kv_heads, head_dim = int(rng.integers(1, 3)), int(rng.integers(1, 5))
    heads = kv_heads * int(rng.integers(1, 3))
    pool = PagedKVCache(num_pages=int(rng.integers(2, most_pages + 1)), page_size=int(rng.integers(1, 4)),
                        num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    return pool, dtype, heads, kv_heads, head_dim, [f"s{i}" for i in range(int(rng.integers(1, 4)))]


def paged_pool_call(rng) -> Call:
    pool, dtype, heads, kv_heads, head_dim, sequences = _pool(rng, 7)
    for name in sequences:  # some history: a few steps each, while pages last
        pool.add(name)
        for _ in range(int(rng.integers(0, 3))):
            one = rng.standard_normal((1, 1, kv_heads, head_dim)).astype(dtype)
            if pool.free_pages * pool.page_size + (-pool.length(name)) % pool.page_size < 2:
                break
            pool.attend([name], rng.standard_normal((1, 1, heads, head_dim)).astype(dtype), one, one)
    step = [name for name in sequences if rng.random() < 0.7] or sequences[:1]
    batch, new = len(step), int(rng.integers(0, 3))
    q = rng.standard_normal((batch, 1, heads, head_dim)).astype(dtype)
    k = rng.standard_normal((batch, new, kv_heads, head_dim)).astype(dtype)
    v = rng.standard_normal((batch, new, kv_heads, head_dim)).astype(dtype)
    arguments = dict(q=q, k=k, v=v)
    names = ()
    label = "valid"
    needed = sum(max(0, -(-(pool.length(s) + new) // pool.page_size) - len(pool.block_table([s])[0]))
                 for s in step)
    if needed > pool.free_pages:
        names, label = ("PagedKVCache",), "more pages than free"
    elif rng.random() < 0.5:
        mutations = [
            (("sequences", "PagedKVCache"), lambda: step.append("nobody")),
            (("sequences",), lambda: step.append(step[0])),
            (("k",), lambda: arguments.update(k=k.astype(np.float64))),
            (("k",), lambda: arguments.update(k=k[:, :, :1] if kv_heads > 1 else k[..., :0])),
            (("k", "v"), lambda: arguments.update(v=None)),
            (("window",), lambda: arguments.update(window=-2)),
            (("q",), lambda: arguments.update(q=q[0])),
            (("causal",), lambda: arguments.update(causal="top_left")),
            (("layout",), lambda: arguments.update(layout="bhsd")),
        ]
        names, mutate = mutations[rng.integers(len(mutations))]
        mutate()
        label = f"broken in {names[0]}"
    if names == ("PagedKVCache",):
        names = ("PagedKVCache", "pages")

    def state():
        return pool_state(pool, q, k, v)

    def verify(result):
        keys, values = pool.keys, pool.values
        for b, name in enumerate(step):
            length = pool.length(name)
            table = pool.block_table([name])[0]
            gathered_k = np.array([keys[table[t // pool.page_size], t % pool.page_size] for t in range(length)],
                                  np.float64).reshape(length, kv_heads, head_dim)
            gathered_v = np.array([values[table[t // pool.page_size], t % pool.page_size] for t in range(length)],
                                  np.float64).reshape(length, kv_heads, head_dim)
            if new and not np.array_equal(gathered_k[length - new:], k[b]):
                return f"sequence {b}'s new keys are not in its pages"
            want, _ = oracle(q[b], gathered_k, gathered_v, {}, length - 1)
            text = close(result[b], want, dtype, length + head_dim, 4 * (1 + np.abs(gathered_v).max(initial=0)) * (
                1 + head_dim * np.abs(q).max() * max(np.abs(gathered_k).max(initial=0), 1)))
            if text:
                return f"out of sequence {b} {text}"
        return None

    return Call("PagedKVCache.attend", label, lambda: pool.attend(step, **arguments), names, state, verify)


def pool_state(pool, *arrays) -> list:
    """What a failing call must leave as it was: the pool's free pages, each sequence's
    pages and length, and the bytes of its keys and values (codes and scales of a
    quantized pool) and of ``arrays`` (the call's own)."""
    tables = {s: pool.block_table([s]).tolist() for s in pool.sequences}
    stored = (pool.keys, pool.values) + (() if pool.key_scales is None else (pool.key_scales, pool.value_scales))
    return [pool.free_pages, tables, {s: pool.length(s) for s in pool.sequences}, snapshot(*stored, *arrays)]


def _add_with_history(rng, pool, sequences, heads, dtype) -> None:
    """Add ``sequences`` to ``pool``, most with one token of history while pages last."""
    kv_heads, head_dim = pool.num_kv_heads, pool.head_dim
    for name in sequences:
        pool.add(name)
        if pool.free_pages * pool.page_size >= 2 and rng.random() < 0.6:
            one = rng.standard_normal((1, kv_heads, head_dim)).astype(dtype)
            pool.attend_varlen([name], rng.standard_normal((1, heads, head_dim)).astype(dtype), one, one,
                               np.array([0, 1]))


def _varlen_step(rng, pool, sequences, heads, dtype) -> tuple:
    """One attend_varlen step on ``pool``: ``(step, counts, q, k, v, cu, arguments, short)``,
    some of ``sequences`` with 0 (nothing new), 1 (a decode token) or more (a chunk) new
    tokens each, the call's keyword arguments, and whether the pool has too few free pages."""
    step = [name for name in sequences if rng.random() < 0.7] or sequences[:1]
    counts = [int(rng.integers(0, 4)) for _ in step]
    total, kv_heads, head_dim = sum(counts), pool.num_kv_heads, pool.head_dim
    q = rng.standard_normal((total, heads, head_dim)).astype(dtype)
    k = rng.standard_normal((total, kv_heads, head_dim)).astype(dtype)
    v = rng.standard_normal((total, kv_heads, head_dim)).astype(dtype)
    cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    needed = sum(max(0, -(-(pool.length(s) + n) // pool.page_size) - len(pool.block_table([s])[0]))
                 for s, n in zip(step, counts))
    return step, counts, q, k, v, cu, dict(q=q, k=k, v=v, cu_seqlens=cu, causal=True), needed > pool.free_pages


def paged_pool_varlen_call(rng) -> Call:
    """PagedKVCache.attend_varlen: prefill chunks and decode tokens of several sequences in
    one call (a packed paged attention_varlen over the pool)."""
    pool, dtype, heads, kv_heads, head_dim, sequences = _pool(rng, 8)
    _add_with_history(rng, pool, sequences, heads, dtype)
    step, counts, q, k, v, cu, arguments, short = _varlen_step(rng, pool, sequences, heads, dtype)
    names, label = (), "valid"
    if short:
        names, label = ("PagedKVCache", "pages"), "more pages than free"
    elif rng.random() < 0.5:
        mutations = [
            (("sequences", "PagedKVCache"), lambda: step.append("nobody")),
            (("sequences",), lambda: step.append(step[0])),
            (("k",), lambda: arguments.update(k=k.astype(np.float64))),
            (("v",), lambda: arguments.update(v=v[:, :, :0])),
            (("cu_seqlens",), lambda: arguments.update(cu_seqlens=cu + 1)),  # not from 0
            (("cu_seqlens",), lambda: arguments.update(cu_seqlens=cu[:-1])),
            (("window",), lambda: arguments.update(window=-2)),
            (("q_lengths",), lambda: arguments.update(q_lengths=np.zeros(len(step), np.int64))),
            (("rotary_cos",), lambda: arguments.update(rotary_cos=np.ones(3), rotary_sin=np.ones(3))),
        ]
        names, mutate = mutations[rng.integers(len(mutations))]
        mutate()
        label = f"broken in {names[0]}"

    def state():
        return pool_state(pool, q, k, v, cu)

    def verify(result):
        keys, values = pool.keys, pool.values
        for b, name in enumerate(step):
            rows, length = slice(int(cu[b]), int(cu[b + 1])), pool.length(name)
            if not counts[b]:
                continue
            table = pool.block_table([name])[0]
            gathered_k = np.array([keys[table[t // pool.page_size], t % pool.page_size] for t in range(length)],
                                  np.float64).reshape(length, kv_heads, head_dim)
            gathered_v = np.array([values[table[t // pool.page_size], t % pool.page_size] for t in range(length)],
                                  np.float64).reshape(length, kv_heads, head_dim)
            if not np.array_equal(gathered_k[length - counts[b]:], k[rows]):
                return f"sequence {b}'s new keys are not in its pages"
            want, _ = oracle(q[rows], gathered_k, gathered_v, {"causal": True}, length - counts[b])
            text = close(result[rows], want, dtype, length + head_dim, 4 * (1 + np.abs(gathered_v).max(initial=0)) * (
                1 + head_dim * np.abs(q).max() * max(np.abs(gathered_k).max(initial=0), 1)))
            if text:
                return f"out of sequence {b} {text}"
        return None

    return Call("PagedKVCache.attend_varlen", label, lambda: pool.attend_varlen(step, **arguments), names, state,
                verify)


def quantized_pool_varlen_call(rng) -> Call:
    """PagedKVCache.attend_varlen on an int8 or float8 e4m3 pool (head dim 16): valid, or
    broken in one argument; the new keys must land as quantize_kv's codes and scales, and
    out be the float64 attention over the pool dequantized."""
    from npattn.core.quantization import quantize_rows

    kind = ["int8", "float8_e4m3"][rng.integers(2)]
    kv_heads, head_dim = int(rng.integers(1, 3)), 16
    heads = kv_heads * int(rng.integers(1, 3))
    pool = PagedKVCache(num_pages=int(rng.integers(2, 9)), page_size=int(rng.integers(1, 4)), num_kv_heads=kv_heads,
                        head_dim=head_dim, dtype=kind)
    sequences = [f"s{i}" for i in range(int(rng.integers(1, 4)))]
    _add_with_history(rng, pool, sequences, heads, np.float32)
    step, counts, q, k, v, cu, arguments, short = _varlen_step(rng, pool, sequences, heads, np.float32)
    names, label = (), "valid"
    if short:
        names, label = ("PagedKVCache", "pages"), "more pages than free"
    elif rng.random() < 0.5:
        mutations = [
            (("sequences", "PagedKVCache"), lambda: step.append("nobody")),
            (("k",), lambda: arguments.update(k=k.astype(np.float64))),
            (("k",), lambda: arguments.update(k=k.astype(np.int8))),
            (("v",), lambda: arguments.update(v=v[:, :, :8])),
            (("cu_seqlens",), lambda: arguments.update(cu_seqlens=cu[:-1])),
            (("window",), lambda: arguments.update(window=-2)),
            (("backend",), lambda: arguments.update(backend="gpu")),
        ]
        names, mutate = mutations[rng.integers(len(mutations))]
        mutate()
        label = f"broken in {names[0]}"

    def state():
        return pool_state(pool, q, k, v, cu)

    def gathered(codes, scales, table, length):
        rows = [(table[t // pool.page_size], t % pool.page_size) for t in range(length)]
        return (np.array([codes[r] for r in rows]).reshape(length, kv_heads, head_dim),
                np.array([scales[r] for r in rows], np.float32).reshape(length, kv_heads))

    def verify(result):
        for b, name in enumerate(step):
            rows, length = slice(int(cu[b]), int(cu[b + 1])), pool.length(name)
            if not counts[b]:
                continue
            table = pool.block_table([name])[0]
            k_codes, k_scales = gathered(pool.keys, pool.key_scales, table, length)
            v_codes, v_scales = gathered(pool.values, pool.value_scales, table, length)
            for (codes, scales), new in (((k_codes, k_scales), k[rows]), ((v_codes, v_scales), v[rows])):
                want_codes, want_scales = quantize_rows(new, pool.keys.dtype)
                if not (np.array_equal(codes[length - counts[b]:], want_codes)
                        and np.array_equal(scales[length - counts[b]:], want_scales)):
                    return f"sequence {b}'s new keys are not quantize_kv's codes and scales in its pages"
            keys = npattn.dequantize_kv(k_codes, k_scales, np.float64)
            values = npattn.dequantize_kv(v_codes, v_scales, np.float64)
            want, _ = oracle(q[rows], keys, values, {"causal": True}, length - counts[b])
            text = close(result[rows], want, np.float32, length + head_dim, 4 * (1 + np.abs(values).max(initial=0)) * (
                1 + head_dim * np.abs(q).max() * max(np.abs(keys).max(initial=0), 1)))
            if text:
                return f"out of sequence {b} {text}"
        return None

    return Call("PagedKVCache.attend_varlen quantized", label, lambda: pool.attend_varlen(step, **arguments), names,
                state, verify)


# ---- attention_varlen ------------------------------------------------------------------------------

def varlen_call(rng) -> Call:
    dtype = np.dtype([np.float32, np.float64][rng.integers(2)])
    sequences = int(rng.integers(1, 4))
    lengths_q, lengths_k = rng.integers(0, 5, sequences), rng.integers(0, 6, sequences)
    kv_heads = int(rng.integers(1, 3))
    heads, head_dim, value_dim = kv_heads * int(rng.integers(1, 3)), int(rng.integers(1, 6)), int(rng.integers(1, 6))
    cu_q, cu_k = np.concatenate([[0], np.cumsum(lengths_q)]), np.concatenate([[0], np.cumsum(lengths_k)])
    q = rng.standard_normal((cu_q[-1], heads, head_dim)).astype(dtype)
    k = rng.standard_normal((cu_k[-1], kv_heads, head_dim)).astype(dtype)
    v = rng.standard_normal((cu_k[-1], kv_heads, value_dim)).astype(dtype)
    options = _options(rng, heads, sequences)
    if rng.random() < 0.2:
        options["q_offset"] = rng.integers(-3, 6, sequences) if rng.random() < 0.5 else int(rng.integers(-3, 6))
    arguments = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **options)
    names, label = (), "valid"
    if rng.random() < 0.5:
        mutations = [
            (("q",), lambda: arguments.update(q=q[:, 0])),
            (("k", "v"), lambda: arguments.update(k=k[:-1]) if len(k) else arguments.update(k=k[None])),
            (("cu_seqlens_q",), lambda: arguments.update(cu_seqlens_q=np.concatenate([cu_q[:-1], cu_q[-1:] + 1]))),
            (("cu_seqlens_q",), lambda: arguments.update(cu_seqlens_q=cu_q + 1)),
            (("cu_seqlens_q",), lambda: arguments.update(cu_seqlens_q=cu_q.astype(np.float32))),
            (("cu_seqlens_k",), lambda: arguments.update(cu_seqlens_k=np.array([0, 2**64 - 1], np.uint64))),
            (("cu_seqlens_q", "cu_seqlens_k"), lambda: arguments.update(cu_seqlens_k=np.concatenate([cu_k, cu_k[-1:]]))),
            (("q_offset",), lambda: arguments.update(q_offset=1.5)),
            (("q_offset",), lambda: arguments.update(q_offset=2**63)),
            (("q_offset",), lambda: arguments.update(q_offset=np.zeros(sequences + 1, np.int64))),
            (("max_seqlen_q",), lambda: arguments.update(max_seqlen_q="7")),
            (("max_seqlen_k",), lambda: arguments.update(max_seqlen_k=-1)),
            (("mask",), lambda: arguments.update(mask=np.ones((1,), bool))),
            (("return_weights",), lambda: arguments.update(return_weights=True)),
            (("alibi_slopes",), lambda: arguments.update(alibi_slopes=np.ones((sequences + 1, heads)))),
            (("window",), lambda: arguments.update(window=-1)),
            (("dropout_p",), lambda: arguments.update(dropout_p="0.1")),
            (("dropout_p",), lambda: arguments.update(dropout_p=np.array([0.1, 0.2]))),
            (("dropout_offset",), lambda: arguments.update(dropout_offset="x")),
            (("is_causal", "causal"), lambda: arguments.update(is_causal=True)),
        ]
        if max(lengths_q) > 0:
            mutations.append((("max_seqlen_q",), lambda: arguments.update(max_seqlen_q=int(max(lengths_q)) - 1)))
        names, mutate = mutations[rng.integers(len(mutations))]
        mutate()
        label = f"broken in {names[0]}"

    def verify(result):
        out, lse = result if options.get("return_lse") else (result, None)
        for b in range(sequences):
            q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
            if q1 == q0:
                continue
            per = dict(options)
            if np.ndim(per.get("alibi_slopes")) == 2:
                per["alibi_slopes"] = per["alibi_slopes"][b]
            offset = per.pop("q_offset", None)
            offset = (k1 - k0) - (q1 - q0) if offset is None else int(np.broadcast_to(offset, sequences)[b])
            want_out, want_lse = oracle(q[q0:q1], k[k0:k1], v[k0:k1], per, int(offset))
            magnitude = 4 * (1 + np.abs(v).max(initial=0)) * (1 + head_dim * np.abs(q).max(initial=0) * max(
                np.abs(k).max(initial=0), 1))
            text = close(out[q0:q1], want_out, dtype, int(k1 - k0) + head_dim, magnitude)
            if text:
                return f"out of sequence {b} {text}"
            if lse is not None:
                text = close(lse[:, q0:q1], want_lse, np.float64 if dtype == np.float64 else np.float32,
                             int(k1 - k0) + head_dim, magnitude)
                if text:
                    return f"lse of sequence {b} {text}"
        return None

    watched = [value for value in arguments.values() if isinstance(value, np.ndarray)]
    return Call("attention_varlen", label, lambda: npattn.attention_varlen(**arguments), names,
                lambda: snapshot(*watched), verify)


# ---- the framework adapters ---------------------------------------------------------------------

def torch_call(rng) -> Call | None:
    try:
        import torch

        import npattn.torch  # noqa: F401  (an attribute of npattn anyway; imported for older versions)
    except ImportError:
        return None
    q = torch.from_numpy(rng.standard_normal((1, 2, 3, 4)).astype(np.float32))
    grad = bool(rng.random() < 0.5)
    qt = q.clone().requires_grad_(grad)
    valid = [("window=np.array(1)", dict(window=np.array(1)), dict(window=1)),
             ("q_offset=torch.tensor(1)", dict(q_offset=torch.tensor(1)), dict(q_offset=1)),
             ("causal, lse", dict(causal=True, return_lse=True), dict(causal=True, return_lse=True))]
    broken = [(("scale",), dict(scale=float("inf"))), (("softcap",), dict(softcap=float("nan"))),
              (("window",), dict(window=-1)), (("causal",), dict(causal="maybe")),
              (("window",), dict(window=object())), (("q_offset",), dict(q_offset=torch.tensor([1.5]))),
              (("attn_mask", "mask"), dict(attn_mask=torch.ones(3, 3, dtype=torch.bool)))]
    if rng.random() < 0.25:  # the kv-cache call with a cache autograd records
        cache = torch.zeros(1, 8, 1, 4, requires_grad=True)
        new = torch.ones(1, 1, 1, 4)
        return Call("npattn.torch", "kv-cache call on a cache that requires grad",
                    lambda: npattn.attention_with_kvcache(torch.ones(1, 1, 2, 4), cache, torch.zeros(1, 8, 1, 4), new,
                                                          new, cache_seqlens=0), ("k_cache",), lambda: snapshot(cache))
    if rng.random() < 0.5:
        label, given, plain = valid[rng.integers(len(valid))]

        def verify(result):
            expected = npattn.attention(q.numpy(), q.numpy(), q.numpy(), **plain)
            for got, want in zip(result if isinstance(result, tuple) else (result,),
                                 expected if isinstance(expected, tuple) else (expected,)):
                if not isinstance(got, torch.Tensor) or not np.array_equal(got.detach().numpy(), want):
                    return "the tensor call differs from the NumPy call"
            return None
        return Call("npattn.torch", label, lambda: npattn.torch.attention(qt, qt, qt, **given), (),
                    lambda: snapshot(qt), verify)
    names, given = broken[rng.integers(len(broken))]
    entry = npattn.torch.attention if grad else npattn.attention
    return Call("npattn.torch", f"broken in {names[0]}", lambda: entry(qt, qt, qt, **given), names,
                lambda: snapshot(qt))


def jax_call(rng) -> Call | None:
    try:
        import jax
        import jax.numpy as jnp

        import npattn.jax  # noqa: F401
    except ImportError:
        return None
    q = jnp.asarray(rng.standard_normal((1, 2, 3, 4)).astype(np.float32))
    jit = bool(rng.random() < 0.5)
    broken = [(("window",), (q, q, q), dict(window=-1)), (("causal",), (q, q, q), dict(causal="maybe")),
              (("scale",), (q, q, q), dict(scale=float("nan"))), (("q",), (q[0], q, q), {}),
              (("q",), (q.astype(jnp.int32), q, q), {}), (("k", "q"), (q, q.astype(jnp.float16), q), {}),
              (("layout",), (q, q, q), dict(layout="bhds"))]
    if rng.random() < 0.4:
        options = dict(causal=True, window=int(rng.integers(0, 3)))

        def verify(result):
            expected = npattn.attention(np.asarray(q), np.asarray(q), np.asarray(q), **options)
            if not np.array_equal(np.asarray(result), expected):
                return "the JAX call differs from the NumPy call"
            return None
        run = (jax.jit(lambda x: npattn.jax.attention(x, x, x, **options)) if jit else
               (lambda x: npattn.jax.attention(x, x, x, **options)))
        return Call("npattn.jax", "valid", lambda: run(q), (), lambda: None, verify)
    if rng.random() < 0.15:
        return Call("npattn.jax", "traced q_offset",
                    lambda: jax.jit(lambda x, o: npattn.jax.attention(x, x, x, q_offset=o))(q, jnp.array([1])),
                    ("q_offset",))
    names, arrays, options = broken[rng.integers(len(broken))]
    if jit:
        return Call("npattn.jax", f"jit, broken in {names[0]}",
                    lambda: jax.jit(lambda *x: npattn.jax.attention(*x, **options))(*arrays), names)
    return Call("npattn.jax", f"broken in {names[0]}", lambda: npattn.jax.attention(*arrays, **options), names)


SURFACES = ((kvcache_call, 0.4), (quantized_kvcache_call, 0.15), (paged_pool_call, 0.15), (paged_pool_varlen_call, 0.1),
            (quantized_pool_varlen_call, 0.08), (varlen_call, 0.2),
            (torch_call, 0.1), (jax_call, 0.05))


def fuzz(calls: int, seed: int) -> Tally:
    """``calls`` drawn calls from ``seed``, classified."""
    rng = np.random.default_rng(seed)
    tally = Tally()
    makers, weights = zip(*SURFACES)
    weights = np.array(weights) / sum(weights)
    made = 0
    with np.errstate(all="ignore"):
        while made < calls:
            call = makers[rng.choice(len(makers), p=weights)](rng)
            if call is None:  # a framework that is not installed
                continue
            classify(call, tally)
            made += 1
    return tally


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    arguments = parser.parse_args(argv)
    tally = fuzz(arguments.calls, arguments.seed)
    print(tally.table())
    return 1 if tally.faults else 0


if __name__ == "__main__":
    sys.path.insert(0, __import__("os").path.dirname(__file__))
    sys.exit(main())
