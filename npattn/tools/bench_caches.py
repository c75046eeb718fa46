"""``python -m npattn bench --caches``: one decode step against caches of each dtype, side by side.

A decode step is memory-bound: the kernel streams every cached key and value once. The
rows time ``attention_with_kvcache`` (one query row per sequence, no append, causal)
against the same keys held as float32, float16 (q float16 too), and float8 e4m3 or int8
codes with float32 scales (q float32), interleaved in one process, and report each against int8
(the median of the per-round ratios) and the bytes each step reads per second.

Shapes: (B, H / Hkv, Sk, D) = (1, 32 / 8, 16384, 128) and (16, 32 / 8, 2048, 128).

With ``--gpu`` (:func:`compare_gpu`) the caches are CuPy arrays and q is float16 for
every cache (the tensor-core forward, which dequantizes the codes as it stages its
tiles): float16, float8 e4m3 and int8 caches, each step planned once
(:func:`npattn.plan_with_kvcache`) and timed by CUDA events around each run (median of
``GPU_RUNS`` per round; the host's work between the launches is inside that time), with
torch's float16 SDPA over the same keys beside them where torch is installed.
"""
from __future__ import annotations

import sys

import numpy as np

from ..adapters.dispatch import attention_with_kvcache
from ..core.quantization import code_dtype, quantize_rows
from .timing import elapsed, interleaved_samples

SHAPES = ((1, 32, 8, 16384, 128), (16, 32, 8, 2048, 128))
CACHES = ("float32", "float16", "float8_e4m3", "int8")
GPU_CACHES = ("float16", "float8_e4m3", "int8")
GPU_RUNS = 20  # device-timed runs per round on the GPU


def cache_arrays(shape, cache: str, rng, q_dtype=None, xp=np):
    """q, k_cache, v_cache (bshd, k and v of ``cache`` dtype; q of ``q_dtype``, default
    the cache's, float32 for codes), the scales' keywords, and the bytes of cache a step
    reads, as arrays of ``xp``."""
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
    q = q.astype(q_dtype or q.dtype)
    if xp is not np:
        q, k, v = (xp.asarray(x) for x in (q, k, v))
        scales = {name: xp.asarray(x) for name, x in scales.items()}
    return q, k, v, scales, read


def _step(shape, cache: str, rng):
    """A callable running one decode step on a cache of ``cache`` dtype, and the bytes of
    cache it reads."""
    q, k, v, scales, read = cache_arrays(shape, cache, rng)
    return (lambda: attention_with_kvcache(q, k, v, cache_seqlens=shape[3], causal=True, **scales)), read


def compare(repeats: int = 5, shapes=SHAPES, out=sys.stdout) -> dict:
    """Print and return ``{shape: {cache dtype: (median ms, speed-up of int8 over it)}}``."""
    rng = np.random.default_rng(0)
    results = {}
    print(f"npattn decode steps by cache dtype, CPU, median of {repeats} interleaved rounds (causal, no append)",
          file=out)
    print(f"{'(B, H/Hkv, Sk, D)':<24} {'cache':<12} {'ms':>8} {'GB/s read':>10} {'int8 is faster by':>18}", file=out)
    for shape in shapes:
        steps = {cache: _step(shape, cache, rng) for cache in CACHES}
        samples = interleaved_samples({cache: run for cache, (run, _) in steps.items()}, repeats, elapsed)
        reads = {cache: read for cache, (_, read) in steps.items()}
        results[_label(shape)] = _print_rows(_label(shape), samples, reads, 1e3, ".2f", out)
    return results


def _label(shape) -> str:
    return f"({shape[0]}, {shape[1]}/{shape[2]}, {shape[3]}, {shape[4]})"


def _print_rows(label, samples, reads, unit, spec, out) -> dict:
    """Print a shape's rows (each cache's median time in seconds times ``unit``, formatted
    by ``spec``; the bytes of ``reads`` per second; int8's speed-up over it) and return
    ``{cache: (median time in the unit, speed-up of int8 over it)}``."""
    rows = {}
    for cache in samples:
        seconds = float(np.median(samples[cache]))
        ratio = float(np.median(samples[cache] / samples["int8"]))
        rows[cache] = (seconds * unit, ratio)
        name = "torch f16" if cache == "torch" else cache
        print(f"{label:<24} {name:<12} {format(seconds * unit, spec):>8} {reads[cache] / seconds / 1e9:>10.1f} "
              f"{ratio:>17.2f}x", file=out)
    return rows


def compare_gpu(repeats: int = 5, shapes=SHAPES, out=sys.stdout) -> dict:
    """:func:`compare` on the GPU (CuPy arrays, q float16, CUDA-event time around each
    planned step, so the host's launches are inside it; ``.ci/gpu_cache_kernels.py``
    replays the steps in CUDA graphs for the device's time alone):
    ``{shape: {cache dtype or "torch": (median us, speed-up of int8 over it)}}``."""
    import cupy
    from cupyx.profiler import benchmark

    from ..serving.kvcache import plan_with_kvcache

    def device_seconds(run):
        return float(np.median(benchmark(run, n_repeat=GPU_RUNS, n_warmup=2).gpu_times))

    rng = np.random.default_rng(0)
    results = {}
    print(f"npattn decode steps by cache dtype, {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, "
          f"q float16, CUDA-event time around each step (the host's launches inside), median of {repeats} "
          f"interleaved rounds of {GPU_RUNS} (causal, no append)",
          file=out)
    print(f"{'(B, H/Hkv, Sk, D)':<24} {'cache':<12} {'us':>8} {'GB/s read':>10} {'int8 is faster by':>18}", file=out)
    for shape in shapes:
        steps, reads = {}, {}
        for cache in GPU_CACHES:
            q, k, v, scales, reads[cache] = cache_arrays(shape, cache, rng, np.float16, cupy)
            plan = plan_with_kvcache(q, k, v, cache_seqlens=shape[3], causal=True, **scales)
            steps[cache] = (lambda plan=plan, arrays=(q, k, v), scales=scales: plan.run(*arrays, **scales))
        torch_step = _torch_step(shape, rng)
        if torch_step is not None:
            steps["torch"], reads["torch"] = torch_step, reads["float16"]
        samples = interleaved_samples(steps, repeats, device_seconds)
        results[_label(shape)] = _print_rows(_label(shape), samples, reads, 1e6, ".1f", out)
    return results


def _torch_step(shape, rng):
    """torch's float16 SDPA over a float16 cache of ``shape`` on the GPU, or None without
    torch (a measurement only: npattn never needs torch)."""
    try:
        import torch
    except ImportError:
        return None
    batch, heads, kv_heads, keys, dim = shape
    q, k, v = (torch.from_numpy(rng.standard_normal(size, dtype=np.float32)).to("cuda", torch.float16)
               for size in ((batch, heads, 1, dim), (batch, kv_heads, keys, dim), (batch, kv_heads, keys, dim)))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return lambda: sdpa(q, k, v, enable_gqa=heads != kv_heads)
