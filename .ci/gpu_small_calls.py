"""Host time of small planned calls on the GPU (run by .ci/gpu-session): a (1, 8, 16x16, 64)
causal call and a GQA decode step against 40 keys, planned and through ``attention``,
beside torch's SDPA on the same small call. Median of 300 calls, each ending with a
synchronize."""
import time

import cupy
import numpy as np

import npattn


def median_us(run, count=300):
    run()
    cupy.cuda.get_current_stream().synchronize()
    times = []
    for _ in range(count):
        start = time.perf_counter()
        run()
        cupy.cuda.get_current_stream().synchronize()
        times.append(time.perf_counter() - start)
    return 1e6 * float(np.median(times))


rng = cupy.random.default_rng(0)
for name, (q_shape, kv_shape) in {"(1,8,16x16,64) causal": ((1, 8, 16, 64), (1, 8, 16, 64)),
                                  "decode (1,8/2,1x40,64)": ((1, 8, 1, 64), (1, 2, 40, 64))}.items():
    q = rng.standard_normal(q_shape, np.float32).astype(np.float16)
    k, v = (rng.standard_normal(kv_shape, np.float32).astype(np.float16) for _ in range(2))
    plan = npattn.plan(q, k, v, causal=True)
    print(f"{name}: planned {median_us(lambda: plan.run(q, k, v)):.1f} us, attention "
          f"{median_us(lambda: npattn.attention(q, k, v, causal=True)):.1f} us")
try:
    import torch

    tq = torch.randn(1, 8, 16, 64, device="cuda", dtype=torch.float16)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    print(f"torch SDPA (1,8,16x16,64) causal: {median_us(lambda: sdpa(tq, tq, tq, is_causal=True)):.1f} us")
except Exception as error:  # report, do not stop the session
    print("torch:", error)

# where a planned small call's host time goes: 300 calls under cProfile
import cProfile  # noqa: E402
import pstats  # noqa: E402

q = rng.standard_normal((1, 8, 16, 64), np.float32).astype(np.float16)
plan = npattn.plan(q, q, q, causal=True)
profiler = cProfile.Profile()
profiler.enable()
for _ in range(300):
    plan.run(q, q, q)
    cupy.cuda.get_current_stream().synchronize()
profiler.disable()
pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
