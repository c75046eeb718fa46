"""The CPU's float16 <-> float32 and float32 -> bfloat16 conversions (npattn.cpu.conversion)
give NumPy's and ml_dtypes' values exactly, in the input's memory layout; the 16-bit
finiteness check reads the exponent bits."""
from __future__ import annotations

import contextlib
import functools
from unittest import mock

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, strategies as st

from npattn.core.arrays import all_finite
from npattn.core.kernel_params import KvCodes
from npattn.cpu import conversion

SPECIAL = [0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65520.0, 7e4, 6.1e-5, 6e-8, 1e-8, -3e-8, 2049.0, 2051.0]


@pytest.mark.skipif(not conversion.MICROKERNELS, reason="the vector conversions need AVX2 or AVX-512")
@given(shape=st.lists(st.integers(1, 7), min_size=4, max_size=4), bshd=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_conversions_equal_numpys_in_the_inputs_layout(shape, bshd, seed):
    rng = np.random.default_rng(seed)
    values = rng.normal(size=shape) * 10.0 ** rng.integers(-9, 6, size=shape)
    flat = values.reshape(-1)
    flat[:len(SPECIAL)] = SPECIAL[:flat.size]
    single = values.astype(np.float32)
    if bshd:  # a bhsd view of a bshd array, as the kernels see one
        single = np.ascontiguousarray(single.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    with np.errstate(over="ignore"):
        expected_half = single.astype(np.float16)
    if single.size < conversion.VECTOR_VALUES:  # small: NumPy's astype is sooner
        assert conversion.converted(single, np.float16) is None
    with mock.patch.object(conversion, "VECTOR_VALUES", 1):  # (the vector path on these small arrays)
        half = conversion.converted(single, np.float16)
        back = conversion.converted(expected_half, np.float32)
        assert conversion.converted(single.astype(np.float64), np.float16) is None  # not a pair it converts
    assert layout(half) == layout(expected_half)
    np.testing.assert_array_equal(half.view(np.uint16), expected_half.view(np.uint16))  # bits: -0.0, NaN too
    np.testing.assert_array_equal(back, expected_half.astype(np.float32))
    assert layout(back) == layout(expected_half.astype(np.float32))


def layout(array):
    """The strides of ``array``'s axes longer than one: its memory layout (an axis of
    length one has a stride that no index reads, and NumPy's astype may give it any)."""
    return tuple(stride for length, stride in zip(array.shape, array.strides) if length > 1)


@pytest.mark.skipif(not conversion.MICROKERNELS, reason="the vector conversions need AVX2 or AVX-512")
@pytest.mark.parametrize("bshd", [False, True])
def test_arrays_of_many_values_convert_on_the_vector_units(bshd):
    """From VECTOR_VALUES values on, with a tail shorter than a vector: NumPy's values."""
    values = np.random.default_rng(2).normal(size=(1, 3, 701, 3)) * 1e3
    single = values.astype(np.float32)
    if bshd:
        single = np.ascontiguousarray(single.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    assert single.size >= conversion.VECTOR_VALUES and single.size % 16
    half = conversion.converted(single, np.float16)
    np.testing.assert_array_equal(half.view(np.uint16), single.astype(np.float16).view(np.uint16))
    assert half.strides == single.astype(np.float16).strides
    np.testing.assert_array_equal(conversion.converted(half, np.float32), half.astype(np.float32))


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("layout, kv_heads, q_len, kv_len, options", [
    ("bhsd", 4, 60, 70, dict(causal=True)), ("bshd", 2, 60, 70, dict(causal=True)),
    ("bhsd", 1, 3, 37, dict(window=(9, 2), sinks=2)), ("bhsd", 2, 1, 5, {}),
    ("bhsd", 2, 4, 21, dict(mask=np.arange(4)[:, None] + np.arange(21) > 2))])
def test_16_bit_weights_are_the_float32_weights_rounded_as_the_kernel_stores_them(monkeypatch, dtype, layout,
                                                                                 kv_heads, q_len, kv_len, options):
    """A 16-bit call's weights: its float32 computation's (the same as a float32 call's on
    the widened inputs) rounded once to nearest even, NumPy's and ml_dtypes' bits, by the
    weights kernel as it stores each row (whole vectors, then a row's last, partial vector
    by a masked store: 70, 37, 21 and 5 keys; an odd count of weights, 3 x 37 and 2 x 5, in
    memory seen as float32 words; the zeros between 2 sink keys and a window, and of a row
    that sees no key, kept), never as a float32 array converted afterwards (a second
    pass that had taken a (1, 8, 512 x 512, 64) call 1.18x float32's time); q read in its
    16-bit dtype by the weights kernel too, and out written 16-bit by the forward's."""
    import npattn
    from npattn.cpu import driver

    shapes = []
    monkeypatch.setattr(driver, "converted", lambda array, *rest: shapes.append(array.shape)
                        or conversion.converted(array, *rest))
    rng = np.random.default_rng(5)
    heads = 4 if kv_heads > 1 else 1
    q = rng.standard_normal((2, q_len, heads, 64) if layout == "bshd" else (2, heads, q_len, 64)).astype(dtype)
    k, v = (rng.standard_normal((2, kv_len, kv_heads, 64) if layout == "bshd" else (2, kv_heads, kv_len, 64))
            .astype(dtype) for _ in range(2))
    out, weights = npattn.attention(q, k, v, return_weights=True, layout=layout, backend="cpu", **options)
    assert (2, heads, q_len, kv_len) not in shapes  # (no float32 weights converted after the kernel)
    wide_out, wide_weights = npattn.attention(*(x.astype(np.float32) for x in (q, k, v)), return_weights=True,
                                              layout=layout, backend="cpu", **options)
    assert weights.dtype == np.dtype(dtype) and weights.shape == (2, heads, q_len, kv_len)
    np.testing.assert_array_equal(weights.view(np.uint16), wide_weights.astype(dtype).view(np.uint16))
    np.testing.assert_array_equal(out.view(np.uint16), wide_out.astype(dtype).view(np.uint16))


@pytest.mark.skipif(not conversion.MICROKERNELS, reason="the vector conversions need AVX2 or AVX-512")
@given(seed=st.integers(0, 2**32 - 1), size=st.integers(1024, 1100), bshd=st.booleans())
def test_bfloat16_out_equals_ml_dtypes_bit_for_bit(seed, size, bshd):
    """Every kind of float32: random bits (NaNs with payloads of either sign, infinities,
    subnormals, the largest finite values that round to inf), and ties at every
    exponent, which round to even."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**32, size=size, dtype=np.uint32)
    bits[:64] = (bits[:64] & 0xFFFF0000) | 0x8000  # ties
    bits[64:72] = [0x7F800001, 0xFFC00000, 0x7FFFFFFF, 0x7F800000, 0xFF800000, 0x00000001, 0x807FFFFF, 0x7F7FFFFF]
    single = bits.view(np.float32).reshape(1, size, 1, 1)
    if bshd:
        single = single.reshape(1, 1, size, 1).transpose(0, 2, 1, 3)
    with np.errstate(invalid="ignore", over="ignore"):
        expected = single.astype(ml_dtypes.bfloat16)
    narrow = conversion.converted(single, ml_dtypes.bfloat16)
    assert narrow.dtype == expected.dtype and narrow.strides == expected.strides
    np.testing.assert_array_equal(narrow.view(np.uint16), expected.view(np.uint16))


@pytest.mark.skipif(not conversion.MICROKERNELS, reason="the vector conversions need AVX2 or AVX-512")
@pytest.mark.parametrize("narrow", [np.float16, ml_dtypes.bfloat16])
@given(vectors=st.integers(1, 40), seed=st.integers(0, 2**32 - 1))
def test_a_plans_conversion_entry_gives_numpys_and_ml_dtypes_bits(narrow, vectors, seed):
    """conversion_entry: the kernels' own machine code for a plan's fixed size, with the
    values of astype (special values included); None for a size that is not whole
    vectors (the caller converts as before) and for a pair it does not convert."""
    size = vectors * conversion._LANES
    rng = np.random.default_rng(seed)
    single = (rng.normal(size=size) * 10.0 ** rng.integers(-9, 6, size=size)).astype(np.float32)
    single[:len(SPECIAL)] = np.array(SPECIAL[:size], np.float32)
    with np.errstate(over="ignore"):
        expected = single.astype(narrow)
    narrowed = np.empty(size, narrow)
    conversion.conversion_entry(np.float32, narrow, size)(single, narrowed.view(np.int8))
    np.testing.assert_array_equal(narrowed.view(np.uint16), expected.view(np.uint16))
    widened = np.empty(size, np.float32)
    conversion.conversion_entry(narrow, np.float32, size)(expected.view(np.int8), widened)
    np.testing.assert_array_equal(widened.view(np.uint32), expected.astype(np.float32).view(np.uint32))
    assert conversion.conversion_entry(np.float32, narrow, size + 1) is None
    assert conversion.conversion_entry(np.float64, narrow, size) is None


# float32 values on both sides of where each 16-bit type's rounding reaches an infinity
# (the halfway points 65520 and 0x7F7F8000, which round up to it), and the specials
_EDGES = {np.dtype(np.float16): np.array([65504.0, 65519.996, 65520.0, 65536.0, 1e5], np.float32),
          np.dtype(ml_dtypes.bfloat16): np.array([3.3895314e38, 3.3961773e38, 3.3961776e38, np.finfo(np.float32).max],
                                                  np.float32)}


@pytest.mark.skipif(not conversion.MICROKERNELS, reason="the vector conversions need AVX2 or AVX-512")
@pytest.mark.parametrize("narrow", [np.float16, ml_dtypes.bfloat16])
@given(vectors=st.integers(1, 40), seed=st.integers(0, 2**32 - 1), plants=st.lists(
    st.tuples(st.sampled_from([np.nan, np.inf, -np.inf, "edge"]), st.integers(0, 10**6), st.booleans()),
    max_size=3))
def test_a_narrowing_says_whether_any_rounded_value_is_not_finite(narrow, vectors, seed, plants):
    """The narrowing kernels return whether any value they rounded is NaN or infinite
    (what the backward's gradients are checked by): a NaN or infinity in, or a float32
    past the 16-bit range (rounded to an infinity as astype rounds it), of either sign,
    anywhere in the array; False for finite values up to the edge."""
    size = vectors * conversion._LANES
    rng = np.random.default_rng(seed)
    single = (rng.normal(size=size) * 10.0 ** rng.integers(-9, 4, size=size)).astype(np.float32)
    edges = _EDGES[np.dtype(narrow)]
    for value, place, negative in plants:
        value = edges[place % len(edges)] if value == "edge" else value
        single[place % size] = -value if negative else value
    with np.errstate(over="ignore"):
        expected = single.astype(narrow)
    narrowed = np.empty(size, narrow)
    flag = conversion.conversion_entry(np.float32, narrow, size)(single, narrowed.view(np.int8))
    np.testing.assert_array_equal(narrowed.view(np.uint16), expected.view(np.uint16))
    assert flag == (not np.isfinite(expected.astype(np.float32)).all())


@functools.lru_cache(maxsize=None)
def _narrow_run():
    """conversion.narrow_run called from jitted code (it has no Python body)."""
    from numba import njit

    @njit
    def narrow(source, start, count, out, out_at, brain):
        return conversion.narrow_run(source, start, count, out, out_at, brain)
    return narrow


@pytest.mark.skipif(not conversion.MICROKERNELS, reason="the vector conversions need AVX2 or AVX-512")
@pytest.mark.parametrize("narrow", [np.float16, ml_dtypes.bfloat16])
@given(size=st.integers(1, 90), start=st.integers(0, 20), out_at=st.integers(0, 20), seed=st.integers(0, 2**32 - 1),
       plant=st.sampled_from([None, np.nan, np.inf, "edge"]), plant_at=st.integers(0, 10**6))
def test_a_run_of_any_length_rounds_into_its_place_and_says_whether_it_stayed_finite(narrow, size, start, out_at,
                                                                                    seed, plant, plant_at):
    """narrow_run (the backward's rounding of a key tile's dK and dV rows) takes a run of
    any length: its last, partial vector is read and written masked, so the elements
    before ``out_at`` and after the run keep their bytes; each value is astype's; and a
    NaN, an infinity or a value past the 16-bit range anywhere in the run, the partial
    vector's lanes included, is reported (what lies outside the run is not)."""
    rng = np.random.default_rng(seed)
    source = (rng.normal(size=start + size + 20) * 10.0 ** rng.integers(-6, 3)).astype(np.float32)
    source[start + size:] = np.inf  # (past the run: never read)
    if plant is not None:
        source[start + plant_at % size] = _EDGES[np.dtype(narrow)][2] if plant == "edge" else plant
    out = np.full(out_at + size + 20, 7.0, narrow)
    flag = _narrow_run()(source, start, size, out.view(np.int8), out_at, narrow is ml_dtypes.bfloat16)
    with np.errstate(over="ignore"):
        expected = source[start:start + size].astype(narrow)
    np.testing.assert_array_equal(out[out_at:out_at + size].view(np.uint16), expected.view(np.uint16))
    assert (out[:out_at] == 7.0).all() and (out[out_at + size:] == 7.0).all()
    assert flag == (plant is not None)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_16_bit_finiteness_reads_the_exponent_bits(dtype):
    rng = np.random.default_rng(1)
    values = rng.normal(size=(2, 3, 40, 16)).astype(dtype)
    assert all_finite(values) and all_finite(values.transpose(0, 2, 1, 3))
    largest = ml_dtypes.finfo(dtype).max
    assert all_finite(np.array([largest, -largest], dtype))
    for bad in (np.nan, np.inf, -np.inf):
        broken = values.copy()
        broken[1, 2, 39, 15] = bad
        assert not all_finite(broken) and not all_finite(broken.transpose(0, 2, 1, 3))


def test_16_bit_finiteness_of_swapped_bytes_reads_the_values():
    """A byte-swapped float16 array's words are not its bits: 1.121 (0x3C7C) read as a
    native word has every exponent bit set. (ml_dtypes' bfloat16 has no swapped form.)"""
    values = np.array([0x3C7C, 0x3F7F], np.uint16).view(np.float16)
    swapped = values.astype(values.dtype.newbyteorder())
    assert all_finite(values) and all_finite(swapped)
    swapped[1] = np.nan
    assert not all_finite(swapped)


def test_kept_widened_arrays_are_reused_per_slot_and_bounded(monkeypatch):
    """A thread's kept array of a slot, shape and dtype comes back at the next request;
    another slot or shape gets its own; an array above the bound is not kept, and the
    least recently used go first once the bound is passed."""
    monkeypatch.setattr(conversion, "_WIDENED", conversion.threading.local())
    monkeypatch.setattr(conversion, "_KEPT_WIDENED_BYTES", 4096)
    q, k = conversion.kept_widened("q"), conversion.kept_widened("k")
    first = q((4, 64), np.float32)  # 1024 bytes
    assert q((4, 64), np.float32) is first
    assert k((4, 64), np.float32) is not first and q((8, 64), np.float32) is not first
    assert q((2048,), np.float32) is not q((2048,), np.float32)  # 8192 bytes: never kept
    for rows in (1, 2, 3):  # 256 + 512 + 768 bytes more: past 4096, the oldest (q (4, 64)) goes
        q((rows, 64), np.float32)
    assert q((4, 64), np.float32) is not first
    assert sum(array.nbytes for array in conversion._WIDENED.arrays.values()) <= 4096


def test_a_16_bit_backward_reuses_its_widened_copies_and_stays_right():
    """Two float16 forward and backward calls of one structure on new values: both passes
    read q, k and v (and the backward dout) a tile at a time, with no float32 copy of them;
    a forward whose backward follows keeps out's float32 product for it (its dominant
    keys' gradients subtract that O: driver.ForwardPlan.for_gradients), so nothing is
    widened, out included; both match the float64 reference."""
    import npattn
    from npattn.cpu import driver, operands
    from strategies import Case, Dims
    from tolerances import assert_close, gradient_bound_terms, output_bound_terms

    rng = np.random.default_rng(5)
    handed = []
    kept = conversion.kept_widened

    def spying(slot):
        empty = kept(slot)
        return lambda shape, dtype: handed.append(empty(shape, dtype)) or handed[-1]

    # (operand plans take their allocators when made: this structure's is made here)
    with mock.patch.object(operands, "kept_widened", spying), mock.patch.object(driver, "_KEPT_DOUT", spying("dout")), \
            mock.patch.object(driver, "_KEPT_OUT", spying("out")):
        for _ in range(2):
            q, k, v, dout = (rng.uniform(-1, 1, (1, 2, 1100, 16)).astype(np.float16) for _ in range(4))
            out, vjp = npattn.attention_vjp(q, k, v, causal=True, backend="cpu")
            got = vjp(dout)
            exact_out, exact_vjp = npattn.attention_vjp(*(x.astype(np.float64) for x in (q, k, v)), causal=True,
                                                        backend="reference")
            case = Case(Dims(1, 2, 2, 1100, 1100, 16, 16), q, k, v, {"causal": True})
            assert_close(out, exact_out, np.float16, *output_bound_terms(case), "out")
            terms = gradient_bound_terms(case, dout)
            for name, grad, exact in zip("qkv", got, exact_vjp(dout.astype(np.float64))):
                assert_close(grad, exact, np.float16, *terms, f"d{name}")
    assert not handed


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("layouts", [("bhsd", "bhsd"), ("bshd", "bshd"), ("bshd", "bhsd")])
def test_a_16_bit_douts_delta_has_the_bits_of_its_float32_copys(monkeypatch, dtype, layouts):
    """delta = rowsum(dout * out) of a 16-bit dout, widened a block of rows at a time (here
    blocks of 3 rows of 48, the last one short) where dout and out lie in one memory order,
    whole where they do not: the bits of einsum on dout's float32 copy either way."""
    from npattn.cpu import driver

    monkeypatch.setattr(driver, "_DELTA_BLOCK", 3 * 48 + 7)
    rng = np.random.default_rng(3)

    def in_layout(array, layout):  # a bhsd view of memory in that layout
        if layout == "bhsd":
            return array
        return np.ascontiguousarray(array.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)

    dout = in_layout(rng.standard_normal((2, 3, 11, 48)).astype(dtype), layouts[0])
    out = in_layout(rng.standard_normal((2, 3, 11, 48)).astype(np.float32), layouts[1])
    delta = driver._delta_of_16_bit(dout, out)
    expected = np.einsum("bhsd,bhsd->bhs", dout.astype(np.float32), out)
    assert delta.shape == (2, 3, 11) and delta.dtype == np.float32
    np.testing.assert_array_equal(delta, expected)


@pytest.mark.skipif(not conversion.MICROKERNELS, reason="the vector conversions need AVX2 or AVX-512")
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
@given(bshd=st.booleans(), batch=st.integers(1, 2), heads=st.integers(1, 3), rows=st.integers(1, 20),
       vectors=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_delta_has_the_same_bits_however_a_16_bit_problems_rows_are_read(dtype, bshd, batch, heads, rows, vectors,
                                                                         seed):
    """The backward's delta = rowsum(dout * out) of a 16-bit problem, in one pass over
    dout and out as they lie (npattn.cpu.delta): within float32's rounding of the exact
    sum (the recursive-summation bound, (D + 1) eps sum |dout out|), and the same bits
    whether each of dout and out is read in 16 bits or as a float32 copy, in either
    layout, the two in one memory order or not; a 16-bit out comes back widened with
    astype's bits in its memory order. None where rows are not whole vectors (einsum
    then, however the arrays are read)."""
    from npattn.cpu.delta import delta_of_rows

    rng = np.random.default_rng(seed)
    shape = (batch, heads, rows, vectors * conversion._LANES)

    def in_layout(array, layout_bshd):  # a bhsd view of memory in that layout
        return np.ascontiguousarray(array.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) if layout_bshd else array

    dout, out = (in_layout(rng.standard_normal(shape).astype(dtype), bshd) for _ in range(2))
    delta, widened = delta_of_rows(dout, out)
    np.testing.assert_array_equal(widened.view(np.uint32), out.astype(np.float32).view(np.uint32))
    assert widened.strides == tuple(2 * stride for stride in out.strides)
    products = dout.astype(np.float64) * out.astype(np.float64)
    exact, size = products.sum(axis=-1), np.abs(products).sum(axis=-1)
    assert delta.shape == shape[:3] and delta.dtype == np.float32
    assert np.all(np.abs(delta - exact) <= (shape[-1] + 1) * np.finfo(np.float32).eps * size)
    for copied in ((dout.astype(np.float32), out), (dout, out.astype(np.float32)),
                   (dout.astype(np.float32), out.astype(np.float32))):
        np.testing.assert_array_equal(delta_of_rows(*copied)[0], delta)
    other_order = in_layout(np.ascontiguousarray(out), not bshd)  # (the same memory where H or S is 1)
    np.testing.assert_array_equal(delta_of_rows(dout, other_order)[0], delta)
    np.testing.assert_array_equal(delta_of_rows(dout.astype(np.float32), other_order.astype(np.float32))[0], delta)
    narrow = rng.standard_normal((batch, heads, rows, conversion._LANES + 1)).astype(dtype)
    assert delta_of_rows(narrow, narrow) is None


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("q_dtype", ["same", np.float32])
@pytest.mark.parametrize("case", ["rows", "odd span", "off a word", "broadcast keys", "transposed", "causal GQA"])
def test_a_16_bit_bias_is_read_as_it_lies_with_the_scores_of_its_float32_copy(monkeypatch, dtype, q_dtype, case):
    """A float16 or bfloat16 bias of a float32 computation (16-bit or float32 q, k, v) is
    read in place by the forward, the weights kernel, the backward and the bias gradient's
    kernel, each value converted where a score adds it (Int.BIAS_CODES): out, lse, weights,
    dq, dk, dv and dbias (rounded to the bias's dtype) have the bits of the same calls on
    the bias widened to float32, whether its rows run a vector at a time with a partial
    last vector (37 and 71 keys), its memory spans an odd count of elements or starts off a
    4-byte boundary (both copied once into words), or it steps along the keys by other
    than 1 (broadcast, transposed: a value at a time). No float32 copy of it is made."""
    import npattn
    from npattn.cpu import operands

    widened = []
    real_widened = operands.widened
    monkeypatch.setattr(operands, "widened", lambda array, *rest: widened.append(array.shape)
                        or real_widened(array, *rest))
    rng = np.random.default_rng(11)
    batch, heads, kv_heads, q_len, kv_len = 2, 4, 4, 5, 37
    options = {}
    if case == "rows":
        bias = rng.standard_normal((batch, heads, q_len, kv_len))
    elif case == "odd span":
        batch, heads, kv_heads, q_len = 1, 1, 1, 3  # (3 x 37 elements)
        bias = rng.standard_normal((1, 1, q_len, kv_len))
    elif case == "off a word":  # a view one element into its buffer
        bias = rng.standard_normal(heads * q_len * kv_len + 1)[1:].reshape(1, heads, q_len, kv_len)
    elif case == "broadcast keys":
        bias = rng.standard_normal((1, heads, q_len, 1))
    elif case == "transposed":
        bias = rng.standard_normal((batch, heads, kv_len, q_len)).transpose(0, 1, 3, 2)
    else:
        kv_heads, q_len, kv_len, options = 2, 33, 71, dict(causal=True)
        bias = rng.standard_normal((batch, 1, q_len, kv_len))
    if case == "off a word":
        buffer = np.empty(bias.size + 1, dtype)
        sixteen = buffer[1:].reshape(bias.shape)
        sixteen[...] = bias * 3
    else:
        sixteen = (bias * 3).astype(dtype)
    compute = dtype if q_dtype == "same" else q_dtype
    q = rng.standard_normal((batch, heads, q_len, 64)).astype(compute)
    k, v = (rng.standard_normal((batch, kv_heads, kv_len, 64)).astype(compute) for _ in range(2))
    got = npattn.attention(q, k, v, bias=sixteen, return_lse=True, return_weights=True, backend="cpu", **options)
    dout = rng.standard_normal(q.shape).astype(compute)
    _, vjp = npattn.attention_vjp(q, k, v, bias=sixteen, backend="cpu", **options)
    gradients = vjp(dout)
    assert sixteen.shape not in widened
    wide_bias = sixteen.astype(np.float32)
    want = npattn.attention(q, k, v, bias=wide_bias, return_lse=True, return_weights=True, backend="cpu", **options)
    for mine, theirs in zip(got, want):
        np.testing.assert_array_equal(np.asarray(mine).view(np.uint8), np.asarray(theirs).view(np.uint8))
    _, wide_vjp = npattn.attention_vjp(q, k, v, bias=wide_bias, backend="cpu", **options)
    wide_gradients = wide_vjp(dout)
    wide_gradients = (*wide_gradients[:3], wide_gradients[3].astype(dtype))  # (dbias in the bias's dtype)
    for mine, theirs in zip(gradients, wide_gradients):
        np.testing.assert_array_equal(np.asarray(mine).view(np.uint8), np.asarray(theirs).view(np.uint8))


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("bias_shape", [(2, 4, 6, 40), (1, 4, 1, 40), (1, 1, 6, 1)])
def test_a_16_bit_bias_gradient_is_the_float32_one_rounded_once_by_the_backward(monkeypatch, dtype, bias_shape):
    """A float16 or bfloat16 bias's gradient comes out of the CPU backward in the bias's
    dtype, its float32 sums rounded once to nearest even (NumPy's and ml_dtypes' bits) on
    the vector units, where the public layer had rounded it by NumPy's astype, a scalar
    loop (a (1, 8, 256 x 256, 64) float16 forward and backward with a bias took 1.6x
    float32's time): full, broadcast over batch and rows, and over all but the rows. (Its
    distance from the float64 reference: the property tests' gradients.)"""
    import npattn
    from npattn import api
    from npattn.cpu import driver

    seen, sums = [], []
    real_public, real_narrowed = api._public_gradients, driver._narrowed
    monkeypatch.setattr(api, "_public_gradients", lambda form, grads, dtypes: seen.append(grads.dbias.dtype)
                        or real_public(form, grads, dtypes))
    monkeypatch.setattr(driver, "_narrowed", lambda gradient, *rest: sums.append(gradient.copy())
                        or real_narrowed(gradient, *rest))
    rng = np.random.default_rng(12)
    q, k, v, dout = (rng.standard_normal(shape).astype(dtype) for shape in
                     ((2, 4, 6, 64), (2, 4, 40, 64), (2, 4, 40, 64), (2, 4, 6, 64)))
    bias = (rng.standard_normal(bias_shape) * 2).astype(dtype)
    _, vjp = npattn.attention_vjp(q, k, v, bias=bias, causal=True, backend="cpu")
    dbias = vjp(dout)[3]
    assert seen == [np.dtype(dtype)] and dbias.dtype == np.dtype(dtype) and dbias.shape == bias_shape
    (float32_sums,) = [x for x in sums if x.shape == bias_shape]
    assert float32_sums.dtype == np.float32
    np.testing.assert_array_equal(dbias.view(np.uint16), float32_sums.astype(dtype).view(np.uint16))


@pytest.mark.skipif(not conversion.MICROKERNELS, reason="16-bit arrays are read as they lie on AVX2 or AVX-512")
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("bias_shape, options", [((2, 4, 24, 70), dict(causal=True)), ((1, 4, 1, 70), {}),
                                                  ((2, 1, 24, 1), dict(dropout_p=0.3, seed=4))])
def test_a_16_bit_backward_with_a_bias_gradient_reads_its_arrays_as_they_lie(monkeypatch, dtype, bias_shape, options):
    """A float16 or bfloat16 backward that computes a bias gradient reads q, k, v and dout
    in their 16-bit memory (tiles and rows converted where its kernels use them, the bias
    gradient's kernel too), as a backward without one does: no float32 copy of them is
    made, and every gradient, the bias's included, has the bits the float32 copies gave."""
    import npattn
    from npattn.cpu import operands
    from npattn.runtime import plans

    rng = np.random.default_rng(13)
    q, dout = (rng.standard_normal((2, 4, 24, 64)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((2, 2, 70, 64)).astype(dtype) for _ in range(2))
    bias = (rng.standard_normal(bias_shape) * 2).astype(dtype)

    def gradients():
        plans.clear()
        _, vjp = npattn.attention_vjp(q, k, v, bias=bias, backend="cpu", **options)
        return vjp(dout)

    widened = []
    real_widened = operands.widened
    monkeypatch.setattr(operands, "widened", lambda array, *rest: widened.append(array.shape)
                        or real_widened(array, *rest))
    in_place = gradients()
    assert not {q.shape, k.shape} & set(widened)
    real_codes = operands.kv_codes  # the backward's float32 copies (the forward as it was)
    monkeypatch.setattr(operands, "kv_codes", lambda problem, kind, tuning: operands.KvCodes.NONE
                        if kind == "backward" else real_codes(problem, kind, tuning))
    copied = gradients()
    if dtype is np.float16:  # (bfloat16 on AVX512_BF16 reads its pairs as they lie either way)
        assert k.shape in widened
    for mine, theirs in zip(in_place, copied):
        assert mine.dtype == theirs.dtype == np.dtype(dtype) and mine.shape == theirs.shape
        np.testing.assert_array_equal(mine.view(np.uint16), theirs.view(np.uint16))


def _backward_plans(monkeypatch, rounded_after=False) -> list:
    """A list that every backward plan made from now on appends itself to; with
    ``rounded_after``, plans whose kernel would round dk and dv leave them float32 for the
    pass afterwards instead (as a plan that may not round them takes them), planned afresh."""
    from npattn.cpu import driver

    made = []
    real_init = driver.BackwardPlan.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        if rounded_after:
            self.gradient_codes = KvCodes.NONE
        made.append(self)

    monkeypatch.setattr(driver, "_BACKWARD_PLANS", type(driver._BACKWARD_PLANS)())
    monkeypatch.setattr(driver.BackwardPlan, "__init__", init)
    return made


@pytest.mark.skipif(not conversion.MICROKERNELS, reason="the kernel rounds whole vectors on AVX2 or AVX-512")
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("case", ["chunk", "key chunks", "gqa window", "head dim 40", "head dim 36 gqa"])
def test_a_16_bit_backward_rounds_dk_and_dv_as_it_writes_them(monkeypatch, dtype, case):
    """A 16-bit backward's kernel rounds each key tile's dK and dV rows into 16-bit dk and
    dv as it writes them (BackwardPlan.gradient_codes; no float32 dk and dv, nor a pass
    over them afterwards): the bits of rounding the float32 ones afterwards (a small call's
    block of gradients, or a GQA group cut into head parts, still takes that path; here
    forced for the same call), with key chunks (each with its dQ), lengths, a window,
    dropout and GQA heads summed into one dK; and at head dims that are not whole vectors,
    where a tile of an odd key count ends its rows' run in a partial vector."""
    import npattn
    from npattn.runtime import plans

    rng = np.random.default_rng(21)
    shapes = {"chunk": ((1, 4, 16, 64), (1, 4, 900, 64), {}),
              "key chunks": ((1, 2, 40, 64), (1, 1, 700, 64), dict(causal=True, kv_lengths=np.array([650]))),
              "gqa window": ((2, 4, 120, 32), (2, 2, 300, 32), dict(causal=True, window=(50, 0), dropout_p=0.2,
                                                                    seed=5)),
              "head dim 40": ((1, 2, 40, 40), (1, 1, 701, 40), dict(causal=True)),
              "head dim 36 gqa": ((2, 4, 50, 36), (2, 2, 333, 36), dict(dropout_p=0.2, seed=3))}
    q_shape, kv_shape, options = shapes[case]
    q, dout = (rng.standard_normal(q_shape).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal(kv_shape).astype(dtype) for _ in range(2))

    def gradients():
        plans.clear()
        _, vjp = npattn.attention_vjp(q, k, v, backend="cpu", **options)
        return vjp(dout)

    made = _backward_plans(monkeypatch)
    with npattn.cpu.tile_sizes(32, 64) if case != "chunk" else contextlib.nullcontext():
        rounded_in_kernel = gradients()
        assert [plan.gradient_codes for plan in made] == [
            KvCodes.BFLOAT16 if dtype is ml_dtypes.bfloat16 else KvCodes.FLOAT16]
        assert case != "key chunks" or made[0].chunks > 1
        made = _backward_plans(monkeypatch, rounded_after=True)
        rounded_after = gradients()
        assert [plan.gradient_codes for plan in made] == [KvCodes.NONE]
    for mine, theirs in zip(rounded_in_kernel, rounded_after):
        assert mine.dtype == theirs.dtype == np.dtype(dtype) and mine.shape == theirs.shape
        np.testing.assert_array_equal(mine.view(np.uint16), theirs.view(np.uint16))


@pytest.mark.reference_may_answer
@pytest.mark.skipif(not conversion.MICROKERNELS, reason="the kernel rounds whole vectors on AVX2 or AVX-512")
@pytest.mark.parametrize("overflow", ["dk", "dv"])
def test_a_float16_dk_or_dv_that_rounds_past_65504_is_answered_as_the_rounding_afterwards_answers(monkeypatch,
                                                                                                 overflow):
    """Finite float32 gradients can round to float16's infinity (from 65520 on): the kernel
    that rounds dk and dv says so as it rounds (counter[NON_FINITE]), so a planned call's
    backward hands the call to the full path, which the float64 reference answers, as it
    answered where the rounding came afterwards: the same bits either way."""
    import npattn
    from npattn.cpu import driver
    from npattn.runtime import plans

    rng = np.random.default_rng(8)
    k, v = rng.standard_normal((1, 2, 900, 64)), rng.standard_normal((1, 2, 900, 64))
    if overflow == "dk":  # dK = scale dS^T Q: one large q row 16 times, dS of ~180 from a large dout
        q, k, dout = np.full((1, 2, 16, 64), 200.0), k / 200, np.full((1, 2, 16, 64), 20000.0)
    else:  # dV = P^T dO: key 7 takes every row's weight, and 16 rows of dout 30000 sum past 65504
        q, dout = np.ones((1, 2, 16, 64)), np.full((1, 2, 16, 64), 30000.0)
        k = k / 10
        k[:, :, 7] = 3.0
    q, k, v, dout = (x.astype(np.float16) for x in (q, k, v, dout))
    assert all(np.isfinite(x).all() for x in (q, k, v, dout))

    answers = []  # what each backward plan's run gave: None sends the call to the full path

    def gradients():
        plans.clear()
        _, vjp = npattn.plan(q, k, v, backend="cpu").vjp(q, k, v)
        return vjp(dout)

    made = _backward_plans(monkeypatch)
    real_call = driver.BackwardPlan.__call__
    monkeypatch.setattr(driver.BackwardPlan, "__call__", lambda self, *args, **kwargs: answers.append(
        real_call(self, *args, **kwargs)) or answers[-1])
    in_kernel = gradients()
    assert made[0].gradient_codes == KvCodes.FLOAT16
    assert answers[0] is None  # (the kernel said so: checked, the call answered by the reference)
    named = dict(zip(("dq", "dk", "dv"), in_kernel))
    assert np.isinf(named[overflow]).any()  # (what the test is about: a rounding past 65504)
    made = _backward_plans(monkeypatch, rounded_after=True)
    after = gradients()
    assert [plan.gradient_codes for plan in made] == [KvCodes.NONE]
    for mine, theirs in zip(in_kernel, after):
        np.testing.assert_array_equal(mine.view(np.uint16), theirs.view(np.uint16))
