"""torch tensors in, torch tensors out: npattn.attention on tensors, and npattn.torch's
custom op under autograd and torch.compile (skipped without torch: the test-frameworks
extra installs it)."""
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn
from npattn.adapters import arrays as foreign
from strategies import cases, layouts, to_layout

torch = pytest.importorskip("torch")
import npattn.torch  # noqa: E402  (needs torch)

FLOATS = ("float16", "float32", "float64")


def tensors(case, layout, requires_grad=False):
    """q, k, v of ``case`` in ``layout``, and its options with every array as a tensor."""
    q, k, v = (torch.from_numpy(np.ascontiguousarray(to_layout(a, layout))).requires_grad_(requires_grad)
               for a in (case.q, case.k, case.v))
    options = {name: torch.from_numpy(np.asarray(value)) if isinstance(value, np.ndarray) else value
               for name, value in case.options.items()}
    return q, k, v, {**options, "layout": layout}


def numpy_of(tensor):
    return tensor.detach().numpy()


@given(cases(dtypes=FLOATS), layouts, st.booleans())
def test_tensors_in_give_the_same_outputs_as_numpy_as_tensors(case, layout, extras):
    q, k, v, options = tensors(case, layout)
    wanted = {"return_lse": extras, "return_weights": extras}
    ours = npattn.attention(q, k, v, **options, **wanted)
    expected = case.run("cpu", layout, **wanted)
    ours, expected = (ours, expected) if extras else ((ours,), (expected,))
    for tensor, array in zip(ours, expected):
        assert isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu"
        assert str(tensor.dtype) == f"torch.{array.dtype}"
        np.testing.assert_array_equal(numpy_of(tensor), array)


@given(cases(dtypes=FLOATS), layouts)
def test_attention_vjp_on_tensors_hands_back_tensors(case, layout):
    q, k, v, options = tensors(case, layout)
    out, vjp = npattn.attention_vjp(q, k, v, **options)
    expected_out, expected_vjp = case.vjp("cpu", layout)
    np.testing.assert_array_equal(numpy_of(out), expected_out)
    dout = np.random.default_rng(1).standard_normal(expected_out.shape).astype(expected_out.dtype)
    for grad, expected in zip(vjp(torch.from_numpy(dout)), expected_vjp(dout)):
        assert isinstance(grad, torch.Tensor) and grad.dtype == torch.from_numpy(expected).dtype
        np.testing.assert_array_equal(numpy_of(grad), expected)


@settings(max_examples=40)
@given(cases(dtypes=FLOATS), layouts)
def test_autograd_through_the_op_gives_the_vjps_gradients(case, layout):
    """The op's backward (attention_backward from what its forward kept: out, or a float16
    call's float32 out) gives attention_vjp's gradients bit for bit."""
    q, k, v, options = tensors(case, layout, requires_grad=True)
    differentiable = [name for name in ("bias", "sink_logits") if name in options]
    for name in differentiable:
        options[name] = options[name].to(q.dtype).requires_grad_(True)
    out = npattn.attention(q, k, v, **options)  # requires grad: runs as npattn.torch's op
    assert out.grad_fn is not None
    expected_out, expected_vjp = case.vjp("cpu", layout, **{name: numpy_of(options[name]) for name in differentiable})
    np.testing.assert_array_equal(numpy_of(out), expected_out)
    dout = np.random.default_rng(2).standard_normal(expected_out.shape).astype(expected_out.dtype)
    out.backward(torch.from_numpy(dout))
    grads = [q.grad, k.grad, v.grad, *(options[name].grad for name in differentiable)]
    for name, grad, expected in zip(["dq", "dk", "dv", *differentiable], grads, expected_vjp(dout)):
        np.testing.assert_array_equal(numpy_of(grad), expected, err_msg=name)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_one_hot_row_has_an_exact_zero_dq_through_the_op(dtype, compiled):
    """One key at scale 1e4: its row is one-hot, so dq is exactly 0, as attention_vjp gives
    it. The op's forward keeps its float32 out for the backward (npattn.attention_for_backward);
    the 16-bit out it returns would leave dq about 0.4 k (the last assertion)."""
    rng = np.random.default_rng(7)
    q, k = (torch.from_numpy(rng.standard_normal((1, 1, 1, 16))).to(dtype).requires_grad_(True) for _ in range(2))
    v = torch.from_numpy(rng.standard_normal((1, 1, 1, 2))).to(dtype).requires_grad_(True)
    dout = torch.tensor([[[[0.5, -1.0]]]], dtype=dtype)
    options = dict(dropout_p=0.1, seed=0, scale=1e4)

    def forward(q, k, v):
        return npattn.torch.attention(q, k, v, return_lse=True, **options)
    run = torch.compile(forward, backend="aot_eager", fullgraph=True) if compiled else forward
    out, lse = run(q, k, v)
    out.backward(dout)
    assert not q.grad.float().any() and not k.grad.float().any()
    host_dtype = ml_dtypes.bfloat16 if dtype == torch.bfloat16 else np.float16

    def host(tensor):
        return tensor.detach().float().numpy().astype(host_dtype if tensor.dtype == dtype else np.float32)
    rounded = npattn.attention_backward(*(host(t) for t in (q, k, v, out, lse, dout)), **options)
    assert np.asarray(rounded[0], np.float64).any()


def every_option(dtype=torch.float64, layout="bhsd"):
    """q, k, v and every option of npattn at once, on a small GQA problem."""
    rng = np.random.default_rng(5)
    B, H, HKV, SQ, SK, D = 2, 4, 2, 5, 7, 3

    def tensor(*shape):
        return torch.from_numpy(rng.standard_normal(shape)).to(dtype).requires_grad_(True)
    q, k, v = tensor(B, H, SQ, D), tensor(B, HKV, SK, D), tensor(B, HKV, SK, D)
    if layout == "bshd":
        q, k, v = (t.detach().transpose(1, 2).contiguous().requires_grad_(True) for t in (q, k, v))
    mask = torch.from_numpy(rng.random((SQ, SK)) < 0.8)
    options = dict(causal=True, window=(3, 1), sinks=1, mask=mask, alibi_slopes=torch.tensor([0.5, 0.25, 0.1, 0.05]),
                   q_lengths=torch.tensor([4, 5]), kv_lengths=torch.tensor([6, 7]), scale=0.4, softcap=3.0,
                   dropout_p=0.2, seed=11, layout=layout)
    return (q, k, v, tensor(1, H, SQ, SK), tensor(H)), options


def test_gradcheck_with_every_option_on():
    inputs, options = every_option()
    assert torch.autograd.gradcheck(
        lambda q, k, v, bias, sinks: npattn.torch.attention(q, k, v, bias=bias, sink_logits=sinks, **options),
        inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_opcheck_schema_fake_and_autograd_registration(dtype):
    """float16: the forward keeps its float32 out for the backward, a fourth output."""
    (q, k, v, bias, sinks), options = every_option(dtype, "bshd")
    arrays = [options.pop(name, None) for name in foreign.ARRAY_OPTIONS]
    arrays[foreign.ARRAY_OPTIONS.index("bias")] = bias
    arrays[foreign.ARRAY_OPTIONS.index("sink_logits")] = sinks
    settings_text = repr({**options, "return_weights": True, "keeps_float_out": dtype == torch.float16})
    result = torch.library.opcheck(torch.ops.npattn.attention_forward.default, (q, k, v, *arrays, settings_text))
    assert set(result.values()) == {"SUCCESS"}, result


def test_compiled_forward_and_backward_equal_eager():
    (q, k, v, bias, sinks), options = every_option(torch.float32, "bshd")

    def loss(q, k, v, bias, sinks):
        out, lse = npattn.torch.attention(q, k, v, bias=bias, sink_logits=sinks, return_lse=True, **options)
        return (out * out).sum() + lse.sum()
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    results = []
    for function in (loss, compiled):
        inputs = [t.detach().clone().requires_grad_(True) for t in (q, k, v, bias, sinks)]
        value = function(*inputs)
        value.backward()
        results.append([value.detach(), *(t.grad for t in inputs)])
    for eager, traced in zip(*results):
        torch.testing.assert_close(traced, eager, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_op_round_trip_keeps_dtype_and_device(dtype):
    (q, k, v, bias, sinks), options = every_option(dtype)
    out, lse = npattn.torch.attention(q, k, v, bias=bias, sink_logits=sinks, return_lse=True, **options)
    assert out.dtype == dtype and out.device == q.device and out.shape == q.shape
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    out.float().sum().backward()
    for tensor in (q, k, v, bias, sinks):
        assert tensor.grad is not None and tensor.grad.dtype == dtype and tensor.grad.shape == tensor.shape


def test_bfloat16_tensors_match_the_float32_computation():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q = torch.linspace(-1, 1, 64).reshape(1, 2, 4, 8).to(torch.bfloat16)
    out = npattn.attention(q, q, q, backend="reference")
    assert out.dtype == torch.bfloat16
    same = q.float().numpy().astype(ml_dtypes.bfloat16)
    expected = npattn.attention(same, same, same, backend="reference")
    np.testing.assert_array_equal(out.float().numpy(), expected.astype(np.float32))


def test_inputs_are_viewed_not_copied():
    tensor = torch.randn(1, 2, 3, 4)
    view = foreign.foreign_kind(tensor).native("q", tensor)
    assert np.shares_memory(view, tensor.numpy())


@pytest.mark.parametrize("options", [{}, {"causal": True}, {"scale": 0.3}, {"mask": "bool"}, {"bias": "float"},
                                     {"gqa": True}], ids=str)
def test_equals_torch_sdpa_where_both_have_the_option(options):
    generator = torch.Generator().manual_seed(3)
    heads, kv_heads = 4, (2 if options.get("gqa") else 4)
    q = torch.randn(2, heads, 6, 8, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(2, kv_heads, 6, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    ours, theirs = {}, {"enable_gqa": kv_heads != heads}
    for name, value in options.items():
        if name == "mask":
            mask = torch.rand(6, 6, generator=generator) < 0.7
            mask[:, 0] = True
            ours["mask"] = theirs["attn_mask"] = mask
        elif name == "bias":
            ours["bias"] = theirs["attn_mask"] = torch.randn(6, 6, generator=generator, dtype=torch.float64)
        elif name == "causal":
            ours["causal"], theirs["is_causal"] = True, True
        elif name == "scale":
            ours["scale"] = theirs["scale"] = value
    q.requires_grad_(True)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, **theirs)
    out = npattn.attention(q, k, v, **ours)
    torch.testing.assert_close(out, expected)
    (expected_grad,) = torch.autograd.grad(expected.sum(), q)
    (grad,) = torch.autograd.grad(out.sum(), q)
    torch.testing.assert_close(grad, expected_grad)


def test_a_small_model_trains_as_with_torch_sdpa():
    """Two copies of one model, attention by npattn and by torch SDPA, trained side by side:
    the losses agree step by step, and fall."""
    def model():
        torch.manual_seed(0)
        return torch.nn.ModuleDict({"qkv": torch.nn.Linear(8, 24, dtype=torch.float64),
                                    "out": torch.nn.Linear(8, 1, dtype=torch.float64)})

    def forward(layers, x, attend):
        q, k, v = layers["qkv"](x).reshape(x.shape[0], x.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4)
        return layers["out"](attend(q, k, v).transpose(1, 2).reshape(x.shape)).mean(dim=(1, 2))

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(16, 5, 8, generator=generator, dtype=torch.float64)
    y = x[:, :, 0].amax(dim=1)  # needs attention across positions
    attends = (lambda q, k, v: npattn.attention(q, k, v, causal=True),
               lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    models = [model(), model()]
    optimizers = [torch.optim.Adam(m.parameters(), lr=0.02) for m in models]
    history = []
    for _ in range(60):
        losses = []
        for layers, optimizer, attend in zip(models, optimizers, attends):
            optimizer.zero_grad()
            loss = ((forward(layers, x, attend) - y) ** 2).mean()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        history.append(losses)
    history = np.array(history)
    np.testing.assert_allclose(history[:, 0], history[:, 1], rtol=1e-9)
    assert history[-1, 0] < 0.5 * history[0, 0]


@pytest.mark.parametrize("q_len, kv_len", [(3, 7), (7, 3), (5, 5)])
def test_q_offset_zero_is_torch_is_causal_when_lengths_differ(q_len, kv_len):
    """torch aligns is_causal top-left; q_offset=0 is that alignment, the default is not."""
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(2, 2, q_len, 8, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(2, 2, kv_len, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(npattn.attention(q, k, v, causal=True, q_offset=0), expected)
    if q_len != kv_len:
        assert not torch.allclose(npattn.attention(q, k, v, causal=True), expected)
