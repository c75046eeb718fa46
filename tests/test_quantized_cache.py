"""Quantized (int8) kv caches: quantize_kv's rounding, the kv-cache call on codes and scales
against the float64 reference of the dequantized cache, the appends, the quantization's
own error against the float cache (a bound derived from the scales), and the safety
rules (every check before the first write; a failing call changes no byte)."""
from __future__ import annotations

from functools import partial

import numpy as np
import pytest
from hypothesis import given, strategies as st

import npattn
from npattn.core.quantization import CODE_LIMIT
from npattn.runtime import plans
from npattn.serving.kvcache import apply_rotary
from conftest import NUMPY_BACKENDS, count_direct_entries
from test_serving import assert_lse, assert_out, assert_same_bytes, call_case, draw_positional_options

HEAD_DIM = 16  # quantized caches take head dims in multiples of 16


@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3), spread=st.floats(1e-3, 1e3),
       zero_rows=st.booleans(), dtype=st.sampled_from(["float32", "float64", "float16"]), seed=st.integers(0, 2**32 - 1))
def test_quantize_kv_rounds_each_value_to_half_a_scale(shape, spread, zero_rows, dtype, seed):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(*shape, HEAD_DIM)) * spread).astype(dtype)
    if zero_rows:
        x[..., 0, :] = 0
    before = x.copy()
    codes, scales = npattn.quantize_kv(x)
    np.testing.assert_array_equal(x, before)  # the input is not modified
    assert codes.dtype == np.int8 and scales.dtype == np.float32
    assert codes.shape == x.shape and scales.shape == x.shape[:-1]
    assert np.abs(codes.astype(int)).max() <= CODE_LIMIT
    values = x.astype(np.float64)
    largest = np.abs(values).max(axis=-1)
    # the scale is the row's largest magnitude over 127, rounded to float32
    np.testing.assert_allclose(scales, largest / CODE_LIMIT, rtol=np.finfo(np.float32).eps, atol=0)
    restored = npattn.dequantize_kv(codes, scales, np.float64)
    # half a scale of rounding, plus float32's rounding of x / scale (a relative eps of the code)
    allowed = scales.astype(np.float64)[..., None] * (0.5 + 2 * CODE_LIMIT * np.finfo(np.float32).eps)
    assert (np.abs(restored - values) <= allowed).all()
    assert (codes[scales == 0] == 0).all()
    negated, negated_scales = npattn.quantize_kv(-x)  # symmetric: no zero point
    np.testing.assert_array_equal(negated, -codes)
    np.testing.assert_array_equal(negated_scales, scales)


@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3), spread=st.floats(1e-3, 1e3),
       seed=st.integers(0, 2**32 - 1))
def test_float8_codes_are_ml_dtypes_e4m3_rounding(shape, spread, seed):
    """float8 e4m3 codes: x / scale rounded as ml_dtypes rounds to float8_e4m3fn (nearest,
    ties to even), with the scale putting each row's largest value at 448."""
    import ml_dtypes

    from npattn.core.quantization import E4M3_VALUES

    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(*shape, HEAD_DIM)) * spread).astype(np.float32)
    x[(0,) * len(shape)][:4] = [0.0, -0.0, 1e-30, -1e-30]
    codes, scales = npattn.quantize_kv(x, "float8_e4m3")
    assert codes.dtype == np.uint8 and scales.dtype == np.float32
    np.testing.assert_allclose(scales, np.abs(x).max(axis=-1) / np.float32(448), rtol=np.finfo(np.float32).eps)
    safe = np.where(scales > 0, scales, np.float32(1))[..., None]
    expected = (x / safe).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(E4M3_VALUES[codes], expected.astype(np.float32))  # (+-0 alike)
    np.testing.assert_array_equal(npattn.dequantize_kv(codes, scales), E4M3_VALUES[codes] * scales[..., None])


def test_quantize_kv_rejects_bad_input_by_name():
    with pytest.raises(TypeError, match="x must be a float array"):
        npattn.quantize_kv(np.ones((2, 16), np.int32))
    with pytest.raises(ValueError, match="x must be finite"):
        npattn.quantize_kv(np.array([[1.0, np.nan] * 8]))
    with pytest.raises(ValueError, match="dtype must be 'int8' or 'float8_e4m3'"):
        npattn.quantize_kv(np.ones((2, 16)), dtype="int4")
    with pytest.raises(ValueError, match="scales must have codes's shape without its last axis"):
        npattn.dequantize_kv(np.ones((2, 16), np.int8), np.ones(3, np.float32))


@st.composite
def quantized_cases(draw, dtypes=("float32", "float64"), head_dims=(HEAD_DIM,)):
    """A quantized kv-cache call's case; ``head_dims``: the head dims to draw from (64
    sends a GPU decode step, contiguous or paged, to the tiles that read its codes into
    registers, 16 to the one that stages them)."""
    batch = draw(st.integers(1, 3))
    new = draw(st.integers(0, 2))
    queries = draw(st.integers(1, 3))
    cached = draw(st.lists(st.integers(0, 9), min_size=batch, max_size=batch))
    page_size = draw(st.sampled_from([None, 2, 4]))
    options = draw_positional_options(draw, max_window=3)
    options.update({name: value for name, value in (("softcap", 2.0), ("sinks", 1)) if draw(st.booleans())})
    rotary = draw(st.sampled_from([None, False, True]))
    slots = draw(st.booleans())
    dtype = draw(st.sampled_from(dtypes))
    kv_heads, group = draw(st.sampled_from([(1, 1), (2, 2), (1, 4)]))
    codes = draw(st.sampled_from(["int8", "float8_e4m3"]))
    head_dim = draw(st.sampled_from(head_dims))
    return batch, new, queries, cached, page_size, options, rotary, slots, dtype, kv_heads, group, codes, head_dim


def _quantized_cache(rng, batch, capacity, kv_heads, page_size, slots, kind="int8", head_dim=HEAD_DIM):
    """Random codes and scales laid out as a contiguous cache (rows picked by
    cache_batch_idx when ``slots``) or a paged pool, with ``read`` giving each sequence's
    logical (B, capacity, ...) view of any of them and the call's layout arguments."""
    call = {}
    if page_size is None:
        rows = rng.permutation(batch + 2)[:batch] if slots else np.arange(batch)
        cache_rows = batch + 2 if slots else batch
        shape = (cache_rows, capacity)
        if slots:
            call["cache_batch_idx"] = rows

        def read(cache):
            return cache[rows]
    else:
        per_sequence = capacity // page_size
        table = rng.permutation(batch * per_sequence + 3)[:batch * per_sequence].reshape(batch, per_sequence)
        shape = (batch * per_sequence + 3, page_size)
        call["block_table"] = table

        def read(cache):
            return cache[table].reshape(batch, capacity, *cache.shape[2:])
    if kind == "int8":
        codes = [rng.integers(-CODE_LIMIT, CODE_LIMIT + 1, size=(*shape, kv_heads, head_dim)).astype(np.int8)
                 for _ in range(2)]
    else:  # any e4m3 bits but the two NaN patterns
        codes = [rng.choice(np.setdiff1d(np.arange(256), [0x7F, 0xFF]), size=(*shape, kv_heads, head_dim)).astype(
            np.uint8) for _ in range(2)]
    scales = [rng.uniform(0.001, 0.05, size=(*shape, kv_heads)).astype(np.float32) for _ in range(2)]
    return codes, scales, read, call


@pytest.mark.parametrize("backend", NUMPY_BACKENDS)
@given(case=quantized_cases(), seed=st.integers(0, 2**32 - 1))
def test_a_quantized_cache_is_its_dequantized_cache(backend, case, seed):
    check_quantized_cache(backend, case, seed)


def check_quantized_cache(backend, case, seed, device=None):
    """Out and lse equal the float64 reference on the dequantized keys of each sequence,
    and the appended slots hold quantize_kv of the new (rotated) keys (test_gpu_emulated.py
    and test_gpu.py hold the GPU kernels to it too). ``device``: CuPy, for a call on
    device arrays (the caches are compared on the host after it)."""
    batch, new, queries, cached, page_size, options, rotary, slots, dtype, kv_heads, group, kind, head_dim = case
    rng = np.random.default_rng(seed)
    heads, capacity = kv_heads * group, 12
    cached = np.array(cached)
    (k_cache, v_cache), (k_scale, v_scale), read, call = _quantized_cache(rng, batch, capacity, kv_heads, page_size,
                                                                          slots, kind, head_dim)
    q = rng.normal(size=(batch, queries, heads, head_dim)).astype(dtype)
    k_new = rng.normal(size=(batch, new, kv_heads, head_dim)).astype(dtype) if new else None
    v_new = rng.normal(size=(batch, new, kv_heads, head_dim)).astype(dtype) if new else None
    if options.pop("alibi_slopes", None):
        options["alibi_slopes"] = rng.uniform(0.1, 1.0, heads)
    if rotary is not None:
        angles = np.arange(capacity)[:, None] * rng.uniform(0.01, 1.0, 4)[None, :]
        call.update(rotary_cos=np.cos(angles), rotary_sin=np.sin(angles), rotary_interleaved=rotary)
    first_query = cached + new - queries
    if rotary is not None and (first_query < 0).any():
        return  # (refused before any write: tests/test_serving.py)
    logical = [read(array).copy() for array in (k_cache, v_cache, k_scale, v_scale)]

    if device is None:
        out, lse = npattn.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cached,
                                                 k_scale=k_scale, v_scale=v_scale, return_lse=True, backend=backend,
                                                 **call, **options)
    else:
        def on_device(value):
            return device.asarray(value) if isinstance(value, np.ndarray) else value

        caches = [device.asarray(array) for array in (k_cache, v_cache, k_scale, v_scale)]
        out, lse = npattn.attention_with_kvcache(
            on_device(q), caches[0], caches[1], on_device(k_new), on_device(v_new), cache_seqlens=on_device(cached),
            k_scale=caches[2], v_scale=caches[3], return_lse=True, backend=backend,
            **{name: on_device(value) for name, value in {**call, **options}.items()})
        out, lse = out.get(), lse.get()
        k_cache, v_cache, k_scale, v_scale = (array.get() for array in caches)

    q_rotated, k_rotated = q, k_new
    if rotary is not None:
        q_rotated = apply_rotary(q, first_query, call["rotary_cos"], call["rotary_sin"], rotary)
        k_rotated = None if k_new is None else apply_rotary(k_new, cached, call["rotary_cos"], call["rotary_sin"],
                                                             rotary)
    if new:
        appended = (*npattn.quantize_kv(k_rotated, kind), *npattn.quantize_kv(v_new, kind))  # k codes, k scales, v
        for b in range(batch):
            where = slice(cached[b], cached[b] + new)
            logical[0][b, where], logical[2][b, where] = appended[0][b], appended[1][b]
            logical[1][b, where], logical[3][b, where] = appended[2][b], appended[3][b]
    for array, expected in zip((k_cache, v_cache, k_scale, v_scale), logical):
        np.testing.assert_array_equal(read(array), expected)
    keys = npattn.dequantize_kv(logical[0], logical[2], np.float64)
    values = npattn.dequantize_kv(logical[1], logical[3], np.float64)
    for b in range(batch):
        length = cached[b] + new
        expected, expected_lse = npattn.attention(
            q_rotated[b:b + 1].astype(np.float64), keys[b:b + 1, :length], values[b:b + 1, :length], layout="bshd",
            return_lse=True, backend="reference", **options)
        case = call_case(q_rotated[b:b + 1], keys[b:b + 1, :length], values[b:b + 1, :length], options)
        assert_out(out[b:b + 1], expected, case)
        assert_lse(lse[b:b + 1], expected_lse, case)


def quantization_error_bound(q, k_scale, v, v_scale, scale):
    """Per (B, Sq, H) row: how far attention over a quantized cache may lie from the
    float cache's. Each score moves by at most ``eps = scale * sum |q| * max k_scale / 2``
    (every key value by half its scale), so each probability by a factor within
    ``exp(+-2 eps)`` and the probabilities by ``exp(2 eps) - 1`` in total; each value by
    half its scale. |out' - out| <= (exp(2 eps) - 1) max |v'| + max v_scale / 2."""
    group = q.shape[2] // k_scale.shape[2]
    k_half = np.repeat(k_scale.max(axis=1), group, axis=-1)[:, None, :] / 2  # (B, 1, H)
    eps = scale * np.abs(q).sum(axis=-1) * k_half
    v_largest = np.repeat(np.abs(v).max(axis=(1, 3)), group, axis=-1)[:, None, :]
    v_half = np.repeat(v_scale.max(axis=1), group, axis=-1)[:, None, :] / 2
    return np.expm1(2 * eps) * (v_largest + v_half) + v_half


@pytest.mark.parametrize("keys", [64, 1024])
def test_the_quantization_error_stays_within_its_derived_bound(keys):
    """Against the float32 cache it came from (measured numbers: docs/tutorials/serving.rst)."""
    rng = np.random.default_rng(keys)
    batch, heads, kv_heads, dim = 2, 8, 2, 64
    q = rng.normal(size=(batch, 1, heads, dim)).astype(np.float32)
    k = rng.normal(size=(batch, keys, kv_heads, dim)).astype(np.float32)
    v = rng.normal(size=(batch, keys, kv_heads, dim)).astype(np.float32)
    (k_codes, k_scale), (v_codes, v_scale) = npattn.quantize_kv(k), npattn.quantize_kv(v)
    exact = npattn.attention_with_kvcache(q, k, v, cache_seqlens=keys, backend="reference")
    quantized = npattn.attention_with_kvcache(q, k_codes, v_codes, cache_seqlens=keys, k_scale=k_scale,
                                              v_scale=v_scale, backend="cpu")
    error = np.abs(quantized.astype(np.float64) - exact).max(axis=-1)
    bound = quantization_error_bound(q.astype(np.float64), k_scale, v, v_scale, 1 / np.sqrt(dim))
    assert (error <= bound).all(), f"worst error {error.max():.3g} past its bound {bound[error > bound].min():.3g}"


def test_the_compiled_e4m3_rounding_is_quantize_rows_table_search():
    """The compiled append's e4m3 rounding (by the float32's bits) gives quantize_rows'
    bits (its search of the table of e4m3 values): every e4m3 value and every midpoint
    between neighbours (ties: to the even pattern), both signs, zeros, past 448, and a
    stride through every float32 pattern below 460."""
    from numba import njit

    from npattn.core.quantization import E4M3_VALUES, _nearest_e4m3
    from npattn.cpu.slots import _e4m3_bits

    @njit  # (not cached: a test's own)
    def rounded(values):
        out = np.empty(values.size, np.int8)
        for i in range(values.size):
            out[i] = _e4m3_bits(values[i])
        return out

    table = E4M3_VALUES[:0x7F].astype(np.float64)
    middles = (table[:-1] + table[1:]) / 2
    strided = np.arange(0, int(np.float32(460).view(np.uint32)), 4099, dtype=np.uint32).view(np.float32)
    values = np.concatenate([table, middles, strided, [0.0, 448.0, 449.0, 1e30, 1e-45]]).astype(np.float32)
    values = np.concatenate([values, -values])
    np.testing.assert_array_equal(rounded(values).view(np.uint8), _nearest_e4m3(np, values))


@given(magnitude=st.integers(-40, 37), ties=st.booleans(), zero_row=st.booleans(),
       dtype=st.sampled_from(["float32", "float64"]), paged=st.booleans(),
       kind=st.sampled_from(["int8", "float8_e4m3"]), seed=st.integers(0, 2**32 - 1))
def test_the_compiled_append_quantizes_with_quantize_rows_bits(magnitude, ties, zero_row, dtype, paged, kind, seed):
    """The CPU backend's quantizing append (npattn.cpu.slots.SlotWriter.quantize) writes the
    codes and scales that quantize_rows gives and NumPy's assignment writes, byte for
    byte, int8 and float8 e4m3: values from 1e-40 to 1e38, rows of exact ties at half a
    step, rows of zeros, k and v of different widths; then puts the old bytes back. So does its checked form
    (quantize_checked), which writes nothing where any of the seven arrays' shapes differ
    from those it is given. A row that is not finite in float32 is left to NumPy: nothing
    written, None (-1 from the checked form)."""
    from npattn.core.quantization import quantize_rows
    from npattn.cpu.slots import SlotWriter
    from npattn.serving.kvcache import _slots

    rng = np.random.default_rng(seed)
    batch, new_len, kv_heads, widths = 3, 2, 2, (HEAD_DIM, 2 * HEAD_DIM)
    slots = 4 if paged else 8
    pages = rng.permutation(12)[:6].reshape(batch, 2) if paged else None
    pool = 12 if paged else batch
    rows = [(rng.normal(size=(batch, new_len, kv_heads, width)) * 10.0 ** magnitude).astype(dtype) for width in widths]
    codes_dtype = np.dtype(np.int8 if kind == "int8" else np.uint8)
    if ties and kind == "int8":  # values at n + 1/2 steps of their row's scale: rint's ties, to the even code
        step = np.float32(np.abs(rows[0].astype(np.float32)).max(axis=-1, keepdims=True) / np.float32(CODE_LIMIT))
        rows[0] = ((rng.integers(-126, 126, size=rows[0].shape) + 0.5) * step).astype(dtype)
        rows[0][..., 0] = CODE_LIMIT * step[..., 0]
    elif ties:  # midpoints of neighbouring e4m3 values, times a power of two: the scale (448 of it in each row)
        from npattn.core.quantization import E4M3_VALUES, E4M3_LARGEST
        table = E4M3_VALUES[:0x7F].astype(np.float64)
        below = rng.integers(0, 0x7E, size=rows[0].shape)
        step = 2.0 ** min(max(magnitude, -100), 100)
        signs = rng.choice([-1.0, 1.0], size=rows[0].shape)
        rows[0] = (signs * (table[below] + table[below + 1]) / 2 * step).astype(dtype)
        rows[0][..., 0] = E4M3_LARGEST * step
    if zero_row:
        rows[1][1, 0] = 0
    caches = [rng.integers(-127, 128, size=(pool, slots, kv_heads, width)).astype(np.int8).view(codes_dtype)
              for width in widths]
    caches += [rng.uniform(0.1, 2.0, (pool, slots, kv_heads)).astype(np.float32) for _ in range(2)]
    targets, positions = _slots(np, batch, new_len, np.array([0, 3, 2]), pages, None, slots, views=False)
    (k_codes, k_scales), (v_codes, v_scales) = (quantize_rows(row, codes_dtype) for row in rows)
    expected = [cache.copy() for cache in caches]
    for cache, new in zip(expected, (k_codes, v_codes, k_scales, v_scales)):
        cache[targets, positions] = new
    before = [cache.copy() for cache in caches]
    writer = SlotWriter(caches, (k_codes, v_codes, k_scales, v_scales), targets, positions)
    assert writer.quantizes(rows[0].dtype)
    olds = writer.quantize(caches, rows)
    assert_same_bytes(caches, expected)
    writer.restore(caches, rows, olds)
    assert_same_bytes(caches, before)
    # the checked form (a plan's runs): the same bytes where every structure matches,
    # nothing written where one differs
    q = np.zeros((batch, new_len, 2 * kv_heads, HEAD_DIM), np.float32)
    checked = np.zeros((7, 8), np.int64)
    for row, array in enumerate((q, *caches, *rows)):
        checked[row, :2 * array.ndim] = (*array.shape, *array.strides)
    checked.setflags(write=False)
    olds = writer.quantize_checked(q, caches, rows, checked)
    assert_same_bytes(caches, expected)
    writer.restore(caches, rows, olds)
    assert_same_bytes(caches, before)
    for row in range(7):
        differs = checked.copy()
        differs[row, 0] += 1
        assert writer.quantize_checked(q, caches, rows, differs) == 0
        assert_same_bytes(caches, before)
    rows[1][2, 1, 0, 3] = np.nan if magnitude % 2 else np.inf
    assert writer.quantize(caches, rows) is None
    assert writer.quantize_checked(q, caches, rows, checked) == -1
    assert_same_bytes(caches, before)


@pytest.mark.parametrize("backend", NUMPY_BACKENDS)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("reversed_arrays", [("k", "v"), ("k_scale", "v_scale"), ("k_scale",), ("k", "v", "k_scale",
                                                                                               "v_scale")])
def test_codes_and_scales_with_negative_strides_give_the_contiguous_caches_bits(backend, paged, reversed_arrays):
    """A quantized cache's codes and scales read through views with a negative stride along
    the keys (or pages) give the bits of the same values in contiguous memory. (The CPU
    plan had taken the scales' own strides while its calls handed the kernel a contiguous
    copy of them: with both scales reversed the step read the wrong scales.)"""
    rng = np.random.default_rng(11)
    q = rng.standard_normal((2, 1, 8, 128)).astype(np.float32)
    (k, k_scale), (v, v_scale) = (npattn.quantize_kv(rng.standard_normal((2, 384, 2, 128))) for _ in range(2))
    arrays = {"k": k, "v": v, "k_scale": k_scale, "v_scale": v_scale}
    layout = {}
    if paged:  # pages of 64 keys, the pool's pages in reverse order
        arrays = {name: np.ascontiguousarray(x.reshape(12, 64, *x.shape[2:])[::-1]) for name, x in arrays.items()}
        layout = {"block_table": np.arange(12)[::-1].reshape(2, 6)}

    def reversed_view(x):  # the same values, the keys' (or pool's pages') axis read backwards
        backwards = (slice(None, None, -1),) if paged else (slice(None), slice(None, None, -1))
        return np.ascontiguousarray(x[backwards])[backwards]

    odd = {name: reversed_view(x) if name in reversed_arrays else x for name, x in arrays.items()}
    assert all((odd[name].strides[0 if paged else 1] < 0) for name in reversed_arrays)
    steps = [npattn.attention_with_kvcache(q, given["k"], given["v"], cache_seqlens=np.array([300, 371]),
                                           k_scale=given["k_scale"], v_scale=given["v_scale"], return_lse=True,
                                           backend=backend, **layout) for given in (arrays, odd)]
    for contiguous, from_odd_views in zip(*steps):
        assert contiguous.tobytes() == from_odd_views.tobytes()


def test_a_quantized_call_that_raises_changes_no_byte(monkeypatch):
    rng = np.random.default_rng(5)
    q = rng.normal(size=(2, 1, 2, HEAD_DIM)).astype(np.float32)
    k = rng.normal(size=(2, 1, 1, HEAD_DIM)).astype(np.float32)
    codes, scales = npattn.quantize_kv(rng.normal(size=(2, 6, 1, HEAD_DIM)).astype(np.float32))
    caches = [codes, codes.copy(), scales, scales.copy()]
    before = [array.copy() for array in caches]

    def call(**options):
        return npattn.attention_with_kvcache(q, caches[0], caches[1], k, k, cache_seqlens=np.array([1, 2]),
                                             k_scale=caches[2], v_scale=caches[3], backend="cpu", **options)

    def unchanged():
        for array, old in zip(caches, before):
            np.testing.assert_array_equal(array, old)

    with pytest.raises(ValueError, match="window must be non-negative"):
        call(window=-1)
    unchanged()
    with pytest.raises(ValueError, match="k_scale must be finite"):
        caches[2][0, 0, 0] = np.nan
        before[2][0, 0, 0] = np.nan
        call(check_finite=True)
    unchanged()
    caches[2][0, 0, 0] = before[2][0, 0, 0] = 1.0

    def out_of_memory(*args, **kwargs):
        raise MemoryError("the attention failed after the append")
    monkeypatch.setattr(npattn.api, "run_problem", out_of_memory)
    with pytest.raises(MemoryError):
        call()
    unchanged()  # the appended codes and scales got their old bytes back


def test_quantized_caches_reject_bad_input_by_name():
    rng = np.random.default_rng(6)
    q = rng.normal(size=(1, 1, 2, HEAD_DIM)).astype(np.float32)
    codes, scales = npattn.quantize_kv(rng.normal(size=(1, 4, 1, HEAD_DIM)).astype(np.float32))

    def call(k_cache=codes, v_cache=codes, **arguments):
        arguments = {"k_scale": scales, "v_scale": scales, **arguments}
        return npattn.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=2, **arguments)

    with pytest.raises(TypeError, match="k_cache holds int8 codes: pass k_scale and v_scale"):
        call(k_scale=None, v_scale=None)
    with pytest.raises(ValueError, match="k_scale and v_scale must be given together"):
        call(v_scale=None)
    with pytest.raises(TypeError, match="k_scale must be float32"):
        call(k_scale=scales.astype(np.float64))
    with pytest.raises(ValueError, match=r"v_scale must have v_cache's shape without its last axis, \(1, 4, 1\)"):
        call(v_scale=scales[:, :3])
    with pytest.raises(TypeError, match="k_cache must be int8 codes or float8 e4m3 codes held as uint8"):
        call(k_cache=codes.astype(np.int16))
    with pytest.raises(TypeError, match="k_cache holds int8 codes but v_cache uint8"):
        call(v_cache=codes.view(np.uint8))
    narrow_codes, narrow_scales = npattn.quantize_kv(rng.normal(size=(1, 4, 1, 8)).astype(np.float32))
    with pytest.raises(ValueError, match="k_cache's head dim must be a multiple of 16"):
        npattn.attention_with_kvcache(q[..., :8], narrow_codes, narrow_codes, cache_seqlens=2, k_scale=narrow_scales,
                                      v_scale=narrow_scales)
    k = rng.normal(size=(1, 1, 1, HEAD_DIM)).astype(np.float32)
    frozen = scales.copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="k_scale is read-only"):
        call(k_cache=codes.copy(), v_cache=codes.copy(), k_scale=frozen, v_scale=scales.copy(), k=k, v=k)
    shared = scales.copy()
    with pytest.raises(ValueError, match="k_scale and v_scale share memory"):
        call(k_cache=codes.copy(), v_cache=codes.copy(), k_scale=shared, v_scale=shared, k=k, v=k)


@pytest.mark.parametrize("paged", [False, True])
def test_a_planned_quantized_step_is_the_call_layer_by_layer(paged):
    check_planned_quantized_step(paged, "auto")


def check_planned_quantized_step(paged, backend):
    """plan_with_kvcache on a quantized cache (its runs hand each layer's scales to one
    backend plan) gives each layer the call's bits and bytes (test_gpu_emulated.py runs it
    on the GPU kernels too)."""
    rng = np.random.default_rng(7)
    batch, heads, kv_heads, layers, capacity = 2, 4, 2, 3, 16
    q = [rng.normal(size=(batch, 1, heads, HEAD_DIM)).astype(np.float32) for _ in range(layers)]
    k = [rng.normal(size=(batch, 1, kv_heads, HEAD_DIM)).astype(np.float32) for _ in range(layers)]
    shape = (batch * capacity // 4, 4) if paged else (batch, capacity)
    layout = {"block_table": np.arange(batch * capacity // 4).reshape(batch, -1)} if paged else {}

    def caches():
        made = []
        for layer in range(layers):
            layer_rng = np.random.default_rng(layer)
            codes, scales = npattn.quantize_kv(layer_rng.normal(size=(*shape, kv_heads, HEAD_DIM)).astype(np.float32))
            made.append([codes, codes.copy(), scales, scales.copy()])
        return made

    planned, called = caches(), caches()
    seqlens = np.array([3, 9])
    step = npattn.plan_with_kvcache(q[0], *planned[0][:2], k[0], k[0], cache_seqlens=seqlens, k_scale=planned[0][2],
                                    v_scale=planned[0][3], causal=True, backend=backend, **layout)
    for layer in range(layers):
        kc, vc, ks, vs = planned[layer]
        out = step.run(q[layer], kc, vc, k[layer], k[layer], k_scale=ks, v_scale=vs)
        kc2, vc2, ks2, vs2 = called[layer]
        expected = npattn.attention_with_kvcache(q[layer], kc2, vc2, k[layer], k[layer], cache_seqlens=seqlens,
                                                 k_scale=ks2, v_scale=vs2, causal=True, backend=backend, **layout)
        np.testing.assert_array_equal(out, expected)
        for mine, theirs in zip(planned[layer], called[layer]):
            np.testing.assert_array_equal(mine, theirs)
    with pytest.raises(ValueError, match="k_scale is None, but the plan was made with it"):
        step.run(q[0], *planned[0][:2], k[0], k[0])


def test_a_planned_int8_steps_compiled_checks_fall_back_by_name_and_undo(monkeypatch):
    """A planned int8 step's runs compare the arrays' structures and quantize the new rows
    in one compiled call (SlotWriter.quantize_checked): a run whose k_scale has other
    strides raises by name with nothing written, and a run whose attention raises after
    the write puts the old codes and scales back."""
    rng = np.random.default_rng(12)
    q = rng.normal(size=(2, 1, 4, HEAD_DIM)).astype(np.float32)
    k = rng.normal(size=(2, 1, 2, HEAD_DIM)).astype(np.float32)
    codes, scales = npattn.quantize_kv(rng.normal(size=(2, 8, 2, HEAD_DIM)).astype(np.float32))
    caches = [codes, codes.copy(), scales, scales.copy()]
    step = npattn.plan_with_kvcache(q, caches[0], caches[1], k, k, cache_seqlens=np.array([3, 6]),
                                    k_scale=caches[2], v_scale=caches[3], backend="cpu")
    assert step._quick is not None
    before = [array.copy() for array in caches]
    wide = np.asfortranarray(caches[2])  # the same shape, its own memory, other strides
    assert wide.base is None and wide.strides != caches[2].strides
    with pytest.raises(ValueError, match="k_scale"):
        step.run(q, caches[0], caches[1], k, k, k_scale=wide, v_scale=caches[3])
    assert_same_bytes(caches, before)

    def fails(*args, **kwargs):
        raise MemoryError("the attention failed after the append")
    monkeypatch.setattr(step, "_codes_attention", fails)
    with pytest.raises(MemoryError):
        step.run(q, caches[0], caches[1], k, k, k_scale=caches[2], v_scale=caches[3])
    assert_same_bytes(caches, before)  # the appended codes and scales got their old bytes back
    monkeypatch.undo()
    out = step.run(q, caches[0], caches[1], k, k, k_scale=caches[2], v_scale=caches[3])
    called = [array.copy() for array in before]
    expected = npattn.attention_with_kvcache(q, called[0], called[1], k, k, cache_seqlens=np.array([3, 6]),
                                             k_scale=called[2], v_scale=called[3], backend="cpu")
    np.testing.assert_array_equal(out, expected)
    assert_same_bytes(caches, called)


@pytest.mark.parametrize("kind, capacity", [("int8", 18), ("int8", 24), ("float8_e4m3", 24)])
def test_a_planned_quantized_steps_later_runs_call_the_kernels_entry_point(monkeypatch, kind, capacity):
    """From its second run on, a planned quantized step's attention calls the CPU forward
    kernel's typed entry point (npattn.cpu.threads.direct_entry) with that run's codes and
    scales and the options kept from the first run: each layer gets the bits the call
    gives it, its own scales read (each layer's differ), GQA rows folded; on whole caches
    (18 slots for 17 keys and the appended one: read in memory order) and on their filled
    part (24 slots: slices of the caches and scales)."""
    rng = np.random.default_rng(11)
    batch, heads, kv_heads, layers = 2, 8, 2, 4
    seqlens = np.array([5, 17])
    q = [rng.normal(size=(batch, 1, heads, HEAD_DIM)).astype(np.float32) for _ in range(layers)]
    k = [rng.normal(size=(batch, 1, kv_heads, HEAD_DIM)).astype(np.float32) for _ in range(layers)]
    caches = []
    for layer in range(layers):
        codes, scales = npattn.quantize_kv(rng.normal(size=(batch, capacity, kv_heads, HEAD_DIM)).astype(np.float32),
                                           kind)
        caches.append((codes, codes.copy(), scales * (layer + 1), scales.copy()))
    called = [[x.copy() for x in cache] for cache in caches]
    expected = [npattn.attention_with_kvcache(q[layer], *called[layer][:2], k[layer], k[layer],
                                              cache_seqlens=seqlens, k_scale=called[layer][2],
                                              v_scale=called[layer][3], causal=True, backend="cpu")
                for layer in range(layers)]
    # (the calls above ran their later layers on a kept step plan, which typed the entry
    # point already: the step below starts from no plans, to type and count its own)
    plans.clear()
    direct_calls = count_direct_entries(monkeypatch)
    kc, vc, ks, vs = caches[0]
    step = npattn.plan_with_kvcache(q[0], kc, vc, k[0], k[0], cache_seqlens=seqlens, k_scale=ks, v_scale=vs,
                                    causal=True, backend="cpu")
    for layer in range(layers):
        kc, vc, ks, vs = caches[layer]
        before = len(direct_calls)
        out = step.run(q[layer], kc, vc, k[layer], k[layer], k_scale=ks, v_scale=vs)
        assert len(direct_calls) == before + (layer > 0), "a later run did not call the entry point"
        np.testing.assert_array_equal(out, expected[layer])
        for mine, theirs in zip(caches[layer], called[layer]):
            np.testing.assert_array_equal(mine, theirs)


@pytest.mark.parametrize("kind", ["int8", "float8_e4m3"])
def test_a_quantized_paged_pool_quantizes_its_appends_and_attends_over_them(kind):
    from npattn.nn import PagedKVCache

    rng = np.random.default_rng(8)
    pool = PagedKVCache(num_pages=8, page_size=4, num_kv_heads=1, head_dim=HEAD_DIM, dtype=kind)
    assert pool.keys.dtype == (np.int8 if kind == "int8" else np.uint8) and pool.key_scales.shape == (8, 4, 1)
    names = ("a", "b")
    for name in names:
        pool.add(name)
    appended = {name: [] for name in names}  # each sequence's (k codes, k scales, v codes, v scales) per step
    for _ in range(6):
        q = rng.normal(size=(2, 1, 2, HEAD_DIM)).astype(np.float32)
        k, v = (rng.normal(size=(2, 1, 1, HEAD_DIM)).astype(np.float32) for _ in range(2))
        out = pool.attend(list(names), q, k, v, causal=True)
        for b, name in enumerate(names):
            appended[name].append((*npattn.quantize_kv(k[b], kind), *npattn.quantize_kv(v[b], kind)))
            k_codes, k_scales, v_codes, v_scales = (np.stack([step[i] for step in appended[name]]) for i in range(4))
            table = pool.block_table([name])[0]
            held = len(appended[name])
            for stored, expected in ((pool.keys, k_codes), (pool.key_scales, k_scales), (pool.values, v_codes),
                                     (pool.value_scales, v_scales)):
                np.testing.assert_array_equal(stored[table].reshape(-1, *stored.shape[2:])[:held], expected[:, 0])
            keys = npattn.dequantize_kv(k_codes[:, 0], k_scales[:, 0], np.float64)[None]
            values = npattn.dequantize_kv(v_codes[:, 0], v_scales[:, 0], np.float64)[None]
            expected_out = npattn.attention(q[b:b + 1].astype(np.float64), keys, values, layout="bshd", causal=True,
                                            backend="reference")
            assert_out(out[b:b + 1], expected_out, call_case(q[b:b + 1], keys, values))
    with pytest.raises(ValueError, match="PagedKVCache: head_dim must be a multiple of 16 for a quantized pool"):
        PagedKVCache(num_pages=2, page_size=4, num_kv_heads=1, head_dim=8, dtype="int8")


@given(steps=st.lists(st.lists(st.integers(0, 5), min_size=3, max_size=3), min_size=1, max_size=3),
       kind=st.sampled_from(["int8", "float8_e4m3"]), seed=st.integers(0, 2**31))
@pytest.mark.parametrize("backend", NUMPY_BACKENDS)
def test_a_quantized_pools_attend_varlen_is_attend_per_sequence(backend, steps, kind, seed):
    """PagedKVCache.attend_varlen on an int8 or e4m3 pool (prefill chunks and decode steps
    of several sequences in one call, the kernels reading the codes; the reference one
    sequence at a time on the pool dequantized) leaves codes and scales as attend does
    sequence by sequence, bit for bit, and returns each sequence's rows as attend does."""
    from npattn.nn import PagedKVCache

    rng = np.random.default_rng(seed)
    pools = [PagedKVCache(16, 4, 2, HEAD_DIM, dtype=kind) for _ in range(2)]
    for pool in pools:
        for name in "abc":
            pool.add(name)
    for counts in steps:
        chosen = [name for name, n in zip("abc", counts) if n]
        news = [n for n in counts if n]
        if not chosen:
            continue
        q = rng.standard_normal((sum(news), 4, HEAD_DIM)).astype(np.float32)
        k, v = (rng.standard_normal((sum(news), 2, HEAD_DIM)).astype(np.float32) for _ in range(2))
        cu = np.concatenate([[0], np.cumsum(news)])
        out = pools[0].attend_varlen(chosen, q, k, v, cu, causal=True, backend=backend)
        for b, name in enumerate(chosen):
            rows = slice(int(cu[b]), int(cu[b + 1]))
            want = pools[1].attend([name], q[None, rows], k[None, rows], v[None, rows], causal=True, backend=backend)
            held = pools[1].length(name)
            table = pools[1].block_table([name])[0]
            keys, values = (npattn.dequantize_kv(codes[table].reshape(-1, 2, HEAD_DIM)[:held],
                                                 scales[table].reshape(-1, 2)[:held], np.float64)[None]
                            for codes, scales in ((pools[1].keys, pools[1].key_scales),
                                                  (pools[1].values, pools[1].value_scales)))
            assert_out(out[None, rows], want, call_case(q[None, rows], keys, values))
    for first, second in ((pools[0].keys, pools[1].keys), (pools[0].values, pools[1].values),
                          (pools[0].key_scales, pools[1].key_scales), (pools[0].value_scales, pools[1].value_scales)):
        np.testing.assert_array_equal(first, second)
    assert [pools[0].length(n) for n in "abc"] == [pools[1].length(n) for n in "abc"]


def test_a_quantized_pools_attend_varlen_that_raises_changes_nothing(monkeypatch):
    """Every check before the first write, and the codes and scales back if the attention
    fails after it."""
    from npattn.nn import PagedKVCache
    from npattn.serving import mixed

    rng = np.random.default_rng(2)
    pool = PagedKVCache(4, 4, 1, HEAD_DIM, dtype="int8")
    pool.add("a")
    floats = lambda rows, heads: rng.standard_normal((rows, heads, HEAD_DIM)).astype(np.float32)  # noqa: E731
    pool.attend_varlen(["a"], floats(3, 2), floats(3, 1), floats(3, 1), np.array([0, 3]), causal=True)
    state = [array.copy() for array in (pool.keys, pool.values, pool.key_scales, pool.value_scales)]
    q, k = floats(1, 2), floats(1, 1)
    with pytest.raises(TypeError, match="unknown option 'softmax_scale'"):
        pool.attend_varlen(["a"], q, k, k, np.array([0, 1]), softmax_scale=0.5)
    with pytest.raises(TypeError, match="k has dtype float64 but q has float32"):
        pool.attend_varlen(["a"], q, k.astype(np.float64), k, np.array([0, 1]))
    with pytest.raises(ValueError, match="backend .gpu. is unavailable here"):
        pool.attend_varlen(["a"], q, k, k, np.array([0, 1]), backend="gpu")

    def failing(problem, implementation, with_vjp=False):
        raise MemoryError("injected after the write")
    monkeypatch.setattr(mixed.api, "run_problem", failing)
    with pytest.raises(MemoryError, match="injected"):
        pool.attend_varlen(["a"], q, k, k, np.array([0, 1]), causal=True)
    for array, before in zip((pool.keys, pool.values, pool.key_scales, pool.value_scales), state):
        np.testing.assert_array_equal(array, before)
    assert pool.length("a") == 3


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("cache", ["contiguous", "paged", "long"])
def test_16_bit_caches_read_in_registers_give_the_bits_of_a_converted_copy(dtype, cache, monkeypatch):
    """float16 and bfloat16 keys and values a decode step reads as they lie, converted in
    registers (KvCodes.FLOAT16 / BFLOAT16, npattn.cpu.code_products), give exactly what the
    converted float32 copy gave: GQA heads folded into rows, pages, and a tile of more
    keys than the micro-kernels' depth slices (DEPTH_BLOCK) at a head dim past one wide
    chunk of columns."""
    import ml_dtypes  # noqa: F401  (registers bfloat16)

    rng = np.random.default_rng(9)
    head_dim = 192 if cache == "long" else 32
    q = rng.normal(size=(2, 2, 8, head_dim)).astype(dtype)
    if cache == "paged":
        k, v = (rng.normal(size=(12, 8, 2, head_dim)).astype(dtype) for _ in range(2))
        layout = dict(block_table=rng.permutation(12)[:10].reshape(2, 5), cache_seqlens=np.array([37, 21]))
    else:
        keys = 300 if cache == "long" else 40
        k, v = (rng.normal(size=(2, keys, 2, head_dim)).astype(dtype) for _ in range(2))
        layout = dict(cache_seqlens=np.array([keys, 23]))
    # (a long row's weights spread over its keys, where the sums' order shows in its bits)
    layout["alibi_slopes"] = np.full(8, 0.001 if cache == "long" else 1.0)
    tiled, copied = _tiles_and_copies(
        monkeypatch, dtype, lambda: npattn.attention_with_kvcache(q, k, v, causal=True, return_lse=True, **layout))
    for mine, theirs in zip(tiled, copied):
        np.testing.assert_array_equal(mine, theirs)


def _tiles_and_copies(monkeypatch, dtype, call):
    """``call()`` reading its 16-bit k and v by tiles (checked), then ``call()`` again with
    plans made afresh on float32 copies of them: both results."""
    from npattn.core.kernel_params import KvCodes
    from npattn.cpu import driver, operands

    problem_codes = []
    planned = operands.kv_codes
    monkeypatch.setattr(operands, "kv_codes", lambda *a: problem_codes.append(planned(*a)) or problem_codes[-1])
    tiled = call()
    assert problem_codes == [KvCodes.FLOAT16 if dtype == "float16" else KvCodes.BFLOAT16]
    monkeypatch.setattr(operands, "kv_codes", lambda *a: KvCodes.NONE)
    monkeypatch.setattr(operands, "_PLANS", type(operands._PLANS)())  # plans made afresh, by the copy
    monkeypatch.setattr(driver, "_FORWARD_PLANS", type(driver._FORWARD_PLANS)())
    return tiled, call()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("page_size", [24, 32])
def test_a_16_bit_chunk_on_pages_packs_its_keys_from_their_memory_with_a_copys_bits(dtype, page_size,
                                                                                  monkeypatch):
    """A prefill chunk against a paged 16-bit cache packs each key tile's K^T straight from
    the pages (whole squares converted and transposed in registers, each page run's last
    keys one by one: npattn.cpu.tiles.pack_key_codes; runs of 24 keys end in 8 such keys
    on AVX-512) and reads the values in registers for P V: the bits of float32 copies of
    the same values, with ALiBi spreading each row's weights over its keys."""
    import ml_dtypes  # noqa: F401  (registers bfloat16)
    from npattn.cpu.tuning import tuned

    rng = np.random.default_rng(11)
    per_sequence = 5 if page_size == 24 else 4
    q = rng.normal(size=(2, 20, 4, 32)).astype(dtype)
    k, v = (rng.normal(size=(2 * per_sequence + 3, page_size, 2, 32)).astype(dtype) for _ in range(2))
    layout = dict(block_table=rng.permutation(2 * per_sequence + 3)[:2 * per_sequence].reshape(2, per_sequence),
                  cache_seqlens=np.array([per_sequence * page_size - 3, per_sequence * page_size // 2 + 5]),
                  alibi_slopes=np.full(4, 0.01))
    with tuned(bf16_products=False):  # (a bfloat16 chunk: not as pairs)
        tiled, copied = _tiles_and_copies(
            monkeypatch, dtype, lambda: npattn.attention_with_kvcache(q, k, v, causal=True, return_lse=True, **layout))
    for mine, theirs in zip(tiled, copied):
        np.testing.assert_array_equal(mine, theirs)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("values", ["converted", "in registers"])
def test_a_16_bit_prefill_longer_than_a_tile_reads_k_and_v_a_tile_at_a_time(dtype, values, monkeypatch):
    """A prefill whose rows span several query tiles converts each key tile where it uses it
    (no float32 copy of k and v, which a call allocated and page-faulted in afresh), with
    the copy's bits, whether P V reads a tile's values converted once or in registers
    (Int.CONVERTED_VALUE_ROWS); bfloat16 where the CPU multiplies in bfloat16 reads k and v
    as they lie instead (npattn.cpu.operands.bf16_products)."""
    import ml_dtypes  # noqa: F401  (registers bfloat16)
    from npattn.core.kernel_params import KvCodes
    from npattn.cpu import driver, operands, simd
    from npattn.cpu.tuning import current, tuned

    rng = np.random.default_rng(4)
    q, k, v = (rng.normal(size=(1, 2, 100, 32)).astype(dtype) for _ in range(3))
    problem_codes = []
    planned = operands.kv_codes
    monkeypatch.setattr(operands, "kv_codes", lambda *a: problem_codes.append(planned(*a)) or problem_codes[-1])
    # 100 rows: four query tiles (32, 32, 32 and 4 rows), every one's values converted, or every one's in registers
    with tuned(forward=(32, 48), converted_value_rows=1 if values == "converted" else 33):
        tiled = npattn.attention(q, k, v, causal=True, return_lse=True)
        pairs = dtype == "bfloat16" and simd.BF16_DOT and current().pair_products
        assert problem_codes == [KvCodes.NONE if pairs else KvCodes(
            KvCodes.FLOAT16 if dtype == "float16" else KvCodes.BFLOAT16)]
        monkeypatch.setattr(operands, "kv_codes", lambda *a: KvCodes.NONE)
        monkeypatch.setattr(operands, "_PLANS", type(operands._PLANS)())  # plans made afresh, by the copy
        monkeypatch.setattr(driver, "_FORWARD_PLANS", type(driver._FORWARD_PLANS)())
        copied = npattn.attention(q, k, v, causal=True, return_lse=True)
    for mine, theirs in zip(tiled, copied):
        np.testing.assert_array_equal(mine, theirs)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", ["prefill", "gqa bshd", "decode interleaved", "split keys", "off boundary"])
def test_16_bit_queries_read_as_they_lie_give_the_bits_of_a_widened_copy(dtype, case, monkeypatch):
    """Where k and v are read a 16-bit tile at a time, q is too: each work item converts its
    rows (every head of a decode item's, npattn.cpu.tiles.convert_query_rows) from q's own
    memory, and (one key range) sums its out rows in float32 scratch and writes them
    rounded into a 16-bit out (npattn.cpu.tiles.narrow_row): the bits q widened to a
    float32 copy and a float32 out narrowed afterwards gave, in every layout the forward
    takes; a q 2 bytes off a 4-byte boundary is read from an aligned copy, the same bits.
    (A bfloat16 prefill that multiplies in bfloat16 reads q as pairs instead: not here.)"""
    import ml_dtypes  # noqa: F401  (registers bfloat16)
    from npattn.core.kernel_params import Int, KvCodes
    from npattn.cpu import driver, operands
    from npattn.cpu.tuning import tuned

    rng = np.random.default_rng(5)
    normal = lambda *shape: rng.normal(size=shape).astype(dtype)  # noqa: E731
    options, tiles = dict(return_lse=True), (32, 48)
    if case == "prefill":  # four query tiles, causal
        q, k, v = normal(1, 2, 100, 32), normal(1, 2, 100, 32), normal(1, 2, 100, 32)
        options.update(causal=True)
    elif case == "gqa bshd":  # query heads of a group folded into rows
        q, k, v = normal(2, 70, 6, 32), normal(2, 90, 2, 32), normal(2, 90, 2, 32)
        options.update(layout="bshd")
    elif case == "decode interleaved":  # one item of every head, key rows holding every head
        q, k, v = normal(2, 1, 4, 64), normal(2, 300, 4, 64), normal(2, 300, 4, 64)
        options.update(layout="bshd")
    elif case == "split keys":  # a short query's keys cut into ranges, an item each
        q, k, v = normal(1, 2, 1, 32), normal(1, 3000, 1, 32), normal(1, 3000, 1, 32)
        options.update(layout="bshd")
    else:
        q, k, v = normal(1, 2, 40, 32), normal(1, 2, 40, 32), normal(1, 2, 40, 32)
        flat = np.empty(q.size + 2, q.dtype)
        start = 1 if flat.__array_interface__["data"][0] % 4 == 0 else 0
        q_off = flat[start:start + q.size].reshape(q.shape)
        q_off[...] = q
        q = q_off
    read, parameters = [], []
    planned, planned_parameters = operands.query_codes, operands._parameters
    monkeypatch.setattr(operands, "query_codes", lambda *a: read.append(planned(*a)) or read[-1])
    monkeypatch.setattr(operands, "_parameters",
                        lambda *a, **k: parameters.append(planned_parameters(*a, **k)) or parameters[-1])

    def fresh_plans():
        monkeypatch.setattr(operands, "_PLANS", type(operands._PLANS)())
        monkeypatch.setattr(driver, "_FORWARD_PLANS", type(driver._FORWARD_PLANS)())

    codes = KvCodes.FLOAT16 if dtype == "float16" else KvCodes.BFLOAT16
    with tuned(forward=tiles, bf16_products=False):  # (bfloat16 prefills: not as pairs)
        fresh_plans()
        in_place = npattn.attention(q, k, v, **options)
        assert read == [codes]
        # out in its own dtype but where a short query's keys are cut into ranges
        assert parameters[-1][0][Int.OUT_CODES] == (KvCodes.NONE if case == "split keys" else codes)
        monkeypatch.setattr(operands, "query_codes", lambda *a: KvCodes.NONE)
        fresh_plans()  # made again, widening q and narrowing a float32 out
        widened = npattn.attention(q, k, v, **options)
        assert parameters[-1][0][Int.OUT_CODES] == KvCodes.NONE
    for mine, theirs in zip(in_place, widened):
        np.testing.assert_array_equal(mine, theirs)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [36, 40])
@pytest.mark.parametrize("case", ["prefill", "gqa bshd weights", "decode interleaved", "decode paged"])
def test_16_bit_head_dims_off_whole_vectors_read_by_tiles_give_the_bits_of_copies(dtype, head_dim, case,
                                                                                 monkeypatch):
    """A forward whose head dim is even but not whole vectors (36: on either ISA; 40: with
    AVX-512's 16 lanes) reads 16-bit q, k and v a tile at a time too, and writes out in its
    own dtype: each key tile's rows converted into float32 rows, their last vector read and
    written masked (npattn.cpu.tiles.whole_vector_rows), as a quantized cache's are
    dequantized; the bits of float32 copies of q, k and v and of a float32 out narrowed
    afterwards, prefills, GQA rows, the weights and decode steps (contiguous and paged)."""
    import ml_dtypes  # noqa: F401  (registers bfloat16)
    from npattn.core.kernel_params import KvCodes
    from npattn.cpu import driver, operands
    from npattn.cpu.tuning import tuned

    rng = np.random.default_rng(12)
    normal = lambda *shape: rng.normal(size=shape).astype(dtype)  # noqa: E731
    if case == "prefill":  # four query tiles, causal
        call = partial(npattn.attention, normal(1, 2, 100, head_dim), normal(1, 2, 100, head_dim),
                       normal(1, 2, 100, head_dim), causal=True, return_lse=True)
    elif case == "gqa bshd weights":  # query heads of a group folded into rows, and the weights kernel
        call = partial(npattn.attention, normal(2, 70, 6, head_dim), normal(2, 90, 2, head_dim),
                       normal(2, 90, 2, head_dim), layout="bshd", causal=True, return_weights=True)
    elif case == "decode interleaved":  # key rows holding every head, ALiBi spreading the weights
        call = partial(npattn.attention_with_kvcache, normal(2, 1, 4, head_dim), normal(2, 300, 4, head_dim),
                       normal(2, 300, 4, head_dim), cache_seqlens=np.array([300, 171]),
                       alibi_slopes=np.full(4, 0.01), return_lse=True)
    else:
        call = partial(npattn.attention_with_kvcache, normal(2, 1, 4, head_dim), normal(12, 16, 2, head_dim),
                       normal(12, 16, 2, head_dim), block_table=rng.permutation(12)[:10].reshape(2, 5),
                       cache_seqlens=np.array([77, 21]), causal=True, return_lse=True)
    planned, read = operands.kv_codes, []
    monkeypatch.setattr(operands, "kv_codes", lambda *a: read.append(planned(*a)) or read[-1])
    codes = KvCodes.FLOAT16 if dtype == "float16" else KvCodes.BFLOAT16
    with tuned(forward=(32, 48), bf16_products=False):  # (bfloat16: not as pairs)
        tiled = call()
        assert read and set(read) == {codes}
        monkeypatch.setattr(operands, "kv_codes", lambda *a: KvCodes.NONE)
        monkeypatch.setattr(operands, "_PLANS", type(operands._PLANS)())  # plans made afresh, by the copies
        monkeypatch.setattr(driver, "_FORWARD_PLANS", type(driver._FORWARD_PLANS)())
        copied = call()
    for mine, theirs in zip(tiled, copied):
        assert mine.dtype == theirs.dtype
        np.testing.assert_array_equal(mine, theirs)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [36, 40])
@pytest.mark.parametrize("case", ["causal", "gqa dropout", "bias gradient"])
def test_16_bit_backward_of_head_dims_off_whole_vectors_reads_tiles_with_the_bits_of_copies(dtype, head_dim, case,
                                                                                          monkeypatch):
    """A backward whose head dim is even but not whole vectors reads 16-bit q, k, v and dout
    a tile at a time too (each key tile's rows converted into float32 rows, their last
    vector masked, which its BLAS products read; q's and dout's rows where a tile uses
    them): out and every gradient, the bias's included, have the bits of float32 copies."""
    import ml_dtypes  # noqa: F401  (registers bfloat16)
    from npattn.core.kernel_params import KvCodes
    from npattn.cpu import driver, operands

    rng = np.random.default_rng(13)
    normal = lambda *shape: rng.normal(size=shape).astype(dtype)  # noqa: E731
    heads, kv_heads = (6, 2) if case == "gqa dropout" else (4, 4)
    q, dout = normal(2, heads, 70, head_dim), normal(2, heads, 70, head_dim)
    k, v = normal(2, kv_heads, 90, head_dim), normal(2, kv_heads, 90, head_dim)
    options = {"causal": {"causal": True}, "gqa dropout": {"dropout_p": 0.2, "seed": 5, "causal": True},
               "bias gradient": {"bias": rng.normal(size=(1, heads, 70, 90)).astype(np.float32)}}[case]

    def gradients():
        monkeypatch.setattr(operands, "_PLANS", type(operands._PLANS)())  # plans made afresh
        monkeypatch.setattr(driver, "_FORWARD_PLANS", type(driver._FORWARD_PLANS)())
        plans.clear()
        out, vjp = npattn.attention_vjp(q, k, v, backend="cpu", **options)
        return (out, *vjp(dout))
    planned, read = operands.kv_codes, []
    monkeypatch.setattr(operands, "kv_codes", lambda *a: read.append((a[1], planned(*a))) or read[-1][1])
    tiled = gradients()
    codes = KvCodes.FLOAT16 if dtype == "float16" else KvCodes.BFLOAT16
    assert ("backward", codes) in read
    monkeypatch.setattr(operands, "kv_codes", lambda *a: KvCodes.NONE)
    copied = gradients()
    for name, mine, theirs in zip(("out", "dq", "dk", "dv", "dbias"), tiled, copied):
        assert mine.dtype == theirs.dtype, name
        np.testing.assert_array_equal(mine, theirs, err_msg=name)


def test_a_16_bit_forward_of_an_odd_head_dim_reads_copies():
    """An odd head dim's rows are not whole float32 words of q and out: its 16-bit forward
    and backward convert copies (kv_codes NONE), as before; an even one reads tiles."""
    from npattn.core.kernel_params import KvCodes
    from npattn.cpu import operands
    from npattn.cpu.tuning import current
    from npattn.core.validation import build_problem

    q = np.ones((1, 2, 8, 33), np.float16)
    assert operands.kv_codes(build_problem(q, q, q), "forward", current()) == KvCodes.NONE
    even = np.ones((1, 2, 8, 34), np.float16)
    assert operands.kv_codes(build_problem(even, even, even), "forward", current()) == KvCodes.FLOAT16
    assert operands.kv_codes(build_problem(even, even, even), "backward", current()) == KvCodes.FLOAT16


@pytest.fixture
def float32_products():
    """bfloat16 computed in float32, not on AVX512_BF16's pairs (npattn.cpu.pair_gradients,
    tests/test_cpu_bf16.py), where the CPU has them."""
    with npattn.cpu.bfloat16_products(False):
        yield


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", ["causal gqa", "dropout bshd window", "softcap"])
def test_a_16_bit_backward_reading_its_arrays_by_tiles_gives_the_bits_of_widened_copies(dtype, case, monkeypatch,
                                                                                       float32_products):
    """The backward converts each key tile of 16-bit k and v once per work item (KV_CODES:
    packed for the products, its rows for dQ and for the gradient of a row's dominant key,
    which every causal row 0 has) and each (head, query tile)'s q and dout rows where a key
    tile uses them (Q_CODES; a float32 dout is read as it is), and gives the gradients
    float32 copies gave, bit for bit; with a bias gradient to compute it reads the tiles too.
    (bfloat16 computed in float32: on AVX512_BF16's pairs the backward reads its arrays as
    they lie, with no tiles converted.)"""
    import ml_dtypes  # noqa: F401  (registers bfloat16)
    from npattn.core.kernel_params import Int, KvCodes
    from npattn.cpu import driver, operands

    rng = np.random.default_rng(8)
    normal = lambda *shape: rng.normal(size=shape).astype(dtype)  # noqa: E731
    if case == "causal gqa":
        q, k, v, dout = normal(2, 6, 150, 32), normal(2, 2, 150, 32), normal(2, 2, 150, 32), normal(2, 6, 150, 32)
        options = dict(causal=True)
    elif case == "dropout bshd window":
        q, k, v, dout = normal(1, 130, 2, 64), normal(1, 210, 2, 64), normal(1, 210, 2, 64), normal(1, 130, 2, 64)
        options = dict(layout="bshd", window=(40, 10), dropout_p=0.25, seed=4)
    else:
        q, k, v, dout = normal(1, 2, 100, 32), normal(1, 2, 100, 32), normal(1, 2, 100, 32), normal(1, 2, 100, 32)
        options = dict(causal=True, softcap=3.0)
        dout = dout.astype(np.float32)  # (a cotangent of another dtype than q's)
    codes = KvCodes.FLOAT16 if dtype == "float16" else KvCodes.BFLOAT16
    parameters, planned = [], operands._parameters
    monkeypatch.setattr(operands, "_parameters",
                        lambda *a, **k: parameters.append((a[1], planned(*a, **k))) or parameters[-1][1])

    def gradients():
        monkeypatch.setattr(operands, "_PLANS", type(operands._PLANS)())
        monkeypatch.setattr(driver, "_FORWARD_PLANS", type(driver._FORWARD_PLANS)())
        monkeypatch.setattr(driver, "_BACKWARD_PLANS", type(driver._BACKWARD_PLANS)())
        _, vjp = npattn.attention_vjp(q, k, v, backend="cpu", **options)
        return vjp(dout)

    tiled = gradients()
    assert [(ints[Int.KV_CODES], ints[Int.Q_CODES]) for kind, (ints, _) in parameters if kind == "backward"] == [
        (codes, codes)]
    kv_codes = operands.kv_codes
    monkeypatch.setattr(operands, "kv_codes", lambda problem, kind, tuning: (
        KvCodes.NONE if kind == "backward" else kv_codes(problem, kind, tuning)))
    copied = gradients()
    for mine, theirs in zip(tiled, copied):
        np.testing.assert_array_equal(mine.view(np.uint16), theirs.view(np.uint16))
    monkeypatch.undo()
    bias = np.zeros((1, 1, q.shape[-2], k.shape[-2]), np.float32)
    if options.get("layout") != "bshd":
        parameters.clear()
        monkeypatch.setattr(operands, "_parameters",
                            lambda *a, **k: parameters.append((a[1], planned(*a, **k))) or parameters[-1][1])
        monkeypatch.setattr(operands, "_PLANS", type(operands._PLANS)())
        monkeypatch.setattr(driver, "_BACKWARD_PLANS", type(driver._BACKWARD_PLANS)())
        _, vjp = npattn.attention_vjp(q, k, v, backend="cpu", bias=bias.astype(dtype), **options)
        vjp(dout)
        assert [ints[Int.KV_CODES] for kind, (ints, _) in parameters if kind == "backward"] == [codes]


@given(lengths=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 6)), min_size=1, max_size=3),
       kind=st.sampled_from(["int8", "float8_e4m3"]), gqa=st.booleans(), seed=st.integers(0, 2**31))
@pytest.mark.parametrize("backend", NUMPY_BACKENDS)
def test_a_paged_varlen_call_reads_quantized_pools(backend, lengths, kind, gqa, seed):
    check_paged_varlen_quantized(backend, lengths, kind, gqa, seed)


def check_paged_varlen_quantized(backend, lengths, kind, gqa, seed, dtype=np.float32):
    """attention_varlen with block_table on int8 or e4m3 pools (k_scale, v_scale): each
    sequence's rows are the float64 attention over its keys dequantized, within float32's
    bound, with queries bottom-right among the keys as for float pools."""
    rng = np.random.default_rng(seed)
    page_size, kv_heads = 4, 2
    heads = 2 * kv_heads if gqa else kv_heads
    lengths = [(new, new + cached) for new, cached in lengths]  # queries, and the keys they sit among
    pages_each = max(1, max(-(-keys // page_size) for _, keys in lengths))
    pool_pages = pages_each * len(lengths) + 1
    (k_codes, k_scale), (v_codes, v_scale) = (
        npattn.quantize_kv(rng.standard_normal((pool_pages, page_size, kv_heads, HEAD_DIM)).astype(np.float32), kind)
        for _ in range(2))
    table = rng.permutation(pool_pages)[:pages_each * len(lengths)].reshape(len(lengths), pages_each)
    cu = np.concatenate([[0], np.cumsum([new for new, _ in lengths])])
    used = np.array([keys for _, keys in lengths])
    q = rng.standard_normal((int(cu[-1]), heads, HEAD_DIM)).astype(dtype)
    out = npattn.attention_varlen(q, k_codes, v_codes, cu, seqused_k=used, block_table=table, k_scale=k_scale,
                                  v_scale=v_scale, causal=True, backend=backend)
    for b, (new, keys) in enumerate(lengths):
        if not new:
            continue
        slots = [(table[b, t // page_size], t % page_size) for t in range(keys)]
        gathered = [npattn.dequantize_kv(np.array([codes[s] for s in slots]).reshape(keys, kv_heads, HEAD_DIM),
                                         np.array([scales[s] for s in slots], np.float32).reshape(keys, kv_heads),
                                         np.float64)[None]
                    for codes, scales in ((k_codes, k_scale), (v_codes, v_scale))]
        rows = q[None, int(cu[b]):int(cu[b + 1])]
        expected = npattn.attention(rows.astype(np.float64), *gathered, layout="bshd", causal=True, backend="reference")
        assert_out(out[None, int(cu[b]):int(cu[b + 1])], expected, call_case(rows, *gathered))


def test_a_paged_varlen_calls_scales_are_checked():
    codes, scales = npattn.quantize_kv(np.ones((2, 4, 1, HEAD_DIM), np.float32))
    q, cu, used, table = np.zeros((1, 1, HEAD_DIM), np.float32), np.array([0, 1]), np.array([3]), np.array([[1]])
    call = lambda **given: npattn.attention_varlen(q, codes, codes, cu, seqused_k=used, block_table=table,  # noqa: E731
                                                   **given)
    with pytest.raises(ValueError, match="k_scale and v_scale must be given together"):
        call(k_scale=scales)
    with pytest.raises(TypeError, match="k_cache holds int8 codes: pass k_scale and v_scale"):
        call()
    with pytest.raises(ValueError, match=r"v_scale must have v_cache's shape without its last axis"):
        call(k_scale=scales, v_scale=scales[:1])
    with pytest.raises(TypeError, match="k_scale and v_scale come with block_table"):
        npattn.attention_varlen(q, q, q, cu, cu, k_scale=scales, v_scale=scales)
