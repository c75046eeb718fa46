"""Compile the CPU kernels ahead of the first call: :func:`warmup`, ``python -m npattn compile``.

The CPU backend's kernels are compiled by Numba on their first call in a fresh
environment (forward and backward: 81 s for float32 and 43 s for float64 on a 2-core Zen 3
VM, about half that on the project's AVX-512 VMs) and then loaded from Numba's
on-disk cache (``__pycache__`` beside the package, or ``NUMBA_CACHE_DIR``) in well
under a second. One compiled kernel serves every shape, layout and option (options
are runtime flags), so a few tiny calls per dtype fill the cache: the forward, the
attention weights' kernel and, with ``backward``, the backward and the bias gradient's
kernel. A service can pay the compile at start-up, an image build can bake it in.
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


def warmup(dtypes: str | Iterable[Any] = ("float32",), backward: bool = True) -> dict[str, float]:
    """Compile (or load from the cache) the CPU kernels for each of ``dtypes``: tiny
    calls of the forward and of the weights' kernel (``return_weights=True``), and unless
    ``backward=False`` of the backward and the bias gradient's kernel. Returns the seconds
    each dtype took. float16 and bfloat16 compute in float32, so they share its kernels."""
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
        seconds[np.dtype(dtype).name] = time.perf_counter() - start
    # the tiny calls run on one thread; a call shared with other threads also runs the
    # crew's watches, or the pool's watch of the counter (small jitted functions: compiled,
    # or loaded, here)
    from .cpu import crew
    from .cpu.threads import new_counter, threads_out

    threads_out(new_counter(1), 0, 0)
    crew.prepare()
    return seconds


def _dtype(name: Any) -> Any:
    text = name if isinstance(name, str) else np.dtype(name).name
    if text not in DTYPES:
        raise ValueError(f"warmup: dtypes must be among {', '.join(DTYPES)}; got {name!r}")
    if text == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(text)
