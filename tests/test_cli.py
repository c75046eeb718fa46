"""``python -m npattn info`` and ``demo`` run and report what they claim."""
import importlib.util
import io
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import npattn
from npattn.tools import cli
from npattn.tools.variants import VARIANTS, Size
from conftest import one_thread_environment, started_in_turn
from tolerances import bound


def test_info_lists_versions_and_every_backend():
    text = subprocess.run([sys.executable, "-m", "npattn", "info"], capture_output=True, text=True,
                          check=True).stdout
    for word in ("npattn", "numpy", "reference", "cpu", "gpu", "NUMBA_NUM_THREADS", "NPATTN_NUM_THREADS",
                 "NPATTN_CPU_ISA", "NPATTN_CACHE_DIR", "device"):
        assert word in text
    from npattn.cpu import isa, simd  # (simd: the ISA the kernels compile for, the switch applied)

    forced = os.environ.get(isa.FORCE_VARIABLE)  # (a run of the suite under the switch says so)
    note = f" (forced by {isa.FORCE_VARIABLE}={forced})" if forced else ""
    assert f"cpu isa    {simd.ISA}{note}\n" in text


def test_version_prints_the_packages_version(capsys):
    import npattn

    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"npattn {npattn.__version__}\n"


def test_bench_isa_reruns_itself_with_every_librarys_switch(monkeypatch):
    """``bench --isa avx2`` hands the same arguments to a child process whose environment
    forces npattn, torch and OpenBLAS to AVX2 (each reads its switch when it loads)."""
    calls = []
    monkeypatch.delenv("NPATTN_CPU_ISA", raising=False)
    monkeypatch.setattr(subprocess, "run", lambda command, env: calls.append((command, env)) or
                        subprocess.CompletedProcess(command, 3))
    arguments = ["bench", "--isa", "avx2", "--shape", "1,2,32,16", "--repeats", "1"]
    assert cli.main(arguments) == 3
    [(command, environment)] = calls
    assert command == [sys.executable, "-m", "npattn", *arguments]
    for name, value in cli.bench_isa_variables("avx2"):
        assert environment[name] == value


def test_bench_products_switch_reaches_the_header(monkeypatch):
    from npattn.tools import bench, timing

    monkeypatch.setattr(timing, "SETTLE_S", 0.0)
    monkeypatch.setattr(bench, "_PEAK_SIZE", 64)
    printed = io.StringIO()
    bench.compare(shapes=[(1, 1, 1, 16, 16)], repeats=1, backward=False, out=printed, progress=io.StringIO(),
                  products="blas")
    assert "SciPy's BLAS" in printed.getvalue().splitlines()[0]


def test_demo_runs_every_variant_within_float32_rounding():
    size = Size(batch=1, heads=2, seq_len=24, head_dim=8)
    printed = io.StringIO()
    rows = cli.demo(size, dtype=np.float32, repeats=1, out=printed)
    assert {row["variant"] for row in rows} == set(VARIANTS)
    for row in rows:
        # values are standard normal: outputs and gradients are of order a few units
        assert row["out_error"] <= bound(np.float32, 1, magnitude=8), row
        assert row["grad_error"] <= bound(np.float32, 1, magnitude=64), row
    assert "mha" in printed.getvalue() and "max |out err|" in printed.getvalue()


def demo_child():
    """``(directory, completed process)`` of the demo run in a new directory: conftest starts
    it at collection (:func:`conftest.started_in_turn`), so that it runs beside the other tests."""
    directory = pathlib.Path(tempfile.mkdtemp(prefix="npattn-demo-"))
    return directory, subprocess.run([sys.executable, "-m", "npattn", "demo", "--seq-len", "16", "--head-dim", "8"],
                                     capture_output=True, text=True, cwd=directory, timeout=900,
                                     env=one_thread_environment())


def test_demo_command_line():
    directory, result = started_in_turn("demo-child", demo_child).result()
    try:
        _check_demo(directory, result)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _check_demo(directory, result):
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "window+sinks" in result.stdout
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no weights plot" in result.stdout
    else:
        assert (directory / "npattn_demo_attention.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_table_rows_are_consistent(monkeypatch):
    """One tiny shape, one round: every row has its pass and times, and with one round the
    per-round medians reduce to plain ratios of the times (torch only when importable)."""
    from npattn.tools import bench, timing

    monkeypatch.setattr(timing, "SETTLE_S", 0.0)
    monkeypatch.setattr(bench, "_PEAK_SIZE", 64)
    printed = io.StringIO()
    rows = bench.compare(shapes=[(1, 2, 1, 32, 16)], repeats=1, out=printed, progress=io.StringIO())
    assert [(row["causal"], row["passes"]) for row in rows] == [
        (False, "forward"), (False, "fwd+bwd"), (True, "forward"), (True, "fwd+bwd")]
    for row in rows:
        assert row["npattn_ms"] > 0 and row["gflops"] > 0 and row["matmul_gflops"] > 0
        assert row["peak_fraction"] == pytest.approx(row["gflops"] / row["matmul_gflops"], rel=1e-9)
        assert (row["torch_ms"] is None) == (row["torch_ratio"] is None)
        if row["torch_ms"] is not None:
            assert row["torch_ratio"] == pytest.approx(row["torch_ms"] / row["npattn_ms"], rel=1e-9)
    assert "(1,2/1kv,32,16)" in printed.getvalue() and "matmul" in printed.getvalue()
    assert all(row["float32_ratio"] is None for row in rows)


def test_bench_in_bfloat16_times_npattns_float32_beside_it(monkeypatch):
    from npattn.tools import bench, timing

    monkeypatch.setattr(timing, "SETTLE_S", 0.0)
    monkeypatch.setattr(bench, "_PEAK_SIZE", 64)
    printed = io.StringIO()
    rows = bench.compare(shapes=[(1, 2, 1, 32, 16)], repeats=1, backward=False, out=printed, progress=io.StringIO(),
                         dtype="bfloat16")
    assert printed.getvalue().startswith(f"npattn {npattn.__version__} bench, bfloat16,")
    assert "f32/npattn" in printed.getvalue()
    assert all(row["float32_ratio"] > 0 for row in rows)


@pytest.mark.parametrize("q_len, kv_len, window", [(1, 9, 3), (5, 5, 1), (3, 9, 2), (9, 3, 4), (16, 16, 5),
                                                   (4, 33, 40)])
def test_the_bench_window_mask_is_npattns_causal_window(q_len, kv_len, window):
    from npattn.core.masks import Visibility
    from npattn.tools import bench

    mask = Visibility.from_options(True, (window, 0), 0).matrix(np, q_len, kv_len)
    np.testing.assert_array_equal(bench.bottom_right_causal(q_len, kv_len, window), mask)
    assert bench.visible_pairs(q_len, kv_len, True, window) == mask.sum()


def test_bench_with_a_window_times_each_shape_once_with_it(monkeypatch):
    from npattn.tools import bench, timing

    monkeypatch.setattr(timing, "SETTLE_S", 0.0)
    monkeypatch.setattr(bench, "_PEAK_SIZE", 64)
    printed = io.StringIO()
    rows = bench.compare(shapes=[(1, 2, 1, 32, 16)], repeats=1, backward=True, out=printed, progress=io.StringIO(),
                         window=8)
    assert [(row["causal"], row["window"], row["passes"]) for row in rows] == [(True, 8, "forward"),
                                                                                (True, 8, "fwd+bwd")]
    assert all(line.split()[1] == "w=8" for line in printed.getvalue().splitlines() if line.startswith("(1,"))
    with pytest.raises(SystemExit):
        cli.main(["bench", "--caches", "--window", "8"])


def test_bench_gpu_says_why_it_cannot_run(capsys):
    from npattn.tools import bench_gpu

    reason = bench_gpu.unavailable_reason()
    if reason is None:
        pytest.skip("a GPU is usable here: bench --gpu would run")
    assert cli.main(["bench", "--gpu"]) == 2
    assert f"bench --gpu needs the gpu backend: {reason}" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="needs the gpu backend"):
        bench_gpu.compare(shapes=[(1, 1, 1, 8, 8)])


def test_bench_reads_query_and_key_lengths_and_runs_the_serving_suite(monkeypatch):
    """B,H,HKV,SQ,SK,D shapes (a decode step, a chunk against a cache) count bottom-right
    causal pairs; the serving suite names those of the issue's serving table."""
    from npattn.tools import bench, timing

    shape = bench.Shape.parse("1,4,2,3,40,16")
    assert (shape.q_len, shape.kv_len, str(shape)) == (3, 40, "(1,4/2kv,3x40,16)")
    assert shape.forward_flops(True) == 4 * 4 * 16 * bench.visible_pairs(3, 40, True)
    assert bench.visible_pairs(3, 40, True) == 3 * 40 - 3
    assert [str(s) for s in bench.suite_shapes("serving")][3] == "(1,32/8kv,1x4096,128)"
    assert len(bench.suite_shapes("all")) == len(bench.DEFAULT_SHAPES) + len(bench.SERVING_SHAPES)
    monkeypatch.setattr(timing, "SETTLE_S", 0.0)
    monkeypatch.setattr(bench, "_PEAK_SIZE", 64)
    rows = bench.compare(shapes=[shape], repeats=1, out=io.StringIO(), progress=io.StringIO())
    assert [(row["shape"], row["causal"]) for row in rows][::2] == [("(1,4/2kv,3x40,16)", False),
                                                                   ("(1,4/2kv,3x40,16)", True)]
    assert all(row["npattn_ms"] > 0 for row in rows)


@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5"])
def test_a_bad_thread_count_variable_is_named(monkeypatch, value):
    from npattn.cpu import threads

    monkeypatch.setenv("NPATTN_NUM_THREADS", value)
    with pytest.raises(ValueError, match=f"NPATTN_NUM_THREADS must be a positive integer \\(or unset\\), got '{value}'"):
        threads.thread_count()


def _run_cli(*arguments, cwd=None):
    return subprocess.run([sys.executable, "-m", "npattn", *arguments], capture_output=True, text=True, cwd=cwd)


def test_help_is_written_for_users():
    result = _run_cli("--help")
    assert result.returncode == 0
    for command in ("info", "demo", "bench", "compile"):
        assert f"\n  {command}" in result.stdout
    assert "``" not in result.stdout and ":mod:" not in result.stdout


@pytest.mark.parametrize("arguments, message", [
    (("demo", "--seq-len", "0"), "argument --seq-len: must be an integer >= 1, got 0"),
    (("demo", "--head-dim", "x"), "argument --head-dim: must be an integer >= 1, got 'x'"),
    (("bench", "--repeats", "-1"), "argument --repeats: must be an integer >= 1, got -1"),
    (("demo", "--plot", "/no/such/folder/weights.png"), "--plot: the folder '/no/such/folder' does not exist"),
])
def test_bad_arguments_get_a_usage_error_not_a_traceback(arguments, message):
    result = _run_cli(*arguments)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_compile_warms_the_kernels_of_each_dtype():
    """Two dtypes: side by side in child processes where there are two cores (a line
    each, in the order asked), one after the other on one."""
    result = _run_cli("compile", "--dtype", "float64", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(r"compiling the CPU kernels \(or loading them from Numba's cache\)\.\.\.\n"
                        r"  float64\s+ready in \d+\.\d s\n  float32\s+ready in \d+\.\d s\n", result.stdout), result.stdout


def test_warmup_returns_seconds_per_dtype_and_names_a_bad_one():
    import npattn

    seconds = npattn.warmup(dtypes=("float32", "float16"), backward=False)
    assert set(seconds) == {"float32", "float16"} and all(s >= 0 for s in seconds.values())
    with pytest.raises(ValueError, match="warmup: dtypes must be among float16, bfloat16, float32, float64; got 'int8'"):
        npattn.warmup(dtypes="int8")


def test_warmup_compiles_every_cpu_kernel_of_its_dtype():
    """The forward, the backward, the weights' kernel and the bias gradient's: after a
    warmup, a call that returns the weights or takes a bias's gradient compiles nothing.
    In a process of its own, where no other test has called the kernels."""
    script = """
import npattn
from npattn.cpu import backward_kernel, forward_kernel
npattn.warmup(dtypes=("float64",))
for kernel in (forward_kernel.forward_kernel, forward_kernel.weights_kernel, backward_kernel.backward_kernel,
               backward_kernel.dbias_kernel):
    print(kernel.__name__, any(str(signature[0].dtype) == "float64" for signature in kernel.signatures))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["forward_kernel", "True", "weights_kernel", "True", "backward_kernel", "True",
                                     "dbias_kernel", "True"], result.stdout


def test_after_a_sixteen_bit_warmup_calls_of_that_dtype_compile_nothing():
    """float16 and bfloat16 share float32's kernels, but convert and sum their backward's
    delta in small kernels of their own: after a warmup of both dtypes, their calls
    (head dims of whole vectors and not, causal, dropout, bshd, a float32 dout, arrays
    past the 1024 values that are converted on the vector units, kv-cache steps on caches
    of the dtype, called and planned) add no machine code to any Numba function. In a
    process of its own, where no other test has called them."""
    script = """
import gc
import ml_dtypes
import numpy as np
import npattn
from numba.core.registry import CPUDispatcher

npattn.warmup(dtypes=("float16", "bfloat16"))

def machine_code():
    return {id(f): len(f.overloads) for f in gc.get_objects() if isinstance(f, CPUDispatcher)}

before = machine_code()
rng = np.random.default_rng(0)
for dtype in (np.float16, ml_dtypes.bfloat16):
    dropout = {"causal": True, "dropout_p": 0.1, "seed": 1}
    for q_shape, k_shape, options in (((2, 8, 33, 64), (2, 2, 47, 64), {"causal": True}),
                                      ((1, 4, 5, 40), (1, 4, 70, 40), {}),
                                      ((1, 4, 300, 64), (1, 4, 300, 64), dropout)):
        q = rng.standard_normal(q_shape).astype(dtype)
        k, v = (rng.standard_normal(k_shape).astype(dtype) for _ in range(2))
        out, vjp = npattn.attention_vjp(q, k, v, **options)
        vjp(np.ones_like(out))
        bshd = [x.transpose(0, 2, 1, 3).copy() for x in (q, k, v)]
        out, vjp = npattn.attention_vjp(*bshd, layout="bshd", **options)
        vjp(np.ones(out.shape, np.float32))
    q = rng.standard_normal((2, 1, 8, 64)).astype(dtype)
    k, v = (rng.standard_normal((2, 1, 2, 64)).astype(dtype) for _ in range(2))
    k_cache, v_cache = np.zeros((2, 40, 2, 64), dtype), np.zeros((2, 40, 2, 64), dtype)
    npattn.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=np.array([3, 5], np.int32), causal=True)
    step = npattn.plan_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=np.array([4, 6], np.int32), causal=True)
    for _ in range(3):
        step.run(q, k_cache, v_cache, k, v)
after = machine_code()
print(sum(after.get(key, 0) - count for key, count in before.items()), len(set(after) - set(before)))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "0"], result.stdout


def test_after_a_warmup_decode_steps_that_append_compile_nothing():
    """A decode step's append into a cache is a compiled function per cache dtype, of any
    layout (npattn.cpu.slots): after a warmup, steps of another batch, head count and
    cache size (called, planned, paged; float32 caches and int8 and e4m3 ones, whose new
    rows the planned runs quantize), and steps whose new rows are views of a fused
    projection and whose caches are views of a larger allocation, add no machine code to
    any Numba function. In a process of its own, where no other test has called them."""
    script = """
import gc
import numpy as np
import npattn
from numba.core.registry import CPUDispatcher

npattn.warmup(dtypes=("float32",), backward=False)

def machine_code():
    return {id(f): len(f.overloads) for f in gc.get_objects() if isinstance(f, CPUDispatcher)}

before = machine_code()
rng = np.random.default_rng(0)
q = rng.standard_normal((3, 1, 8, 64)).astype(np.float32)
k, v = (rng.standard_normal((3, 1, 2, 64)).astype(np.float32) for _ in range(2))
seqlens = np.array([5, 0, 9], np.int32)
pages = {"block_table": np.arange(12, dtype=np.int32).reshape(3, 4)}
for capacity, dtype, extra in (((3, 40, 2, 64), np.float32, {}), ((12, 8, 2, 64), np.float32, pages),
                               ((3, 40, 2, 64), np.int8, None), ((3, 40, 2, 64), np.uint8, None)):
    if extra is None:
        extra = {"k_scale": np.ones(capacity[:3], np.float32), "v_scale": np.ones(capacity[:3], np.float32)}
    k_cache, v_cache = np.zeros(capacity, dtype), np.zeros(capacity, dtype)
    npattn.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=True, **extra)
    step = npattn.plan_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens + 1, causal=True, **extra)
    scales = {name: extra[name] for name in ("k_scale", "v_scale") if name in extra}
    for _ in range(3):
        step.run(q, k_cache, v_cache, k, v, **scales)
fused = rng.standard_normal((3, 1, 12, 64)).astype(np.float32)  # q's 8 heads, then k's 2 and v's 2
q, k, v = fused[:, :, :8], fused[:, :, 8:10], fused[:, :, 10:]
for dtype in (np.float32, np.int8, np.uint8):
    k_cache, v_cache = (np.zeros((3, 64, 2, 64), dtype)[:, :40] for _ in range(2))
    extra = {} if dtype == np.float32 else {"k_scale": np.ones((3, 64, 2), np.float32)[:, :40],
                                            "v_scale": np.ones((3, 64, 2), np.float32)[:, :40]}
    npattn.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=True, **extra)
    step = npattn.plan_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens + 1, causal=True, **extra)
    for _ in range(3):
        step.run(q, k_cache, v_cache, k, v, **extra)
after = machine_code()
print(sum(after.get(key, 0) - count for key, count in before.items()), len(set(after) - set(before)))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "0"], result.stdout


def test_bench_adapters_times_each_way_of_calling_against_numpy(monkeypatch, capsys):
    """One tiny shape, one round: numpy's own ratio is 1, and a row for each framework
    importable here, forward and forward+backward."""
    from npattn.tools import bench, bench_adapters

    monkeypatch.setattr(bench, "_RUN_S", 0.0)
    results = bench_adapters.compare(bench.Shape(1, 2, 2, 16, 8), repeats=1)
    assert results[("numpy", "forward")][1] == 1.0 and results[("numpy", "fwd+bwd")][1] == 1.0
    expected = {("numpy", "forward"), ("numpy", "fwd+bwd")}
    for module, plain, differentiated in (("torch", "torch tensors", "torch autograd"),
                                          ("jax", "jax arrays", "jax jit")):
        if importlib.util.find_spec(module) is not None:
            expected |= {(name, run) for name in (plain, differentiated) for run in ("forward", "fwd+bwd")}
    assert set(results) == expected
    assert all(ms > 0 for ms, _ in results.values())
    assert "(1,2,16,8) causal float32" in capsys.readouterr().out


def test_bench_layouts_rows_are_consistent(monkeypatch):
    """The serving layouts' comparison at small sizes: its rows and ratios agree with the
    printed times (torch columns only when importable)."""
    from npattn.tools import bench_layouts, timing

    monkeypatch.setattr(timing, "SETTLE_S", 0.0)
    monkeypatch.setattr(bench_layouts, "VARLEN_TOKENS", 640)
    monkeypatch.setattr(bench_layouts, "VARLEN_SEQUENCES", 4)
    monkeypatch.setattr(bench_layouts, "VARLEN_HEADS", 2)
    monkeypatch.setattr(bench_layouts, "DECODE", (2, 4, 2, 64, 16))
    monkeypatch.setattr(bench_layouts, "PAGE_SIZES", (16, 4))
    monkeypatch.setattr(bench_layouts, "DECODE_CALLS", 2)
    printed = io.StringIO()
    monkeypatch.setattr(bench_layouts, "SHORT_SEQUENCES", (4, 8))
    monkeypatch.setattr(bench_layouts, "PREFIX", (2, 4, 2, 32, 16, 16))
    monkeypatch.setattr(bench_layouts, "PREFIX_PAGE", 4)
    monkeypatch.setattr(bench_layouts, "MIXED", (1, 4, 8, 3, 2, 12, 4, 2, 16, 4))
    varlen, short, *paged, prefix, mixed = bench_layouts.compare(repeats=1, out=printed)
    assert mixed["ratio"] == pytest.approx(mixed["mixed_ms"] / mixed["two_calls_ms"])
    assert prefix["speedup"] == pytest.approx(prefix["pages_ms"] / prefix["shared_ms"])
    assert short["ratio"] == pytest.approx(short["packed_ms"] / short["dense_ms"])
    assert sum(varlen["lengths"]) == 640 and all(64 <= n <= 2048 for n in varlen["lengths"])
    # one round: the median of per-round ratios is the ratio of the times
    assert varlen["ratio"] == pytest.approx(varlen["packed_ms"] / varlen["alone_ms"])
    assert [row["page_size"] for row in paged] == [16, 4]
    for row in paged:
        assert row["ratio"] == pytest.approx(row["paged_ms"] / row["contiguous_ms"])
    assert "target <= 1.1x" in printed.getvalue()


def test_bench_plans_times_each_call_plain_and_planned():
    import io

    from npattn.tools import bench_plans

    printed = io.StringIO()
    results = bench_plans.compare(calls=2, repeats=1, out=printed)
    rows = printed.getvalue().splitlines()[2:]
    assert [row[:52].strip() for row in rows] == list(results)
    assert all(plain > 0 for plain, _ in results.values())
    assert all(planned > 0 for label, (_, planned) in results.items()
               if "alone" not in label and "torch" not in label and not label.endswith((", first", ", next")))
    assert any(label.endswith(", first") for label in results)  # (a step's first layer: every check)
    assert any(label.endswith(", next") for label in results)  # (a next step's first layer: its plan moved on)


def test_bench_caches_times_every_cache_dtype_against_int8():
    import io

    from npattn.tools import bench_caches

    printed = io.StringIO()
    results = bench_caches.compare(repeats=1, shapes=((2, 4, 2, 32, 16),), out=printed)
    rows = printed.getvalue().splitlines()[2:]
    assert [row.split()[-4] for row in rows] == list(bench_caches.CACHES)
    (label, timed), = results.items()
    assert label == "(2, 4/2, 32, 16)" and set(timed) == set(bench_caches.CACHES)
    assert timed["int8"][1] == 1.0 and all(ms > 0 and ratio > 0 for ms, ratio in timed.values())
