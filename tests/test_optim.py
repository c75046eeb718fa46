"""Optimizers against their update rules written out by hand, and their errors."""
import numpy as np
import pytest

from npattn.autograd import Tensor
from npattn.nn.optim import SGD, Adam, AdamW, clip_grad_norm
from tolerances import assert_close

GRADS = [np.array([0.5, -1.0, 2.0]), np.array([-0.25, 0.75, 1.0]), np.array([1.5, 0.0, -2.0])]
START = np.array([1.0, -2.0, 0.5])


def run(optimizer_class, **options):
    """Apply three steps with the fixed gradients; return the parameter after each."""
    parameter = Tensor(START.copy(), requires_grad=True)
    optimizer = optimizer_class([parameter], **options)
    data_id = id(parameter.data)
    trajectory = []
    for grad in GRADS:
        optimizer.zero_grad()
        assert parameter.grad is None
        parameter.grad = grad.copy()
        optimizer.step()
        trajectory.append(parameter.data.copy())
    assert id(parameter.data) == data_id  # updated in place
    return trajectory


@pytest.mark.parametrize("momentum, weight_decay, nesterov", [(0.0, 0.0, False), (0.9, 0.0, False),
                                                              (0.9, 0.1, False), (0.8, 0.05, True)])
def test_sgd_follows_its_rule(momentum, weight_decay, nesterov):
    lr = 0.1
    p, buffer, expected = START.copy(), None, []
    for g in GRADS:
        g = g + weight_decay * p
        if momentum:
            buffer = g if buffer is None else momentum * buffer + g
            g = g + momentum * buffer if nesterov else buffer
        p = p - lr * g
        expected.append(p)
    actual = run(SGD, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
    # the same rule in another order: a few roundings per step, three steps
    assert_close(actual, expected, np.float64, length=3 * 4, magnitude=np.abs(expected).max(), what="SGD")


@pytest.mark.parametrize("optimizer_class, weight_decay", [(Adam, 0.0), (Adam, 0.1), (AdamW, 0.1)])
def test_adam_follows_its_rule(optimizer_class, weight_decay):
    lr, beta1, beta2, eps = 0.01, 0.9, 0.999, 1e-8
    p, m, v, expected = START.copy(), 0.0, 0.0, []
    for t, g in enumerate(GRADS, start=1):
        if optimizer_class is AdamW:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        p = p - lr * (m / (1 - beta1 ** t)) / (np.sqrt(v / (1 - beta2 ** t)) + eps)
        expected.append(p)
    actual = run(optimizer_class, lr=lr, weight_decay=weight_decay)
    # moments, bias corrections, a square root and a division per step, three steps
    assert_close(actual, expected, np.float64, length=3 * 8, magnitude=np.abs(expected).max(),
                 what=optimizer_class.__name__)


def test_adamw_decays_by_default_and_adam_does_not():
    assert AdamW([Tensor(START, requires_grad=True)]).weight_decay == 0.01
    assert Adam([Tensor(START, requires_grad=True)]).weight_decay == 0.0


def test_parameters_without_gradients_are_left_alone():
    a, b = Tensor(START.copy(), requires_grad=True), Tensor(START.copy(), requires_grad=True)
    optimizer = Adam([a, b], lr=0.1)
    a.grad = np.ones(3)
    optimizer.step()
    assert not np.array_equal(a.data, START) and np.array_equal(b.data, START)


def test_float32_parameters_stay_float32():
    p = Tensor(np.ones(3, np.float32), requires_grad=True)
    for optimizer in (SGD([p], lr=0.1, momentum=0.9), Adam([p]), AdamW([p])):
        p.grad = np.ones(3, np.float64)
        optimizer.step()
        assert p.data.dtype == np.float32


def test_clip_grad_norm_scales_to_the_bound_and_reports_the_norm():
    a, b = Tensor(np.zeros(2), requires_grad=True), Tensor(np.zeros(1), requires_grad=True)
    a.grad, b.grad = np.array([3.0, 0.0]), np.array([4.0])
    assert clip_grad_norm([a, b], 1.0) == pytest.approx(5.0)
    total = np.sqrt((a.grad ** 2).sum() + (b.grad ** 2).sum())
    # clip_grad_norm scales by max_norm / (norm + 1e-6), as torch does
    assert total == pytest.approx(5.0 / (5.0 + 1e-6), abs=1e-15)
    np.testing.assert_allclose(a.grad / b.grad, [0.75, 0.0])
    assert clip_grad_norm([a, b], 10.0) == pytest.approx(total, abs=1e-15)  # under the bound: unchanged
    assert np.sqrt((a.grad ** 2).sum() + (b.grad ** 2).sum()) == pytest.approx(total, abs=1e-15)


def test_a_quadratic_is_minimized():
    target = np.array([3.0, -1.0])
    for make in (lambda p: SGD([p], lr=0.1, momentum=0.5), lambda p: Adam([p], lr=0.1)):
        p = Tensor(np.zeros(2), requires_grad=True)
        optimizer = make(p)
        for _ in range(300):
            optimizer.zero_grad()
            ((p - target) ** 2).sum().backward()
            optimizer.step()
        np.testing.assert_allclose(p.data, target, atol=1e-3)  # converged: 300 steps of a contraction


def test_bad_settings_are_refused_by_name():
    p = [Tensor(START, requires_grad=True)]
    with pytest.raises(ValueError, match="lr must be positive"):
        SGD(p, lr=0.0)
    with pytest.raises(ValueError, match="parameters must not be empty"):
        Adam([])
    with pytest.raises(ValueError, match="nesterov"):
        SGD(p, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="betas"):
        Adam(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm(p, 0.0)
