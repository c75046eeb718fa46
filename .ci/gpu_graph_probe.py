"""Can a planned decode step (and a kv-cache step's plan) be captured in a CUDA graph (cupy.cuda.Graph) and replayed
with new q contents? Prints what happens (run by a lent GPU's call; a probe for issue 35,
not a test): the capture's error, or the replays' agreement with uncaptured calls and the
time of a replay against a call."""
import time

import cupy
import numpy as np

import npattn

rng = cupy.random.default_rng(0)


def per_call_us(stream, calls: dict) -> dict:
    """Each of ``calls`` (label -> call) 200 times back to back on ``stream``: us a call."""
    timings = {}
    for label, call in calls.items():
        call()
        stream.synchronize()
        start = time.perf_counter()
        for _ in range(200):
            call()
        stream.synchronize()
        timings[label] = 1e6 * (time.perf_counter() - start) / 200
    return timings


for name, (q_shape, kv_shape) in {"decode (8,32/8,1x8192,128)": ((8, 32, 1, 128), (8, 8, 8192, 128)),
                                  "small (1,8,16x16,64)": ((1, 8, 16, 64), (1, 8, 16, 64))}.items():
    q = rng.standard_normal(q_shape, np.float32).astype(np.float16)
    k, v = (rng.standard_normal(kv_shape, np.float32).astype(np.float16) for _ in range(2))
    causal = q_shape[2] > 1
    plan = npattn.plan(q, k, v, causal=causal)
    stream = cupy.cuda.Stream(non_blocking=True)
    try:
        with stream:
            plan.run(q, k, v)
            stream.synchronize()
            stream.begin_capture()
            captured_out = plan.run(q, k, v)
            graph = stream.end_capture()
    except Exception as error:
        print(f"{name}: capture failed: {type(error).__name__}: {error}")
        continue
    mismatches = 0
    with stream:
        for trial in range(100):
            q[...] = rng.standard_normal(q_shape, np.float32).astype(np.float16)
            graph.launch(stream)
            expected = plan.run(q, k, v)
            stream.synchronize()
            mismatches += not bool(cupy.array_equal(captured_out, expected))
        timings = per_call_us(stream, {"replay": lambda: graph.launch(stream), "call": lambda: plan.run(q, k, v)})
    print(f"{name}: 100 replays, {mismatches} differ from uncaptured calls; "
          f"replay {timings['replay']:.1f} us, planned call {timings['call']:.1f} us (back to back, per call)")


# a kv-cache step's plan (contiguous cache, 16 sequences at 2048 keys, GQA 32/8, D 128):
# captured once, replayed with new q, k and v contents (the plan's metadata are fixed).
# Not safe to capture yet (its undo copies come from CuPy's pool at each run): measured,
# with nothing else allocating between replays
B, S, H, HKV, D = 16, 4096, 32, 8, 128
k_cache, v_cache = (rng.standard_normal((B, S, HKV, D), np.float32).astype(np.float16) for _ in range(2))
q = rng.standard_normal((B, 1, H, D), np.float32).astype(np.float16)
k, v = (rng.standard_normal((B, 1, HKV, D), np.float32).astype(np.float16) for _ in range(2))
lengths = cupy.full(B, 2048, cupy.int32)
name = "kv-cache step (16,32/8,1+2048,128)"
try:
    step = npattn.plan_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths)
    plain = npattn.plan(q, k_cache[:, :2049], v_cache[:, :2049], layout="bshd")
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        step.run(q, k_cache, v_cache, k, v)
        stream.synchronize()
        stream.begin_capture()
        captured_out = step.run(q, k_cache, v_cache, k, v)
        graph = stream.end_capture()
except Exception as error:
    print(f"{name}: capture failed: {type(error).__name__}: {error}")
else:
    mismatches = 0
    with stream:
        for trial in range(100):
            for x in (q, k, v):
                x[...] = rng.standard_normal(x.shape, np.float32).astype(np.float16)
            graph.launch(stream)
            replayed = captured_out.copy()
            expected = step.run(q, k_cache, v_cache, k, v)
            stream.synchronize()
            mismatches += not bool(cupy.array_equal(replayed, expected))
        timings = per_call_us(stream, {"replay": lambda: graph.launch(stream),
                                       "step": lambda: step.run(q, k_cache, v_cache, k, v),
                                       "plain attention": lambda: plain.run(q, k_cache[:, :2049], v_cache[:, :2049])})
    print(f"{name}: 100 replays, {mismatches} differ from uncaptured runs; "
          + ", ".join(f"{label} {us:.1f} us" for label, us in timings.items()) + " (back to back, per call)")
