"""npattn.testing catches real kernel bugs: a property test written with it in a few lines,
with the default settings, fails for each classic attention bug and passes correct float32
and float16 kernels (the demonstration docs/tutorials/testing.rst walks through)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis.errors import Flaky  # noqa: F401  (hypothesis re-raises a failing example as itself)

import npattn.testing as nt

BUGS = ("scale", "causal_diagonal", "no_max_subtraction", "gqa_mapping", "window", "dropout_renormalized")


def my_attention(q, k, v, causal=False, window=None, scale=None, dropout_p=0.0, keep=None, bug=None):
    """A materialized attention kernel (bhsd), as a user would write one: float32 math for
    float16/float32 inputs, bottom-right causal alignment, GQA, windows, inverted dropout
    with a given keep mask; ``bug`` plants one classic mistake."""
    batch, heads, q_len, dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    compute = np.float64 if q.dtype == np.float64 else np.float32
    kv_head = np.arange(heads) % kv_heads if bug == "gqa_mapping" else np.arange(heads) // (heads // kv_heads)
    keys, values = k[:, kv_head].astype(compute), v[:, kv_head].astype(compute)
    scale = (1 / dim if bug == "scale" else 1 / math.sqrt(dim)) if scale is None else scale
    with np.errstate(all="ignore"):
        s = (q.astype(compute) @ keys.transpose(0, 1, 3, 2)) * compute(scale)
        i = np.arange(q_len)[:, None] + (kv_len - q_len)  # each row's key position
        j = np.arange(kv_len)[None, :]
        visible = np.ones((q_len, kv_len), bool)
        if causal:
            visible &= (j < i) if bug == "causal_diagonal" else (j <= i)
        if window is not None:
            left, right = window
            visible &= (j >= i - left + (1 if bug == "window" else 0)) & (j <= i + right)
        s = np.where(visible, s, -np.inf)
        top = np.zeros_like(s[..., :1]) if bug == "no_max_subtraction" else s.max(axis=-1, keepdims=True)
        top = np.where(np.isfinite(top), top, 0)
        e = np.exp(s - top)
        if dropout_p and bug == "dropout_renormalized":  # dropped before the normalization
            e = np.where(keep, e, 0)
        total = e.sum(axis=-1, keepdims=True)
        p = np.where(total > 0, e / np.where(total > 0, total, 1), 0)
        if dropout_p and bug != "dropout_renormalized":
            p = np.where(keep, p / (1 - dropout_p), 0)
        return (p.astype(q.dtype).astype(compute) @ values).astype(q.dtype)


def run_kernel(problem, bug=None):
    options = dict(problem.options)
    dropout_p = options.pop("dropout_p", 0.0)
    options.pop("seed", None)
    keep = nt.dropout_keep(problem) if dropout_p else None
    return my_attention(problem.q, problem.k, problem.v, dropout_p=dropout_p, keep=keep, bug=bug, **options)


PROBLEMS = dict(options=("causal", "window", "scale", "dropout_p"), max_heads=4)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_correct_kernel_passes(dtype):
    @given(nt.attention_problems(dtypes=(dtype,), **PROBLEMS))
    def property_test(problem):
        nt.assert_attention_close(run_kernel(problem), problem)
    property_test()


@pytest.mark.parametrize("bug", BUGS)
def test_each_classic_bug_fails_the_property(bug):
    # Hypothesis's default count of examples (100), which a user's test has, not the ci
    # profile's 50: at 50, 3 of 20 seeds missed the GQA mapping or the window bug (at 100,
    # none of 20 missed any); the derandomized examples differed between a clean clone, which
    # missed no_max_subtraction, and the working checkout, which missed gqa_mapping
    @settings(max_examples=100)
    @given(nt.attention_problems(dtypes=("float32",), **PROBLEMS))
    def property_test(problem):
        nt.assert_attention_close(run_kernel(problem, bug), problem)
    with pytest.raises(AssertionError):
        property_test()


def test_the_low_precision_rule_passes_a_correct_float16_kernel_and_fails_a_wrong_scale():
    @given(nt.attention_problems(dtypes=("float16",), options=("causal", "window", "scale")))
    def correct(problem):
        nt.assert_attention_close(run_kernel(problem), problem, rule="low_precision_reference")

    @given(nt.attention_problems(dtypes=("float16",), options=("causal",)))
    def wrong_scale(problem):
        nt.assert_attention_close(run_kernel(problem, "scale"), problem, rule="low_precision_reference")
    correct()
    with pytest.raises(AssertionError):
        wrong_scale()


@settings(max_examples=25)
@given(nt.attention_problems(dtypes=("float32", "float64"), layouts=("bhsd", "bshd"),
                             options=tuple(name for name in nt.OPTION_NAMES)))
def test_npattn_passes_its_own_checks_for_every_option_and_layout(problem):
    """npattn's CPU backend, forward and backward, against the same checks (every option)."""
    import npattn

    outputs, vjp = npattn.attention_vjp(problem.q, problem.k, problem.v, layout=problem.layout, **problem.options)
    nt.assert_attention_close(outputs, problem)
    out = outputs[0] if isinstance(outputs, tuple) else outputs
    dout = np.random.default_rng(0).standard_normal(out.shape).astype(out.dtype)
    nt.assert_attention_grads_close(*vjp(dout)[:3], problem, dout)


def test_bad_selections_are_named():
    with pytest.raises(ValueError, match="options must be a non-empty selection of .*got \\('softmax_scale',\\)"):
        nt.attention_problems(options=("softmax_scale",))
    with pytest.raises(ValueError, match="dtypes"):
        nt.attention_problems(dtypes=("int8",))
    with pytest.raises(ValueError, match="max_seq must be an int >= 1"):
        nt.attention_problems(max_seq=0)
