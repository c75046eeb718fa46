"""The autograd: every function's gradient against float64 finite differences, the
engine's bookkeeping (accumulation, no_grad, release of the graph), and its errors."""
import gc
import weakref

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import mutually_broadcastable_shapes

from npattn import autograd as ag
from npattn.autograd import Function, GradcheckError, Tensor, gradcheck
from tolerances import assert_close

RNG = np.random.default_rng(20261122)


def tensor(*shape, positive=False, requires_grad=True):
    data = RNG.standard_normal(shape)
    if positive:
        data = np.abs(data) + 0.5
    return Tensor(data, requires_grad=requires_grad)


# (id, function, inputs): each is gradchecked in float64
CASES = [
    ("add-broadcast", lambda a, b: a + b, [tensor(3, 1, 4), tensor(5, 1)]),
    ("sub-broadcast", lambda a, b: a - b, [tensor(4), tensor(2, 3, 4)]),
    ("mul-broadcast", lambda a, b: a * b, [tensor(2, 3, 1), tensor(1, 3, 4)]),
    ("div-broadcast", lambda a, b: a / b, [tensor(2, 3), tensor(3, positive=True)]),
    ("scalar-arithmetic", lambda a: (2.0 - a) * 3.0 / (a * a + 1.0) + 1.5, [tensor(3, 2)]),
    ("reflected-array", lambda a: np.ones((2, 3)) - a * np.full((2, 3), 2.0), [tensor(2, 3)]),
    ("power-constant", lambda a: a ** 3, [tensor(3, 2)]),
    ("power-both", lambda a, b: a ** b, [tensor(3, 2, positive=True), tensor(2)]),
    ("rpow", lambda a: 2.0 ** a, [tensor(4)]),
    ("neg", lambda a: -a, [tensor(3)]),
    ("matmul-2d", lambda a, b: a @ b, [tensor(3, 4), tensor(4, 2)]),
    ("matmul-batched-broadcast", lambda a, b: a @ b, [tensor(2, 1, 3, 4), tensor(5, 4, 2)]),
    ("matmul-vector-left", lambda a, b: a @ b, [tensor(4), tensor(2, 4, 3)]),
    ("matmul-vector-right", lambda a, b: a @ b, [tensor(2, 3, 4), tensor(4)]),
    ("matmul-vectors", lambda a, b: a @ b, [tensor(4), tensor(4)]),
    ("clip", lambda a: ag.clip(a, -0.5, 0.7), [tensor(4, 5)]),
    ("clip-one-sided", lambda a: ag.clip(a, None, 0.0) * a, [tensor(6)]),
    ("exp", ag.exp, [tensor(3, 2)]),
    ("log", ag.log, [tensor(3, 2, positive=True)]),
    ("tanh", ag.tanh, [tensor(3, 2)]),
    ("sigmoid", ag.sigmoid, [tensor(3, 2)]),
    ("relu", ag.relu, [tensor(3, 5)]),
    ("gelu", ag.gelu, [tensor(3, 5)]),
    ("gelu-tanh", lambda a: ag.gelu(a, approximate="tanh"), [tensor(3, 5)]),
    ("sum-all", lambda a: a.sum(), [tensor(2, 3)]),
    ("sum-axis", lambda a: a.sum(axis=1), [tensor(2, 3, 4)]),
    ("sum-axes-keepdims", lambda a: a.sum(axis=(0, 2), keepdims=True), [tensor(2, 3, 4)]),
    ("mean-axis", lambda a: a.mean(axis=-1), [tensor(2, 3, 4)]),
    ("mean-all", lambda a: ag.mean(a), [tensor(2, 3)]),
    ("max-axis", lambda a: a.max(axis=1), [tensor(3, 4)]),
    ("max-all-keepdims", lambda a: ag.max(a, keepdims=True), [tensor(3, 4)]),
    ("reshape", lambda a: a.reshape(6, 2) * np.arange(12.0).reshape(6, 2), [tensor(3, 4)]),
    ("transpose", lambda a: a.transpose(2, 0, 1) * np.arange(24.0).reshape(4, 2, 3), [tensor(2, 3, 4)]),
    ("T", lambda a: a.T @ np.ones((3, 2)), [tensor(3, 4)]),
    ("getitem-slice", lambda a: a[1:, ::2], [tensor(3, 4)]),
    ("getitem-repeated-indices", lambda a: a[np.array([0, 2, 0, 0])], [tensor(3, 2)]),
    ("getitem-bool", lambda a: a[np.array([True, False, True])], [tensor(3, 2)]),
    ("split", lambda a: ag.split(a, [1, 3], axis=1)[1] * 2.0 + ag.split(a, 2, axis=0)[0].sum(), [tensor(2, 4)]),
    ("concat", lambda a, b: ag.concat([a, b, a], axis=1), [tensor(2, 3), tensor(2, 1)]),
    ("stack", lambda a, b: ag.stack([a, b], axis=1), [tensor(2, 3), tensor(2, 3)]),
    ("linear", lambda x, w, b: ag.linear(x, w, b), [tensor(2, 3, 4), tensor(5, 4), tensor(5)]),
    ("linear-no-bias", lambda x, w: ag.linear(x, w), [tensor(3, 4), tensor(2, 4)]),
    ("softmax", lambda a: ag.softmax(a, axis=-1), [tensor(3, 5)]),
    ("softmax-axis0", lambda a: ag.softmax(a, axis=0), [tensor(3, 5)]),
    ("log-softmax", lambda a: ag.log_softmax(a), [tensor(3, 5)]),
    ("cross-entropy", lambda a: ag.cross_entropy(a, np.array([0, 4, 2])), [tensor(3, 5)]),
    ("cross-entropy-ignore-sum", lambda a: ag.cross_entropy(a, np.array([1, -100, 2]), reduction="sum"),
     [tensor(3, 4)]),
    ("cross-entropy-none-smoothing", lambda a: ag.cross_entropy(a, np.array([1, 0]), reduction="none",
                                                                label_smoothing=0.1), [tensor(2, 3)]),
    ("cross-entropy-class-axis-1", lambda a: ag.cross_entropy(a, np.array([[0, 2, 1, 1]])), [tensor(1, 3, 4)]),
    ("cross-entropy-unbatched", lambda a: ag.cross_entropy(a, np.array(2)), [tensor(4)]),
    ("layer-norm", lambda x, w, b: ag.layer_norm(x, w, b), [tensor(2, 3, 6), tensor(6), tensor(6)]),
    ("layer-norm-plain", lambda x: ag.layer_norm(x, eps=1e-3), [tensor(4, 5)]),
    ("layer-norm-bias-only", lambda x, b: ag.layer_norm(x, bias=b), [tensor(4, 5), tensor(5)]),
    ("rms-norm", lambda x, w: ag.rms_norm(x, w, eps=1e-6), [tensor(2, 3, 6), tensor(6)]),
    ("rms-norm-default-eps", lambda x: ag.rms_norm(x), [tensor(4, 5)]),
    ("dropout", lambda x: ag.dropout(x, p=0.3, seed=7), [tensor(6, 7)]),
    ("dropout-eval", lambda x: ag.dropout(x, p=0.3, training=False) * 2.0, [tensor(3)]),
    ("embedding", lambda w: ag.embedding(np.array([[0, 2], [2, 2]]), w), [tensor(3, 4)]),
]


@pytest.mark.parametrize("fn, inputs", [pytest.param(fn, inputs, id=name) for name, fn, inputs in CASES])
def test_gradients_match_finite_differences(fn, inputs):
    assert gradcheck(fn, inputs)


@pytest.mark.parametrize("fn, inputs", [pytest.param(fn, inputs, id=name) for name, fn, inputs in CASES])
def test_float32_graphs_keep_float32_gradients(monkeypatch, fn, inputs):
    """Every function keeps a float32 graph in float32: given float32 gradients, it returns
    float32 ones, with no cast left to the engine (one function that returned float64 made
    every gradient of a float32 model behind it float64, at twice the time); and a leaf's
    gradient has the leaf's dtype also where a float64 constant promoted the output."""
    from npattn.autograd import tensor as tensor_module

    casts, real = [], tensor_module.in_dtype
    monkeypatch.setattr(tensor_module, "in_dtype", lambda grad, dtype: grad if grad.dtype == dtype
                        else casts.append(grad.dtype) or real(grad, dtype))
    singles = [Tensor(x.data.astype(np.float32), requires_grad=True) for x in inputs]
    out = fn(*singles)
    (out * RNG.standard_normal(out.shape).astype(out.dtype)).sum().backward()
    assert [x.grad.dtype for x in singles] == [np.float32] * len(singles)
    if out.dtype == np.float32:
        assert casts == [], f"a function returned {casts[0]} gradients in a float32 graph"


@settings(max_examples=30)
@given(shapes=mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=3, max_side=3),
       op=st.sampled_from(["add", "sub", "mul", "div"]))
def test_broadcasting_gradients_sum_back_to_each_shape(shapes, op):
    a, b = (Tensor(RNG.uniform(0.5, 2.0, shape), requires_grad=True) for shape in shapes.input_shapes)
    fn = getattr(ag, op)
    gradcheck(fn, [a, b])
    out = fn(a, b)
    out.backward(np.ones(out.shape))
    assert a.grad.shape == a.shape and b.grad.shape == b.shape


def test_gradcheck_catches_a_wrong_gradient():
    class _WrongSquare(Function):
        def forward(self, x):
            self.x = x
            return x * x

        def backward(self, grad):
            return grad * 2.01 * self.x  # 0.5% off

    with pytest.raises(GradcheckError, match="input 0"):
        gradcheck(_WrongSquare.apply, [tensor(4)])


def test_gradcheck_needs_float64_and_a_differentiable_input():
    with pytest.raises(TypeError, match="float64"):
        gradcheck(ag.exp, [Tensor(np.ones(3, np.float32), requires_grad=True)])
    with pytest.raises(ValueError, match="requires_grad"):
        gradcheck(ag.exp, [Tensor(np.ones(3))])


# ----- attention as one node -------------------------------------------------------------------

B, H, HKV, SQ, SK, D = 2, 4, 2, 5, 7, 8
ATTENTION_OPTIONS = {
    "plain": {},
    "causal": dict(causal=True),
    "window-sinks": dict(causal=True, window=2, sinks=1),
    "mask": dict(mask=RNG.random((B, 1, SQ, SK)) > 0.3),
    "alibi": dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625])),
    "softcap": dict(softcap=2.0),
    "lengths": dict(q_lengths=np.array([5, 3]), kv_lengths=np.array([7, 4])),
    "scale": dict(scale=0.3),
    "dropout": dict(dropout_p=0.25, seed=11),
    "bshd": dict(layout="bshd"),
}


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("options", list(ATTENTION_OPTIONS.values()), ids=list(ATTENTION_OPTIONS))
def test_attention_node_gradients(options, backend):
    if options.get("layout") == "bshd":
        q, k, v = tensor(B, SQ, H, D), tensor(B, SK, HKV, D), tensor(B, SK, HKV, D)
    else:
        q, k, v = tensor(B, H, SQ, D), tensor(B, HKV, SK, D), tensor(B, HKV, SK, D)
    gradcheck(lambda q, k, v: ag.attention(q, k, v, backend=backend, **options), [q, k, v])


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_attention_node_bias_and_sink_logit_gradients(backend):
    q, k, v = tensor(B, H, SQ, D), tensor(B, HKV, SK, D), tensor(B, HKV, SK, D)
    bias, sinks = tensor(1, H, 1, SK), tensor(H)  # broadcast over batch and query rows
    gradcheck(lambda q, k, v, bias, sinks: ag.attention(q, k, v, bias=bias, sink_logits=sinks, causal=True,
                                                        backend=backend),
              [q, k, v, bias, sinks])


def test_attention_node_is_one_backward_call(monkeypatch):
    import npattn.api

    calls = []
    original = npattn.api.attention_vjp

    def counting(*args, **kwargs):
        out, vjp = original(*args, **kwargs)
        return out, lambda dout: calls.append(1) or vjp(dout)

    monkeypatch.setattr(npattn.api, "attention_vjp", counting)
    q, k, v, bias = tensor(1, 2, 3, 4), tensor(1, 2, 3, 4), tensor(1, 2, 3, 4), tensor(3, 3)
    (ag.attention(q, k, v, bias=bias, backend="reference") ** 2).sum().backward()
    assert calls == [1]
    assert all(t.grad is not None and t.grad.shape == t.shape for t in (q, k, v, bias))


def test_attention_node_returns_lse_and_weights_as_constants():
    q = tensor(1, 2, 3, 4)
    out, lse, weights = ag.attention(q, q, q, return_lse=True, return_weights=True, backend="reference")
    assert out.requires_grad and not lse.requires_grad and not weights.requires_grad
    assert lse.shape == (1, 2, 3) and weights.shape == (1, 2, 3, 3)
    np.testing.assert_allclose(weights.data.sum(-1), 1.0)


# ----- the engine ------------------------------------------------------------------------------

def test_a_tensor_used_twice_gets_both_gradients():
    x = Tensor(np.array([1.0, -2.0, 3.0]), requires_grad=True)
    (x * x + x).sum().backward()
    np.testing.assert_array_equal(x.grad, 2 * x.data + 1)


def test_gradients_accumulate_across_backward_calls():
    x = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    (x * 3.0).sum().backward()
    (x * x).sum().backward()
    np.testing.assert_array_equal(x.grad, 3.0 + 2 * x.data)


def test_no_grad_records_nothing():
    x = tensor(3)
    with ag.no_grad():
        y = ag.exp(x) * 2.0
        assert not ag.is_grad_enabled()
    assert ag.is_grad_enabled()
    assert not y.requires_grad and y._ctx is None
    with pytest.raises(RuntimeError, match="does not require gradients"):
        y.sum().backward()


def test_constants_do_not_get_gradients_or_ask_for_them():
    seen = []

    class _Spy(Function):
        def forward(self, a, b):
            seen.append(self.needs_input_grad)
            return a * b

        def backward(self, grad):
            return None, grad  # nothing for the input nobody asked about

    a, b = tensor(3, requires_grad=False), tensor(3)
    _Spy.apply(a, b).sum().backward()
    assert seen == [(False, True)] and a.grad is None and b.grad is not None


def test_the_graph_is_released_after_backward():
    gc.collect()
    gc.disable()  # reference counting alone must free it: no cycles may hold the arrays
    try:
        x = tensor(50, 50)
        hidden = ag.tanh(x @ x)
        saved = weakref.ref(hidden._ctx)
        loss = hidden.sum()
        del hidden
        loss.backward()
        assert saved() is None
        with pytest.raises(RuntimeError, match="released"):
            loss.backward()
    finally:
        gc.enable()


def test_backward_errors_name_the_problem():
    x = tensor(2, 3)
    with pytest.raises(RuntimeError, match=r"non-scalar tensor of shape \(2, 3\)"):
        (x * 2.0).backward()
    with pytest.raises(ValueError, match=r"shape \(2, 3\)"):
        (x * 2.0).backward(np.ones(3))
    (x * 2.0).backward(np.ones((2, 3)))
    np.testing.assert_array_equal(x.grad, np.full((2, 3), 2.0))


def test_float32_stays_float32():
    x = Tensor(np.ones((2, 3), np.float32), requires_grad=True)
    y = ag.layer_norm(ag.gelu(x * 0.5 + 1.0), eps=1e-5).mean()
    assert y.dtype == np.float32
    y.backward()
    assert x.grad.dtype == np.float32


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("p", [0.1, 0.3, 0.77])
def test_dropout_is_its_documented_mask_scaled_once(dtype, p):
    """dropout(x, p, seed) is x times ``default_rng(seed).random(x.shape) >= p`` divided by
    1 - p, that scale rounded once to x's dtype: the same bits in float32 and float64."""
    x = Tensor(RNG.standard_normal((5, 7, 9)).astype(dtype), requires_grad=True)
    out = ag.dropout(x, p=p, seed=3)
    keep = np.random.default_rng(3).random(x.shape) >= p
    expected = x.data * (keep / (1.0 - p)).astype(dtype)
    assert out.dtype == dtype
    np.testing.assert_array_equal(out.data.view(np.uint8), expected.view(np.uint8))
    grad = RNG.standard_normal(x.shape).astype(dtype)
    out.backward(grad)
    np.testing.assert_array_equal(x.grad.view(np.uint8), (grad * (keep / (1.0 - p)).astype(dtype)).view(np.uint8))


def test_inputs_are_not_modified():
    data = RNG.standard_normal((3, 4))
    before = data.copy()
    x = Tensor(data, requires_grad=True)
    grad = np.ones((3, 4))
    (ag.softmax(x) * x).backward(grad)
    np.testing.assert_array_equal(data, before)
    x.grad += 1.0  # the leaf's gradient is its own array, never the caller's
    np.testing.assert_array_equal(grad, np.ones((3, 4)))


@pytest.mark.parametrize("bias_dtype", [np.float32, np.float64])
def test_linear_adds_its_bias_as_numpy_would(bias_dtype):
    """linear adds the bias into the product's own array where that keeps NumPy's result
    dtype (no second array of out's size), and makes a new one where the bias promotes:
    the values and dtype of ``x @ w.T + b`` either way, the inputs untouched."""
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((2, 3, 4), dtype=np.float32), rng.standard_normal((5, 4), dtype=np.float32)
    b = rng.standard_normal(5).astype(bias_dtype)
    copies = [array.copy() for array in (x, w, b)]
    with ag.no_grad():
        out = ag.linear(Tensor(x), Tensor(w), Tensor(b)).data
    expected = x @ w.T + b
    assert out.dtype == expected.dtype
    np.testing.assert_array_equal(out, expected)
    for array, copy in zip((x, w, b), copies):
        np.testing.assert_array_equal(array, copy)


def test_function_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"linear: weight must be \(out_features, 4\)"):
        ag.linear(tensor(2, 4), tensor(3, 5))
    with pytest.raises(ValueError, match=r"cross_entropy: target_indices must be in \[0, 3\)"):
        ag.cross_entropy(tensor(2, 3), np.array([0, 3]))
    with pytest.raises(TypeError, match="cross_entropy: target_indices must be integers"):
        ag.cross_entropy(tensor(2, 3), np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"cross_entropy: target_indices must have shape \(2,\)"):
        ag.cross_entropy(tensor(2, 3), np.array([0, 1, 2]))
    with pytest.raises(ValueError, match=r"dropout: p must be in \[0, 1\)"):
        ag.dropout(tensor(3), p=1.0)
    with pytest.raises(ValueError, match=r"embedding: indices must be in \[0, 3\)"):
        ag.embedding(np.array([3]), tensor(3, 2))
    with pytest.raises(ValueError, match=r"layer_norm: weight must have shape \(4,\)"):
        ag.layer_norm(tensor(2, 4), tensor(3))
    with pytest.raises(ValueError, match="gelu: approximate"):
        ag.gelu(tensor(2), approximate="fast")


def test_dropout_is_seeded_and_keeps_about_1_minus_p():
    x = Tensor(np.ones(100_000))
    first = ag.dropout(x, p=0.2, seed=3).data
    np.testing.assert_array_equal(first, ag.dropout(x, p=0.2, seed=3).data)
    kept = (first > 0).mean()
    assert abs(kept - 0.8) < 5 * np.sqrt(0.2 * 0.8 / x.size)
    np.testing.assert_allclose(first[first > 0], 1 / 0.8)


def test_cross_entropy_matches_its_definition():
    logits = RNG.standard_normal((4, 6))
    targets = np.array([5, 0, 3, 3])
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = -log_p[np.arange(4), targets].mean()
    assert_close(ag.cross_entropy(Tensor(logits), targets).item(), expected, np.float64, length=6 + 4,
                 magnitude=np.abs(log_p).max(), what="cross entropy")  # 6 classes, 4 rows


def test_cupy_tensors_flow_through_unchanged():
    cupy = pytest.importorskip("cupy")
    try:
        cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        pytest.skip("CUDA is not available")
    x = Tensor(cupy.asarray(RNG.standard_normal((2, 2, 3, 4))), requires_grad=True)
    w = Tensor(cupy.asarray(RNG.standard_normal((4, 4))), requires_grad=True)
    h = ag.linear(x, w)
    loss = ag.layer_norm(ag.attention(h, h, h, causal=True, backend="reference")).sum()
    loss.backward()
    assert isinstance(x.grad, cupy.ndarray) and isinstance(w.grad, cupy.ndarray)
    gradcheck(lambda x, w: ag.gelu(ag.linear(x, w)), [x, w])


# ----- a model trains --------------------------------------------------------------------------

def test_a_two_layer_attention_model_learns_under_adam():
    """Predict, at every position, the token two places earlier (causal attention must
    learn to look back): the loss falls well below chance."""
    from npattn.nn.optim import Adam

    vocab, dim, heads, length, batch = 8, 16, 2, 10, 16
    rng = np.random.default_rng(0)

    def param(*shape, scale=None):
        scale = 1 / np.sqrt(shape[-1]) if scale is None else scale
        return Tensor((rng.standard_normal(shape) * scale).astype(np.float32), requires_grad=True)

    embed, positions = param(vocab, dim, scale=1.0), param(length, dim, scale=1.0)
    layers = [dict(qkv=param(3 * dim, dim), out=param(dim, dim), norm=Tensor(np.ones(dim, np.float32),
                                                                             requires_grad=True))
              for _ in range(2)]
    head = param(vocab, dim)
    parameters = [embed, positions, head] + [p for layer in layers for p in layer.values()]

    def loss_of(tokens):
        x = ag.embedding(tokens, embed) + positions
        for layer in layers:
            h = ag.layer_norm(x, layer["norm"])
            q, k, v = (t.reshape(batch, length, heads, dim // heads)
                       for t in ag.split(ag.linear(h, layer["qkv"]), 3, axis=-1))
            attended = ag.attention(q, k, v, causal=True, layout="bshd")
            x = x + ag.linear(attended.reshape(batch, length, dim), layer["out"])
        logits = ag.linear(x, head)[:, 2:]
        return ag.cross_entropy(logits.reshape(-1, vocab), tokens[:, :-2].reshape(-1))

    optimizer = Adam(parameters, lr=2e-2)
    losses = []
    for _ in range(60):
        tokens = rng.integers(0, vocab, (batch, length))
        optimizer.zero_grad()
        loss = loss_of(tokens)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    chance = np.log(vocab)
    assert np.mean(losses[:5]) > 0.8 * chance
    assert np.mean(losses[-5:]) < 0.3 * chance


def test_a_tensor_hands_its_data_to_numpy_dlpack_and_python_numbers():
    data = np.arange(6, dtype=np.float32).reshape(2, 3)
    tensor = Tensor(data, requires_grad=True)
    assert np.asarray(tensor) is data  # no copy
    np.testing.assert_array_equal(np.asarray(tensor, dtype=np.float64), data)
    copied = np.array(tensor, copy=True)
    assert copied is not data and np.array_equal(copied, data)
    np.testing.assert_array_equal(np.from_dlpack(tensor), data)
    loss = (tensor * tensor).sum()
    assert float(loss) == 55.0 and int(loss) == 55 and loss.item() == 55.0
    with pytest.raises(ValueError):
        float(tensor)  # more than one element
