"""Three float16 decode steps, planned, at the shapes of issue 35's decode targets: what
an Nsight Compute run of the decode kernels profiles (skip the first call's launches).
Usage: python .ci/gpu_ncu_decode.py BATCH HEADS KV_HEADS KEYS (head dim 128)."""
import sys

import cupy
import numpy as np

import npattn

batch, heads, kv_heads, keys = (int(x) for x in sys.argv[1:5])
rng = cupy.random.default_rng(0)
q = rng.standard_normal((batch, heads, 1, 128), np.float32).astype(np.float16)
k, v = (rng.standard_normal((batch, kv_heads, keys, 128), np.float32).astype(np.float16) for _ in range(2))
plan = npattn.plan(q, k, v)
for _ in range(3):
    plan.run(q, k, v)
cupy.cuda.get_current_stream().synchronize()
