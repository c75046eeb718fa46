"""``python -m npattn bench``: npattn's CPU kernels side by side with PyTorch and naive NumPy.

Each row times one shape (B, H, Hkv, S, D), causal or not (with ``--window W``: causal in a
sliding window of W keys, which torch and the naive version get as a mask), float32, forward
and forward+backward. Implementations run interleaved (A B C A B C ...) in one
process and the table reports medians, because the 2-core VMs this project runs
on have bursts of CPU steal that would bias back-to-back runs; each timed run
starts after a short pause, so the spinning worker threads of the previous one
(OpenBLAS, OpenMP) do not slow it. GFLOP/s counts
the matrix products' useful flops (4 S_q S_k D per head forward, causal counting
only visible pairs; 2.5x that for the backward's five products) and "% peak" is
against NumPy's float32 matmul (2048^3), timed as one more member of every round:
these VMs also change speed by up to 1.7x for minutes at a time, so a peak taken
once at the start would misstate every later row. Ratios (torch/npattn, % peak)
are medians of the per-round ratios, which cancel a drift that hits both
members of a round. PyTorch
(``scaled_dot_product_attention``) and the naive implementation (materialized
scores, NumPy's softmax) are timed only when importable; torch is never a
dependency of npattn.

``--memory`` instead runs one forward at (1, 8, 16384, 64) in a fresh process
and reports its peak resident memory above the process's baseline, against the
bytes of the inputs and the output.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

import numpy as np

import npattn

from .timing import elapsed, interleaved_samples, npattn_passes, settled_elapsed

DEFAULT_SHAPES = ((1, 8, 8, 2048, 64), (4, 16, 16, 1024, 64), (1, 32, 8, 2048, 128))


@dataclass(frozen=True)
class Shape:
    """(B, H, Hkv, S, D): S keys, and S query rows unless ``q_len`` says fewer (a decode
    step, a chunk of a prefill, against a cache of S keys)."""

    batch: int
    heads: int
    kv_heads: int
    seq_len: int
    head_dim: int
    q_len_given: int | None = None

    @classmethod
    def parse(cls, text: str) -> "Shape":
        """"B,H,S,D", "B,H,HKV,S,D" or "B,H,HKV,SQ,SK,D"."""
        numbers = [int(x) for x in text.split(",")]
        if len(numbers) == 4:
            numbers.insert(2, numbers[1])
        if len(numbers) == 6:
            batch, heads, kv_heads, q_len, kv_len, head_dim = numbers
            return cls(batch, heads, kv_heads, kv_len, head_dim, q_len)
        if len(numbers) != 5:
            raise ValueError(f"a shape is B,H,S,D, B,H,HKV,S,D or B,H,HKV,SQ,SK,D; got {text!r}")
        return cls(*numbers)

    @property
    def q_len(self) -> int:
        return self.seq_len if self.q_len_given is None else self.q_len_given

    @property
    def kv_len(self) -> int:
        return self.seq_len

    def __str__(self):
        kv = "" if self.kv_heads == self.heads else f"/{self.kv_heads}kv"
        length = self.seq_len if self.q_len == self.kv_len else f"{self.q_len}x{self.kv_len}"
        return f"({self.batch},{self.heads}{kv},{length},{self.head_dim})"

    def forward_flops(self, causal: bool, window: int | None = None) -> float:
        pairs = visible_pairs(self.q_len, self.kv_len, causal, window)
        return 4.0 * self.batch * self.heads * pairs * self.head_dim


def visible_pairs(q_len: int, kv_len: int, causal: bool, window: int | None = None) -> int:
    """(query, key) pairs one head computes. Causal is bottom-right aligned: query i sits at
    position i + Sk - Sq and sees keys j <= that position; with ``window`` (causal) only
    the keys from that position - window on."""
    if window is not None:
        return int(bottom_right_causal(q_len, kv_len, window).sum())
    if not causal:
        return q_len * kv_len
    if q_len <= kv_len:  # row i sees Sk - Sq + i + 1 keys
        return q_len * kv_len - q_len * (q_len - 1) // 2
    return kv_len * (kv_len + 1) // 2  # the first Sq - Sk rows see nothing


def bottom_right_causal(q_len: int, kv_len: int, window: int | None = None) -> np.ndarray:
    """Boolean (q_len, kv_len): True where npattn's causal (with ``window``: a causal window
    of that many keys back, ``window=(window, 0)``) lets query i see key j. torch's
    ``is_causal`` aligns top-left and has no window, so torch gets this as an explicit mask
    when Sq != Sk or with a window."""
    visible = np.tri(q_len, kv_len, kv_len - q_len, dtype=bool)
    if window is not None:
        visible &= ~np.tri(q_len, kv_len, kv_len - q_len - window - 1, dtype=bool)
    return visible



# The shapes serving and embedding pipelines run ("serving" suite), as (B, H, Hkv, SQ, SK, D):
# small calls, a decode step against a cache (one query row), a chunk of a prefill.
# The last: an MQA decode step, one kv head at B = 1, whose keys npattn splits over the
# cores (npattn/cpu/splitting.py).
SERVING_SHAPES = ((1, 8, 8, 16, 16, 64), (1, 8, 8, 128, 128, 64), (8, 12, 12, 128, 128, 64),
                  (1, 32, 8, 1, 4096, 128), (16, 32, 8, 1, 1024, 128), (1, 32, 8, 16, 4096, 128),
                  (1, 8, 1, 1, 16384, 128))
SUITES = {"prefill": DEFAULT_SHAPES, "serving": SERVING_SHAPES}


def suite_shapes(suite: str) -> list[Shape]:
    """The shapes of ``suite``: "prefill", "serving" or "all" (both)."""
    if suite == "all":
        return suite_shapes("prefill") + suite_shapes("serving")
    if suite not in SUITES:
        raise ValueError(f"suite is one of {('all', *SUITES)}, got {suite!r}")
    return [Shape.parse(",".join(map(str, s))) for s in SUITES[suite]]


def _inputs(shape: Shape, seed=0, dtype="float32"):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((shape.batch, shape.heads, shape.q_len, shape.head_dim), np.float32)
    k = rng.standard_normal((shape.batch, shape.kv_heads, shape.kv_len, shape.head_dim), np.float32)
    v = rng.standard_normal((shape.batch, shape.kv_heads, shape.kv_len, shape.head_dim), np.float32)
    return tuple(x.astype(_numpy_dtype(dtype)) for x in (q, k, v)) if dtype != "float32" else (q, k, v)


def _numpy_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def _float32_runs(q, k, v, causal, window=None):
    """npattn on the same values in float32: what a lower-precision row is measured against."""
    return _npattn_runs(*(x.astype(np.float32) for x in (q, k, v)), causal, window)


def _npattn_runs(q, k, v, causal, window=None):
    options = {} if window is None else {"window": (window, 0)}
    return npattn_passes(q, k, v, causal=causal, backend="cpu", **options)


def _torch_runs(q, k, v, causal, window=None):
    import torch

    dtype = getattr(torch, q.dtype.name)  # float32, float16 or bfloat16 (converted through float32)
    tq, tk, tv = (torch.from_numpy(x.astype(np.float32)).to(dtype) for x in (q, k, v))
    options = dict(is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    if causal and (q.shape[2] != k.shape[2] or window is not None):  # top-left is_causal, no window: a mask
        options.update(is_causal=False,
                       attn_mask=torch.from_numpy(bottom_right_causal(q.shape[2], k.shape[2], window)))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def forward():
        with torch.no_grad():
            sdpa(tq, tk, tv, **options)

    grads = [x.clone().requires_grad_(True) for x in (tq, tk, tv)]

    def both():
        out = sdpa(*grads, **options)
        out.backward(torch.ones_like(out))
    return forward, both


def _naive_runs(q, k, v, causal, window=None):
    """Materialized float32 attention in NumPy: what a user writes without a kernel."""
    q, k, v = (x.astype(np.float32, copy=False) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k_full, v_full = (np.repeat(x, group, axis=1) for x in (k, v))
    scale = np.float32(1 / np.sqrt(q.shape[-1]))

    def forward():
        scores = (q * scale) @ k_full.swapaxes(-1, -2)
        if causal:
            scores = np.where(bottom_right_causal(q.shape[2], k.shape[2], window), scores, -np.inf)
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
        return scores @ v_full
    return forward, None


_RUN_S = 0.02  # the least time one timed run of a small call's rounds takes


def _calls_per_run(run) -> int:
    """Calls of ``run`` per timed run: enough to take about :data:`_RUN_S`."""
    run()  # warm
    return max(1, int(_RUN_S / max(elapsed(run), 1e-6)))


def _repeated(run, calls: int):
    if calls == 1:
        return run

    def repeated():
        for _ in range(calls):
            run()
    return repeated


def _milliseconds(ms: float) -> str:
    """One decimal from 10 ms up, three significant digits below (small calls)."""
    return f"{ms:.1f}" if ms >= 10 else f"{ms:.3g}"


def _npattn_isa(dtype: str = "float32") -> str:
    """What the CPU backend's tile products run on here, for ``dtype``."""
    from ..cpu.amx import TILES
    from ..cpu.simd import ISA
    from ..cpu.tuning import current

    names = {"avx512": "AVX-512", "avx2": "AVX2", "baseline": "SSE"}
    products = "micro-kernels" if current().vector_products else "SciPy's BLAS"
    tiles = " (bfloat16 pairs on AMX tiles)" if dtype == "bfloat16" and TILES and current().pair_products else ""
    return f"{names[ISA]} {products}{tiles}"


_PEAK_SIZE = 2048  # the matmul of "% peak": n x n times n x n, float32


def _matmul_run(size: int):
    """One float32 n x n matmul in NumPy: the practical peak the table compares with."""
    a = np.random.default_rng(0).standard_normal((size, size), np.float32)
    return lambda: a @ a


_BAR_WIDTH = 30


def _progress(done: int, total: int, label: str, stream) -> None:
    """Redraw the bar on a terminal (never into a file or pipe: it would garble the table)."""
    if not getattr(stream, "isatty", lambda: False)():
        return
    filled = int(_BAR_WIDTH * done / total)
    stream.write(f"\r[{'#' * filled}{'.' * (_BAR_WIDTH - filled)}] {done}/{total} {label:<40}")
    stream.flush()


def _clear_progress(stream) -> None:
    """Blank the bar's line, so a table row printed next starts at column 0."""
    if getattr(stream, "isatty", lambda: False)():
        stream.write("\r" + " " * (_BAR_WIDTH + 50) + "\r")
        stream.flush()


def compare(shapes=DEFAULT_SHAPES, repeats: int = 5, backward: bool = True, out=sys.stdout,
            progress=sys.stderr, products: str | None = None, dtype: str = "float32",
            window: int | None = None) -> list[dict]:
    """Time every shape x causal; print the table; return its rows (times in ms). ``products``
    ("vector" or "blas") forces npattn's tile products (see :func:`npattn.cpu.products`);
    ``dtype`` ("float32", "bfloat16" or "float16") the inputs' dtype, npattn and torch
    alike, with a column for npattn's float32 time on the same values; ``window``: each
    shape once, causal with a sliding window of that many keys back (torch and the naive
    version get it as a boolean mask), its column "w=" and the window."""
    if products is not None:
        from .. import cpu

        with cpu.products(products):
            return compare(shapes, repeats, backward, out, progress, dtype=dtype, window=window)
    shapes = [s if isinstance(s, Shape) else Shape.parse(",".join(map(str, s))) for s in shapes]
    # (npattn's float32 run right after its run in each round, before the naive one, whose
    # sequence x sequence arrays leave memory to be mapped again: after them, float32 had
    # run up to 1.2x slower in some rounds, and the ratio of the two moved with it)
    candidates = {"npattn": _npattn_runs}
    if dtype != "float32":
        candidates["float32"] = _float32_runs
    candidates["naive"] = _naive_runs
    try:
        import torch  # noqa: F401
        candidates["torch"] = _torch_runs
        torch_note = (f"torch {torch.__version__} on {torch.get_num_threads()} threads, "
                      f"{torch.backends.cpu.get_cpu_capability()}")
    except ImportError:
        torch_note = "torch not importable: no torch column"
    matmul, matmul_flops = _matmul_run(_PEAK_SIZE), 2.0 * _PEAK_SIZE ** 3
    print(f"npattn {npattn.__version__} bench, {dtype}, median of {repeats} interleaved runs; "
          f"npattn's products: {_npattn_isa(dtype)}; {torch_note}", file=out)
    header = (f"{'shape (B,H,S,D)':<25}{'causal':<8}{'pass':<9}{'npattn ms':>10}{'GFLOP/s':>9}"
              f"{'% peak':>8}{'torch ms':>10}{'torch/npattn':>13}{'naive ms':>10}{'matmul':>9}"
              + (f"{'f32/npattn':>11}" if dtype != "float32" else ""))
    print(header, file=out)
    print("-" * len(header), file=out)
    rows = []
    jobs = [(shape, causal) for shape in shapes for causal in ((True,) if window else (False, True))]
    label = f"w={window}" if window else None
    for index, (shape, causal) in enumerate(jobs):
        _progress(index, len(jobs), f"{shape} {label or f'causal={causal}'}", progress)
        q, k, v = _inputs(shape, dtype=dtype)
        runs = {name: make(q, k, v, causal, window) for name, make in candidates.items()}
        for pass_index, pass_name in enumerate(("forward", "fwd+bwd") if backward else ("forward",)):
            timed = {name: pair[pass_index] for name, pair in runs.items() if pair[pass_index] is not None}
            # small calls repeat within a timed run, to about _RUN_S, so the pause before
            # each run (settled_elapsed) costs every contender the same cold start once
            calls = _calls_per_run(timed["npattn"])
            timed = {name: _repeated(run, calls) for name, run in timed.items()}
            timed["matmul"] = matmul
            samples = interleaved_samples(timed, repeats, settled_elapsed)
            samples = {name: t if name == "matmul" else t / calls for name, t in samples.items()}
            ms = {name: 1e3 * float(np.median(t)) for name, t in samples.items()}
            flops = shape.forward_flops(causal, window) * (3.5 if pass_name == "fwd+bwd" else 1.0)
            gflops = flops / (ms["npattn"] / 1e3) / 1e9
            peak_fraction = float(np.median(samples["matmul"] / samples["npattn"])) * flops / matmul_flops
            torch_ratio = (float(np.median(samples["torch"] / samples["npattn"])) if "torch" in samples
                           else None)
            float32_ratio = (float(np.median(samples["float32"] / samples["npattn"])) if "float32" in samples
                             else None)
            row = dict(shape=str(shape), causal=causal, window=window, passes=pass_name, npattn_ms=ms["npattn"],
                       float32_ratio=float32_ratio,
                       gflops=gflops, peak_fraction=peak_fraction, torch_ms=ms.get("torch"),
                       torch_ratio=torch_ratio, naive_ms=ms.get("naive"),
                       matmul_gflops=matmul_flops / (ms["matmul"] / 1e3) / 1e9)
            rows.append(row)
            torch_ms = "-" if row["torch_ms"] is None else _milliseconds(row["torch_ms"])
            ratio = "-" if torch_ratio is None else f"{torch_ratio:.2f}x"
            naive_ms = "-" if row["naive_ms"] is None else _milliseconds(row["naive_ms"])
            _clear_progress(progress)
            print(f"{str(shape):<25}{label or str(causal):<8}{pass_name:<9}{_milliseconds(ms['npattn']):>10}{gflops:>9.1f}"
                  f"{100 * peak_fraction:>7.0f}%{torch_ms:>10}{ratio:>13}{naive_ms:>10}"
                  f"{row['matmul_gflops']:>9.0f}" + (f"{float32_ratio:>10.2f}x" if float32_ratio else ""), file=out)
        out.flush()
    _clear_progress(progress)
    print("torch/npattn > 1 means npattn is faster. matmul: NumPy's float32 GFLOP/s in the same "
          "rounds, the peak of '% peak'." + (" f32/npattn: npattn's float32 time on the same values over its "
                                              f"{dtype} time." if dtype != "float32" else ""), file=out)
    return rows


_MEMORY_SCRIPT = """
import json, resource, sys
import numpy as np
import npattn
shape = json.loads(sys.argv[1])
tiny = np.zeros((1, 1, 8, shape[3]), np.float32)
npattn.attention(tiny, tiny, tiny, backend="cpu")  # compile or load kernels first
baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal(shape, np.float32) for _ in range(3))
out = npattn.attention(q, k, v, backend="cpu")
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(dict(extra=peak - baseline, inputs=q.nbytes * 3, output=out.nbytes)))
"""


def memory(shape=(1, 8, 16384, 64), out=sys.stdout) -> dict:
    """Peak RSS of one float32 forward in a fresh process, above the process's baseline
    after importing and warming up (kernels loaded), against inputs + output bytes."""
    result = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, json.dumps(list(shape))],
                            capture_output=True, text=True, check=True)
    facts = json.loads(result.stdout.strip().splitlines()[-1])
    ratio = facts["extra"] / (facts["inputs"] + facts["output"])
    print(f"forward {tuple(shape)} float32: peak RSS above baseline {facts['extra'] / 2**20:.0f} MiB, "
          f"inputs + output {(facts['inputs'] + facts['output']) / 2**20:.0f} MiB, ratio {ratio:.2f}",
          file=out)
    return dict(facts, ratio=ratio)
