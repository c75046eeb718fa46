"""The public plan/run API (``npattn.plan``): a plan checks a call once, then runs arrays of
its structure with the bits ``attention`` gives them, forward and backward, refuses arrays
of another structure by name, and owns the option arrays whose values it checked."""
from __future__ import annotations

import gc
import re
import weakref

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import npattn
from conftest import NUMPY_BACKENDS
from strategies import cases, layouts, packed_batches, to_layout
import tolerances


def _user(case, layout):
    return [np.ascontiguousarray(to_layout(x, layout)) for x in (case.q, case.k, case.v)]


def _same(a, b):
    for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("backend", NUMPY_BACKENDS)
@given(case=cases(dtypes=("float32", "float64")), layout=layouts, seed=st.integers(0, 2**32 - 1))
def test_a_plan_runs_new_arrays_as_attention_does_bit_for_bit(backend, case, layout, seed):
    options = {**case.options, "layout": layout, "backend": backend, "return_lse": True}
    if options.get("dropout_p") and options.get("seed") is None:
        options["seed"] = 7
    plan = npattn.plan(*_user(case, layout), **options)
    rng = np.random.default_rng(seed)
    fresh = [rng.uniform(-2, 2, x.shape).astype(x.dtype) for x in _user(case, layout)]  # new values
    _same(plan.run(*fresh), npattn.attention(*fresh, **options))
    (out, lse), vjp = plan.vjp(*fresh)
    (want_out, want_lse), want_vjp = npattn.attention_vjp(*fresh, **options)
    _same((out, lse), (want_out, want_lse))
    dout = rng.uniform(-1, 1, out.shape).astype(out.dtype)
    _same(tuple(vjp(dout)), tuple(want_vjp(dout)))


def test_arrays_of_another_structure_are_refused_by_name():
    q = np.ones((1, 2, 3, 4), np.float32)
    plan = npattn.plan(q, q, q, causal=True)
    for arrays, name, what in (((q[:, :1], q, q), "q", "shape"), ((q, q.astype(np.float64), q), "k", "float64"),
                               ((q, q, np.asfortranarray(q)), "v", "strides"), ((q, q, q.tolist()), "v", "list")):
        with pytest.raises(ValueError, match=f"^{name} is .*{what}.*but the plan was made for"):
            plan.run(*arrays)
        with pytest.raises(ValueError, match=f"^{name} is "):
            plan.vjp(*arrays)
    assert (plan.backend, plan.layout, plan.shapes) == ("cpu", "bhsd", ((1, 2, 3, 4),) * 3)


def test_a_plan_checks_as_attention_does():
    q = np.ones((1, 2, 3, 4), np.float32)
    for options, error, message in ((dict(window=-1), ValueError, "window must be non-negative"),
                                    (dict(softmax_scale=0.1), TypeError, "npattn's equivalent is scale="),
                                    (dict(kv_lengths=np.array([4])), ValueError, "kv_lengths must lie")):
        with pytest.raises(error, match=message):
            npattn.plan(q, q, q, **options)
    with pytest.raises(TypeError, match="block_table .* is for the forward only"):
        npattn.plan(q.transpose(0, 2, 1, 3), q.transpose(0, 2, 1, 3)[:1], q.transpose(0, 2, 1, 3)[:1],
                    layout="bshd", block_table=np.zeros((1, 1), np.int64)).vjp(
            q.transpose(0, 2, 1, 3), q.transpose(0, 2, 1, 3)[:1], q.transpose(0, 2, 1, 3)[:1])


def test_checked_option_arrays_belong_to_the_plan_and_mask_and_bias_are_read_at_each_run():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 2, 5, 4)).astype(np.float32) for _ in range(3))
    lengths, slopes, bias = np.array([5, 3]), np.array([0.5, 0.25]), np.zeros((5, 5), np.float32)
    plan = npattn.plan(q, k, v, kv_lengths=lengths, alibi_slopes=slopes, bias=bias)
    before = plan.run(q, k, v)
    lengths[0], slopes[0] = 99, np.nan  # would fail the checks: the plan kept its own copies
    _same(plan.run(q, k, v), before)
    bias[:, 0] = -np.inf  # no value check: read where it lies
    _same(plan.run(q, k, v), npattn.attention(q, k, v, kv_lengths=np.array([5, 3]), alibi_slopes=np.array([0.5, 0.25]),
                                              bias=bias))


def test_dropout_without_a_seed_draws_per_run_and_the_vjp_reuses_its_own():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 2, 6, 4)) for _ in range(3))
    plan = npattn.plan(q, k, v, dropout_p=0.5)
    assert not np.array_equal(plan.run(q, k, v), plan.run(q, k, v))
    for _ in range(3):
        out, vjp = plan.vjp(q, k, v)
        dout = rng.standard_normal(out.shape)
        dv = vjp(dout)[2]
        # out is linear in v, so sum(out * dout) = sum(dv * v) exactly when dv comes from the
        # forward's own dropout mask (another mask breaks it by O(1))
        terms = np.abs(out * dout).sum()  # both sides sum out.size products of this size at most
        assert abs((out * dout).sum() - (dv * v).sum()) <= tolerances.bound(np.float64, out.size + q.shape[2], terms)


def test_check_finite_checks_each_runs_arrays():
    q = np.ones((1, 1, 2, 4), np.float32)
    plan = npattn.plan(q, q, q, check_finite=True)
    bad = q.copy()
    bad[0, 0, 1, 2] = np.nan
    with pytest.raises(ValueError, match=r"k must be finite \(check_finite=True\), got k\[0, 0, 1, 2\] = nan"):
        plan.run(q, bad, q)


def test_a_non_finite_result_gets_the_references_answer():
    q = np.ones((1, 1, 2, 4), np.float32)
    plan = npattn.plan(q, q, q)
    v = q.copy()
    v[0, 0, 0, 0] = np.inf
    _same(plan.run(q, q, v), npattn.attention(q, q, v))


def test_a_plan_keeps_no_run_array_alive():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, 8, 4)) for _ in range(3))
    plan = npattn.plan(q, k, v)
    plan.vjp(q, k, v)[1](np.ones_like(q))
    refs = [weakref.ref(a) for a in (q, k, v)]
    del q, k, v
    gc.collect()
    assert all(ref() is None for ref in refs)
    assert plan.shapes == ((1, 2, 8, 4),) * 3


def test_torch_and_jax_arrays_are_named():
    torch = pytest.importorskip("torch")
    q = torch.ones(1, 1, 2, 4)
    with pytest.raises(TypeError, match="npattn.plan takes NumPy or CuPy arrays"):
        npattn.plan(q, q, q)


# ---- a decode step's plan, run on every layer ------------------------------------------------

@given(seed=st.integers(0, 2**32 - 1))
def test_a_kvcache_plan_runs_each_layer_as_attention_with_kvcache_does(seed):
    from serving_fuzz import kv_problem

    rng = np.random.default_rng(seed)
    problem = kv_problem(rng)
    arguments = problem.arguments()
    before = [np.array(x, copy=True) for x in (problem.k_cache, problem.v_cache)]
    plan = npattn.plan_with_kvcache(**arguments)
    _same(tuple(before), (problem.k_cache, problem.v_cache))  # planning writes nothing
    for _ in range(3):  # layers: their own q, caches and new keys, of the step's structure
        layer = {name: (rng.standard_normal(value.shape).astype(value.dtype) if name in ("q", "k", "v")
                        else value.copy()) for name, value in arguments.items()
                 if name in ("q", "k_cache", "v_cache", "k", "v") and value is not None}
        by_call = {name: value.copy() for name, value in layer.items()}
        expected = npattn.attention_with_kvcache(**{**arguments, **by_call})
        got = plan.run(layer["q"], layer["k_cache"], layer["v_cache"], layer.get("k"), layer.get("v"),
                       arguments.get("prefix_k"), arguments.get("prefix_v"))
        _same(got, expected)
        for name in ("k_cache", "v_cache"):
            np.testing.assert_array_equal(layer[name], by_call[name])


def test_a_kvcache_plan_refuses_arrays_of_another_structure_and_read_only_caches():
    q, k = np.ones((2, 1, 4, 8), np.float32), np.ones((2, 1, 2, 8), np.float32)
    caches = np.zeros((2, 16, 2, 8), np.float32), np.zeros((2, 16, 2, 8), np.float32)
    plan = npattn.plan_with_kvcache(q, *caches, k, k, cache_seqlens=np.array([3, 5]), causal=True)
    with pytest.raises(ValueError, match=r"^q is ndarray float32 shape \(2, 2, 4, 8\)"):
        plan.run(np.ones((2, 2, 4, 8), np.float32), *caches, k, k)
    with pytest.raises(ValueError, match="^k is None, but the plan was made with it"):
        plan.run(q, *caches, None, None)
    frozen = caches[0].copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="k_cache is read-only"):
        plan.run(q, frozen, caches[1], k, k)
    assert not caches[1].any()
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="plan_with_kvcache takes NumPy or CuPy arrays"):
        npattn.plan_with_kvcache(torch.ones(2, 1, 4, 8), *caches, k, k, cache_seqlens=3)


def test_a_kvcache_plans_later_runs_check_every_array_before_writing():
    """From its second run a plan checks a plain step in the append's compiled call: an
    array of the plan's shape but other strides, a read-only cache and one cache passed
    twice still get their named errors with nothing written, and an array of the plan's
    structure lying unaligned in memory runs as an aligned one does."""
    rng = np.random.default_rng(12)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((2, 1, 4, 8), (2, 1, 2, 8), (2, 1, 2, 8)))
    caches = [rng.standard_normal((2, 16, 2, 8)).astype(np.float32) for _ in range(2)]
    plan = npattn.plan_with_kvcache(q, *caches, k, v, cache_seqlens=np.array([3, 5]), causal=True)
    plan.run(q, *[cache.copy() for cache in caches], k, v)  # the first run plans the attention
    arrays = dict(q=q, k_cache=caches[0], v_cache=caches[1], k=k, v=v)
    want = plan.run(**{name: (array.copy() if "cache" in name else array) for name, array in arrays.items()})
    for name, array in arrays.items():
        spread = np.zeros((*array.shape[:-1], 2 * array.shape[-1]), np.float32)[..., ::2]  # other strides
        spread[...] = array
        before = [cache.tobytes() for cache in caches]
        with pytest.raises(ValueError, match=rf"^{name} is ndarray float32 shape {re.escape(str(array.shape))} "
                                             r"strides \(\d+, \d+, \d+, 8\)"):
            plan.run(**{**arrays, name: spread})
        assert [cache.tobytes() for cache in caches] == before
        unaligned = np.frombuffer(bytearray(array.nbytes + 1), np.uint8)[1:].view(np.float32).reshape(array.shape)
        unaligned[...] = array
        assert not unaligned.flags.aligned and unaligned.strides == array.strides
        layer = {key: (value.copy() if "cache" in key else value)
                 for key, value in {**arrays, name: unaligned}.items()}
        _same(plan.run(**layer), want)
    frozen = caches[0].copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="k_cache is read-only"):
        plan.run(q, frozen, caches[1], k, v)
    with pytest.raises(ValueError, match="k_cache and v_cache share memory"):
        plan.run(q, caches[0], caches[0], k, v)
    assert [cache.tobytes() for cache in caches] == before


@pytest.mark.parametrize("dim", [8, 16])  # rows copied element by element, and a vector at a time
def test_a_kvcache_plans_compiled_append_is_kept_only_once_a_run_matched(dim):
    """The append's compiled call is typed at the first run that takes it, and kept only
    once such a run had the plan's structure: a cache of the plan's shape in Fortran order
    (another layout to Numba) at that run raises by name, and the runs after it write the
    slots the call writes (its entry kept, it had indexed the plan's arrays as Fortran
    ones: the wrong slots)."""
    rng = np.random.default_rng(13)
    q, k = (rng.standard_normal(shape).astype(np.float32) for shape in ((2, 1, 4, dim), (2, 1, 2, dim)))
    caches = [rng.standard_normal((2, 8, 2, dim)).astype(np.float32) for _ in range(2)]
    seqlens = np.array([3, 6])
    plan = npattn.plan_with_kvcache(q, *caches, k, k, cache_seqlens=seqlens, backend="cpu")
    plan.run(q, *caches, k, k)  # the first run plans the attention; the second takes the compiled call
    fortran = np.asfortranarray(caches[0])
    assert fortran.base is None and fortran.strides != caches[0].strides
    before = [cache.copy() for cache in caches]
    with pytest.raises(ValueError, match="k_cache is ndarray float32"):
        plan.run(q, fortran, caches[1], k, k)
    out = plan.run(q, *caches, k, k)
    expected = npattn.attention_with_kvcache(q, *before, k, k, cache_seqlens=seqlens, backend="cpu")
    np.testing.assert_array_equal(out, expected)
    for cache, called in zip(caches, before):
        np.testing.assert_array_equal(cache, called)


# ---- a packed batch's plan, run on every layer -----------------------------------------------

@pytest.mark.parametrize("backend", NUMPY_BACKENDS)
@given(case=packed_batches(), seed=st.integers(0, 2**32 - 1))
def test_a_varlen_plan_runs_each_layer_as_attention_varlen_does(backend, case, seed):
    """plan_varlen's runs and vjps give attention_varlen's bits for each layer's packed
    arrays (new values, the step's lengths), on every backend: one planned kernel call on
    the CPU, a call per sequence elsewhere and with dropout."""
    lengths_q, lengths_k, heads, kv_heads, head_dim, value_dim, options = case
    rng = np.random.default_rng(seed)
    cu_q, cu_k = np.r_[0, np.cumsum(lengths_q)], np.r_[0, np.cumsum(lengths_k)]
    shapes = ((cu_q[-1], heads, head_dim), (cu_k[-1], kv_heads, head_dim), (cu_k[-1], kv_heads, value_dim))
    options = {name: (rng.uniform(0.1, 1, value) if name in ("alibi_slopes", "sink_logits") else value)
               for name, value in options.items()}
    options.update(backend=backend, return_lse=True)
    layers = [[rng.standard_normal(shape).astype(np.float32) for shape in shapes] for _ in range(3)]
    plan = npattn.plan_varlen(*layers[0], cu_q, cu_k, **options)
    for q, k, v in layers:
        _same(plan.run(q, k, v), npattn.attention_varlen(q, k, v, cu_q, cu_k, **options))
        (out, lse), vjp = plan.vjp(q, k, v)
        (want_out, want_lse), want_vjp = npattn.attention_varlen_vjp(q, k, v, cu_q, cu_k, **options)
        _same((out, lse), (want_out, want_lse))
        dout = rng.standard_normal(out.shape).astype(out.dtype)
        _same(tuple(vjp(dout)), tuple(want_vjp(dout)))


def test_a_varlen_plan_refuses_other_structures_and_draws_a_seed_per_run():
    q = np.ones((7, 2, 4), np.float32)
    cu = np.array([0, 3, 7])
    plan = npattn.plan_varlen(q, q, q, cu, cu, causal=True)
    with pytest.raises(ValueError, match=r"^k is ndarray float32 shape \(8, 2, 4\)"):
        plan.run(q, np.ones((8, 2, 4), np.float32), q)
    with pytest.raises(ValueError, match="^v is ndarray float64"):
        plan.vjp(q, q, q.astype(np.float64))
    with pytest.raises(ValueError, match="cu_seqlens_q must run from 0 to Tq = 7"):
        npattn.plan_varlen(q, q, q, np.array([0, 3, 6]), cu)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((7, 2, 4)) for _ in range(3))
    dropping = npattn.plan_varlen(q, k, v, cu, cu, dropout_p=0.5)
    assert not np.array_equal(dropping.run(q, k, v), dropping.run(q, k, v))
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="plan_varlen takes NumPy or CuPy arrays"):
        npattn.plan_varlen(torch.ones(7, 2, 4), q, q, cu, cu)


def test_serving_plans_own_the_option_arrays_they_checked():
    """A slope array changed after planning (to a value the checks would refuse) reaches
    neither plan's runs: they run with the values that were checked."""
    rng = np.random.default_rng(4)
    slopes = np.array([0.5, 0.25, 0.125, 0.0625])
    q, k = rng.standard_normal((1, 1, 4, 8)), rng.standard_normal((1, 1, 2, 8))
    cache = rng.standard_normal((2, 1, 16, 2, 8))
    step = npattn.plan_with_kvcache(q, *cache.copy(), k, k, cache_seqlens=5, alibi_slopes=slopes)
    packed = rng.standard_normal((6, 4, 8)), rng.standard_normal((9, 2, 8))
    cu_q, cu_k = np.array([0, 2, 6]), np.array([0, 4, 9])
    batch = npattn.plan_varlen(packed[0], packed[1], packed[1], cu_q, cu_k, alibi_slopes=slopes)
    want_step = npattn.attention_with_kvcache(q, *cache.copy(), k, k, cache_seqlens=5, alibi_slopes=slopes.copy())
    want_batch = npattn.attention_varlen(packed[0], packed[1], packed[1], cu_q, cu_k, alibi_slopes=slopes.copy())
    slopes[:] = np.nan
    for _ in range(2):
        _same(step.run(q, *cache.copy(), k, k), want_step)
        _same(batch.run(packed[0], packed[1], packed[1]), want_batch)
