"""The CPU kernels beyond the shared properties: many tiles, big shapes, determinism, no copies.

The equivalence tests of ``test_backend_equivalence`` run at the default tile sizes, where
most hypothesis problems fit in one tile; here tiny tiles make every tile edge, dead-tile
skip and multi-tile online-softmax rescale happen on small problems, with the tiles'
products on both paths: the vector micro-kernels and BLAS.
"""
import dataclasses
import os
import threading
import time

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn
from npattn.cpu.isa import FORCE_VARIABLE
from strategies import Case, Dims, cases, dims, layouts
from tolerances import assert_close, gradient_bound_terms
from test_backend_equivalence import check_backward, check_forward

pytestmark = pytest.mark.skipif(not npattn.backends()["cpu"], reason="the cpu backend is unavailable")
cpu = pytest.importorskip("npattn.cpu")
tiles = st.tuples(st.integers(1, 4), st.integers(1, 5))
# "dot": the default vector path, whose forward takes the scores of problems of few rows
# per kv head (Sq x group <= 8: most drawn here) as dot products of the key rows;
# "vector": packed key tiles everywhere; "blas": SciPy's BLAS
products = st.sampled_from(["dot", "vector", "blas"])


def product_path(kind):
    """A context manager running the block on the tiles' product path ``kind``."""
    from npattn.cpu.tuning import DOT_ROWS, tuned

    return tuned(vector=kind != "blas", dot_rows=0 if kind == "vector" else DOT_ROWS)


@given(case=cases(dtypes=("float32", "float64"), dims_strategy=dims(max_len=13)), layout=layouts, tile=tiles,
       kind=products)
def test_forward_matches_the_reference_across_many_tiles(case, layout, tile, kind):
    with cpu.tile_sizes(*tile), product_path(kind):
        check_forward("cpu", case, layout)


@given(case=cases(dtypes=("float32", "float64"), dims_strategy=dims(max_len=13)), layout=layouts, tile=tiles,
       kind=products)
def test_backward_matches_the_reference_across_many_tiles(case, layout, tile, kind):
    with cpu.tile_sizes(*tile), product_path(kind):
        check_backward("cpu", case, layout)


@st.composite
def vector_dims(draw):
    """Head dims around whole vectors (AVX-512: 16 float32 lanes, 8 float64, in 4-vector
    chunks; AVX2: 8 and 4 lanes in 2-vector chunks), so the micro-kernels' chunk,
    single-vector and BLAS-fallback paths all run at either ISA, and lengths past their
    6-row blocks."""
    d = draw(dims(max_len=40))
    widths = st.sampled_from([8, 12, 16, 20, 24, 32, 48, 64, 72, 80])
    return dataclasses.replace(d, head_dim=draw(widths), value_dim=draw(widths))


# Where AVX2 is forced on an AVX-512 CPU (the child of tests/test_cpu_isa.py), float32
# alone: float64's AVX2 vector paths are held there by the micro-kernel and row tests, and
# compiling its whole kernels for AVX2 as well took the child (alone, the Zen 4 VM) 102 s
# of CPU against 65 s. On an AVX2-only CPU nothing is forced: the suite runs both there.
VECTOR_WIDTH_DTYPES = ("float32",) if os.environ.get(FORCE_VARIABLE) else ("float32", "float64")


@settings(max_examples=40)
@given(case=cases(dtypes=VECTOR_WIDTH_DTYPES, dims_strategy=vector_dims()), layout=layouts,
       tile=st.tuples(st.integers(1, 20), st.integers(1, 70), st.integers(1, 13)), kind=products)
def test_vector_products_match_the_reference_at_vector_widths(case, layout, tile, kind):
    """Also cuts tiles that the causal or window edge crosses into bands of 1 to 13 rows."""
    with cpu.tile_sizes(*tile), product_path(kind):
        check_forward("cpu", case, layout)
        check_backward("cpu", case, layout)


def test_products_must_be_vector_or_blas():
    with pytest.raises(ValueError, match="'vector' or 'blas'"):
        with cpu.products("mkl"):
            pass


# Shapes past the default tiles (64 x 256), lengths that are not tile multiples, head dims
# that are not powers of two, up to 256; few examples, each one large.
large = dims(max_batch=1, max_kv_heads=2, max_group=2, min_len=1, max_len=300, max_dim=256)


@settings(max_examples=12)
@given(case=cases(dtypes=("float32",), dims_strategy=large), layout=layouts)
def test_large_shapes_match_the_reference(case, layout):
    check_forward("cpu", case, layout)
    check_backward("cpu", case, layout)


def _problem(rng, dtype=np.float32, batch=2, heads=4, kv_heads=2, q_len=70, kv_len=300, dim=24):
    q = rng.normal(size=(batch, heads, q_len, dim)).astype(dtype)
    k = rng.normal(size=(batch, kv_heads, kv_len, dim)).astype(dtype)
    v = rng.normal(size=(batch, kv_heads, kv_len, dim)).astype(dtype)
    return q, k, v


OPTIONS = dict(causal=True, window=(90, None), sinks=3, dropout_p=0.2, seed=11,
               kv_lengths=np.array([300, 211]))


@pytest.mark.parametrize("split", ["key chunks", "head parts"])
@pytest.mark.parametrize("bias_shape", [None, (1, 1, 70, 300), (4, 1, 1)])
def test_backward_is_bitwise_deterministic_across_runs_and_thread_counts(monkeypatch, bias_shape, split):
    """One kv head leaves the backward too few items: it splits the keys into chunks, each
    with its own dQ, or, where those copies of dQ would take too much memory (here: any)
    and dK and dV are the smaller (300 queries against 250 keys), the group's query heads
    into parts, each with its own dK and dV. Either way the bits are those of one thread,
    and the gradients the reference's."""
    from npattn.cpu import driver

    if split == "head parts":
        monkeypatch.setattr(driver, "_DQ_COPIES_BYTES", 0)
    npattn.runtime.plans.clear()  # (plans made under other limits)
    rng = np.random.default_rng(0)
    lengths = dict(q_len=70, kv_len=300) if split == "key chunks" else dict(q_len=300, kv_len=250)
    q, k, v = _problem(rng, batch=1, kv_heads=1, **lengths)
    options = dict(OPTIONS, kv_lengths=None)
    if bias_shape is not None:
        options["bias"] = rng.normal(size=tuple(n if n in (1, 4) else m for n, m in
                                                zip(bias_shape, (1, 4, q.shape[2], k.shape[2])))).astype(np.float32)
    dout = rng.normal(size=q.shape).astype(np.float32)

    def gradients():
        out, vjp = npattn.attention_vjp(q, k, v, backend="cpu", **options)
        return (out, *vjp(dout))

    first = gradients()
    plan = next(plan for plan in driver._BACKWARD_PLANS._plans.values() if plan.dq_shape[-2] == q.shape[2])
    assert (plan.head_parts > 1) == (split == "head parts") and plan.chunks * plan.head_parts > 1
    assert (plan.dq_shape[0], plan.dk_shape[0], plan.dv_shape[0]) == (plan.chunks, plan.head_parts, plan.head_parts)
    monkeypatch.setenv("NPATTN_NUM_THREADS", "1")
    for again in (gradients(), gradients()):
        for a, b in zip(first, again):
            assert a.tobytes() == b.tobytes()
    wide = {name: value.astype(np.float64) if isinstance(value, np.ndarray) and value.dtype == np.float32 else value
            for name, value in options.items()}
    out, vjp = npattn.attention_vjp(*(x.astype(np.float64) for x in (q, k, v)), backend="reference", **wide)
    # the dtype's bound over gradient_bound_terms' length, relative to each gradient's own
    # size: their magnitude term bounds every term (here 36-416 against gradients of 1-9),
    # which would pass a split that sums a head twice
    case = Case(Dims(1, 4, 1, q.shape[2], k.shape[2], q.shape[3], v.shape[3]), q, k, v, options)
    length, _ = gradient_bound_terms(case, dout)
    for name, got, exact in zip(("dq", "dk", "dv"), first[1:4], vjp(dout.astype(np.float64))):  # (the split's)
        assert_close(got, exact, np.float32, length, float(np.abs(exact).max()), name)
    npattn.runtime.plans.clear()


def test_an_mqa_backward_keeps_one_copy_of_dq():
    """(1, 32 q / 1 kv, 2048, 128): key chunks would keep 8 copies of dQ (268 MB); the plan
    splits the query heads into 8 parts instead, whose dK and dV copies take 16 MB. A
    smaller one, (1, 8/1, 1024, 64), keeps its key chunks (14 MB of copies: those ran
    5-15% faster)."""
    from npattn.core.validation import build_problem
    from npattn.cpu import driver, tuning

    def plan_of(heads, length, dim):
        q = np.zeros((1, heads, length, dim), np.float32)
        k = v = np.zeros((1, 1, length, dim), np.float32)
        return driver.BackwardPlan(build_problem(q, k, v, causal=True), tuning.current())

    large = plan_of(32, 2048, 128)
    assert (large.head_parts, large.chunks) == (8, 1) and large.dq_shape[0] == 1
    assert 4 * (np.prod(large.dk_shape) + np.prod(large.dv_shape)) == 16 << 20
    small = plan_of(8, 1024, 64)
    assert (small.head_parts, small.chunks) == (1, 8)


def test_kernels_read_inputs_in_place_in_both_layouts():
    from npattn.cpu.operands import build_operands
    from npattn.core.validation import build_problem

    rng = np.random.default_rng(1)
    q, k, v = _problem(rng)
    bias = rng.normal(size=(1, 1, q.shape[2], k.shape[2])).astype(np.float32)
    for layout in ("bhsd", "bshd"):
        arrays = [a.transpose(0, 2, 1, 3).copy() if layout == "bshd" else a for a in (q, k, v)]
        ops = build_operands(build_problem(*arrays, bias=bias, layout=layout))
        for given_array, flat in zip(arrays, (ops.q, ops.k, ops.v)):
            assert np.shares_memory(given_array, flat) and flat.size == given_array.size
        assert np.shares_memory(bias, ops.bias) and ops.bias.size == bias.size  # never expanded to B, H


@pytest.mark.parametrize("q_len", [2, 64])  # out of 4 KiB (NumPy's zeros) and of 128 KiB (aligned)
def test_outputs_past_the_alignment_threshold_start_on_a_cache_line(q_len):
    """The forward's out from 64 KiB up starts on a 64-byte line (whole-vector stores, and
    JAX takes it without a copy); either way it is zeros where no key is visible."""
    from npattn.cpu import scratch

    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 8, q_len, 64)).astype(np.float32)
    kv_lengths = np.array([0])  # every row sees no key: out is its initial zeros
    out = npattn.attention(q, q, q, kv_lengths=kv_lengths, backend="cpu")
    assert not out.any()
    if out.nbytes >= scratch._ALIGNED_FROM:
        assert out.ctypes.data % 64 == 0
    out = npattn.attention(q, q, q, backend="cpu")
    if out.nbytes >= scratch._ALIGNED_FROM:
        assert out.ctypes.data % 64 == 0


@pytest.mark.parametrize("options", [dict(causal=True), dict(causal="top_left", window=(1, 0)), dict(sinks=2, window=3),
                                     dict(layout="bshd", causal=True), dict(gqa=True, causal=True)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_a_plain_planned_call_writes_every_byte_of_out_and_lse(options, dtype):
    """A plan's plain calls run the kernel's entry point on uninitialized out and lse
    (no zeros, no -inf fill): poisoned with NaN, they come back with the bits of a
    run on zeros and -inf, rows that see no key included (9 queries, 5 keys)."""
    options = dict(options)
    kv_heads = 2 if options.pop("gqa", False) else 4
    layout = options.get("layout", "bhsd")
    rng = np.random.default_rng(4)
    shapes = [(1, 4, 9, 32), (1, kv_heads, 5, 32), (1, kv_heads, 5, 32)]
    q, k, v = (rng.standard_normal(shape).astype(dtype) for shape in shapes)
    if layout == "bshd":
        q, k, v = (array.transpose(0, 2, 1, 3).copy() for array in (q, k, v))
    plan = npattn.plan(q, k, v, return_lse=True, backend="cpu", **options)
    plan.run(q, k, v)  # the first call types the entry point (on zeros and -inf)
    expected = plan.planned_forward(q, k, v)
    forward = plan._forward_plan

    def poisoned(make):
        return lambda: np.full_like(make(), np.nan)

    forward.out_empty, forward.lse_empty = poisoned(forward.out_empty), poisoned(forward.lse_empty)
    assert forward._entries
    # (the kernel's own result: a NaN left in out would send run() to the full path, which
    # would answer right all the same)
    result = plan.planned_forward(q, k, v)
    assert result is not None, "the kernel left a NaN of the poisoned out"
    np.testing.assert_array_equal(result.out.view(np.uint8), expected.out.view(np.uint8))
    np.testing.assert_array_equal(result.lse.view(np.uint8), expected.lse.view(np.uint8))
    out, lse = plan.run(q, k, v)
    if options.get("causal") is True:  # bottom-right: queries 0-3 see no key
        assert np.isneginf(lse[:, :, :4]).all() and not (out[:, :4] if layout == "bshd" else out[:, :, :4]).any()


def test_float16_inputs_run_in_float32_and_return_float16():
    rng = np.random.default_rng(2)
    q, k, v = _problem(rng, dtype=np.float16)
    out, lse = npattn.attention(q, k, v, causal=True, return_lse=True, backend="cpu")
    exact, exact_lse = npattn.attention(*(a.astype(np.float64) for a in (q, k, v)), causal=True,
                                        return_lse=True, backend="reference")
    assert out.dtype == np.float16 and lse.dtype == np.float32
    length = k.shape[2] + q.shape[3]
    assert_close(out, exact, np.float16, length, float(np.abs(v).max()), "out")
    assert_close(lse, exact_lse, np.float16, length, 1 + float(np.abs(exact_lse).max()), "lse")


def test_tile_sizes_must_be_positive():
    with pytest.raises(ValueError, match="block_q=0"):
        with cpu.tile_sizes(0, 8):
            pass
    with pytest.raises(ValueError, match="edge_band=0"):
        with cpu.tile_sizes(4, 8, edge_band=0):
            pass


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_later_key_far_above_the_running_max_is_handled_exactly(dtype):
    """The forward guesses each row's max from earlier key tiles; a later score more than the
    kernel's headroom above it must send the tile back through a fresh max pass."""
    rng = np.random.default_rng(3)
    q, k, v = _problem(rng, dtype=dtype, q_len=9, kv_len=40, dim=8)
    bias = np.zeros((1, 1, 9, 40), dtype)
    bias[..., 5, 31] = 80.0    # one row jumps in a late tile
    bias[..., 6, 20:] = 200.0  # another by more than float32's exp range
    for options in ({"bias": bias}, {"bias": bias, "sink_logits": rng.normal(size=4) - 100}):
        with cpu.tile_sizes(4, 8):
            out, lse = npattn.attention(q, k, v, return_lse=True, backend="cpu", **options)
        exact, exact_lse = npattn.attention(*(a.astype(np.float64) for a in (q, k, v)), return_lse=True,
                                            backend="reference", **options)
        length = k.shape[2] + q.shape[3]
        assert_close(out, exact, dtype, length, float(np.abs(v).max()), "out")
        assert_close(lse, exact_lse, dtype, length, 1 + float(np.abs(exact_lse).max()), "lse")


@pytest.mark.parametrize("hand_off", ["crew", "pool"])
def test_small_calls_run_on_the_calling_thread_and_large_ones_share_the_work(monkeypatch, hand_off):
    """Below threads.FORWARD_INLINE_FLOPS of work (BACKWARD_INLINE_FLOPS for a backward) no
    item goes to another thread (the hand-off cost more than a small call's whole work);
    above it, with 2 threads, the crew takes them (npattn/cpu/crew.py), or with
    NPATTN_SPIN_US=0, from POOL_INLINE_FLOPS, the pool; the bits are the same either way."""
    from npattn.cpu import crew, threads

    submitted = []
    if hand_off == "pool":
        monkeypatch.setenv("NPATTN_SPIN_US", "0")
        real_submit = threads._submit
        monkeypatch.setattr(threads, "_submit", lambda calls: submitted.append(len(calls)) or real_submit(calls))
    else:
        real_run = crew.Crew.run
        monkeypatch.setattr(crew.Crew, "run", lambda self, *arguments: submitted.append(arguments[-2] - 1)
                            or real_run(self, *arguments))
    monkeypatch.setenv("NPATTN_NUM_THREADS", "2")
    rng = np.random.default_rng(0)
    small = [rng.standard_normal((1, 8, 16, 64), dtype=np.float32) for _ in range(3)]
    out, vjp = npattn.attention_vjp(*small, backend="cpu")
    vjp(out)
    assert submitted == []
    # between the two: 1.2 MFLOP, a forward that the crew shares and a backward it does not;
    # the pool, whose hand-off costs more, shares neither (POOL_INLINE_FLOPS)
    assert threads.FORWARD_INLINE_FLOPS <= 2 * 8 * 24 * 24 * 128 < threads.BACKWARD_INLINE_FLOPS
    assert 2 * 8 * 24 * 24 * 128 < threads.POOL_INLINE_FLOPS <= 2 * 8 * 256 * 256 * 128
    middle = [rng.standard_normal((1, 8, 24, 64), dtype=np.float32) for _ in range(3)]
    out, vjp = npattn.attention_vjp(*middle, backend="cpu")
    middle_shared = [1] if hand_off == "crew" else []
    assert submitted == middle_shared
    gradients = vjp(out)
    assert submitted == middle_shared
    large = [rng.standard_normal((1, 8, 256, 64), dtype=np.float32) for _ in range(3)]
    shared = npattn.attention(*large, backend="cpu")
    shared_gradients = npattn.attention_vjp(*large, backend="cpu")[1](shared)
    assert submitted == middle_shared + [1] * 3  # (the large forward, and the large vjp's two passes)
    monkeypatch.setenv("NPATTN_NUM_THREADS", "1")
    assert npattn.attention(*large, backend="cpu").tobytes() == shared.tobytes()
    alone = npattn.attention_vjp(*large, backend="cpu")[1](shared)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(alone, shared_gradients))
    middle_alone = npattn.attention_vjp(*middle, backend="cpu")[1](out)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(middle_alone, gradients))


def _claims_kernel():
    """A kernel for run_items that records, per item, the first item of the claim that
    handed it out."""
    from numba import njit

    from npattn.cpu.threads import claim_items

    @njit(nogil=True)
    def record_claims(claim_of, run, counter, items):
        while True:
            first, stop = claim_items(counter, items, run)
            if first >= items:
                break
            for item in range(first, stop):
                claim_of[item] = first
    return record_claims


@pytest.mark.parametrize("threads, items, run", [(2, 64 * 6, 6), (3, 8 * 11, 11), (2, 7, 3), (2, 12, 6),
                                                 (1, 10, 5), (3, 9, 1)])
def test_threads_claim_whole_runs_of_items_but_the_last_ones_item_by_item(monkeypatch, threads, items, run):
    """claim_items hands out every item exactly once: the items of each run (a bfloat16
    forward's kv head, whose key tiles the claiming thread then packs once) in one claim,
    but for the last ``threads`` runs (and the items past whole runs), claimed one by one
    so that the threads finish together."""
    from npattn.cpu import threads as threads_module

    monkeypatch.setenv("NPATTN_NUM_THREADS", str(threads))
    claim_of = np.full(items, -1, np.int64)
    counter = threads_module.run_items(_claims_kernel(), (claim_of, run), items)
    whole = max(0, items // run - threads) * run if run > 1 else 0
    runs_first = np.arange(items) - np.arange(items) % run
    assert (claim_of[:whole] == runs_first[:whole]).all()
    assert (claim_of[whole:] == np.arange(whole, items)).all()
    assert counter[threads_module.THREADS] == min(items, threads)


def _slow_items_kernel():
    """A kernel for run_items whose item ``i`` spins ``work[i]`` rounds before it marks
    ``done[i]``, and records in ``ran_by[i]`` whether the calling thread ran it."""
    from numba import njit

    from npattn.cpu.threads import next_item

    @njit(nogil=True)
    def slow_items(work, done, ran_by, caller, counter, items):
        while True:
            item = next_item(counter, items)
            if item >= items:
                break
            total = 0.0
            for x in range(work[item]):
                total += np.sqrt(x + total)
            ran_by[item] = caller
            done[item] = 1 if total >= 0 else 2
    return slow_items


@pytest.mark.parametrize("hand_off", ["pool watched", "pool waited", "crew watched", "crew napping"])
def test_a_call_returns_once_every_item_is_done_whoever_finishes_last(monkeypatch, hand_off):
    """run_items returns only when each item is done, also where a worker is still in its
    item as the calling thread runs out of items. The pool's: watched through the counter
    (each thread counts itself out after its last write; here with polls enough for any
    wait) or, where the watch gives up (here at once), on the worker's future. The crew's:
    watched through the worker's DONE slot, or (its watch here a single poll) between naps."""
    from npattn.cpu import crew, threads

    monkeypatch.setenv("NPATTN_NUM_THREADS", "2")
    monkeypatch.setattr(threads, "WATCH_PAUSES", 10**12)
    monkeypatch.setenv("NPATTN_SPIN_US", "0" if hand_off.startswith("pool") else "200")
    watched = hand_off.endswith("watched")
    if hand_off == "pool waited":
        monkeypatch.setattr(threads, "threads_out", lambda counter, count, pauses: False)
    if hand_off == "crew napping":
        monkeypatch.setattr(crew, "DONE_POLLS", 1)
        naps = []
        real_nap = crew._nap
        monkeypatch.setattr(crew, "_nap", lambda: naps.append(1) or real_nap())
    waited = []
    real_submit = threads._submit

    def submit(calls):
        futures = real_submit(calls)
        for future in futures:
            real_result = future.result
            future.result = lambda *timeout, real_result=real_result: waited.append(1) or real_result(*timeout)
        return futures
    monkeypatch.setattr(threads, "_submit", submit)
    kernel = _slow_items_kernel()
    caller = threading.current_thread()

    def run(work, done, ran_by, counter, items):
        if threading.current_thread() is caller:
            # the worker claims the first item, the long one, before the calling thread
            # starts: it then runs the short rest and runs out while the worker works
            deadline = time.monotonic() + 60
            while counter[threads.CLAIMED] < 1:
                assert time.monotonic() < deadline, "the worker never started"
                time.sleep(0.0002)
        kernel(work, done, ran_by, int(threading.current_thread() is caller), counter, items)
    work = np.array([40_000_000, 1000, 1000, 1000, 1000], np.int64)
    done, ran_by = np.zeros(work.size, np.int64), np.full(work.size, -1, np.int64)
    counter = threads.run_items(run, (work, done, ran_by), work.size)
    assert (done == 1).all(), done
    assert ran_by.tolist() == [0, 1, 1, 1, 1]
    assert counter[threads.OUT] == 2
    if hand_off.startswith("pool"):
        assert bool(waited) != watched
    else:
        assert not waited
        if hand_off == "crew napping":
            assert naps


@pytest.mark.parametrize("hand_off", ["pool", "crew"])
def test_a_worker_that_fails_before_its_kernel_runs_raises_from_the_call(monkeypatch, hand_off):
    """A worker that never reaches its kernel never counts itself out: the call stops
    watching the counter and raises the worker's error from its future (the pool), or
    from the crew's record of it once the worker is back in its watch."""
    from npattn.cpu import threads

    monkeypatch.setenv("NPATTN_NUM_THREADS", "2")
    monkeypatch.setenv("NPATTN_SPIN_US", "0" if hand_off == "pool" else "200")
    monkeypatch.setattr(threads, "WATCH_PAUSES", 1000)
    kernel = _slow_items_kernel()
    caller, worker_started = threading.current_thread(), threading.Event()

    def run(work, done, ran_by, counter, items):
        if threading.current_thread() is not caller:
            worker_started.set()
            raise RuntimeError("the worker failed before its kernel")
        assert worker_started.wait(10)  # (else the worker would be cancelled, never run)
        kernel(work, done, ran_by, 1, counter, items)
    work = np.full(4, 10, np.int64)
    done, ran_by = np.zeros(4, np.int64), np.full(4, -1, np.int64)
    with pytest.raises(RuntimeError, match="before its kernel"):
        threads.run_items(run, (work, done, ran_by), 4)
    assert (done == 1).all()


_FOLDING_OPTIONS = [{}, {"causal": True}, {"window": (None, 2)}, {"softcap": 2.0, "scale": 0.3},
                    {"causal": True, "window": (None, 1)}, {"kv_lengths": np.array([5, 37])},
                    {"q_lengths": np.array([1, 0])}, {"causal": True, "alibi_slopes": np.linspace(0.05, 0.6, 12)},
                    {"alibi_slopes": np.linspace(-0.3, 0.4, 24).reshape(2, 12)},
                    {"sink_logits": np.linspace(-2, 3, 12, dtype=np.float32)}]


@pytest.mark.parametrize("options, q_len, tiles", [
    *((options, q_len, tiles) for options in _FOLDING_OPTIONS for q_len, tiles in ((1, None), (7, None), (7, (28, 5)))),
    # a left window bound folds a decode step's one row (its folded rows share one band), sinks too
    ({"causal": True, "window": (5, 0)}, 1, None), ({"causal": True, "window": (5, 0), "sinks": 2}, 1, (28, 5)),
    ({"window": (3, 3), "sink_logits": np.ones(12, np.float32), "alibi_slopes": np.full(12, 0.2)}, 1, (28, 5))])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_gqa_forward_folds_query_heads_into_rows_with_the_same_bits(monkeypatch, options, layout, q_len, tiles):
    """GQA runs forward as Sq x group rows per kv head (cpu/folding.py), the rows of a
    position side by side: out, lse, weights, and the gradients computed from them, are
    bit for bit those of the unfolded kernels, also with many key tiles, with each folded
    row's own ALiBi slope and sink logit, and a decode step's left window bound."""
    from npattn.cpu import folding

    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 12, q_len, 16), dtype=np.float32)
    k, v = (rng.standard_normal((2, 3, 37, 16), dtype=np.float32) for _ in range(2))
    if layout == "bshd":
        q, k, v = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v))
    if "q_lengths" in options:
        options = {"q_lengths": np.array([q_len, q_len // 2])}

    def run():
        with cpu.tile_sizes(*(tiles or (192, 384))):
            (out, lse, weights), vjp = npattn.attention_vjp(q, k, v, layout=layout, return_lse=True,
                                                            return_weights=True, backend="cpu", **options)
            return [out, lse, weights, *vjp(np.ones_like(out))]

    calls = []
    real_fold = folding.fold
    monkeypatch.setattr(folding, "fold", lambda problem: calls.append(1) or real_fold(problem))
    folded = run()
    assert calls, "the forward was not folded"
    monkeypatch.setattr(folding, "foldable", lambda problem, tuning: False)
    npattn.runtime.plans.clear()  # the folded call's plans would answer again
    for got, expected in zip(folded, run()):
        assert got.shape == expected.shape and got.tobytes() == expected.tobytes()


@settings(max_examples=30)
@given(case=cases(dtypes=("float32", "float64"), dims_strategy=dims(max_len=40)), layout=layouts,
       block_k=st.integers(1, 9))
def test_short_queries_split_over_key_ranges_match_the_reference(case, layout, block_k):
    """Every key range a short query's keys are cut into (here from one key tile up, see
    cpu/splitting.py) merges, by lse, to the reference's out and lse: causal, window,
    sinks, lengths, masks, bias and dropout hold in each range."""
    from unittest import mock

    from npattn.cpu import splitting

    with mock.patch.object(splitting, "MIN_SPLIT_KEYS", 1), cpu.tile_sizes(64, block_k):
        check_forward("cpu", case, layout)
        check_backward("cpu", case, layout)


def test_decode_key_ranges_depend_on_the_shapes_only():
    """An MQA decode step at B = 1 is one work item: cut into 8 ranges of whole key tiles
    (none empty), as is any decode step at B = 1 once its items hold every head; 8 items
    of one head each, or 16 entries, need no split, nor do long queries; the
    weights need the whole row, and packed rows write their out and lse in place (sink
    logits split: they enter the merge); a window of fewer keys than two ranges would
    leave all ranges but one empty."""
    from npattn.core.masks import Visibility
    from npattn.cpu import splitting

    def problem(**fields):  # the fields key_splits reads
        defaults = dict(batch=1, heads=1, q_len=1, kv_len=8192, return_weights=False, sink_logits=None,
                        packed_rows=False, visibility=Visibility())
        return type("Problem", (), {**defaults, **fields})

    assert splitting.key_splits(problem(), (192, 384)) == (8, 1152)
    assert splitting.key_splits(problem(kv_len=2500), (192, 384)) == (2, 1536)
    assert splitting.key_splits(problem(heads=8), (192, 384)) == (1, 8192)
    # a decode step's items hold every head (cpu.operands.head_group): B of them
    assert splitting.key_splits(problem(heads=8), (192, 384), heads_per_item=8) == (8, 1152)
    assert splitting.key_splits(problem(batch=16, heads=8), (192, 384), heads_per_item=8) == (1, 8192)
    assert splitting.key_splits(problem(kv_len=1500), (192, 384)) == (1, 1500)
    assert splitting.key_splits(problem(q_len=193), (192, 384)) == (1, 8192)
    assert splitting.key_splits(problem(return_weights=True), (192, 384)) == (1, 8192)
    assert splitting.key_splits(problem(sink_logits=np.zeros(1)), (192, 384)) == (8, 1152)  # (sinks join the merge)
    assert splitting.key_splits(problem(packed_rows=True), (192, 384)) == (1, 8192)
    window = Visibility.from_options(True, (128, 0), 0)
    assert splitting.key_splits(problem(visibility=window), (192, 384)) == (1, 8192)
    assert splitting.key_splits(problem(visibility=Visibility.from_options(True, (2047, 0), 0)), (192, 384)) == (
        2, 4224)
    assert splitting.key_splits(problem(visibility=Visibility.from_options(False, (128, None), 0)), (192, 384)) == (
        8, 1152)  # (unbounded on the right)
    assert splitting.key_splits(problem(visibility=Visibility.from_options(True, (1000, 0), 1100)), (192, 384)) == (
        2, 4224)  # (the sinks add their keys)


@pytest.mark.parametrize("options", [{}, {"kv_lengths": np.array([3000])}, {"causal": True, "window": (2100, 0)},
                                     {"sink_logits": np.array([0.5, -1.0, 2.0, 100.0], np.float32)},
                                     {"sink_logits": np.array([0.5, -1.0, 2.0, 100.0], np.float32),
                                      "kv_lengths": np.array([1100])},
                                     {"sink_logits": np.array([0.5, -1.0, 2.0, 100.0], np.float32),
                                      "kv_lengths": np.array([0])}])
def test_split_decode_steps_give_the_same_bits_on_any_thread_count(monkeypatch, options):
    """A decode step cut into key ranges (an MQA group folded, its rows' sink logits
    entering the merge): the same bits on 1, 2 and 3 threads, and the reference's out and
    lse, with keys in the first range only and with none at all (out 0, lse -inf)."""
    from npattn.cpu import splitting

    merges = []
    real_merge = splitting.merge
    monkeypatch.setattr(splitting, "merge", lambda *arrays: merges.append(1) or real_merge(*arrays))
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 4, 1, 32), dtype=np.float32)
    k, v = (rng.standard_normal((1, 1, 4500, 32), dtype=np.float32) for _ in range(2))
    results = []
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("NPATTN_NUM_THREADS", threads)
        out, lse = npattn.attention(q, k, v, return_lse=True, backend="cpu", **options)
        results.append(out.tobytes() + lse.tobytes())
    assert len(merges) == 3, "the decode step was not split"
    assert results[0] == results[1] == results[2]
    exact, exact_lse = npattn.attention(*(x.astype(np.float64) for x in (q, k, v)), return_lse=True,
                                        backend="reference", **options)
    assert_close(out, exact, np.float32, k.shape[2] + q.shape[3], float(np.abs(v).max()), "out")
    finite = np.abs(exact_lse[np.isfinite(exact_lse)])
    assert_close(lse, exact_lse, np.float32, k.shape[2] + q.shape[3], 1 + float(finite.max(initial=0)), "lse")


def _head_major(x):
    """``x`` (B, S, H, D) as a view of head-major memory: the same values, each head's rows in order."""
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)


_DECODE_OPTIONS = ({}, {"causal": True}, {"window": (300, 0)}, {"softcap": 2.0, "scale": 0.3},
                   {"kv_lengths": np.array([2600, 1100]), "q_offset": np.array([2599, 1099])},
                   {"dropout_p": 0.3, "seed": 7})
_DECODE_SHAPES = ((4, 4, 1, "float32"), (8, 2, 1, "float32"), (8, 2, 2, "float32"), (6, 3, 1, "float64"),
                  (8, 2, 1, "float16"), (8, 2, 1, "bfloat16"), (8, 2, 1, "int8"), (8, 2, 1, "float8_e4m3"))


# (a quantized cache is read through attention_with_kvcache, which sets the lengths and
# offsets itself and takes no dropout)
@pytest.mark.parametrize("heads, kv_heads, q_len, cache, options", [
    (*shape, options) for shape in _DECODE_SHAPES for options in _DECODE_OPTIONS
    if shape[3] not in ("int8", "float8_e4m3") or not {"kv_lengths", "dropout_p"} & set(options)])
def test_decode_items_visit_every_head_of_a_key_row_with_the_bits_of_one_head_each(monkeypatch, heads, kv_heads,
                                                                                 q_len, cache, options):
    """A decode step's work item holds every head (cpu.operands.head_group): on keys whose
    rows hold every head (B, S, Hkv, D) it visits each key tile head by head, prefetching
    the next tile in memory order; on head-major keys one head at a time. Both give the
    same bits, across many key tiles and two key ranges, float and quantized or 16-bit
    caches alike, and match the float64 reference."""
    from npattn.cpu import operands

    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, q_len, heads, 32)).astype(np.float32 if cache != "float64" else np.float64)
    k, v = (rng.standard_normal((2, 2600, kv_heads, 32)) for _ in range(2))
    codes = {}
    if cache in ("int8", "float8_e4m3"):
        (k, k_scale), (v, v_scale) = npattn.quantize_kv(k, cache), npattn.quantize_kv(v, cache)
        codes = {"k_scale": k_scale, "v_scale": v_scale}
    else:
        dtype = np.dtype(ml_dtypes.bfloat16 if cache == "bfloat16" else cache)
        k, v = k.astype(dtype), v.astype(dtype)
        q = q.astype(dtype) if dtype.itemsize == 2 else q
    groups = []
    real_group = operands.head_group
    monkeypatch.setattr(operands, "head_group", lambda *a: groups.append(real_group(*a)) or groups[-1])

    def run(keys, values, scales):
        npattn.runtime.plans.clear()
        with cpu.tile_sizes(64, 128):  # 21 key tiles, in two key ranges
            if not scales:
                return npattn.attention(q, keys, values, layout="bshd", return_lse=True, backend="cpu", **options)
            return npattn.attention_with_kvcache(q, keys, values, cache_seqlens=2600, return_lse=True, backend="cpu",
                                                 **scales, **options)

    rows = run(k, v, codes)
    (per_item, group), = set(groups)  # every head in an item; visited head by head where each reads its kv head
    assert group == (per_item if per_item == kv_heads else 1), groups
    groups.clear()
    by_head = run(_head_major(k), _head_major(v), {name: _head_major(s[..., None])[..., 0]
                                                    for name, s in codes.items()})
    assert set(groups) == {(per_item, 1)}, groups
    for got, expected in zip(rows, by_head):
        assert got.tobytes() == expected.tobytes()
    if "dropout_p" in options:
        return
    keys, values = (npattn.dequantize_kv(x, codes[f"{name}_scale"], np.float64) if codes else x.astype(np.float64)
                    for name, x in (("k", k), ("v", v)))
    exact, exact_lse = npattn.attention(q.astype(np.float64), keys, values, layout="bshd", return_lse=True,
                                        backend="reference", **options)
    dtype = q.dtype
    assert_close(rows[0], exact, dtype, 2600 + 32, float(np.abs(values).max()), "out")
    assert_close(rows[1], exact_lse, np.float32 if dtype.itemsize == 2 else dtype, 2600 + 32,
                 1 + float(np.abs(exact_lse).max()), "lse")


@pytest.mark.parametrize("cpu_name, slice_bytes, asks", [
    ("znver4", 128, True), ("znver4", 512, True), ("znver4", 1024, True), ("emeraldrapids", 128, True),
    ("emeraldrapids", 256, True), ("emeraldrapids", 512, False), ("sapphirerapids", 1024, False)])
def test_decode_items_ask_for_the_next_tile_where_the_cores_need_it(cpu_name, slice_bytes, asks):
    """AMD's cores ask memory for the next key tile always; Intel's only where each head's
    slice of a key row is shorter than 512 bytes (npattn.cpu.isa.tile_prefetch_pays)."""
    from unittest import mock

    from npattn.cpu import isa

    with mock.patch.object(isa, "host_cpu_name", return_value=cpu_name):
        assert isa.tile_prefetch_pays(slice_bytes) is asks


@pytest.mark.parametrize("cpu_name, asks", [("znver3", True), ("znver2", True), ("znver4", False),
                                            ("znver5", True), ("emeraldrapids", True), ("skylake-avx512", True)])
def test_decode_products_ask_for_the_rows_a_tile_on_where_the_cores_need_it(cpu_name, asks):
    """Intel's cores, the AVX2 Zen cores and Zen 5 ask for the rows a tile on as the
    products go; Zen 4 keeps the bursts (npattn.cpu.isa.row_prefetch_pays)."""
    from unittest import mock

    from npattn.cpu import isa

    with mock.patch.object(isa, "host_cpu_name", return_value=cpu_name):
        assert isa.row_prefetch_pays() is asks


@pytest.mark.parametrize("cpu_name, rows", [("znver3", 33), ("znver4", 33), ("znver5", 33), ("emeraldrapids", 16),
                                            ("skylake-avx512", 16), ("haswell", 16)])
def test_16_bit_values_convert_once_from_the_rows_that_pay_on_the_cores(monkeypatch, cpu_name, rows):
    """A forward reading 16-bit values a tile at a time converts them once per tile from 16
    query rows on Intel's cores, whose conversions share the FMA ports, and from 33 on AMD's
    (npattn.cpu.isa.converted_value_rows): the plan's Int.CONVERTED_VALUE_ROWS, unless a
    tuning sets it."""
    from npattn.cpu import isa, operands
    from npattn.cpu.operands import Int
    from npattn.cpu.tuning import tuned

    seen = []
    real_parameters = operands._parameters

    def parameters(*args, **kwargs):
        ints, reals = real_parameters(*args, **kwargs)
        seen.append(int(ints[Int.CONVERTED_VALUE_ROWS]))
        return ints, reals

    monkeypatch.setattr(operands, "_parameters", parameters)
    monkeypatch.setattr(isa, "host_cpu_name", lambda: cpu_name)
    q = np.random.default_rng(0).standard_normal((1, 2, 20, 32)).astype(np.float16)
    npattn.runtime.plans.clear()
    npattn.attention(q, q, q, backend="cpu")
    with tuned(converted_value_rows=5):
        npattn.attention(q, q, q, backend="cpu")
    assert seen == [rows, 5]


def _recorded_prefetch_flags(monkeypatch) -> list:
    """A list that each forward plan made from now on appends its (Int.HEAD_GROUP,
    Int.TILE_PREFETCH, Int.ROW_PREFETCH) to."""
    from npattn.cpu import operands
    from npattn.cpu.operands import Int

    flags = []
    real_parameters = operands._parameters

    def parameters(*args, **kwargs):
        ints, reals = real_parameters(*args, **kwargs)
        flags.append((int(ints[Int.HEAD_GROUP]), int(ints[Int.TILE_PREFETCH]), int(ints[Int.ROW_PREFETCH])))
        return ints, reals

    monkeypatch.setattr(operands, "_parameters", parameters)
    return flags


@pytest.mark.parametrize("cache, head_dim, slice_bytes", [("float32", 128, 512), ("float32", 64, 256),
                                                          ("float16", 128, 256), ("int8", 128, 128)])
def test_decode_steps_give_the_same_bits_with_and_without_asking_for_the_next_tile(monkeypatch, cache, head_dim,
                                                                                   slice_bytes):
    """A decode item's requests for the next tile change no bit of the step: on AMD's cores
    the next tile's rows in bursts (Int.TILE_PREFETCH); on Intel's, where the products read
    a contiguous cache's codes in registers (16-bit values, one-byte codes), the rows a
    tile on key by key as they go (Int.ROW_PREFETCH, 64 rows: the tile), and elsewhere the
    bursts only where each head's slice of a key row is shorter than 512 bytes."""
    from npattn.cpu import isa

    flags = _recorded_prefetch_flags(monkeypatch)
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 1, 8, head_dim)).astype(np.float16 if cache == "float16" else np.float32)
    k, v = (rng.standard_normal((2, 700, 8, head_dim)) for _ in range(2))
    if cache == "int8":
        (k, k_scale), (v, v_scale) = npattn.quantize_kv(k, cache), npattn.quantize_kv(v, cache)
    else:
        k, v = k.astype(cache), v.astype(cache)
    steps = {}
    for cpu_name in ("znver4", "emeraldrapids"):
        monkeypatch.setattr(isa, "host_cpu_name", lambda: cpu_name)
        npattn.runtime.plans.clear()
        with cpu.tile_sizes(64, 64):  # 11 key tiles a step
            if cache == "int8":
                steps[cpu_name] = npattn.attention_with_kvcache(q, k, v, cache_seqlens=700, k_scale=k_scale,
                                                                v_scale=v_scale, return_lse=True, backend="cpu")
            else:
                steps[cpu_name] = npattn.attention(q, k, v, layout="bshd", return_lse=True, backend="cpu")
    in_registers = cache != "float32"
    assert flags == [(8, 1, 0), (8, 0, 64) if in_registers else (8, int(slice_bytes < 512), 0)], flags
    for with_requests, without in zip(steps["znver4"], steps["emeraldrapids"]):
        assert with_requests.tobytes() == without.tobytes()


def test_paged_decode_steps_ask_for_the_next_tile_in_bursts(monkeypatch):
    """On a paged cache the rows a tile on may lie in another page: an int8 decode step on
    Intel's cores asks for the next tile's rows (its pages looked up) in bursts, not for
    the rows a tile on as the products go (Int.ROW_PREFETCH 0), and gives the bits of the
    same keys in a contiguous cache."""
    from npattn.cpu import isa

    flags = _recorded_prefetch_flags(monkeypatch)
    monkeypatch.setattr(isa, "host_cpu_name", lambda: "emeraldrapids")
    npattn.runtime.plans.clear()
    rng = np.random.default_rng(4)
    q = rng.standard_normal((2, 1, 8, 128)).astype(np.float32)
    (k, k_scale), (v, v_scale) = (npattn.quantize_kv(rng.standard_normal((2, 768, 8, 128))) for _ in range(2))
    table = np.arange(12)[::-1].reshape(2, 6)  # pages of 128 keys, in reverse
    paged = [np.ascontiguousarray(x.reshape(12, 128, *x.shape[2:])[::-1]) for x in (k, v, k_scale, v_scale)]
    with cpu.tile_sizes(64, 64):
        steps = [npattn.attention_with_kvcache(q, *arrays[:2], cache_seqlens=700, k_scale=arrays[2],
                                               v_scale=arrays[3], return_lse=True, backend="cpu", **layout)
                 for arrays, layout in (((k, v, k_scale, v_scale), {}), (paged, {"block_table": table}))]
    assert flags == [(8, 0, 64), (8, 1, 0)], flags
    for contiguous, from_pages in zip(*steps):
        assert contiguous.tobytes() == from_pages.tobytes()


def test_banded_backwards_take_small_tiles_where_they_compute_fewer_masked_scores():
    """A causal or windowed backward takes 64 x 64 tiles where they compute at most 1/1.1
    of the scores 96 x 192 tiles would (npattn.cpu.tuning.Tuning.backward_tiles): causal
    up to 1024 keys, narrow windows at any length; other backwards 96 x 192, forwards
    192 x 384, and tile_sizes overrides all of them."""
    from npattn.core.validation import build_problem
    from npattn.cpu.operands import Int, operand_plan
    from npattn.cpu.tuning import current

    def tiles(kv_len, kind="backward", **options):
        x = np.zeros((1, 2, kv_len, 64), np.float32)
        ints = operand_plan(build_problem(x, x, x, **options), kind, current()).ints
        return int(ints[Int.BLOCK_Q]), int(ints[Int.BLOCK_K])

    assert tiles(128, causal=True) == tiles(1024, causal=True) == (64, 64)
    assert tiles(2048, window=(128, 0)) == tiles(2048, window=(128, 128)) == (64, 64)
    assert tiles(2048, causal=True) == tiles(1024) == tiles(2048, window=(2000, 0)) == (96, 192)
    assert tiles(512, kind="forward", causal=True) == (192, 384)
    with cpu.tile_sizes(32, 48):
        assert tiles(128, causal=True) == tiles(1024) == (32, 48)


def test_prefills_with_a_narrow_window_take_small_forward_tiles():
    """A forward of at least 128 rows with a window's left edge takes 64 x 128 tiles where
    192 x 384 ones would compute 1.2x the scores or more (its bands trim the right edge
    only: npattn.cpu.tuning.Tuning.forward_tiles); causal ones, wide windows and short
    queries keep 192 x 384, and tile_sizes overrides it."""
    from npattn.core.validation import build_problem
    from npattn.cpu.operands import Int, operand_plan
    from npattn.cpu.tuning import current

    def tiles(q_len, kv_len, **options):
        q, keys = np.zeros((1, 2, q_len, 64), np.float32), np.zeros((1, 2, kv_len, 64), np.float32)
        ints = operand_plan(build_problem(q, keys, keys, **options), "forward", current()).ints
        return int(ints[Int.BLOCK_Q]), int(ints[Int.BLOCK_K])

    assert tiles(2048, 2048, window=(128, 0)) == tiles(1024, 1024, window=(256, 256)) == (64, 128)
    assert tiles(2048, 2048, causal=True) == tiles(2048, 2048, window=(1024, 0)) == (192, 384)
    assert tiles(16, 2048, window=(128, 0)) == (16, 384)  # a short chunk: its rows, 384 keys
    with cpu.tile_sizes(32, 48):
        assert tiles(2048, 2048, window=(128, 0)) == (32, 48)
    # and such a forward (5 x 4 tiles, bands cut by both edges) matches the float64 reference
    assert tiles(300, 500, window=(40, 3)) == (64, 128)
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((1, 2, 300, 32), (1, 2, 500, 32),
                                                                           (1, 2, 500, 32)))
    out, lse = npattn.attention(q, k, v, window=(40, 3), return_lse=True, backend="cpu")
    exact, exact_lse = npattn.attention(*(x.astype(np.float64) for x in (q, k, v)), window=(40, 3),
                                        return_lse=True, backend="reference")
    assert_close(out, exact, np.float32, 44, float(np.abs(v).max()), "out")
    assert_close(lse, exact_lse, np.float32, 44, 1 + float(np.abs(exact_lse).max()), "lse")


@settings(max_examples=60, deadline=None)
@given(q_len=st.integers(1, 700), kv_len=st.integers(1, 700), causal=st.booleans(),
       left=st.none() | st.integers(0, 300), right=st.none() | st.integers(0, 300),
       q_offset=st.none() | st.integers(-50, 700), block_q=st.integers(1, 200), block_k=st.integers(1, 200),
       edge_band=st.none() | st.integers(1, 64))
def test_scores_computed_counts_the_live_tiles_of_a_band(q_len, kv_len, causal, left, right, q_offset, block_q,
                                                         block_k, edge_band):
    """npattn.cpu.tuning.scores_computed is the area of the tiles that hold a visible
    (row, key) pair, counted one tile at a time here; with ``edge_band``, each band of a
    tile's rows stops at its last row's right edge (the forward's bands: the keys up to
    there of each live tile)."""
    from npattn.core.masks import Visibility
    from npattn.cpu.tuning import scores_computed

    window = None if left is None and right is None else (left, right)
    visibility = Visibility.from_options(causal, window, 0, q_offset)
    rows = np.arange(q_len)[:, None] + visibility.shift(q_len, kv_len)
    keys = np.arange(kv_len)[None, :]
    before_right_edge = np.ones((q_len, kv_len), bool)
    if visibility.window_right is not None:
        before_right_edge &= keys <= rows + visibility.window_right
    visible = before_right_edge.copy()
    if visibility.window_left is not None:
        visible &= keys >= rows - visibility.window_left
    area = 0
    for i0 in range(0, q_len, block_q):
        for j0 in range(0, kv_len, block_k):
            tile = visible[i0:i0 + block_q, j0:j0 + block_k]
            if not tile.any():
                continue
            if edge_band is None:
                area += tile.size
                continue
            for r0 in range(0, tile.shape[0], edge_band):
                band = tile[r0:r0 + edge_band]
                row = before_right_edge[i0 + r0 + band.shape[0] - 1]  # the band's last row's right edge
                end = (np.flatnonzero(row)[-1] + 1) if row.any() else 0
                area += band.shape[0] * min(max(end - j0, 0), tile.shape[1])
    assert scores_computed(visibility, q_len, kv_len, (block_q, block_k), edge_band) == area


def test_the_problem_signature_keys_arrays_by_layout_and_values_by_value():
    # The parameter cache keys a problem by problem.signature: every field is in it, the
    # arrays (keyed by shape, strides and dtype) in ARRAY_FIELDS, and no array among the
    # values (where it would be keyed by identity, or not be hashable).
    from npattn.core import problem
    from npattn.core.validation import build_problem

    q = np.zeros((2, 2, 3, 4))
    built = build_problem(q, q, q, mask=np.ones((3, 3), bool), bias=np.zeros((3, 3)),
                          alibi_slopes=np.ones(2), sink_logits=np.zeros(2), q_lengths=np.array([3, 2]),
                          kv_lengths=np.array([1, 3]), q_start=np.array([1, 0]), kv_start=np.array([0, 1]),
                          q_offset=np.array([0, 2]), block_table=np.array([[1], [0]]), softcap=2.0, dropout_p=0.1,
                          seed=1)
    # (a quantized kv cache's scales come from attention_with_kvcache, not from an option)
    built = dataclasses.replace(built, k_scale=np.ones((2, 2, 3), np.float32), v_scale=np.ones((2, 2, 3), np.float32))
    fields = {f.name for f in dataclasses.fields(problem.AttentionProblem)}
    assert fields == {"xp", *problem.ARRAY_FIELDS, *problem.VALUE_FIELDS}
    assert all(hasattr(getattr(built, name), "shape") for name in problem.ARRAY_FIELDS)
    assert not any(hasattr(getattr(built, name), "shape") for name in problem.VALUE_FIELDS)
    hash(problem.signature(built))


@given(case=cases(dtypes=("float32", "float64"), dims_strategy=dims(max_len=13)), layout=layouts,
       kind=st.sampled_from(["forward", "backward"]), tile=tiles)
@settings(max_examples=60)
def test_cached_parameters_equal_fresh_ones(case, layout, kind, tile):
    # Examples share shapes and differ in options: any option the cache key missed would
    # hand a later example an earlier one's parameters.
    from npattn.cpu import operands
    from npattn.core.validation import build_problem

    q, k, v = (a.transpose(0, 2, 1, 3) if layout == "bshd" else a for a in (case.q, case.k, case.v))
    options = {name: value for name, value in case.options.items() if name != "dropout_p"}
    problem = build_problem(q, k, v, layout=layout, **options)
    with cpu.tile_sizes(*tile):
        ops = operands.build_operands(problem, kind)
        again = operands.build_operands(problem, kind)
        npattn.runtime.plans.clear()
        fresh = operands.build_operands(problem, kind)
    for name in ("ints", "reals", "spans"):
        assert np.array_equal(getattr(ops, name), getattr(fresh, name)), name
        assert getattr(ops, name) is getattr(again, name) or name == "spans"
    assert all(not array.flags.writeable for array in ops)  # one compiled kernel for all


@pytest.mark.parametrize("head_dim", [8, 16, 64])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_16_bit_one_hot_row_with_dropout_has_an_exact_zero_dq_on_the_cpu(dtype, head_dim):
    """One key at scale 1e4 with dropout: its row is one-hot, so dq is exactly 0. The
    backward subtracts O from the kept key's z v for that gradient, exact only for the
    forward's float32 product: the CPU forward of a vjp keeps it, where a plain call writes
    its 16-bit out directly (a rounded O had left dq = 0.41 k; found by hypothesis at head
    dim 8, whose 16-bit forward reads its arrays by tiles and writes out in float16)."""
    import ml_dtypes  # noqa: F401  (registers bfloat16)
    import npattn
    from npattn.core.validation import build_problem
    from npattn.cpu import driver
    from npattn.cpu.tuning import current

    rng = np.random.default_rng(7)
    q, k = (rng.standard_normal((1, 1, 1, head_dim)).astype(dtype) for _ in range(2))
    v = rng.standard_normal((1, 1, 1, 2)).astype(dtype)
    options = dict(dropout_p=0.1, seed=0, scale=1e4, backend="cpu")
    dout = np.array([[[[0.5, -1.0]]]]).astype(dtype)
    for _ in range(3):  # the full path twice, then the plan
        out, vjp = npattn.attention_vjp(q, k, v, **options)
        dq, dk, dv = vjp(dout)
        assert not np.asarray(dq, np.float64).any() and not np.asarray(dk, np.float64).any()
        np.testing.assert_array_equal(out, npattn.attention(q, k, v, **options))
    options.pop("backend")
    plan = driver.forward_plan(build_problem(q, k, v, **options), current())
    assert plan.out_codes  # (a plain call's forward writes its 16-bit out itself)
    assert plan.for_gradients().out_codes is False and plan.for_gradients() is plan.for_gradients()
