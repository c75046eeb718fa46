"""JAX arrays in, JAX arrays out: npattn.attention on concrete JAX arrays, and
npattn.jax's custom_vjp under jit, grad and vmap (skipped without JAX: the
test-frameworks extra installs it)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn
from strategies import cases, layouts, to_layout
from tolerances import assert_close

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

import npattn.jax  # noqa: E402  (needs JAX)

jax.config.update("jax_platforms", "cpu")
FLOATS = ("float16", "float32", "float64")


@pytest.fixture(autouse=True)
def float64_arrays():
    """float64 arrays stay float64 (JAX narrows them to float32 by default)."""
    with jax.enable_x64(True):
        yield


def jax_arrays(case, layout):
    q, k, v = (jnp.asarray(to_layout(a, layout)) for a in (case.q, case.k, case.v))
    options = {name: jnp.asarray(value) if isinstance(value, np.ndarray) else value
               for name, value in case.options.items()}
    return q, k, v, {**options, "layout": layout}


@given(cases(dtypes=FLOATS), layouts, st.booleans())
def test_jax_arrays_in_give_the_same_outputs_as_numpy_as_jax_arrays(case, layout, extras):
    q, k, v, options = jax_arrays(case, layout)
    wanted = {"return_lse": extras, "return_weights": extras}
    ours = npattn.attention(q, k, v, **options, **wanted)
    expected = case.run("cpu", layout, **wanted)
    ours, expected = (ours, expected) if extras else ((ours,), (expected,))
    for array, reference in zip(ours, expected):
        assert isinstance(array, jax.Array) and array.dtype == reference.dtype
        np.testing.assert_array_equal(np.asarray(array), reference)


@settings(max_examples=30)
@given(cases(dtypes=FLOATS), layouts)
def test_jit_grad_gives_the_vjps_gradients(case, layout):
    """The backward (attention_backward from the residuals: out, or a float16 call's
    float32 out) gives attention_vjp's gradients bit for bit."""
    q, k, v, options = jax_arrays(case, layout)
    names = [name for name in ("bias", "sink_logits") if name in options]
    for name in names:
        options[name] = options[name].astype(q.dtype)
    expected_out, expected_vjp = case.vjp("cpu", layout, **{name: np.asarray(options[name]) for name in names})
    dout = np.random.default_rng(2).standard_normal(expected_out.shape).astype(expected_out.dtype)
    constants = {name: value for name, value in options.items() if name not in names}

    def loss(q, k, v, *differentiable):
        out = npattn.attention(q, k, v, **constants, **dict(zip(names, differentiable)))  # tracers: npattn.jax
        return (out * dout).sum()
    grads = jax.jit(jax.grad(loss, argnums=tuple(range(3 + len(names)))))(q, k, v, *(options[n] for n in names))
    for name, grad, expected in zip(["dq", "dk", "dv", *names], grads, expected_vjp(dout)):
        assert grad.dtype == expected.dtype
        np.testing.assert_array_equal(np.asarray(grad), expected, err_msg=name)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_16_bit_one_hot_row_has_an_exact_zero_dq(dtype):
    """One key at scale 1e4: its row is one-hot, so dq is exactly 0, as attention_vjp gives
    it: the forward under differentiation keeps its float32 out as the residual
    (npattn.attention_for_backward), where the 16-bit out would leave dq about 0.4 k."""
    rng = np.random.default_rng(7)
    q, k = (jnp.asarray(rng.standard_normal((1, 1, 1, 16)).astype(dtype)) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((1, 1, 1, 2)).astype(dtype))
    dout = jnp.asarray([[[[0.5, -1.0]]]], dtype)
    options = dict(dropout_p=0.1, seed=0, scale=1e4)
    out, pullback = jax.vjp(lambda q, k, v: npattn.jax.attention(q, k, v, **options), q, k, v)
    dq, dk, _ = jax.jit(pullback)(dout)
    assert not np.asarray(dq, np.float64).any() and not np.asarray(dk, np.float64).any()
    np.testing.assert_array_equal(np.asarray(out), np.asarray(npattn.jax.attention(q, k, v, **options)))
    _, lse = npattn.attention(*(np.asarray(a) for a in (q, k, v)), return_lse=True, **options)
    rounded = npattn.attention_backward(*(np.asarray(a) for a in (q, k, v, out, lse, dout)), **options)
    assert np.asarray(rounded[0], np.float64).any()


def every_option(dtype=np.float64):
    rng = np.random.default_rng(5)
    B, H, HKV, SQ, SK, D = 2, 4, 2, 5, 7, 3

    def array(*shape):
        return jnp.asarray(rng.standard_normal(shape).astype(dtype))
    options = dict(causal=True, window=(3, 1), sinks=1, mask=jnp.asarray(rng.random((SQ, SK)) < 0.8),
                   alibi_slopes=jnp.asarray([0.5, 0.25, 0.1, 0.05]), q_lengths=jnp.asarray([4, 5]),
                   kv_lengths=jnp.asarray([6, 7]), scale=0.4, softcap=3.0, dropout_p=0.2, seed=11,
                   layout="bshd")
    return (array(B, SQ, H, D), array(B, SK, HKV, D), array(B, SK, HKV, D), array(1, H, SQ, SK), array(H)), options


def test_check_grads_with_every_option_on():
    inputs, options = every_option()
    check_grads(lambda q, k, v, bias, sinks: npattn.jax.attention(q, k, v, bias=bias, sink_logits=sinks, **options),
                inputs, order=1, modes=["rev"])


def test_vmap_maps_over_a_leading_axis():
    (q, k, v, bias, sinks), options = every_option(np.float32)
    batched = jnp.stack([q, 2 * q, -q])
    outs = jax.vmap(lambda q: npattn.jax.attention(q, k, v, bias=bias, **options))(batched)
    for out, one in zip(outs, batched):
        np.testing.assert_array_equal(np.asarray(out), np.asarray(npattn.jax.attention(one, k, v, bias=bias, **options)))
    grads = jax.vmap(jax.grad(lambda q: npattn.jax.attention(q, k, v, **options).sum()))(batched)
    assert grads.shape == batched.shape


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_round_trip_keeps_dtype(dtype):
    (q, k, v, bias, sinks), options = every_option(np.float32)
    q, k, v = (a.astype(dtype) for a in (q, k, v))
    out, lse = npattn.attention(q, k, v, return_lse=True, **options)
    assert out.dtype == q.dtype and out.shape == q.shape and isinstance(out, jax.Array)
    assert lse.dtype == (jnp.float64 if dtype == "float64" else jnp.float32)
    grads = jax.grad(lambda q, k, v: npattn.jax.attention(q, k, v, **options).astype(jnp.float32).sum(),
                     argnums=(0, 1, 2))(q, k, v)
    assert [g.dtype for g in grads] == [q.dtype] * 3


@pytest.mark.parametrize("options", [{}, {"causal": True}, {"scale": 0.3}, {"mask": "bool"}, {"bias": "float"},
                                     {"gqa": True}], ids=str)
def test_equals_jax_dot_product_attention_where_both_have_the_option(options):
    rng = np.random.default_rng(4)
    heads, kv_heads = 4, (2 if options.get("gqa") else 4)
    q = jnp.asarray(rng.standard_normal((2, 6, heads, 8)))  # JAX's layout is bshd
    k, v = (jnp.asarray(rng.standard_normal((2, 6, kv_heads, 8))) for _ in range(2))
    ours, theirs = {"layout": "bshd"}, {}
    if "mask" in options:
        mask = rng.random((6, 6)) < 0.7
        mask[:, 0] = True
        ours["mask"], theirs["mask"] = jnp.asarray(mask), jnp.asarray(mask)[None, None]
    if "bias" in options:
        ours["bias"] = theirs["bias"] = jnp.asarray(rng.standard_normal((1, 1, 6, 6)))
    if "causal" in options:
        ours["causal"] = theirs["is_causal"] = True
    if "scale" in options:
        ours["scale"] = theirs["scale"] = 0.3

    def both(q):
        return npattn.attention(q, k, v, **ours), jax.nn.dot_product_attention(q, k, v, **theirs)
    out, expected = both(q)
    # jax.nn.dot_product_attention takes its softmax in float32, also for float64 inputs: the
    # bound is float32's, for sums over the 6 keys after dot products over D = 8, at the size
    # of v's entries amplified by the scores' (as tests/tolerances.py's output terms)
    scores = ours.get("scale", 8 ** -0.5) * 8 * float(jnp.abs(q).max() * jnp.abs(k).max())
    magnitude = float(jnp.abs(v).max()) * (1 + scores)
    assert_close(np.asarray(out), np.asarray(expected), np.float32, 6 + 8, magnitude)
    grad, expected_grad = (jax.grad(lambda q, i=i: both(q)[i].sum())(q) for i in range(2))
    assert_close(np.asarray(grad), np.asarray(expected_grad), np.float32, heads // kv_heads * 6 + 6 + 16,
                 magnitude * (1 + scores))


def test_attention_vjp_under_a_trace_names_the_function_to_use():
    (q, k, v, bias, sinks), options = every_option()
    with pytest.raises(TypeError, match="npattn.jax.attention"):
        jax.jit(lambda q: npattn.attention_vjp(q, k, v)[0])(q)


def test_dropout_needs_a_seed():
    (q, k, v, bias, sinks), options = every_option()
    with pytest.raises(ValueError, match="seed"):
        npattn.jax.attention(q, k, v, dropout_p=0.1)


def test_modules_hand_back_jax_arrays():
    from npattn.nn import MultiHeadAttention

    module = MultiHeadAttention(8, 2, dtype="float32", seed=0)
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
    out = module(jnp.asarray(x), attn_mask=jnp.asarray(np.tril(np.ones((3, 3), bool))))
    assert isinstance(out, jax.Array) and out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), module(x, attn_mask=np.tril(np.ones((3, 3), bool))).data)
