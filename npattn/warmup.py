"""Compile the CPU kernels ahead of the first call: :func:`warmup`, ``python -m npattn compile``.

The CPU backend's kernels are compiled by Numba on their first call in a fresh
environment (forward and backward: 81 s for float32 and 43 s for float64 on a 2-core Zen 3
VM, about half that on the project's AVX-512 VMs) and then loaded from Numba's
on-disk cache (``__pycache__`` beside the package, or ``NUMBA_CACHE_DIR``) in well
under a second. One compiled kernel serves every shape, layout and option (options
are runtime flags), so a few tiny calls per dtype fill the cache: the forward, the
attention weights' kernel, with ``backward`` the backward and the bias gradient's
kernel, with ``serving`` the kv-cache calls' appends (compiled per cache dtype), and for
float32 the exact GELU and the normalization rows that :mod:`npattn.autograd` runs on
float32 arrays. A service can pay the compile at start-up, an image build can bake it in.
``python -m npattn compile`` compiles its dtypes side by side, a process each, where
the machine has the cores (saves into one cache are locked: :mod:`npattn.cpu._cache`).
The GPU backend compiles its CUDA kernels per option set on first use and keeps the
cubins on disk (``NPATTN_CACHE_DIR``); it is not warmed here.
"""
from __future__ import annotations

import time
from typing import Any, Iterable

import numpy as np

from .core.checks import FLOAT_DTYPE_NAMES as DTYPES


def warmup(dtypes: str | Iterable[Any] = ("float32",), backward: bool = True,
           serving: bool = True) -> dict[str, float]:
    """Compile (or load from the cache) the CPU kernels for each of ``dtypes``: tiny
    calls of the forward and of the weights' kernel (``return_weights=True``), unless
    ``backward=False`` of the backward and the bias gradient's kernel, and unless
    ``serving=False`` of the kv-cache calls' compiled appends (:func:`_serving_steps`);
    for float32 also the exact GELU's and the normalization's kernels
    (:mod:`npattn.cpu.activations`, :mod:`npattn.cpu.normalization`); for float16 and
    bfloat16 also their conversions and the backward's delta sums (:func:`_sixteen_bit_calls`).
    Returns the seconds each dtype took. float16 and bfloat16 compute in float32, so they
    share its kernels."""
    from .api import attention_vjp
    from .backends import backends
    from .cpu import compiling

    reason = backends()["cpu"].reason
    if reason is not None:
        raise RuntimeError(f"warmup: the cpu backend is unavailable: {reason}")
    if isinstance(dtypes, str):
        dtypes = (dtypes,)
    seconds = {}
    for name in dtypes:
        dtype = _dtype(name)
        q, bias = np.zeros((1, 1, 2, 8), dtype), np.zeros((1, 1, 2, 2), dtype)
        start = time.perf_counter()
        with compiling.quiet():  # asked for: no note on stderr
            out, vjp = attention_vjp(q, q, q, bias=bias, return_weights=True, backend="cpu")
            if backward:
                vjp(np.ones_like(out[0]))
            if np.dtype(dtype).itemsize == 2:
                _sixteen_bit_calls(dtype, backward)
            if serving:
                _serving_steps(dtype)
            if np.dtype(dtype) == np.float32:  # npattn.nn's layers on float32 autograd arrays
                from .cpu.activations import gelu, gelu_gradient
                from .cpu.normalization import normalize

                gelu_gradient(gelu(np.zeros(1, np.float32)), np.ones(1, np.float32))
                normalize(np.zeros((1, 2), np.float32), None, None, 1e-5, True, keep=True)
        seconds[np.dtype(dtype).name] = time.perf_counter() - start
    # the tiny calls run on one thread; a call shared with other threads also runs the
    # crew's watches, or the pool's watch of the counter (small jitted functions: compiled,
    # or loaded, here)
    from .cpu import crew
    from .cpu.threads import new_counter, threads_out

    threads_out(new_counter(1), 0, 0)
    crew.prepare()
    return seconds


def _sixteen_bit_calls(dtype: Any, backward: bool) -> None:
    """float16 and bfloat16 where the head dim is whole vectors and where it is not (read
    as they lie, a tile at a time), with the kernels that convert them and that sum the
    backward's delta from out, given a dout of the dtype and a float32 one (as mixed
    precision passes it); and an odd head dim's forward's widened copies: calls over the
    1024 values from which the copies are converted on the vector units
    (npattn.cpu.conversion; the tiny calls' copies are NumPy's)."""
    from .api import attention, attention_vjp

    for head_dim, size in ((64, 2), (36, 32)):
        # (36: not whole vectors of float32 at any ISA; 40 was whole at AVX2's 8 lanes, and an
        # AVX2 CPU's first call that widened a copy compiled the conversion after the warmup)
        q = np.zeros((1, 1, size, head_dim), dtype)
        _, vjp = attention_vjp(q, q, q, backend="cpu")
        if backward:  # (out has q's shape)
            vjp(np.ones(q.shape, dtype))
            vjp(np.ones(q.shape, np.float32))
    q = np.zeros((1, 1, 32, 35), dtype)
    attention(q, q, q, backend="cpu")


def _serving_steps(dtype: Any) -> None:
    """Tiny decode steps that append keys of ``dtype`` to caches, called and planned (a
    plan's later runs take the write's checked entry): caches of ``dtype`` and int8 and
    float8 e4m3 caches (new float32 or float64 rows quantized in the compiled append).
    Each cache dtype's append is a compiled function of its own (npattn.cpu.slots),
    2-7 s of a first decode step on the Zen 3 VM where only the attention was warmed."""
    from .serving.kvcache import attention_with_kvcache, plan_with_kvcache

    # (a head dim of whole vectors, as models have: the appends' vector path; two query
    # heads a kv head, as GQA has)
    q, k, v = np.zeros((1, 1, 2, 64), dtype), np.zeros((1, 1, 1, 64), dtype), np.zeros((1, 1, 1, 64), dtype)
    capacity = (1, 4, 1, 64)
    for cache_dtype, quantized in ((dtype, False), (np.int8, True), (np.uint8, True)):
        k_cache, v_cache = np.zeros(capacity, cache_dtype), np.zeros(capacity, cache_dtype)
        k_scale, v_scale = (np.ones(capacity[:3], np.float32) if quantized else None for _ in range(2))
        attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=np.zeros(1, np.int32), k_scale=k_scale,
                               v_scale=v_scale)
        step = plan_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=np.ones(1, np.int32), k_scale=k_scale,
                                 v_scale=v_scale)
        for _ in range(2):
            step.run(q, k_cache, v_cache, k, v, k_scale=k_scale, v_scale=v_scale)


def _dtype(name: Any) -> Any:
    text = name if isinstance(name, str) else np.dtype(name).name
    if text not in DTYPES:
        raise ValueError(f"warmup: dtypes must be among {', '.join(DTYPES)}; got {name!r}")
    if text == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(text)
