"""``python -m npattn info | demo | bench``: what is installed, every variant through every
backend, and the CPU kernels timed against PyTorch and naive NumPy."""
from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys
import time

import numpy as np

import npattn
from ..core.checks import FLOAT_DTYPE_NAMES
from .variants import VARIANTS, Size

_THREAD_VARIABLES = ("NPATTN_NUM_THREADS", "NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                     "MKL_NUM_THREADS")
# npattn's other switches: the CPU ISA to force (cpu/isa.py) and the GPU's cubin cache (gpu/kernel_cache.py)
_OTHER_VARIABLES = ("NPATTN_CPU_ISA", "NPATTN_CACHE_DIR")


def info() -> str:
    """Versions, backends, threads and device, one fact a line."""
    lines = [f"npattn     {npattn.__version__}", f"python     {platform.python_version()}",
             f"platform   {platform.platform()}"]
    for module in ("numpy", "numba", "scipy", "cupy"):
        lines.append(f"{module:<10} {_version(module)}")
    lines.append("backends:")
    for name, status in npattn.backends().items():
        lines.append(f"  {name:<10} {'available' if status else 'unavailable: ' + status.reason}")
    lines.append(f"cpu cores  {os.cpu_count()}")
    for variable in _THREAD_VARIABLES:
        lines.append(f"  {variable}={os.environ.get(variable, '(unset)')}")
    lines.append(f"cpu isa    {_cpu_isa()}")
    for variable in _OTHER_VARIABLES:
        lines.append(f"  {variable}={os.environ.get(variable, '(unset)')}")
    lines.append(f"device     {_device()}")
    return "\n".join(lines)


def _cpu_isa() -> str:
    """The vector ISA the CPU kernels compile for, or why there is none."""
    from .. import cpu

    if cpu.unavailable_reason():
        return "(cpu backend unavailable)"
    from ..cpu import isa, simd

    forced = os.environ.get(isa.FORCE_VARIABLE)
    return simd.ISA + (f" (forced by {isa.FORCE_VARIABLE}={forced})" if forced else "")


def demo(size: Size = Size(), dtype=np.float32, repeats: int = 3, out=sys.stdout, plot_path=None) -> list[dict]:
    """Run every variant forward and backward through every available backend; print the max
    error against the float64 reference and the median time; with ``plot_path``, draw one
    variant's attention weights there as PNG. Returns the table's rows."""
    backends = [name for name, status in npattn.backends().items() if status and name != "gpu"]
    header = (f"{'variant':<16} {'backend':<10} {'max |out err|':>14} {'max |grad err|':>15} "
              f"{'fwd ms':>8} {'fwd+bwd ms':>11}")
    print(f"npattn {npattn.__version__} demo: (B, H, S, D) = "
          f"({size.batch}, {size.heads}, {size.seq_len}, {size.head_dim}), {np.dtype(dtype).name}, "
          f"errors against the float64 reference", file=out)
    if "cpu" in backends:
        from ..warmup import warmup

        print("compiling the CPU kernels (or loading them from Numba's cache)...", end=" ", file=out, flush=True)
        seconds = warmup(dtypes=(np.dtype(dtype).name,), serving=False)  # (no variant appends to a cache)
        print(f"ready in {sum(seconds.values()):.1f} s", file=out)
    print(header, file=out)
    print("-" * len(header), file=out)
    rows = []
    for variant in VARIANTS.values():
        q, k, v, options = variant.build(size, np.random.default_rng(0), dtype)
        dout = np.random.default_rng(1).standard_normal(
            npattn.attention(q, k, v, **options, backend="reference").shape)
        exact_out, exact_vjp = npattn.attention_vjp(*(x.astype(np.float64) for x in (q, k, v)),
                                                    **options, backend="reference")
        exact_grads = exact_vjp(dout)
        for backend in backends:
            # the first call also compiles or loads kernels: run it before timing anything
            result, vjp = npattn.attention_vjp(q, k, v, **options, backend=backend)
            grads = vjp(dout.astype(dtype))
            forward_ms = _median_ms(lambda: npattn.attention(q, k, v, **options, backend=backend), repeats)
            both_ms = _median_ms(lambda: npattn.attention_vjp(q, k, v, **options, backend=backend)[1](dout),
                                 repeats)
            row = dict(variant=variant.name, backend=backend,
                       out_error=_max_error(result, exact_out),
                       grad_error=max(_max_error(g, e) for g, e in zip(grads, exact_grads)),
                       forward_ms=forward_ms, forward_backward_ms=both_ms)
            rows.append(row)
            print(f"{row['variant']:<16} {backend:<10} {row['out_error']:>14.2e} {row['grad_error']:>15.2e} "
                  f"{forward_ms:>8.2f} {both_ms:>11.2f}", file=out)
    unavailable = {n: s.reason for n, s in npattn.backends().items() if not s}
    for name, reason in unavailable.items():
        print(f"({name} backend not run: {reason})", file=out)
    if plot_path is not None:
        _plot_demo_weights(plot_path, size, dtype, out)
    return rows


def _plot_demo_weights(path, size, dtype, out) -> None:
    """Save the causal sliding-window variant's weights as heatmaps (skipped, with a note,
    when matplotlib is missing)."""
    try:
        from .viz import plot_attention

        variant = VARIANTS["window+sinks"]
        q, k, v, options = variant.build(size, np.random.default_rng(0), dtype)
        _, weights = npattn.attention(q, k, v, **options, return_weights=True)
        plot_attention(weights, path, heads=range(min(4, weights.shape[1])),
                       title=f"npattn demo: {variant.name} attention weights")
        print(f"attention weights of {variant.name} drawn to {path}", file=out)
    except ImportError as error:
        print(f"(no weights plot: {error})", file=out)


DESCRIPTION = """npattn: fast, exact attention for NumPy and CuPy arrays.

commands:
  info      what is installed: versions, backends, threads, CPU vector ISA, GPU
  demo      every attention variant through every backend, checked against float64
  bench     npattn's CPU kernels timed beside PyTorch and naive NumPy
  compile   compile the CPU kernels (and kv-cache appends) now, so that no first call waits

Run "python -m npattn COMMAND --help" for a command's options."""


def _positive_int(text: str) -> int:
    """argparse type: an int >= 1 (the error is printed as usage, not a traceback)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def _check_plot_path(parser, path: str) -> None:
    """Before the demo runs: the PNG's folder must exist and take a new file."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        parser.error(f"--plot: the folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK):
        parser.error(f"--plot: the folder {folder!r} is not writable")
    if os.path.isdir(path):
        parser.error(f"--plot: {path!r} is a folder; give a file name such as attention.png")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m npattn", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"npattn {npattn.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="versions, backends, threads and device")
    demo_parser = commands.add_parser("demo", help="every variant through every available backend")
    demo_parser.add_argument("--seq-len", type=_positive_int, default=Size.seq_len,
                             help=f"query and key length (default {Size.seq_len})")
    demo_parser.add_argument("--head-dim", type=_positive_int, default=Size.head_dim,
                             help=f"head dimension (default {Size.head_dim})")
    demo_parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    demo_parser.add_argument("--plot", default="npattn_demo_attention.png", metavar="PATH",
                             help="where to draw attention weights as PNG (needs matplotlib); '' for none")
    bench_parser = commands.add_parser("bench", help="CPU kernels against torch SDPA and naive NumPy")
    bench_parser.add_argument("--shape", action="append", dest="shapes", metavar="B,H[,HKV],S,D",
                              help="a shape to time (repeatable); default: the suite's; B,H,HKV,SQ,SK,D "
                                   "also reads (SQ query rows against SK keys, SQ=1 a decode step)")
    bench_parser.add_argument("--repeats", type=_positive_int, default=5,
                              help="timed runs per shape; the median is reported (default 5)")
    bench_parser.add_argument("--forward-only", action="store_true", help="skip the backward passes")
    bench_parser.add_argument("--memory", action="store_true",
                              help="peak memory of one forward at (1, 8, 16384, 64) instead")
    bench_parser.add_argument("--adapters", action="store_true",
                              help="npattn called on torch tensors and JAX arrays against the same call on "
                                   "NumPy instead (the adapters' cost; one shape, default 1,8,512,64)")
    bench_parser.add_argument("--ring", type=_positive_int, metavar="N",
                              help="ring attention on N MPI ranks against one process instead (one thread "
                                   "each; one shape B,H,S,D, default 1,8,8192,64, causal, zigzag shards)")
    bench_parser.add_argument("--layouts", action="store_true",
                              help="the serving layouts instead: a packed variable-length batch against each "
                                   "sequence alone, and a decode step on a paged cache against a contiguous one "
                                   "(with --gpu: on the GPU)")
    bench_parser.add_argument("--plans", action="store_true",
                              help="small calls through attention and through npattn.plan, and a decode step's "
                                   "layer through attention_with_kvcache and through plan_with_kvcache, instead")
    bench_parser.add_argument("--caches", action="store_true",
                              help="decode steps against float32, float16 and int8 (quantized) caches instead, "
                                   "at (1, 32/8, 16384, 128) and (16, 32/8, 2048, 128) (with --gpu: float16, "
                                   "float8 e4m3 and int8 caches on the GPU, q float16, torch's SDPA beside them)")
    bench_parser.add_argument("--gpu", action="store_true",
                              help="the CUDA kernels against torch SDPA's fastest backend on the GPU instead")
    bench_parser.add_argument("--tiles", action="store_true",
                              help="with --gpu: time the tensor-core forward's candidate tile shapes beside torch")
    bench_parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default=None,
                              help="the inputs' dtype, npattn's and torch's alike (default: float32 on the CPU, "
                                   "with a column for npattn's float32 time when another; float16 with --gpu)")
    bench_parser.add_argument("--suite", choices=["all", "prefill", "decode", "serving"], default=None,
                              help="which shapes run: on the CPU prefill (the default), serving (small calls, "
                                   "decode steps, a chunked prefill) or all; with --gpu all (the default), "
                                   "prefill or decode")
    bench_parser.add_argument("--json", metavar="PATH",
                              help="with --gpu: also write the rows to PATH as a JSON list of objects")
    bench_parser.add_argument("--isa", choices=["avx2"], default=None,
                              help="CPU: run npattn, torch and OpenBLAS as on an AVX2-only CPU (in a child "
                                   "process with NPATTN_CPU_ISA, ATEN_CPU_CAPABILITY and OPENBLAS_CORETYPE set)")
    bench_parser.add_argument("--window", type=_positive_int, metavar="W",
                              help="CPU: each shape causal with a sliding window of W keys back (window=(W, 0); "
                                   "torch and the naive version get it as a boolean mask)")
    bench_parser.add_argument("--products", choices=["vector", "blas"], default=None,
                              help="CPU: npattn's tile products on its micro-kernels or on SciPy's BLAS "
                                   "(default: the micro-kernels where the CPU has AVX-512 or AVX2)")
    compile_parser = commands.add_parser(
        "compile", help="compile the CPU kernels and the kv-cache calls' appends into Numba's on-disk cache now")
    compile_parser.add_argument("--dtype", action="append", dest="dtypes", choices=list(FLOAT_DTYPE_NAMES),
                                help="a dtype to compile for (repeatable; default float32 and float64)")
    args = parser.parse_args(argv)
    if args.command == "info":
        print(info())
    elif args.command == "compile":
        return _compile(args.dtypes or ["float32", "float64"])
    elif args.command == "demo":
        if args.plot:
            _check_plot_path(demo_parser, args.plot)
        demo(Size(seq_len=args.seq_len, head_dim=args.head_dim), dtype=np.dtype(args.dtype),
             plot_path=args.plot or None)
    else:
        from ..cpu.isa import FORCE_VARIABLE

        if args.window and (args.gpu or args.caches or args.plans or args.layouts or args.memory or args.ring
                            or args.adapters):
            bench_parser.error("--window applies to the CPU suites' rows only")
        if args.isa and not args.gpu and os.environ.get(FORCE_VARIABLE) != args.isa:  # not yet the child
            return _rerun_with(bench_isa_variables(args.isa), argv)
        from . import bench

        if args.caches:
            from . import bench_caches

            (bench_caches.compare_gpu if args.gpu else bench_caches.compare)(repeats=args.repeats)
        elif args.plans:
            from . import bench_plans

            bench_plans.compare(repeats=args.repeats)
        elif args.layouts:
            from . import bench_layouts

            bench_layouts.compare(repeats=args.repeats, gpu=args.gpu)
        elif args.gpu:
            from . import bench_gpu

            suite = args.suite or "all"
            if suite == "serving":
                print("bench --gpu: the suites are all, prefill and decode", file=sys.stderr)
                return 2
            shapes = [bench_gpu.GpuShape.parse(s) for s in args.shapes] if args.shapes else None
            if not bench_gpu.select_shapes(suite, shapes):
                print(f"bench --gpu: no shape given is in the {suite} suite", file=sys.stderr)
                return 2
            reason = bench_gpu.unavailable_reason()
            if reason is not None:
                print(f"bench --gpu needs the gpu backend: {reason}", file=sys.stderr)
                return 2
            if args.tiles:
                from . import tune_gpu

                tune_gpu.compare(shapes or bench_gpu.DEFAULT_SHAPES, dtype=args.dtype or "float16",
                                 repeats=args.repeats, json_path=args.json)
                return 0
            bench_gpu.compare(shapes, dtype=args.dtype or "float16", repeats=args.repeats, backward=not args.forward_only,
                              suite=suite, json_path=args.json)
        elif args.memory:
            bench.memory()
        elif args.ring:
            from . import bench_ring

            shape = tuple(int(x) for x in args.shapes[0].split(",")) if args.shapes else bench_ring.DEFAULT_SHAPE
            if len(shape) != 4:
                bench_parser.error(f"--ring takes a shape B,H,S,D; got {args.shapes[0]!r}")
            try:
                bench_ring.compare(args.ring, shape, repeats=args.repeats, backward=not args.forward_only)
            except RuntimeError as error:
                print(error, file=sys.stderr)
                return 2
        elif args.adapters:
            from . import bench_adapters

            shape = bench.Shape.parse(args.shapes[0]) if args.shapes else bench_adapters.DEFAULT_SHAPE
            bench_adapters.compare(shape, repeats=max(args.repeats, 15))
        else:
            if args.suite == "decode":
                print("bench: the CPU suites are prefill, serving and all", file=sys.stderr)
                return 2
            shapes = ([bench.Shape.parse(s) for s in args.shapes] if args.shapes
                      else bench.suite_shapes(args.suite or "prefill"))
            bench.compare(shapes, repeats=args.repeats, backward=not args.forward_only, products=args.products,
                          dtype=args.dtype or "float32", window=args.window)
    return 0


def _compile(dtypes) -> int:
    """``python -m npattn compile``: warm the CPU kernels, one line per dtype. Several
    dtypes compile side by side, a child process each (as many at once as the kernels'
    threads, ``NPATTN_NUM_THREADS`` or the usable cores): Numba compiles on one thread, so
    on 2 cores float32 and float64 take about the time of float32 alone."""
    from ..cpu.threads import thread_count
    from ..warmup import warmup

    print("compiling the CPU kernels (or loading them from Numba's cache)...", flush=True)
    dtypes = list(dict.fromkeys(dtypes))
    if len(dtypes) > 1 and thread_count() > 1:
        return _compile_side_by_side(dtypes, thread_count())
    try:
        for dtype in dtypes:
            seconds = warmup(dtypes=(dtype,))
            print(f"  {dtype:<9} ready in {seconds[dtype]:.1f} s", flush=True)
    except RuntimeError as error:
        print(f"compile: {error}", file=sys.stderr)
        return 1
    return 0


def _compile_side_by_side(dtypes, cores: int) -> int:
    """:func:`_compile` of each dtype in a child process, ``cores`` at a time; their lines
    in the order of ``dtypes``; the first failure's status."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    def compile_one(dtype):
        return subprocess.run([sys.executable, "-m", "npattn", "compile", "--dtype", dtype], capture_output=True,
                              text=True)
    status = 0
    with ThreadPoolExecutor(min(cores, len(dtypes))) as pool:
        for child in pool.map(compile_one, dtypes):
            print("".join(child.stdout.splitlines(keepends=True)[1:]), end="", flush=True)
            print(child.stderr, end="", file=sys.stderr)
            status = status or child.returncode
    return status


def bench_isa_variables(isa: str) -> list[tuple[str, str]]:
    """The environment that makes npattn (Numba), torch (ATen's kernels, and the oneDNN and
    MKL products under them) and OpenBLAS (NumPy's matmul, SciPy's fallback products) all
    run as on a CPU whose widest vectors are ``isa``."""
    from ..cpu.isa import FORCE_VARIABLE

    return [(FORCE_VARIABLE, isa), ("ATEN_CPU_CAPABILITY", isa), ("ONEDNN_MAX_CPU_ISA", isa.upper()),
            ("MKL_ENABLE_INSTRUCTIONS", isa.upper()), ("OPENBLAS_CORETYPE", "Haswell")]


def _rerun_with(variables, argv) -> int:
    """Run this command again in a child process with ``variables`` set: each library reads
    its switch once, when it loads, and NumPy's OpenBLAS has loaded already."""
    import subprocess

    environment = {**os.environ, **dict(variables)}
    arguments = sys.argv[1:] if argv is None else list(argv)
    return subprocess.run([sys.executable, "-m", "npattn", *arguments], env=environment).returncode


def _version(module: str) -> str:
    try:
        return importlib.import_module(module).__version__
    except Exception as error:  # an optional dependency missing or broken: say which
        return f"not available ({type(error).__name__}: {error})".splitlines()[0]


def _device() -> str:
    try:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        return f"{props['name'].decode()} (compute capability {props['major']}.{props['minor']})"
    except Exception as error:
        return f"no CUDA device ({type(error).__name__})"


def _median_ms(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def _max_error(actual, expected) -> float:
    difference = np.abs(np.asarray(actual, np.float64) - np.asarray(expected, np.float64))
    return float(difference.max(initial=0.0))
