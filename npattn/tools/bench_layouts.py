"""``python -m npattn bench --layouts``: the serving layouts against their plain equivalents.

- A packed batch (:func:`npattn.attention_varlen`) of sequences of different lengths
  against the sum of calling npattn on each sequence alone (the target: at most 1.1x),
  and against the sum of torch SDPA calls on each sequence (torch's CPU has no packed
  call); and 256 packed sequences of 32 tokens against one dense (256, 32) batch.
- A decode step against a paged cache (:func:`npattn.attention_with_kvcache` with a
  ``block_table``) against the same step on a contiguous cache (the target: within
  10%), at two page sizes, and torch SDPA on the contiguous cache with a mask of each
  sequence's length.
- A decode step whose 32 sequences share a 4096-key prefix (``prefix_k`` / ``prefix_v``,
  read once for the batch) against the prefix copied in front of every sequence's keys,
  in pages of 16 (the target: at least 4x faster) and in a contiguous cache.
- A mixed batch, prefill chunks and decode steps in one paged ``attention_varlen`` call,
  against the same work as one prefill and one decode call (the target: at most 1.1x)
  and as one call per sequence.

Times are medians of interleaved runs (:mod:`npattn.tools.timing`), ratios medians of the
per-round ratios; ``gpu=True`` runs npattn on CuPy arrays (torch on CUDA) instead.
"""
from __future__ import annotations

import sys

import numpy as np

import npattn

from .bench import _repeated
from .timing import elapsed, interleaved_samples, settled_elapsed

# The packed batch: 8 sequences with lengths drawn from 64-2048 that add up to 8192
VARLEN_TOKENS, VARLEN_SEQUENCES, VARLEN_HEADS, VARLEN_DIM = 8192, 8, 16, 64
# Many short sequences of one length: (count, tokens each)
SHORT_SEQUENCES = (256, 32)
# The decode step: (B, H, Hkv, cached keys, D), page sizes timed
DECODE = (16, 32, 8, 2048, 128)
PAGE_SIZES = (256, 64, 16)
DECODE_CALLS = 10  # decode steps per timed run
# The shared prefix: (B, H, Hkv, prefix keys, most own keys, D) of one decode step, and the
# page size of the copied-prefix comparison
PREFIX = (32, 32, 8, 4096, 256, 128)
PREFIX_PAGE = 16
# The mixed batch: (prefill chunks, chunk length, keys before a chunk, decode steps, their
# fewest and most keys, H, Hkv, D, page size)
MIXED = (2, 512, 2048, 30, 512, 4096, 32, 8, 128, 16)


def varlen_lengths(seed: int = 0) -> np.ndarray:
    """VARLEN_SEQUENCES lengths in [64, 2048] adding up to VARLEN_TOKENS."""
    rng = np.random.default_rng(seed)
    while True:
        lengths = rng.integers(64, 2049, VARLEN_SEQUENCES - 1)
        last = VARLEN_TOKENS - int(lengths.sum())
        if 64 <= last <= 2048:
            return np.append(lengths, last)


def compare(repeats: int = 5, gpu: bool = False, out=sys.stdout) -> list[dict]:
    """Time both comparisons, print them, return their rows (times in ms)."""
    if gpu:
        import cupy as xp

        def synchronize():
            xp.cuda.get_current_stream().synchronize()
        time_one = elapsed
    else:
        xp = np
        synchronize = _nothing
        time_one = settled_elapsed
    torch = _torch(gpu)
    print(f"npattn {npattn.__version__} serving layouts, float32 on {'the GPU' if gpu else 'the CPU'}, "
          f"median of {repeats} interleaved runs; torch: {'not importable' if torch is None else torch.__version__}",
          file=out)
    rows = [_varlen(xp, torch, gpu, synchronize, time_one, repeats, out),
            _short_sequences(xp, synchronize, time_one, repeats, out)]
    rows += _paged_decode(xp, torch, gpu, synchronize, time_one, repeats, out)
    rows.append(_shared_prefix(xp, synchronize, time_one, repeats, out))
    rows.append(_mixed_batch(xp, synchronize, time_one, repeats, out))
    return rows


def _nothing():
    return None


def _torch(gpu: bool):
    try:
        import torch
    except ImportError:
        return None
    if gpu and not torch.cuda.is_available():
        return None
    return torch


def _timed(timed: dict, repeats: int, time_one, calls: int = 1) -> tuple[dict, dict]:
    """``(ms, samples)``: each run's median milliseconds per call and its per-round seconds
    (runs of ``calls`` calls each, for steps too short to time alone); ratios are taken
    as medians of per-round ratios, which cancel a round's drift (this VM's memory
    bandwidth moves by a third from minute to minute)."""
    samples = interleaved_samples({name: _repeated(run, calls) for name, run in timed.items()}, repeats, time_one)
    samples = {name: t / calls for name, t in samples.items()}
    return {name: 1e3 * float(np.median(t)) for name, t in samples.items()}, samples


def _ratio(samples: dict, name: str, base: str) -> float:
    return float(np.median(samples[name] / samples[base]))


def _varlen(xp, torch, gpu, synchronize, time_one, repeats, out) -> dict:
    lengths = varlen_lengths()
    starts = np.concatenate([[0], np.cumsum(lengths)])
    rng = np.random.default_rng(1)
    q, k, v = (xp.asarray(rng.standard_normal((VARLEN_TOKENS, VARLEN_HEADS, VARLEN_DIM), np.float32))
               for _ in range(3))
    alone = [(q[None, a:b], k[None, a:b], v[None, a:b]) for a, b in zip(starts[:-1], starts[1:])]

    def packed():
        npattn.attention_varlen(q, k, v, starts, starts, causal=True)
        synchronize()

    def each_alone():
        for qs, ks, vs in alone:
            npattn.attention(qs, ks, vs, causal=True, layout="bshd")
        synchronize()
    timed = {"packed": packed, "each alone": each_alone}
    if torch is not None:
        device = "cuda" if gpu else "cpu"
        tensors = [tuple(torch.as_tensor(np.asarray(x.get() if gpu else x)).to(device).transpose(1, 2)
                         for x in triple) for triple in alone]

        def torch_each():
            for qs, ks, vs in tensors:
                torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
            if gpu:
                torch.cuda.synchronize()
        timed["torch each"] = torch_each
    ms, samples = _timed(timed, repeats, time_one)
    row = dict(case="varlen", lengths=lengths.tolist(), packed_ms=ms["packed"], alone_ms=ms["each alone"],
               ratio=_ratio(samples, "packed", "each alone"), torch_ms=ms.get("torch each"),
               torch_ratio=_ratio(samples, "torch each", "packed") if "torch each" in samples else None)
    torch_text = "" if row["torch_ms"] is None else (f"; torch SDPA per sequence {row['torch_ms']:.1f} ms "
                                                       f"({row['torch_ratio']:.2f}x the packed call)")
    print(f"packed causal batch, lengths {lengths.tolist()} (H={VARLEN_HEADS}, D={VARLEN_DIM}): "
          f"{row['packed_ms']:.1f} ms against {row['alone_ms']:.1f} ms for each sequence alone, "
          f"{row['ratio']:.3f}x (target <= 1.1x){torch_text}", file=out)
    return row


def _short_sequences(xp, synchronize, time_one, repeats, out) -> dict:
    """Many short sequences of one length, packed, against the same batch as one dense
    (B, S, H, D) call: what a packed call costs beyond the work itself."""
    count, length = SHORT_SEQUENCES
    rng = np.random.default_rng(3)
    q, k, v = (xp.asarray(rng.standard_normal((count * length, VARLEN_HEADS, VARLEN_DIM), np.float32))
               for _ in range(3))
    starts = np.arange(count + 1) * length
    batched = [x.reshape(count, length, VARLEN_HEADS, VARLEN_DIM) for x in (q, k, v)]

    def packed():
        npattn.attention_varlen(q, k, v, starts, starts, causal=True)
        synchronize()

    def dense():
        npattn.attention(*batched, causal=True, layout="bshd")
        synchronize()
    ms, samples = _timed({"packed": packed, "dense": dense}, repeats, time_one)
    row = dict(case="short sequences", sequences=count, length=length, packed_ms=ms["packed"], dense_ms=ms["dense"],
               ratio=_ratio(samples, "packed", "dense"))
    print(f"{count} causal sequences of {length} tokens, packed: {row['packed_ms']:.1f} ms against "
          f"{row['dense_ms']:.1f} ms as one dense ({count}, {length}) batch, {row['ratio']:.3f}x", file=out)
    return row


def _paged_decode(xp, torch, gpu, synchronize, time_one, repeats, out) -> list[dict]:
    batch, heads, kv_heads, cached, dim = DECODE
    rng = np.random.default_rng(2)
    lengths = rng.integers(cached // 2, cached + 1, batch)  # per-sequence cache lengths
    q = xp.asarray(rng.standard_normal((batch, 1, heads, dim), np.float32))
    keys = rng.standard_normal((batch, cached, kv_heads, dim), np.float32)
    values = rng.standard_normal((batch, cached, kv_heads, dim), np.float32)
    k_cache, v_cache = xp.asarray(keys), xp.asarray(values)

    def contiguous():
        npattn.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True)
        synchronize()
    timed = {"contiguous": contiguous}
    for page_size in PAGE_SIZES:
        pool_k, pool_v, table = paged_copy(keys, values, page_size, rng)
        timed[f"paged {page_size}"] = _paged_run(xp.asarray(pool_k), xp.asarray(pool_v), xp.asarray(table), q,
                                                 lengths, synchronize)
    if torch is not None:
        device = "cuda" if gpu else "cpu"
        tq = torch.as_tensor(np.asarray(q.get() if gpu else q)).to(device).transpose(1, 2)
        tk, tv = (torch.as_tensor(x).to(device).transpose(1, 2) for x in (keys, values))
        mask = torch.as_tensor(np.arange(cached)[None, :] < lengths[:, None]).to(device)[:, None, None, :]

        def torch_contiguous():
            torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, enable_gqa=True)
            if gpu:
                torch.cuda.synchronize()
        timed["torch"] = torch_contiguous
    ms, samples = _timed(timed, repeats, time_one, calls=DECODE_CALLS)
    rows = []
    for page_size in PAGE_SIZES:
        name = f"paged {page_size}"
        rows.append(dict(case="paged decode", page_size=page_size, paged_ms=ms[name], contiguous_ms=ms["contiguous"],
                         ratio=_ratio(samples, name, "contiguous"), torch_ms=ms.get("torch")))
    torch_text = "" if "torch" not in ms else f"; torch SDPA, contiguous with a length mask, {ms['torch']:.3f} ms"
    print(f"decode step (B={batch}, H={heads}/{kv_heads}, cached {cached // 2}-{cached}, D={dim}): contiguous "
          f"cache {ms['contiguous']:.3f} ms; "
          + "; ".join(f"pages of {row['page_size']}: {row['paged_ms']:.3f} ms, {row['ratio']:.3f}x" for row in rows)
          + f" (target <= 1.1x){torch_text}", file=out)
    return rows


def _shared_prefix(xp, synchronize, time_one, repeats, out) -> dict:
    """A decode step whose sequences share a prompt prefix: ``prefix_k`` / ``prefix_v``
    (the prefix read once for the batch) against the prefix copied in front of every
    sequence's own keys, in pages (the target: >= 4x) and in a contiguous cache."""
    batch, heads, kv_heads, span, most, dim = PREFIX
    rng = np.random.default_rng(4)
    own = rng.integers(most // 4, most + 1, batch)
    q = xp.asarray(rng.standard_normal((batch, 1, heads, dim), np.float32))
    prefix_k, prefix_v = (rng.standard_normal((span, kv_heads, dim), np.float32) for _ in range(2))
    own_k, own_v = (rng.standard_normal((batch, most, kv_heads, dim), np.float32) for _ in range(2))
    copied_k, copied_v = (np.concatenate([np.broadcast_to(p[None], (batch, *p.shape)), c], axis=1)
                          for p, c in ((prefix_k, own_k), (prefix_v, own_v)))
    pool_k, pool_v, table = (xp.asarray(x) for x in paged_copy(copied_k, copied_v, PREFIX_PAGE, rng))
    shared_arrays = [xp.asarray(x) for x in (own_k, own_v, prefix_k, prefix_v)]
    copied_k, copied_v = xp.asarray(copied_k), xp.asarray(copied_v)

    def shared():
        npattn.attention_with_kvcache(q, *shared_arrays[:2], cache_seqlens=own, prefix_k=shared_arrays[2],
                                      prefix_v=shared_arrays[3], causal=True)
        synchronize()

    def copied_pages():
        npattn.attention_with_kvcache(q, pool_k, pool_v, cache_seqlens=own + span, block_table=table, causal=True)
        synchronize()

    def copied_contiguous():
        npattn.attention_with_kvcache(q, copied_k, copied_v, cache_seqlens=own + span, causal=True)
        synchronize()
    ms, samples = _timed({"shared": shared, "pages": copied_pages, "contiguous": copied_contiguous}, repeats,
                         time_one)
    row = dict(case="shared prefix", prefix=span, shared_ms=ms["shared"], pages_ms=ms["pages"],
               contiguous_ms=ms["contiguous"], speedup=_ratio(samples, "pages", "shared"),
               contiguous_speedup=_ratio(samples, "contiguous", "shared"))
    print(f"decode step sharing a {span}-key prefix (B={batch}, H={heads}/{kv_heads}, own keys {most // 4}-{most}, "
          f"D={dim}): {row['shared_ms']:.1f} ms with prefix_k/prefix_v against {row['pages_ms']:.1f} ms with the "
          f"prefix copied into every sequence's pages of {PREFIX_PAGE}, {row['speedup']:.2f}x (target >= 4x), and "
          f"{row['contiguous_ms']:.1f} ms copied into a contiguous cache, {row['contiguous_speedup']:.2f}x", file=out)
    return row


def _mixed_batch(xp, synchronize, time_one, repeats, out) -> dict:
    """Prefill chunks and decode steps in one paged ``attention_varlen`` call, against the
    same work as one prefill call and one decode call (the target: at most 1.1x) and as one
    call per sequence."""
    chunks, chunk, before, steps, fewest, most, heads, kv_heads, dim, page = MIXED
    rng = np.random.default_rng(5)
    keys = [chunk + before] * chunks + [int(n) for n in rng.integers(fewest, most + 1, steps)]
    rows = [chunk] * chunks + [1] * steps
    held = [-(-n // page) for n in keys]
    pool_k, pool_v = (xp.asarray(rng.standard_normal((sum(held), page, kv_heads, dim), np.float32)) for _ in range(2))
    order = rng.permutation(sum(held))
    table = np.zeros((len(keys), max(held)), np.int64)
    for b, start in enumerate(np.cumsum([0] + held[:-1])):
        table[b, :held[b]] = order[start:start + held[b]]
    cu = np.concatenate([[0], np.cumsum(rows)])
    used = np.array(keys)
    q = xp.asarray(rng.standard_normal((int(cu[-1]), heads, dim), np.float32))
    table_d = xp.asarray(table)
    prefill_q = q[:chunks * chunk].reshape(chunks, chunk, heads, dim)
    decode_q = q[chunks * chunk:].reshape(steps, 1, heads, dim)

    def mixed():
        npattn.attention_varlen(q, pool_k, pool_v, cu, seqused_k=used, block_table=table_d, causal=True)
        synchronize()

    def two_calls():
        npattn.attention_with_kvcache(prefill_q, pool_k, pool_v, cache_seqlens=used[:chunks],
                                      block_table=table_d[:chunks], causal=True)
        npattn.attention_with_kvcache(decode_q, pool_k, pool_v, cache_seqlens=used[chunks:],
                                      block_table=table_d[chunks:], causal=True)
        synchronize()

    def each():
        for b in range(len(keys)):
            npattn.attention_with_kvcache(q[None, int(cu[b]):int(cu[b + 1])], pool_k, pool_v,
                                          cache_seqlens=used[b:b + 1], block_table=table_d[b:b + 1], causal=True)
        synchronize()
    ms, samples = _timed({"mixed": mixed, "two calls": two_calls, "each": each}, repeats, time_one)
    row = dict(case="mixed batch", mixed_ms=ms["mixed"], two_calls_ms=ms["two calls"], each_ms=ms["each"],
               ratio=_ratio(samples, "mixed", "two calls"), each_ratio=_ratio(samples, "mixed", "each"))
    print(f"mixed batch ({chunks} prefill chunks of {chunk} after {before} keys, {steps} decode steps against "
          f"{fewest}-{most} keys, H={heads}/{kv_heads}, D={dim}, pages of {page}) in one paged attention_varlen call: "
          f"{row['mixed_ms']:.1f} ms against {row['two_calls_ms']:.1f} ms as one prefill and one decode call, "
          f"{row['ratio']:.3f}x (target <= 1.1x), and {row['each_ms']:.1f} ms as a call per sequence, "
          f"{row['each_ratio']:.3f}x", file=out)
    return row


def paged_copy(keys, values, page_size: int, rng):
    """``(pool_k, pool_v, block_table)``: (B, S, Hkv, D) keys and values as pools of pages
    of ``page_size`` keys, each sequence's pages scattered through the pool in a random
    order (S a multiple of ``page_size``)."""
    batch, length = keys.shape[:2]
    per_sequence = length // page_size
    table = rng.permutation(batch * per_sequence).reshape(batch, per_sequence)
    pools = []
    for cache in (keys, values):
        pool = np.empty((batch * per_sequence, page_size) + cache.shape[2:], cache.dtype)
        pool[table] = cache.reshape((batch, per_sequence, page_size) + cache.shape[2:])
        pools.append(pool)
    return pools[0], pools[1], table


def _paged_run(pool_k, pool_v, table, q, lengths, synchronize):
    def run():
        npattn.attention_with_kvcache(q, pool_k, pool_v, cache_seqlens=lengths, block_table=table, causal=True)
        synchronize()
    return run
