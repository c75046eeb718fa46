"""Module bookkeeping (names, modes, state dicts, seeded initialization) and the building
blocks' gradients, in float64, with respect to inputs and parameters."""
import numpy as np
import pytest

from npattn import autograd as ag
from npattn.autograd import Tensor, gradcheck
from npattn.nn import MLP, Dropout, Embedding, LayerNorm, Linear, Module, RMSNorm
from module_checks import gradcheck_module

RNG = np.random.default_rng(5)


def x64(*shape):
    return Tensor(RNG.standard_normal(shape), requires_grad=True)


@pytest.mark.parametrize("make, shape", [
    (lambda: Linear(4, 3, dtype="float64", seed=0), (2, 5, 4)),
    (lambda: Linear(4, 3, bias=False, dtype="float64", seed=0), (4,)),
    (lambda: LayerNorm(6, dtype="float64"), (3, 6)),
    (lambda: RMSNorm(6, eps=1e-6, dtype="float64"), (2, 3, 6)),
    (lambda: MLP(4, 8, dtype="float64", seed=1), (2, 3, 4)),
    (lambda: MLP(4, 8, activation="relu", dropout=0.25, dtype="float64", seed=1), (2, 3, 4)),
], ids=["linear", "linear-no-bias", "layer-norm", "rms-norm", "mlp", "mlp-relu-dropout"])
def test_layer_gradients(make, shape):
    module = make()
    if isinstance(module, MLP):
        module.dropout = _FixedDropout(0.25)  # one mask for every evaluation of gradcheck
    gradcheck_module(module, x64(*shape))


class _FixedDropout(Module):
    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x):
        return ag.dropout(x, self.p, seed=3)


def test_embedding_gradient_sums_repeated_rows():
    table = Embedding(5, 3, dtype="float64", seed=0)
    indices = np.array([[1, 4, 1], [0, 1, 2]])
    gradcheck(lambda w: ag.embedding(indices, w), [table.weight])
    out = table(indices)
    out.backward(np.ones(out.shape))
    np.testing.assert_array_equal(table.weight.grad[:, 0], [1, 3, 1, 0, 1])


def test_names_follow_assignment_and_nesting():
    mlp = MLP(4, 8, seed=0)
    assert [name for name, _ in mlp.named_parameters()] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert mlp.num_parameters() == 4 * 8 + 8 + 8 * 4 + 4
    assert [name for name, _ in LayerNorm(3, bias=False).named_parameters()] == ["weight"]
    assert Linear(2, 3, bias=False).bias is None


def test_initialization_is_xavier_uniform_with_zero_biases_and_seeded():
    a, b = Linear(200, 100, seed=7), Linear(200, 100, seed=7)
    np.testing.assert_array_equal(a.weight.data, b.weight.data)
    bound = np.sqrt(6 / 300)
    assert np.abs(a.weight.data).max() <= bound and np.abs(a.weight.data).max() > 0.95 * bound
    assert abs(a.weight.data.var() - bound ** 2 / 3) < 0.05 * bound ** 2 / 3
    np.testing.assert_array_equal(a.bias.data, 0)
    assert a.weight.dtype == np.float32
    before = a.weight.data.copy()
    a.reset_parameters(8)
    assert not np.array_equal(before, a.weight.data)
    assert not np.array_equal(Linear(5, 5, seed=1).weight.data, Linear(5, 5, seed=2).weight.data)


def test_state_dict_round_trip_in_place():
    source, target = MLP(4, 8, seed=0), MLP(4, 8, seed=1)
    weight = target.fc1.weight
    state = source.state_dict()
    assert all(isinstance(value, np.ndarray) for value in state.values())
    target.load_state_dict(state)
    assert target.fc1.weight is weight  # loaded in place: optimizers keep their references
    for name, value in target.state_dict().items():
        np.testing.assert_array_equal(value, state[name])
    state["fc1.weight"][...] = 0  # the state dict is a copy, not a view
    assert source.fc1.weight.data.any()


def test_to_moves_parameters_in_place_and_names_bad_kinds():
    module = MLP(4, 8, seed=0)
    weight = module.fc1.weight
    before = module.state_dict()
    module.fc1.weight.grad = np.ones_like(weight.data)
    assert module.to("numpy") is module
    assert module.fc1.weight is weight and weight.grad is None  # same Tensors, gradients cleared
    for name, value in module.state_dict().items():
        np.testing.assert_array_equal(value, before[name])
    with pytest.raises(ValueError, match="'numpy' or 'cupy', got 'gpu'"):
        module.to("gpu")


def test_to_cupy_runs_the_module_on_the_gpu_backend():
    cupy = pytest.importorskip("cupy")
    import npattn

    if not npattn.backends()["gpu"]:
        pytest.skip(f"gpu: {npattn.backends()['gpu'].reason}")
    from npattn.nn import MultiHeadAttention

    module = MultiHeadAttention(16, 4, causal=True, seed=3)
    x = np.random.default_rng(0).standard_normal((2, 5, 16)).astype(np.float32)
    expected = module(x).data
    module.to("cupy")
    assert all(isinstance(p.data, cupy.ndarray) for p in module.parameters())
    out = module(cupy.asarray(x))
    assert isinstance(out.data, cupy.ndarray)
    np.testing.assert_allclose(cupy.asnumpy(out.data), expected, atol=1e-5)
    out.sum().backward()
    assert all(isinstance(p.grad, cupy.ndarray) for p in module.parameters())


def test_load_state_dict_names_what_is_wrong_and_changes_nothing():
    mlp = MLP(4, 8, seed=0)
    good = mlp.state_dict()
    with pytest.raises(KeyError, match=r"missing keys \['fc2.bias'\], unexpected keys \['fc3.bias'\]"):
        mlp.load_state_dict({**{k: v for k, v in good.items() if k != "fc2.bias"}, "fc3.bias": good["fc2.bias"]})
    bad = {k: np.zeros_like(v) for k, v in good.items()}
    bad["fc2.weight"] = np.zeros((8, 4))
    with pytest.raises(ValueError, match=r"'fc2.weight' must have shape \(4, 8\); got \(8, 4\)"):
        mlp.load_state_dict(bad)
    for name, value in mlp.state_dict().items():
        np.testing.assert_array_equal(value, good[name])


def test_train_and_eval_switch_dropout_everywhere():
    mlp = MLP(4, 16, dropout=0.5, seed=0)
    x = Tensor(np.ones((64, 4), np.float32))
    assert mlp.training and mlp.dropout.training
    assert mlp.eval() is mlp and not mlp.dropout.training
    np.testing.assert_array_equal(mlp(x).data, mlp(x).data)
    mlp.train()
    assert not np.array_equal(mlp(x).data, mlp(x).data)


def test_seeded_dropout_module_repeats_its_masks():
    x = Tensor(np.ones(1000))
    first, second = Dropout(0.3, seed=4), Dropout(0.3, seed=4)
    np.testing.assert_array_equal(first(x).data, second(x).data)
    np.testing.assert_array_equal(first(x).data, second(x).data)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="MLP: activation"):
        MLP(2, 4, activation="swish")
    with pytest.raises(ValueError, match=r"Dropout: p must be in \[0, 1\)"):
        Dropout(1.5)
    with pytest.raises(ValueError, match=r"linear: weight must be \(out_features, 3\)"):
        Linear(4, 2)(Tensor(np.ones((2, 3), np.float32)))
