"""A call like an earlier one (npattn/runtime/plans.py) skips the checks whose outcome is known and
runs the plan the earlier call left: it must answer exactly as a first call would, and
every call the checks would reject must still be rejected."""
from __future__ import annotations

import gc
import os
import threading
import weakref

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn
from npattn import cpu
from npattn.cpu import conversion, simd
from npattn.cpu.tuning import tuned
from npattn.runtime import plans
from conftest import count_direct_entries
from strategies import cases, dims, layouts, to_layout

pytestmark = pytest.mark.skipif(not npattn.backends()["cpu"], reason="needs the cpu backend")

# the options a repeated call can skip the checks of: plain values, nothing per call
_PLAIN_OPTIONS = ("causal", "window", "sinks", "scale", "softcap")
# and with arrays keyed by their values (Option.keyed)
_KEYED_OPTIONS = ("causal", "window", "q_offset", "alibi_slopes", "kv_lengths", "q_lengths", "q_start", "kv_start")


def _same(a, b):
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape and x.flags.c_contiguous == y.flags.c_contiguous
        assert x.tobytes() == y.tobytes()


@settings(max_examples=40)
@given(case=cases(options=_PLAIN_OPTIONS, dtypes=("float32", "float64", "float16"),
                  dims_strategy=dims(max_group=4, max_len=20, max_dim=16)),
       layout=layouts, return_lse=st.booleans())
def test_a_repeated_call_answers_as_a_first_call(case, layout, return_lse):
    q, k, v = (to_layout(a, layout) for a in (case.q, case.k, case.v))
    options = {**case.options, "layout": layout, "return_lse": return_lse}
    plans.clear()
    first = npattn.attention(q, k, v, **options)
    key = plans.call_key(q, k, v, options)
    assert key is not None and plans.lookup(key) is None, "planned at the first call"
    second = npattn.attention(q, k, v, **options)
    assert plans.lookup(key) is not None, "two calls left no plan"
    again = npattn.attention(q, k, v, **options)
    _same(first, second)
    _same(first, again)
    # new arrays of the same structure, other values: the plan serves them too
    rng = np.random.default_rng(1)
    q2, k2, v2 = (np.ascontiguousarray(rng.standard_normal(a.shape).astype(a.dtype)) for a in (case.q, case.k, case.v))
    q2, k2, v2 = (to_layout(a, layout) for a in (q2, k2, v2))
    planned = npattn.attention(q2, k2, v2, **options)
    plans.clear()
    _same(planned, npattn.attention(q2, k2, v2, **options))


@settings(max_examples=30)
@given(case=cases(options=_PLAIN_OPTIONS, dtypes=("float32", "float64"),
                  dims_strategy=dims(max_group=4, max_len=20, max_dim=16)),
       layout=layouts)
def test_a_repeated_vjp_answers_as_a_first_one(case, layout):
    _check_repeated_vjps(case, layout)


@settings(max_examples=30)
@given(case=cases(options=_KEYED_OPTIONS, dtypes=("float32", "float64"),
                  dims_strategy=dims(max_group=4, max_len=20, max_dim=16)),
       layout=layouts)
def test_a_repeated_vjp_with_option_arrays_answers_as_a_first_one(case, layout):
    """Option arrays keyed by value: the planned forward and backward read the plan's
    copies of them (the backward had run without them)."""
    _check_repeated_vjps(case, layout)


def _check_repeated_vjps(case, layout):
    q, k, v = (to_layout(a, layout) for a in (case.q, case.k, case.v))
    options = {**case.options, "layout": layout}
    rng = np.random.default_rng(2)

    def run():
        out, vjp = npattn.attention_vjp(q, k, v, **options)
        dout = rng.standard_normal(out.shape).astype(out.dtype)
        return (out, *vjp(dout))

    plans.clear()
    rng = np.random.default_rng(2)
    first = run()
    rng = np.random.default_rng(2)
    _same(first, run())
    assert plans.lookup(plans.call_key(q, k, v, options)).backward_plan is not None
    rng = np.random.default_rng(2)
    _same(first, run())


def test_a_forward_plan_alone_is_completed_by_the_first_vjp():
    q, k, v = _arrays()
    npattn.attention(q, k, v)
    npattn.attention(q, k, v)
    assert plans.lookup(plans.call_key(q, k, v, {}))._backward_plan is None  # made at the first use
    out, vjp = npattn.attention_vjp(q, k, v)
    grads = vjp(np.ones_like(out))
    assert plans.lookup(plans.call_key(q, k, v, {}))._backward_plan is not None
    out2, vjp2 = npattn.attention_vjp(q, k, v)
    _same((out, *grads), (out2, *vjp2(np.ones_like(out))))


def test_a_non_finite_dout_after_a_planned_vjp_gets_the_references_gradients():
    q, k, v = _arrays()
    for _ in range(2):
        out, vjp = npattn.attention_vjp(q, k, v)
    dout = np.ones_like(out)
    dout[0, 1, 2, 3] = np.inf
    dq, dk, dv = vjp(dout)
    expected = npattn.attention_vjp(q, k, v, backend="reference")[1](dout)
    for got, want in zip((dq, dk, dv), expected):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(dq).any()
    with pytest.raises(ValueError, match="dout"):
        vjp(np.ones((1, 2, 4, 7), np.float32))


@pytest.mark.parametrize("shapes, options", [
    (((1, 8, 16, 64), (1, 8, 16, 64)), {}),
    (((2, 8, 1, 32), (2, 2, 300, 32)), {"causal": True}),  # GQA folded into rows
    (((1, 8, 1, 32), (1, 1, 5000, 32)), {}),               # keys split into ranges
    (((1, 8, 3, 32), (1, 2, 40, 32)), {"window": (4, 0), "sinks": 2}),
])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_repeated_calls_of_each_cpu_path_give_the_same_bits(shapes, options, layout):
    rng = np.random.default_rng(0)
    (q_shape, kv_shape) = shapes
    q = rng.standard_normal(q_shape, dtype=np.float32)
    k, v = (rng.standard_normal(kv_shape, dtype=np.float32) for _ in "kv")
    q, k, v = (to_layout(a, layout) for a in (q, k, v))
    results = [npattn.attention(q, k, v, layout=layout, return_lse=True, **options) for _ in range(3)]
    for result in results[1:]:
        _same(results[0], result)


@pytest.mark.parametrize("view", ["reversed", "broadcast", "sliced", "float16"])
def test_repeated_calls_on_odd_views_answer_as_first_calls(view):
    """Views whose flat memory cannot be read in place are copied on every call, the
    plan's strides those of the copy."""
    rng = np.random.default_rng(0)
    base = rng.standard_normal((2, 3, 12, 16)).astype(np.float32)
    q, k, v = {"reversed": (base[:, :, ::-1], base[:, :, ::-1], base),
               "broadcast": (base, np.broadcast_to(base[:, :, :1], base.shape), base),
               "sliced": (base[:, :, ::2, ::2], base[:, :, 1::2, ::2], base[:, :, ::2, 1::2]),
               "float16": tuple(base.astype(np.float16) for _ in "qkv")}[view]
    first = npattn.attention(q, k, v, causal=True)
    second = npattn.attention(q, k, v, causal=True)
    other = np.ascontiguousarray(base[::-1])
    changed = {"reversed": (other[:, :, ::-1], other[:, :, ::-1], other),
               "broadcast": (other, np.broadcast_to(other[:, :, :1], other.shape), other),
               "sliced": (other[:, :, ::2, ::2], other[:, :, 1::2, ::2], other[:, :, ::2, 1::2]),
               "float16": tuple(other.astype(np.float16) for _ in "qkv")}[view]
    planned = npattn.attention(*changed, causal=True)
    plans.clear()
    _same(first, second)
    _same(planned, npattn.attention(*changed, causal=True))
    assert not np.array_equal(first, planned)


def _arrays(shape=(1, 2, 4, 8), dtype=np.float32):
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal(shape).astype(dtype) for _ in "qkv")


@pytest.mark.parametrize("good, bad, error", [
    ({"causal": True}, {"causal": 1}, TypeError),            # 1 == True, but not a bool
    ({"window": (2, 1)}, {"window": (2, True)}, TypeError),
    ({"window": 2}, {"window": 2.0}, TypeError),
    ({"scale": 0.5}, {"scale": float("nan")}, ValueError),
    ({"softcap": 5.0}, {"softcap": -5.0}, ValueError),
    ({"sinks": 1}, {"sinks": -1}, ValueError),
    ({"layout": "bhsd"}, {"layout": "BHSD"}, ValueError),
    ({}, {"windows": 2}, TypeError),
    ({"backend": "cpu"}, {"backend": "cpus"}, ValueError),
])
def test_a_call_the_checks_reject_is_rejected_after_a_good_one(good, bad, error):
    q, k, v = _arrays()
    npattn.attention(q, k, v, **good)
    npattn.attention(q, k, v, **good)  # planned now
    with pytest.raises(error):
        npattn.attention(q, k, v, **bad)


def test_other_arrays_of_a_planned_structure_are_checked():
    q, k, v = _arrays()
    npattn.attention(q, k, v)
    with pytest.raises(TypeError, match="dtype"):
        npattn.attention(q, k, v.astype(np.float64))
    with pytest.raises(ValueError):
        npattn.attention(q, k[:, :1, :3], v)
    with pytest.raises(TypeError):
        npattn.attention(q, k, v.astype(np.int32))
    # subclasses and other byte orders take the full path, with its checks
    expected = npattn.attention(q, k, v)

    class Sub(np.ndarray):
        pass

    assert plans.call_key(q.view(Sub), k, v, {}) is None
    np.testing.assert_array_equal(npattn.attention(q.view(Sub), k, v), expected)
    swapped = q.astype(q.dtype.newbyteorder())
    assert plans.call_key(swapped, k, v, {}) is None
    np.testing.assert_array_equal(npattn.attention(swapped, k, v), expected)


def test_options_with_arrays_or_per_call_work_are_not_planned():
    q, k, v = _arrays()
    for options in ({"mask": np.ones((4, 4), bool)}, {"bias": np.zeros((4, 4), np.float32)},
                    {"kv_lengths": [3]}, {"sink_logits": np.zeros(2, np.float32)},
                    {"dropout_p": 0.1}, {"check_finite": True},
                    {"window": [2, 1]}, {"scale": np.float32(0.5)},
                    {"alibi_slopes": np.zeros(plans.KEYED_ENTRIES + 1, np.float32)}):
        assert plans.call_key(q, k, v, options) is None, options
    for options in ({"dropout_p": 0.0}, {"check_finite": False}, {"return_weights": False}, {"return_weights": True},
                    {"window": (None, 2)},
                    {"kv_lengths": np.array([3])}, {"q_offset": np.array([1])}, {"alibi_slopes": np.ones(2)}):
        assert plans.call_key(q, k, v, options) is not None, options


@pytest.mark.parametrize("name, good, other, bad", [
    ("kv_lengths", [5, 8], [2, 8], [5, 9]),
    ("q_lengths", [8, 3], [1, 3], [-1, 3]),
    ("kv_start", [0, 3], [4, 3], [0, 9]),
    ("q_offset", [0, -3], [2, -3], [2**40, 0]),
    ("alibi_slopes", [0.5, 0.25], [0.75, 0.25], [np.nan, 0.25]),
])
def test_small_option_arrays_key_a_repeated_call_by_their_values(monkeypatch, name, good, other, bad):
    """Lengths, starts, offsets and ALiBi slopes key a repeated call by their bytes: the
    third call with an earlier pair's values runs their plan, which holds its own copy (a
    write to the caller's array cannot reach it); other values are checked (bad ones
    raise after good ones) and answer as a first call."""
    from npattn import api

    checked = []
    real = api.build_problem
    monkeypatch.setattr(api, "build_problem", lambda *a, **o: checked.append(1) or real(*a, **o))
    q, k, v = _arrays((2, 2, 8, 16))
    dtype = np.float32 if name == "alibi_slopes" else np.int64
    caller = np.array(good, dtype)
    plans.clear()
    first = npattn.attention(q, k, v, causal=True, **{name: caller})
    npattn.attention(q, k, v, causal=True, **{name: caller})  # planned now
    assert len(checked) == 2
    caller[...] = other  # the plan's copy keeps the good values
    _same(npattn.attention(q, k, v, causal=True, **{name: np.array(good, dtype)}), first)
    assert len(checked) == 2, "a call with the planned values was checked again"
    changed = npattn.attention(q, k, v, causal=True, **{name: caller})
    assert len(checked) == 3
    plans.clear()
    _same(changed, npattn.attention(q, k, v, causal=True, **{name: np.array(other, dtype)}))
    with pytest.raises(ValueError, match=name):
        npattn.attention(q, k, v, causal=True, **{name: np.array(bad, dtype)})


def test_non_finite_inputs_after_a_planned_call_get_the_references_answer():
    q, k, v = _arrays()
    npattn.attention(q, k, v)
    npattn.attention(q, k, v)
    bad = q.copy()
    bad[0, 1, 2, 3] = np.nan
    out = npattn.attention(bad, k, v)
    assert np.isnan(out[0, 1, 2]).all() and np.isfinite(np.delete(out.reshape(-1, 8), 6, axis=0)).all()


def test_a_plan_keeps_no_input_alive():
    q, k, v = _arrays((1, 2, 64, 16))
    npattn.attention(q, k, v)
    npattn.attention(q, k, v)
    refs = [weakref.ref(a) for a in (q, k, v)]
    del q, k, v
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_a_plan_made_under_other_tile_sizes_is_not_used():
    q, k, v = _arrays((1, 2, 40, 16))
    untiled = npattn.attention(q, k, v, causal=True)
    with cpu.tile_sizes(4, 8):
        tiled = npattn.attention(q, k, v, causal=True)
        tiled_again = npattn.attention(q, k, v, causal=True)
    plans.clear()
    with cpu.tile_sizes(4, 8):
        fresh = npattn.attention(q, k, v, causal=True)
    _same(tiled, fresh)
    _same(tiled_again, fresh)
    _same(untiled, npattn.attention(q, k, v, causal=True))
    assert not np.array_equal(tiled, untiled)  # other tiles round otherwise: the test can tell


def test_inputs_are_not_modified_and_outputs_are_fresh():
    q, k, v = _arrays()
    copies = [a.copy() for a in (q, k, v)]
    first = npattn.attention(q, k, v)
    second = npattn.attention(q, k, v)
    assert first is not second and not np.shares_memory(first, second)
    for a, b in zip((q, k, v), copies):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("kv_len", [16, 512])
def test_gradients_are_separate_arrays_and_a_large_calls_own_their_memory(dtype, kv_len):
    """A small backward's dq, dk and dv are parts of one block (one allocation, one
    rounding pass): writing one leaves the others as they were. A large one's (more than
    1 MiB together) each own their memory, so that keeping one keeps no other alive. Both
    are the first call's values on a repeated (planned) call."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 8, 16, 64)).astype(dtype)
    k, v = (rng.standard_normal((1, 8, kv_len, 64)).astype(dtype) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(dtype)
    first = npattn.attention_vjp(q, k, v)[1](dout)
    gradients = npattn.attention_vjp(q, k, v)[1](dout)
    for got, want in zip(gradients, first):
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got, want)
    dq, dk, dv = gradients
    assert not any(np.shares_memory(a, b) for a, b in ((dq, dk), (dq, dv), (dk, dv)))
    before = dk.copy(), dv.copy()
    dq[...] = 7
    np.testing.assert_array_equal(dk, before[0])
    np.testing.assert_array_equal(dv, before[1])
    if kv_len == 512:  # 2.1 MiB of float32 gradients, in one key chunk
        for gradient in gradients:
            assert gradient.flags.owndata or gradient.base.nbytes == gradient.nbytes


def test_threads_sharing_plans_get_their_own_answers():
    rng = np.random.default_rng(0)
    inputs = [tuple(rng.standard_normal((1, 4, 24, 16), dtype=np.float32) for _ in "qkv") for _ in range(4)]
    expected = [npattn.attention(*arrays, causal=True) for arrays in inputs]
    failures = []

    def caller(index):
        for _ in range(50):
            if not np.array_equal(npattn.attention(*inputs[index], causal=True), expected[index]):
                failures.append(index)

    callers = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for thread in callers:
        thread.start()
    for thread in callers:
        thread.join()
    assert not failures


def _small_heads(rng, layout, heads, dtype):
    """A (1, heads, 16, 64) array of ``dtype`` in ``layout`` ((1, 16, heads, 64) for bshd)."""
    shape = [1, 8, 16, 64]
    shape[2 if layout == "bshd" else 1] = heads
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype)


def _unaligned_copy(array):
    """``array``'s values at an address off its dtype's alignment (another Numba type)."""
    buffer = np.zeros(array.nbytes + 1, np.uint8)
    unaligned = np.frombuffer(buffer.data, array.dtype, array.size, offset=1).reshape(array.shape)
    unaligned[...] = array
    assert not unaligned.flags.aligned
    return unaligned


@pytest.mark.parametrize("dtype, bf16_products", [(np.float32, True), (np.float16, True), (ml_dtypes.bfloat16, False),
                                                   (ml_dtypes.bfloat16, True)])
@pytest.mark.parametrize("layout, kv_heads", [("bhsd", 8), ("bshd", 8), ("bhsd", 2)])
def test_plain_planned_calls_run_the_kernels_machine_code_with_the_first_calls_bits(monkeypatch, layout, kv_heads,
                                                                                    dtype, bf16_products):
    """From its second plain call on, a plan calls the forward kernel's compiled entry point
    directly (no dispatcher typing each argument, npattn.cpu.threads.direct_entry): the same
    bits as the first call, in both layouts and with GQA rows folded, float16 too (its keys read
    as bytes a tile at a time, its q read as it lies, each item's rows converted in the kernel,
    which writes out in float16: the bits of widening q and narrowing a float32 out,
    tests/test_quantized_cache.py; bfloat16 likewise, and where the CPU multiplies in bfloat16
    q, k and v read as pairs); q at an address off the float's alignment (another Numba type)
    goes through the dispatcher, with the same bits too (a 16-bit q is then read from an
    aligned copy)."""
    direct_calls = count_direct_entries(monkeypatch)
    rng = np.random.default_rng(3)
    q, k, v = (_small_heads(rng, layout, heads, dtype) for heads in (8, kv_heads, kv_heads))
    with tuned(bf16_products=bf16_products):
        plan = npattn.plan(q, k, v, causal=True, layout=layout, return_lse=True)
        first = plan.run(q, k, v)
        assert not direct_calls
        again = plan.run(q, k, v)
        assert direct_calls, "the second plain call did not run the entry point"
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, b)
        operands = plan._forward_plan.operands
        if dtype != np.float32 and conversion.MICROKERNELS:  # q read as it lies, out written in its own dtype
            # (as pairs where the products take them: not on a decode step's few rows, as bshd's 8 here)
            assert operands.pairs or operands.q_codes
            assert operands.pairs == (layout == "bhsd" and bf16_products and dtype == ml_dtypes.bfloat16
                                      and simd.BF16_DOT)
            assert plan._forward_plan.out_codes and plan._forward_plan._narrow_out is None
        direct_calls.clear()
        for a, b in zip(first, plan.run(_unaligned_copy(q), k, v)):
            np.testing.assert_array_equal(a, b)
    if kv_heads == 8 and dtype == np.float32:  # (folded GQA rows are a copy of q, aligned again)
        assert not direct_calls


@pytest.mark.parametrize("layout, kv_heads", [("bhsd", 8), ("bshd", 8), ("bhsd", 2)])
@pytest.mark.parametrize("weights", [False, True], ids=["out", "weights"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_repeated_attention_calls_reach_the_kernels_machine_code(monkeypatch, dtype, weights, layout, kv_heads):
    """npattn.attention's own plan of a repeated structure calls the forward kernel's entry
    point too, from the fourth call on (the third, its plan's first, types it), though its
    first two calls (the full path's) ran the backend's plan with the problem's operands: an
    entry typed for those alone had kept every plain call on the dispatcher (a
    (1, 8, 16 x 16, 64) causal float32 call took 25.4 us, now 21). With the weights, the
    weights kernel's entry point runs after it (16-bit weights written by the kernel in
    their own dtype), with the bits of the full path's weights; in both layouts, and with
    GQA rows folded."""
    plans.clear()
    direct_calls = count_direct_entries(monkeypatch)
    rng = np.random.default_rng(6)
    q, k, v = (_small_heads(rng, layout, heads, dtype) for heads in (8, kv_heads, kv_heads))
    options = dict(causal=True, return_weights=weights, layout=layout)
    results = [npattn.attention(q, k, v, **options) for _ in range(3)]
    assert not direct_calls  # (the first two: the full path; the second plans)
    results.append(npattn.attention(q, k, v, **options))
    assert len(direct_calls) == (2 if weights else 1), "a planned plain call did not run the entry points"
    for result in results[1:]:
        for got, expected in zip(result if weights else [result], results[0] if weights else [results[0]]):
            assert got.dtype == expected.dtype == dtype
            np.testing.assert_array_equal(got, expected)


_OPTION_ARRAYS = {
    "lengths and offsets": dict(kv_lengths=np.array([11, 16]), q_offset=np.array([-5, 0]), causal=True),
    "left padding": dict(kv_start=np.array([3, 0]), causal=True),
    "ALiBi and sink logits": dict(alibi_slopes=np.linspace(0.1, 0.8, 8), sink_logits=np.linspace(-1, 1, 8)),
    "pages": dict(block_table=np.array([[3, 0], [1, 2]]), kv_lengths=np.array([16, 9])),
}


@pytest.mark.parametrize("kv_heads", [8, 2])
@pytest.mark.parametrize("options", list(_OPTION_ARRAYS), ids=list(_OPTION_ARRAYS))
def test_planned_calls_with_option_arrays_run_the_kernels_machine_code_with_the_first_calls_bits(
        monkeypatch, options, kv_heads):
    """A plan's option arrays (lengths, starts, offsets, pages, ALiBi slopes, sink
    logits) are its own copies, the same at every run: from the second run on, the
    option operands of the first are kept and the forward kernel's entry point is called
    directly, with the first run's bits (GQA rows folded too), equal to the call checked
    from nothing."""
    options = _OPTION_ARRAYS[options]
    direct_calls = count_direct_entries(monkeypatch)
    rng = np.random.default_rng(5)
    paged = "block_table" in options
    q = rng.standard_normal((2, 8, 8, 32), dtype=np.float32)  # (small: a call the calling thread runs alone)
    k, v = (rng.standard_normal((4 if paged else 2, kv_heads, 8 if paged else 16, 32), dtype=np.float32)
            for _ in range(2))
    plan = npattn.plan(q, k, v, **options)
    first = plan.run(q, k, v)
    assert not direct_calls
    q2, k2, v2 = (rng.standard_normal(x.shape, dtype=np.float32) for x in (q, k, v))
    again = plan.run(q2, k2, v2)
    assert direct_calls, "the second run did not call the entry point"
    np.testing.assert_array_equal(first, npattn.attention(q, k, v, **options))
    np.testing.assert_array_equal(again, npattn.attention(q2, k2, v2, **options))


def test_plans_of_one_structure_with_other_option_values_keep_their_own_operands(monkeypatch):
    """Two plans whose problems differ only in their option arrays' values share the
    backend's plan of their structure: runs taken in turn each give their own call's bits
    (the operands kept are those of the problem the last run passed, used only for a run
    that passes it again)."""
    direct_calls = count_direct_entries(monkeypatch)
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((2, 8, 8, 32), dtype=np.float32) for _ in range(3))
    option_sets = [dict(kv_lengths=np.array(lengths), q_offset=np.array(offsets), causal=True,
                        alibi_slopes=np.linspace(0.1, slope, 8))
                   for lengths, offsets, slope in (([8, 3], [0, -5], 0.8), ([5, 8], [-3, 0], 1.6))]
    planned = [npattn.plan(q, k, v, **options) for options in option_sets]
    expected = [npattn.attention(q, k, v, **options) for options in option_sets]
    assert not np.array_equal(*expected)
    for _ in range(3):
        for plan, out in zip(planned, expected):
            for _ in range(2):  # (a plan's second run in a row calls the entry point)
                np.testing.assert_array_equal(plan.run(q, k, v), out)
    assert direct_calls


@pytest.mark.parametrize("option", ["bias", "float64 bias", "mask"])
def test_a_planned_bias_or_mask_is_read_where_it_lies_at_every_run(monkeypatch, option):
    """A plan reads ``bias`` and ``mask`` where they lie at each run (the caller may write
    them between runs): their operands (a float64 bias's a float32 copy) are never kept,
    and a run after a write gives the call checked from nothing on the new values."""
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((1, 8, 16, 64), dtype=np.float32) for _ in range(3))
    dtype = np.float64 if option == "float64 bias" else np.float32
    option = option.split()[-1]
    array = (rng.standard_normal((16, 16)).astype(dtype) if option == "bias"
             else rng.random((16, 16)) < 0.7)
    array[:, 0] = True if option == "mask" else array[:, 0]
    plan = npattn.plan(q, k, v, **{option: array})
    for _ in range(3):
        plan.run(q, k, v)
    array[...] = (rng.standard_normal((16, 16)).astype(dtype) if option == "bias"
                  else rng.random((16, 16)) < 0.5)
    array[:, 1] = True if option == "mask" else array[:, 1]
    np.testing.assert_array_equal(plan.run(q, k, v), npattn.attention(q, k, v, **{option: array.copy()}))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("layout, kv_heads", [("bhsd", 8), ("bshd", 2)])
def test_planned_backwards_run_the_kernels_machine_code_with_the_first_calls_bits(monkeypatch, dtype, layout,
                                                                                 kv_heads):
    """From its second plain vjp on, a small plan's backward calls the backward kernel's
    compiled entry point directly, with the first call's bits: for every dtype, with a
    dout whose strides it has seen (kept) and of another layout, and with a dout at an
    address off its alignment (another Numba type: through the dispatcher, once typed, on
    read-only q, k and v as every call the dispatcher types: the entry's own views of them
    are writable, and typing those would compile the kernel once more)."""
    from npattn.cpu import driver

    kernels = []
    typed = driver.direct_entry

    def counted(kernel, arguments):
        entry = typed(kernel, arguments)
        return None if entry is None else (lambda *values: kernels.append(kernel.__name__) or entry(*values))

    monkeypatch.setattr(driver, "direct_entry", counted)
    rng = np.random.default_rng(4)
    q, k, v, dout = (_small_heads(rng, layout, heads, dtype) for heads in (8, kv_heads, kv_heads, 8))
    plan = npattn.plan(q, k, v, causal=True, layout=layout)
    first = plan.vjp(q, k, v)[1](dout)
    assert "backward_kernel" not in kernels
    again = plan.vjp(q, k, v)[1](dout)
    assert "backward_kernel" in kernels, "the second plain vjp did not run the entry point"
    transposed = np.ascontiguousarray(np.swapaxes(dout, 1, 2)).swapaxes(1, 2)  # the same values, other strides
    unaligned = _unaligned_copy(dout)
    for other in (again, plan.vjp(q, k, v)[1](transposed), plan.vjp(q, k, v)[1](unaligned),
                  plan.vjp(q, k, v)[1](unaligned), plan.vjp(q, k, v)[1](dout)):
        for a, b in zip(first, other):
            np.testing.assert_array_equal(a, b)
    assert all(not any(operand.mutable for operand in types[:3]) for types in driver.backward_kernel.overloads)


def test_a_structure_that_never_repeats_is_never_planned():
    rng = np.random.default_rng(0)
    cache = rng.standard_normal((1, 2, 40, 8)).astype(np.float32)
    q = rng.standard_normal((1, 4, 1, 8)).astype(np.float32)
    for length in range(1, 40):  # a decode loop: one more key each step
        npattn.attention(q, cache[:, :, :length], cache[:, :, :length], causal=True)
    assert len(plans._FORWARD) == 0


def test_the_caches_stay_bounded():
    cache = plans.PlanCache(limit=3)
    for key in range(10):
        cache.put(key, str(key))
    assert len(cache) == 3 and cache.get(9) == "9" and cache.get(0) is None


@settings(max_examples=30)
@given(case=cases(options=tuple(dict.fromkeys(_PLAIN_OPTIONS + _KEYED_OPTIONS)),
                  dtypes=("float32", "float64", "float16"), dims_strategy=dims(max_group=4, max_len=20, max_dim=16)),
       layout=layouts)
def test_a_repeated_attention_backward_answers_as_a_first_one(case, layout):
    q, k, v = (to_layout(a, layout) for a in (case.q, case.k, case.v))
    options = {**case.options, "layout": layout}
    out, lse = npattn.attention(q, k, v, return_lse=True, **options)
    dout = np.random.default_rng(3).standard_normal(out.shape).astype(out.dtype)
    plans.clear()
    first = npattn.attention_backward(q, k, v, out, lse, dout, **options)
    for _ in range(2):
        _same(first, npattn.attention_backward(q, k, v, out, lse, dout, **options))
    assert plans.lookup(plans.call_key(q, k, v, options)).backward_plan is not None


@settings(max_examples=30)
@given(case=cases(dtypes=("float16", "bfloat16", "float32", "float64"),
                  dims_strategy=dims(max_group=4, max_len=20, max_dim=16)),
       layout=layouts)
def test_attention_backward_from_attention_for_backward_gives_the_vjps_gradients(case, layout):
    """A framework's two passes (attention_for_backward, then attention_backward from the
    arrays it kept) give attention_vjp's outputs and gradients bit for bit, on the full
    path and then the planned one; a 16-bit call keeps its float32 out for them."""
    q, k, v = (to_layout(a, layout) for a in (case.q, case.k, case.v))
    options = {**case.options, "layout": layout, "return_lse": True}
    outputs, vjp = npattn.attention_vjp(q, k, v, **options)
    dout = np.random.default_rng(3).standard_normal(outputs[0].shape).astype(case.dtype)
    expected = vjp(dout)
    plans.clear()
    for _ in range(3):  # the full path, then the plan's
        (out, lse), out_for_backward = npattn.attention_for_backward(q, k, v, **options)
        _same((out, lse), outputs)
        assert out_for_backward.shape == out.shape and out_for_backward.dtype == lse.dtype
        if case.dtype == lse.dtype:
            assert out_for_backward is out
        _same(npattn.attention_backward(q, k, v, out_for_backward, lse, dout, **options), expected)


def test_attention_backward_checks_out_lse_and_dout_after_a_planned_call():
    q, k, v = _arrays()
    out, lse = npattn.attention(q, k, v, return_lse=True)
    for _ in range(3):
        npattn.attention_backward(q, k, v, out, lse, np.ones_like(out))
    with pytest.raises(ValueError, match="out must have the output's shape"):
        npattn.attention_backward(q, k, v, out[:, :, :-1], lse, np.ones_like(out))
    with pytest.raises(ValueError, match="lse must have the output's shape"):
        npattn.attention_backward(q, k, v, out, lse[..., :-1], np.ones_like(out))
    with pytest.raises(ValueError, match="dout must have the output's shape"):
        npattn.attention_backward(q, k, v, out, lse, np.ones_like(out)[:, :, :-1])
    with pytest.raises(ValueError, match="needs seed"):
        npattn.attention_backward(q, k, v, out, lse, np.ones_like(out), dropout_p=0.1)
    # other dtypes of out and dout take the full path, and give its answer
    expected = npattn.attention_backward(q, k, v, out, lse, np.ones_like(out))
    wide = npattn.attention_backward(q, k, v, out.astype(np.float64), lse, np.ones(out.shape))
    _same(expected, wide)


def test_a_planned_call_passes_through_few_modules():
    """A repeated ``attention(..., causal=True, window=...)`` call runs its plan: from the
    public function to the kernel it enters at most 12 of npattn's modules (the full path's
    first call entered 24, switching modules 119 times)."""
    import sys

    q = np.random.default_rng(0).standard_normal((1, 8, 16, 64)).astype(np.float32)
    for _ in range(3):
        npattn.attention(q, q, q, causal=True, window=(4, 0))
    entered = []

    def note(frame, event, arg):
        if event == "call" and f"{os.sep}npattn{os.sep}" in frame.f_code.co_filename:
            entered.append(frame.f_code.co_filename.rpartition(f"{os.sep}npattn{os.sep}")[2])

    sys.setprofile(note)
    try:
        npattn.attention(q, q, q, causal=True, window=(4, 0))
    finally:
        sys.setprofile(None)
    assert "cpu/forward_kernel.py" in entered or "cpu/threads.py" in entered, entered
    assert "core/validation.py" not in entered and "core/options.py" not in entered, sorted(set(entered))
    assert len(set(entered)) <= 12, sorted(set(entered))


def test_cupy_calls_are_keyed_by_their_device():
    """Repeated CuPy calls are planned too (runtime.plans.call_key): the device is part of
    their structure, arrays on two devices are never one structure, and a call mixing
    devices is not planned (the full path names the problem). Checked with stand-ins that
    look like CuPy arrays to npattn (no GPU needed)."""
    from npattn.runtime.plans import call_key

    kind = type("ndarray", (), {"__module__": "cupy._core.core"})

    def fake(device, shape=(1, 2, 3, 4)):
        array = np.zeros(shape, np.float32)
        stand_in = kind()
        stand_in.shape, stand_in.strides, stand_in.dtype = array.shape, array.strides, array.dtype
        stand_in.device = type("Device", (), {"id": device})()
        return stand_in

    on0, on1 = fake(0), fake(1)
    options = {"causal": True}
    assert call_key(on0, on0, on0, options) == call_key(fake(0), fake(0), fake(0), options) is not None
    assert call_key(on0, on0, on0, options) != call_key(on1, on1, on1, options)
    assert call_key(on0, on1, on1, options) is None
    assert call_key(on0, fake(0, (1, 2, 5, 4)), on0, options) != call_key(on0, on0, on0, options)
    host = np.zeros((1, 2, 3, 4), np.float32)
    assert call_key(on0, host, host, options) is None and call_key(host, on0, on0, options) is None
