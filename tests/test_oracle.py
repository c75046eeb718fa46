"""Cross-check ``npattn.attention(backend="reference")`` against the independent loop oracle.

``tests/oracle_loop.py`` is a second formulation of the math (one query row at a time, in log
space, written without reading ``npattn/reference.py``). Every option of API.md section 1 is
drawn here, alone and combined, on small random problems.

Tolerances. Both sides compute in float64 when the inputs are float64, so the difference is
rounding only. A score carries an absolute error of about ``eps * |s|``, which becomes a relative
error of the same size in ``exp(s - lse)``, and sums over up to ``n = max(Sk, D, 1)`` terms add
``n * eps``; so we allow ``tol = eps * 64 * n * (1 + M) / (1 - dropout_p)`` for out, lse and
weights alike, where ``M`` bounds the magnitude of any score (and sink logit) of the case and
``eps = np.finfo(dtype).eps``. For float32 inputs the float32 output is compared with the oracle
run on the same float32 values upcast to float64, with the same formula and float32's eps.
-inf in lse must sit at exactly the same positions, and rows that are empty there must have
exactly zero output and weights.
"""

import math
import os
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from oracle_loop import dropout_hash, keep, loop_attention  # noqa: E402

ALL_OPTIONS = ("causal", "q_offset", "window", "sinks", "sink_logits", "mask", "bias", "alibi", "q_lengths",
               "kv_lengths", "q_start", "kv_start", "scale", "softcap", "dropout", "layout")

SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ----------------------------------------------------------------------------- strategies

def _floats(dtype, lo=-3.0, hi=3.0):
    return st.floats(lo, hi, width=32 if dtype == np.float32 else 64, allow_nan=False, allow_infinity=False)


@st.composite
def broadcast_shapes(draw, full):
    """A shape broadcastable to ``full``: a lower-rank suffix, with some axes collapsed to 1."""
    B, H, Sq, Sk = full
    named = [full, (Sq, Sk), (1, H, 1, Sk), (B, 1, Sq, Sk), (Sk,), (1, 1, Sq, 1), ()]
    if draw(st.booleans()):
        return draw(st.sampled_from(named))
    rank = draw(st.integers(0, 4))
    return tuple(n if draw(st.booleans()) else 1 for n in full[4 - rank:])


@st.composite
def window_values(draw):
    bound = st.none() | st.integers(0, 5)
    return draw(st.integers(0, 5) | st.tuples(bound, bound))


@st.composite
def problems(draw, dtype=np.float64, options=ALL_OPTIONS):
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 4))
    H = Hkv * draw(st.integers(1, 4 // Hkv))
    Sq = draw(st.integers(1, 9) | st.just(0))
    Sk = draw(st.integers(1, 9) | st.just(0))
    D = draw(st.integers(1, 8))
    Dv = draw(st.integers(1, 8))
    full = (B, H, Sq, Sk)
    on = {name: name in options and draw(st.booleans()) for name in ALL_OPTIONS}
    if len(options) == 1:
        on[options[0]] = True  # the single-option tests always exercise their option

    arr = lambda shape, lo=-3.0, hi=3.0: draw(hnp.arrays(dtype, shape, elements=_floats(dtype, lo, hi)))
    kw = {}
    q, k, v = arr((B, H, Sq, D)), arr((B, Hkv, Sk, D)), arr((B, Hkv, Sk, Dv))
    if on["causal"]:
        kw["causal"] = draw(st.sampled_from([True, "bottom_right", "top_left"]))
    if on["q_offset"] and kw.get("causal") != "top_left":
        kw["q_offset"] = draw(st.integers(-Sq - 2, Sk + 2)
                              | st.lists(st.integers(-Sq - 2, Sk + 2), min_size=B, max_size=B).map(np.array))
    if on["window"]:
        kw["window"] = draw(window_values())
    if on["sinks"]:
        kw["sinks"] = draw(st.integers(0, 4))
    if on["sink_logits"]:
        kw["sink_logits"] = arr((H,))
    if on["mask"]:
        shape = draw(broadcast_shapes(full))
        mask = draw(hnp.arrays(np.bool_, shape))
        if len(shape) >= 2 and shape[-2] == Sq and Sq > 0 and draw(st.booleans()):
            mask = mask.copy()
            mask[..., draw(st.integers(0, Sq - 1)), :] = False  # a fully masked row
        kw["mask"] = mask
    if on["bias"]:
        shape = draw(broadcast_shapes(full))
        elements = _floats(dtype)
        if draw(st.booleans()):
            elements = elements | st.just(-np.inf)
        kw["bias"] = draw(hnp.arrays(dtype, shape, elements=elements))
    if on["alibi"]:
        kw["alibi_slopes"] = arr(draw(st.sampled_from([(H,), (B, H)])), 0.0, 1.5)
    if on["q_lengths"]:
        kw["q_lengths"] = np.array(draw(st.lists(st.integers(0, Sq), min_size=B, max_size=B)), dtype=np.int64)
    if on["kv_lengths"]:
        kw["kv_lengths"] = np.array(draw(st.lists(st.integers(0, Sk), min_size=B, max_size=B)), dtype=np.int64)
    if on["q_start"]:
        kw["q_start"] = np.array(draw(st.lists(st.integers(0, Sq), min_size=B, max_size=B)), dtype=np.int64)
    if on["kv_start"]:
        kw["kv_start"] = np.array(draw(st.lists(st.integers(0, Sk), min_size=B, max_size=B)), dtype=np.int64)
    if on["scale"]:
        kw["scale"] = draw(st.floats(0.05, 2.0))
    if on["softcap"]:
        kw["softcap"] = draw(st.none() | st.just(0.0) | st.floats(0.5, 10.0))
    if on["dropout"]:
        kw["dropout_p"] = draw(st.floats(0.05, 0.9))
        kw["seed"] = draw(st.integers(-2**63, 2**64 - 1))
    if on["layout"]:
        kw["layout"] = "bshd"
        q, k, v = (np.ascontiguousarray(a.transpose(0, 2, 1, 3)) for a in (q, k, v))
    return q, k, v, kw


# ----------------------------------------------------------------------------- comparison

def score_bound(q, k, kw):
    """An upper bound M on |score| and |sink logit| for the case, used by the tolerance."""
    D = q.shape[-1]
    Sk = k.shape[2] if kw.get("layout", "bhsd") == "bhsd" else k.shape[1]
    scale = kw.get("scale") or 1.0 / math.sqrt(D)
    qk = scale * D * 9.0
    if kw.get("softcap"):
        qk = min(qk, kw["softcap"])
    m = qk + 3.0  # bias is bounded by 3 (or -inf, which is not a score)
    if kw.get("alibi_slopes") is not None:
        m += 1.5 * Sk
    if kw.get("sink_logits") is not None:
        m = max(m, 3.0)
    return m


def check_against_oracle(q, k, v, kw):
    import npattn

    Sk = k.shape[2] if kw.get("layout", "bhsd") == "bhsd" else k.shape[1]
    eps = np.finfo(q.dtype).eps
    p = kw.get("dropout_p", 0.0)
    tol = eps * 64 * max(Sk, q.shape[-1], 1) * (1.0 + score_bound(q, k, kw)) / (1.0 - p)

    q0, k0, v0 = q.copy(), k.copy(), v.copy()
    got = npattn.attention(q, k, v, backend="reference", return_lse=True, return_weights=True, **kw)
    exp_out, exp_lse, exp_w = loop_attention(q, k, v, **kw)  # upcasts float32 to float64 itself

    assert isinstance(got, tuple) and len(got) == 3
    out, lse, w = got
    for a, b in ((q, q0), (k, k0), (v, v0)):
        np.testing.assert_array_equal(a, b, err_msg="inputs were modified")
    assert out.dtype == q.dtype, f"out dtype {out.dtype} != q dtype {q.dtype}"
    if kw.get("layout", "bhsd") == "bshd":
        assert out.shape == exp_out.transpose(0, 2, 1, 3).shape
        out = out.transpose(0, 2, 1, 3)
    assert out.shape == exp_out.shape and lse.shape == exp_lse.shape and w.shape == exp_w.shape

    out, lse, w = (np.asarray(a, dtype=np.float64) for a in (out, lse, w))
    assert not np.isnan(out).any() and not np.isnan(lse).any() and not np.isnan(w).any()

    empty = np.isneginf(exp_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty, err_msg="-inf lse positions differ")
    assert np.isfinite(lse[~empty]).all()
    np.testing.assert_allclose(lse[~empty], exp_lse[~empty], rtol=tol, atol=tol, equal_nan=False,
                               err_msg="lse")
    assert (out[empty] == 0).all(), "empty rows must output exact zeros"
    assert (w[empty] == 0).all(), "empty rows must have zero weights"
    np.testing.assert_allclose(out, exp_out, rtol=tol, atol=tol, equal_nan=False, err_msg="out")
    np.testing.assert_allclose(w, exp_w, rtol=tol, atol=tol, equal_nan=False, err_msg="weights")


# ----------------------------------------------------------------------------- property tests

@SETTINGS
@given(data=st.data(), option=st.sampled_from(ALL_OPTIONS))
def test_single_option_float64(data, option):
    check_against_oracle(*data.draw(problems(np.float64, options=(option,))))


@SETTINGS
@given(case=problems(np.float64, options=()))
def test_plain_float64(case):
    check_against_oracle(*case)


@SETTINGS
@given(case=problems(np.float64))
def test_combined_float64(case):
    check_against_oracle(*case)


@SETTINGS
@given(case=problems(np.float32))
def test_combined_float32(case):
    check_against_oracle(*case)


@SETTINGS
@given(case=problems(np.float64, options=("causal", "window", "sinks", "q_lengths", "kv_lengths", "layout")))
def test_positions_float64(case):
    check_against_oracle(*case)


# ----------------------------------------------------------------------------- hand-picked cases

def _qkv(B=2, H=4, Hkv=2, Sq=5, Sk=7, D=4, Dv=3, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.uniform(-3, 3, (B, H, Sq, D)), rng.uniform(-3, 3, (B, Hkv, Sk, D)),
            rng.uniform(-3, 3, (B, Hkv, Sk, Dv)))


@pytest.mark.parametrize("kw, shape", [
    (dict(causal=True), dict(Sq=3, Sk=7)),                       # Sq < Sk: decoding-style
    (dict(causal=True), dict(Sq=7, Sk=3)),                       # Sq > Sk: first rows empty
    (dict(causal=True, window=2), dict(Sq=6, Sk=6)),
    (dict(window=(None, 1)), dict(Sq=4, Sk=8)),
    (dict(window=(1, None), sinks=2), dict(Sq=8, Sk=4)),
    (dict(causal=True, window=1, sinks=2, sink_logits=np.array([0.5, -1.0, 2.0, 0.0])), {}),
    (dict(mask=np.zeros((5, 7), bool)), {}),                      # everything masked
    (dict(bias=np.full((1, 4, 1, 7), -np.inf)), {}),              # -inf everywhere, even with a sink
    (dict(bias=np.full((7,), -np.inf), sink_logits=np.ones(4)), {}),
    (dict(q_lengths=np.array([0, 3]), kv_lengths=np.array([7, 0])), {}),
    (dict(alibi_slopes=np.array([[0.5, 0.25, 0.125, 1.0], [1.0, 0.0, 0.5, 0.1]]), causal=True), {}),
    (dict(softcap=1.5, scale=0.9, dropout_p=0.5, seed=2**40 + 3), dict(Hkv=1)),
    (dict(dropout_p=0.3, seed=-7, layout="bshd"), {}),
])
def test_hand_picked(kw, shape):
    q, k, v = _qkv(**shape)
    if kw.get("layout") == "bshd":
        q, k, v = (np.ascontiguousarray(a.transpose(0, 2, 1, 3)) for a in (q, k, v))
    check_against_oracle(q, k, v, kw)


# ----------------------------------------------------------------------------- dropout hash

def test_dropout_hash_golden():
    # Computed once with oracle_loop.dropout_hash from the spec in npattn/core/dropout.py.
    assert dropout_hash(0, 0, 0, 0, 0) == 3136461558
    assert dropout_hash(12345, 1, 2, 3, 4) == 113364721
    assert dropout_hash(2**40 + 7, 1, 3, 8, 5) == 959822599
    assert dropout_hash(-1, 0, 1, 2, 3) == dropout_hash(2**64 - 1, 0, 1, 2, 3) == 2941536466


def test_dropout_hash_matches_keep_mask():
    from npattn.core.dropout import keep_mask

    rng = np.random.default_rng(1234)
    seeds = [0, 1, 2**32 - 1, 2**32, 2**32 + 1, 2**63, 2**64 - 1, 2**64 + 5, 2**70 + 11, -1, -2**32, -2**63]
    seeds += [int(s) for s in rng.integers(-2**62, 2**62, 38)]
    B, H, Sq, Sk = 3, 4, 9, 11
    for n, seed in enumerate(seeds):
        p = [0.0, 0.1, 0.5, 0.9, 1e-9][n % 5]
        b, h, i, j = (int(rng.integers(0, m)) for m in (B, H, Sq, Sk))
        mask = keep_mask(np, seed, p, B, H, Sq, Sk)
        assert mask.shape == (B, H, Sq, Sk) and mask.dtype == np.bool_
        assert bool(mask[b, h, i, j]) == keep(seed, p, b, h, i, j), (seed, p, b, h, i, j)
    # a whole mask, once, element by element
    mask = keep_mask(np, 2**33 + 5, 0.4, 2, 3, 4, 5)
    expected = [[[[keep(2**33 + 5, 0.4, b, h, i, j) for j in range(5)] for i in range(4)] for h in range(3)]
                for b in range(2)]
    np.testing.assert_array_equal(mask, np.array(expected))
    # with dropout_offset: the indices plus the offsets, wrapping mod 2**32
    offset = (1, 2**32 - 2, 7, 2**31)
    mask = keep_mask(np, 99, 0.5, 2, 3, 4, 5, offset=offset)
    expected = [[[[keep(99, 0.5, b + 1, h + 2**32 - 2, i + 7, j + 2**31) for j in range(5)] for i in range(4)]
                 for h in range(3)] for b in range(2)]
    np.testing.assert_array_equal(mask, np.array(expected))
