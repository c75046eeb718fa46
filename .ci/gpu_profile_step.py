"""One planned decode step at (BATCH, 32/8, KEYS, 128), q float16, on a CACHE
("float16", "int8" or "float8_e4m3") cache, run three times: what a full Nsight Compute
profile of the step's kernels takes (skip the first run's launches, which compile).
--untransposed plans the quantized step with forward_tc.cu's one-warp tile
(sources.TRANSPOSED_ROWS = 0). Usage:
python .ci/gpu_profile_step.py CACHE BATCH KEYS [--untransposed]"""
import sys

import cupy
import numpy as np

import npattn
from npattn.gpu import sources

cache, batch, keys = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if "--untransposed" in sys.argv:
    sources.TRANSPOSED_ROWS = 0
rng = np.random.default_rng(0)
k, v = (rng.standard_normal((batch, keys, 8, 128), dtype=np.float32) for _ in range(2))
q = cupy.asarray(rng.standard_normal((batch, 1, 32, 128), dtype=np.float32).astype(np.float16))
if cache == "float16":
    k, v, scales = cupy.asarray(k.astype(np.float16)), cupy.asarray(v.astype(np.float16)), {}
else:
    (kc, ks), (vc, vs) = npattn.quantize_kv(k, cache), npattn.quantize_kv(v, cache)
    k, v = cupy.asarray(kc), cupy.asarray(vc)
    scales = dict(k_scale=cupy.asarray(ks), v_scale=cupy.asarray(vs))
plan = npattn.plan_with_kvcache(q, k, v, cache_seqlens=keys, causal=True, **scales)
for _ in range(3):
    plan.run(q, k, v, **scales)
cupy.cuda.get_current_stream().synchronize()
