"""Where a planned kv-cache decode step's host time goes, on float16, int8 and float8
e4m3 caches (q float16, no append): cupyx's benchmark (CPU time to return, CUDA-event
time on the stream; median of 200) and a cProfile of 300 runs (the 15 functions with the
most time of their own). Usage: python .ci/gpu_step_profile.py [B H HKV KEYS D]"""
import cProfile
import io
import pstats
import sys

import cupy
import numpy as np
from cupyx.profiler import benchmark

import npattn

batch, heads, kv_heads, keys, dim = (int(x) for x in sys.argv[1:6]) if len(sys.argv) > 5 else (16, 32, 8, 2048, 128)
rng = np.random.default_rng(0)
q = cupy.asarray(rng.standard_normal((batch, 1, heads, dim), dtype=np.float32).astype(np.float16))
for cache in ("float16", "int8", "float8_e4m3"):
    k, v = (rng.standard_normal((batch, keys, kv_heads, dim), dtype=np.float32) for _ in range(2))
    if cache == "float16":
        k, v, scales = cupy.asarray(k.astype(np.float16)), cupy.asarray(v.astype(np.float16)), {}
    else:
        (k, ks), (v, vs) = npattn.quantize_kv(k, cache), npattn.quantize_kv(v, cache)
        k, v, scales = cupy.asarray(k), cupy.asarray(v), dict(k_scale=cupy.asarray(ks), v_scale=cupy.asarray(vs))
    plan = npattn.plan_with_kvcache(q, k, v, cache_seqlens=keys, causal=True, **scales)

    def step():
        plan.run(q, k, v, **scales)

    timed = benchmark(step, n_repeat=200, n_warmup=10)
    print(f"== {cache} ({batch}, {heads}/{kv_heads}, {keys}, {dim}): host {1e6 * np.median(timed.cpu_times):.1f} us, "
          f"device {1e6 * np.median(timed.gpu_times):.1f} us")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(300):
        step()
    cupy.cuda.get_current_stream().synchronize()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(15)
    print("\n".join(line for line in text.getvalue().splitlines()[6:] if line.strip())[:3000])
