"""The CUDA kernels, built for the host (tests/gpu_emulation.h) and run through the GPU
backend's own driver, against the float64 reference: every option, dtype and layout,
forward and backward. This is how the kernels' logic is tested on machines with no
GPU (CI's); test_gpu.py holds them to the same properties on a real device.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn
from npattn.gpu.options import Option
from strategies import DECISIVE_EXAMPLES, Case, Dims, cases, dims, layouts
from test_backend_equivalence import check_backward, check_forward, check_peaked_backward, peaked_cases, upcast
from test_nonfinite import assert_same_outputs, check_kernel_marks_non_finite_rows, planted_cases
from test_odd_views import DEVICE_VIEW_KINDS, check_odd_views, viewed_cases
from test_options import check_option_is_read
from test_quantized_cache import (check_paged_varlen_quantized, check_planned_quantized_step, check_quantized_cache,
                                  quantized_cases)
from test_serving import (cache_cases, check_kvcache, check_paged_forward, check_varlen, packed_batches,
                          paged_cases)

import gpu_emulation
import tolerances
from conftest import emulation

pytestmark = pytest.mark.skipif(gpu_emulation.compiler() is None, reason="needs g++ to build the emulation")
ALL_DTYPES = ("float16", "bfloat16", "float32", "float64")
# The shared strategies draw lengths up to 9: one tile of the GPU kernels (16 query rows,
# 16-32 keys; 64 x 64 on tensor cores). Lengths up to 80 cover several query and key
# tiles of each (the online softmax
# across key tiles, dK/dV over query tiles), at a cost: each emulated launch runs every
# CUDA thread in turn on one core, so those get fewer examples.
MANY_TILES = dims(max_len=80, max_dim=24)
# Each emulated launch runs every CUDA thread in turn on one core: the properties here draw a
# quarter of the profile's examples (25 in CI, 250 with --hypothesis-profile=dev), those
# over many tiles an eighth; the same properties on a real GPU (test_gpu.py) and on the
# CPU draw the full count.
EMULATED = settings(max_examples=max(10, settings().max_examples // 4))
FEWER = settings(max_examples=max(8, settings().max_examples // 8))


def launched_splits(arguments) -> int:
    """The key splits of a forward launch, from its ``arguments`` (the operands, then out,
    its three strides, lse, splits and partial): more than 1 where its blocks split the
    keys and their partials are merged (by the forward's own last block of each item, or
    by the combine)."""
    from npattn.core.kernel_params import OPERAND_NAMES

    return int(arguments[len(OPERAND_NAMES) + 5])


def recorded_launches(monkeypatch) -> list:
    """A list that every emulated launch from now on appends ``(kind, splits, options)``
    to (splits and options: a tensor-core forward's, else None)."""
    from npattn.gpu import launch

    launched, emulated_run = [], launch.run

    def spy(kind, storage, bound, blocks, shared_bytes, arguments, **config):
        forward = kind == "forward_tc"
        launched.append((kind, launched_splits(arguments) if forward else None,
                         config["options"] if forward else None))
        return emulated_run(kind, storage, bound, blocks, shared_bytes, arguments, **config)

    monkeypatch.setattr(launch, "run", spy)
    return launched


def assert_same_bits(got, want):
    """``got`` and ``want`` hold the same bits (NaN payloads and the sign of 0 included)."""
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    np.testing.assert_array_equal(got.view(f"u{got.itemsize}"), want.view(f"u{want.itemsize}"))


@pytest.fixture(scope="module", autouse=True)
def emulated_gpu(request):
    built = emulation(request.config)  # started at collection (conftest.started)
    patch = pytest.MonkeyPatch()
    with gpu_emulation.emulated_gpu(patch, built):
        yield
    patch.undo()
    if os.environ.get(gpu_emulation.WRITE_AHEAD_VARIABLE) == "1":
        built.write_ahead_list()


# float64 runs the SIMT kernels, float16 the tensor-core ones: an option of the table that
# either leaves out of its scores or gradients fails here.
@pytest.mark.parametrize("dtype", ["float64", "float16"])
@pytest.mark.parametrize("name", sorted(DECISIVE_EXAMPLES))
def test_every_option_is_read_by_the_emulated_gpu_kernels(name, dtype):
    check_option_is_read("gpu", name, dtype)


@EMULATED
@given(case=cases(dtypes=ALL_DTYPES), layout=layouts)
def test_emulated_gpu_forward_matches_the_reference(case, layout):
    check_forward("gpu", case, layout)


@EMULATED
@given(case=cases(dtypes=ALL_DTYPES), layout=layouts)
def test_emulated_gpu_backward_matches_the_reference(case, layout):
    check_backward("gpu", case, layout)


_LAST_BLOCKS = r"""
// out[block] = whether the block (split block % splits of item block / splits) found
// itself the last of its item's blocks to count itself (merge.cuh's last_of_splits)
__global__ void last_blocks(unsigned* counters, int* out, long long splits) {
    NPATTN_DYNAMIC_SHARED(shared);
    const bool last = last_of_splits(counters + blockIdx.x / splits, splits, reinterpret_cast<int*>(shared));
    if (threadIdx.x == 0) out[blockIdx.x] = last;
}
"""


def test_exactly_one_block_of_each_split_item_merges_it(tmp_path):
    """The forward's merge of a split work item runs in exactly one block, the last of
    the item's blocks to finish, whichever that is (the emulation's blocks run first to
    last, then last to first), and leaves the item's counter at 0 for the next launch:
    on a GPU a second block merging the item would race the blocks still writing it."""
    from npattn.gpu import sources

    library, launchers = gpu_emulation.build_source(tmp_path, sources.source() + _LAST_BLOCKS, ["last_blocks"])
    items, splits = 3, 4
    for reversed_blocks, last_split in ((0, splits - 1), (1, 0)):
        counters, out = np.zeros(items, np.uint32), np.full(items * splits, -1, np.int32)
        library.npattn_emulation_reverse_blocks(reversed_blocks)
        gpu_emulation.run_kernel(library, launchers, "last_blocks", items * splits, 64, 16, (counters, out, splits))
        library.npattn_emulation_reverse_blocks(0)
        expected = np.zeros((items, splits), np.int32)
        expected[:, last_split] = 1
        np.testing.assert_array_equal(out.reshape(items, splits), expected)
        assert not counters.any()


_ECHO_SCALARS = r"""
// copies the struct passed by value back out, with its size as C lays it out
__global__ void echo_scalars(i64* ints, float* reals, i64* size, const __grid_constant__ ParameterScalars<float> scalars) {
    if (threadIdx.x != 0) return;
    for (int i = 0; i < NPATTN_INT_COUNT; ++i) ints[i] = scalars.ints[i];
    for (int i = 0; i < NPATTN_REAL_COUNT; ++i) reals[i] = scalars.reals[i];
    *size = sizeof(scalars);
}
"""


def test_parameter_scalars_travel_as_a_one_element_structured_array(tmp_path):
    """NPATTN_PARAMETER_SCALARS's struct leaves the driver in the form CuPy passes by value
    whatever its size (a size-one NumPy array: CuPy's ``CNumpyArray``, a pointer to its
    bytes), not as a NumPy scalar (CuPy's scalar conversion holds 64 bytes), with the
    C struct's size and field offsets."""
    from npattn.core.kernel_params import Int, Real
    from npattn.gpu import driver, sources

    ints = np.arange(len(Int), dtype=np.int64) * 7 - 3
    reals = np.linspace(-1.5, 2.5, len(Real)).astype(np.float32)
    value = driver._scalars_by_value(ints, reals)
    assert isinstance(value, np.ndarray) and value.size == 1 and value.dtype.fields is not None
    library, launchers = gpu_emulation.build_source(tmp_path, sources.source() + _ECHO_SCALARS, ["echo_scalars"])
    ints_out, reals_out, size = np.zeros_like(ints), np.zeros_like(reals), np.zeros(1, np.int64)
    gpu_emulation.run_kernel(library, launchers, "echo_scalars", 1, 32, 0, (ints_out, reals_out, size, value))
    assert size[0] == value.dtype.itemsize
    np.testing.assert_array_equal(ints_out, ints)
    np.testing.assert_array_equal(reals_out, reals)


@pytest.mark.parametrize("options", [
    dict(causal=True, window=(500, 0), sinks=2, softcap=3.0, dropout_p=0.3, seed=5,
         alibi_slopes=np.linspace(0.01, 0.1, 8), sink_logits=np.linspace(-1.0, 1.0, 8)),
    dict(bias=np.random.default_rng(4).normal(size=(2, 8, 1, 700)),
         mask=np.random.default_rng(5).random((2, 1, 1, 700)) < 0.7, kv_lengths=np.array([700, 260]))])
def test_emulated_gpu_merged_splits_take_every_option(monkeypatch, options):
    """Every score option on a split float16 decode step that the forward merges (GQA, 2
    splits a row; Option.MERGES): the reference's answer (out, lse and the weights, whose
    call checks out on the host), and the bits of the combine (MERGED_SPLITS = 0)."""
    from npattn.gpu import driver
    from npattn.runtime import plans

    case = uniform_case(2, 8, 2, 1, 700, 64, 64, values_seed=17, dtype=np.float16, **options)
    launched = recorded_launches(monkeypatch)
    plans.clear()
    try:
        check_forward("gpu", case, "bhsd")
        merged = case.run("gpu", layout="bhsd", return_lse=True)
        forwards = [(splits, options & Option.MERGES) for kind, splits, options in launched if kind == "forward_tc"]
        assert forwards and all(splits == 2 and merges for splits, merges in forwards), launched
        monkeypatch.setattr(driver, "MERGED_SPLITS", 0)
        plans.clear()
        combined = case.run("gpu", layout="bhsd", return_lse=True)
    finally:
        plans.clear()
    for got, want in zip(combined, merged):
        assert_same_bits(got, want)


def test_emulated_gpu_forward_merges_many_splits_when_told(monkeypatch, request):
    """driver.MERGED_SPLITS past COMBINE_CHUNK (a setting a device session times): a
    transposed step of 19 splits a row merges them in the forward, a warp taking a row's
    three chunks in turn, first to last block or last to first the same bits, within the
    reference's bounds, and no combine runs."""
    from npattn.gpu import driver
    from npattn.runtime import plans
    from test_serving import assert_lse, assert_out, call_case

    monkeypatch.setattr(driver, "MERGED_SPLITS", 64)
    monkeypatch.setattr(driver, "MIN_KEY_TILES_PER_SPLIT", 1)
    rng = np.random.default_rng(22)
    kv_heads, heads, dim, length = 1, 4, 64, 600
    (k_cache, k_scale), (v_cache, v_scale) = (npattn.quantize_kv(rng.normal(size=(1, length, kv_heads, dim)), "int8")
                                              for _ in range(2))
    q = rng.normal(size=(1, 1, heads, dim)).astype(np.float16)
    launched = recorded_launches(monkeypatch)
    call = dict(cache_seqlens=length, k_scale=k_scale, v_scale=v_scale, return_lse=True, backend="gpu")
    plans.clear()
    try:
        out, lse = npattn.attention_with_kvcache(q, k_cache, v_cache, **call)
        assert [(kind, splits) for kind, splits, _ in launched] == [("forward_tc", 19)], launched
        with emulation(request.config).blocks_reversed():
            again = npattn.attention_with_kvcache(q, k_cache, v_cache, **call)
    finally:
        plans.clear()
    assert_same_bits(again[0], out)
    assert_same_bits(again[1], lse)
    keys, values = (npattn.dequantize_kv(*pair, np.float64) for pair in ((k_cache, k_scale), (v_cache, v_scale)))
    expected, expected_lse = npattn.attention(q.astype(np.float64), keys, values, layout="bshd", return_lse=True,
                                              backend="reference")
    case = call_case(q, keys, values, {})
    assert_out(out, expected, case)
    assert_lse(lse, expected_lse, case)


@pytest.mark.parametrize("cache", ["int8", "float8_e4m3", "float16"])  # decode_tc.cu's tile; forward_tc.cu's
def test_emulated_gpu_forward_merges_a_few_splits_itself_with_the_combines_bits(monkeypatch, request, cache):
    """A split decode step of at most COMBINE_CHUNK splits a row merges them in the
    forward (Option.MERGES, driver.MERGED_SPLITS): the last block of each work item to
    finish merges the item's rows (merge.cuh), and no combine runs. Whichever block
    finishes last (the emulation's blocks run first to last, then last to first), out and
    lse are bit for bit those of the combine (MERGED_SPLITS = 0 launches it) and within
    the reference's bounds; each item's counter is back to 0 after every run, so the
    plan's next run merges too. Rows with a sink logit, a sequence of no keys (zeros and
    -inf) and a NaN value that one kv head of the first sequence sees (the merge's repair:
    NaN rows). Quantized caches take the transposed tile, float16 ones forward_tc.cu's."""
    from npattn.gpu import driver
    from npattn.runtime import plans
    from test_serving import assert_lse, assert_out, call_case

    rng = np.random.default_rng(21)
    batch, kv_heads, heads, dim, capacity = 3, 2, 8, 64, 640
    lengths = np.array([600, 0, 350])
    q = rng.normal(size=(batch, 1, heads, dim)).astype(np.float16)
    k, v = (rng.normal(size=(batch, capacity, kv_heads, dim)) for _ in range(2))
    sinks = rng.normal(size=heads)
    if cache != "float16":
        (k_cache, k_scale), (v_cache, v_scale) = npattn.quantize_kv(k, cache), npattn.quantize_kv(v, cache)
        v_scale[0, 100, 1] = np.nan
        scales = dict(k_scale=k_scale, v_scale=v_scale)
        keys, values = npattn.dequantize_kv(k_cache, k_scale, np.float64), npattn.dequantize_kv(v_cache, v_scale,
                                                                                                 np.float64)
    else:
        k_cache, v_cache = k.astype(np.float16), v.astype(np.float16)
        v_cache[0, 100, 1, 3] = np.nan
        scales = {}
        keys, values = k_cache.astype(np.float64), v_cache.astype(np.float64)
    launched, buffers, kept = recorded_launches(monkeypatch), [], driver.ForwardPlan._partial
    monkeypatch.setattr(driver.ForwardPlan, "_partial", lambda plan: buffers.append((plan, kept(plan))) or buffers[-1][1])

    def step():
        launched.clear()
        return npattn.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, sink_logits=sinks,
                                             return_lse=True, backend="gpu", **scales)

    plans.clear()
    try:
        merged = step()
        splits = [count for kind, count, _ in launched if kind == "forward_tc"]
        kinds = [kind for kind, _, _ in launched]
        assert splits and 1 < splits[0] <= driver.COMBINE_CHUNK and "combine" not in kinds, launched
        runs = [step()]
        with emulation(request.config).blocks_reversed():
            runs.append(step())
        for plan, buffer in buffers:
            assert plan.merged and not buffer[plan.counters_at:].view(np.uint32).any(), "a counter left set"
        monkeypatch.setattr(driver, "MERGED_SPLITS", 0)
        plans.clear()
        runs.append(step())
        assert "combine" in [kind for kind, _, _ in launched], launched
    finally:
        plans.clear()
    for run in runs:
        for got, want in zip(run, merged):
            assert_same_bits(got, want)
    out, lse = merged
    for b in range(batch):
        if lengths[b] == 0:
            assert not out[b].any() and (lse[b] == -np.inf).all()
            continue
        expected, expected_lse = npattn.attention(q[b:b + 1].astype(np.float64), keys[b:b + 1, :lengths[b]],
                                                  values[b:b + 1, :lengths[b]], layout="bshd", sink_logits=sinks,
                                                  return_lse=True, backend="reference")
        np.testing.assert_array_equal(np.isnan(out[b:b + 1]), np.isnan(expected))
        seen = ~np.isnan(expected)
        case = call_case(q[b:b + 1], keys[b:b + 1, :lengths[b]], np.nan_to_num(values[b:b + 1, :lengths[b]]),
                         dict(sink_logits=sinks))
        assert_out(np.where(seen, out[b:b + 1], 0), np.where(seen, expected, 0), case)
        assert_lse(lse[b:b + 1], expected_lse, case)
    assert np.isnan(out[0, 0, 4:]).any(axis=-1).all() and np.isfinite(out[0, 0, :4]).all()


@FEWER
@given(case=cases(dtypes=ALL_DTYPES, dims_strategy=MANY_TILES), layout=layouts)
def test_emulated_gpu_forward_over_many_tiles(case, layout):
    check_forward("gpu", case, layout)


@FEWER
@given(case=cases(dtypes=ALL_DTYPES, dims_strategy=MANY_TILES), layout=layouts)
def test_emulated_gpu_backward_over_many_tiles(case, layout):
    check_backward("gpu", case, layout)


@FEWER
@given(case=peaked_cases(dtypes=("float16", "bfloat16", "float32")), layout=layouts)
def test_emulated_gpu_backward_of_nearly_one_hot_rows_matches_the_reference(case, layout):
    check_peaked_backward("gpu", case, layout)


@FEWER
@given(drawn=viewed_cases(DEVICE_VIEW_KINDS, dtypes=ALL_DTYPES))
def test_emulated_gpu_reads_odd_views_as_their_contiguous_copies(drawn):
    check_odd_views("gpu", *drawn)


def uniform_case(batch, heads, kv_heads, q_len, kv_len, head_dim, value_dim, values_seed, dtype=np.float32,
                 **options):
    """A :class:`Case` of the given shapes with values in [-1, 1] (``values_seed``; a
    ``seed`` among ``options`` is dropout's)."""
    rng = np.random.default_rng(values_seed)
    d = Dims(batch, heads, kv_heads, q_len, kv_len, head_dim, value_dim)

    def uniform(*shape):
        return rng.uniform(-1, 1, shape).astype(dtype)

    return Case(d, uniform(batch, heads, q_len, head_dim), uniform(batch, kv_heads, kv_len, head_dim),
                uniform(batch, kv_heads, kv_len, value_dim), options)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_emulated_gpu_wide_heads_and_many_tiles(dtype):
    """Head dims past 64 (accumulator bounds 256, and 128 for the tensor-core backward),
    several query and key tiles, GQA, every option that moves the band."""
    options = dict(causal=True, window=(30, None), sinks=3, dropout_p=0.25, seed=11, softcap=4.0)
    for head_dim, value_dim in [(200, 72), (120, 40)]:
        case = uniform_case(1, 4, 2, 40, 70, head_dim, value_dim, values_seed=head_dim, dtype=dtype, **options)
        check_forward("gpu", case, "bhsd")
        check_backward("gpu", case, "bshd")


def test_emulated_gpu_backward_is_deterministic():
    rng = np.random.default_rng(1)
    q, k, v = (rng.normal(size=(2, 2, 33, 16)).astype(np.float32) for _ in range(3))
    bias = rng.normal(size=(2, 1, 33, 33))
    runs = []
    for _ in range(2):
        _, vjp = npattn.attention_vjp(q, k, v, bias=bias, causal=True, dropout_p=0.1, seed=2, backend="gpu")
        runs.append(vjp(np.ones_like(q)))
    for first, again in zip(*runs):
        np.testing.assert_array_equal(first, again)


def test_emulated_gpu_split_kv_decoding_matches_the_reference():
    """Short queries against a long cache take the split-KV forward and its combine."""
    from npattn.gpu import driver

    rng = np.random.default_rng(3)
    assert driver.decode_splits(2 * 4, 3, 300, 16, 32) > 1
    for options in [{}, dict(causal=True, sink_logits=rng.normal(size=4), dropout_p=0.3, seed=4),
                    dict(window=(40, 0), sinks=2, kv_lengths=np.array([0, 170])),
                    dict(mask=rng.random((2, 1, 3, 300)) < 0.5, q_lengths=np.array([3, 1])),
                    # a row that sees no key, out and lse left unfilled: the combine writes its zeros and -inf
                    dict(mask=np.arange(3)[:, None] + np.zeros((2, 1, 1, 300), int) != 1)]:
        check_forward("gpu", uniform_case(2, 4, 2, 3, 300, 32, 24, values_seed=3, **options), "bhsd")


def test_split_decoding_never_asks_for_more_blocks_than_its_target():
    """The splits round down: (16, 32/8, 1 x 2048, 128)'s 128 one-warp blocks take 8
    splits, 1024 blocks for the 1056 places; 9 (rounding up) overshot into a second wave
    (61.3 us a step against 45.8 on an H200)."""
    from npattn.gpu import driver

    assert driver.decode_splits(128, 4, 2048, 16, 32, warps=1) == 8
    for blocks in (1, 7, 8, 100, 128, 129, 512, 1000, 1056):
        splits = driver.decode_splits(blocks, 4, 10**6, 16, 32, warps=1)
        assert splits == 1 or blocks * splits <= driver.DECODE_TARGET_WARPS, (blocks, splits)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])  # the SIMT forward, the tensor-core one
def test_emulated_gpu_combine_over_hundreds_of_splits(dtype, monkeypatch):
    """300 splits of one key tile each: the combine's block of 8 warps, each taking
    chunks of sources.COMBINE_CHUNK = 8 splits (five chunks for the first warps, four for
    the rest, the last one partial), with a sink logit and a mask that hides whole splits
    from a row."""
    from npattn.gpu import driver

    monkeypatch.setattr(driver, "MIN_KEY_TILES_PER_SPLIT", 1)
    monkeypatch.setattr(driver, "DECODE_TARGET_WARPS", 10**6)
    keys = 300 * (32 if dtype == np.float32 else 64)
    assert driver.combine_warps(300) == 8
    mask = np.ones((2, keys), bool)
    mask[0, keys // 4:keys // 2] = False  # row 0 sees none of a quarter of the splits
    case = uniform_case(1, 2, 1, 2, keys, 16 if dtype == np.float32 else 64, 16 if dtype == np.float32 else 64,
                        values_seed=11, dtype=dtype, mask=mask, sink_logits=np.array([0.5, -1.0]))
    check_forward("gpu", case, "bhsd")


@pytest.mark.parametrize("dtype", [np.float32, np.float16])  # the SIMT forward, the tensor-core one
@pytest.mark.parametrize("value_dim", [40, 96, 128, 200, 256])
def test_emulated_gpu_combine_at_every_head_dim_bound(dtype, value_dim, monkeypatch):
    """A split decode step (GQA, a sink logit) whose values fill each head-dim bound's
    columns, or part of them: the combine built for the step's bound (sources.
    HEAD_DIM_BOUNDS: MAX_D / 32 columns a lane) merges every column."""
    from npattn.gpu import driver, launch, sources

    monkeypatch.setattr(driver, "MIN_KEY_TILES_PER_SPLIT", 1)
    keys = 12 * (32 if dtype == np.float32 else 64)
    head_dim = min(value_dim, 64)
    bounds, emulated_run = [], launch.run

    def spy(kind, storage, bound, *args, **kwargs):
        if kind == "combine":
            bounds.append(bound)
        return emulated_run(kind, storage, bound, *args, **kwargs)

    monkeypatch.setattr(launch, "run", spy)
    case = uniform_case(1, 4, 2, 1, keys, head_dim, value_dim, values_seed=13, dtype=dtype,
                        sink_logits=np.array([0.5, -1.0, 0.0, 2.0]))
    check_forward("gpu", case, "bhsd")
    assert bounds == [sources.head_dim_bound(head_dim, value_dim)], bounds


def test_emulated_gpu_plans_keep_their_split_partials_per_thread(monkeypatch):
    """A planned split decode step keeps its partials' buffer (a CUDA graph that captured
    the call writes it at every replay, so it must outlive the call), one per thread:
    runs on new values reuse it and stay right, another thread's run gets its own."""
    import threading

    from npattn.gpu import driver

    buffers = []
    kept = driver.ForwardPlan._partial
    monkeypatch.setattr(driver.ForwardPlan, "_partial", lambda plan: buffers.append(kept(plan)) or buffers[-1])
    case = uniform_case(1, 4, 2, 1, 700, 64, 64, values_seed=13, dtype=np.float16)
    plan = npattn.plan(case.q, case.k, case.v, backend="gpu")
    rng = np.random.default_rng(14)
    for _ in range(2):
        q, k, v = (rng.uniform(-1, 1, x.shape).astype(np.float16) for x in (case.q, case.k, case.v))
        drawn = dataclasses.replace(case, q=q, k=k, v=v)
        tolerances.assert_close(plan.run(q, k, v), upcast(drawn).run("reference"), np.float16,
                                *tolerances.output_bound_terms(drawn), "out")
    worker = threading.Thread(target=plan.run, args=(case.q, case.k, case.v))
    worker.start()
    worker.join()
    assert len(buffers) == 3 and buffers[0] is buffers[1] and buffers[2] is not buffers[0]


def test_emulated_gpu_combine_skips_the_rows_of_splits_that_saw_no_key(monkeypatch):
    """A split whose keys a row does not see holds 0 * NaN in that row where v has a NaN
    (the tile product): the combine adds nothing of it, so the row is finite without the
    repair pass (turned off here), and only the row that sees the key is NaN."""
    from npattn.gpu import driver, launch

    monkeypatch.setattr(driver, "MIN_KEY_TILES_PER_SPLIT", 1)
    monkeypatch.setattr(driver, "DECODE_TARGET_WARPS", 10**6)
    emulated_kernel = launch.kernel
    monkeypatch.setattr(launch, "kernel", lambda kind, *arguments, **config: (
        (lambda blocks, operands: None) if kind == "repair" else emulated_kernel(kind, *arguments, **config)))
    keys = 300 * 64
    mask = np.ones((2, keys), bool)
    mask[0, keys // 4:keys // 2] = False  # whole splits (one 64-key tile each) that row 0 does not see
    case = uniform_case(1, 2, 1, 2, keys, 64, 64, values_seed=12, dtype=np.float16, mask=mask)
    v = case.v.copy()
    v[0, 0, keys // 4 + 5, 3] = np.nan
    case = dataclasses.replace(case, v=v)
    out, expected = case.run("gpu"), case.run("reference")
    np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))
    assert np.isnan(out[0, :, 1, 3]).all() and np.isfinite(out[0, :, 0]).all()


@FEWER
@given(case=cases(dtypes=ALL_DTYPES, dims_strategy=MANY_TILES), layout=layouts)
def test_emulated_gpu_forward_with_every_possible_split(case, layout):
    """Splits forced down to one key tile each, so small shapes split too."""
    from npattn.gpu import driver

    patch = pytest.MonkeyPatch()
    patch.setattr(driver, "MIN_KEY_TILES_PER_SPLIT", 1)
    try:
        check_forward("gpu", case, layout)
    finally:
        patch.undo()


# ---- the modules of npattn.nn on the gpu backend --------------------------------------------

def test_emulated_gpu_module_gradients_pass_gradcheck():
    from module_checks import gradcheck_module
    from npattn.autograd import Tensor
    from npattn.nn import MultiHeadAttention

    rng = np.random.default_rng(4)
    module = MultiHeadAttention(8, 2, num_kv_heads=1, causal=True, rotary="rope", sink_logits=True,
                                dtype="float64", seed=2, backend="gpu")
    x = Tensor(rng.standard_normal((2, 4, 8)), requires_grad=True)
    gradcheck_module(module, x, key_padding_mask=np.array([[False] * 4, [False, False, False, True]]))


def test_emulated_gpu_decoding_with_a_long_cache_equals_the_full_pass():
    """Token-by-token decoding after a long prefill: each step is one query against
    hundreds of cached keys, the split-KV forward and its combine."""
    from module_checks import assert_same_composition
    from npattn.gpu import driver
    from npattn.nn import GroupedQueryAttention, KVCache

    embed, heads, length = 32, 4, 300
    assert driver.decode_splits(1 * heads, 1, length, 16, 32) > 1
    module = GroupedQueryAttention(embed, heads, 2, causal=True, rotary="rope", dtype="float64", seed=5,
                                   backend="gpu")
    x = np.random.default_rng(5).standard_normal((1, length, embed))
    cache = KVCache(1, 2, embed // heads, capacity=length, dtype="float64")
    decoded = [module(x[:, :length - 3], cache=cache).data]
    decoded += [module(x[:, t:t + 1], cache=cache).data for t in range(length - 3, length)]
    full = module(x).data
    assert_same_composition(np.concatenate(decoded, axis=1), full, 2 * embed + length, "decoded")
    module.backend = "reference"
    assert_same_composition(full, module(x).data, 2 * embed + length, "gpu against reference")


# ---- the tensor-core forward's tile shapes and option sets ---------------------------------

N = Option.NARROW  # head dims below the kernel's bound (32 and 12 of 64)


@pytest.mark.parametrize("tile", gpu_emulation.EXTRA_TILES[64],
                         ids=lambda t: f"warps{t.warps}-frags{t.frags}-keys{t.block_k}-stages{t.stages}")
@pytest.mark.parametrize("q_len, kv_len, head_dim, options", [
    (40, 90, 64, {}),
    (40, 90, 32, dict(causal=True, window=(30, 0), sinks=2, kv_lengths=np.array([70, 90]))),
    (40, 90, 64, dict(causal=True, softcap=3.0, dropout_p=0.2, seed=7,
                      bias=np.random.default_rng(1).normal(size=(40, 90)), alibi_slopes=np.linspace(0.1, 0.8, 8),
                      mask=np.random.default_rng(2).random((2, 1, 40, 90)) < 0.8)),
    (40, 90, 12, dict(causal=True, sink_logits=np.linspace(-1.0, 1.0, 8))),  # unaligned rows, plain loads
])
def test_emulated_tensor_core_forward_with_two_row_fragments_per_warp(monkeypatch, tile, q_len, kv_len, head_dim,
                                                                       options):
    """The tiles whose warps own two m16 row fragments, and those with two K/V stages
    (forced, as the tuning harness forces them), compute what the reference does, for every
    kind of option (90 keys: several key tiles, so the stages alternate)."""
    from npattn.gpu import launch, sources
    from npattn.runtime import plans

    tiles = []
    emulated_run = launch.run

    def spy(kind, storage, bound, blocks, shared_bytes, arguments, **config):
        if kind == "forward_tc":
            tiles.append(config["tile"])
        return emulated_run(kind, storage, bound, blocks, shared_bytes, arguments, **config)

    monkeypatch.setattr(launch, "run", spy)
    case = uniform_case(2, 8, 2, q_len, kv_len, head_dim, head_dim, values_seed=q_len + head_dim,
                        dtype=np.float16, **options)
    # peaked rows (scores of a few units): near-uniform weights would hide a key tile read
    # from the wrong stage
    case = dataclasses.replace(case, q=(case.q * 8).astype(np.float16))
    plans.clear()  # a plan kept from an earlier call of this structure has its own tile
    try:
        with sources.forced_forward_tile(tile):
            for layout in ("bhsd", "bshd"):
                check_forward("gpu", case, layout)
    finally:
        plans.clear()
    assert tiles and set(tiles) == {tile}


@pytest.mark.parametrize("options", [{}, dict(kv_lengths=np.array([250, 300]), causal=True)])
def test_emulated_decode_steps_with_two_kv_stages(monkeypatch, options):
    """A decode step on a one-warp tile with two K/V stages (a candidate of the tuning
    harness, forced as it forces it), its keys split across blocks, matches the reference."""
    from npattn.gpu import launch, sources
    from npattn.runtime import plans

    tile = sources.ForwardTile(1, 1, 32, 2)
    tiles, emulated_run = [], launch.run

    def spy(kind, storage, bound, blocks, shared_bytes, arguments, **config):
        tiles.append((kind, config.get("tile"), launched_splits(arguments) if kind == "forward_tc" else None))
        return emulated_run(kind, storage, bound, blocks, shared_bytes, arguments, **config)

    monkeypatch.setattr(launch, "run", spy)
    case = uniform_case(2, 8, 2, 1, 300, 64, 64, values_seed=11, dtype=np.float16, **options)
    case = dataclasses.replace(case, q=(case.q * 8).astype(np.float16))  # peaked rows
    plans.clear()
    try:
        with sources.forced_forward_tile(tile, decode=True):
            check_forward("gpu", case, "bhsd")
    finally:
        plans.clear()
    assert [(launched, splits > 1) for kind, launched, splits in tiles if kind == "forward_tc"] == [(tile, True)], tiles


@pytest.mark.parametrize("head_dim, kv_len, options", [
    (64, 300, {}), (64, 300, dict(kv_lengths=np.array([250, 300]))), (128, 77, {}), (128, 1000, {})])
def test_emulated_decode_tiles_stage_whole_rows_with_strided_copies(monkeypatch, head_dim, kv_len, options):
    """A decode step's one-warp tile at a head dim that fills its bound stages K and V by
    stage_strided_rows (whole tiles and a last partial one, split keys or not): the
    reference's answer."""
    from npattn.gpu import launch

    ran, emulated_kernel = [], launch.kernel

    def spy(kind, storage, bound, shared_bytes, **config):
        ran.append((kind, bound, config.get("tile"), config.get("options")))
        return emulated_kernel(kind, storage, bound, shared_bytes, **config)

    monkeypatch.setattr(launch, "kernel", spy)
    case = uniform_case(2, 8, 2, 1, kv_len, head_dim, head_dim, values_seed=13, dtype=np.float16, **options)
    check_forward("gpu", dataclasses.replace(case, q=(case.q * 8).astype(np.float16)), "bhsd")  # peaked rows
    tiles = [(tile, options) for kind, _, tile, options in ran if kind == "forward_tc"]
    assert tiles and all(tile.warps == 1 and not options & (Option.NARROW | Option.UNALIGNED) for tile, options in tiles)


@pytest.mark.parametrize("q_len, kv_len, head_dim, options, warps, expected", [
    # a decode step: the 4 query heads of a GQA group fill 4 rows of a one-warp tile, split-KV
    (1, 700, 32, {}, 1, N),
    (1, 700, 64, dict(causal=True, sink_logits=np.array([0.5, -1.0, 0.0, 2.0, 1.0, 0.0, -0.5, 0.25])), 1,
     Option.BAND | Option.SINK),
    # chunked prefill: 16 query rows x 4 heads = 64 packed rows, 4 warps
    (16, 200, 64, dict(causal=True), 4, Option.BAND),
    (16, 200, 32, dict(window=(20, 3), sinks=2, kv_lengths=np.array([150, 200])), 4, Option.BAND | N),
    # prefill: 160 packed rows, in one 256-row tile of 8 warps x 2 row fragments without
    # options, in two 128-row tiles of 8 warps x 1 with them (their state takes registers)
    (40, 90, 64, {}, 8, Option(0)),
    (40, 90, 32, {}, 8, N),
    (40, 90, 32, dict(causal=True, softcap=3.0, dropout_p=0.2, seed=7), 8,
     Option.BAND | Option.SOFTCAP | Option.DROPOUT | N),
    (40, 90, 64, dict(bias=np.random.default_rng(1).normal(size=(40, 90)), alibi_slopes=np.linspace(0.1, 0.8, 8),
                      mask=np.random.default_rng(2).random((2, 1, 40, 90)) < 0.8), 8,
     Option.BIAS | Option.ALIBI | Option.MASK),
    # head dims that are not whole 16-byte chunks: plain loads and stores
    (40, 90, 12, dict(causal=True), 8, Option.BAND | Option.UNALIGNED | N),
    (40, 90, 60, {}, 8, Option.UNALIGNED),
])
@pytest.mark.parametrize("dtype", [np.float16])
def test_emulated_tensor_core_forward_runs_the_tile_shape_and_options_the_call_needs(
        monkeypatch, q_len, kv_len, head_dim, options, warps, expected, dtype):
    """Each call runs the instantiation of its packed rows' tile shape with exactly the
    option bits it needs, and MERGES where it splits its keys a few ways (so the plain
    path, the band path and the optioned paths all run here), and every one of them
    matches the reference in both layouts."""
    from npattn.gpu import launch

    calls = []
    emulated_run = launch.run

    def spy(kind, storage, bound, blocks, shared_bytes, arguments, **config):
        calls.append((kind, dict(config, splits=launched_splits(arguments) if kind == "forward_tc" else None)))
        return emulated_run(kind, storage, bound, blocks, shared_bytes, arguments, **config)

    monkeypatch.setattr(launch, "run", spy)
    case = uniform_case(2, 8, 2, q_len, kv_len, head_dim, head_dim, values_seed=q_len + head_dim, dtype=dtype,
                        **options)
    for layout in ("bhsd", "bshd"):
        calls.clear()
        check_forward("gpu", case, layout)
        forward = [config for kind, config in calls if kind == "forward_tc"]
        assert forward and all(c["tile"].warps == warps and c["options"] & ~Option.MERGES == expected
                               for c in forward), forward
        if q_len == 1:  # (2 splits: the forward merges them itself)
            assert all(c["splits"] > 1 and c["options"] & Option.MERGES for c in forward), "700 keys split in 2"


_OPTIONED = dict(causal=True, bias=np.random.default_rng(3).normal(size=(1, 4, 70, 90)), dropout_p=0.2, seed=9)


@pytest.mark.parametrize("dtype, head_dim, options", [
    (np.float16, 64, {}),
    ("bfloat16", 64, _OPTIONED),
    (np.float16, 128, _OPTIONED),
])
def test_emulated_tensor_core_kernels_are_within_a_few_rounding_steps(dtype, head_dim, options):
    """The tensor-core forward and backward on aligned rows (cp.async, ldmatrix) against
    the float64 reference, relative to each result's largest element: the shared
    tolerance of check_backward grows with the row count and would let a dropped tile
    column through. 16-bit inputs round every operand, P and dS once (eps / 2 each),
    and float32 accumulation adds far less, so 8 eps is a wide margin that a lost
    column (errors of 30% and more) cannot pass."""
    from ml_dtypes import bfloat16
    from npattn.gpu import options as gpu_options

    dtype = bfloat16 if dtype == "bfloat16" else dtype
    case = uniform_case(2, 4, 2, 70, 90, head_dim, head_dim, values_seed=head_dim, dtype=dtype, **options)
    assert not gpu_options.options_of(npattn.core.validation.build_problem(case.q, case.k, case.v),
                                      (case.q, case.k, case.v)) & Option.UNALIGNED
    eps = float(np.finfo(np.float16).eps) if dtype == np.float16 else 2.0 ** -7
    out, vjp = case.vjp("gpu")
    exact_out, exact_vjp = upcast(case).vjp("reference")
    dout = np.random.default_rng(0).normal(size=out.shape).astype(np.float32)
    results = [("out", out, exact_out)] + list(zip(("dq", "dk", "dv"), vjp(dout.astype(dtype)),
                                                   exact_vjp(dout.astype(dtype).astype(np.float64))))
    for name, actual, expected in results:
        actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
        error = np.abs(actual - expected).max() / np.abs(expected).max()
        assert error <= 8 * eps, f"{name}: {error:.2e} of the largest element (8 eps = {8 * eps:.2e})"


@FEWER
@given(case=planted_cases(into=("q", "k", "bias")))
def test_emulated_gpu_kernels_make_rows_with_a_non_finite_score_nan_themselves(case):
    check_kernel_marks_non_finite_rows(npattn.gpu, case)


@pytest.mark.parametrize("q_len, kv_len", [(70, 90), (1, 700)])  # prefill; a split decode step
def test_emulated_tensor_core_kernels_make_rows_with_a_non_finite_score_nan(q_len, kv_len):
    """The tensor-core forward (float16, D = 64) and the split combine: a row of all-NaN
    scores (a NaN query), one NaN key and one +inf bias entry."""
    case = uniform_case(1, 4, 2, q_len, kv_len, 64, 64, values_seed=5, dtype=np.float16, causal=True)
    q, k = case.q.copy(), case.k.copy()
    q[0, 1, q_len // 2, 3] = np.nan
    k[0, 0, kv_len - 2, 7] = np.nan
    bias = np.zeros((q_len, kv_len), np.float16)
    bias[q_len - 1, 0] = np.inf
    check_kernel_marks_non_finite_rows(npattn.gpu, Case(case.dims, q, k, case.v, {**case.options, "bias": bias}))


def check_gpu_forward_repairs_its_rows(case):
    """The GPU forward on its own (no reference to fall back on, no check of out on the
    host): NaN, +inf and -inf where the reference has them, the rest within the dtype's
    bound, and a result that says it needs no check."""
    from npattn.core.validation import build_problem

    problem = build_problem(case.q, case.k, case.v, **case.options)
    expected = npattn.reference.forward(problem)
    result = npattn.gpu.forward(problem)
    assert result.finite is (True if result.weights is None else None)
    assert_same_outputs(result.out, result.lse, expected.out, expected.lse, case)


@EMULATED
@given(case=planted_cases())
def test_emulated_gpu_forward_gives_the_references_non_finite_rows_itself(case):
    """NaN and inf planted in q, k, v and bias under every option (float32 and float64:
    the SIMT kernels, whose tile products leak 0 * NaN of keys a row does not see): the
    repair pass on the device gives each such row the reference's answer."""
    check_gpu_forward_repairs_its_rows(case)


# (q_len, kv_len, options) of the cases planted_in_v_and_q plants: the tile paths the
# planted values cross (here and on a real GPU, tests/test_gpu.py)
PLANTED_V_AND_Q = [
    (70, 90, dict(causal=True)),                                 # prefill over several tiles
    (1, 700, {}),                                                # a split decode step (combine)
    (2, 700, dict(mask=np.arange(700) != 697)),                  # the same, hiding v's NaN at key 697
    (3, 300, dict(window=(40, 0), sinks=2, kv_lengths=np.array([170]))),
    (5, 80, dict(mask=np.random.default_rng(1).random((5, 80)) < 0.5, dropout_p=0.3, seed=3))]


def planted_in_v_and_q(dtype, q_len, kv_len, options):
    """A case with a NaN and an inf in v of keys some rows do not see (a causal future key,
    a masked or windowed one), a NaN query row and a NaN key."""
    case = uniform_case(1, 4, 2, q_len, kv_len, 64, 64, values_seed=7, dtype=dtype, **options)
    q, k, v = case.q.copy(), case.k.copy(), case.v.copy()
    v[0, 0, kv_len - 3, 5] = np.nan
    v[0, 1, kv_len // 2, 9] = np.inf
    v[0, 1, 1, 2] = np.nan
    q[0, 2, q_len // 2, 3] = np.nan
    k[0, 1, kv_len - 2, 7] = np.nan  # (kv head 1: a NaN score in kv head 0 would hide v's NaN there)
    return dataclasses.replace(case, q=q, k=k, v=v)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])  # the SIMT kernels, the tensor-core ones
@pytest.mark.parametrize("q_len, kv_len, options", PLANTED_V_AND_Q)
def test_emulated_gpu_forward_gives_the_references_non_finite_rows_in_v_and_q(dtype, q_len, kv_len, options):
    check_gpu_forward_repairs_its_rows(planted_in_v_and_q(dtype, q_len, kv_len, options))


def test_emulated_gpu_forward_recomputes_rows_whose_scores_overflow_float32():
    """bfloat16 inputs whose products overflow float32 (the kernels give inf or NaN): the
    repair recomputes those rows in float64, where the scores are finite."""
    from ml_dtypes import bfloat16

    case = uniform_case(1, 2, 1, 3, 40, 16, 16, values_seed=2, dtype=bfloat16)
    q = case.q.copy()
    q[0, 0, 1] = 1e38  # q . k reaches 1e38 * 16: beyond float32, within float64
    case = dataclasses.replace(case, q=q, options={"scale": 1e-30})
    check_gpu_forward_repairs_its_rows(case)


# paged keys: the SIMT forward (float32) and the tensor-core one (float16, PAGED built)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@FEWER
@given(case=paged_cases(), seed=st.integers(0, 2**32 - 1))
def test_emulated_gpu_reads_paged_keys(dtype, case, seed):
    check_paged_forward("gpu", case, seed, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@FEWER
@given(case=packed_batches(), seed=st.integers(0, 2**32 - 1))
def test_emulated_gpu_runs_packed_batches(dtype, case, seed):
    check_varlen("gpu", dtype, case, seed)


@FEWER
@given(case=cache_cases(), seed=st.integers(0, 2**32 - 1))
def test_emulated_gpu_decodes_against_caches(case, seed):
    check_kvcache("gpu", case, seed)


# int8 and float8 e4m3 caches, contiguous or paged, every positional option: the forward
# dequantizes the tiles it stages (float16 q: the tensor-core one, CodeTile;
# float32/float64 q: the SIMT one, load_key_tile) or, for float16 q at head dim 64,
# reads the codes into registers (REGISTER_CODES, TRANSPOSED for up to 8 packed rows);
# the repair pass
# the keys it rereads (key_element)
@FEWER
@given(case=quantized_cases(dtypes=("float16", "float32", "float64"), head_dims=(16, 64)),
       seed=st.integers(0, 2**32 - 1))
def test_emulated_gpu_decodes_against_quantized_caches(case, seed):
    check_quantized_cache("gpu", case, seed)


@FEWER
@given(lengths=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 6)), min_size=1, max_size=3),
       kind=st.sampled_from(["int8", "float8_e4m3"]), gqa=st.booleans(), seed=st.integers(0, 2**31))
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_emulated_gpu_reads_quantized_pools_in_packed_batches(lengths, kind, gqa, seed, dtype):
    check_paged_varlen_quantized("gpu", lengths, kind, gqa, seed, dtype)


@pytest.mark.parametrize("paged", [False, True])
def test_an_emulated_gpu_planned_quantized_step_is_the_call_layer_by_layer(paged):
    check_planned_quantized_step(paged, "gpu")


@contextlib.contextmanager
def forward_options_launched():
    """A list of the option sets of the tensor-core forwards the emulation launches inside
    the block."""
    from npattn.gpu import launch

    ran, real_run = [], launch.run

    def spy(kind, storage, bound, blocks, shared, arguments, **config):
        if kind == "forward_tc":
            ran.append(config["options"])
        return real_run(kind, storage, bound, blocks, shared, arguments, **config)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launch, "run", spy)
        yield ran


def check_codes_against_their_16_bit_values(kind, paged, q_len, dtype, xp=np, every_code=False,
                                                    same_bits=None, dim=64):
    """A decode or short prefill step on a quantized cache (contiguous or ``paged``, GQA,
    two sequences of 600 and 45 keys, so split keys and tiles with tails), and the same
    step on a cache of ``dtype`` holding each code times its scale rounded to ``dtype``.
    Where the tensor-core forward stages both into the same 16-bit tiles (CodeTile
    dequantizes the codes as it deposits them: two K/V stages, ``same_bits``), out and
    lse have the same bits. The one-stage decode tile reads the codes into registers
    instead, contiguous or paged, and scales outside the products (REGISTER_CODES in
    forward_tc.cu; with its products transposed, decode_tc.cu, for at most 8 packed rows:
    ``q_len`` 1 here, not 5): its out and lse are held to the bound of the float64
    reference on the dequantized cache, and its out's largest error to twice the 16-bit
    cache's. ``every_code``:
    codes drawn from every finite code (e4m3's subnormals and int8's -128 among them)
    instead of quantize_kv's. ``xp``: CuPy, for the device. ``dim``: the head dim."""
    from test_serving import assert_lse, assert_out, call_case

    same_bits = False if same_bits is None else same_bits
    rng = np.random.default_rng(11)
    batch, kv_heads, heads, page_size, pages = 2, 2, 4, 32, 40
    lengths = np.array([600, 45])
    shape = (pages, page_size, kv_heads, dim) if paged else (batch, pages * page_size // batch, kv_heads, dim)
    (k_codes, k_scale), (v_codes, v_scale) = (npattn.quantize_kv(rng.normal(size=shape), kind) for _ in range(2))
    if every_code:
        finite = np.setdiff1d(np.arange(256), [0x7f, 0xff] if kind == "float8_e4m3" else [])
        k_codes, v_codes = (rng.choice(finite, size=shape).astype(np.uint8).view(codes.dtype)
                            for codes in (k_codes, v_codes))
        k_scale, v_scale = (rng.uniform(0.001, 0.01, size=shape[:-1]).astype(np.float32) for _ in range(2))
    k_values, v_values = (npattn.dequantize_kv(codes, scale).astype(dtype)
                          for codes, scale in ((k_codes, k_scale), (v_codes, v_scale)))
    q = rng.normal(size=(batch, q_len, heads, dim)).astype(dtype)
    call = dict(cache_seqlens=lengths, causal=True, return_lse=True, backend="gpu")
    table = rng.permutation(pages)[:pages // 2 * 2].reshape(batch, pages // 2) if paged else None
    if paged:
        call["block_table"] = table
    if xp is not np:
        q, k_codes, v_codes, k_scale, v_scale, k_values, v_values = (
            xp.asarray(x) for x in (q, k_codes, v_codes, k_scale, v_scale, k_values, v_values))
        call = {name: xp.asarray(value) if isinstance(value, np.ndarray) else value for name, value in call.items()}
    from npattn.gpu.options import Option

    # (the emulation launches through launch.run; a device's plans keep their launchers)
    with forward_options_launched() if xp is np else contextlib.nullcontext([]) as ran:
        from_codes = npattn.attention_with_kvcache(q, k_codes, v_codes, k_scale=k_scale, v_scale=v_scale, **call)
    if xp is np:  # codes into registers where not the same bits; transposed for at most 8 packed rows
        transposed = not same_bits and q_len * heads // kv_heads <= 8
        assert ran and all(bool(options & Option.REGISTER_CODES) != same_bits
                           and bool(options & Option.TRANSPOSED) == transposed for options in ran), ran
    from_values = npattn.attention_with_kvcache(q, k_values, v_values, **call)
    host = [x.get() if xp is not np else x for x in (*from_codes, *from_values, q, k_codes, v_codes, k_scale, v_scale)]
    out, lse, values_out, values_lse, q, k_codes, v_codes, k_scale, v_scale = host
    assert np.isfinite(out).all()
    if same_bits:
        np.testing.assert_array_equal(out, values_out)
        np.testing.assert_array_equal(lse, values_lse)
        return
    def sequence(array, b):  # sequence b's keys (codes or scales) in order, from its row or its pages
        held = array[table[b]].reshape(-1, *array.shape[2:]) if paged else array[b]
        return held[:lengths[b]]

    for b in range(batch):
        rows = slice(b, b + 1)
        keys, values = (npattn.dequantize_kv(sequence(codes, b), sequence(scale, b), np.float64)[None]
                        for codes, scale in ((k_codes, k_scale), (v_codes, v_scale)))
        expected, expected_lse = npattn.attention(q[rows].astype(np.float64), keys, values, layout="bshd",
                                                  causal=True, return_lse=True, backend="reference")
        case = call_case(q[rows], keys, values, dict(causal=True))
        assert_out(out[rows], expected, case)
        assert_lse(lse[rows], expected_lse, case)
        # and as close as the 16-bit cache's step, whose values each rounded once (the
        # bound above is the worst case over every rounding: loose for 600 keys)
        error, values_error = (np.abs(np.asarray(x[rows], np.float64) - expected).max() for x in (out, values_out))
        assert error <= 2 * values_error, (error, values_error)


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
@pytest.mark.parametrize("kind", ["int8", "float8_e4m3"])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("q_len", [1, 5])
def test_emulated_gpu_codes_match_their_16_bit_values(kind, paged, q_len, dtype):
    check_codes_against_their_16_bit_values(kind, paged, q_len, dtype)


# every option a decode step's codes-in-registers tiles are built with (the everything-but-
# pages build at 64-wide heads), drawn as one value each
_STEP_OPTIONS = {
    "sink_logits": lambda rng, heads, q_len, keys: dict(sink_logits=rng.normal(size=heads)),
    "alibi_slopes": lambda rng, heads, q_len, keys: dict(alibi_slopes=rng.uniform(0.1, 1.0, heads)),
    "bias": lambda rng, heads, q_len, keys: dict(bias=rng.normal(size=(1, heads, q_len, keys)).astype(np.float32)),
    # (head 0's rows see no key: zeros and an lse of -inf)
    "mask": lambda rng, heads, q_len, keys: dict(mask=(rng.random((1, heads, q_len, keys)) > 0.3)
                                                 & (np.arange(heads) > 0)[None, :, None, None]),
    "dropout_p": lambda rng, heads, q_len, keys: dict(dropout_p=0.3, seed=7),
    "softcap": lambda rng, heads, q_len, keys: dict(softcap=2.0),
    "window": lambda rng, heads, q_len, keys: dict(window=40, sinks=3),
}


@pytest.mark.parametrize("kind", ["int8", "float8_e4m3"])
@pytest.mark.parametrize("option", sorted(_STEP_OPTIONS))
@pytest.mark.parametrize("q_len", [1, 2, 3])
def test_emulated_gpu_codes_in_registers_read_every_option(option, q_len, kind):
    """A quantized step over a contiguous cache at 64-wide heads with a group of 4 reads
    its codes into registers, transposed for one query (4 packed rows) and two (8: their
    windows differ, so some tiles are partly visible) and not for three (12), and each
    option there: the same out and lse as the reference backend's call on
    the same cache, within the float16 bound, and out within twice the error of the step
    on a float16 cache of the dequantized values (dropout: the same seeded mask)."""
    from npattn.gpu.options import Option
    from test_serving import assert_lse, assert_out, call_case

    rng = np.random.default_rng(23)
    kv_heads, group, dim, capacity, length = 2, 4, 64, 160, 150
    heads = kv_heads * group
    (k_codes, k_scale), (v_codes, v_scale) = (npattn.quantize_kv(rng.normal(size=(1, capacity, kv_heads, dim)), kind)
                                              for _ in range(2))
    q = rng.normal(size=(1, q_len, heads, dim)).astype(np.float16)
    options = dict(_STEP_OPTIONS[option](rng, heads, q_len, capacity), causal=True, return_lse=True)
    call = dict(k_scale=k_scale, v_scale=v_scale, cache_seqlens=np.array([length]), **options)
    with forward_options_launched() as ran:
        out, lse = npattn.attention_with_kvcache(q, k_codes, v_codes, backend="gpu", **call)
    expected, expected_lse = npattn.attention_with_kvcache(q.astype(np.float64), k_codes, v_codes,
                                                           backend="reference", **call)
    transposed = q_len * group <= 8
    assert ran and all(options & Option.REGISTER_CODES and bool(options & Option.TRANSPOSED) == transposed
                       for options in ran), ran
    keys, values = (npattn.dequantize_kv(codes[:, :length], scale[:, :length], np.float64)
                    for codes, scale in ((k_codes, k_scale), (v_codes, v_scale)))
    case = call_case(q, keys, values, {name: value for name, value in options.items() if name != "return_lse"})
    assert_out(out, expected, case)
    assert_lse(lse, expected_lse, case)
    # and as close as the same step on a float16 cache of the dequantized values (the bound
    # above is the worst case over every rounding: loose for 150 keys)
    k_values, v_values = (npattn.dequantize_kv(codes, scale).astype(np.float16)
                          for codes, scale in ((k_codes, k_scale), (v_codes, v_scale)))
    values_out, _ = npattn.attention_with_kvcache(q, k_values, v_values, backend="gpu", cache_seqlens=np.array([length]),
                                                  **options)
    error, values_error = (np.abs(np.asarray(x, np.float64) - expected).max() for x in (out, values_out))
    assert error <= 2 * values_error, (error, values_error)


@pytest.mark.parametrize("kind", ["int8", "float8_e4m3"])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("q_len", [1, 5])
def test_emulated_gpu_codes_at_128_wide_heads_match_their_16_bit_values(kind, paged, q_len):
    """The 128-wide decode tiles (32-key tiles), transposed (one query: 2 packed rows a kv
    head) and not (five: 10), on contiguous and paged caches."""
    check_codes_against_their_16_bit_values(kind, paged, q_len, np.float16, dim=128)


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
@pytest.mark.parametrize("kind", ["int8", "float8_e4m3"])
def test_emulated_gpu_every_code_matches_its_16_bit_value(kind, dtype):
    check_codes_against_their_16_bit_values(kind, False, 1, dtype, every_code=True)


@pytest.mark.parametrize("kind", ["int8", "float8_e4m3"])
def test_emulated_gpu_codes_on_two_stages_give_the_bits_of_their_16_bit_values(kind):
    """A decode step forced onto two K/V stages (the tuning harness's candidate), where the
    codes are fetched and dequantized at once rather than ahead of use."""
    from npattn.gpu import sources

    with sources.forced_forward_tile(sources.ForwardTile(1, 1, 32, 2), decode=True):
        check_codes_against_their_16_bit_values(kind, False, 1, np.float16, same_bits=True)


@pytest.mark.parametrize("paged", [False, True])
def test_an_emulated_gpu_e4m3_nan_code_gives_the_references_nan_rows(paged):
    """e4m3's NaN codes (S.1111.111) read as NaN: a NaN code in v at a key the first query
    row does not see (causal) and the second does leaves the first row finite and makes
    the second NaN, as the reference on the dequantized cache does."""
    rng = np.random.default_rng(5)
    shape = (4, 16, 2, 64) if paged else (1, 64, 2, 64)
    (k_codes, k_scale), (v_codes, v_scale) = (npattn.quantize_kv(rng.normal(size=shape), "float8_e4m3")
                                              for _ in range(2))
    table = np.array([[2, 0, 3, 1]]) if paged else None
    key = 37  # of the one sequence's 40 keys
    slot = (table[0, key // 16], key % 16) if paged else (0, key)
    v_codes[slot][1, 5] = 0xff  # kv head 1, column 5
    q = rng.normal(size=(1, 4, 4, 64)).astype(np.float16)
    call = dict(cache_seqlens=np.array([40]), causal=True, return_lse=True, block_table=table)
    out, lse = npattn.attention_with_kvcache(q, k_codes, v_codes, k_scale=k_scale, v_scale=v_scale, backend="gpu",
                                             **call)
    keys, values = (npattn.dequantize_kv(codes[table[0]].reshape(-1, 2, 64) if paged else codes[0],
                                         scale[table[0]].reshape(-1, 2) if paged else scale[0], np.float64)[None, :40]
                    for codes, scale in ((k_codes, k_scale), (v_codes, v_scale)))
    expected, _ = npattn.attention(q.astype(np.float64), keys, values, layout="bshd", causal=True, return_lse=True,
                                   backend="reference")
    assert np.isnan(expected).any() and not np.isnan(expected).all()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])  # the SIMT forward, the tensor-core one (CODES)
@pytest.mark.parametrize("kind", ["int8", "float8_e4m3"])
@pytest.mark.parametrize("nan_key", [None, 150])
def test_emulated_gpu_split_decoding_of_quantized_caches(monkeypatch, kind, nan_key, dtype):
    """A decode step over 600 quantized keys (paged, GQA) takes the split-KV forward and
    its merge (the combine after the SIMT forward, the tensor-core forward's own); with a
    NaN value scale at a key the first sequence sees (and the second, shorter one does
    not), the merge's repair recomputes that row from the codes: NaN, as the reference's,
    and the other rows the reference's finite ones."""
    from npattn.gpu import launch
    from test_serving import assert_lse, assert_out, call_case

    rng = np.random.default_rng(6)
    pages, page_size, kv_heads, heads, dim = 44, 32, 2, 4, 32
    (k_pool, k_scale), (v_pool, v_scale) = (npattn.quantize_kv(rng.normal(size=(pages, page_size, kv_heads, dim)),
                                                                kind) for _ in range(2))
    table = rng.permutation(pages)[:40].reshape(2, 20)
    lengths = np.array([600, 120])
    if nan_key is not None:
        v_scale[table[0, nan_key // page_size], nan_key % page_size, 1] = np.nan  # kv head 1 of sequence 0 only
    q = rng.normal(size=(2, 1, heads, dim)).astype(dtype)
    splits = []
    real_run = launch.run

    def spy(kind_, storage, bound, blocks, shared, arguments, **config):
        if kind_ in ("forward", "forward_tc"):
            splits.append(launched_splits(arguments))
        return real_run(kind_, storage, bound, blocks, shared, arguments, **config)

    monkeypatch.setattr(launch, "run", spy)
    out, lse = npattn.attention_with_kvcache(q, k_pool, v_pool, cache_seqlens=lengths, block_table=table,
                                             k_scale=k_scale, v_scale=v_scale, return_lse=True, backend="gpu")
    assert splits and min(splits) > 1, "the step did not split its keys"
    for b in range(2):
        keys, values = (npattn.dequantize_kv(pool[table[b]].reshape(-1, kv_heads, dim)[:lengths[b]],
                                             scale[table[b]].reshape(-1, kv_heads)[:lengths[b]], np.float64)[None]
                        for pool, scale in ((k_pool, k_scale), (v_pool, v_scale)))
        expected, expected_lse = npattn.attention(q[b:b + 1].astype(np.float64), keys, values, layout="bshd",
                                                  return_lse=True, backend="reference")
        np.testing.assert_array_equal(np.isnan(out[b:b + 1]), np.isnan(expected))
        seen = ~np.isnan(expected)
        case = call_case(q[b:b + 1], keys, np.nan_to_num(values))
        assert_out(np.where(seen, out[b:b + 1], 0), np.where(seen, expected, 0), case)
        assert_lse(lse[b:b + 1], expected_lse, case)
    assert np.isnan(out[0, 0, 2:]).all() == (nan_key is not None) and np.isfinite(out[1]).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("kind", ["int8", "float8_e4m3"])
def test_emulated_gpu_repairs_rows_of_quantized_caches_from_their_codes(kind, dtype):
    """A NaN scale of a value row the first query does not see (causal) leaks into the
    tile product (0 * NaN); the repair pass recomputes the row from the codes and scales
    (key_element) and gives the reference's: that row finite, the next one (which sees
    the key) NaN."""
    from test_serving import assert_lse, assert_out, call_case

    rng = np.random.default_rng(4)
    codes, scales = zip(*(npattn.quantize_kv(rng.normal(size=(1, 16, 2, 16)), kind) for _ in range(2)))
    k_cache, v_cache = codes
    k_scale, v_scale = (x.copy() for x in scales)
    v_scale[0, 9, 1] = np.nan  # key 9 of kv head 1: seen by the second query row only
    q = rng.normal(size=(1, 2, 4, 16)).astype(dtype)
    call = dict(cache_seqlens=np.array([10]), k_scale=k_scale, v_scale=v_scale, causal=True, return_lse=True)
    out, lse = npattn.attention_with_kvcache(q, k_cache, v_cache, backend="gpu", **call)
    keys = npattn.dequantize_kv(k_cache[:, :10], k_scale[:, :10], np.float64)
    values = npattn.dequantize_kv(v_cache[:, :10], v_scale[:, :10], np.float64)
    expected, expected_lse = npattn.attention(q.astype(np.float64), keys, values, layout="bshd", causal=True,
                                              return_lse=True, backend="reference")
    assert np.isnan(expected[0, 1, 2:]).all() and np.isfinite(expected[0, 0]).all()  # (heads 2, 3: kv head 1)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(expected_lse))
    case = call_case(q, keys, np.nan_to_num(values), dict(causal=True))  # (the bound of the finite rows)
    seen = ~np.isnan(expected)
    assert_out(np.where(seen, out, 0), np.where(seen, expected, 0), case)
    assert_lse(np.nan_to_num(lse), np.nan_to_num(expected_lse), case)


@EMULATED
@given(case=cases(dtypes=ALL_DTYPES), layout=layouts, seed=st.integers(0, 2**32 - 1))
def test_a_gpu_plan_runs_new_arrays_as_a_gpu_call_does(case, layout, seed):
    """The GPU backend's plan (gpu.driver.ForwardPlan: kernel, launch geometry, parameters
    on the device, worked out once) gives each run's arrays the bits of an unplanned call,
    option arrays and dropout seeds included; a run on rows off a 16-byte boundary takes
    the kernel variant for them (UNALIGNED) though the plan was made on aligned rows."""
    from strategies import to_layout

    options = {**case.options, "layout": layout, "backend": "gpu", "return_lse": True}
    if options.get("dropout_p") and options.get("seed") is None:
        options["seed"] = 11
    if options.get("block_table") is not None:
        return  # paged calls are not planned
    user = [np.ascontiguousarray(to_layout(x, layout)) for x in (case.q, case.k, case.v)]
    plan = npattn.plan(*user, **options)
    rng = np.random.default_rng(seed)
    for _ in range(2):
        fresh = [rng.uniform(-2, 2, x.shape).astype(x.dtype) for x in user]
        np.testing.assert_array_equal(plan.run(*fresh)[0], npattn.attention(*fresh, **options)[0])
    if case.q.dtype.itemsize == 2 and case.q.shape[-1] % 8 == 0 and case.q.size:
        # the same values one element past an aligned start: another kernel variant, same answer
        shifted = []
        for x in fresh:
            buffer = np.empty(x.size + 1, x.dtype)
            view = buffer[1:].reshape(x.shape)
            view[...] = x
            shifted.append(view)
        if all(a.strides == b.strides for a, b in zip(shifted, fresh)):
            np.testing.assert_array_equal(plan.run(*shifted)[0], npattn.attention(*fresh, **options)[0])


@pytest.mark.parametrize("dtype, q_len", [(np.float16, 24), (np.float16, 1), (np.float32, 5)])
def test_a_planned_gpu_call_never_reads_out_back_to_check_it(monkeypatch, dtype, q_len):
    """No check of out for NaN and inf on the host (on a GPU: a reduction and a wait for
    the device): the repair pass answers for it, on a prefill call, a split decode step
    and the SIMT kernels; a NaN planted in v of a key some rows do not see still reaches
    exactly the reference's rows. A call that returns the weights keeps the host's check."""
    import npattn.api
    import npattn.runtime.nonfinite

    def no_host_check(array):
        raise AssertionError("a planned GPU call read out back to check it")

    case = uniform_case(1, 4, 2, q_len, 300, 64, 64, values_seed=17, dtype=dtype, causal=True)
    v = case.v.copy()
    v[0, 1, 299, 4] = np.nan  # seen by the last query row only
    plan = npattn.plan(case.q, case.k, v, causal=True, backend="gpu")
    with monkeypatch.context() as patch:
        for module in (npattn.api, npattn.core.results, npattn.runtime.nonfinite):
            if hasattr(module, "all_finite"):
                patch.setattr(module, "all_finite", no_host_check)
        out = np.asarray(plan.run(case.q, case.k, v), np.float64)
    expected = np.asarray(npattn.attention(case.q, case.k, v, causal=True, backend="reference"), np.float64)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))
    assert np.isnan(out).sum() == 2  # head 2's and head 3's last row, column 4
    weights_plan = npattn.plan(case.q, case.k, case.v, causal=True, backend="gpu", return_weights=True)
    checked = []
    with monkeypatch.context() as patch:
        patch.setattr(npattn.core.results, "all_finite", lambda array: checked.append(array) or True)
        weights_plan.run(case.q, case.k, case.v)
    assert checked


def test_the_serving_calls_new_paths_run_on_the_emulated_gpu():
    """A shared prefix (its stacked and per-entry parts) and prefill with decode in one
    paged attention_varlen call (a call per sequence on the GPU) against the reference."""
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 1, 4, 16)).astype(np.float32)
    own = [rng.standard_normal((2, 8, 2, 16)).astype(np.float32) for _ in range(2)]
    prefix = [rng.standard_normal((5, 2, 16)).astype(np.float32) for _ in range(2)]
    for options in (dict(causal=True), dict(causal=True, window=(3, 0), sinks=1)):
        got = npattn.attention_with_kvcache(q, *own, cache_seqlens=np.array([3, 6]), prefix_k=prefix[0],
                                            prefix_v=prefix[1], backend="gpu", **options)
        want = npattn.attention_with_kvcache(q, *own, cache_seqlens=np.array([3, 6]), prefix_k=prefix[0],
                                             prefix_v=prefix[1], backend="reference", **options)
        np.testing.assert_allclose(got, want, rtol=0, atol=tolerances.attention_bounds(
            np.float32, q, np.concatenate([prefix[0], *own[0]]), np.concatenate([prefix[1], *own[1]]), 13)[0])
    pools = [rng.standard_normal((6, 4, 2, 16)).astype(np.float32) for _ in range(2)]
    packed = rng.standard_normal((6, 4, 16)).astype(np.float32)
    arguments = dict(seqused_k=np.array([7, 3, 9]), block_table=np.array([[0, 2, 4], [1, 3, 5], [5, 4, 3]]),
                     causal=True)
    got = npattn.attention_varlen(packed, *pools, np.array([0, 4, 5, 6]), backend="gpu", **arguments)
    want = npattn.attention_varlen(packed, *pools, np.array([0, 4, 5, 6]), backend="reference", **arguments)
    np.testing.assert_allclose(got, want, rtol=0, atol=tolerances.attention_bounds(np.float32, packed, *pools, 12)[0])
