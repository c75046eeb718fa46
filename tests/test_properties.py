"""Properties every backend must satisfy, written once and parametrized over backends.

Each test states a mathematical fact about attention (an equivalence between two
ways of asking for the same thing, or an invariance) and checks it on random
problems. A backend is held to all of them by appearing in ``NUMPY_BACKENDS``.
"""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import NUMPY_BACKENDS
from strategies import ALL_OPTIONS, POSITIONAL_OPTIONS, cases, dims
from tolerances import assert_close, bound, gradient_magnitude, output_magnitude, score_magnitude
import npattn
from npattn.core.dropout import keep_mask

DTYPES = ("float16", "bfloat16", "float32", "float64")
NON_POSITIONAL = tuple(o for o in ALL_OPTIONS if o not in POSITIONAL_OPTIONS)
pytestmark = pytest.mark.parametrize("backend", NUMPY_BACKENDS)


def positions(case):
    """p_i as (B or 1, 1, Sq, 1) and the key indices as (1, 1, 1, Sk): p_i = i + Sk - Sq,
    or, with q_offset (0 for causal="top_left"), row i - q_start[b] of the real rows at
    key q_offset[b] of the real keys (which start at kv_start[b])."""
    d, o = case.dims, case.options
    offset = 0 if o.get("causal") == "top_left" else o.get("q_offset")
    if offset is None:
        shift = np.array(d.kv_len - d.q_len)
    else:
        shift = (np.asarray(offset) + o.get("kv_start", np.zeros(d.batch, int))
                 - o.get("q_start", np.zeros(d.batch, int)))
    return (np.arange(d.q_len)[None, None, :, None] + shift.reshape(-1, 1, 1, 1),
            np.arange(d.kv_len)[None, None, None, :])


def sink_keys(case, sinks):
    """(B or 1, 1, 1, Sk): the keys the first ``sinks`` real keys are (from kv_start[b])."""
    start = np.asarray(case.options.get("kv_start", 0)).reshape(-1, 1, 1, 1)
    j = np.arange(case.dims.kv_len)[None, None, None, :]
    return (j >= start) & (j < start + sinks)


@given(case=cases(dtypes=DTYPES))
def test_weights_are_a_distribution_over_visible_keys(backend, case):
    out, lse, weights = case.run(backend, return_lse=True, return_weights=True)
    assert weights.shape == case.dims.scores_shape
    assert (weights >= 0).all()
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    empty = np.isneginf(lse)
    sink = case.options.get("sink_logits")
    sink_prob = 0.0 if sink is None else np.exp(np.where(empty, 0.0, sink[None, :, None] - lse))
    total = weights.astype(np.float64).sum(-1) + sink_prob
    assert_close(total[~empty], np.ones(int((~empty).sum())), case.dtype, case.dims.kv_len, what="row sums")
    assert (weights[empty] == 0).all() and (out[empty] == 0).all()


@given(case=cases(options=NON_POSITIONAL, dtypes=DTYPES), data=st.data())
def test_permuting_keys_with_values_changes_nothing(backend, case, data):
    order = np.array(data.draw(st.permutations(range(case.dims.kv_len))), dtype=int)
    permuted = case.with_options(**{name: case.options[name][..., order]
                                    for name in ("mask", "bias")
                                    if name in case.options and case.options[name].shape[-1] > 1})
    permuted = type(case)(case.dims, case.q, case.k[:, :, order], case.v[:, :, order], permuted.options)
    out, lse = case.run(backend, return_lse=True)
    out_p, lse_p = permuted.run(backend, return_lse=True)
    assert_close(out_p, out, case.dtype, case.dims.kv_len, output_magnitude(case), "output")
    assert_close(lse_p, lse, case.dtype, case.dims.kv_len, 1 + np.abs(lse[np.isfinite(lse)]).max(initial=0))


@given(case=cases(dtypes=DTYPES), data=st.data())
def test_invisible_keys_never_change_the_output(backend, case, data):
    _, _, weights = case.run("reference", return_lse=True, return_weights=True)
    visible = explicit_visibility(case)
    d = case.dims
    # keys that no row of any query head of a kv group can see
    hidden = ~visible.reshape(d.batch, d.kv_heads, d.group, d.q_len, d.kv_len).any(axis=(2, 3))
    assert (weights[~visible] == 0).all()
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    k, v = case.k.copy(), case.v.copy()
    k[hidden] = rng.normal(0, 100, k[hidden].shape)
    v[hidden] = rng.normal(0, 100, v[hidden].shape)
    perturbed = type(case)(case.dims, case.q, k, v, case.options)
    np.testing.assert_array_equal(perturbed.run(backend), case.run(backend))


@given(case=cases(dtypes=DTYPES, dims_strategy=dims(max_kv_heads=2, max_group=3)))
def test_grouped_query_equals_multi_head_with_repeated_kv(backend, case):
    group = case.dims.group
    repeated = type(case)(case.dims, case.q, np.repeat(case.k, group, axis=1),
                          np.repeat(case.v, group, axis=1), case.options)
    assert_close(repeated.run(backend), case.run(backend), case.dtype, case.dims.kv_len,
                 output_magnitude(case))
    out, vjp = case.vjp(backend)
    dout = np.random.default_rng(0).normal(size=out.shape).astype(case.dtype)
    dq, dk, dv = vjp(dout)[:3]
    dq_r, dk_r, dv_r = repeated.vjp(backend)[1](dout)[:3]
    d = case.dims
    grad_scale = gradient_magnitude(case, dout)
    assert_close(dq, dq_r, case.dtype, d.kv_len * d.head_dim, grad_scale, "dq")
    for name, ours, theirs in (("dk", dk, dk_r), ("dv", dv, dv_r)):
        summed = theirs.reshape(d.batch, d.kv_heads, group, *theirs.shape[2:]).sum(axis=2)
        assert_close(ours, summed, case.dtype, d.q_len * d.heads, grad_scale, name)


@given(case=cases(options=[o for o in ALL_OPTIONS if o not in ("causal", "window", "sinks")], dtypes=DTYPES))
def test_causal_equals_its_bottom_right_mask(backend, case):
    i, j = positions(case)
    mask = case.options.get("mask", True) & (j <= i)
    assert_close(case.run(backend, causal=True), case.run(backend, mask=mask), case.dtype,
                 case.dims.kv_len, output_magnitude(case))


@given(case=cases(dtypes=DTYPES), data=st.data())
def test_window_and_sinks_equal_their_band_mask(backend, case, data):
    d = case.dims
    bound = st.none() | st.integers(0, max(d.q_len, d.kv_len))
    left, right = data.draw(st.tuples(bound, bound))
    sinks = data.draw(st.integers(0, d.kv_len))
    causal = case.options.get("causal", False)
    i, j = positions(case)
    band = np.ones(np.broadcast_shapes(i.shape, j.shape), bool)
    if left is not None:
        band = band & (j >= i - left)
    if right is not None:
        band = band & (j <= i + right)
    if left is not None or right is not None:
        band = band | sink_keys(case, sinks)
    mask = case.options.get("mask", True) & band
    windowed = case.run(backend, window=(left, right), sinks=sinks)
    assert_close(windowed, case.run(backend, mask=mask, window=None, sinks=0), case.dtype, d.kv_len,
                 output_magnitude(case))
    if isinstance(case.options.get("window"), int) or left != right:
        return
    as_int = case.run(backend, window=left, sinks=sinks)  # an int w means (w, w), or (w, 0) when causal
    expected = case.run(backend, window=(left, 0 if causal else left), sinks=sinks)
    np.testing.assert_array_equal(as_int, expected)


@given(case=cases(options=[o for o in ALL_OPTIONS if o not in ("kv_lengths", "q_lengths")], dtypes=DTYPES),
       data=st.data())
def test_lengths_equal_padding_masks(backend, case, data):
    d = case.dims
    kv_lengths = np.array(data.draw(st.lists(st.integers(0, d.kv_len), min_size=d.batch, max_size=d.batch)))
    q_lengths = np.array(data.draw(st.lists(st.integers(0, d.q_len), min_size=d.batch, max_size=d.batch)))
    key_ok = np.arange(d.kv_len)[None, :] < kv_lengths[:, None]
    row_ok = np.arange(d.q_len)[None, :] < q_lengths[:, None]
    mask = case.options.get("mask", True) & key_ok[:, None, None, :] & row_ok[:, None, :, None]
    padded, lse = case.run(backend, kv_lengths=kv_lengths, q_lengths=q_lengths, return_lse=True)
    assert_close(padded, case.run(backend, mask=mask), case.dtype, d.kv_len, output_magnitude(case))
    assert (padded.transpose(0, 2, 1, 3)[~row_ok] == 0).all()
    assert np.isneginf(lse.transpose(0, 2, 1)[~row_ok]).all()


@given(case=cases(options=[o for o in ALL_OPTIONS if o != "alibi_slopes"], dtypes=DTYPES), data=st.data())
def test_alibi_equals_its_explicit_bias(backend, case, data):
    d = case.dims
    slopes = np.random.default_rng(data.draw(st.integers(0, 99))).uniform(0, 1, (d.batch, d.heads))
    i, j = positions(case)
    bias = case.options.get("bias", 0.0) - slopes[:, :, None, None] * np.abs(i - j)
    per_head = case.run(backend, alibi_slopes=slopes[0]) if d.batch == 1 else None
    assert_close(case.run(backend, alibi_slopes=slopes), case.run(backend, bias=bias), case.dtype,
                 d.kv_len, output_magnitude(case))
    if per_head is not None:
        np.testing.assert_array_equal(per_head, case.run(backend, alibi_slopes=slopes))


@given(case=cases(options=[o for o in ALL_OPTIONS if o not in POSITIONAL_OPTIONS or o == "dropout"]
                  + ["sink_logits"], dtypes=DTYPES))
def test_sink_logits_equal_an_extra_zero_valued_key(backend, case):
    d = case.dims
    sink = case.options.get("sink_logits")
    if sink is None:
        sink = np.linspace(-1, 1, d.heads)
    # append key j = Sk with k = 0 (score 0, also after softcap), v = 0 and bias = sink logit
    k = np.concatenate([case.k, np.zeros_like(case.k[:, :, :1])], axis=2)
    v = np.concatenate([case.v, np.zeros_like(case.v[:, :, :1])], axis=2)
    bias = np.broadcast_to(case.options.get("bias", np.zeros((1, 1, 1, 1))), d.scores_shape)
    sink_column = np.broadcast_to(sink[None, :, None, None], (d.batch, d.heads, d.q_len, 1))
    bias = np.concatenate([bias, sink_column], axis=-1)
    extended = dict(bias=bias, sink_logits=None)
    if "mask" in case.options:
        mask = np.broadcast_to(case.options["mask"], d.scores_shape)
        extended["mask"] = np.concatenate([mask, np.ones_like(mask[..., :1])], axis=-1)
    out, lse = case.run(backend, sink_logits=sink, return_lse=True)
    explicit = type(case)(case.dims, case.q, k, v, case.options)
    out_x, lse_x = explicit.run(backend, **extended, return_lse=True)
    has_key = np.isfinite(lse)  # the sink does not count as a visible key: empty rows stay empty
    assert_close(out[has_key], out_x[has_key], case.dtype, d.kv_len + 1, output_magnitude(case))
    assert_close(lse[has_key], lse_x[has_key], case.dtype, d.kv_len + 1,
                 1 + np.abs(lse_x[has_key]).max(initial=0))
    assert (out[~has_key] == 0).all()


@given(case=cases(options=[o for o in ALL_OPTIONS if o != "dropout"], dtypes=DTYPES),
       p=st.sampled_from([0.1, 0.3, 0.7]), seed=st.integers(-2**65, 2**65),
       offset=st.one_of(st.just((0, 0, 0, 0)), st.tuples(*[st.integers(0, 2**32 - 1)] * 4)))
def test_dropout_mask_is_the_specified_hash(backend, case, p, seed, offset):
    """With one-hot values, out[i, j] = P[i, j] * keep / (1 - p) exposes the mask itself
    (with ``dropout_offset``: the mask of the indices plus the offset)."""
    d = case.dims
    eye = np.broadcast_to(np.eye(d.kv_len, dtype=case.dtype), (d.batch, d.kv_heads, d.kv_len, d.kv_len))
    one_hot = type(case)(case.dims, case.q, case.k, eye, case.options)
    weights = one_hot.run(backend, return_weights=True)[1].astype(np.float64)
    dropped = one_hot.run(backend, dropout_p=p, seed=seed, dropout_offset=offset).astype(np.float64)
    expected = weights * keep_mask(np, seed, p, *d.scores_shape, offset=offset) / (1 - p)
    assert_close(dropped, expected, case.dtype, d.kv_len, 1 / (1 - p))
    np.testing.assert_array_equal(one_hot.run(backend, dropout_p=0.0, seed=seed), one_hot.run(backend))
    np.testing.assert_array_equal(one_hot.run(backend, dropout_p=p, seed=seed, dropout_offset=offset),
                                  dropped.astype(case.dtype))


@given(case=cases(options=["scale", "softcap", "bias"], dtypes=DTYPES), data=st.data())
def test_a_block_given_its_dropout_offset_draws_the_whole_problems_mask(backend, case, data):
    """Batches b0.., kv-head groups from h0, rows i0.. and keys [j0, j1) called alone with
    ``dropout_offset=(b0, h0, i0, j0)`` give the whole call's outputs and gradients on those
    rows when the whole call hides the other keys: one problem's mask, drawn in blocks (as
    ring attention draws it)."""
    d = case.dims
    b0 = data.draw(st.integers(0, d.batch - 1))
    g0 = data.draw(st.integers(0, d.kv_heads - 1))
    i0 = data.draw(st.integers(0, d.q_len - 1))
    j0 = data.draw(st.integers(0, d.kv_len - 1))
    j1 = data.draw(st.integers(j0 + 1, d.kv_len))
    h0 = g0 * d.group
    dropout = dict(dropout_p=0.5, seed=data.draw(st.integers(0, 2**64 - 1)))
    mask = np.zeros((d.q_len, d.kv_len), bool)
    mask[:, j0:j1] = True
    bias = case.options.get("bias")
    whole = case.with_options(mask=mask, **dropout)
    block_bias = None if bias is None else np.broadcast_to(bias, d.scores_shape)[b0:, h0:, i0:, j0:j1]
    block = type(case)(d, case.q[b0:, h0:, i0:], case.k[b0:, g0:, j0:j1], case.v[b0:, g0:, j0:j1],
                       {**case.options, "bias": block_bias, **dropout, "dropout_offset": (b0, h0, i0, j0)})
    (out, vjp), (block_out, block_vjp) = whole.vjp(backend), block.vjp(backend)
    rows = np.s_[b0:, h0:, i0:]
    assert_close(block_out, out[rows], case.dtype, j1 - j0, output_magnitude(case))
    dout = np.random.default_rng(0).normal(size=out.shape).astype(case.dtype)
    dq = vjp(dout)[0]
    dq_block = block_vjp(np.ascontiguousarray(dout[rows]))[0]
    assert_close(dq_block, dq[rows], case.dtype, j1 - j0, gradient_magnitude(case, dout))


def test_dropout_keeps_the_expected_fraction(backend):
    """Over 2**18 scores the kept fraction is within 5 standard deviations of 1 - p."""
    shape = (2, 4, 128, 256)
    v = np.broadcast_to(np.eye(256), (2, 4, 256, 256))
    q = np.zeros(shape[:3] + (8,))
    k = np.zeros((2, 4, 256, 8))
    n = np.prod(shape)
    for p in (0.1, 0.5, 0.9):
        kept = (npattn.attention(q, k, v, dropout_p=p, seed=7, backend=backend) != 0).mean()
        assert abs(kept - (1 - p)) < 5 * np.sqrt(p * (1 - p) / n), (p, kept)
    a = npattn.attention(q, k, v, dropout_p=0.5, seed=1, backend=backend)
    b = npattn.attention(q, k, v, dropout_p=0.5, seed=2, backend=backend)
    assert (a != b).mean() > 0.4  # two seeds disagree on about half of the scores


@given(case=cases(dtypes=DTYPES))
def test_layouts_agree(backend, case):
    out, lse = case.run(backend, return_lse=True)
    out_t, lse_t = case.run(backend, layout="bshd", return_lse=True)
    assert out_t.shape == (case.dims.batch, case.dims.q_len, case.dims.heads, case.dims.value_dim)
    np.testing.assert_array_equal(out_t, out.transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(lse_t, lse)
    _, vjp = case.vjp(backend)
    _, vjp_t = case.vjp(backend, layout="bshd")
    dout = np.random.default_rng(1).normal(size=out.shape).astype(case.dtype)
    grads, grads_t = vjp(dout), vjp_t(dout.transpose(0, 2, 1, 3))
    assert len(grads) == len(grads_t)
    for index, (grad, grad_t) in enumerate(zip(grads, grads_t)):
        in_layout = index < 3  # dq, dk, dv follow the layout; dbias and dsink_logits do not
        np.testing.assert_array_equal(grad_t, grad.transpose(0, 2, 1, 3) if in_layout else grad)


@given(case=cases(options=[o for o in ALL_OPTIONS if o not in ("scale", "softcap")], dtypes=DTYPES),
       scale=st.floats(0.05, 2.0))
def test_scale_equals_prescaled_queries(backend, case, scale):
    prescaled = type(case)(case.dims, (case.q.astype(np.float64) * scale * np.sqrt(case.dims.head_dim)),
                           case.k.astype(np.float64), case.v.astype(np.float64), case.options)
    magnitude = output_magnitude(case) * (1 + score_magnitude(case.with_options(scale=scale)))
    assert_close(case.run(backend, scale=scale), prescaled.run(backend), case.dtype, case.dims.kv_len,
                 magnitude)


@given(case=cases(options=[o for o in ALL_OPTIONS if o != "sink_logits"], dtypes=DTYPES), data=st.data())
def test_shifting_a_rows_scores_changes_only_its_lse(backend, case, data):
    d = case.dims
    shift = np.random.default_rng(data.draw(st.integers(0, 99))).uniform(-3, 3, (d.batch, d.heads, d.q_len, 1))
    out, lse = case.run(backend, return_lse=True)
    out_s, lse_s = case.run(backend, bias=case.options.get("bias", 0.0) + shift, return_lse=True)
    bias = case.options.get("bias", np.zeros(1))
    # the shifted scores reach |s| + |bias| + |shift|; their rounding scales with that
    score_size = 1 + score_magnitude(case) + np.abs(bias[np.isfinite(bias)]).max(initial=0) + np.abs(shift).max()
    assert_close(out_s, out, case.dtype, d.kv_len, output_magnitude(case) * score_size)
    assert_close(lse_s, lse + shift[..., 0], case.dtype, d.kv_len,
                 score_size + np.abs(lse[np.isfinite(lse)]).max(initial=0))


@given(case=cases(dtypes=DTYPES))
def test_rows_without_visible_keys_give_zeros_and_no_gradient(backend, case):
    mask = np.ones(case.dims.scores_shape, bool)
    mask[:, :, 0] = False  # row 0 of every head sees nothing
    case = case.with_options(mask=case.options.get("mask", True) & mask)
    out, lse, weights = case.run(backend, return_lse=True, return_weights=True)
    assert (out[:, :, 0] == 0).all() and np.isneginf(lse[:, :, 0]).all() and (weights[:, :, 0] == 0).all()
    (out_v, lse_v), vjp = case.vjp(backend, return_lse=True)
    dout = np.zeros_like(out_v)
    dout[:, :, 0] = 1.0  # a gradient on the empty rows only
    for grad in vjp(dout):
        assert not np.isnan(grad).any()
        assert (grad == 0).all()


@given(case=cases(dtypes=DTYPES))
def test_inputs_are_never_modified(backend, case):
    arrays = [case.q, case.k, case.v] + [a for a in case.options.values() if isinstance(a, np.ndarray)]
    copies = [a.copy() for a in arrays]
    for a in arrays:
        a.flags.writeable = False  # writing would raise
    out, vjp = case.vjp(backend)
    vjp(np.ones_like(out))
    for a, c in zip(arrays, copies):
        np.testing.assert_array_equal(a, c)


def explicit_visibility(case):
    """The API's visibility rule, spelled out independently of npattn.core.masks: (B, H, Sq, Sk)."""
    d, o = case.dims, case.options
    i, j = positions(case)
    visible = np.ones(d.scores_shape, bool) & o.get("mask", True)
    if o.get("causal"):
        visible &= j <= i
    window = o.get("window")
    if window is not None:
        left, right = window if isinstance(window, tuple) else (window, 0 if o.get("causal") else window)
        band = np.ones_like(j <= i)
        if left is not None:
            band = band & (j >= i - left)
        if right is not None:
            band = band & (j <= i + right)
        if left is not None or right is not None:
            band = band | sink_keys(case, o.get("sinks", 0))
        visible &= band
    if "kv_lengths" in o:
        visible &= j < o["kv_lengths"][:, None, None, None]
    if "q_lengths" in o:
        visible &= np.arange(d.q_len)[None, None, :, None] < o["q_lengths"][:, None, None, None]
    if "kv_start" in o:
        visible &= j >= o["kv_start"][:, None, None, None]
    if "q_start" in o:
        visible &= np.arange(d.q_len)[None, None, :, None] >= o["q_start"][:, None, None, None]
    if "bias" in o:
        visible &= ~np.isneginf(o["bias"])
    return visible


@given(case=cases(options=[o for o in ALL_OPTIONS if o != "softcap"], dtypes=DTYPES),
       softcap=st.floats(0.25, 8.0))
def test_softcap_equals_its_explicit_additive_correction(backend, case, softcap):
    """softcap replaces s by c * tanh(s / c) before bias: the same as adding c * tanh(s / c) - s."""
    d = case.dims
    scale = case.options.get("scale", 1 / np.sqrt(d.head_dim))
    keys = np.repeat(case.k.astype(np.float64), d.group, axis=1)
    scores = scale * case.q.astype(np.float64) @ keys.swapaxes(-1, -2)
    correction = softcap * np.tanh(scores / softcap) - scores
    explicit = case.run(backend, bias=case.options.get("bias", 0.0) + correction)
    magnitude = output_magnitude(case) * (1 + score_magnitude(case))
    assert_close(case.run(backend, softcap=softcap), explicit, case.dtype, d.kv_len, magnitude)


@given(case=cases(options=[o for o in ALL_OPTIONS if o != "dropout"], dtypes=DTYPES,
                  dims_strategy=dims(max_group=1)))
def test_vjp_reuses_the_forward_dropout_mask_when_seed_is_none(backend, case):
    """out is linear in v, so <dv, v> == <out, dout> exactly when the backward's mask is the forward's."""
    out, vjp = case.vjp(backend, dropout_p=0.5, seed=None)
    dout = np.random.default_rng(3).normal(size=out.shape)
    dv = vjp(dout.astype(case.dtype))[2]
    inner_out = float(np.sum(out.astype(np.float64) * dout))
    inner_v = float(np.sum(dv.astype(np.float64) * case.v))
    magnitude = float(np.abs(out).sum() * np.abs(dout).max(initial=0) + 1)
    assert abs(inner_out - inner_v) <= 2 * bound(case.dtype, case.dims.kv_len * out.size, magnitude)
