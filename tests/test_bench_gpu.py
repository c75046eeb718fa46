"""``bench --gpu``'s logic without a GPU: shapes and suites, flop and byte counts, the torch
reference's choice, rows, table and JSON; the timing loop runs over stand-ins for CuPy and torch."""
import io
import json
import subprocess
import sys
import types

import numpy as np
import pytest

from npattn.tools import bench, bench_gpu, cli
from npattn.tools.bench_gpu import GpuShape
from npattn.core.masks import Visibility

FACTS = dict(device="Test GPU", torch_version="2.9.0", npattn_version="0.0.test")


def test_import_needs_only_numpy():
    code = ("import sys, npattn.tools.bench_gpu; "
            "print(sorted(m for m in ('cupy', 'torch', 'numba', 'ml_dtypes') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


@pytest.mark.parametrize("q_len, kv_len", [(1, 1), (1, 7), (5, 5), (3, 9), (9, 3), (16, 16), (4, 33)])
def test_causal_pairs_and_mask_are_npattns_bottom_right_causal(q_len, kv_len):
    mask = Visibility(causal=True).matrix(np, q_len, kv_len)
    np.testing.assert_array_equal(bench_gpu.bottom_right_causal(q_len, kv_len), mask)
    assert bench_gpu.visible_pairs(q_len, kv_len, causal=True) == mask.sum()
    assert bench_gpu.visible_pairs(q_len, kv_len, causal=False) == q_len * kv_len


@pytest.mark.parametrize("causal", [False, True])
def test_square_shapes_count_the_flops_of_the_cpu_bench(causal):
    shape = bench.Shape(2, 8, 4, 96, 64)
    assert GpuShape.prefill(shape).forward_flops(causal) == shape.forward_flops(causal)


def test_decode_reads_k_and_v_once():
    # 2 (K and V) * B * Hkv * Sk * D * itemsize
    assert GpuShape(8, 32, 8, 1, 8192, 128).kv_bytes("float16") == 2 * 8 * 8 * 8192 * 128 * 2
    assert GpuShape(64, 32, 8, 1, 2048, 128).kv_bytes("float32") == 2 * 64 * 8 * 2048 * 128 * 4
    # one query row: causal hides nothing, so it costs the same flops
    decode = GpuShape(8, 32, 8, 1, 8192, 128)
    assert decode.forward_flops(True) == decode.forward_flops(False) == 4.0 * 8 * 32 * 8192 * 128


def test_shapes_parse_and_print():
    assert GpuShape.parse("1,8,2048,64") == GpuShape(1, 8, 8, 2048, 2048, 64)
    assert GpuShape.parse("1,32,8,2048,128") == GpuShape(1, 32, 8, 2048, 2048, 128)
    assert GpuShape.parse("8,32,8,1,8192,128") == GpuShape(8, 32, 8, 1, 8192, 128)
    assert str(GpuShape(1, 32, 8, 2048, 2048, 128)) == "(1,32/8kv,2048,128)"
    assert str(GpuShape(8, 32, 8, 1, 8192, 128)) == "(8,32/8kv,1:8192,128)"
    with pytest.raises(ValueError):
        GpuShape.parse("1,2,3")


def test_default_suites_are_the_issues_table():
    prefill = bench_gpu.select_shapes("prefill")
    decode = bench_gpu.select_shapes("decode")
    assert [(s.batch, s.heads, s.kv_heads, s.q_len, s.head_dim) for s in prefill] == [
        (4, 16, 16, 2048, 64), (2, 16, 16, 4096, 128), (1, 32, 8, 8192, 128), (8, 16, 16, 1024, 64)]
    assert all(s.q_len == s.kv_len for s in prefill)
    assert decode == [GpuShape(8, 32, 8, 1, 8192, 128), GpuShape(64, 32, 8, 1, 2048, 128),
                      GpuShape(16, 32, 8, 1, 2048, 128), GpuShape(1, 8, 1, 1, 32768, 128)]
    assert bench_gpu.select_shapes("all") == prefill + decode
    # given shapes replace the defaults; plain tuples are prefill shapes of the CPU bench
    assert bench_gpu.select_shapes("all", [(1, 2, 1, 32, 16)]) == [GpuShape(1, 2, 1, 32, 32, 16)]
    assert bench_gpu.select_shapes("decode", [(1, 2, 1, 32, 16)]) == []
    with pytest.raises(ValueError):
        bench_gpu.select_shapes("training")


def test_plan_runs_decode_once_forward_only():
    prefill, decode = GpuShape(1, 2, 2, 8, 8, 16), GpuShape(2, 4, 2, 1, 64, 16)
    assert bench_gpu.plan([prefill, decode]) == [
        (prefill, False, ("forward", "fwd+bwd")), (prefill, True, ("forward", "fwd+bwd")),
        (decode, False, ("forward",))]
    assert bench_gpu.plan([prefill], backward=False) == [(prefill, False, ("forward",)),
                                                         (prefill, True, ("forward",))]


def test_torch_candidates_by_dtype_and_shape():
    square, decode = GpuShape(1, 2, 2, 8, 8, 16), GpuShape(2, 4, 2, 1, 64, 16)
    assert bench_gpu.torch_candidates("float32", square) == ("default",)
    assert bench_gpu.torch_candidates("float32", decode) == ("default",)
    assert bench_gpu.torch_candidates("float16", square) == ("flash", "cudnn")
    assert bench_gpu.torch_candidates("bfloat16", decode) == ("flash", "cudnn", "efficient")
    assert set(bench_gpu.TORCH_BACKENDS) >= {"flash", "cudnn", "efficient"}


def test_reference_is_the_fastest_backend_and_share_the_median_ratio():
    samples = {"npattn": np.array([1.0, 2.0, 4.0]), "torch:flash": np.array([3.0, 3.0, 3.0]),
               "torch:cudnn": np.array([0.5, 3.0, 2.0])}
    backend, share = bench_gpu.reference(samples)
    assert backend == "cudnn"  # median 2.0 against flash's 3.0
    assert share == pytest.approx(np.median([0.5, 1.5, 0.5]))
    assert bench_gpu.reference({"npattn": np.array([1.0])}) == (None, None)


def _samples(npattn_s, **torch_s):
    return {"npattn": np.array(npattn_s), **{f"torch:{k}": np.array(v) for k, v in torch_s.items()}}


def test_decode_row_reports_bandwidth_and_the_reference():
    shape = GpuShape(8, 32, 8, 1, 8192, 128)
    row = bench_gpu.make_row(shape, False, "forward", "float16",
                             _samples([2e-3, 2e-3], flash=[3e-3, 3e-3], efficient=[1e-3, 1e-3]), FACTS)
    assert row["suite"] == "decode" and row["torch_backend"] == "efficient"
    assert row["npattn_ms"] == pytest.approx(2.0) and row["torch_ms"] == pytest.approx(1.0)
    assert row["share_of_torch"] == pytest.approx(0.5)
    assert row["npattn_gbps"] == pytest.approx(shape.kv_bytes("float16") / 2e-3 / 1e9)
    assert row["torch_gbps"] == pytest.approx(2 * row["npattn_gbps"])
    assert row["npattn_tflops"] == pytest.approx(shape.forward_flops(False) / 2e-3 / 1e12)
    assert row["torch_ms_by_backend"] == pytest.approx({"flash": 3.0, "efficient": 1.0})
    assert {key: row[key] for key in FACTS} == FACTS and row["dtype"] == "float16"


def test_prefill_row_without_torch():
    shape = GpuShape(1, 2, 2, 64, 64, 16)
    row = bench_gpu.make_row(shape, True, "fwd+bwd", "float32", _samples([1e-3]), FACTS)
    assert row["suite"] == "prefill" and row["npattn_gbps"] is None
    assert row["npattn_tflops"] == pytest.approx(3.5 * shape.forward_flops(True) / 1e-3 / 1e12)
    assert all(row[key] is None for key in ("torch_ms", "torch_tflops", "torch_gbps", "torch_backend",
                                            "share_of_torch"))
    line = bench_gpu.format_row(row)
    assert len(line) == len(bench_gpu.format_header())
    assert line.startswith("(1,2,64,16)") and line.split().count("-") == 6  # GB/s and torch's five


def test_table_row_shows_every_column():
    row = bench_gpu.make_row(GpuShape(64, 32, 8, 1, 2048, 128), False, "forward", "bfloat16",
                             _samples([1e-3], cudnn=[0.8e-3]), FACTS)
    line, header = bench_gpu.format_row(row), bench_gpu.format_header()
    assert len(line) == len(header)
    for title in ("npattn ms", "TFLOP/s", "GB/s", "torch ms", "torch backend", "of torch"):
        assert title in header
    for text in ("(64,32/8kv,1:2048,128)", "False", "forward", "1.000", "0.800", "cudnn", "80%",
                 f"{row['npattn_gbps']:.0f}", f"{row['torch_gbps']:.0f}"):
        assert text in line


def test_json_holds_every_row(tmp_path):
    rows = [bench_gpu.make_row(GpuShape(8, 32, 8, 1, 8192, 128), False, "forward", "float16",
                               _samples([2e-3], flash=[3e-3]), FACTS),
            bench_gpu.make_row(GpuShape(1, 2, 2, 64, 64, 16), True, "forward", "float16", _samples([1e-3]), FACTS)]
    path = tmp_path / "rows.json"
    bench_gpu.write_json(rows, path)
    assert json.loads(path.read_text()) == rows


class _FakeStream:
    def synchronize(self):
        pass


def _fake_cupy():
    """Just what bench_gpu.compare touches in CuPy, over NumPy arrays."""
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(get_current_stream=_FakeStream)
    cupy.ones = np.ones
    cupy.random = np.random
    return cupy


def test_compare_loop_with_stand_ins(monkeypatch, tmp_path):
    """The timing loop over every job, with fake CuPy, npattn on the CPU and fake torch
    backends (cuDNN refusing): rows, table and JSON agree."""
    monkeypatch.setattr(bench_gpu, "unavailable_reason", lambda: None)
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    monkeypatch.setattr(bench_gpu, "_device_name", lambda cupy: "Test GPU")
    monkeypatch.setattr(bench_gpu, "_torch", lambda: types.SimpleNamespace(__version__="2.9.0"))
    calls = []

    def npattn_runs(cupy, q, k, v, causal):
        calls.append((q.shape, k.shape, causal))
        return (lambda: None), (lambda: None)

    def refuse():
        raise RuntimeError("No available kernel")

    def torch_runs(torch, q, k, v, shape, causal, dtype):
        return {"torch:flash": ((lambda: None), (lambda: None)), "torch:cudnn": (refuse, refuse)}
    monkeypatch.setattr(bench_gpu, "_npattn_runs", npattn_runs)
    monkeypatch.setattr(bench_gpu, "_torch_runs", torch_runs)
    printed, path = io.StringIO(), tmp_path / "rows.json"
    shapes = [GpuShape(1, 2, 1, 8, 8, 16), GpuShape(2, 4, 2, 1, 32, 16)]
    rows = bench_gpu.compare(shapes, dtype="float32", repeats=2, json_path=path, out=printed,
                             progress=io.StringIO())
    assert calls == [((1, 2, 8, 16), (1, 1, 8, 16), False), ((1, 2, 8, 16), (1, 1, 8, 16), True),
                     ((2, 4, 1, 16), (2, 2, 32, 16), False)]
    assert [(row["suite"], row["causal"], row["passes"]) for row in rows] == [
        ("prefill", False, "forward"), ("prefill", False, "fwd+bwd"), ("prefill", True, "forward"),
        ("prefill", True, "fwd+bwd"), ("decode", False, "forward")]
    assert all(row["torch_backend"] == "flash" and list(row["torch_ms_by_backend"]) == ["flash"] for row in rows)
    assert json.loads(path.read_text()) == json.loads(json.dumps(rows))
    table = printed.getvalue()
    assert "Test GPU" in table and "torch 2.9.0" in table and table.count("flash") == len(rows)
    assert [row["suite"] for row in bench_gpu.compare(shapes, suite="decode", repeats=1, out=io.StringIO(),
                                                      progress=io.StringIO())] == ["decode"]


def test_command_line_refuses_a_suite_without_shapes(capsys):
    assert cli.main(["bench", "--gpu", "--suite", "decode", "--shape", "1,2,64,16"]) == 2
    assert "no shape given is in the decode suite" in capsys.readouterr().err


def test_command_line_reads_the_new_options():
    if bench_gpu.unavailable_reason() is None:
        pytest.skip("a GPU is usable here: bench --gpu would run")
    for argv in (["--suite", "prefill", "--json", "rows.json"], ["--dtype", "bfloat16"],
                 ["--shape", "8,32,8,1,8192,128", "--suite", "decode"]):
        assert cli.main(["bench", "--gpu", *argv]) == 2  # parsed, then stopped for want of a GPU


def test_asv_decode_targets_are_the_bench_decode_shapes():
    import pathlib

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "asv_benchmarks"))
    from benchmarks import attention as suite

    shapes = [GpuShape(*(int(x) for x in shape.split(","))) for shape in suite.GpuDecode.params[2]]
    assert shapes == list(bench_gpu.DECODE_SHAPES)
