"""Inputs with unusual memory give what their contiguous copies give: broadcast views
(stride 0, as ``np.broadcast_to`` makes), negative strides, Fortran order, big-endian,
read-only and misaligned buffers, for q, k, v, bias, mask and dout, and for the out and
lse that ``attention_backward`` is given. Every backend either
reads such an array as it lies or copies it once; none reads past its buffer, and none
writes to it.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import npattn
from conftest import NUMPY_BACKENDS
from strategies import cases, dims
from tolerances import assert_close, gradient_magnitude, output_magnitude, score_magnitude

VIEW_KINDS = ("contiguous", "broadcast", "reversed", "fortran", "big_endian", "read_only", "misaligned")
# CuPy has no big-endian arrays, and a GPU cannot load an element from a misaligned address
DEVICE_VIEW_KINDS = ("contiguous", "broadcast", "reversed", "fortran", "read_only")
VIEWED = ("q", "k", "v", "bias", "mask", "dout", "out", "lse")


def odd_view(array, kind):
    """A view of ``array``'s values (for "broadcast": of its first row along the second-to-last
    axis, repeated) whose memory is of ``kind``."""
    if kind == "broadcast":
        return np.broadcast_to(array[..., :1, :], array.shape) if array.ndim >= 2 else array
    if kind == "reversed":
        return np.ascontiguousarray(array[..., ::-1, :])[..., ::-1, :] if array.ndim >= 2 else array
    if kind == "fortran":
        return np.asfortranarray(array)
    if kind == "big_endian":
        return array.astype(array.dtype.newbyteorder(">"))
    if kind == "read_only":
        copy = array.copy()
        copy.flags.writeable = False
        return copy
    if kind == "misaligned":
        buffer = np.zeros(array.nbytes + 1, np.uint8)
        view = buffer[1:].view(array.dtype).reshape(array.shape)
        view[...] = array
        return view
    return np.ascontiguousarray(array)


@st.composite
def viewed_cases(draw, kinds=VIEW_KINDS, dtypes=("float32", "float64")):
    case = draw(cases(options=("mask", "bias", "causal", "sink_logits", "softcap"), dtypes=dtypes,
                      dims_strategy=dims(max_len=12, max_dim=10)))
    return case, {name: draw(st.sampled_from(kinds)) for name in VIEWED}


def check_odd_views(backend, case, kinds):
    """``backend`` on odd views against the same values made contiguous; inputs untouched."""
    arrays = {"q": case.q, "k": case.k, "v": case.v, **{n: case.options[n] for n in ("bias", "mask") if n in case.options}}
    rng = np.random.default_rng(1)
    batch, heads, q_len, value_dim = case.dims.batch, case.dims.heads, case.dims.q_len, case.dims.value_dim
    arrays["dout"] = rng.normal(size=(batch, heads, q_len, value_dim)).astype(case.dtype)
    viewed = {name: odd_view(array, kinds[name]) for name, array in arrays.items()}
    plain = {name: np.ascontiguousarray(array) for name, array in viewed.items()}
    before = {name: array.tobytes() for name, array in viewed.items()}

    def run(given):
        options = {**case.options, **{n: given[n] for n in ("bias", "mask") if n in given}}
        (out, lse), vjp = npattn.attention_vjp(given["q"], given["k"], given["v"], return_lse=True,
                                               backend=backend, **options)
        return out, lse, vjp(given["dout"])

    out, lse, grads = run(viewed)
    exact_out, exact_lse, exact_grads = run(plain)
    for name, array in viewed.items():
        assert array.tobytes() == before[name], f"{name} was modified"
    d = case.dims
    magnitude = output_magnitude(case) * (1 + score_magnitude(case))
    assert_close(out, exact_out, case.dtype, d.kv_len + d.head_dim, magnitude, "out")
    assert_close(lse, exact_lse, case.dtype, d.kv_len + d.head_dim, 1 + score_magnitude(case) + np.abs(
        exact_lse[np.isfinite(exact_lse)]).max(initial=0), "lse")
    length = d.q_len * d.group + d.kv_len + d.head_dim + d.value_dim
    for grad, expected in zip(grads, exact_grads):
        assert_close(grad, expected, case.dtype, length, gradient_magnitude(case, plain["dout"]) * max(1, d.q_len),
                     "gradient")

    # attention_backward reads a forward's out and lse as they lie too (a slice of a longer
    # lse, as ring attention passes, is not contiguous)
    saved = {"out": odd_view(exact_out, kinds["out"]), "lse": odd_view(exact_lse, kinds["lse"])}
    saved_before = {name: array.tobytes() for name, array in saved.items()}
    options = {**case.options, **{n: viewed[n] for n in ("bias", "mask") if n in viewed}}
    grads = npattn.attention_backward(viewed["q"], viewed["k"], viewed["v"], saved["out"], saved["lse"],
                                      viewed["dout"], backend=backend, **options)
    exact_grads = npattn.attention_backward(plain["q"], plain["k"], plain["v"], np.ascontiguousarray(saved["out"]),
                                            np.ascontiguousarray(saved["lse"]), plain["dout"], backend=backend,
                                            **{**case.options, **{n: plain[n] for n in ("bias", "mask") if n in plain}})
    for name, array in saved.items():
        assert array.tobytes() == saved_before[name], f"{name} was modified"
    for grad, expected in zip(grads, exact_grads):
        assert_close(grad, expected, case.dtype, length, gradient_magnitude(case, plain["dout"]) * max(1, d.q_len),
                     "attention_backward's gradient")


@pytest.mark.parametrize("backend", NUMPY_BACKENDS)
@given(drawn=viewed_cases())
def test_odd_views_give_what_their_contiguous_copies_give(backend, drawn):
    check_odd_views(backend, *drawn)


@pytest.mark.parametrize("backend", NUMPY_BACKENDS)
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_a_sequence_broadcast_operand_is_read_within_its_buffer(backend, name):
    """The fuzz run's case: one row repeated by a zero stride, once read past its end."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, 8, 16), dtype=np.float32) for _ in range(3))
    arrays = {"q": q, "k": k, "v": v}
    arrays[name] = np.broadcast_to(arrays[name][:, :, :1], arrays[name].shape)
    got = npattn.attention(**arrays, backend=backend)
    exact = npattn.attention(*(np.ascontiguousarray(arrays[n]).astype(np.float64) for n in "qkv"), backend="reference")
    assert_close(got, exact, np.float32, 8 + 16, 4.0)
