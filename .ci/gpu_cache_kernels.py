"""Device time of decode steps on float16, float8 e4m3 and int8 caches (q float16), the
host left out: each planned step (npattn.plan_with_kvcache, no append) captured in a CUDA
graph and replayed, timed by CUDA events (median of 5 rounds of 50 replays); where a step
cannot be captured, '-'. With --once each step just runs twice (the second for Nsight
Compute to time its kernels: `ncu --metrics gpu__time_duration.sum --csv ...`). With
--splits TARGET,MIN ... each step is planned again under each of the driver's split-KV
settings (DECODE_TARGET_WARPS, MIN_KEY_TILES_PER_SPLIT) and timed; each row ends with
float16's time over int8's. A quantized cache's step (4 packed rows a kv head at these
shapes: products transposed, Option.TRANSPOSED) and a float16 one are timed as built,
where they split a row's keys at most driver.MERGED_SPLITS ways merging them in the
forward (no combine launched); as "/combine" (MERGED_SPLITS = 0; the same step twice
where it does not merge: batch 1's 33 splits a row); as "/merge64" (MERGED_SPLITS = 64:
batch 1's splits merged in the forward too); and a quantized step with --untransposed as
"/untransposed" (sources.TRANSPOSED_ROWS = 0: forward_tc.cu's tile, slower than the
transposed one in every run of 2026-11-30).
Usage: python .ci/gpu_cache_kernels.py LABEL [--once] [--untransposed] [--splits TARGET,MIN ...]"""
import pathlib
import sys

import cupy
import numpy as np

import npattn

SHAPES = ((1, 32, 8, 16384, 128), (16, 32, 8, 2048, 128))
CACHES = ("float16", "float8_e4m3", "int8")
from npattn.gpu import driver, sources
from npattn.runtime import plans

label, once = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("--") else "tree", "--once" in sys.argv
settings = [tuple(int(x) for x in arg.split(",")) for arg in sys.argv[sys.argv.index("--splits") + 1:]
            if "," in arg] if "--splits" in sys.argv else []
settings = settings or [(driver.DECODE_TARGET_WARPS, driver.MIN_KEY_TILES_PER_SPLIT)]


def arrays(shape, cache, rng):
    """q, k, v and the scales' keywords on the device; the host arrays kept on disk, so
    that the runs of several trees in one GPU call quantize them once (seconds each)."""
    path = pathlib.Path("/tmp/npattn-cache-arrays") / f"{'x'.join(map(str, shape))}-{cache}.npz"
    if not path.exists():
        batch, heads, kv_heads, keys, dim = shape
        k, v = (rng.standard_normal((batch, keys, kv_heads, dim), dtype=np.float32) for _ in range(2))
        q = rng.standard_normal((batch, 1, heads, dim), dtype=np.float32).astype(np.float16)
        if cache == "float16":
            saved = dict(q=q, k=k.astype(np.float16), v=v.astype(np.float16))
        else:
            (kc, ks), (vc, vs) = npattn.quantize_kv(k, cache), npattn.quantize_kv(v, cache)
            saved = dict(q=q, k=kc, v=vc, k_scale=ks, v_scale=vs)
        path.parent.mkdir(exist_ok=True)
        np.savez(path, **saved)
    loaded = {name: cupy.asarray(x) for name, x in np.load(path).items()}
    return loaded.pop("q"), loaded.pop("k"), loaded.pop("v"), loaded


def replay_us(run):
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        run()
        stream.synchronize()
        try:
            stream.begin_capture()
            run()
            graph = stream.end_capture()
        except Exception as error:  # a step that waits on the host cannot be captured
            print(f"  (no capture: {type(error).__name__}: {str(error)[:80]})")
            return float("nan")
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        rounds = []
        for _ in range(5):
            start.record(stream)
            for _ in range(50):
                graph.launch(stream)
            end.record(stream)
            end.synchronize()
            rounds.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / 50)
        return float(np.median(rounds))


rng = np.random.default_rng(0)
print(f"{label}: decode step device time in a CUDA graph, us (K/V bytes read per second)")
for shape in SHAPES:
    for target, least in settings:
        driver.DECODE_TARGET_WARPS, driver.MIN_KEY_TILES_PER_SPLIT = target, least
        times = {}
        for cache in CACHES:
            q, k, v, scales = arrays(shape, cache, rng)
            variants = ((8, "", driver.COMBINE_CHUNK), (8, "/combine", 0), (8, "/merge64", 64))
            if "--untransposed" in sys.argv:
                variants += ((0, "/untransposed", driver.COMBINE_CHUNK),)
            for rows, suffix, merged in variants if scales else variants[:3]:
                sources.TRANSPOSED_ROWS, driver.MERGED_SPLITS = rows, merged  # read when the plan is made
                plans.clear()  # (no plan of the structure made under the settings before)
                plan = npattn.plan_with_kvcache(q, k, v, cache_seqlens=shape[3], causal=True, **scales)
                run = (lambda plan=plan, q=q, k=k, v=v, scales=scales: plan.run(q, k, v, **scales))
                if once:
                    run()
                    run()
                    cupy.cuda.get_current_stream().synchronize()
                    continue
                times[cache + suffix] = (replay_us(run), k.nbytes + v.nbytes)
            sources.TRANSPOSED_ROWS, driver.MERGED_SPLITS = 8, driver.COMBINE_CHUNK
        if not once:
            ratios = "  ".join(
                f"float16/int8{suffix} {times['float16' + suffix][0] / times['int8' + suffix][0]:.2f}x"
                for suffix in ("", "/combine", "/merge64") if "int8" + suffix in times)
            print(f"{label}: {shape} splits ({target},{least})  " + "  ".join(
                f"{cache} {us:.1f} ({read / us / 1e3:.0f} GB/s)" for cache, (us, read) in times.items())
                + f"  {ratios}", flush=True)
