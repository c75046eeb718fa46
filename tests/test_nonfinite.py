"""NaN and inf in the inputs reach exactly the outputs that read them, alike on every backend.

The reference defines it (IEEE arithmetic, where a row reads only the keys it sees; see
:mod:`npattn.reference` and :mod:`npattn.runtime.nonfinite`): here it is checked against a
loop over rows, and every backend against the reference with NaN, +inf and -inf
planted at random places of q, k, v and bias, under every option. The CPU kernels are
also held to the score rules on their own (no fallback to the reference), and no
non-finite input may raise from inside a kernel. ``check_finite=True`` names the first
bad element instead.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import npattn
from conftest import KERNEL_BACKENDS
from npattn import cpu, reference
from npattn.core.validation import build_problem
from strategies import ALL_OPTIONS, cases
from tolerances import bound, gradient_bound_terms, output_bound_terms, score_magnitude

PLANTS = (np.nan, np.inf, -np.inf)
PLANTABLE = ("q", "k", "v", "bias")


@st.composite
def planted_cases(draw, into=PLANTABLE, options=ALL_OPTIONS):
    """A case with 1 to 3 NaN/inf values planted in some of ``into`` (bias when drawn)."""
    case = draw(cases(options=options, dtypes=("float32", "float64")))
    arrays = {name: getattr(case, name).copy() for name in ("q", "k", "v")}
    options = dict(case.options)
    if "bias" in options:
        arrays["bias"] = options["bias"].copy()
    targets = [name for name in into if name in arrays]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    for _ in range(draw(st.integers(1, 3))):
        target = arrays[draw(st.sampled_from(targets))]
        if target.size:
            target[tuple(rng.integers(0, n) for n in target.shape)] = draw(st.sampled_from(PLANTS))
    if "bias" in arrays:
        options["bias"] = arrays.pop("bias")
    return dataclasses.replace(case, options=options, **arrays)


def assert_same_values(actual, expected, dtype, length, magnitude, what):
    """NaN, +inf and -inf in the same places; the finite values within the dtype's bound."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    for kind in (np.isnan, np.isposinf, np.isneginf):
        np.testing.assert_array_equal(kind(actual), kind(expected), err_msg=f"{what}: {kind.__name__} places")
    finite = np.isfinite(expected)
    np.testing.assert_allclose(actual[finite], expected[finite], rtol=0,
                               atol=bound(dtype, length, magnitude), err_msg=what)


def _finite_part(array):
    return np.where(np.isfinite(array), array, 0.0)


def finite_values(case):
    """``case`` with its planted values set to 0: the sizes the bounds are derived from
    (the planted ones are compared by place, not size)."""
    return dataclasses.replace(case, q=_finite_part(case.q), k=_finite_part(case.k), v=_finite_part(case.v))


@given(case=planted_cases())
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_every_backend_gives_the_references_non_finite_outputs(backend, case):
    expected_out, expected_lse = case.run("reference", return_lse=True)
    with cpu.tile_sizes(2, 3):  # many tile edges: the partly visible tiles where 0 * NaN could leak
        out, lse = case.run(backend, return_lse=True)
    assert_same_outputs(out, lse, expected_out, expected_lse, case)


def assert_same_outputs(out, lse, expected_out, expected_lse, case):
    """``out`` and ``lse`` against the reference's for a case with planted values: the same
    non-finite places, the rest within the bounds of the case's finite values."""
    finite = finite_values(case)
    length, magnitude = output_bound_terms(finite)
    assert_same_values(out, expected_out, case.dtype, length, magnitude, "out")
    lse_size = 1 + score_magnitude(finite) + np.abs(expected_lse[np.isfinite(expected_lse)]).max(initial=0)
    assert_same_values(lse, expected_lse, case.dtype, length, lse_size, "lse")


@given(case=planted_cases(), seed=st.integers(0, 2**32 - 1))
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_every_backend_gives_the_references_non_finite_gradients(backend, case, seed):
    dout = np.random.default_rng(seed).uniform(-1, 1, (*case.q.shape[:3], case.v.shape[-1])).astype(case.dtype)
    (_, expected_vjp), (_, vjp) = case.vjp("reference"), case.vjp(backend)
    terms = gradient_bound_terms(finite_values(case), dout)
    for name, got, want in zip(("dq", "dk", "dv", "dbias", "dsink_logits"), vjp(dout), expected_vjp(dout)):
        assert_same_values(got, want, case.dtype, *terms, name)


def check_kernel_marks_non_finite_rows(backend, case):
    """``backend``'s own forward (no reference to fall back on), for a case with non-finite
    values in q, k or bias only: NaN rows where the reference has them, the rest close."""
    problem = build_problem(case.q, case.k, case.v, **case.options)
    expected = reference.forward(problem)
    result = backend.forward(problem)
    out, lse = (np.asarray(a, np.float64) for a in (result.out, result.lse))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(expected.lse))
    np.testing.assert_array_equal(np.isnan(out).any(axis=-1), np.isnan(expected.out).any(axis=-1))
    rows = ~np.isnan(expected.lse)
    assert_same_values(out[rows], expected.out[rows], case.dtype, *output_bound_terms(finite_values(case)), "out")


@given(case=planted_cases(into=("q", "k", "bias")))
def test_the_cpu_kernels_make_rows_with_a_non_finite_score_nan_themselves(case):
    with cpu.tile_sizes(2, 3):
        check_kernel_marks_non_finite_rows(cpu, case)


@given(case=planted_cases(), clean=st.booleans())
def test_the_cpu_forward_reports_whether_out_is_finite_as_reading_out_would(case, clean):
    """The kernel's report (``ForwardResult.finite``) stands in for a pass over out: it must
    agree with one on clean inputs and on every planted NaN and inf, in v too (the
    ``0 * NaN`` of keys a row does not see), over tiles of 2 x 3 that split every row's
    keys. Unknown (None) only where merged key ranges wrote rows the kernel did not."""
    arrays = {name: getattr(case, name) for name in ("q", "k", "v")}
    if clean:
        arrays = {name: np.nan_to_num(array, nan=0.0, posinf=1.0, neginf=-1.0) for name, array in arrays.items()}
    options = dict(case.options)
    if clean and "bias" in options:
        options["bias"] = np.nan_to_num(options["bias"], nan=0.0, posinf=1.0, neginf=-1.0)
    problem = build_problem(arrays["q"], arrays["k"], arrays["v"], **options)
    with cpu.tile_sizes(2, 3):
        result = cpu.forward(problem)
    if result.finite is not None:
        assert result.finite == bool(np.isfinite(np.asarray(result.out, np.float64)).all())


@pytest.mark.parametrize("planted", ["q inf", "k -inf", "bias +inf", "bias nan",
                                     pytest.param("overflow", marks=pytest.mark.reference_may_answer)])
def test_no_non_finite_input_raises_from_a_cpu_kernel(planted):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 5, 8)).astype(np.float32) for _ in range(3))
    bias = np.zeros((5, 5), np.float32)
    if planted == "q inf":
        q[0, 1, 2, 3] = np.inf
    elif planted == "k -inf":
        k[0, 0, 4, 0] = -np.inf
    elif planted == "overflow":
        q *= np.float32(1e30)
        k *= np.float32(1e30)
    else:
        bias[2, 1] = np.inf if planted == "bias +inf" else np.nan
    problem = build_problem(q, k, v, bias=bias, causal=True)
    result = cpu.forward(problem)  # the kernel itself, no reference behind it
    cpu.backward(problem, result.saved, np.ones_like(result.out))
    # through the API, float32 scores that overflow (1e60) get the float64 reference's answer
    out, lse = npattn.attention(q, k, v, bias=bias, causal=True, return_lse=True, backend="cpu")
    expected = reference.forward(problem)
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(expected.lse))
    np.testing.assert_array_equal(np.isnan(out), np.isnan(expected.out))


def test_values_a_row_cannot_see_never_reach_it():
    """An uninitialized cache slot holding NaN, hidden by a mask or past kv_lengths."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 2, 4, 8)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 6, 8)).astype(np.float32) for _ in range(2))
    v[0, :, 5] = np.nan
    mask = np.ones((4, 6), bool)
    mask[:, 5] = False
    for backend in ("reference", "cpu"):
        for options in ({"mask": mask}, {"kv_lengths": np.array([5])}, {"causal": True, "mask": mask}):
            out = npattn.attention(q, k, v, backend=backend, **options)
            assert np.isfinite(out).all(), (backend, options)
        seen = npattn.attention(q, k, v, backend=backend, causal=True)
        assert np.isnan(seen[0, :, -1]).all() and np.isfinite(seen[0, :, :-1]).all(), backend


def test_a_row_of_nan_query_is_nan_and_its_neighbours_are_not():
    q = np.ones((1, 1, 3, 4), np.float32)
    q[0, 0, 1, 2] = np.nan
    for backend in ("reference", "cpu"):
        ones = np.ones_like(q)
        out, lse = npattn.attention(q, ones, ones, return_lse=True, backend=backend)
        assert np.isnan(out[0, 0, 1]).all() and math.isnan(lse[0, 0, 1]), backend
        assert np.isfinite(out[0, 0, [0, 2]]).all(), backend


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("name", PLANTABLE)
def test_check_finite_names_the_first_bad_element(name, layout):
    arrays = {n: np.zeros((1, 3, 3, 4), np.float32) for n in ("q", "k", "v")}  # H = S: both layouts
    arrays["bias"] = np.zeros((3, 3), np.float32)
    index, later = ((1, 2), (2, 0)) if name == "bias" else ((0, 1, 1, 2), (0, 2, 0, 0))
    arrays[name][index] = np.inf
    arrays[name][later] = np.nan
    message = f"{name} must be finite (check_finite=True), got {name}[{', '.join(map(str, index))}] = inf"
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        npattn.attention(arrays["q"], arrays["k"], arrays["v"], bias=arrays["bias"], check_finite=True,
                         layout=layout, backend="reference")


def test_check_finite_passes_finite_inputs_and_is_off_by_default():
    q = np.ones((1, 1, 2, 4), np.float32)
    bad = q.copy()
    bad[0, 0, 0, 0] = np.nan
    np.testing.assert_array_equal(npattn.attention(q, q, q, check_finite=True), npattn.attention(q, q, q))
    assert np.isnan(npattn.attention(bad, q, q)[0, 0, 0]).all()
    with pytest.raises(TypeError, match="check_finite must be a bool"):
        npattn.attention(q, q, q, check_finite="yes")


@given(seed=st.integers(0, 2**32 - 1), plants=st.integers(1, 12))
def test_the_references_visible_product_is_ieee_over_the_visible_terms(seed, plants):
    """Against a loop over every output element that adds only the visible terms, in
    Python floats (IEEE: 0 * inf and inf - inf are NaN)."""
    rng = np.random.default_rng(seed)
    m, n, p = rng.integers(1, 6, size=3)
    a = rng.choice([0.0, 0.5, -1.5, 2.0, np.nan], size=(2, m, n), p=[0.3, 0.2, 0.2, 0.2, 0.1])
    b = rng.standard_normal((2, n, p))
    for _ in range(plants):
        b[tuple(rng.integers(0, s) for s in b.shape)] = rng.choice([np.nan, np.inf, -np.inf])
    visible = rng.random((2, m, n)) < 0.6
    expected = np.zeros((2, m, p))
    for lead, row, column in np.ndindex(2, m, p):
        total = 0.0
        for key in range(n):
            if visible[lead, row, key]:
                total += float(a[lead, row, key]) * float(b[lead, key, column])
        expected[lead, row, column] = total
    with np.errstate(all="ignore"):
        actual = reference._visible_matmul(np, a, b, visible)
    assert_same_values(actual, expected, np.float64, n, 4.0, "product")


@given(dtype=st.sampled_from([np.float16, np.float32, np.float64]),
       shape=st.lists(st.integers(1, 5), min_size=1, max_size=4),
       order=st.randoms(use_true_random=False), step=st.sampled_from([1, 2]),
       special=st.sampled_from([None, np.nan, np.inf, -np.inf]), place=st.integers(0, 10**6),
       huge=st.booleans())
def test_all_finite_agrees_with_isfinite_in_every_memory_order(dtype, shape, order, step, special, place, huge):
    """The check every result passes (a BLAS sum of squares first, min and max when that is
    not finite) says what ``np.isfinite(a).all()`` says: for permuted and strided views, with
    values whose squares overflow (the sum is inf, every element finite) and with one NaN or inf."""
    from npattn.core.arrays import all_finite

    base = np.full([*shape[:-1], shape[-1] * step], np.finfo(dtype).max if huge else 1.5, dtype)
    if special is not None:
        base.reshape(-1)[place % base.size] = special
    axes = list(range(base.ndim))
    order.shuffle(axes)
    view = base[..., ::step].transpose(axes)
    assert all_finite(view) == bool(np.isfinite(view).all())


@given(case=cases(dtypes=("float16", "bfloat16", "float32", "float64")), seed=st.integers(0, 2**32 - 1),
       plants=st.lists(st.tuples(st.sampled_from(PLANTS), st.integers(0, 10**6)), min_size=1, max_size=3))
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_a_non_finite_dout_gets_the_references_gradients(backend, case, seed, plants):
    """NaN and inf planted in dout give a plan's vjp the reference's gradients, in every
    dtype: the CPU plans find them on delta = rowsum(dout * out) before their kernels
    run (the float16 and bfloat16 ones read dout as it lies), or on the gradients. (The
    kernels alone would spread a NaN to keys its row does not see, through 0 * NaN.)"""
    dout = np.random.default_rng(seed).uniform(-1, 1, (*case.q.shape[:3], case.v.shape[-1])).astype(case.dtype)
    for value, place in plants:
        dout.reshape(-1)[place % dout.size] = value
    expected = case.vjp("reference")[1](dout)
    got = npattn.plan(case.q, case.k, case.v, backend=backend, **case.options).vjp(case.q, case.k, case.v)[1](dout)
    terms = gradient_bound_terms(case, _finite_part(dout.astype(np.float64)))
    for name, actual, want in zip(("dq", "dk", "dv", "dbias", "dsink_logits"), got, expected):
        assert_same_values(actual, want, case.dtype, *terms, name)


@pytest.mark.reference_may_answer
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_gradients_past_the_dtypes_range_are_the_references(dtype, monkeypatch):
    """A finite dout whose gradients leave the dtype's range (dv, the sum of 16 dout rows,
    past the largest value; in float32 and bfloat16 delta = rowsum(dout * out) overflows
    float32 first, and the kernels would make dq NaN where it is 0) gives a plan's vjp
    the reference's gradients: the plan's checks send the call to the full path, whose
    reference answers, as for a non-finite input."""
    from npattn.runtime import nonfinite

    answered = []
    monkeypatch.setattr(nonfinite.reference, "backward",
                        lambda *arguments, backward=reference.backward: answered.append(1) or backward(*arguments))
    rng = np.random.default_rng(3)
    q = rng.uniform(-1, 1, (1, 2, 16, 64)).astype(dtype)
    k, v = (rng.uniform(0.5, 1, (1, 2, 2, 64)).astype(dtype) for _ in range(2))
    big = 30000.0 if dtype == "float16" else float(np.finfo(np.float32).max) / 4
    dout = np.full((1, 2, 16, 64), big, dtype)
    got = npattn.plan(q, k, v).vjp(q, k, v)[1](dout)
    assert answered
    want = npattn.attention_vjp(q, k, v, backend="reference")[1](dout)
    assert not np.isfinite(np.asarray(want[2], np.float64)).all()
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64), err_msg=name)


def test_a_float32_gradient_past_the_range_with_a_finite_delta_gets_the_references_gradients(monkeypatch):
    """dv past float32's range (the sum of 64 dout rows of a quarter of the largest value)
    while delta = rowsum(dout * out) stays finite (dout's columns alternate in sign against
    an out that is the same in every column): the plan's check of the gradients themselves
    sends the call to the full path, whose reference answers."""
    from npattn.runtime import nonfinite

    answered = []
    monkeypatch.setattr(nonfinite.reference, "backward",
                        lambda *arguments, backward=reference.backward: answered.append(1) or backward(*arguments))
    rng = np.random.default_rng(4)
    q = rng.uniform(-1, 1, (1, 2, 64, 64)).astype(np.float32)
    k = rng.uniform(-1, 1, (1, 2, 2, 64)).astype(np.float32)
    v = np.full((1, 2, 2, 64), 0.75, np.float32)
    dout = np.where(np.arange(64) % 2 == 0, 1.0, -1.0) * np.full((1, 2, 64, 64), np.finfo(np.float32).max / 16)
    dout = dout.astype(np.float32)
    got = npattn.plan(q, k, v).vjp(q, k, v)[1](dout)
    assert answered
    want = npattn.attention_vjp(q, k, v, backend="reference")[1](dout)
    assert not np.isfinite(want[2]).all()
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        np.testing.assert_array_equal(a, b, err_msg=name)


@given(dtype=st.sampled_from([np.float32, np.float64]), size=st.integers(1, 3000),
       plants=st.lists(st.tuples(st.sampled_from([np.nan, np.inf, -np.inf, "max", "-max", "tiny"]),
                                 st.integers(0, 10**6)), max_size=3))
def test_the_cpu_plans_finiteness_pass_agrees_with_isfinite(dtype, size, plants):
    """The jitted pass the CPU's backward plans check delta and their gradients with
    (:mod:`npattn.cpu.finiteness`) says what ``np.isfinite(a).all()`` says: with NaN
    and infinities of both signs anywhere, and with the largest and the smallest finite
    values (whose products with 0 must stay 0)."""
    from npattn.cpu.finiteness import finiteness_entry

    values = np.random.default_rng(size).standard_normal(size).astype(dtype)
    info = np.finfo(dtype)
    special = {"max": info.max, "-max": -info.max, "tiny": info.smallest_subnormal}
    for value, place in plants:
        values[place % size] = special.get(value, value) if isinstance(value, str) else value
    assert finiteness_entry(dtype)(values) == bool(np.isfinite(values).all())
