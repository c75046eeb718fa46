"""Malformed calls of attention and attention_vjp, drawn at random: each raises ValueError, TypeError or MemoryError whose
message names the argument at fault, before any kernel runs, and modifies no input.

One valid call is built from drawn sizes, then one argument is broken by a drawn
mutation (wrong rank, dtype, shape, kind, range or value). The CI profile draws 400
calls per backend; ``--hypothesis-profile=dev`` draws 2000.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn
from conftest import NUMPY_BACKENDS

CALLS = 2000 if settings().max_examples >= 1000 else 400


def _base(draw):
    batch, kv_heads, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    q_len, kv_len, dim = draw(st.integers(1, 5)), draw(st.integers(1, 5)), draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    q = rng.standard_normal((batch, kv_heads * group, q_len, dim)).astype(np.float32)
    k = rng.standard_normal((batch, kv_heads, kv_len, dim)).astype(np.float32)
    v = rng.standard_normal((batch, kv_heads, kv_len, dim)).astype(np.float32)
    return {"q": q, "k": k, "v": v}


def _shape_of(arrays, name):
    return arrays[name].shape


# Each mutation: (argument named in the error, function of (draw, arrays) -> the broken value)
_NOT_ARRAYS = st.sampled_from(["text", None, {"a": 1}, object(), [[1.0], [1.0, 2.0]]])
_MUTATIONS = {
    "q": [lambda d, a: a["q"][0], lambda d, a: a["q"][None], lambda d, a: a["q"].astype(np.int32),
          lambda d, a: a["q"].astype(np.complex64), lambda d, a: a["q"].astype(bool),
          lambda d, a: d(_NOT_ARRAYS), lambda d, a: np.concatenate([a["q"], a["q"]], axis=-1),
          lambda d, a: np.concatenate([a["q"], a["q"]], axis=0)],
    "k": [lambda d, a: a["k"].astype(np.float64), lambda d, a: a["k"][..., :-1] if a["k"].shape[-1] > 1
          else np.concatenate([a["k"], a["k"]], -1), lambda d, a: np.concatenate([a["k"], a["k"]], 0),
          lambda d, a: d(_NOT_ARRAYS), lambda d, a: a["k"][0]],
    "v": [lambda d, a: np.concatenate([a["v"], a["v"]], 2), lambda d, a: a["v"].astype(np.float16),
          lambda d, a: d(_NOT_ARRAYS), lambda d, a: np.concatenate([a["v"], a["v"]], 1)],
    "causal": [lambda d, a: d(st.sampled_from(["yes", 1, None, 0.0]))],
    "window": [lambda d, a: d(st.sampled_from([-1, 1.5, "2", (1, 2, 3), (-1, 0), (0, "x")]))],
    "sinks": [lambda d, a: d(st.sampled_from([-1, 1.5, "3", None]))],
    "mask": [lambda d, a: np.ones((2, 3, 7, 11), bool), lambda d, a: np.ones(_scores(a), np.float32),
             lambda d, a: d(_NOT_ARRAYS.filter(lambda x: x is not None))],
    "bias": [lambda d, a: np.zeros((3, 7, 11), np.float32), lambda d, a: np.zeros(_scores(a), np.int64),
             lambda d, a: np.zeros(_scores(a), bool)],
    "alibi_slopes": [lambda d, a: np.ones(a["q"].shape[1] + 1), lambda d, a: np.full(a["q"].shape[1], np.nan),
                     lambda d, a: np.ones(a["q"].shape[1], np.int32)],
    "sink_logits": [lambda d, a: np.ones(a["q"].shape[1] + 2), lambda d, a: np.full(a["q"].shape[1], np.inf)],
    "q_lengths": [lambda d, a: np.full(a["q"].shape[0], -1), lambda d, a: np.full(a["q"].shape[0], 99),
                  lambda d, a: np.ones(a["q"].shape[0], np.float32), lambda d, a: np.ones(a["q"].shape[0] + 1, int)],
    "kv_lengths": [lambda d, a: np.full(a["k"].shape[0], a["k"].shape[2] + 1), lambda d, a: "3"],
    "scale": [lambda d, a: d(st.sampled_from([float("nan"), float("inf"), "0.5", 1e300, [1.0]]))],
    "softcap": [lambda d, a: d(st.sampled_from([-1.0, float("nan"), "2", 1e-300]))],
    "dropout_p": [lambda d, a: d(st.sampled_from([1.0, -0.1, "0.1", float("nan")]))],
    "seed": [lambda d, a: d(st.sampled_from([1.5, "7", [1]]))],
    "layout": [lambda d, a: d(st.sampled_from(["bhds", "BHSD", None, 3]))],
    "return_lse": [lambda d, a: d(st.sampled_from(["yes", 1, None]))],
    "return_weights": [lambda d, a: d(st.sampled_from(["no", 0, None]))],
    "check_finite": [lambda d, a: d(st.sampled_from(["true", 1]))],
    "backend": [lambda d, a: d(st.sampled_from(["tpu", "CPU", 1, None]))],
}


def _scores(arrays):
    b, h, sq, _ = arrays["q"].shape
    return (b, h, sq, arrays["k"].shape[2])


@st.composite
def malformed_calls(draw):
    """``(arrays, options, name)``: a call whose argument ``name`` is broken."""
    arrays = _base(draw)
    name = draw(st.sampled_from(sorted(_MUTATIONS)))
    broken = draw(st.sampled_from(_MUTATIONS[name]))(draw, arrays)
    options = {}
    if name in arrays:
        arrays[name] = broken
    else:
        options[name] = broken
        if name == "seed":
            options["dropout_p"] = 0.5
    return arrays, options, name


def _snapshot(values):
    return [np.array(v, copy=True) if isinstance(v, np.ndarray) else None for v in values]


@settings(max_examples=CALLS)
@given(call=malformed_calls(), entry=st.sampled_from([npattn.attention, npattn.attention_vjp]))
@pytest.mark.parametrize("backend", NUMPY_BACKENDS)
def test_a_malformed_call_raises_an_error_naming_its_argument(backend, call, entry):
    arrays, options, name = call
    options = {"backend": backend, **options}
    values = [arrays["q"], arrays["k"], arrays["v"], *options.values()]
    before = _snapshot(values)
    with pytest.raises((ValueError, TypeError, MemoryError)) as raised:
        entry(arrays["q"], arrays["k"], arrays["v"], **options)
    message = str(raised.value)
    # as a word: a bare substring test would take the "v" of "value" for the argument v.
    # A shape that disagrees may be named from either side (k's heads against q's).
    named = {"q": ("q", "k", "v"), "k": ("k", "q"), "v": ("v", "k")}.get(name, (name,))
    assert any(re.search(rf"(?<![\w.]){re.escape(n)}(?!\w)", message) for n in named), f"{name}: {message}"
    for value, copy in zip(values, before):
        if copy is not None:
            np.testing.assert_array_equal(value, copy, err_msg=f"{name}: an input was modified")


@settings(max_examples=CALLS // 4)
@given(dout=st.sampled_from(["shape", "dtype", "kind", "rank"]), seed=st.integers(0, 2**16))
def test_a_malformed_cotangent_is_named(dout, seed):
    q = np.random.default_rng(seed).standard_normal((1, 2, 3, 4)).astype(np.float32)
    out, vjp = npattn.attention_vjp(q, q, q, backend="cpu")
    broken = {"shape": out[..., :-1], "dtype": out.astype(np.int32), "kind": "grad", "rank": out[0]}[dout]
    with pytest.raises((ValueError, TypeError), match="dout"):
        vjp(broken)
