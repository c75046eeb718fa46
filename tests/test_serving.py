"""The serving calls against the dense reference on the unpacked, masked problem:
packed variable-length batches (attention_varlen), decoding against contiguous and paged
KV caches (attention_with_kvcache), left padding (q_start / kv_start) and the causal
alignments, forward and backward, with hypothesis drawing the lengths (zeros included)
and the page layouts."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, strategies as st

import npattn
from npattn.serving.kvcache import apply_rotary
from conftest import NUMPY_BACKENDS
from strategies import Case, Dims, packed_batches
import tolerances

DTYPES = ("float64", "float32")


def call_case(q, k, v, options=None, layout="bshd"):
    """The attention call ``(q, k, v, **options)`` as a :class:`strategies.Case` (bhsd), for
    the shared tolerance bounds (tests/tolerances.py)."""
    q, k, v = (np.asarray(x).transpose(0, 2, 1, 3) if layout == "bshd" else np.asarray(x) for x in (q, k, v))
    dims = Dims(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3])
    return Case(dims, q, k, v, dict(options or {}))


def assert_out(actual, expected, case, what="out"):
    """An output within the bound of ``case``'s out (tolerances.output_bound_terms)."""
    tolerances.assert_close(actual, expected, case.dtype, *tolerances.output_bound_terms(case), what)


def assert_lse(actual, expected, case):
    """An lse within the bound the backends' equivalence tests hold lse to."""
    expected = np.asarray(expected, np.float64)
    magnitude = 1 + tolerances.score_magnitude(case) + np.abs(expected[np.isfinite(expected)]).max(initial=0)
    tolerances.assert_close(actual, expected, case.dtype, case.dims.kv_len + case.dims.head_dim, magnitude, "lse")


def assert_gradient(actual, expected, case, dout, what):
    """A gradient within the bound of ``case``'s gradients for ``dout`` (in case's layout)."""
    dout = np.asarray(dout)
    tolerances.assert_close(actual, expected, case.dtype, *tolerances.gradient_bound_terms(case, dout), what)


def _normal(rng, shape, dtype):
    return rng.normal(size=shape).astype(dtype)


def _padded(packed, starts, width):
    """Packed (T, H, X) rows as a zero-padded (B, width, H, X) batch."""
    batch = len(starts) - 1
    padded = np.zeros((batch, width) + packed.shape[1:], packed.dtype)
    for b in range(batch):
        padded[b, :starts[b + 1] - starts[b]] = packed[starts[b]:starts[b + 1]]
    return padded


@pytest.mark.parametrize("backend", NUMPY_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@given(case=packed_batches(), seed=st.integers(0, 2**32 - 1))
def test_varlen_equals_the_padded_reference_forward_and_backward(backend, dtype, case, seed):
    check_varlen(backend, dtype, case, seed)


def check_varlen(backend, dtype, case, seed):
    """attention_varlen(_vjp) on ``backend`` equals the reference on the padded batch, each
    sequence aligned at its own bottom-right corner, forward and backward."""
    lengths_q, lengths_k, heads, kv_heads, head_dim, value_dim, options = case
    rng = np.random.default_rng(seed)
    cu_q, cu_k = np.r_[0, np.cumsum(lengths_q)], np.r_[0, np.cumsum(lengths_k)]
    q = _normal(rng, (cu_q[-1], heads, head_dim), dtype)
    k = _normal(rng, (cu_k[-1], kv_heads, head_dim), dtype)
    v = _normal(rng, (cu_k[-1], kv_heads, value_dim), dtype)
    options = {name: (rng.uniform(0.1, 1.0, value) if name == "alibi_slopes" else
                      rng.normal(size=value) if name == "sink_logits" else value) for name, value in options.items()}
    (out, lse), vjp = npattn.attention_varlen_vjp(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                   return_lse=True, backend=backend, **options)
    dout = _normal(rng, out.shape, dtype)
    grads = vjp(dout)

    # the unpacked problem: padded rows and keys hidden by lengths, each sequence aligned
    # at its own bottom-right corner (q_offset = Lk - Lq) unless top-left
    lengths_q, lengths_k = np.array(lengths_q), np.array(lengths_k)
    width_q, width_k = max(1, lengths_q.max()), max(1, lengths_k.max())
    dense = dict(options)
    if dense.get("alibi_slopes") is not None and dense["alibi_slopes"].ndim == 1:
        dense["alibi_slopes"] = np.broadcast_to(dense["alibi_slopes"], (len(lengths_q), heads))
    if dense.get("causal") == "top_left":
        dense["causal"] = True
        dense["q_offset"] = np.zeros(len(lengths_q), np.int64)
    else:
        dense["q_offset"] = lengths_k - lengths_q
    (expected, expected_lse), expected_vjp = npattn.attention_vjp(
        _padded(q, cu_q, width_q), _padded(k, cu_k, width_k), _padded(v, cu_k, width_k), layout="bshd",
        q_lengths=lengths_q, kv_lengths=lengths_k, return_lse=True, backend="reference", **dense)
    padded_dout = _padded(dout, cu_q, width_q)
    expected_grads = expected_vjp(padded_dout)
    case = call_case(_padded(q, cu_q, width_q), _padded(k, cu_k, width_k), _padded(v, cu_k, width_k), dense)
    for b in range(len(lengths_q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        assert_out(out[rows], expected[b, :lengths_q[b]], case)
        assert_lse(lse[:, rows], expected_lse[b, :, :lengths_q[b]], case)
        for name, grad, packed_rows, length in (("dq", 0, rows, lengths_q[b]), ("dk", 1, keys, lengths_k[b]),
                                                 ("dv", 2, keys, lengths_k[b])):
            assert_gradient(grads[grad][packed_rows], expected_grads[grad][b, :length], case, padded_dout, name)
    if "sink_logits" in options:
        assert_gradient(grads[3], expected_grads[3], case, padded_dout, "dsink_logits")


def draw_positional_options(draw, max_window, kv_lengths=False):
    """Some of causal, a window up to ``max_window``, ALiBi (True: the test draws slopes)
    and, when asked, kv_lengths (True: likewise)."""
    drawers = {"causal": st.just(True), "window": st.integers(0, max_window), "alibi_slopes": st.just(True)}
    if kv_lengths:
        drawers["kv_lengths"] = st.just(True)
    return {name: draw(strategy) for name, strategy in drawers.items() if draw(st.booleans())}


@st.composite
def paged_cases(draw):
    """(batch, heads, kv_heads, q_len, page_size, pages per entry, pool pages, D, options)."""
    kv_heads = draw(st.integers(1, 2))
    options = draw_positional_options(draw, max_window=9, kv_lengths=True)
    batch, per_entry = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    return (batch, kv_heads * draw(st.integers(1, 3)), kv_heads, draw(st.integers(1, 5)),
            draw(st.sampled_from([1, 2, 3, 8, 16, 40])), per_entry, batch * per_entry + draw(st.integers(0, 3)),
            draw(st.sampled_from([4, 8, 16])), options)


def check_paged_forward(backend, case, seed, dtype):
    """attention with ``block_table`` on pools of pages equals it on each entry's pages
    gathered into (B, Sk, Hkv, D) keys and values (the reference)."""
    batch, heads, kv_heads, q_len, page_size, per_entry, pool, head_dim, options = case
    rng = np.random.default_rng(seed)
    q = _normal(rng, (batch, q_len, heads, head_dim), dtype)
    k_pool = _normal(rng, (pool, page_size, kv_heads, head_dim), dtype)
    v_pool = _normal(rng, (pool, page_size, kv_heads, head_dim), dtype)
    table = rng.permutation(pool)[:batch * per_entry].reshape(batch, per_entry)
    kv_len = per_entry * page_size
    options = dict(options)
    if options.pop("kv_lengths", None):
        options["kv_lengths"] = rng.integers(0, kv_len + 1, batch)
    if options.pop("alibi_slopes", None):
        options["alibi_slopes"] = rng.uniform(0.1, 1.0, heads)
    out, lse = npattn.attention(q, k_pool, v_pool, block_table=table, layout="bshd", return_lse=True,
                                backend=backend, **options)
    keys = k_pool[table].reshape(batch, kv_len, kv_heads, head_dim)
    values = v_pool[table].reshape(batch, kv_len, kv_heads, head_dim)
    expected, expected_lse = npattn.attention(q, keys, values, layout="bshd", return_lse=True, backend="reference",
                                              **options)
    case = call_case(q, keys, values, options)
    assert_out(out, expected, case)
    assert_lse(lse, expected_lse, case)


@pytest.mark.parametrize("backend", NUMPY_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@given(case=paged_cases(), seed=st.integers(0, 2**32 - 1))
def test_paged_keys_equal_their_gathered_copy(backend, dtype, case, seed):
    check_paged_forward(backend, case, seed, dtype)


@st.composite
def cache_cases(draw):
    batch = draw(st.integers(1, 3))
    new = draw(st.integers(0, 3))
    queries = draw(st.integers(1, 3))
    cached = draw(st.lists(st.integers(0, 7), min_size=batch, max_size=batch))
    page_size = draw(st.sampled_from([None, 1, 2, 4]))
    options = draw_positional_options(draw, max_window=3)
    rotary = draw(st.sampled_from([None, False, True]))  # None: no rotary; else interleaved or not
    slots = draw(st.booleans())  # contiguous cache rows picked by cache_batch_idx
    return batch, new, queries, cached, page_size, options, rotary, slots


@pytest.mark.parametrize("backend", NUMPY_BACKENDS)
@given(case=cache_cases(), seed=st.integers(0, 2**32 - 1))
def test_kvcache_appends_in_place_and_equals_the_reference(backend, case, seed):
    check_kvcache(backend, case, seed)


def check_kvcache(backend, case, seed):
    """attention_with_kvcache on ``backend``: the caches hold what each sequence appended,
    at its own length, and the outputs are the reference's on each sequence alone."""
    batch, new, queries, cached, page_size, options, rotary, slots = case
    rng = np.random.default_rng(seed)
    heads, kv_heads, head_dim, capacity = 4, 2, 6, 12
    cached = np.array(cached)
    q = rng.normal(size=(batch, queries, heads, head_dim))
    k_new = rng.normal(size=(batch, new, kv_heads, head_dim)) if new else None
    v_new = rng.normal(size=(batch, new, kv_heads, head_dim)) if new else None
    # every sequence's keys as one contiguous (capacity) row: what the cache should hold
    logical_k = rng.normal(size=(batch, capacity, kv_heads, head_dim))
    logical_v = rng.normal(size=(batch, capacity, kv_heads, head_dim))
    if options.pop("alibi_slopes", None):
        options["alibi_slopes"] = rng.uniform(0.1, 1.0, heads)
    call = {}
    if page_size is None:
        rows = rng.permutation(batch + 2)[:batch] if slots else np.arange(batch)
        k_cache = rng.normal(size=(batch + 2 if slots else batch, capacity, kv_heads, head_dim))
        v_cache = rng.normal(size=k_cache.shape)
        k_cache[rows], v_cache[rows] = logical_k, logical_v
        if slots:
            call["cache_batch_idx"] = rows

        def read(cache):
            return cache[rows]
    else:
        pages_per_sequence = capacity // page_size
        table = rng.permutation(batch * pages_per_sequence + 3)[:batch * pages_per_sequence]
        table = table.reshape(batch, pages_per_sequence)
        k_cache = rng.normal(size=(batch * pages_per_sequence + 3, page_size, kv_heads, head_dim))
        v_cache = rng.normal(size=k_cache.shape)
        k_cache[table] = logical_k.reshape(batch, pages_per_sequence, page_size, kv_heads, head_dim)
        v_cache[table] = logical_v.reshape(batch, pages_per_sequence, page_size, kv_heads, head_dim)
        call["block_table"] = table

        def read(cache):
            return cache[table].reshape(batch, capacity, kv_heads, head_dim)
    if rotary is not None:
        angles = np.arange(capacity)[:, None] * rng.uniform(0.01, 1.0, 2)[None, :]
        call.update(rotary_cos=np.cos(angles), rotary_sin=np.sin(angles), rotary_interleaved=rotary)
    untouched = k_cache.copy(), v_cache.copy()
    inputs = [None if x is None else x.copy() for x in (q, k_new, v_new)]
    first_query = cached + new - queries  # bottom-right within each sequence's keys
    if rotary is not None and (first_query < 0).any():  # a query before position 0 has no rotation
        with pytest.raises(ValueError, match="rotary_cos and rotary_sin rotate each query by its position, which must be >= 0"):
            npattn.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cached, backend=backend,
                                          **call, **options)
        np.testing.assert_array_equal(k_cache, untouched[0])
        return

    out, lse = npattn.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cached,
                                             return_lse=True, backend=backend, **call, **options)

    for before, after in zip(inputs, (q, k_new, v_new)):
        assert before is None or np.array_equal(before, after)  # q, k, v are never modified
    q_rotated, k_rotated = q, k_new
    if rotary is not None:
        q_rotated = apply_rotary(q, first_query, call["rotary_cos"], call["rotary_sin"], rotary)
        k_rotated = None if k_new is None else apply_rotary(k_new, cached, call["rotary_cos"], call["rotary_sin"],
                                                             rotary)
    expected_k, expected_v = logical_k.copy(), logical_v.copy()
    for b in range(batch):
        if new:
            expected_k[b, cached[b]:cached[b] + new] = k_rotated[b]
            expected_v[b, cached[b]:cached[b] + new] = v_new[b]
    np.testing.assert_array_equal(read(k_cache), expected_k)  # appended at each sequence's own length
    np.testing.assert_array_equal(read(v_cache), expected_v)
    if page_size is None and slots:  # the rows no sequence uses are untouched
        others = np.setdiff1d(np.arange(k_cache.shape[0]), call["cache_batch_idx"])
        np.testing.assert_array_equal(k_cache[others], untouched[0][others])
    elif page_size is not None:
        others = np.setdiff1d(np.arange(k_cache.shape[0]), call["block_table"])
        np.testing.assert_array_equal(k_cache[others], untouched[0][others])
    for b in range(batch):  # each sequence alone, its last query level with its last key
        keys = cached[b] + new
        expected, expected_lse = npattn.attention(
            q_rotated[b:b + 1], expected_k[b:b + 1, :keys], expected_v[b:b + 1, :keys], layout="bshd",
            return_lse=True, backend="reference", **options)
        case = call_case(q_rotated[b:b + 1], expected_k[b:b + 1, :keys], expected_v[b:b + 1, :keys], options)
        assert_out(out[b:b + 1], expected, case)
        assert_lse(lse[b:b + 1], expected_lse, case)


def test_kvcache_rotary_turns_scores_into_functions_of_the_distance():
    # a key rotated at position p and a query at p + 3 score as at positions 0 and 3
    rng = np.random.default_rng(1)
    angles = np.arange(16)[:, None] * np.array([0.3, 0.05])[None, :]
    cos, sin = np.cos(angles), np.sin(angles)
    x = rng.normal(size=(1, 1, 1, 4))
    y = rng.normal(size=(1, 1, 1, 4))
    for interleaved in (False, True):
        near = (apply_rotary(x, np.array([0]), cos, sin, interleaved) *
                apply_rotary(y, np.array([3]), cos, sin, interleaved)).sum()
        far = (apply_rotary(x, np.array([9]), cos, sin, interleaved) *
               apply_rotary(y, np.array([12]), cos, sin, interleaved)).sum()
        assert abs(near - far) < 1e-12


@pytest.mark.parametrize("backend", NUMPY_BACKENDS)
def test_causal_top_left_is_torchs_is_causal_and_differs_from_bottom_right(backend):
    rng = np.random.default_rng(2)
    q, k, v = rng.normal(size=(1, 2, 4, 3)), rng.normal(size=(1, 2, 8, 3)), rng.normal(size=(1, 2, 8, 3))
    top_left_mask = np.tril(np.ones((4, 8), bool))        # torch's is_causal: key j <= row i
    bottom_right_mask = np.tril(np.ones((4, 8), bool), 4)  # key j <= i + Sk - Sq
    case = call_case(q, k, v, layout="bhsd")
    for causal, mask in (("top_left", top_left_mask), ("bottom_right", bottom_right_mask), (True, bottom_right_mask)):
        assert_out(npattn.attention(q, k, v, causal=causal, backend=backend),
                   npattn.attention(q, k, v, mask=mask, backend="reference"), case)
    assert np.abs(npattn.attention(q, k, v, causal="top_left", backend=backend)
                  - npattn.attention(q, k, v, causal=True, backend=backend)).max() > 0.1


@pytest.mark.parametrize("backend", NUMPY_BACKENDS)
@given(seed=st.integers(0, 2**32 - 1), data=st.data())
def test_left_padding_equals_each_sequence_alone(backend, seed, data):
    rng = np.random.default_rng(seed)
    batch, q_len, kv_len = 2, 6, 8
    q_start = np.array(data.draw(st.lists(st.integers(0, q_len), min_size=batch, max_size=batch)))
    kv_start = np.array(data.draw(st.lists(st.integers(0, kv_len), min_size=batch, max_size=batch)))
    options = data.draw(st.sampled_from([{}, {"causal": True}, {"causal": "top_left"},
                                         {"causal": True, "window": 2, "sinks": 1},
                                         {"alibi_slopes": np.array([0.5, 0.25])}]))
    q, k, v = (rng.normal(size=(batch, 2, n, 4)) for n in (q_len, kv_len, kv_len))
    out, vjp = npattn.attention_vjp(q, k, v, q_start=q_start, kv_start=kv_start, backend=backend, **options)
    dout = rng.normal(size=out.shape)
    dq, dk, dv = vjp(dout)
    for b in range(batch):
        rows, keys = slice(q_start[b], None), slice(kv_start[b], None)
        alone, alone_vjp = npattn.attention_vjp(q[b:b + 1, :, rows], k[b:b + 1, :, keys], v[b:b + 1, :, keys],
                                                backend="reference", **options)
        alone_dq, alone_dk, alone_dv = alone_vjp(dout[b:b + 1, :, rows])
        case = call_case(q[b:b + 1, :, rows], k[b:b + 1, :, keys], v[b:b + 1, :, keys], options, layout="bhsd")
        assert_out(out[b:b + 1, :, rows], alone, case)
        for name, got, expected in (("dq", dq[b:b + 1, :, rows], alone_dq), ("dk", dk[b:b + 1, :, keys], alone_dk),
                                    ("dv", dv[b:b + 1, :, keys], alone_dv)):
            assert_gradient(got, expected, case, dout[b:b + 1, :, rows], name)
        # the padding outputs zeros and takes no gradient
        assert not out[b, :, :q_start[b]].any() and not dq[b, :, :q_start[b]].any()
        assert not dk[b, :, :kv_start[b]].any() and not dv[b, :, :kv_start[b]].any()


def test_serving_calls_reject_bad_input_by_name():
    q, kv = np.zeros((2, 1, 2, 4)), np.zeros((2, 5, 1, 4))
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] \+ 1 new keys = 6 exceeds the cache's 5"):
        npattn.attention_with_kvcache(q, kv, kv.copy(), np.zeros((2, 1, 1, 4)), np.zeros((2, 1, 1, 4)),
                                      cache_seqlens=np.array([0, 5]))
    with pytest.raises(TypeError, match="sets q_offset itself"):
        npattn.attention_with_kvcache(q, kv, kv, cache_seqlens=1, q_offset=0)
    with pytest.raises(ValueError, match="k_cache has 3 rows but q has batch 2"):
        npattn.attention_with_kvcache(q, np.zeros((3, 5, 1, 4)), np.zeros((3, 5, 1, 4)), cache_seqlens=1)
    with pytest.raises(ValueError, match=r"block_table must hold page indices in \[0, 4\)"):
        npattn.attention_with_kvcache(q, np.zeros((4, 2, 1, 4)), np.zeros((4, 2, 1, 4)), cache_seqlens=1,
                                      block_table=np.array([[4, 0], [1, 2]]))
    with pytest.raises(ValueError, match="k and v must be given together"):
        npattn.attention_with_kvcache(q, kv, kv, np.zeros((2, 1, 1, 4)), cache_seqlens=1)
    with pytest.raises(ValueError, match="rotary_cos has 3 positions"):
        npattn.attention_with_kvcache(q, kv, kv.copy(), np.zeros((2, 1, 1, 4)), np.zeros((2, 1, 1, 4)),
                                      cache_seqlens=3, rotary_cos=np.ones((3, 2)), rotary_sin=np.ones((3, 2)))
    packed = np.zeros((5, 1, 4))
    with pytest.raises(ValueError, match="cu_seqlens_q must run from 0 to Tq = 5"):
        npattn.attention_varlen(packed, packed, packed, [0, 2, 4], [0, 2, 5])
    with pytest.raises(ValueError, match="cu_seqlens_k must be nondecreasing"):
        npattn.attention_varlen(packed, packed, packed, [0, 2, 5], [0, 3, 2, 5])
    with pytest.raises(ValueError, match="max_seqlen_q = 2 is less than sequence 1's length 3"):
        npattn.attention_varlen(packed, packed, packed, [0, 2, 5], [0, 2, 5], max_seqlen_q=2)
    with pytest.raises(TypeError, match="attention_varlen does not take return_weights: its weights would be"):
        npattn.attention_varlen(packed, packed, packed, [0, 5], [0, 5], return_weights=True)
    with pytest.raises(ValueError, match='causal="top_left" already places each sequence'):
        npattn.attention_varlen(packed, packed, packed, [0, 5], [0, 5], causal="top_left", q_offset=1)
    with pytest.raises(TypeError, match="attention_varlen does not take mask"):
        npattn.attention_varlen(packed, packed, packed, [0, 5], [0, 5], mask=np.ones((5, 5), bool))
    with pytest.raises(ValueError, match='causal="top_left" already places the rows'):
        npattn.attention(q, q, q, causal="top_left", q_offset=1)
    with pytest.raises(ValueError, match='causal must be a bool, "bottom_right" or "top_left"'):
        npattn.attention(q, q, q, causal="top-left")
    with pytest.raises(ValueError, match=r"q_offset as an array must have shape \(B,\) = \(2,\)"):
        npattn.attention(q, q, q, q_offset=np.array([1, 2, 3]))
    with pytest.raises(ValueError, match=r"block_table must lie in \[0, 1\]"):
        npattn.attention(q, kv[:, :1], kv[:, :1], layout="bshd", block_table=np.array([[0, 2], [1, 1]]))
    with pytest.raises(TypeError, match="block_table .* is for the forward only"):
        npattn.attention_vjp(q, kv[:, :1], kv[:, :1], layout="bshd", block_table=np.array([[0], [1]]))
    with pytest.raises(ValueError, match=r"q_start must lie in \[0, Sq\] = \[0, 2\]"):
        npattn.attention(q, q, q, q_start=np.array([0, 3]))


def test_a_call_that_raises_leaves_the_cache_as_it_was():
    rng = np.random.default_rng(3)
    q, k, v = rng.normal(size=(2, 1, 2, 4)), rng.normal(size=(2, 1, 1, 4)), rng.normal(size=(2, 1, 1, 4))
    k_cache, v_cache = rng.normal(size=(2, 5, 1, 4)), rng.normal(size=(2, 5, 1, 4))
    before = k_cache.copy(), v_cache.copy()
    with pytest.raises(ValueError, match="window must be non-negative"):
        npattn.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=np.array([1, 2]), window=-1)
    np.testing.assert_array_equal(k_cache, before[0])
    np.testing.assert_array_equal(v_cache, before[1])


def assert_same_bytes(arrays, expected):
    """Each of ``arrays`` holds the bytes of its ``expected`` (NaN payloads and -0.0 included)."""
    for actual, wanted in zip(arrays, expected, strict=True):
        np.testing.assert_array_equal(actual.view(np.uint8), wanted.view(np.uint8))


def _random_bytes(rng, shape, dtype):
    """An array of ``dtype`` and ``shape`` whose bytes are random (NaN payloads included)."""
    return rng.integers(0, 256, size=(*shape, dtype.itemsize), dtype=np.uint8).view(dtype).reshape(shape)


def _aliased_rows(caches):
    """New k and v rows that are views of the key cache, over slots the step writes: the
    last sequence's k rows are the slots the first sequence writes (contiguous layout)."""
    return [caches[0][2::-1, 0:2], caches[0][0:3, 0:2]]


_SLOT_DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "float8_e4m3fn")
_SLOT_LAYOUTS = ("contiguous", "rows", "paged")
# every dtype and layout; aliased rows for a typed, a bits-viewed and a quantized cache;
# the vector copies (float caches) with and without aliasing (a case a distinct compile)
_SLOT_CASES = ([(dtype, layout, False, False) for dtype in _SLOT_DTYPES for layout in _SLOT_LAYOUTS]
               + [(dtype, layout, True, False) for dtype in ("float32", "bfloat16", "int8")
                  for layout in ("contiguous", "paged")]
               + [(dtype, layout, aliased, True) for dtype in ("float32", "float64") for layout in ("contiguous", "paged")
                  for aliased in (False, True)])


@pytest.mark.parametrize("dtype, layout, aliased, vectors", _SLOT_CASES)
def test_the_compiled_append_writes_numpys_bytes_and_puts_them_back(dtype, layout, aliased, vectors):
    """The CPU backend's append (npattn.cpu.slots) against NumPy's assignments, one cache
    after the other, byte for byte: dtypes Numba types as they are and those it copies as
    unsigned ints, k and v of different widths (``vectors``: whole vectors, which float
    caches copy a vector at a time), a quantized cache's scales (3-D) beside its codes,
    new rows that are views of the cache; then the old bytes put back."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from npattn.cpu.slots import SlotWriter
    from npattn.serving.kvcache import _slots

    dtype = np.dtype(getattr(ml_dtypes, dtype, None) or dtype)
    rng = np.random.default_rng(len(layout) + 2 * aliased)
    batch, new_len, kv_heads = 3, 2, 2
    widths = (16, 16 if aliased else 32) if vectors else (4, 4 if aliased else 6)
    seqlens, pages, rows, slots = np.array([0, 5, 3]), None, None, 8
    if layout == "paged":  # pages of 4, each sequence's pages a shuffle of the pool's
        pages, slots = rng.permutation(12)[:9].reshape(batch, 3), 4
    elif layout == "rows":
        rows = rng.permutation(5)[:batch]
    caches = [_random_bytes(rng, (12 if pages is not None else 5, slots, kv_heads, width), dtype) for width in widths]
    new = (_aliased_rows(caches) if aliased else
           [_random_bytes(rng, (batch, new_len, kv_heads, width), dtype) for width in widths])
    if dtype.itemsize == 1:  # a quantized cache: int8 or e4m3 codes, then float32 scales per row
        caches += [rng.uniform(0.5, 2.0, caches[0].shape[:3]).astype(np.float32) for _ in range(2)]
        new += [rng.uniform(0.5, 2.0, (batch, new_len, kv_heads)).astype(np.float32) for _ in range(2)]
    targets, positions = _slots(np, batch, new_len, seqlens, pages, rows, slots, views=False)
    before = [cache.copy() for cache in caches]
    expected = [cache.copy() for cache in caches]
    sources = _aliased_rows(expected) + new[2:] if aliased else new
    for cache, rows_in in zip(expected, sources):  # NumPy reads each source as the writes before left it
        cache[targets, positions] = rows_in
    writer = SlotWriter(caches, new, targets, positions)
    olds = writer.write(caches, new)
    assert_same_bytes(caches, expected)
    writer.restore(caches, new, olds)
    assert_same_bytes(caches, before)


def test_a_checked_append_writes_nothing_for_arrays_of_other_strides_or_alignment():
    """SlotWriter.write_checked compares each array's shape, strides and alignment with
    the plan's in its compiled call, before any write: None, and the caches untouched,
    where one differs; the write, as write's, where none does. Both before a call
    matched (the machine code typed for the odd array's layout) and after (the kept
    machine code, typed for the plan's arrays, given arrays of another layout)."""
    from npattn.cpu.slots import SlotWriter
    from npattn.serving.kvcache import _slots

    rng = np.random.default_rng(10)
    q = rng.normal(size=(2, 1, 4, 16)).astype(np.float32)
    caches = [rng.normal(size=(2, 8, 2, 16)).astype(np.float32) for _ in range(2)]
    new = [rng.normal(size=(2, 1, 2, 16)).astype(np.float32) for _ in range(2)]
    arrays = [q, *caches, *new]
    expected = np.array([(*array.shape, *array.strides) for array in arrays], np.int64)
    expected.setflags(write=False)
    targets, positions = _slots(np, 2, 1, np.array([3, 5]), None, None, 8, views=False)
    writer = SlotWriter(caches, new, targets, positions)
    odd = []  # each array in turn replaced by a spread and by an unaligned copy of it
    for index, array in enumerate(arrays):
        spread = np.zeros((*array.shape[:-1], 2 * array.shape[-1]), np.float32)[..., ::2]
        unaligned = np.frombuffer(bytearray(array.nbytes + 1), np.uint8)[1:].view(np.float32).reshape(array.shape)
        for other in (spread, unaligned):
            other[...] = array
            odd.append([*arrays[:index], other, *arrays[index + 1:]])
    before = [cache.copy() for cache in caches]
    # the first call (each odd structure would compile its own typed code: one here)
    assert writer.write_checked(*odd[2], expected) is None
    assert_same_bytes(caches, before)
    assert writer.write_checked(*arrays, expected) is not None
    for cache, old, rows in zip(caches, before, new):
        old[targets, positions] = rows
    assert_same_bytes(caches, before)
    for others in odd:  # the kept code compares them all
        assert writer.write_checked(*others, expected) is None
        assert_same_bytes(caches, before)


def test_a_compiled_append_that_fails_midway_puts_the_codes_back(monkeypatch):
    """A quantized cache's append writes its codes, then its scales: a failure at the
    scales (memory, say) gives the codes their old bytes back before it raises."""
    from npattn.cpu import slots
    from npattn.serving.kvcache import _slots

    rng = np.random.default_rng(9)
    codes, scales = npattn.quantize_kv(rng.normal(size=(2, 8, 2, 16)).astype(np.float32))
    caches = [codes, codes.copy(), scales, scales.copy()]
    new_codes, new_scales = npattn.quantize_kv(rng.normal(size=(2, 1, 2, 16)).astype(np.float32))
    new = (new_codes, new_codes.copy(), new_scales, new_scales.copy())
    targets, positions = _slots(np, 2, 1, np.array([3, 5]), None, None, 8, views=False)
    before = [cache.copy() for cache in caches]
    writer = slots.SlotWriter(caches, new, targets, positions)
    run = slots._run
    calls = []

    def failing(kernel, *arguments):
        calls.append(kernel)
        if len(calls) == 2:
            raise MemoryError("no memory for the scales")
        return run(kernel, *arguments)

    monkeypatch.setattr(slots, "_run", failing)
    with pytest.raises(MemoryError, match="no memory for the scales"):
        writer.write(caches, new)
    assert calls == [slots._write_plain, slots._write_plain]
    assert_same_bytes(caches, before)


@pytest.mark.parametrize("backend", NUMPY_BACKENDS)
def test_kvcache_attend_keeps_a_length_per_row(backend):
    from npattn.nn import KVCache

    rng = np.random.default_rng(4)
    cache = KVCache(3, 1, 4, capacity=8, dtype="float64")
    first = rng.normal(size=(3, 2, 2, 4)), rng.normal(size=(3, 2, 1, 4)), rng.normal(size=(3, 2, 1, 4))
    cache.attend(*first, causal=True, backend=backend)
    later = rng.normal(size=(2, 1, 2, 4)), rng.normal(size=(2, 1, 1, 4)), rng.normal(size=(2, 1, 1, 4))
    out = cache.attend(*later, rows=[2, 0], causal=True, backend=backend)  # rows 2 and 0 move on, row 1 waits
    assert cache.lengths.tolist() == [3, 2, 3] and cache.position == 3
    for index, row in enumerate((2, 0)):
        keys = np.concatenate([first[1][row], later[1][index]])[None]
        values = np.concatenate([first[2][row], later[2][index]])[None]
        expected = npattn.attention(later[0][index:index + 1], keys, values, causal=True, layout="bshd",
                                    backend="reference")
        assert_out(out[index:index + 1], expected, call_case(later[0][index:index + 1], keys, values))
    with pytest.raises(ValueError, match="rows hold different lengths"):
        cache.check(3, 1, 4, 1)
    cache.reset([0, 2])
    assert cache.lengths.tolist() == [0, 2, 0]


@pytest.mark.parametrize("backend", NUMPY_BACKENDS)
def test_paged_cache_takes_and_gives_back_pages(backend):
    from npattn.nn import PagedKVCache

    rng = np.random.default_rng(5)
    cache = PagedKVCache(num_pages=5, page_size=2, num_kv_heads=1, head_dim=4, dtype="float64")
    cache.add("a")
    cache.add("b")
    history = {"a": [], "b": []}
    for sequences, new in ((["a"], 3), (["a", "b"], 1), (["b"], 2)):
        q = rng.normal(size=(len(sequences), new, 2, 4))
        k, v = rng.normal(size=(len(sequences), new, 1, 4)), rng.normal(size=(len(sequences), new, 1, 4))
        out = cache.attend(sequences, q, k, v, causal=True, backend=backend)
        for row, name in enumerate(sequences):
            history[name].append((k[row], v[row]))
            keys = np.concatenate([x for x, _ in history[name]])[None]
            values = np.concatenate([y for _, y in history[name]])[None]
            expected = npattn.attention(q[row:row + 1], keys, values, causal=True, layout="bshd", backend="reference")
            assert_out(out[row:row + 1], expected, call_case(q[row:row + 1], keys, values))
    assert (cache.length("a"), cache.length("b"), cache.free_pages) == (4, 3, 1)
    with pytest.raises(MemoryError, match="2 more pages needed, 1 free"):
        cache.attend(["a"], *(rng.normal(size=(1, 3, n, 4)) for n in (2, 1, 1)))
    assert cache.length("a") == 4  # nothing written
    cache.free("a")
    assert cache.free_pages == 3 and cache.sequences == ("b",)
    with pytest.raises(KeyError, match="no sequence 'a'"):
        cache.length("a")


@pytest.mark.parametrize("backend", NUMPY_BACKENDS)
@pytest.mark.parametrize("settings", [dict(rotary="rope"), dict(rotary=None, window=3, sinks=1),
                                      dict(rotary="rope", sink_logits=True, num_kv_heads=1)],
                         ids=["rope", "window", "mqa-sinks"])
def test_modules_decode_in_place_without_grad_as_they_do_recording(backend, settings):
    # under no_grad a cached step goes through KVCache.attend (attention_with_kvcache),
    # recording through the concatenating path: the same answers, step by step
    from npattn import autograd as ag
    from npattn.nn import KVCache, MultiHeadAttention

    settings = dict(settings)
    kv_heads = settings.pop("num_kv_heads", 2)
    module = MultiHeadAttention(32, 4, num_kv_heads=kv_heads, causal=True, seed=0, dtype="float64", backend=backend,
                                **settings)
    x = np.random.default_rng(6).standard_normal((2, 9, 32))
    recorded, in_place = KVCache(2, kv_heads, 8, 9, dtype="float64"), KVCache(2, kv_heads, 8, 9, dtype="float64")
    calls, attend = [], in_place.attend
    in_place.attend = lambda *args, **options: calls.append(args) or attend(*args, **options)
    for start, stop in ((0, 4), (4, 5), (5, 9)):  # a prompt, then one token, then a chunk
        expected = module(x[:, start:stop], cache=recorded)
        assert expected.requires_grad
        with ag.no_grad():
            got = module(x[:, start:stop], cache=in_place)
        tolerances.assert_close(got.data, expected.data, "float64", *_module_bound_terms(module, x, stop))
    # the keys went through two rope codes: a rotation's two products apart, of |k|'s size
    tolerances.assert_close(in_place.keys, recorded.keys, "float64", 2, float(np.abs(recorded.keys).max()))
    assert in_place.lengths.tolist() == [9, 9] and in_place.position == 9 and len(calls) == 3


def _module_bound_terms(module, x, keys):
    """``(length, magnitude)`` of tolerances.bound for a MultiHeadAttention output on x
    (B, S, E) with ``keys`` positions attended: the projections' sums over E around the
    attention's over the keys and the head dim, of terms the size of the projected
    values times the output weights, amplified by the scores' rounding (as for out)."""
    embed = x.shape[-1]
    weights = {name: float(np.abs(value).max(initial=0)) for name, value in module.state_dict().items()}

    def projected(name):  # a bound on |x W^T + b| for projection ``name``
        return embed * weights[f"{name}.weight"] * float(np.abs(x).max()) + weights.get(f"{name}.bias", 0.0)
    head_dim = module.head_dim
    score = head_dim * projected("q_proj") * projected("k_proj") / np.sqrt(head_dim)
    magnitude = embed * weights["out_proj.weight"] * projected("v_proj") * (1 + score)
    return 2 * embed + keys + head_dim, magnitude


@pytest.mark.parametrize("products", ["vector", "blas"])
@given(case=paged_cases(), seed=st.integers(0, 2**32 - 1))
def test_paged_keys_on_both_cpu_product_paths(products, case, seed):
    # tiles of keys read page by page: the micro-kernels' packed and dot-product paths, and BLAS
    from npattn import backends, cpu

    if not backends()["cpu"]:
        pytest.skip("the cpu backend is not available here")
    with cpu.products(products):
        check_paged_forward("cpu", case, seed, "float32")


@pytest.mark.parametrize("backend", NUMPY_BACKENDS)
def test_varlen_non_finite_values_reach_only_the_rows_that_see_them(backend):
    # the fused CPU call falls back to the reference on its packed rows; a NaN in a key of
    # sequence 1 reaches sequence 1's rows that see it and no other sequence's
    rng = np.random.default_rng(7)
    cu = np.array([0, 3, 7, 9])
    q, k, v = (rng.normal(size=(9, 2, 4)) for _ in range(3))
    v[5, 0, 1] = np.nan
    (out, lse), vjp = npattn.attention_varlen_vjp(q, k, v, cu, cu, causal=True, return_lse=True, backend=backend)
    nan_rows = np.isnan(out).any(axis=(1, 2))
    assert nan_rows.tolist() == [False, False, False, False, False, True, True, False, False]
    expected = npattn.attention(q[None, 3:7], k[None, 3:7], v[None, 3:7], causal=True, layout="bshd",
                                backend="reference")
    np.testing.assert_array_equal(np.isnan(out[3:7]), np.isnan(expected[0]))
    assert np.isfinite(lse).all()
    dq, dk, dv = vjp(np.ones_like(out))
    assert np.isfinite(dq[:3]).all() and np.isfinite(dk[7:]).all()


@given(batch=st.integers(1, 3), q_len=st.integers(1, 4), extra=st.integers(0, 60), kv_heads=st.sampled_from([1, 2, 8]),
       new=st.integers(0, 2), options=st.sampled_from([{}, dict(causal=True), dict(causal=True, window=(5, 0)),
                                                       dict(alibi_slopes=np.linspace(0.1, 0.8, 8)),
                                                       dict(causal=True, sinks=2, window=(3, 0))]),
       seed=st.integers(0, 2**31))
def test_a_step_whose_sequences_hold_equal_keys_gives_the_bits_of_explicit_lengths(batch, q_len, extra, kv_heads, new,
                                                                                    options, seed):
    """A contiguous cache whose sequences all hold the same number of keys runs its attention
    without per-entry lengths and offsets (the default alignment says the same): the output
    is bit for bit the call with them, and the appended keys land where they belong."""
    rng = np.random.default_rng(seed)
    cached, heads, dim = q_len + extra, 8, 16
    q = rng.standard_normal((batch, q_len, heads, dim)).astype(np.float32)
    k_cache, v_cache = (rng.standard_normal((batch, cached + new + 3, kv_heads, dim)).astype(np.float32)
                        for _ in range(2))
    k, v = ((rng.standard_normal((batch, new, kv_heads, dim)).astype(np.float32) for _ in range(2)) if new
            else (None, None))
    expected_k, expected_v = k_cache.copy(), v_cache.copy()
    if new:
        expected_k[:, cached:cached + new], expected_v[:, cached:cached + new] = k, v
    keys = cached + new
    expected = npattn.attention(q, expected_k[:, :keys], expected_v[:, :keys], layout="bshd",
                                q_offset=np.full(batch, keys - q_len), kv_lengths=np.full(batch, keys), **options)
    out = npattn.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cached, **options)
    assert np.array_equal(out, expected)
    assert np.array_equal(k_cache, expected_k) and np.array_equal(v_cache, expected_v)


@given(batch=st.integers(1, 3), q_len=st.integers(1, 3), new=st.integers(0, 2), layout=st.sampled_from(
           ["contiguous", "rows", "paged"]),
       options=st.sampled_from([{}, dict(causal=True), dict(causal=True, window=(3, 0), sinks=1),
                                dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625])), dict(softcap=2.0)]),
       rotary=st.booleans(), check_finite=st.booleans(), seed=st.integers(0, 2**31))
def test_a_left_padded_cache_is_its_keys_moved_to_the_front(batch, q_len, new, layout, options, rotary, check_finite,
                                                             seed):
    """``cache_leftpad`` (FlashAttention's left-padded caches): sequence b's keys are slots
    [leftpad[b], cache_seqlens[b]) of its row, positions counted from the first: the same
    output as the cache with those keys moved to the front, and the new keys written at
    cache_seqlens; NaN in the padding is never read (check_finite included)."""
    rng = np.random.default_rng(seed)
    slots, heads, kv_heads, dim = 16, 4, 2, 8
    seqlens = rng.integers(q_len, slots - new + 1, batch)
    leftpad = np.array([rng.integers(0, s - q_len + 1) for s in seqlens])
    q = rng.standard_normal((batch, q_len, heads, dim)).astype(np.float32)
    k, v = ((rng.standard_normal((batch, new, kv_heads, dim)).astype(np.float32) for _ in range(2)) if new
            else (None, None))
    caches = [rng.standard_normal((batch, slots, kv_heads, dim)).astype(np.float32) for _ in range(2)]
    for cache, b in ((c, b) for c in caches for b in range(batch)):
        cache[b, :leftpad[b]] = np.nan  # padding: never read
    moved = [np.zeros_like(c) for c in caches]
    for target, source in zip(moved, caches):
        for b in range(batch):
            target[b, :seqlens[b] - leftpad[b]] = source[b, leftpad[b]:seqlens[b]]
    extra = dict(options, check_finite=check_finite)
    if rotary:
        angles = np.outer(np.arange(slots + 2), [1.0, 0.3])
        extra.update(rotary_cos=np.cos(angles), rotary_sin=np.sin(angles))
    expected = npattn.attention_with_kvcache(q, *moved, k, v, cache_seqlens=seqlens - leftpad, **extra)
    arguments = dict(cache_seqlens=seqlens, cache_leftpad=leftpad, **extra)
    if layout == "rows":  # the sequences in rows of a larger cache, in another order
        order = rng.permutation(batch + 1)[:batch]
        big = [np.full((batch + 1, slots, kv_heads, dim), np.nan, np.float32) for _ in caches]
        for target, source in zip(big, caches):
            target[order] = source
        caches, arguments["cache_batch_idx"] = big, order
    elif layout == "paged":  # pages of 4 slots, shuffled in a pool
        pages = rng.permutation(batch * slots // 4).reshape(batch, slots // 4)
        pools = [np.full((batch * slots // 4, 4, kv_heads, dim), np.nan, np.float32) for _ in caches]
        for pool, source in zip(pools, caches):
            pool[pages.reshape(-1)] = source.reshape(batch * slots // 4, 4, kv_heads, dim)
        caches, arguments["block_table"] = pools, pages
    out = npattn.attention_with_kvcache(q, *caches, k, v, **arguments)
    np.testing.assert_allclose(out, expected, rtol=0, atol=2 * tolerances.attention_bounds(  # two float32 calls
        np.float32, q, moved[0], moved[1], slots, options.get("scale"))[0])
    if new:  # the new keys sit at cache_seqlens, as the moved cache holds them at seqlens - leftpad
        for b in range(batch):
            if layout == "contiguous":
                written = caches[1][b, seqlens[b]:seqlens[b] + new]
            elif layout == "rows":
                written = caches[1][arguments["cache_batch_idx"][b], seqlens[b]:seqlens[b] + new]
            else:
                flat = caches[1][arguments["block_table"][b]].reshape(slots, kv_heads, dim)
                written = flat[seqlens[b]:seqlens[b] + new]
            np.testing.assert_array_equal(written, moved[1][b, seqlens[b] - leftpad[b]:seqlens[b] - leftpad[b] + new])


def test_cache_leftpad_is_checked_before_any_write():
    q, k = np.ones((2, 1, 2, 4), np.float32), np.ones((2, 1, 2, 4), np.float32)
    caches = [np.zeros((2, 8, 2, 4), np.float32) for _ in range(2)]
    for bad, error, message in ((np.array([0, 6]), ValueError, r"cache_leftpad\[1\] = 6 must lie in \[0, cache_seqlens\[1\]\] = \[0, 5\]"),
                                (np.array([0, 1, 2]), ValueError, r"cache_leftpad must have shape \(B,\) = \(2,\)"),
                                (np.array([0.5, 1.0]), TypeError, "got dtype float64"),
                                ("1", TypeError, "got str")):
        with pytest.raises(error, match=message):
            npattn.attention_with_kvcache(q, *caches, k, k, cache_seqlens=np.array([3, 5]), cache_leftpad=bad)
        assert not any(c.any() for c in caches)


@given(batch=st.integers(1, 3), q_len=st.integers(1, 3), span=st.integers(1, 9), new=st.integers(0, 2),
       layout=st.sampled_from(["contiguous", "paged"]),
       options=st.sampled_from([{}, dict(causal=True), dict(causal=True, window=(4, 0)),
                                dict(causal=True, window=(2, 0), sinks=2), dict(alibi_slopes=np.array([0.5, 0.25, 0.1, 0.05])),
                                dict(softcap=2.0, causal=True), dict(sink_logits=np.array([0.3, -1.0, 0.0, 2.0])),
                                dict(causal=True, window=(1, 0), sink_logits=np.array([0.3, -1.0, 0.0, 2.0])),
                                dict(causal=True, return_lse=True)]),
       rotary=st.booleans(), seed=st.integers(0, 2**31))
def test_a_shared_prefix_is_the_prefix_copied_in_front_of_every_sequence(batch, q_len, span, new, layout, options,
                                                                         rotary, seed):
    """prefix_k / prefix_v (cascade attention): the same answer as a cache holding the prefix
    in front of every sequence's own keys, for every option that applies (causal alignment,
    windows with sinks, ALiBi, softcap, sink logits, GQA, rotary, lse); the new keys land in
    the own cache; a plan runs each layer with its own prefix."""
    rng = np.random.default_rng(seed)
    own_slots, heads, kv_heads, dim = 12, 4, 2, 8
    seqlens = rng.integers(max(q_len - new, 0), own_slots - new + 1, batch)
    q = rng.standard_normal((batch, q_len, heads, dim)).astype(np.float32)
    k, v = ((rng.standard_normal((batch, new, kv_heads, dim)).astype(np.float32) for _ in range(2)) if new
            else (None, None))
    prefix = [rng.standard_normal((span, kv_heads, dim)).astype(np.float32) for _ in range(2)]
    own = [rng.standard_normal((batch, own_slots, kv_heads, dim)).astype(np.float32) for _ in range(2)]
    copied = [np.concatenate([np.broadcast_to(p[None], (batch, *p.shape)), c], axis=1) for p, c in zip(prefix, own)]
    extra = dict(options)
    if rotary:
        angles = np.outer(np.arange(span + own_slots + 2), [1.0, 0.3])
        extra.update(rotary_cos=np.cos(angles), rotary_sin=np.sin(angles))
    expected = npattn.attention_with_kvcache(q, *copied, k, v, cache_seqlens=seqlens + span, **extra)
    arguments = dict(cache_seqlens=seqlens, prefix_k=prefix[0], prefix_v=prefix[1], **extra)
    caches = own
    if layout == "paged":
        pages = rng.permutation(batch * own_slots // 4).reshape(batch, own_slots // 4)
        caches = [np.zeros((batch * own_slots // 4, 4, kv_heads, dim), np.float32) for _ in own]
        for pool, source in zip(caches, own):
            pool[pages.reshape(-1)] = source.reshape(-1, 4, kv_heads, dim)
        arguments["block_table"] = pages
    before = [c.copy() for c in caches]
    out = npattn.attention_with_kvcache(q, *caches, k, v, **arguments)
    bound = 2 * max(tolerances.attention_bounds(np.float32, q, np.concatenate(copied[0]),  # two float32 calls
                                                np.concatenate(copied[1]), span + own_slots))
    for got, want in zip(out if isinstance(out, tuple) else (out,), expected if isinstance(expected, tuple)
                         else (expected,)):
        np.testing.assert_allclose(got, want, atol=bound, rtol=0)
    plan = npattn.plan_with_kvcache(q, *[c.copy() for c in before], k, v, **arguments)
    layer_prefix = [x * 0.5 for x in prefix]
    layer_copied = [np.concatenate([np.broadcast_to(p[None], (batch, *p.shape)), c], axis=1)
                    for p, c in zip(layer_prefix, own)]
    want = npattn.attention_with_kvcache(q, *layer_copied, k, v, cache_seqlens=seqlens + span, **extra)
    got = plan.run(q, *[c.copy() for c in before], k, v, *layer_prefix)
    for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        np.testing.assert_allclose(a, b, atol=bound, rtol=0)


def test_a_prefix_is_checked_before_any_write():
    q, k = np.ones((2, 1, 4, 8), np.float32), np.ones((2, 1, 2, 8), np.float32)
    caches = [np.zeros((2, 8, 2, 8), np.float32) for _ in range(2)]
    prefix = np.ones((5, 2, 8), np.float32)
    for arguments, error, message in (
            (dict(prefix_k=prefix), ValueError, "must be given together"),
            (dict(prefix_k=prefix, prefix_v=prefix[:4]), ValueError, "must hold the same keys"),
            (dict(prefix_k=prefix[:, :1], prefix_v=prefix), ValueError, r"prefix_k must be \(Sp, Hkv, D\)"),
            (dict(prefix_k=prefix.astype(np.float64), prefix_v=prefix), TypeError, "prefix_k has dtype float64"),
            (dict(prefix_k=prefix, prefix_v=prefix, bias=np.zeros((8,))), TypeError, "does not take bias with prefix_k")):
        with pytest.raises(error, match=message):
            npattn.attention_with_kvcache(q, *caches, k, k, cache_seqlens=np.array([3, 5]), **arguments)
        assert not any(c.any() for c in caches)


@given(lengths=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 14)), min_size=1, max_size=4),
       options=st.sampled_from([{}, dict(causal=True), dict(causal=True, window=(3, 0)),
                                dict(alibi_slopes=np.array([0.5, 0.25, 0.1, 0.05])), dict(softcap=2.0, causal=True),
                                dict(causal=True, return_lse=True), dict(causal="top_left")]),
       backend=st.sampled_from(["cpu", "reference"]), seed=st.integers(0, 2**31))
def test_paged_varlen_is_one_kvcache_call_per_sequence(lengths, options, backend, seed):
    """attention_varlen with block_table (prefill chunks and decode steps in one call, keys in
    pages): each sequence's rows are attention_with_kvcache's for that sequence alone."""
    rng = np.random.default_rng(seed)
    heads, kv_heads, dim, page, pages_each = 4, 2, 8, 4, 4
    batch = len(lengths)
    cu_q = np.r_[0, np.cumsum([n for n, _ in lengths])]
    used = np.array([min(m, pages_each * page) for _, m in lengths])
    q = rng.standard_normal((int(cu_q[-1]), heads, dim)).astype(np.float32)
    pools = [rng.standard_normal((batch * pages_each + 2, page, kv_heads, dim)).astype(np.float32) for _ in range(2)]
    table = rng.permutation(batch * pages_each + 2)[:batch * pages_each].reshape(batch, pages_each)
    out = npattn.attention_varlen(q, *pools, cu_q, seqused_k=used, block_table=table, backend=backend, **options)
    got_out, got_lse = out if isinstance(out, tuple) else (out, None)
    assert got_out.shape == (q.shape[0], heads, dim)
    aligned = {name: value for name, value in options.items() if name != "causal"} if options.get(
        "causal") == "top_left" else options
    for b, (n, _) in enumerate(lengths):
        if not n:
            continue
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        if options.get("causal") == "top_left":  # row 0 level with key 0
            want = npattn.attention(q[None, rows], *pools, block_table=table[b:b + 1], kv_lengths=used[b:b + 1],
                                    q_offset=0, causal=True, layout="bshd", **aligned)
        else:
            want = npattn.attention_with_kvcache(q[None, rows], *pools, cache_seqlens=used[b:b + 1],
                                                 block_table=table[b:b + 1], backend=backend, **options)
        want_out, want_lse = want if isinstance(want, tuple) else (want, None)
        out_bound, lse_bound = tolerances.attention_bounds(np.float32, q, pools[0], pools[1], 16, options.get("scale"))
        np.testing.assert_allclose(got_out[rows], want_out[0], rtol=0, atol=2 * out_bound)  # two float32 calls
        if want_lse is not None:
            np.testing.assert_allclose(got_lse[:, rows], want_lse[0], rtol=0, atol=2 * lse_bound)


def test_paged_varlen_checks_its_arguments():
    q, pool = np.ones((5, 2, 4), np.float32), np.ones((6, 4, 1, 4), np.float32)
    table = np.array([[0, 1], [2, 3]])
    for arguments, error, message in (
            (dict(seqused_k=np.array([3, 9]), block_table=table), ValueError, r"seqused_k\[1\] = 9"),
            (dict(block_table=table), TypeError, "needs seqused_k"),
            (dict(seqused_k=np.array([3, 4])), TypeError, "seqused_k comes with block_table"),
            (dict(seqused_k=np.array([5, 4]), block_table=np.array([[0, 9], [2, 3]])), ValueError,
             r"block_table\[0, 1\] = 9"),  # (a page past a sequence's keys is never read: no error there)
            (dict(seqused_k=np.array([3, 4]), block_table=table, dropout_p=0.1), TypeError, "no dropout_p")):
        with pytest.raises(error, match=message):
            npattn.attention_varlen(q, pool, pool, np.array([0, 2, 5]), **arguments)


@given(steps=st.lists(st.lists(st.integers(0, 5), min_size=3, max_size=3), min_size=1, max_size=3),
       rotary=st.booleans(), seed=st.integers(0, 2**31))
def test_paged_cache_attend_varlen_is_attend_per_sequence(steps, rotary, seed):
    """PagedKVCache.attend_varlen (prefill chunks and decode steps of several sequences in
    one call) leaves the pool as attend does sequence by sequence, and returns each
    sequence's rows as attend does."""
    from npattn.nn import PagedKVCache

    rng = np.random.default_rng(seed)
    caches = [PagedKVCache(16, 4, 2, 8, dtype="float64") for _ in range(2)]
    for cache in caches:
        for name in "abc":
            cache.add(name)
    extra = {}
    if rotary:
        angles = np.outer(np.arange(64), [1.0, 0.5, 0.25, 0.1])
        extra = dict(rotary_cos=np.cos(angles), rotary_sin=np.sin(angles))
    for counts in steps:
        chosen = [name for name, n in zip("abc", counts) if n]
        news = [n for n in counts if n]
        if not chosen:
            continue
        q = rng.standard_normal((sum(news), 4, 8))
        k, v = rng.standard_normal((sum(news), 2, 8)), rng.standard_normal((sum(news), 2, 8))
        cu = np.concatenate([[0], np.cumsum(news)])
        out = caches[0].attend_varlen(chosen, q, k, v, cu, causal=True, **extra)
        for b, name in enumerate(chosen):
            rows = slice(int(cu[b]), int(cu[b + 1]))
            want = caches[1].attend([name], q[None, rows], k[None, rows], v[None, rows], causal=True, **extra)
            np.testing.assert_allclose(out[rows], want[0], rtol=0, atol=2 * tolerances.attention_bounds(
                np.float64, q, caches[1].keys, caches[1].values, caches[1].length(name))[0])
    np.testing.assert_array_equal(caches[0].keys, caches[1].keys)
    assert [caches[0].length(n) for n in "abc"] == [caches[1].length(n) for n in "abc"]


def test_paged_cache_attend_varlen_that_raises_changes_nothing():
    from npattn.nn import PagedKVCache

    rng = np.random.default_rng(1)
    cache = PagedKVCache(4, 2, 1, 4, dtype="float64")
    cache.add("a")
    cache.attend_varlen(["a"], rng.standard_normal((3, 2, 4)), rng.standard_normal((3, 1, 4)),
                        rng.standard_normal((3, 1, 4)), np.array([0, 3]), causal=True)
    keys, values, free = cache.keys.copy(), cache.values.copy(), cache.free_pages
    q, k = rng.standard_normal((1, 2, 4)), rng.standard_normal((1, 1, 4))
    with pytest.raises(TypeError, match="unknown option 'softmax_scale'"):  # found before any write
        cache.attend_varlen(["a"], q, k, k, np.array([0, 1]), softmax_scale=0.5)
    with pytest.raises(MemoryError, match="more pages needed"):
        cache.attend_varlen(["a"], rng.standard_normal((9, 2, 4)), rng.standard_normal((9, 1, 4)),
                            rng.standard_normal((9, 1, 4)), np.array([0, 9]))
    with pytest.raises(TypeError, match="k has dtype float32"):
        cache.attend_varlen(["a"], q, k.astype(np.float32), k, np.array([0, 1]))
    short = np.ones((3, 2))  # covers positions 0-2, the call needs 3
    with pytest.raises(ValueError, match=r"rotary_cos must be \(positions >= 4"):
        cache.attend_varlen(["a"], q, k, k, np.array([0, 1]), rotary_cos=short, rotary_sin=short)
    np.testing.assert_array_equal(cache.keys, keys)
    np.testing.assert_array_equal(cache.values, values)
    assert cache.free_pages == free and cache.length("a") == 3


def test_a_prefix_with_more_queries_than_own_keys_keeps_causal_alignment():
    """Found by the serving fuzz: three queries against one own key put the first two rows
    inside the prefix, where a causal mask hides the prefix's later keys (the stacked prefix
    part assumed every row sees the whole prefix)."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 3, 2, 8))
    own = [rng.standard_normal((2, 4, 1, 8)) for _ in range(2)]
    prefix = [rng.standard_normal((5, 1, 8)) for _ in range(2)]
    out = npattn.attention_with_kvcache(q, *own, cache_seqlens=1, prefix_k=prefix[0], prefix_v=prefix[1], causal=True)
    copied = [np.concatenate([np.broadcast_to(p[None], (2, 5, 1, 8)), c], axis=1) for p, c in zip(prefix, own)]
    np.testing.assert_allclose(out, npattn.attention_with_kvcache(q, *copied, cache_seqlens=6, causal=True), rtol=0,
                               atol=2 * tolerances.attention_bounds(np.float64, q, *copied, 6)[0])

