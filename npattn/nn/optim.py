"""Optimizers for :class:`npattn.autograd.Tensor` parameters: SGD, Adam, AdamW, and a
gradient-norm clip. They follow torch.optim's update rules and defaults::

    optimizer = Adam(model.parameters(), lr=1e-3)
    for batch in data:
        optimizer.zero_grad()
        loss = model(batch)
        loss.backward()
        clip_grad_norm(model.parameters(), 1.0)
        optimizer.step()

Parameters are updated in place (``p.data`` keeps its identity), so views of the
parameters and state dicts stay valid. Parameters whose ``grad`` is None are skipped.
"""
from __future__ import annotations

import math

from ..core import arguments
from ..core.arrays import array_module


class Optimizer:
    """Holds the parameters; subclasses implement :meth:`_update` for one parameter."""

    def __init__(self, parameters, lr: float):
        self.parameters = list(parameters)
        if not self.parameters:
            raise ValueError(f"{type(self).__name__}: parameters must not be empty")
        self.lr = arguments.positive(type(self).__name__, "lr", lr)
        self.state = [dict() for _ in self.parameters]
        self.steps = 0

    def zero_grad(self) -> None:
        """Forget every parameter's gradient (the next backward starts from zero)."""
        for parameter in self.parameters:
            parameter.grad = None

    def step(self) -> None:
        """One update of every parameter that has a gradient."""
        self.steps += 1
        for parameter, state in zip(self.parameters, self.state):
            if parameter.grad is not None:
                self._update(parameter, parameter.grad.astype(parameter.dtype, copy=False), state)

    def _update(self, parameter, grad, state) -> None:
        raise NotImplementedError


class SGD(Optimizer):
    """Stochastic gradient descent with optional momentum (torch's form: ``b = mu b + g``,
    then ``p -= lr b``; Nesterov uses ``g + mu b``) and L2 weight decay (added to g)."""

    def __init__(self, parameters, lr: float, momentum: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False):
        super().__init__(parameters, lr)
        momentum = arguments.real("SGD", "momentum", momentum, low=0.0, high=1.0)
        weight_decay = arguments.real("SGD", "weight_decay", weight_decay, low=0.0)
        if nesterov and momentum == 0:
            raise ValueError("SGD: nesterov needs a momentum > 0")
        self.momentum, self.weight_decay, self.nesterov = momentum, weight_decay, nesterov

    def _update(self, parameter, grad, state):
        if self.weight_decay:
            grad = grad + self.weight_decay * parameter.data
        if self.momentum:
            buffer = state.get("momentum")
            buffer = grad.copy() if buffer is None else self.momentum * buffer + grad
            state["momentum"] = buffer
            grad = grad + self.momentum * buffer if self.nesterov else buffer
        parameter.data -= self.lr * grad


class Adam(Optimizer):
    """Adam with bias correction; ``weight_decay`` is L2 (added to the gradient) as in
    torch's Adam. See :class:`AdamW` for decoupled decay."""

    decoupled = False

    def __init__(self, parameters, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        super().__init__(parameters, lr)
        owner = type(self).__name__
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise TypeError(f"{owner}: betas must be a pair (beta1, beta2); got {betas!r}")
        beta1, beta2 = (arguments.real(owner, f"betas[{i}]", beta, low=0.0, high=1.0, high_open=True)
                        for i, beta in enumerate(betas))
        eps = arguments.positive(owner, "eps", eps)
        weight_decay = arguments.real(owner, "weight_decay", weight_decay, low=0.0)
        self.betas, self.eps, self.weight_decay = (beta1, beta2), eps, weight_decay

    def _update(self, parameter, grad, state):
        xp = array_module(grad)
        beta1, beta2 = self.betas
        if self.weight_decay and self.decoupled:
            parameter.data *= 1 - self.lr * self.weight_decay
        elif self.weight_decay:
            grad = grad + self.weight_decay * parameter.data
        if "m" not in state:
            state["m"], state["v"], state["t"] = xp.zeros_like(grad), xp.zeros_like(grad), 0
        state["t"] += 1
        m, v, t = state["m"], state["v"], state["t"]
        m *= beta1
        m += (1 - beta1) * grad
        v *= beta2
        v += (1 - beta2) * grad * grad
        step_size = self.lr / (1 - beta1 ** t)
        denominator = xp.sqrt(v / (1 - beta2 ** t)) + self.eps
        parameter.data -= (step_size * m / denominator).astype(parameter.dtype, copy=False)


class AdamW(Adam):
    """Adam with decoupled weight decay (``p *= 1 - lr * weight_decay`` before the step),
    default 0.01 as torch's AdamW."""

    decoupled = True

    def __init__(self, parameters, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        super().__init__(parameters, lr, betas, eps, weight_decay)


def clip_grad_norm(parameters, max_norm: float) -> float:
    """Scale every gradient by ``max_norm / total_norm`` when the total 2-norm of all
    gradients together exceeds ``max_norm``; returns the norm before clipping."""
    max_norm = arguments.positive("clip_grad_norm", "max_norm", max_norm)
    grads = [p for p in parameters if p.grad is not None]
    total = math.sqrt(sum(float((p.grad.astype("float64") ** 2).sum()) for p in grads))
    if total > max_norm:
        factor = max_norm / (total + 1e-6)
        for p in grads:
            p.grad = p.grad * factor
    return total
