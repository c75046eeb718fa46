"""``python -m npattn bench --gpu --tiles``: the tensor-core forward's tile shapes timed
side by side, with torch's fastest SDPA backend, in one run on one GPU.

GPU time is scarce, so one call does everything: every candidate tile of
:data:`TILES` (warps, row fragments per warp, keys per tile) is compiled up front in
parallel threads (NVRTC releases the GIL), then each prefill shape runs, causal and
not, every tile (each decode shape every tile of :data:`DECODE_TILES`) through the real call path (:func:`npattn.plan` made inside
:func:`npattn.gpu.sources.forced_forward_tile`), interleaved with torch's flash and
cuDNN backends (A B C A B C ...). Each variant's output is checked against a float64
reference computed on the device (torch's math backend on upcast inputs), as is torch's,
so a fast tile that computes something else shows at once.

Rows: shape, causal, tile, ms, TFLOP/s (decode: GB/s of K and V), share of torch's best (its time over the
tile's), relative error (||out - ref|| / ||ref||) and torch's. The JSON keeps them all.
"""
from __future__ import annotations

import concurrent.futures
import sys

import numpy as np

import npattn

from ..gpu import kernel_cache, sources
from ..gpu.options import Option
from ..gpu.sources import ForwardTile
from .bench_gpu import DECODE_SHAPES, PREFILL_SHAPES, GpuShape, _device_name, _inputs, _torch, write_json
from .timing import elapsed, interleaved_samples

# candidate tiles of prefill-sized calls per head-dim bound; the first is the default
# (sources.forward_tc_config) of a call without options (at d <= 64 under a band: the second)
TILES = {
    64: (ForwardTile(8, 2, 64), ForwardTile(4, 2, 64), ForwardTile(8, 1, 64), ForwardTile(8, 2, 64, 2),
         ForwardTile(4, 2, 64, 2), ForwardTile(8, 1, 64, 2)),
    128: (ForwardTile(8, 2, 64), ForwardTile(4, 2, 64), ForwardTile(8, 1, 64), ForwardTile(8, 2, 64, 2),
          ForwardTile(4, 2, 64, 2), ForwardTile(8, 2, 32, 2), ForwardTile(8, 1, 64, 2)),
}
# candidate tiles of decode steps at 128-wide heads (a GQA group's few rows: one warp,
# one fragment); the first is the default. Two stages keep twice the bytes in flight
# per warp, which a decode step, bound by reading K and V, may want (untimed so far).
DECODE_TILES = (ForwardTile(1, 1, 32), ForwardTile(1, 1, 64), ForwardTile(1, 1, 128), ForwardTile(1, 1, 32, 2),
                ForwardTile(1, 1, 64, 2))
# the option sets timed: plain, and the causal band
OPTION_SETS = (0, int(Option.BAND))


def names(dtype: str = "float16", bounds=(64, 128)) -> list[str]:
    """The name expressions of every candidate tile with each timed option set (decode
    tiles of 128-wide heads plain)."""
    return [sources.kernel_name("forward_tc", dtype, bound, tile=tile, options=options)
            for bound in bounds for tile in TILES[bound] for options in OPTION_SETS] + [
        sources.kernel_name("forward_tc", dtype, 128, tile=tile, options=0) for tile in DECODE_TILES]


def precompile(architecture: str, expressions, workers: int = 16) -> None:
    """Compile ``expressions`` for ``architecture`` into the kernel cache, in parallel."""
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda name: kernel_cache.cubin(architecture, name), expressions))


def _relative_error(out, reference) -> float:
    import cupy

    difference = out.astype(cupy.float64) - reference
    return float(cupy.linalg.norm(difference.ravel()) / cupy.linalg.norm(reference.ravel()))


def compare(shapes=PREFILL_SHAPES + DECODE_SHAPES, dtype: str = "float16", repeats: int = 10, json_path=None,
            out=sys.stdout) -> list[dict]:
    """Time every tile of :data:`TILES` at ``shapes`` (causal and not), forward only, beside
    torch; print a table, write JSON rows to ``json_path`` after each shape; return the rows."""
    import cupy

    torch = _torch()
    device = _device_name(cupy)
    architecture = f"sm_{cupy.cuda.Device().compute_capability}"
    bounds = sorted({sources.head_dim_bound(s.head_dim, s.head_dim) for s in shapes})
    precompile(architecture, names(dtype, bounds))
    rows = []
    print(f"{'shape':<24}{'causal':<8}{'tile (warps, frags, keys, stages)':<36}{'ms':>9}{'TFLOP/s':>9}{'of torch':>10}"
          f"{'rel. err':>10}{'torch err':>10}", file=out)
    for shape in shapes:
        shape = shape if isinstance(shape, GpuShape) else GpuShape.parse(shape)
        bound = sources.head_dim_bound(shape.head_dim, shape.head_dim)
        q, k, v = _inputs(cupy, shape, dtype)
        tiles = DECODE_TILES if shape.is_decode else TILES[bound]
        for causal in (False,) if shape.is_decode else (False, True):
            timed, outputs = {}, {}
            for tile in tiles:
                with sources.forced_forward_tile(tile, decode=shape.is_decode):
                    plan = npattn.plan(q, k, v, causal=causal, backend="gpu")
                    outputs[tile] = plan.run(q, k, v)

                def run(plan=plan):
                    plan.run(q, k, v)
                    cupy.cuda.get_current_stream().synchronize()
                timed[tile] = run
            reference, torch_error, torch_outputs = None, None, {}
            if torch is not None:
                reference, torch_runs, torch_outputs = _torch_forward(torch, cupy, q, k, v, shape, causal)
                timed.update(torch_runs)
            samples = interleaved_samples(timed, repeats, elapsed)
            medians = {name: float(np.median(t)) for name, t in samples.items()}
            torch_names = [name for name in medians if isinstance(name, str)]
            best = min(torch_names, key=medians.get) if torch_names else None
            if best is not None:
                torch_error = _relative_error(cupy.from_dlpack(torch_outputs[best].contiguous()), reference)
            flops = shape.forward_flops(causal)
            for tile in tiles:
                ms = 1e3 * medians[tile]
                share = None if best is None else float(np.median(np.asarray(samples[best]) / np.asarray(samples[tile])))
                error = None if reference is None else _relative_error(outputs[tile], reference)
                row = dict(shape=str(shape), causal=causal, dtype=dtype, warps=tile.warps, frags=tile.frags,
                           block_k=tile.block_k, stages=tile.stages, ms=ms, tflops=flops / medians[tile] / 1e12,
                           kv_gbps=shape.kv_bytes(dtype) / medians[tile] / 1e9 if shape.is_decode else None,
                           share_of_torch=share, relative_error=error, torch_backend=best,
                           torch_ms=None if best is None else 1e3 * medians[best], torch_relative_error=torch_error,
                           device=device)
                rows.append(row)
                rate = f"{row['kv_gbps']:>7.0f}GB" if shape.is_decode else f"{row['tflops']:>9.1f}"
                print(f"{str(shape):<24}{str(causal):<8}{str(_tile_tuple(tile)):<36}{ms:>9.3f}"
                      f"{rate}{_cell(share, '.0%'):>10}{_cell(error, '.1e'):>10}"
                      f"{_cell(torch_error, '.1e'):>10}", file=out)
            out.flush()
            if json_path is not None:
                write_json(rows, json_path)
    return rows


def _tile_tuple(tile: ForwardTile) -> tuple[int, int, int, int]:
    return tile.warps, tile.frags, tile.block_k, tile.stages


def _cell(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _torch_forward(torch, cupy, q, k, v, shape: GpuShape, causal: bool):
    """(float64 reference as CuPy, {"torch:<label>": timed run}, {"torch:<label>": output})
    for torch's flash and cuDNN SDPA backends that accept the shape."""
    import warnings

    from torch.nn.attention import SDPBackend, sdpa_kernel

    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
    options = dict(enable_gqa=shape.heads != shape.kv_heads, is_causal=causal)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    # float64 on the device, one (batch entry, head) at a time: a whole (1, 32, 8192, 8192)
    # score matrix in float64 would take 17 GB
    group = shape.heads // shape.kv_heads
    reference = torch.empty(tq.shape, dtype=torch.float64, device=tq.device)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        for b in range(shape.batch):
            for h in range(shape.heads):
                reference[b, h] = sdpa(tq[b, h].double()[None], tk[b, h // group].double()[None],
                                       tv[b, h // group].double()[None], is_causal=causal)[0]
    reference = cupy.from_dlpack(reference)
    runs, outputs = {}, {}
    for label, member in (("flash", "FLASH_ATTENTION"), ("cudnn", "CUDNN_ATTENTION")):
        if not hasattr(SDPBackend, member):
            continue

        def run(member=getattr(SDPBackend, member)):
            with torch.no_grad(), sdpa_kernel(member):
                result = sdpa(tq, tk, tv, **options)
            torch.cuda.synchronize()
            return result
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                outputs[f"torch:{label}"] = run()
        except RuntimeError:
            continue
        runs[f"torch:{label}"] = run
    return reference, runs, outputs
