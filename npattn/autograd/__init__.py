"""A small, exact reverse-mode autograd: train attention models with NumPy or CuPy alone.

    from npattn import autograd as ag
    x = ag.Tensor(np.ones((2, 3)), requires_grad=True)
    loss = (ag.tanh(x @ w) ** 2).mean()
    loss.backward()          # x.grad, w.grad

- :class:`Tensor` (``tensor.py``): the array, its ``grad``, the engine (``backward``).
- :class:`Function` (``function.py``): one differentiable step; subclass it for new ones.
- ``ops.py``: arithmetic with broadcasting, matmul, elementwise maps, reductions, shapes.
- ``functional.py``: linear, softmax, cross_entropy, layer_norm, rms_norm, dropout,
  embedding, and ``attention`` as one fused node over :func:`npattn.attention_vjp`.
- :func:`gradcheck`: float64 finite-difference checks of any function's gradients.

Importing it needs only NumPy.
"""
from .tensor import Tensor, is_grad_enabled, no_grad  # first: the modules below build on it
from .function import Function
from .functional import (attention, cross_entropy, dropout, embedding, layer_norm, linear,
                         log_softmax, rms_norm, softmax)
from .gradcheck import GradcheckError, gradcheck
from .ops import (add, clip, concat, div, exp, gelu, getitem, log, matmul, max, mean, mul, neg, power,
                  relu, reshape, sigmoid, split, stack, sub, sum, tanh, transpose)

__all__ = [
    "Tensor", "Function", "no_grad", "is_grad_enabled", "gradcheck", "GradcheckError",
    "add", "clip", "sub", "mul", "div", "power", "neg", "matmul", "exp", "log", "tanh", "sigmoid",
    "relu", "gelu", "sum", "mean", "max", "reshape", "transpose", "getitem", "split", "concat",
    "stack", "linear", "softmax", "log_softmax", "cross_entropy", "layer_norm", "rms_norm",
    "dropout", "embedding", "attention",
]
