"""``python -m npattn bench --caches``: one decode step against caches of each dtype, side by side.

A decode step is memory-bound: the kernel streams every cached key and value once. The
rows time ``attention_with_kvcache`` (one query row per sequence, no append, causal)
against the same keys held as float32, float16 (q float16 too), and float8 e4m3 or int8
codes with float32 scales (q float32), interleaved in one process, and report each against int8
(the median of the per-round ratios) and the bytes each step reads per second.

Shapes: (B, H / Hkv, Sk, D) = (1, 32 / 8, 16384, 128) and (16, 32 / 8, 2048, 128).
"""
from __future__ import annotations

import sys

import numpy as np

from ..adapters.dispatch import attention_with_kvcache
from ..core.quantization import code_dtype, quantize_rows
from .timing import elapsed, interleaved_samples

SHAPES = ((1, 32, 8, 16384, 128), (16, 32, 8, 2048, 128))
CACHES = ("float32", "float16", "float8_e4m3", "int8")


def _step(shape, cache: str, rng):
    """A callable running one decode step on a cache of ``cache`` dtype, and the bytes of
    cache it reads."""
    batch, heads, kv_heads, keys, dim = shape
    k = rng.standard_normal((batch, keys, kv_heads, dim), dtype=np.float32)
    v = rng.standard_normal((batch, keys, kv_heads, dim), dtype=np.float32)
    q = rng.standard_normal((batch, 1, heads, dim), dtype=np.float32)
    if cache in ("int8", "float8_e4m3"):
        (k, k_scale), (v, v_scale) = quantize_rows(k, code_dtype(cache)), quantize_rows(v, code_dtype(cache))
        scales = dict(k_scale=k_scale, v_scale=v_scale)
        read = k.nbytes + v.nbytes + k_scale.nbytes + v_scale.nbytes
    else:
        k, v, q = k.astype(cache), v.astype(cache), q.astype(cache)
        scales = {}
        read = k.nbytes + v.nbytes
    return (lambda: attention_with_kvcache(q, k, v, cache_seqlens=keys, causal=True, **scales)), read


def compare(repeats: int = 5, shapes=SHAPES, out=sys.stdout) -> dict:
    """Print and return ``{shape: {cache dtype: (median ms, speed-up of int8 over it)}}``."""
    rng = np.random.default_rng(0)
    results = {}
    print(f"npattn decode steps by cache dtype, CPU, median of {repeats} interleaved rounds (causal, no append)",
          file=out)
    print(f"{'(B, H/Hkv, Sk, D)':<24} {'cache':<8} {'ms':>8} {'GB/s read':>10} {'int8 is faster by':>18}", file=out)
    for shape in shapes:
        steps = {cache: _step(shape, cache, rng) for cache in CACHES}
        samples = interleaved_samples({cache: run for cache, (run, _) in steps.items()}, repeats, elapsed)
        label = f"({shape[0]}, {shape[1]}/{shape[2]}, {shape[3]}, {shape[4]})"
        rows = {}
        for cache in CACHES:
            ms = float(np.median(samples[cache])) * 1e3
            ratio = float(np.median(samples[cache] / samples["int8"]))
            rows[cache] = (ms, ratio)
            gigabytes = steps[cache][1] / (ms / 1e3) / 1e9
            print(f"{label:<24} {cache:<8} {ms:>8.2f} {gigabytes:>10.1f} {ratio:>17.2f}x", file=out)
        results[label] = rows
    return results
