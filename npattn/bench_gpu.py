"""``python -m npattn bench --gpu``: npattn's CUDA kernels side by side with PyTorch's SDPA
(its flash backend) on the same GPU.

Each row times one shape (B, H, Hkv, S, D), causal or not, in float16 (``--dtype``),
forward and forward+backward; every timed call ends with a device synchronize, and
npattn and torch alternate in one process (A B A B ...), medians reported. TFLOP/s
count the useful flops as in :mod:`npattn.bench`; "of torch" is npattn's throughput
as a share of torch's, the median of per-round ratios. torch, when importable with
CUDA, reads the very same device arrays through DLPack; it is never a dependency.
"""
from __future__ import annotations

import sys
import time

import numpy as np

import npattn

from .bench import Shape, _clear_progress, _progress, interleaved_samples

DEFAULT_SHAPES = ((4, 16, 16, 4096, 128), (1, 8, 8, 2048, 64), (1, 32, 8, 4096, 128))


def unavailable_reason() -> str | None:
    """Why ``--gpu`` cannot run here, or None."""
    return npattn.backends()["gpu"].reason


def _inputs(cupy, shape: Shape, dtype):
    rng = cupy.random.default_rng(0)
    q = rng.standard_normal((shape.batch, shape.heads, shape.seq_len, shape.head_dim), np.float32)
    kv = (shape.batch, shape.kv_heads, shape.seq_len, shape.head_dim)
    k, v = rng.standard_normal(kv, np.float32), rng.standard_normal(kv, np.float32)
    return tuple(x.astype(dtype) for x in (q, k, v))


def _npattn_runs(cupy, q, k, v, causal):
    synchronize = cupy.cuda.get_current_stream().synchronize
    dout = cupy.ones(q.shape, q.dtype)

    def forward():
        npattn.attention(q, k, v, causal=causal, backend="gpu")
        synchronize()

    def both():
        npattn.attention_vjp(q, k, v, causal=causal, backend="gpu")[1](dout)
        synchronize()
    return forward, both


def _torch_runs(q, k, v, causal):
    """None when torch (with CUDA) is not importable or its flash backend refuses the shape."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    grads = [x.detach().clone().requires_grad_(True) for x in (tq, tk, tv)]

    def forward():
        with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            sdpa(tq, tk, tv, is_causal=causal, enable_gqa=gqa)
        torch.cuda.synchronize()

    def both():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = sdpa(*grads, is_causal=causal, enable_gqa=gqa)
            out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
    try:
        forward()
    except RuntimeError:  # no flash kernel for this dtype, head dim or GPU
        return None
    return forward, both


def _time(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def compare(shapes=DEFAULT_SHAPES, dtype="float16", repeats: int = 10, backward: bool = True, out=sys.stdout,
            progress=sys.stderr) -> list[dict]:
    """Time every shape x causal on the current GPU; print the table; return its rows."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"bench --gpu needs the gpu backend: {reason}")
    import cupy

    shapes = [s if isinstance(s, Shape) else Shape(*s) for s in shapes]
    device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    device = device.decode() if isinstance(device, bytes) else device
    print(f"npattn {npattn.__version__} bench --gpu, {dtype}, median of {repeats} interleaved runs on {device}",
          file=out)
    header = (f"{'shape (B,H,S,D)':<24}{'causal':<8}{'pass':<9}{'npattn ms':>10}{'TFLOP/s':>9}"
              f"{'torch ms':>10}{'TFLOP/s':>9}{'of torch':>10}")
    print(header, file=out)
    print("-" * len(header), file=out)
    rows = []
    jobs = [(shape, causal) for shape in shapes for causal in (False, True)]
    for index, (shape, causal) in enumerate(jobs):
        _progress(index, len(jobs), f"{shape} causal={causal}", progress)
        q, k, v = _inputs(cupy, shape, np.dtype(dtype))
        ours = _npattn_runs(cupy, q, k, v, causal)
        theirs = _torch_runs(q, k, v, causal)
        for pass_index, pass_name in enumerate(("forward", "fwd+bwd") if backward else ("forward",)):
            timed = {"npattn": ours[pass_index]}
            if theirs is not None:
                timed["torch"] = theirs[pass_index]
            samples = interleaved_samples(timed, repeats, _time)
            ms = {name: 1e3 * float(np.median(t)) for name, t in samples.items()}
            flops = shape.forward_flops(causal) * (3.5 if pass_name == "fwd+bwd" else 1.0)
            tflops = {name: flops / (t / 1e3) / 1e12 for name, t in ms.items()}
            share = float(np.median(samples["torch"] / samples["npattn"])) if "torch" in samples else None
            row = dict(shape=str(shape), causal=causal, passes=pass_name, dtype=dtype, npattn_ms=ms["npattn"],
                       npattn_tflops=tflops["npattn"], torch_ms=ms.get("torch"),
                       torch_tflops=tflops.get("torch"), share_of_torch=share)
            rows.append(row)
            _clear_progress(progress)
            torch_ms = "-" if share is None else f"{ms['torch']:.2f}"
            torch_tflops = "-" if share is None else f"{tflops['torch']:.1f}"
            of_torch = "-" if share is None else f"{100 * share:.0f}%"
            print(f"{str(shape):<24}{str(causal):<8}{pass_name:<9}{ms['npattn']:>10.2f}{tflops['npattn']:>9.1f}"
                  f"{torch_ms:>10}{torch_tflops:>9}{of_torch:>10}", file=out)
        out.flush()
    _clear_progress(progress)
    print("of torch: npattn's throughput as a share of torch SDPA's flash backend on the same GPU.", file=out)
    return rows
