"""Host time of small planned calls on the GPU (run by .ci/gpu-session): a (1, 8, 16x16, 64)
causal call and a GQA decode step against 40 keys, planned and through ``attention``,
beside torch's SDPA on the same small call. Median of 300 calls, each ending with a
synchronize. Then each planned call's host and device time apart (cupyx's benchmark:
CPU time to return, and CUDA-event time on the stream), also for three long decode steps,
beside torch's SDPA. (The host's check of out for NaN and inf, which these columns once
showed costing 56-87 us of a small call, is a kernel on the device since
npattn/gpu/repair.cu.)"""
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

# host and device time apart: cupyx.profiler.benchmark's CPU times (the call returning)
# and GPU times (events around it on the stream)
from cupyx.profiler import benchmark  # noqa: E402


def split_us(run, count=200):
    result = benchmark(run, n_repeat=count, n_warmup=10)
    return 1e6 * float(np.median(result.cpu_times)), 1e6 * float(np.median(result.gpu_times))


cases = {"(1,8,16x16,64) causal": ((1, 8, 16, 64), (1, 8, 16, 64), True),
         "decode (8,32/8,1x8192,128)": ((8, 32, 1, 128), (8, 8, 8192, 128), False),
         "decode (64,32/8,1x2048,128)": ((64, 32, 1, 128), (64, 8, 2048, 128), False),
         "decode (1,8/1,1x32768,128)": ((1, 8, 1, 128), (1, 1, 32768, 128), False)}
print(f"{'call':<30}{'host us':>10}{'device us':>11}{'torch host':>12}{'device':>9}")
for name, (q_shape, kv_shape, causal) in cases.items():
    q = rng.standard_normal(q_shape, np.float32).astype(np.float16)
    k, v = (rng.standard_normal(kv_shape, np.float32).astype(np.float16) for _ in range(2))
    plan = npattn.plan(q, k, v, causal=causal)
    planned = split_us(lambda: plan.run(q, k, v))
    try:
        tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
        gqa = q_shape[1] != kv_shape[1]
        torch_times = split_us(lambda: sdpa(tq, tk, tv, is_causal=causal, enable_gqa=gqa))
    except Exception as error:  # report, do not stop the session
        print("torch:", error)
        torch_times = (float("nan"), float("nan"))
    print(f"{name:<30}{planned[0]:>10.1f}{planned[1]:>11.1f}{torch_times[0]:>12.1f}{torch_times[1]:>9.1f}")
