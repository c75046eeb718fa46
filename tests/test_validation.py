"""Every bad input of API.md's "Errors" list: the exception type, a message naming the
argument (and what was expected), raised before any kernel runs."""
import re

import numpy as np
import pytest

import npattn
import npattn.reference
from tolerances import assert_close

B, H, HKV, SQ, SK, D = 2, 8, 2, 5, 7, 4


def arrays(dtype=np.float32):
    rng = np.random.default_rng(0)
    return dict(q=rng.normal(size=(B, H, SQ, D)).astype(dtype),
                k=rng.normal(size=(B, HKV, SK, D)).astype(dtype),
                v=rng.normal(size=(B, HKV, SK, 3)).astype(dtype))


class FakeCupyArray:
    """Quacks like a CuPy array for the kind check, which must reject it before touching it."""

    __module__ = "cupy._core.core"
    dtype = np.dtype(np.float32)
    shape = (B, HKV, SK, D)
    ndim = 4


def replace(**changes):
    return lambda base: {**base, **changes}


BAD_INPUTS = [
    # (id, change to the valid arguments, exception, words the message must contain)
    ("int q", lambda a: {**a, "q": a["q"].astype(np.int32)}, TypeError, ["q", "floating", "int32"]),
    ("int k", lambda a: {**a, "k": a["k"].astype(np.int64)}, TypeError, ["k", "int64"]),
    ("dtype mix", lambda a: {**a, "k": a["k"].astype(np.float64)}, TypeError, ["k", "float64", "float32"]),
    ("rank 3 q", lambda a: {**a, "q": a["q"][0]}, ValueError, ["q", "4-D", "3-D"]),
    ("rank 5 v", lambda a: {**a, "v": a["v"][None]}, ValueError, ["v", "4-D", "5-D"]),
    ("batch", lambda a: {**a, "k": a["k"][:1], "v": a["v"][:1]}, ValueError, ["k", "batch", "1", "2"]),
    ("heads", lambda a: {**a, "k": np.zeros((B, 3, SK, D), np.float32), "v": np.zeros((B, 3, SK, 3), np.float32)},
     ValueError, ["k has 3 heads, which does not divide q's 8 heads"]),
    ("v heads", lambda a: {**a, "v": np.zeros((B, 4, SK, 3), np.float32)}, ValueError, ["v", "4", "2"]),
    ("v keys", lambda a: {**a, "v": np.zeros((B, HKV, SK + 1, 3), np.float32)}, ValueError, ["v", "Sk"]),
    ("head dim", lambda a: {**a, "k": np.zeros((B, HKV, SK, D + 1), np.float32)}, ValueError, ["k", "head dim"]),
    ("mixed kinds", lambda a: {**a, "k": FakeCupyArray()}, TypeError, ["k", "cupy", "numpy"]),
    ("mask shape", replace(mask=np.ones((3, SK), bool)), ValueError, ["mask", "(3, 7)", "broadcast"]),
    ("mask rank", replace(mask=np.ones((1, 1, 1, SQ, SK), bool)), ValueError, ["mask", "broadcast"]),
    ("mask dtype", replace(mask=np.ones((SQ, SK), np.float32)), TypeError, ["mask", "bool", "float32"]),
    ("bias shape", replace(bias=np.zeros((B, H, SQ, SK + 1))), ValueError, ["bias", "broadcast"]),
    ("bias dtype", replace(bias=np.zeros((SQ, SK), np.int64)), TypeError, ["bias", "int64"]),
    ("negative window", replace(window=-1), ValueError, ["window", "non-negative", "-1"]),
    ("negative window pair", replace(window=(2, -3)), ValueError, ["window", "non-negative"]),
    ("window triple", replace(window=(1, 2, 3)), ValueError, ["window", "(left, right)"]),
    ("float window", replace(window=2.5), TypeError, ["window", "2.5"]),
    ("negative sinks", replace(sinks=-2), ValueError, ["sinks", "-2"]),
    ("float sinks", replace(sinks=1.0), TypeError, ["sinks"]),
    ("sink_logits shape", replace(sink_logits=np.zeros(HKV)), ValueError, ["sink_logits", "(H,)", "(2,)"]),
    ("alibi shape", replace(alibi_slopes=np.zeros((H, B))), ValueError, ["alibi_slopes", "(8, 2)"]),
    ("alibi dtype", replace(alibi_slopes=np.zeros(H, np.int32)), TypeError, ["alibi_slopes", "int32"]),
    ("q_lengths dtype", replace(q_lengths=np.array([1.0, 2.0])), TypeError, ["q_lengths", "integer"]),
    ("q_lengths shape", replace(q_lengths=np.array([1, 2, 3])), ValueError, ["q_lengths", "(B,)", "(3,)"]),
    ("kv_lengths range", replace(kv_lengths=np.array([3, SK + 1])), ValueError, ["kv_lengths", "[0, 7]", "8"]),
    ("negative q_lengths", replace(q_lengths=np.array([-1, 2])), ValueError, ["q_lengths", "-1"]),
    ("dropout_p one", replace(dropout_p=1.0), ValueError, ["dropout_p", "[0, 1)", "1.0"]),
    ("dropout_p negative", replace(dropout_p=-0.1), ValueError, ["dropout_p", "-0.1"]),
    ("dropout_p nan", replace(dropout_p=float("nan")), ValueError, ["dropout_p", "nan"]),
    ("dropout_p string", replace(dropout_p="0.1"), TypeError, ["dropout_p"]),
    ("seed float", replace(dropout_p=0.1, seed=1.5), TypeError, ["seed", "1.5"]),
    ("scale inf", replace(scale=float("inf")), ValueError, ["scale", "inf"]),
    ("scale string", replace(scale="0.5"), TypeError, ["scale"]),
    ("softcap negative", replace(softcap=-1.0), ValueError, ["softcap", "-1.0"]),
    ("scale past float32", replace(scale=1e39), ValueError, ["scale", "float32", "1e+39"]),
    ("softcap past float32", replace(softcap=1e39), ValueError, ["softcap", "float32", "1e+39"]),
    ("softcap below float32's normals", replace(softcap=1e-40), ValueError, ["softcap", "float32", "1e-40"]),
    ("alibi nan", replace(alibi_slopes=np.full(H, np.nan)), ValueError, ["alibi_slopes[0]", "nan"]),
    ("alibi -inf", replace(alibi_slopes=np.r_[np.ones(H - 1), -np.inf]), ValueError, ["alibi_slopes[7]", "-inf"]),
    ("alibi overflowing its distances", replace(alibi_slopes=np.full((B, H), 1e38)), ValueError,
     ["alibi_slopes[0, 0]", "Sq + Sk = 12", "float32"]),
    ("sink_logits nan", replace(sink_logits=np.r_[np.zeros(H - 1), np.nan]), ValueError, ["sink_logits[7]", "nan"]),
    ("sink_logits +inf", replace(sink_logits=np.full(H, np.inf)), ValueError, ["sink_logits[0]", "finite"]),
    ("ragged list q", lambda a: {**a, "q": [[[[1.0, 2.0], [3.0]]]]}, ValueError, ["q", "one shape"]),
    ("ragged list bias", replace(bias=[[0.0, 1.0], [2.0]]), ValueError, ["bias", "one shape"]),
    ("causal string", replace(causal="yes"), ValueError, ["causal", "bool", '"top_left"', "'yes'"]),
    ("causal int", replace(causal=1), TypeError, ["causal", "bool", "int"]),
    ("causal top_left with q_offset", replace(causal="top_left", q_offset=2), ValueError, ["top_left", "q_offset=2"]),
    ("q_offset array shape", replace(q_offset=np.zeros(B + 1, np.int64)), ValueError, ["q_offset", f"({B},)"]),
    ("q_offset floats", replace(q_offset=np.zeros(B)), TypeError, ["q_offset", "float64"]),
    ("q_start past Sq", replace(q_start=np.full(B, 99)), ValueError, ["q_start[0]", "99", "Sq"]),
    ("kv_start negative", replace(kv_start=np.full(B, -1)), ValueError, ["kv_start[0]", "-1", "Sk"]),
    ("return_lse int", replace(return_lse=1), TypeError, ["return_lse", "bool"]),
    ("return_weights None", replace(return_weights=None), TypeError, ["return_weights", "bool"]),
    ("layout", replace(layout="bsdh"), ValueError, ["layout", "bhsd", "bshd", "bsdh"]),
    ("unknown backend", replace(backend="tpu"), ValueError, ["backend", "tpu", "reference"]),
    ("gpu backend on NumPy arrays", replace(backend="gpu"), ValueError, ["backend", "gpu", "CuPy"]),
]


@pytest.fixture
def no_kernel(monkeypatch):
    """Fail loudly if any backend starts computing: errors must come first."""
    def forbidden(*args, **kwargs):
        raise AssertionError("a kernel ran before the input was rejected")
    monkeypatch.setattr(npattn.reference, "forward", forbidden)


@pytest.mark.parametrize("change, error, words", [p[1:] for p in BAD_INPUTS], ids=[p[0] for p in BAD_INPUTS])
@pytest.mark.parametrize("entry", ["attention", "attention_vjp"])
def test_bad_input_is_rejected_naming_the_argument(no_kernel, entry, change, error, words):
    with pytest.raises(error) as raised:
        getattr(npattn, entry)(**change(arrays()))
    message = str(raised.value)
    for word in words:
        assert word in message, f"{word!r} missing from {message!r}"


def test_bad_cotangent_is_rejected():
    out, vjp = npattn.attention_vjp(**arrays(), backend="reference")
    with pytest.raises(ValueError, match=re.escape("dout must have the output's shape (2, 8, 5, 3)")):
        vjp(out[:, :, :2])
    with pytest.raises(TypeError, match="dout"):
        vjp(np.ones(out.shape, np.int32))


def test_empty_sequences_are_valid():
    a = arrays(np.float64)
    out, lse = npattn.attention(a["q"], a["k"][:, :, :0], a["v"][:, :, :0], return_lse=True)
    assert out.shape == (B, H, SQ, 3) and (out == 0).all() and np.isneginf(lse).all()
    out = npattn.attention(a["q"][:, :, :0], a["k"], a["v"])
    assert out.shape == (B, H, 0, 3)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_empty_batches_and_heads_work_forward_and_backward(backend):
    a = arrays(np.float32)
    for cut in ({"q": a["q"][:0], "k": a["k"][:0], "v": a["v"][:0]},            # B = 0
                {"q": a["q"][:, :, :0]},                                         # Sq = 0
                {"k": a["k"][:, :, :0], "v": a["v"][:, :, :0]},                  # Sk = 0
                {"v": np.zeros((B, HKV, SK, 0), np.float32)[..., :0]}):           # Dv = 0 is refused
        given = {**a, **cut}
        if given["v"].shape[-1] == 0:
            with pytest.raises(ValueError, match="head dims"):
                npattn.attention(**given, backend=backend)
            continue
        out, vjp = npattn.attention_vjp(**given, backend=backend)
        dq, dk, dv = vjp(np.ones_like(out))
        assert (dq.shape, dk.shape, dv.shape) == (given["q"].shape, given["k"].shape, given["v"].shape)
        assert np.isfinite(out).all() and np.isfinite(dq).all() and np.isfinite(dk).all()


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_huge_windows_and_sinks_mean_no_bound(backend):
    """Bounds past every distance (2**63 - 1 once overflowed the kernels' int64) change nothing."""
    a = arrays(np.float64)
    unbounded = npattn.attention(**a, backend="reference")
    causal = npattn.attention(**a, causal=True, backend="reference")
    def check(got, expected):  # the same sums, possibly over other tiles: rounding only
        assert_close(got, expected, np.float64, SK + D, np.abs(a["v"]).max())

    for huge in (SQ + SK, 2**31, 2**63 - 1, 2**63, 10**40):
        check(npattn.attention(**a, window=huge, backend=backend), unbounded)
        check(npattn.attention(**a, window=(huge, None), backend=backend), unbounded)
        check(npattn.attention(**a, causal=True, window=huge, sinks=huge, backend=backend), causal)


def test_big_endian_inputs_are_read_in_their_byte_order():
    a = arrays(np.float32)
    swapped = {name: x.astype(x.dtype.newbyteorder(">")) for name, x in a.items()}
    swapped["k"] = a["k"]  # mixed byte orders are one dtype
    np.testing.assert_array_equal(npattn.attention(**swapped, backend="reference"), npattn.attention(**a, backend="reference"))


def test_softcap_zero_means_none_and_array_likes_are_accepted():
    a = arrays(np.float64)
    np.testing.assert_array_equal(npattn.attention(**a, softcap=0.0), npattn.attention(**a))
    listed = {name: x.tolist() for name, x in a.items()}
    np.testing.assert_array_equal(npattn.attention(**listed), npattn.attention(**a))


def test_backends_report_availability_with_reasons():
    statuses = npattn.backends()
    assert set(statuses) == {"reference", "cpu", "gpu"}
    assert statuses["reference"] and statuses["reference"].reason is None
    for name, status in statuses.items():
        assert isinstance(status.available, bool)
        assert status.available or status.reason, name


