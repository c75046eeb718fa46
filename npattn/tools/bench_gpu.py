"""``python -m npattn bench --gpu``: npattn's CUDA kernels side by side with PyTorch's SDPA
on the same GPU.

Two suites of rows (``--suite``). Prefill: shapes (B, H, Hkv, S, D), causal or not,
forward and forward+backward. Decode: one query row against a KV cache of Sk keys, forward
only and not causal (with one row, bottom-right causal hides nothing). Every timed call
ends with a device synchronize; npattn and torch alternate in one process (A B A B ...),
medians reported. TFLOP/s count the useful flops as in :mod:`npattn.tools.bench` (causal counts
only the visible pairs, bottom-right aligned as npattn's causal is); decode rows also give
GB/s of K and V read, since a decode step is bound by reading the cache.

torch's reference: in float32 SDPA as it dispatches by default; in float16/bfloat16 every
one of its flash, cuDNN (and, for Sq != Sk, memory-efficient) backends that accepts the
shape is timed, and the fastest is the reference ("torch backend"). "of torch" is that
backend's time over npattn's, the median of per-round ratios. torch, when importable with
CUDA, reads the very same device arrays through DLPack; it is never a dependency.

Everything that needs a GPU (CuPy, torch) is imported inside the functions that time; the
rest (flop and byte counts, row selection, the reference's choice, formatting, JSON) is
plain Python over NumPy.
"""
from __future__ import annotations

import contextlib
import json
import sys
import warnings
from dataclasses import dataclass

import numpy as np

import npattn

from .bench import Shape, _clear_progress, _progress, bottom_right_causal, visible_pairs
from .timing import elapsed, interleaved_samples, npattn_passes


@dataclass(frozen=True)
class GpuShape:
    """q is (batch, heads, q_len, head_dim); k and v are (batch, kv_heads, kv_len, head_dim)."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int

    @classmethod
    def prefill(cls, shape: Shape) -> "GpuShape":
        """A (B, H, Hkv, S, D) shape of :mod:`npattn.tools.bench`: as many queries as keys."""
        return cls(shape.batch, shape.heads, shape.kv_heads, shape.seq_len, shape.seq_len, shape.head_dim)

    @classmethod
    def parse(cls, text: str) -> "GpuShape":
        """"B,H,HKV,SQ,SK,D", or what :meth:`Shape.parse` reads ("B,H[,HKV],S,D") for Sq = Sk."""
        numbers = [int(x) for x in text.split(",")]
        return cls(*numbers) if len(numbers) == 6 else cls.prefill(Shape.parse(text))

    @property
    def is_decode(self) -> bool:
        """One query row: causal changes nothing and inference has no backward."""
        return self.q_len == 1

    def __str__(self):
        kv = "" if self.kv_heads == self.heads else f"/{self.kv_heads}kv"
        rows = f"{self.q_len}" if self.q_len == self.kv_len else f"{self.q_len}:{self.kv_len}"
        return f"({self.batch},{self.heads}{kv},{rows},{self.head_dim})"

    def forward_flops(self, causal: bool) -> float:
        """4 D flops per visible (query, key) pair and head: QK^T and PV."""
        return 4.0 * self.batch * self.heads * visible_pairs(self.q_len, self.kv_len, causal) * self.head_dim

    def kv_bytes(self, dtype: str) -> int:
        """Bytes of K and V, each (B, Hkv, Sk, D): what one forward must read at least."""
        return 2 * self.batch * self.kv_heads * self.kv_len * self.head_dim * ITEMSIZE[dtype]


# Sizes by name, so counting bytes needs no ml_dtypes for bfloat16.
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}

PREFILL_SHAPES = tuple(GpuShape.prefill(Shape(*s)) for s in (
    (4, 16, 16, 2048, 64), (2, 16, 16, 4096, 128), (1, 32, 8, 8192, 128), (8, 16, 16, 1024, 64)))
# D = 128: 32 query heads over 8 KV heads with a long cache at small batch, a short one at
# large batch and at 16; and 8 query heads over one KV head at batch 1 with a very long
# cache (the fewest blocks: split-KV's and its combine's hardest case)
DECODE_SHAPES = (GpuShape(8, 32, 8, 1, 8192, 128), GpuShape(64, 32, 8, 1, 2048, 128),
                 GpuShape(16, 32, 8, 1, 2048, 128), GpuShape(1, 8, 1, 1, 32768, 128))
DEFAULT_SHAPES = PREFILL_SHAPES + DECODE_SHAPES
SUITES = ("all", "prefill", "decode")
PASSES = ("forward", "fwd+bwd")  # the order of the (forward, forward+backward) pairs of runs

# torch's SDPBackend members that float16/bfloat16 rows try, by the label the table shows.
TORCH_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}
DEFAULT_BACKEND = "default"  # float32: SDPA picks, no backend forced


def select_shapes(suite: str, shapes=None) -> list[GpuShape]:
    """The shapes ``suite`` runs, out of ``shapes`` (GpuShape, or 5-tuples of Shape for
    prefill; default: DEFAULT_SHAPES). A shape is decode when it has one query row."""
    if suite not in SUITES:
        raise ValueError(f"suite is one of {SUITES}, got {suite!r}")
    shapes = DEFAULT_SHAPES if shapes is None else shapes
    shapes = [s if isinstance(s, GpuShape) else GpuShape.prefill(Shape(*s)) for s in shapes]
    return [s for s in shapes if suite == "all" or (suite == "decode") == s.is_decode]


def plan(shapes, backward: bool = True) -> list[tuple[GpuShape, bool, tuple[str, ...]]]:
    """(shape, causal, passes) per job: decode shapes once, not causal, forward only;
    other shapes not causal and causal, with "fwd+bwd" after "forward" when ``backward``."""
    jobs = []
    for shape in shapes:
        if shape.is_decode:
            jobs.append((shape, False, PASSES[:1]))
        else:
            passes = PASSES if backward else PASSES[:1]
            jobs.extend((shape, causal, passes) for causal in (False, True))
    return jobs


def torch_candidates(dtype: str, shape: GpuShape) -> tuple[str, ...]:
    """Labels of the torch backends to time: SDPA's own choice in float32 (flash and cuDNN
    have no float32 kernels), else flash and cuDNN, plus memory-efficient where Sq != Sk
    (flash may refuse a decode step or the explicit mask a bottom-right causal needs)."""
    if dtype == "float32":
        return (DEFAULT_BACKEND,)
    return ("flash", "cudnn") + (("efficient",) if shape.q_len != shape.kv_len else ())


def reference(samples: dict) -> tuple[str | None, float | None]:
    """``samples``: name -> seconds per round, "npattn" and ``torch:<label>`` for each torch
    backend that ran. Returns the fastest torch label (lowest median) and npattn's share,
    the median over rounds of that backend's time / npattn's; (None, None) without torch."""
    torch_times = {name.split(":", 1)[1]: t for name, t in samples.items() if name.startswith("torch:")}
    if not torch_times:
        return None, None
    best = min(torch_times, key=lambda label: float(np.median(torch_times[label])))
    return best, float(np.median(np.asarray(torch_times[best]) / np.asarray(samples["npattn"])))


def make_row(shape: GpuShape, causal: bool, pass_name: str, dtype: str, samples: dict, facts: dict) -> dict:
    """One table and JSON row from one job's ``samples`` (as for :func:`reference`);
    ``facts`` (device, torch and npattn versions) are copied into it. Times in ms, TFLOP/s,
    GB/s of K and V read (decode rows only, else None); torch's numbers are None without torch."""
    ms = {name: 1e3 * float(np.median(t)) for name, t in samples.items()}
    flops = shape.forward_flops(causal) * (3.5 if pass_name == "fwd+bwd" else 1.0)
    kv_bytes = shape.kv_bytes(dtype) if shape.is_decode else None
    backend, share = reference(samples)
    torch_ms = None if backend is None else ms[f"torch:{backend}"]
    return dict(
        shape=str(shape), suite="decode" if shape.is_decode else "prefill", batch=shape.batch,
        heads=shape.heads, kv_heads=shape.kv_heads, q_len=shape.q_len, kv_len=shape.kv_len,
        head_dim=shape.head_dim, causal=causal, passes=pass_name, dtype=dtype,
        npattn_ms=ms["npattn"], npattn_tflops=_per_second(flops, ms["npattn"], 1e12),
        npattn_gbps=_per_second(kv_bytes, ms["npattn"], 1e9),
        torch_ms=torch_ms, torch_tflops=_per_second(flops, torch_ms, 1e12),
        torch_gbps=_per_second(kv_bytes, torch_ms, 1e9), torch_backend=backend, share_of_torch=share,
        torch_ms_by_backend={name.split(":", 1)[1]: t for name, t in ms.items() if name.startswith("torch:")},
        **facts)


def _per_second(amount, ms, unit):
    """``amount`` per second in ``unit``s, or None when either is unknown."""
    return None if amount is None or ms is None else amount / (ms / 1e3) / unit


# (title, row key, alignment, width, format spec; "" for text). None prints as "-".
_COLUMNS = (("shape (B,H,Sq[:Sk],D)", "shape", "<", 24, ""), ("causal", "causal", "<", 8, ""),
            ("pass", "passes", "<", 9, ""), ("npattn ms", "npattn_ms", ">", 10, ".3f"),
            ("TFLOP/s", "npattn_tflops", ">", 9, ".1f"), ("GB/s", "npattn_gbps", ">", 8, ".0f"),
            ("torch ms", "torch_ms", ">", 10, ".3f"), ("TFLOP/s", "torch_tflops", ">", 9, ".1f"),
            ("GB/s", "torch_gbps", ">", 8, ".0f"), ("torch backend", "torch_backend", ">", 15, ""),
            ("of torch", "share_of_torch", ">", 10, ".0%"))


def format_header() -> str:
    """The table's column titles, aligned as :func:`format_row` aligns values."""
    return "".join(f"{title:{align}{width}}" for title, _, align, width, _ in _COLUMNS)


def format_row(row: dict) -> str:
    """One row of the table: the row's values under :func:`format_header`."""
    cells = []
    for _, key, align, width, spec in _COLUMNS:
        value = row[key]
        text = "-" if value is None else format(value, spec) if spec else str(value)
        cells.append(f"{text:{align}{width}}")
    return "".join(cells)


def write_json(rows: list[dict], path) -> None:
    """``rows`` as a JSON list of objects at ``path`` (overwritten)."""
    with open(path, "w") as stream:
        json.dump(rows, stream, indent=2)
        stream.write("\n")


def unavailable_reason() -> str | None:
    """Why ``--gpu`` cannot run here, or None."""
    return npattn.backends()["gpu"].reason


def _numpy_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes  # noqa: F401  (registers NumPy's "bfloat16")
    return np.dtype(dtype)


def _inputs(cupy, shape: GpuShape, dtype: str):
    """q, k, v on the device, standard normal, in ``dtype``."""
    rng = cupy.random.default_rng(0)
    dims = [(shape.batch, shape.heads, shape.q_len, shape.head_dim)]
    dims += [(shape.batch, shape.kv_heads, shape.kv_len, shape.head_dim)] * 2
    return tuple(rng.standard_normal(d, np.float32).astype(_numpy_dtype(dtype)) for d in dims)


def _npattn_runs(cupy, q, k, v, causal):
    """(forward, forward+backward) of npattn on the GPU, each ending with a synchronize."""
    return npattn_passes(q, k, v, causal=causal, backend="gpu")


def _torch():
    """torch if it is importable, has ``sdpa_kernel`` (torch 2.3 on) and sees a CUDA device, else None."""
    try:
        import torch
        from torch.nn.attention import sdpa_kernel  # noqa: F401
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _torch_runs(torch, q, k, v, shape: GpuShape, causal: bool, dtype: str) -> dict:
    """``torch:<label>`` -> (forward, forward+backward) for each candidate backend this torch
    has; whether a backend accepts the shape is found out by :func:`_accepted`."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
    leaves = [x.detach().clone().requires_grad_(True) for x in (tq, tk, tv)]
    dout = torch.ones_like(tq)
    options = dict(enable_gqa=shape.heads != shape.kv_heads, is_causal=causal)
    if causal and shape.q_len != shape.kv_len:  # torch's is_causal would align top-left
        options.update(is_causal=False,
                       attn_mask=torch.from_numpy(bottom_right_causal(shape.q_len, shape.kv_len)).to(tq.device))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def runs(context):
        def forward():
            with torch.no_grad(), context():
                sdpa(tq, tk, tv, **options)
            torch.cuda.synchronize()

        def both():
            with context():
                # autograd.grad, not backward: no .grad accumulates across rounds
                torch.autograd.grad(sdpa(*leaves, **options), leaves, dout)
            torch.cuda.synchronize()
        return forward, both

    found = {}
    for label in torch_candidates(dtype, shape):
        if label == DEFAULT_BACKEND:
            found[f"torch:{label}"] = runs(contextlib.nullcontext)
        elif hasattr(SDPBackend, TORCH_BACKENDS[label]):  # cuDNN came in torch 2.4
            member = getattr(SDPBackend, TORCH_BACKENDS[label])
            found[f"torch:{label}"] = runs(lambda member=member: sdpa_kernel(member))
    return found


def _accepted(runs: dict) -> dict:
    """The runs (name -> callable) that run: a torch backend refuses a shape, dtype or GPU it
    has no kernel for with a RuntimeError (after a warning per reason, silenced here)."""
    kept = {}
    for name, run in runs.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                run()
        except RuntimeError:
            continue
        kept[name] = run
    return kept


def _device_name(cupy) -> str:
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    return name.decode() if isinstance(name, bytes) else name


def compare(shapes=None, dtype="float16", repeats: int = 10, backward: bool = True, suite: str = "all",
            json_path=None, out=sys.stdout, progress=sys.stderr) -> list[dict]:
    """Time every job of :func:`plan` over :func:`select_shapes` on the current GPU; print the
    table; write the rows to ``json_path`` when given; return them (see :func:`make_row`)."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"bench --gpu needs the gpu backend: {reason}")
    import cupy

    jobs = plan(select_shapes(suite, shapes), backward)
    if not jobs:
        raise ValueError(f"no shape given is in the {suite} suite")
    torch = _torch()
    facts = dict(device=_device_name(cupy), torch_version=None if torch is None else torch.__version__,
                 npattn_version=npattn.__version__)
    torch_note = "torch not importable with CUDA: no torch columns" if torch is None else f"torch {torch.__version__}"
    print(f"npattn {npattn.__version__} bench --gpu, {dtype}, median of {repeats} interleaved runs on "
          f"{facts['device']}; {torch_note}", file=out)
    print(format_header(), file=out)
    print("-" * len(format_header()), file=out)
    rows = []
    for index, (shape, causal, passes) in enumerate(jobs):
        _progress(index, len(jobs), f"{shape} causal={causal}", progress)
        q, k, v = _inputs(cupy, shape, dtype)
        ours = _npattn_runs(cupy, q, k, v, causal)
        theirs = {} if torch is None else _torch_runs(torch, q, k, v, shape, causal, dtype)
        for pass_name in passes:
            pass_index = PASSES.index(pass_name)
            timed = {"npattn": ours[pass_index],
                     **_accepted({name: pair[pass_index] for name, pair in theirs.items()})}
            samples = interleaved_samples(timed, repeats, elapsed)
            rows.append(make_row(shape, causal, pass_name, dtype, samples, facts))
            _clear_progress(progress)
            print(format_row(rows[-1]), file=out)
            if json_path is not None:  # after every row: a run cut short still leaves its rows
                write_json(rows, json_path)
        out.flush()
    _clear_progress(progress)
    print("GB/s: K and V bytes read per second (decode rows). torch backend: the fastest of SDPA's that "
          "accepted the shape; of torch: its time / npattn's (above 100%: npattn is faster).", file=out)
    return rows
