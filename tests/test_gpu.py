"""The GPU backend: its CUDA sources compile for every instantiation (NVRTC, no GPU
needed, so this runs in CI), its host-side bookkeeping holds, and, where CUDA and CuPy
are usable, every option and dtype matches the float64 reference, forward and backward,
with the same bits on every run.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import npattn
from npattn.gpu import launch, sources
from npattn.gpu.options import ALL, Option, describe, options_of
from npattn.core.kernel_params import Int, Real

from conftest import backend_params, machine_code_names, nvrtc_or_skip, started_in_turn
from tolerances import assert_close
from strategies import Case, Dims, cases, layouts, to_layout
from test_backend_equivalence import check_backward, check_forward
from test_gpu_emulated import (PLANTED_V_AND_Q, assert_same_bits, check_codes_against_their_16_bit_values,
                               launched_splits, planted_in_v_and_q)
from test_nonfinite import assert_same_outputs, planted_cases
from test_quantized_cache import check_quantized_cache, quantized_cases

# sm_80's largest opt-in block of shared memory (163 KiB); sm_90 allows 227 KiB
_SM80_SHARED_BYTES = 163 * 1024

GPU = backend_params(["gpu"])


# ---- without a GPU ------------------------------------------------------------------------

def test_every_kernel_instantiation_compiles_for_every_architecture(machine_code, ptx_symbols):
    """The kernels whose machine code is read compile to machine code for every
    architecture, and every other instantiation to PTX for sm_90, side by side once per
    session by conftest's ``machine_code`` fixture (tests/test_gpu_machine_code.py reads
    the same cubins). The source has no code that depends on the architecture, so what
    compiles for one compiles for the other."""
    assert set(machine_code) == set(sources.ARCHITECTURES)
    assert sources.EVERY_INSTANTIATION_ARCHITECTURE in sources.ARCHITECTURES
    for architecture, (cubin, lowered) in machine_code.items():
        assert cubin, architecture
        assert set(machine_code_names(architecture)) <= set(lowered), architecture
        assert len(set(lowered.values())) == len(lowered), f"{architecture}: two instantiations share a symbol"
    every = {**machine_code[sources.EVERY_INSTANTIATION_ARCHITECTURE][1], **ptx_symbols}
    assert set(sources.name_expressions()) <= set(every)
    assert len(set(every.values())) == len(every), "two instantiations share a symbol"


def test_ci_reads_the_bfloat16_twins_machine_code_on_sm_90_only():
    """conftest.read_on: every checked kind of kernel is read on every architecture, in
    float16 at least; the bfloat16 twins on sm_90 alone."""
    from conftest import machine_code_names

    every = machine_code_names()
    on_sm_80, on_sm_90 = machine_code_names("sm_80"), machine_code_names("sm_90")
    assert on_sm_90 == every
    assert set(on_sm_80) == {name for name in every if not name.partition("<")[2].startswith("bf16_bits,")}
    assert any(name.partition("<")[2].startswith("half_bits,") for name in on_sm_80)
    assert {name.partition("<")[0] for name in on_sm_80} == {name.partition("<")[0] for name in every}


def test_the_source_has_no_code_that_depends_on_the_architecture():
    """Why CI compiles every instantiation for one architecture only: an ``#if`` on
    ``__CUDA_ARCH__`` (a Hopper-only path, say) would make an instantiation's compile
    depend on it, and then each architecture needs every instantiation compiled again
    (conftest.compiled_names, conftest.ptx_names)."""
    assert "__CUDA_ARCH__" not in sources.source()


def hopper_tiles():
    """NVRTC's compile of every tile the harness times, for sm_90, to PTX at the fastest
    compile level (the kernels use dynamic shared memory only, so ptxas has no size of
    theirs to refuse; on the 2-core Zen 3 VM, 2.0 s of one core alone, against 26.5 s to
    optimized PTX, and 32 s to optimized PTX and 73 s to a cubin under the suite's load):
    conftest starts it at collection
    (:func:`conftest.started_in_turn`), so that it runs beside the other tests."""
    from npattn.gpu import nvrtc
    from npattn.tools import tune_gpu

    return nvrtc.check_compiles("sm_90", names=tune_gpu.names(), machine_code=False)


def test_every_tile_the_harness_times_compiles_for_hopper():
    """What `bench --gpu --tiles` (npattn.tools.tune_gpu) will compile on a lent GPU, whose
    minutes are scarce: a candidate that does not compile is found here first."""
    nvrtc_or_skip()
    from npattn.tools import tune_gpu

    lowered = started_in_turn("hopper-tiles", hopper_tiles).result()
    assert len(lowered) == len(tune_gpu.names()) == len(set(lowered.values()))


@pytest.mark.parametrize("machine_code", [True, False], ids=["cubin", "unoptimized-ptx"])
def test_the_compile_check_fails_on_a_bad_instantiation(machine_code):
    """Both checks CI runs: to machine code, and to unoptimized PTX (ptx_names')."""
    nvrtc_or_skip()
    from npattn.gpu import nvrtc

    with pytest.raises(nvrtc.CompileError, match="forward_kernel"):
        # Storage<int> has no definition: the template cannot be instantiated
        nvrtc.check_compiles("sm_80", names=["forward_kernel<int, float, 64, 32>"], machine_code=machine_code)


def test_unoptimized_ptx_instantiates_what_optimized_ptx_does():
    """The unoptimized check compiles the same instantiations to the same symbols, at the
    fastest compile level where this NVRTC has one, and NVVM's optimizer is what it leaves
    out (its PTX differs)."""
    nvrtc_or_skip()
    from npattn.gpu import nvrtc

    if nvrtc.version() >= (12, 9):  # (the version the project's test wheels bring)
        assert nvrtc._fast_compile_options() == (nvrtc.FAST_COMPILE_OPTION,)

    names = [sources.kernel_name("forward", "float32", 64), sources.kernel_name("dq", "float32", 64)]
    optimized, optimized_symbols = nvrtc.compile_ptx("sm_90", names)
    unoptimized, unoptimized_symbols = nvrtc.compile_ptx("sm_90", names, optimized=False)
    assert unoptimized_symbols == optimized_symbols
    for symbol in optimized_symbols.values():
        assert f".entry {symbol}(".encode() in unoptimized
    assert unoptimized != optimized


def test_every_dtype_and_kind_has_instantiations():
    names = sources.name_expressions()
    assert len(names) == len(set(names))
    for dtype_name in sources.STORAGE:
        forward = sources.forward_kind(dtype_name)
        assert forward == ("forward_tc" if dtype_name in ("float16", "bfloat16") else "forward")
        for bound in sources.HEAD_DIM_BOUNDS:
            for kind in ("dkdv", "dq", "combine"):
                assert sources.kernel_name(kind, dtype_name, bound) in names
            if forward == "forward":
                assert sources.kernel_name(forward, dtype_name, bound) in names
                continue
            # the tensor-core forward: every tile shape the driver picks, plain and fully optioned
            for rows in (1, 16, 17, 64, 65, 4096):
                for options in (0, Option.BAND, ALL):
                    tile = sources.forward_tc_config(rows, bound, options)
                    assert sources.kernel_name(forward, dtype_name, bound, tile=tile, options=options) in names
        for kind in ("weights", "dbias"):
            assert sources.kernel_name(kind, dtype_name) in names


def test_the_source_defines_every_parameter_position():
    text = sources.source()
    for member in Int:
        assert f"#define NPATTN_INT_{member.name} {member.value}\n" in text
    for member in Real:
        assert f"#define NPATTN_REAL_{member.name} {member.value}\n" in text
    assert '#include "' not in text, "local includes must be inlined: NVRTC gets no include path"
    # common.cuh's strided_key_row reads an array's B, H and S strides as three in a row
    for array in ("Q", "K", "V", "K_SCALE", "V_SCALE"):
        assert [Int[f"{array}_STRIDE_{axis}"] - Int[f"{array}_STRIDE_B"] for axis in "BHS"] == [0, 1, 2], array


@pytest.mark.parametrize("head_dim, bound", [(1, 64), (64, 64), (65, 128), (128, 128), (200, 256), (256, 256)])
def test_head_dims_pick_the_smallest_accumulator(head_dim, bound):
    assert sources.head_dim_bound(head_dim, 1) == bound
    assert sources.head_dim_bound(1, head_dim) == bound


def test_head_dims_past_the_largest_bound_are_refused_by_name():
    with pytest.raises(ValueError, match="up to 256, got 257"):
        sources.head_dim_bound(257, 64)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_shared_memory_fits_an_sm80_block_at_the_widest_heads(dtype):
    widest = sources.MAX_HEAD_DIM
    assert launch.forward_shared_bytes(widest, widest, dtype) <= _SM80_SHARED_BYTES
    assert launch.backward_shared_bytes(widest, widest, dtype) <= _SM80_SHARED_BYTES


@pytest.mark.parametrize("rows", [1, 64, 65])
def test_tensor_core_shared_memory_fits_an_sm80_block_at_the_widest_heads(rows):
    for bound in sources.HEAD_DIM_BOUNDS:
        tile = sources.forward_tc_config(rows, bound)
        assert launch.forward_tc_shared_bytes(bound, bound, tile) <= _SM80_SHARED_BYTES
    # swizzled rows hold a multiple of 64 values; the output tile reuses the same bytes
    tile = sources.ForwardTile(4, 1, 64)
    assert launch.forward_tc_shared_bytes(17, 8, tile) == launch.forward_tc_shared_bytes(64, 64, tile)
    for tile in (sources.ForwardTile(8, 1, 64), sources.ForwardTile(4, 2, 64)):  # 128 rows: the staged output is larger
        assert launch.forward_tc_shared_bytes(16, 256, tile) == 2 * 128 * 256


def test_tensor_core_forward_tiles_follow_the_packed_rows():
    Tile = sources.ForwardTile
    assert sources.forward_tc_config(1, 128) == Tile(1, 1, 32)       # a decode step's GQA group
    assert sources.forward_tc_config(1, 64) == Tile(1, 1, 64)
    assert sources.forward_tc_config(64, 128) == Tile(4, 1, 64)
    assert sources.forward_tc_config(4096, 256) == Tile(4, 1, 32)    # accumulators of 256 columns
    assert Tile(4, 2, 64).block_q == 128 and Tile(4, 2, 64).threads == 128
    # prefill: two row fragments per warp with no option but the band and pages
    assert sources.forward_tc_config(4096, 128) == Tile(8, 2, 64)
    assert sources.forward_tc_config(4096, 128, Option.BAND | Option.PAGED) == Tile(8, 2, 64)
    assert sources.forward_tc_config(4096, 64) == Tile(8, 2, 64)
    assert sources.forward_tc_config(4096, 64, Option.BAND) == Tile(4, 2, 64)
    # other options keep one fragment per warp: their state needs the registers
    for option in (Option.MASK, Option.BIAS, Option.ALIBI, Option.SOFTCAP, Option.DROPOUT, Option.SINK, Option.NARROW):
        assert sources.forward_tc_config(4096, 128, option | Option.BAND) == Tile(8, 1, 64), option
        assert sources.forward_tc_config(4096, 64, option) == Tile(8, 1, 64), option


def test_only_two_fragment_forwards_may_keep_a_little_stack():
    names = sources.forward_tc_names("float16", 128)
    allowed = {name: sources.stack_allowance(name) for name in names}
    assert {name for name, allowance in allowed.items() if allowance} == {
        sources.kernel_name("forward_tc", "float16", 128, tile=sources.ForwardTile(8, 2, 64), options=options)
        for options in (0, Option.BAND)}
    assert set(allowed.values()) == {0, sources.TWO_FRAGMENT_STACK_BYTES}


def test_a_forced_tile_takes_prefill_calls_only_inside_its_block():
    tile = sources.ForwardTile(4, 2, 32)
    with sources.forced_forward_tile(tile):
        assert sources.forward_tc_config(4096, 128) == tile
        assert sources.forward_tc_config(16, 128) == sources.ForwardTile(1, 1, 32)  # decode keeps its own
    with sources.forced_forward_tile(sources.ForwardTile(1, 1, 128), decode=True):
        assert sources.forward_tc_config(16, 128) == sources.ForwardTile(1, 1, 128)
        assert sources.forward_tc_config(4096, 128) == sources.ForwardTile(8, 2, 64)
    assert sources.forward_tc_config(4096, 128) == sources.ForwardTile(8, 2, 64)


def test_options_name_what_a_call_needs():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(1, 2, 4, 8)).astype(np.float16)
    from npattn.core.validation import build_problem

    def needed(**options):
        return options_of(build_problem(q, q, q, **options), (q, q, q))

    assert needed() == Option(0)
    assert needed(causal=True) == Option.BAND
    assert needed(window=2) == Option.BAND
    assert needed(kv_lengths=np.array([3])) == Option.BAND
    assert needed(q_lengths=np.array([3])) == Option(0)  # rows past it are never computed
    assert needed(bias=np.zeros((4, 4))) == Option.BIAS
    assert needed(mask=np.ones((4, 4), bool), softcap=2.0) == Option.MASK | Option.SOFTCAP
    assert needed(dropout_p=0.1, seed=1) == Option.DROPOUT
    assert needed(alibi_slopes=np.ones(2), sink_logits=np.zeros(2)) == Option.ALIBI | Option.SINK
    odd = rng.normal(size=(1, 2, 4, 12)).astype(np.float16)
    assert options_of(build_problem(odd, odd, odd), (odd, odd, odd)) == Option.UNALIGNED
    sliced = q[..., 1:7]  # rows that start 2 bytes into a 16-byte line
    assert options_of(build_problem(q, q, q), (sliced, q, q)) & Option.UNALIGNED
    assert describe(Option.BIAS | Option.BAND) == "BAND|BIAS" and describe(0) == "none"


def test_tensor_core_backward_fits_an_sm80_block_and_is_routed_by_dtype_and_width():
    widest = max(sources.TENSOR_CORE_BACKWARD_BOUNDS)
    for kind in ("dkdv_tc", "dq_tc"):
        assert launch.backward_tc_shared_bytes(kind, widest, widest) <= _SM80_SHARED_BYTES
    assert sources.backward_kinds("float16", 128) == ("dkdv_tc", "dq_tc")
    assert sources.backward_kinds("bfloat16", 64) == ("dkdv_tc", "dq_tc")
    assert sources.backward_kinds("float16", 256) == ("dkdv", "dq")  # too wide for the registers
    assert sources.backward_kinds("float32", 64) == ("dkdv", "dq")


def test_shared_memory_grows_with_the_head_dims():
    for size in (launch.forward_shared_bytes, launch.backward_shared_bytes):
        assert size(64, 64, np.float32) < size(128, 64, np.float32) < size(128, 128, np.float32)
    # float64 forward tiles have half the keys (sources.FORWARD_BLOCK_K); the backward's do not
    assert launch.backward_shared_bytes(64, 64, np.float64) == 2 * launch.backward_shared_bytes(64, 64, np.float32)
    assert launch.forward_shared_bytes(64, 64, np.float64) < 2 * launch.forward_shared_bytes(64, 64, np.float32)


def test_import_needs_no_cupy():
    import subprocess

    code = "import npattn.gpu, npattn.gpu.sources, npattn.gpu.launch, sys; print('cupy' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


# ---- on a GPU -----------------------------------------------------------------------------

@dataclass(frozen=True)
class DeviceCase(Case):
    """A :class:`Case` whose calls take CuPy arrays (options included) and hand NumPy back,
    so the reference comparisons of test_backend_equivalence apply unchanged."""

    def _device_call(self, function, backend, layout, overrides):
        import cupy

        q, k, v = (cupy.asarray(to_layout(a, layout)) for a in (self.q, self.k, self.v))
        options = {name: cupy.asarray(value) if isinstance(value, np.ndarray) else value
                   for name, value in {**self.options, **overrides}.items()}
        return function(q, k, v, **options, layout=layout, backend=backend)

    def run(self, backend="reference", layout="bhsd", **overrides):
        return _to_host(self._device_call(npattn.attention, backend, layout, overrides))

    def vjp(self, backend="reference", layout="bhsd", **overrides):
        import cupy

        outputs, vjp = self._device_call(npattn.attention_vjp, backend, layout, overrides)
        return _to_host(outputs), lambda dout: _to_host(vjp(cupy.asarray(dout)))


def _to_host(result):
    import cupy

    if isinstance(result, tuple):
        return tuple(cupy.asnumpy(x) for x in result)
    return cupy.asnumpy(result)


def on_device(case):
    return DeviceCase(case.dims, case.q, case.k, case.v, case.options)


@pytest.mark.parametrize("backend", GPU)
@given(case=cases(dtypes=("float16", "float32", "float64")), layout=layouts)
def test_gpu_forward_matches_the_reference(backend, case, layout):
    check_forward(backend, on_device(case), layout)


@pytest.mark.parametrize("backend", GPU)
@given(case=cases(dtypes=("float16", "float32", "float64")), layout=layouts)
def test_gpu_backward_matches_the_reference(backend, case, layout):
    check_backward(backend, on_device(case), layout)


def _wide_case(head_dim, value_dim, dtype, **options):
    rng = np.random.default_rng(head_dim + value_dim)
    d = Dims(batch=2, heads=4, kv_heads=2, q_len=70, kv_len=90, head_dim=head_dim, value_dim=value_dim)

    def uniform(*shape):
        return rng.uniform(-1, 1, size=shape).astype(dtype)

    return DeviceCase(d, uniform(2, 4, 70, head_dim), uniform(2, 2, 90, head_dim), uniform(2, 2, 90, value_dim),
                      options)


@pytest.mark.parametrize("backend", GPU)
@pytest.mark.parametrize("head_dim, value_dim", [(256, 256), (200, 72), (8, 136)])
@pytest.mark.parametrize("options", [{}, {"causal": True, "dropout_p": 0.3, "seed": 5, "softcap": 3.0}])
def test_gpu_wide_and_uneven_heads(backend, head_dim, value_dim, options):
    case = _wide_case(head_dim, value_dim, np.float32, **options)
    check_forward(backend, case, "bhsd")
    check_backward(backend, case, "bshd")


@pytest.mark.parametrize("backend", GPU)
@pytest.mark.parametrize("bound", [64, 128])
@pytest.mark.parametrize("options", [{}, {"causal": True},
                                     {"causal": True, "softcap": 3.0, "dropout_p": 0.2, "seed": 3,
                                      "kv_lengths": np.array([60, 90]), "window": (40, 0), "sinks": 2}])
def test_gpu_forward_at_every_candidate_tile(backend, bound, options):
    """Every tile the tuning harness times (``bench --gpu --tiles``) computes the reference's
    answer on the device, so a tile it finds fastest can become the default."""
    from npattn.runtime import plans
    from npattn.tools import tune_gpu

    case = _wide_case(bound, bound, np.float16, **options)
    for tile in tune_gpu.TILES[bound]:
        plans.clear()  # a kept plan of this structure would run its own tile
        try:
            with sources.forced_forward_tile(tile):
                check_forward(backend, case, "bhsd")
        finally:
            plans.clear()


@pytest.mark.parametrize("backend", GPU)
@pytest.mark.parametrize("options", [{}, {"kv_lengths": np.array([700, 1000])}])
def test_gpu_decode_at_every_candidate_tile(backend, options):
    """Every decode tile the tuning harness times, one query row against 1000 keys split
    across blocks, computes the reference's answer on the device."""
    from npattn.runtime import plans
    from npattn.tools import tune_gpu

    rng = np.random.default_rng(9)
    q = rng.uniform(-2, 2, (2, 8, 1, 128)).astype(np.float16)
    k, v = (rng.uniform(-1, 1, (2, 2, 1000, 128)).astype(np.float16) for _ in range(2))
    case = DeviceCase(Dims(batch=2, heads=8, kv_heads=2, q_len=1, kv_len=1000, head_dim=128, value_dim=128),
                      q, k, v, options)
    for tile in tune_gpu.DECODE_TILES:
        plans.clear()
        try:
            with sources.forced_forward_tile(tile, decode=True):
                check_forward(backend, case, "bhsd")
        finally:
            plans.clear()


@pytest.mark.parametrize("backend", GPU)
def test_gpu_backward_gives_the_same_bits_on_every_run(backend):
    import cupy

    case = _wide_case(64, 64, np.float32, causal=True, bias=np.random.default_rng(1).normal(size=(4, 70, 90)),
                      dropout_p=0.2, seed=3)
    dout = cupy.asarray(np.random.default_rng(2).normal(size=(2, 4, 70, 64)).astype(np.float32))
    runs = []
    for _ in range(3):
        _, vjp = case._device_call(npattn.attention_vjp, backend, "bhsd", {})
        runs.append([cupy.asnumpy(g) for g in vjp(dout)])
    for run in runs[1:]:
        for first, again in zip(runs[0], run):
            np.testing.assert_array_equal(first, again)


@pytest.mark.parametrize("backend", GPU)
def test_gpu_is_what_auto_picks_for_cupy(backend):
    import cupy

    q = cupy.asarray(np.random.default_rng(0).normal(size=(1, 2, 5, 8)).astype(np.float32))
    auto = cupy.asnumpy(npattn.attention(q, q, q))
    named = cupy.asnumpy(npattn.attention(q, q, q, backend="gpu"))
    np.testing.assert_array_equal(auto, named)


def test_compiled_kernels_are_kept_on_disk_per_instantiation(tmp_path, monkeypatch):
    """A second process (here: a second call) reads the cubin and its mangled symbol
    instead of compiling; another instantiation or architecture gets its own file."""
    from npattn.gpu import kernel_cache, nvrtc

    nvrtc_or_skip()
    monkeypatch.setenv("NPATTN_CACHE_DIR", str(tmp_path))
    name = sources.kernel_name("combine", "float32", 64)
    path, symbol = kernel_cache.cubin("sm_80", name)
    assert path.parent == tmp_path and path.read_bytes()
    assert symbol == nvrtc.check_compiles("sm_80", [name])[name]

    def no_compiling(*args, **kwargs):
        raise AssertionError("compiled again instead of reading the cache")

    monkeypatch.setattr(nvrtc, "compile_cubin", no_compiling)
    assert kernel_cache.cubin("sm_80", name) == (path, symbol)
    assert kernel_cache.key("sm_90", name) != kernel_cache.key("sm_80", name)
    assert kernel_cache.key("sm_80", sources.kernel_name("combine", "float64", 64)) != kernel_cache.key("sm_80", name)


def test_tuning_switches_reach_nvrtc_and_the_cache_key(monkeypatch):
    """NPATTN_GPU_DEFINES (the harness's A/B switches) becomes one -D per name, after the
    architecture's own (sm_89 and later: the hardware e4m3 conversion, which
    NPATTN_SOFTWARE_E4M3 leaves out), and a cubin built with them never stands in for the
    default build's."""
    from npattn.gpu import kernel_cache

    nvrtc_or_skip()
    name = sources.kernel_name("combine", "float32", 64)
    monkeypatch.delenv("NPATTN_GPU_DEFINES", raising=False)
    default_options, default_key = sources.compile_options("sm_90"), kernel_cache.key("sm_90", name)
    assert [option for option in default_options if option.startswith("-D")] == ["-DNPATTN_HARDWARE_E4M3"]
    assert not any(option.startswith("-D") for option in sources.compile_options("sm_80"))
    assert sources.compile_options("compute_90") == ("--gpu-architecture=compute_90", *default_options[1:])
    monkeypatch.setenv("NPATTN_GPU_DEFINES", " NPATTN_A  NPATTN_B ")
    assert sources.compile_options("sm_90") == (*default_options, "-DNPATTN_A", "-DNPATTN_B")
    assert kernel_cache.key("sm_90", name) != default_key
    monkeypatch.setenv("NPATTN_GPU_DEFINES", "NPATTN_SOFTWARE_E4M3")
    assert sources.compile_options("sm_90")[-1:] == ("-DNPATTN_SOFTWARE_E4M3",)
    assert "-DNPATTN_HARDWARE_E4M3" not in sources.compile_options("sm_90")


@pytest.mark.parametrize("backend", GPU)
@given(case=planted_cases())
def test_gpu_forward_gives_the_references_non_finite_rows(backend, case):
    """NaN and inf planted in q, k, v and bias under every option (the SIMT kernels, float32
    and float64): out and lse as the reference's, from the device alone (the repair pass;
    a planned call does not check out on the host)."""
    out, lse = on_device(case).run(backend, return_lse=True)
    expected_out, expected_lse = case.run("reference", return_lse=True)
    assert_same_outputs(out, lse, expected_out, expected_lse, case)


@pytest.mark.parametrize("backend", GPU)
@given(case=quantized_cases(dtypes=("float16", "float32", "float64"), head_dims=(16, 64)),
       seed=st.integers(0, 2**32 - 1))
def test_gpu_decodes_against_quantized_caches(backend, case, seed):
    """int8 and float8 e4m3 caches on the device (test_quantized_cache.check_quantized_cache)."""
    import cupy

    check_quantized_cache(backend, case, seed, device=cupy)


@pytest.mark.parametrize("backend", GPU)
@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
@pytest.mark.parametrize("kind", ["int8", "float8_e4m3"])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("q_len", [1, 5])
def test_gpu_codes_match_their_16_bit_values(backend, kind, paged, q_len, dtype):
    """On the device: a paged cache's codes staged and dequantized into 16-bit tiles (the
    bits of a 16-bit cache), a contiguous cache's read into registers and scaled outside
    the products (within the reference's bound and twice the 16-bit cache's error)
    (test_gpu_emulated.check_codes_against_their_16_bit_values)."""
    import cupy

    check_codes_against_their_16_bit_values(kind, paged, q_len, dtype, xp=cupy)
    if not paged and q_len == 1:  # every finite code once per (kind, dtype)
        check_codes_against_their_16_bit_values(kind, paged, q_len, dtype, xp=cupy, every_code=True)


@pytest.mark.parametrize("backend", GPU)
@pytest.mark.parametrize("kind", ["int8", "float8_e4m3", "float16"])  # decode_tc.cu's tile; forward_tc.cu's
def test_gpu_forward_merges_its_splits_with_the_combines_bits(backend, kind, monkeypatch):
    """On the device, where blocks run at once: issue 38's decode step (16, 32/8, 1 x
    2048, 128), of 2 splits a row (256 blocks of the transposed tile over a quantized
    cache) or 8 (1024 one-warp blocks over a float16 one), merges them in the forward
    (the last block of each item, counted by an atomic; merge.cuh) with the bits of the
    combine (driver.MERGED_SPLITS = 0), on every one of 20 runs and 20 replays of a CUDA
    graph that captured it (a block that merged before another's partials landed, or a
    counter left set, would show), and within the float64 reference's bounds."""
    import cupy

    from npattn.gpu import driver, launch
    from npattn.runtime import plans
    from test_serving import assert_lse, assert_out, call_case

    rng = np.random.default_rng(31)
    batch, heads, kv_heads, length, dim = 16, 32, 8, 2048, 128
    k, v = (rng.standard_normal((batch, length, kv_heads, dim), np.float32) for _ in range(2))
    if kind == "float16":
        (k_codes, k_scale), (v_codes, v_scale) = (k.astype(np.float16), None), (v.astype(np.float16), None)
    else:
        (k_codes, k_scale), (v_codes, v_scale) = npattn.quantize_kv(k, kind), npattn.quantize_kv(v, kind)
    q = rng.standard_normal((batch, 1, heads, dim), np.float32).astype(np.float16)
    on_device = [None if x is None else cupy.asarray(x) for x in (q, k_codes, v_codes, k_scale, v_scale)]
    launched, real_kernel = [], launch.kernel

    def kernel(kind_, *arguments, **config):  # (plans launch what launch.kernel gave them)
        launcher = real_kernel(kind_, *arguments, **config)

        def spied(blocks, operands):
            launched.append((kind_, launched_splits(operands) if kind_ == "forward_tc" else None))
            return launcher(blocks, operands)
        return spied

    monkeypatch.setattr(launch, "kernel", kernel)

    def step():
        plans.clear()
        plan = npattn.plan_with_kvcache(on_device[0], on_device[1], on_device[2], cache_seqlens=length,
                                        k_scale=on_device[3], v_scale=on_device[4], return_lse=True, backend=backend)
        return plan, (lambda: plan.run(on_device[0], on_device[1], on_device[2], k_scale=on_device[3],
                                       v_scale=on_device[4]))

    _, run = step()
    merged = [x.get() for x in run()]
    splits = [count for kind_, count in launched if kind_ == "forward_tc"]
    assert splits == [2 if kind != "float16" else 8] and "combine" not in dict(launched), launched
    for _ in range(20):
        for got, want in zip(run(), merged):
            assert_same_bits(got.get(), want)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        run()
        stream.synchronize()
        stream.begin_capture()
        captured = run()
        graph = stream.end_capture()
        for _ in range(20):
            for x in captured:
                x.fill(0)
            graph.launch(stream)
            stream.synchronize()
            for got, want in zip(captured, merged):
                assert_same_bits(got.get(), want)
    monkeypatch.setattr(driver, "MERGED_SPLITS", 0)
    launched.clear()
    _, run = step()
    combined = [x.get() for x in run()]
    assert "combine" in dict(launched), launched
    for got, want in zip(combined, merged):
        assert_same_bits(got, want)
    plans.clear()
    keys, values = (x.astype(np.float64) if scale is None else npattn.dequantize_kv(x, scale, np.float64)
                    for x, scale in ((k_codes, k_scale), (v_codes, v_scale)))
    for b in (0, batch - 1):
        expected, expected_lse = npattn.attention(q[b:b + 1].astype(np.float64), keys[b:b + 1], values[b:b + 1],
                                                  layout="bshd", return_lse=True, backend="reference")
        case = call_case(q[b:b + 1], keys[b:b + 1], values[b:b + 1], {})
        assert_out(merged[0][b:b + 1], expected, case)
        assert_lse(merged[1][b:b + 1], expected_lse, case)


@pytest.mark.parametrize("backend", GPU)
def test_gpu_bench_of_caches_times_each_cache_against_int8(backend):
    """``bench --caches --gpu`` runs a planned step on each cache dtype and reports int8's
    speed-up over each."""
    import io

    from npattn.tools import bench_caches

    printed = io.StringIO()
    results = bench_caches.compare_gpu(repeats=1, shapes=((2, 4, 2, 256, 64),), out=printed)
    ((label, timed),) = results.items()
    assert label == "(2, 4/2, 256, 64)" and set(bench_caches.GPU_CACHES) <= set(timed)
    assert timed["int8"][1] == 1.0 and all(us > 0 for us, _ in timed.values())


@pytest.mark.parametrize("backend", GPU)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])  # the SIMT kernels, the tensor-core ones
@pytest.mark.parametrize("q_len, kv_len, options", PLANTED_V_AND_Q)
def test_gpu_forward_gives_the_references_non_finite_rows_in_v_and_q(backend, dtype, q_len, kv_len, options):
    """NaN and inf in v of keys some rows do not see, a NaN query row and a NaN key
    (test_gpu_emulated.planted_in_v_and_q), on the device."""
    case = planted_in_v_and_q(dtype, q_len, kv_len, options)
    out, lse = on_device(case).run(backend, return_lse=True)
    expected_out, expected_lse = case.run("reference", return_lse=True)
    assert_same_outputs(out, lse, expected_out, expected_lse, case)


@pytest.mark.parametrize("backend", GPU)
@pytest.mark.parametrize("q_len, kv_len", [(1, 3000), (16, 16)])  # a split decode step; a small call
def test_gpu_planned_call_replays_in_a_cuda_graph(backend, q_len, kv_len):
    """A planned call waits for nothing on the host (no check of out, no sync), so a CUDA
    graph can capture it: 100 replays with new q, k and v contents give the bits of
    uncaptured calls on the same inputs."""
    import cupy

    rng = cupy.random.default_rng(9)
    q = rng.standard_normal((2, 8, q_len, 128), np.float32).astype(np.float16)
    k, v = (rng.standard_normal((2, 2, kv_len, 128), np.float32).astype(np.float16) for _ in range(2))
    plan = npattn.plan(q, k, v, causal=True, return_lse=True, backend=backend)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        plan.run(q, k, v)
        stream.synchronize()
        stream.begin_capture()
        captured_out, captured_lse = plan.run(q, k, v)
        graph = stream.end_capture()
        for _ in range(100):
            for x in (q, k, v):
                x[...] = rng.standard_normal(x.shape, np.float32).astype(np.float16)
            graph.launch(stream)
            replayed = captured_out.copy(), captured_lse.copy()
            expected = plan.run(q, k, v)
            for got, want in zip(replayed, expected):
                assert bool(cupy.array_equal(got, want))


@pytest.mark.parametrize("backend", GPU)
def test_gpu_results_of_non_finite_inputs_are_the_references(backend):
    """A NaN in v reaches exactly the rows that see its key, forward (the repair pass
    recomputes on the device the rows the tile products made NaN) and backward (the
    check of the gradients sends them to the reference)."""
    import cupy

    rng = np.random.default_rng(4)
    q, k, v = (rng.normal(size=(1, 2, 6, 8)).astype(np.float32) for _ in range(3))
    v[0, 1, 2, 3] = np.nan
    dout = rng.normal(size=(1, 2, 6, 8)).astype(np.float32)
    out, vjp = npattn.attention_vjp(*(cupy.asarray(x) for x in (q, k, v)), causal=True, backend=backend)
    grads = vjp(cupy.asarray(dout))
    expected_out, expected_vjp = npattn.attention_vjp(q, k, v, causal=True, backend="reference")
    for got, expected in zip((out, *grads), (expected_out, *expected_vjp(dout))):
        got = cupy.asnumpy(got)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
        finite = ~np.isnan(expected)
        # the reference's float64 answer, rounded once to float32
        assert_close(got[finite], expected[finite], np.float32, 1, np.abs(expected[finite]).max(initial=1.0))
    nan = np.isnan(cupy.asnumpy(out))  # column 3 of the rows that see key 2, nothing else
    assert nan[0, 1, 2:, 3].all() and nan.sum() == 4
