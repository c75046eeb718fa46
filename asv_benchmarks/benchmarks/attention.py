"""asv benchmarks for npattn.attention, in scipy's benchmark style.

Grids run over backend x dtype x sequence length x head dim x causal. Setup builds the
arrays and runs one warm-up call (Numba JIT / NVRTC compilation is not timed); a backend
that cannot run here raises NotImplementedError so asv skips it. GPU timings synchronize
the device inside the timed call.
"""
import numpy as np

import npattn
from npattn.tools import timing
from npattn.tools.bench import SERVING_SHAPES
from npattn.tools.variants import VARIANTS, Size

# The float64 reference materializes (B, H, S, S) twice over; keep it to small sizes.
REFERENCE_MAX_SEQ_LEN = 1024


def require(backend, seq_len=0):
    status = npattn.backends()[backend]
    if not status:
        raise NotImplementedError(f"{backend}: {status.reason}")
    if backend == "reference" and seq_len > REFERENCE_MAX_SEQ_LEN:
        raise NotImplementedError("the reference materializes S x S; too large")


def to_device(backend, arrays):
    if backend != "gpu":
        return arrays
    import cupy

    return [cupy.asarray(a) for a in arrays]


class _ForwardBackward:
    """Timed passes over ``self.q, k, v`` and ``self.options``, set by a subclass's setup
    through :meth:`prepare`: the passes of npattn.tools.timing, which ``python -m npattn bench``
    and ``bench --gpu`` time too (synchronizing the device inside the timed call)."""

    def prepare(self):
        self.forward, self.forward_backward = timing.npattn_passes(self.q, self.k, self.v, **self.options)
        self.forward()  # compile outside the timing

    def time_forward(self, backend, *params):
        self.forward()

    def time_forward_backward(self, backend, *params):
        self.forward_backward()


class Attention(_ForwardBackward):
    params = (["reference", "cpu", "gpu"], ["float32", "float64"], [256, 1024, 2048], [64, 128],
              [False, True])
    param_names = ["backend", "dtype", "seq_len", "head_dim", "causal"]
    timeout = 300

    def setup(self, backend, dtype, seq_len, head_dim, causal):
        require(backend, seq_len)
        rng = np.random.default_rng(0)
        shape = (1, 8, seq_len, head_dim)
        self.q, self.k, self.v, self.dout = to_device(
            backend, [rng.standard_normal(shape).astype(dtype) for _ in range(4)])
        self.options = dict(causal=causal, backend=backend)
        self.prepare()


    def peakmem_forward(self, backend, *params):
        npattn.attention(self.q, self.k, self.v, **self.options)

    def peakmem_forward_backward(self, backend, *params):
        _, vjp = npattn.attention_vjp(self.q, self.k, self.v, **self.options)
        vjp(self.dout)


class TargetShapes(_ForwardBackward):
    """The shapes the CPU targets are stated at (B, H, Hkv, S, D), float32: compare with
    ``python -m npattn bench``, which times torch's SDPA beside them."""

    params = (["cpu", "gpu"], ["1,8,8,2048,64", "4,16,16,1024,64", "1,32,8,2048,128"], [False, True])
    param_names = ["backend", "shape", "causal"]
    timeout = 600

    def setup(self, backend, shape, causal):
        require(backend)
        b, h, hkv, s, d = (int(x) for x in shape.split(","))
        rng = np.random.default_rng(0)
        self.q, self.k, self.v, self.dout = to_device(backend, [
            rng.standard_normal(dims, np.float32) for dims in ((b, h, s, d), (b, hkv, s, d), (b, hkv, s, d),
                                                               (b, h, s, d))])
        self.options = dict(causal=causal, backend=backend)
        self.prepare()



class LowPrecision(_ForwardBackward):
    """The target shapes (B, H, Hkv, SQ, SK, D) in bfloat16 and float16 on the CPU: bfloat16
    multiplies in bfloat16 pairs forward and backward where the CPU has AVX512_BF16
    (npattn.cpu.pair_gradients), float16 computes in float32 reading its arrays in place.
    Compare with ``python -m npattn bench --dtype bfloat16``, which times torch's SDPA in the
    same dtype and npattn's float32 on the same values beside them."""

    params = (["cpu"], ["bfloat16", "float16"], ["1,8,8,2048,2048,64", "4,16,16,1024,1024,64",
                                                 "1,32,8,2048,2048,128"], [False, True])
    param_names = ["backend", "dtype", "shape", "causal"]
    timeout = 600

    def setup(self, backend, dtype, shape, causal):
        require(backend)
        try:  # (NumPy's bfloat16: the benchmark environment installs npattn[testing], which brings it)
            import ml_dtypes
        except ImportError:
            raise NotImplementedError("bfloat16 needs ml_dtypes") from None

        self.q, self.k, self.v, self.dout = shaped_operands(
            backend, ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype, shape)
        self.options = dict(causal=causal, backend=backend)
        self.prepare()


class SlidingWindow(_ForwardBackward):
    """Causal sliding windows of ``window`` keys at (1, 8, 2048, 64), float32: where the
    backward's tiles follow the band of visible keys (npattn.cpu.tuning.Tuning.backward_tiles)."""

    params = (["cpu", "gpu"], [128, 1024])
    param_names = ["backend", "window"]
    timeout = 300

    def setup(self, backend, window):
        require(backend)
        rng = np.random.default_rng(0)
        self.q, self.k, self.v = to_device(backend, [rng.standard_normal((1, 8, 2048, 64), np.float32)
                                                     for _ in range(3)])
        self.options = dict(causal=True, window=(window, 0), backend=backend)
        self.prepare()


class Serving(_ForwardBackward):
    """The serving shapes of ``python -m npattn bench --suite serving`` (B, H, Hkv, SQ, SK,
    D), float32: small calls, decode steps against a cache, a chunk of a prefill."""

    params = (["cpu", "gpu"], [",".join(map(str, shape)) for shape in SERVING_SHAPES], [False, True])
    param_names = ["backend", "shape", "causal"]
    timeout = 300

    def setup(self, backend, shape, causal):
        require(backend)
        self.q, self.k, self.v, self.dout = shaped_operands(backend, "float32", shape)
        self.options = dict(causal=causal, backend=backend)
        self.prepare()


class Layouts:
    """The serving layouts of ``python -m npattn bench --layouts``, float32: a packed
    variable-length causal batch (8 sequences of 64-2048 tokens, 8192 in all, H=16, D=64)
    and a decode step (B=16, H=32/8, up to 2048 cached keys, D=128) on a contiguous and
    on a paged cache (pages of 256 keys)."""

    params = (["cpu", "gpu"],)
    param_names = ["backend"]
    timeout = 300

    def setup(self, backend):
        from npattn.tools import bench_layouts

        require(backend)
        rng = np.random.default_rng(0)
        lengths = bench_layouts.varlen_lengths()
        self.starts = np.concatenate([[0], np.cumsum(lengths)])
        tokens = (bench_layouts.VARLEN_TOKENS, bench_layouts.VARLEN_HEADS, bench_layouts.VARLEN_DIM)
        self.packed = to_device(backend, [rng.standard_normal(tokens).astype("float32") for _ in range(3)])
        batch, heads, kv_heads, cached, dim = bench_layouts.DECODE
        self.lengths = rng.integers(cached // 2, cached + 1, batch)
        q, keys, values = (rng.standard_normal(shape).astype("float32")
                           for shape in ((batch, 1, heads, dim), (batch, cached, kv_heads, dim),
                                         (batch, cached, kv_heads, dim)))
        pages = bench_layouts.paged_copy(keys, values, 256, rng)
        self.q, self.k_cache, self.v_cache, self.k_pool, self.v_pool, self.table = to_device(
            backend, [q, keys, values, *pages])

    def time_varlen(self, backend):
        npattn.attention_varlen(*self.packed, self.starts, self.starts, causal=True, backend=backend)
        _synchronize(backend)

    def time_decode_contiguous(self, backend):
        npattn.attention_with_kvcache(self.q, self.k_cache, self.v_cache, cache_seqlens=self.lengths, causal=True,
                                      backend=backend)
        _synchronize(backend)

    def time_decode_paged(self, backend):
        npattn.attention_with_kvcache(self.q, self.k_pool, self.v_pool, cache_seqlens=self.lengths,
                                      block_table=self.table, causal=True, backend=backend)
        _synchronize(backend)


class DecodeCaches:
    """The decode steps of ``python -m npattn bench --caches``: one query row per sequence
    against a cache of each dtype, (B, H / Hkv, Sk, D) = (16, 32 / 8, 2048, 128) and
    (1, 32 / 8, 16384, 128), causal, no append. q is float32 for one-byte codes and
    float32 caches and float16 for float16 ones on the CPU, float16 for every cache on the
    GPU (its tensor-core decode)."""

    params = (["cpu", "gpu"], ["int8", "float8_e4m3", "float16", "float32"],
              ["16,32,8,2048,128", "1,32,8,16384,128"])
    param_names = ["backend", "cache", "shape"]
    timeout = 300

    def setup(self, backend, cache, shape):
        from npattn.tools import bench_caches

        require(backend)
        if backend == "gpu" and cache == "float32":
            raise NotImplementedError("the GPU's decode rows are of 16-bit q (bench --caches --gpu)")
        shape = tuple(int(x) for x in shape.split(","))
        xp = np
        if backend == "gpu":
            import cupy as xp
        q, k, v, self.scales, _ = bench_caches.cache_arrays(shape, cache, np.random.default_rng(0),
                                                       np.float16 if backend == "gpu" else None, xp)
        self.step = npattn.plan_with_kvcache(q, k, v, cache_seqlens=shape[3], causal=True, backend=backend,
                                             **self.scales)
        self.arrays = (q, k, v)
        self.time_decode_step(backend)

    def time_decode_step(self, backend, *params):
        self.step.run(*self.arrays, **self.scales)
        _synchronize(backend)


def _synchronize(backend):
    if backend == "gpu":
        import cupy

        cupy.cuda.get_current_stream().synchronize()


def shaped_operands(backend, dtype, shape):
    """q, k, v, dout on ``backend`` for a "B,H,HKV,SQ,SK,D" shape: q and dout (B, H, SQ, D),
    k and v (B, HKV, SK, D)."""
    b, h, hkv, sq, sk, d = (int(x) for x in shape.split(","))
    rng = np.random.default_rng(0)
    return to_device(backend, [rng.standard_normal(dims).astype(dtype)
                               for dims in ((b, h, sq, d), (b, hkv, sk, d), (b, hkv, sk, d), (b, h, sq, d))])


class GpuTargets(_ForwardBackward):
    """The shape the GPU targets are stated at, (4, 16, 4096, 128), in float16 and float32,
    plus a short-query step (4 queries against 16384 cached keys, the split-KV path); compare
    with ``python -m npattn bench --gpu``, which times torch's fastest SDPA backend beside them."""

    params = (["gpu"], ["float16", "float32"], ["4,16,16,4096,4096,128", "8,32,8,4,16384,128"], [False, True])
    param_names = ["backend", "dtype", "shape", "causal"]
    timeout = 600

    def setup(self, backend, dtype, shape, causal):
        require(backend)
        self.q, self.k, self.v, self.dout = shaped_operands(backend, dtype, shape)
        self.options = dict(causal=causal, backend=backend)
        self.prepare()


class GpuDecode:
    """The decode rows of ``python -m npattn bench --suite decode --gpu``: one query row
    against a KV cache, 32 query heads over 8 KV heads (8 over 1 at batch 1), D = 128.
    Forward only (inference), and not causal: with one query row, bottom-right causal hides
    no key."""

    params = (["gpu"], ["float16", "float32"], ["8,32,8,1,8192,128", "64,32,8,1,2048,128", "16,32,8,1,2048,128",
                                               "1,8,1,1,32768,128"])
    param_names = ["backend", "dtype", "shape"]
    timeout = 600

    def setup(self, backend, dtype, shape):
        require(backend)
        self.q, self.k, self.v, _ = shaped_operands(backend, dtype, shape)
        self.options = dict(backend=backend)
        self.prepare()

    prepare = _ForwardBackward.prepare
    time_forward = _ForwardBackward.time_forward


class Variants:
    """Every variant of npattn.tools.variants at one size: what each option costs on top of plain MHA."""

    params = (["reference", "cpu", "gpu"], list(VARIANTS))
    param_names = ["backend", "variant"]
    timeout = 300

    def setup(self, backend, variant):
        require(backend)
        q, k, v, self.options = VARIANTS[variant].build(Size(batch=2, heads=8, seq_len=512, head_dim=64),
                                                        np.random.default_rng(0), np.float32)
        self.q, self.k, self.v = to_device(backend, [q, k, v])
        self.options = {**self.options, **to_device_options(backend, self.options), "backend": backend}
        self.prepare()

    prepare = _ForwardBackward.prepare
    time_forward = _ForwardBackward.time_forward
    time_forward_backward = _ForwardBackward.time_forward_backward


def to_device_options(backend, options):
    arrays = {name: value for name, value in options.items() if isinstance(value, np.ndarray)}
    return dict(zip(arrays, to_device(backend, list(arrays.values()))))


class Adapters:
    """npattn called through torch and JAX against the same call on NumPy, at (1, 8, 512, 64)
    causal float32 (:mod:`npattn.tools.bench_adapters`; a framework not installed is skipped)."""

    params = (["numpy", "torch tensors", "torch autograd", "jax arrays", "jax jit"],)
    param_names = ["called_as"]
    timeout = 300

    def setup(self, called_as):
        from npattn.tools import bench_adapters

        runs = bench_adapters.contenders()
        if called_as not in runs:
            raise NotImplementedError(f"{called_as}: its framework is not installed")
        self.forward, self.forward_backward = runs[called_as]
        self.forward()  # compile and plan outside the timing

    def time_forward(self, called_as):
        self.forward()

    def time_forward_backward(self, called_as):
        self.forward_backward()
