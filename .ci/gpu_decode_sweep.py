"""Decode steps' device time on a lent GPU under split-KV settings (issue 35's shapes):
for each shape and each (DECODE_TARGET_WARPS, MIN_KEY_TILES_PER_SPLIT) of the driver,
the planned call's device time (cupyx's benchmark: CUDA events around the call on the
stream, median of 100), K/V bytes read per second, the error against a float64 result
on the device, and torch SDPA's device time beside it. Usage:
  python .ci/gpu_decode_sweep.py LABEL [TARGET,MIN ...]     (default: the driver's own)
Prints a table and appends its rows to sweep.jsonl under $OUT (or the working directory)."""
import json
import os
import sys

import cupy
import numpy as np
from cupyx.profiler import benchmark

import npattn
from npattn.gpu import driver

SHAPES = {  # (B, H, Hkv, keys), D = 128, one query row
    "(8,32/8,1x8192,128)": (8, 32, 8, 8192),
    "(64,32/8,1x2048,128)": (64, 32, 8, 2048),
    "(16,32/8,1x2048,128)": (16, 32, 8, 2048),
    "(1,8/1,1x32768,128)": (1, 8, 1, 32768),
}
label = sys.argv[1] if len(sys.argv) > 1 else "default"
settings = [tuple(int(x) for x in arg.split(",")) for arg in sys.argv[2:]] or [
    (driver.DECODE_TARGET_WARPS, driver.MIN_KEY_TILES_PER_SPLIT)]


def device_us(run):
    return 1e6 * float(np.median(benchmark(run, n_repeat=100, n_warmup=10).gpu_times))


def reference(q, k, v):
    group = q.shape[1] // k.shape[1]
    k64 = cupy.repeat(k.astype(cupy.float64), group, axis=1)
    v64 = cupy.repeat(v.astype(cupy.float64), group, axis=1)
    scores = q.astype(cupy.float64) @ k64.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    weights = cupy.exp(scores - scores.max(-1, keepdims=True))
    return (weights / weights.sum(-1, keepdims=True)) @ v64


rng = cupy.random.default_rng(0)
rows = []
try:
    import torch
except ImportError:
    torch = None
print(f"{label}: {'shape':<24}{'target,min':>12}{'us':>9}{'GB/s':>8}{'rel err':>10}{'torch us':>10}{'GB/s':>8}")
for name, (batch, heads, kv_heads, keys) in SHAPES.items():
    q = rng.standard_normal((batch, heads, 1, 128), np.float32).astype(np.float16)
    k, v = (rng.standard_normal((batch, kv_heads, keys, 128), np.float32).astype(np.float16) for _ in range(2))
    expected = reference(q, k, v)
    kv_bytes = 2 * k.nbytes
    torch_us = float("nan")
    if torch is not None:
        tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        torch_us = device_us(lambda: sdpa(tq, tk, tv, enable_gqa=heads != kv_heads))
    for target, minimum in settings:
        driver.DECODE_TARGET_WARPS, driver.MIN_KEY_TILES_PER_SPLIT = target, minimum
        plan = npattn.plan(q, k, v)
        out = plan.run(q, k, v)
        error = float(cupy.linalg.norm((out - expected).ravel()) / cupy.linalg.norm(expected.ravel()))
        us = device_us(lambda: plan.run(q, k, v))
        row = dict(label=label, shape=name, target_warps=target, min_tiles=minimum, us=us,
                   gbps=kv_bytes / us / 1e3, error=error, torch_us=torch_us)
        rows.append(row)
        print(f"{label}: {name:<24}{f'{target},{minimum}':>12}{us:>9.1f}{row['gbps']:>8.0f}{error:>10.2e}"
              f"{torch_us:>10.1f}{kv_bytes / torch_us / 1e3:>8.0f}", flush=True)
with open(os.path.join(os.environ.get("OUT", "."), "sweep.jsonl"), "a") as file:
    file.writelines(json.dumps(row) + "\n" for row in rows)
