"""attention_with_kvcache keeps the plan of a checked step for the step's other layers
(npattn.serving.kvcache._STEPS): a call whose every checked argument equals an earlier
successful call's, the arrays' data aside, runs that call's plan; and a decode loop's next
step, whose only change is cache_seqlens, runs that plan moved on to the new lengths
(_MOVING, KVCachePlan.advanced). These tests hold both to the bits, cache bytes and errors
of a call checked from nothing, and to holding no array of the caller's."""
from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import npattn
from npattn.runtime import plans
from npattn.serving import kvcache
from test_serving import assert_out, call_case

BATCH, HEADS, KV_HEADS, HEAD_DIM, CAPACITY, LAYERS = 2, 4, 2, 16, 24, 3


def _step_arguments(rng, layout):
    """One decode step's q, caches, new keys and keywords for ``layout`` (each call of this
    draws another layer's arrays of one structure; the keywords are the step's)."""
    q = rng.normal(size=(BATCH, 1, HEADS, HEAD_DIM)).astype(np.float32)
    k, v = (rng.normal(size=(BATCH, 1, KV_HEADS, HEAD_DIM)).astype(np.float32) for _ in range(2))
    caches = [rng.normal(size=(BATCH + 1, CAPACITY, KV_HEADS, HEAD_DIM)).astype(np.float32) for _ in range(2)]
    keywords = dict(cache_seqlens=np.array([5, 17]), causal=True, backend="cpu")
    if layout == "rows":
        keywords["cache_batch_idx"] = np.array([2, 0])
    elif layout == "paged":
        caches = [rng.normal(size=(8, 4, KV_HEADS, HEAD_DIM)).astype(np.float32) for _ in range(2)]
        keywords["block_table"] = np.array([[3, 1, -1, -1, -1], [0, 2, 4, 5, 6]], np.int32)
    elif layout == "int8":
        codes, scales = npattn.quantize_kv(caches[0][:BATCH], "int8")
        caches = [codes, codes.copy(), scales, scales.copy()]
        return q, caches, k, v, keywords
    else:  # a row per sequence
        caches = [np.ascontiguousarray(cache[:BATCH]) for cache in caches]
        if layout == "no append":
            k = v = None
    return q, caches + [None, None], k, v, keywords


def _call(q, caches, k, v, keywords):
    k_cache, v_cache, k_scale, v_scale = caches
    return npattn.attention_with_kvcache(q, k_cache, v_cache, k, v, k_scale=k_scale, v_scale=v_scale, **keywords)


def _copies(caches):
    return [None if cache is None else cache.copy() for cache in caches]


LAYOUTS = ["contiguous", "rows", "paged", "int8", "no append"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_steps_later_layers_run_its_plan_with_the_bits_of_a_checked_call(monkeypatch, layout):
    """Three layers of one step: the first is checked, the others run its plan, and each
    gives the outputs and cache bytes of the same call checked from nothing."""
    rng = np.random.default_rng(3)
    layers = [_step_arguments(rng, layout) for _ in range(LAYERS)]
    keywords = layers[0][4]
    expected, expected_caches = [], []
    for q, caches, k, v, _ in layers:  # each call checked from nothing: no kept plan
        copies = _copies(caches)
        plans.clear()
        expected.append(_call(q, copies, k, v, keywords))
        expected_caches.append(copies)
    plans.clear()
    checked = []
    real = kvcache._checked
    monkeypatch.setattr(kvcache, "_checked", lambda *arguments: checked.append(1) or real(*arguments))
    for (q, caches, k, v, _), out, after in zip(layers, expected, expected_caches):
        np.testing.assert_array_equal(_call(q, caches, k, v, keywords), out)
        for cache, expected_cache in zip(caches, after):
            if cache is not None:
                np.testing.assert_array_equal(cache, expected_cache)
    assert len(checked) == 1, "the later layers were checked again"
    # the next step (its caches one key longer) is checked again, unless its plan moves on
    # (a contiguous cache whose rows are its sequences: test_a_decode_loops_next_steps_...)
    q, caches, k, v, _ = layers[0]
    _call(q, caches, k, v, dict(keywords, cache_seqlens=keywords["cache_seqlens"] + 1))
    assert len(checked) == (1 if layout in MOVING_LAYOUTS else 2)


MOVING_LAYOUTS = LAYOUTS  # (every layout here: NumPy, no left padding, rotary tables or prefix)


def _checked_calls(monkeypatch):
    """A list that gets an entry at each full check of a kv-cache call."""
    checked = []
    real = kvcache._checked
    monkeypatch.setattr(kvcache, "_checked", lambda *arguments: checked.append(1) or real(*arguments))
    return checked


@pytest.mark.parametrize("layout", MOVING_LAYOUTS)
def test_a_decode_loops_next_steps_move_its_plan_with_the_bits_of_a_checked_call(monkeypatch, layout):
    """Steps of a decode loop whose only change is cache_seqlens (each sequence one key
    longer, the last one sitting at the cache's end at the last step) run the plan of the
    step before, moved on to the new lengths: each layer gives the outputs and cache bytes
    of the same call checked from nothing, and only the loop's first step is checked (and,
    paged, the step whose longest sequence reaches another page)."""
    rng = np.random.default_rng(13)
    layers = [_step_arguments(rng, layout) for _ in range(2)]
    appends = layers[0][2] is not None
    # (the last step: 23 + 1 keys of 24; paged: 17 + 1 of 20, the longest sequence reaching a
    # fifth page of 4 keys at the fifth step, whose plan holds four: checked in full)
    (first, longest) = (1, 12) if layout == "paged" else (3, CAPACITY - 6)  # (paged: the first holds two pages)
    steps = [np.array([first + s, longest + s]) for s in range(6 if appends else 7)]
    expected = {}
    for s, lengths in enumerate(steps):
        for layer, (q, caches, k, v, keywords) in enumerate(layers):
            copies = _copies(caches)
            plans.clear()
            expected[s, layer] = (_call(q, copies, k, v, dict(keywords, cache_seqlens=lengths)), copies)
    plans.clear()
    checked = _checked_calls(monkeypatch)
    for s, lengths in enumerate(steps):
        for layer, (q, caches, k, v, keywords) in enumerate(layers):
            caches = _copies(caches)
            out = _call(q, caches, k, v, dict(keywords, cache_seqlens=lengths))
            expected_out, expected_caches = expected[s, layer]
            np.testing.assert_array_equal(out, expected_out)
            for cache, expected_cache in zip(caches, expected_caches):
                if cache is not None:
                    np.testing.assert_array_equal(cache, expected_cache)
    assert len(checked) == (2 if layout == "paged" else 1), f"{len(checked)} full checks for {len(steps)} steps"


def test_a_plan_with_kvcache_moved_on_runs_the_next_steps_as_checked_calls():
    """plan_with_kvcache's plan of one step, moved on by KVCachePlan.advanced to each next
    step's lengths, gives the bits and cache bytes of attention_with_kvcache checked from
    nothing at each; a paged plan answers None for lengths that reach another number of
    pages."""
    rng = np.random.default_rng(18)
    q, caches, k, v, keywords = _step_arguments(rng, "int8")
    k_cache, v_cache, k_scale, v_scale = caches
    lengths = keywords.pop("cache_seqlens")
    step = npattn.plan_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, k_scale=k_scale,
                                    v_scale=v_scale, **keywords)
    mine, theirs = _copies(caches), _copies(caches)
    for moved in range(4):
        out = step.run(q, mine[0], mine[1], k, v, k_scale=mine[2], v_scale=mine[3])
        plans.clear()
        expected = _call(q, theirs, k, v, dict(keywords, cache_seqlens=lengths + moved))
        np.testing.assert_array_equal(out, expected)
        for cache, expected_cache in zip(mine, theirs):
            np.testing.assert_array_equal(cache, expected_cache)
        step = step.advanced(lengths + moved + 1)
    q, caches, k, v, keywords = _step_arguments(rng, "paged")
    paged = npattn.plan_with_kvcache(q, caches[0], caches[1], k, v, **keywords)
    assert paged.advanced(keywords["cache_seqlens"] + 1) is not None
    assert paged.advanced(np.array([5, 14])) is None  # (its longest sequence in 4 pages, not 5)


@pytest.mark.parametrize("change", ["too many keys", "a negative length", "lengths of another shape"])
def test_a_moved_step_with_lengths_out_of_range_raises_as_a_checked_call(monkeypatch, change):
    """The lengths a plan moves on to are checked as the full call checks them: out of
    range, the call raises the error of the call checked from nothing (lengths of another
    shape are another key: checked in full) and writes nothing."""
    rng = np.random.default_rng(14)
    q, caches, k, v, keywords = _step_arguments(rng, "contiguous")
    plans.clear()
    _call(q, _copies(caches), k, v, keywords)
    lengths = {"too many keys": np.array([5, CAPACITY]), "a negative length": np.array([-1, 6]),
               "lengths of another shape": np.array([5, 6, 7])}[change]
    keywords = dict(keywords, cache_seqlens=lengths)
    caches = _copies(caches)
    before = _copies(caches)
    kept = _error_of(lambda: _call(q, caches, k, v, keywords))
    for cache, old in zip(caches, before):
        if cache is not None:
            np.testing.assert_array_equal(cache, old)
    plans.clear()
    assert kept == _error_of(lambda: _call(q, caches, k, v, keywords))


@pytest.mark.parametrize("change", ["a write into another sequence's page", "a page outside the pool"])
def test_a_moved_paged_step_checks_the_pages_its_lengths_reach(monkeypatch, change):
    """A paged plan moves on with its table, but the pages and slots the new lengths reach
    are checked as the full call checks them: a new key landing in a page another sequence
    holds, or a length reaching a table entry outside the pool, raises the error of the
    call checked from nothing and writes nothing."""
    rng = np.random.default_rng(19)
    q, caches, k, v, keywords = _step_arguments(rng, "paged")
    # sequence 0's third page is sequence 1's fifth (read by it, never written by 0 at first);
    # or a third page past the pool
    third = 6 if change == "a write into another sequence's page" else 8
    keywords["block_table"] = np.array([[3, 1, third, -1, -1], [0, 2, 4, 5, 6]], np.int32)
    plans.clear()
    _call(q, _copies(caches), k, v, keywords)  # lengths (5, 17) + 1: sequence 0 in two pages
    checked = _checked_calls(monkeypatch)
    keywords = dict(keywords, cache_seqlens=np.array([8, 17]))  # sequence 0's new key: its third page
    caches = _copies(caches)
    before = _copies(caches)
    moved = _error_of(lambda: _call(q, caches, k, v, keywords))
    assert not checked, "the step was checked in full, not moved"
    for cache, old in zip(caches, before):
        if cache is not None:
            np.testing.assert_array_equal(cache, old)
    plans.clear()
    assert moved == _error_of(lambda: _call(q, caches, k, v, keywords))


def test_a_step_past_its_key_bucket_or_with_every_sequence_at_its_end_is_checked_again(monkeypatch):
    """A plan moves on only within its KEY_BUCKET of keys read: a step whose longest
    sequence crosses into the next bucket is checked in full, as is one whose sequences all
    end at the bucket's end (whose full checks give no lengths); both still give the
    reference's answer."""
    rng = np.random.default_rng(15)
    q, _, k, v, keywords = _step_arguments(rng, "contiguous")
    bucket = kvcache.KEY_BUCKET
    k_cache = rng.normal(size=(BATCH, 2 * bucket, KV_HEADS, HEAD_DIM)).astype(np.float32)
    v_cache = rng.normal(size=k_cache.shape).astype(np.float32)
    plans.clear()
    checked = _checked_calls(monkeypatch)
    for lengths, checks in (([10, bucket - 3], 1), ([11, bucket - 2], 1), ([bucket - 1, bucket - 1], 2),
                            ([12, bucket], 3), ([13, bucket + 1], 3)):
        lengths = np.array(lengths)
        out = npattn.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=True,
                                            backend="cpu")
        assert len(checked) == checks, (lengths, len(checked))
        for b, length in enumerate(lengths + 1):
            arrays = (q[b:b + 1], k_cache[b:b + 1, :length], v_cache[b:b + 1, :length])
            expected = npattn.attention(*arrays, layout="bshd", causal=True, backend="reference")
            assert_out(out[b:b + 1], expected, call_case(*arrays, dict(causal=True)))


def test_a_moved_step_holds_no_array_of_the_callers():
    """Nor does a plan moved on to the next step's lengths."""
    rng = np.random.default_rng(16)
    q, caches, k, v, keywords = _step_arguments(rng, "int8")
    plans.clear()
    _call(q, caches, k, v, keywords)
    _call(q, caches, k, v, dict(keywords, cache_seqlens=keywords["cache_seqlens"] + 1))
    assert len(kvcache._STEPS) == 2 and len(kvcache._MOVING) == 1
    watched = [weakref.ref(array) for array in (q, *caches, k, v)]
    del q, caches, k, v
    gc.collect()
    assert all(ref() is None for ref in watched), "a moved step plan holds a caller's array"


def test_a_kept_step_holds_no_array_of_the_callers():
    """The kept plan holds neither q, nor the caches, nor the new keys: they go when the
    caller drops them."""
    rng = np.random.default_rng(4)
    q, caches, k, v, keywords = _step_arguments(rng, "int8")
    plans.clear()
    _call(q, caches, k, v, keywords)
    assert len(kvcache._STEPS) == 1
    watched = [weakref.ref(array) for array in (q, *caches, k, v)]
    del q, caches, k, v
    gc.collect()
    assert all(ref() is None for ref in watched), "a kept step plan holds a caller's array"


@pytest.mark.parametrize("layout", ["contiguous", "int8"])
def test_a_kept_step_holds_no_array_of_a_later_layers(layout):
    """Nor the arrays of the layers that ran the kept plan after it: a quantized step's
    plan of the codes held the last layer's scales (a cache's memory) until 2026-11-30."""
    rng = np.random.default_rng(17)
    q, caches, k, v, keywords = _step_arguments(rng, layout)
    plans.clear()
    _call(q, caches, k, v, keywords)
    q, caches, k, v, _ = _step_arguments(rng, layout)
    _call(q, caches, k, v, keywords)
    assert len(kvcache._STEPS) == 1
    watched = [weakref.ref(array) for array in (q, *caches, k, v) if array is not None]
    del q, caches, k, v
    gc.collect()
    assert all(ref() is None for ref in watched), "a kept step plan holds a later layer's array"


def _error_of(call):
    with pytest.raises(Exception) as raised:
        call()
    return type(raised.value), str(raised.value)


@pytest.mark.parametrize("change", ["read-only cache", "one array for both caches", "rotary_interleaved",
                                    "too many keys", "an unknown option", "cache row out of range"])
def test_a_call_like_a_kept_step_but_for_one_argument_raises_as_a_checked_call(change):
    """After a step's plan is kept, a call that differs from it in one argument raises
    the error of the same call checked from nothing, and writes nothing."""
    rng = np.random.default_rng(5)
    q, caches, k, v, keywords = _step_arguments(rng, "rows")
    plans.clear()
    _call(q, _copies(caches), k, v, keywords)
    assert len(kvcache._STEPS) == 1
    caches = _copies(caches)
    if change == "read-only cache":
        caches[1].flags.writeable = False
    elif change == "one array for both caches":
        caches[1] = caches[0]
    elif change == "rotary_interleaved":
        keywords = dict(keywords, rotary_interleaved="yes")
    elif change == "too many keys":
        keywords = dict(keywords, cache_seqlens=np.array([5, CAPACITY]))
    elif change == "an unknown option":
        keywords = dict(keywords, softmax_scale=0.5)
    elif change == "cache row out of range":
        keywords = dict(keywords, cache_batch_idx=np.array([2, BATCH + 1]))
    before = _copies(caches)
    kept = _error_of(lambda: _call(q, caches, k, v, keywords))
    for cache, old in zip(caches, before):
        np.testing.assert_array_equal(cache, old)
    plans.clear()
    assert kept == _error_of(lambda: _call(q, caches, k, v, keywords))


@pytest.mark.parametrize("options", [dict(scale=0.3), dict(softcap=2.0), dict(window=(1, 0)), dict(return_lse=True)])
def test_a_call_like_a_kept_step_but_for_an_option_gives_its_own_answer(options):
    """An option's value is part of what a kept step is kept for: the same step with
    another value gives what that call checked from nothing gives."""
    rng = np.random.default_rng(6)
    q, caches, k, v, keywords = _step_arguments(rng, "rows")
    plans.clear()
    _call(q, _copies(caches), k, v, keywords)
    changed = dict(keywords, **options)
    kept_caches, fresh_caches = _copies(caches), _copies(caches)
    kept = _call(q, kept_caches, k, v, changed)
    plans.clear()
    fresh = _call(q, fresh_caches, k, v, changed)
    kept, fresh = _outputs(kept), _outputs(fresh)
    assert len(kept) == len(fresh)
    for mine, theirs in zip(kept, fresh):
        np.testing.assert_array_equal(mine, theirs)
    unchanged = _outputs(_call(q, _copies(caches), k, v, keywords))
    assert len(unchanged) != len(kept) or not np.array_equal(unchanged[0], kept[0]), "the option changed nothing"


def _outputs(result):
    return result if isinstance(result, tuple) else (result,)


def test_dropout_without_a_seed_draws_a_fresh_mask_at_every_call():
    """Calls that draw a fresh seed (dropout without ``seed``) are never run on a kept
    plan: two identical calls drop different weights."""
    rng = np.random.default_rng(7)
    q, caches, k, v, keywords = _step_arguments(rng, "rows")
    keywords = dict(keywords, dropout_p=0.5)
    plans.clear()
    first = _call(q, _copies(caches), k, v, keywords)
    second = _call(q, _copies(caches), k, v, keywords)
    assert not np.array_equal(first, second)


def test_a_decode_loops_steps_share_the_cpus_plan_of_one_key_bucket(monkeypatch):
    """Steps whose longest sequence holds keys within one KEY_BUCKET read the same keys of a
    contiguous cache (each sequence bounded by its own length): the CPU makes one plan of
    the attention for all of them, where each new key count had made its own; and each
    step gives the reference's answer on its sequences' own keys."""
    from npattn.cpu import driver

    made = []
    real = driver.ForwardPlan
    monkeypatch.setattr(driver, "ForwardPlan", lambda *arguments: made.append(1) or real(*arguments))
    plans.clear()
    rng = np.random.default_rng(8)
    q, caches, k, v, keywords = _step_arguments(rng, "contiguous")
    k_cache = np.zeros((BATCH, 2 * kvcache.KEY_BUCKET, KV_HEADS, HEAD_DIM), np.float32)
    v_cache = np.zeros_like(k_cache)
    steps = 12
    for step in range(steps):
        lengths = np.array([3 + step, 40 + 2 * step])
        out = npattn.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=True,
                                            backend="cpu")
        for b, length in enumerate(lengths + 1):
            arrays = (q[b:b + 1], k_cache[b:b + 1, :length], v_cache[b:b + 1, :length])
            expected = npattn.attention(*arrays, layout="bshd", causal=True, backend="reference")
            assert_out(out[b:b + 1], expected, call_case(*arrays, dict(causal=True)))
    assert len(made) == 1, f"{len(made)} plans for {steps} steps of one key bucket"


def test_a_step_returning_the_weights_reads_the_keys_its_sequences_hold():
    """The weights' last axis is the keys the step read: a contiguous cache's longest
    sequence's, not rounded to KEY_BUCKET."""
    rng = np.random.default_rng(9)
    q, caches, k, v, keywords = _step_arguments(rng, "contiguous")
    out, weights = _call(q, caches, k, v, dict(keywords, return_weights=True))
    assert weights.shape == (BATCH, HEADS, 1, 18)
    assert out.shape == (BATCH, 1, HEADS, HEAD_DIM)


def _packed_layer(rng):
    """One layer's packed q, k, v for sequences of 1, 1, 16 query rows and 5, 9, 20 keys."""
    return tuple(rng.normal(size=(rows, heads, HEAD_DIM)).astype(np.float32)
                 for rows, heads in ((18, HEADS), (34, KV_HEADS), (34, KV_HEADS)))


CU_Q, CU_K = np.array([0, 1, 2, 18]), np.array([0, 5, 14, 34])


@pytest.mark.parametrize("options", [dict(causal=True), dict(causal=True, return_lse=True), dict(window=(3, 0))])
def test_a_packed_batchs_later_layers_run_its_plan_with_the_bits_of_a_checked_call(monkeypatch, options):
    """attention_varlen keeps the plan of a checked batch for the batch's other layers:
    each gives what the call checked from nothing gives, and only the first is checked."""
    from npattn.serving import varlen

    rng = np.random.default_rng(10)
    layers = [_packed_layer(rng) for _ in range(LAYERS)]
    expected = []
    for layer in layers:
        plans.clear()
        expected.append(_outputs(npattn.attention_varlen(*layer, CU_Q, CU_K, **options)))
    plans.clear()
    checked = []
    real = varlen._PackedCall.of
    monkeypatch.setattr(varlen._PackedCall, "of", lambda *arguments: checked.append(1) or real(*arguments))
    for layer, outputs in zip(layers, expected):
        for mine, theirs in zip(_outputs(npattn.attention_varlen(*layer, CU_Q, CU_K, **options)), outputs):
            np.testing.assert_array_equal(mine, theirs)
    assert len(checked) == 1, "the later layers were checked again"
    # other lengths, other options: checked, each its own answer
    other = np.array([0, 2, 2, 18])
    out = npattn.attention_varlen(*layers[0], other, CU_K, **options)
    assert len(checked) == 2
    plans.clear()
    for mine, theirs in zip(_outputs(out), _outputs(npattn.attention_varlen(*layers[0], other, CU_K, **options))):
        np.testing.assert_array_equal(mine, theirs)


def test_a_kept_packed_batch_holds_no_array_of_the_callers():
    rng = np.random.default_rng(11)
    q, k, v = _packed_layer(rng)
    cu_q, cu_k = CU_Q.copy(), CU_K.copy()
    plans.clear()
    first = npattn.attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    cu_q[1] = 0  # (a write to the caller's lengths: the kept plan has its own)
    again = npattn.attention_varlen(q, k, v, CU_Q, CU_K, causal=True)
    np.testing.assert_array_equal(first, again)
    watched = [weakref.ref(array) for array in (q, k, v, cu_q, cu_k)]
    del q, k, v, cu_q, cu_k
    gc.collect()
    assert all(ref() is None for ref in watched), "a kept packed batch holds a caller's array"


@pytest.mark.parametrize("bad", [dict(max_seqlen_q=3), dict(cu_seqlens_k=np.array([0, 5, 14, 35])),
                                 dict(q_offset=np.array([0, 1])), dict(scale=float("nan"))])
def test_a_call_like_a_kept_packed_batch_but_for_one_argument_raises_as_a_checked_call(bad):
    rng = np.random.default_rng(12)
    q, k, v = _packed_layer(rng)
    plans.clear()
    npattn.attention_varlen(q, k, v, CU_Q, CU_K, causal=True)
    arguments = {**dict(cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, causal=True), **bad}
    kept = _error_of(lambda: npattn.attention_varlen(q, k, v, **arguments))
    plans.clear()
    assert kept == _error_of(lambda: npattn.attention_varlen(q, k, v, **arguments))


def test_a_kept_step_with_alibi_slopes_reads_its_own_copy_of_them():
    """ALiBi slopes key a step by their values (the options' keyed arrays); the kept plan
    holds its own copy, so a later write to the caller's slopes reaches only calls made
    with the new values."""
    rng = np.random.default_rng(13)
    q, caches, k, v, keywords = _step_arguments(rng, "rows")
    slopes = np.linspace(0.1, 0.8, HEADS)
    plans.clear()
    _call(q, _copies(caches), k, v, dict(keywords, alibi_slopes=slopes))
    assert len(kvcache._STEPS) == 1
    slopes[:] = 0.05  # the caller's array written: another key
    kept = _call(q, _copies(caches), k, v, dict(keywords, alibi_slopes=np.linspace(0.1, 0.8, HEADS)))
    written = _call(q, _copies(caches), k, v, dict(keywords, alibi_slopes=slopes))
    plans.clear()
    np.testing.assert_array_equal(kept, _call(q, _copies(caches), k, v,
                                              dict(keywords, alibi_slopes=np.linspace(0.1, 0.8, HEADS))))
    plans.clear()
    np.testing.assert_array_equal(written, _call(q, _copies(caches), k, v, dict(keywords, alibi_slopes=slopes)))
    assert not np.array_equal(kept, written)


def test_a_packed_batchs_later_layers_run_its_plan_for_their_gradients_too(monkeypatch):
    """attention_varlen_vjp keeps the checked batch's plan as attention_varlen does: the
    later layers' outputs and gradients have the bits of calls checked from nothing."""
    from npattn.serving import varlen

    rng = np.random.default_rng(14)
    layers = [_packed_layer(rng) for _ in range(LAYERS)]
    douts = [rng.normal(size=(18, HEADS, HEAD_DIM)).astype(np.float32) for _ in range(LAYERS)]
    options = dict(causal=True, alibi_slopes=None, scale=0.3)
    expected = []
    for layer, dout in zip(layers, douts):
        plans.clear()
        out, vjp = npattn.attention_varlen_vjp(*layer, CU_Q, CU_K, **options)
        expected.append((out, *vjp(dout)))
    plans.clear()
    checked = []
    real = varlen._PackedCall.of
    monkeypatch.setattr(varlen._PackedCall, "of", lambda *arguments: checked.append(1) or real(*arguments))
    for layer, dout, results in zip(layers, douts, expected):
        out, vjp = npattn.attention_varlen_vjp(*layer, CU_Q, CU_K, **options)
        for mine, theirs in zip((out, *vjp(dout)), results):
            np.testing.assert_array_equal(mine, theirs)
    assert len(checked) == 1, "the later layers were checked again"
