"""Tensor algebra: arithmetic with broadcasting, matmul, elementwise maps, reductions and
shape operations, each a :class:`~npattn.autograd.function.Function` with its backward.

Every function takes Tensors (or numbers and arrays, taken as constants) and returns a
Tensor; they work on NumPy and CuPy data alike.
"""
from __future__ import annotations

import math

from ..core.arrays import array_module
from .function import Function, as_tensor, cpu_kernel_takes, unbroadcast
from .tensor import Tensor


# ----- arithmetic ---------------------------------------------------------------------------

class _Add(Function):
    def forward(self, a, b):
        self.shapes = a.shape, b.shape
        return a + b

    def backward(self, grad):
        return tuple(unbroadcast(grad, shape) if needed else None
                     for shape, needed in zip(self.shapes, self.needs_input_grad))


class _Sub(Function):
    def forward(self, a, b):
        self.shapes = a.shape, b.shape
        return a - b

    def backward(self, grad):
        a_shape, b_shape = self.shapes
        return (unbroadcast(grad, a_shape) if self.needs_input_grad[0] else None,
                unbroadcast(-grad, b_shape) if self.needs_input_grad[1] else None)


class _Mul(Function):
    def forward(self, a, b):
        self.save_for_backward(a, b)
        return a * b

    def backward(self, grad):
        a, b = self.saved
        return (unbroadcast(grad * b, a.shape) if self.needs_input_grad[0] else None,
                unbroadcast(grad * a, b.shape) if self.needs_input_grad[1] else None)


class _Div(Function):
    def forward(self, a, b):
        self.save_for_backward(a, b)
        return a / b

    def backward(self, grad):
        a, b = self.saved
        return (unbroadcast(grad / b, a.shape) if self.needs_input_grad[0] else None,
                unbroadcast(-grad * a / (b * b), b.shape) if self.needs_input_grad[1] else None)


class _Power(Function):
    def forward(self, base, exponent):
        out = base ** exponent
        self.save_for_backward(base, exponent, out)
        return out

    def backward(self, grad):
        base, exponent, out = self.saved
        xp = array_module(base)
        d_base = d_exponent = None
        if self.needs_input_grad[0]:
            d_base = unbroadcast(grad * exponent * base ** (exponent - 1), base.shape)
        if self.needs_input_grad[1]:
            # d/de b**e = b**e log b; taken as 0 where b == 0 (the limit for e > 0)
            log_base = xp.log(xp.where(base > 0, base, 1))
            d_exponent = unbroadcast(grad * out * log_base, exponent.shape)
        return d_base, d_exponent


class _Neg(Function):
    def forward(self, a):
        return -a

    def backward(self, grad):
        return -grad


class _MatMul(Function):
    """``a @ b`` with NumPy's rules: 1-D operands are promoted and the added axis dropped,
    leading (batch) axes broadcast."""

    def forward(self, a, b):
        self.save_for_backward(a, b)
        return a @ b

    def backward(self, grad):
        a, b = self.saved
        xp = array_module(a)
        a2 = a[None, :] if a.ndim == 1 else a
        b2 = b[:, None] if b.ndim == 1 else b
        g = grad
        if b.ndim == 1:  # first: for two vectors, g is 0-D and becomes (1, 1)
            g = g[..., None]
        if a.ndim == 1:
            g = g[..., None, :]
        d_a = d_b = None
        if self.needs_input_grad[0]:
            d_a = unbroadcast(g @ xp.swapaxes(b2, -1, -2), a2.shape).reshape(a.shape)
        if self.needs_input_grad[1]:
            d_b = unbroadcast(xp.swapaxes(a2, -1, -2) @ g, b2.shape).reshape(b.shape)
        return d_a, d_b


def add(a, b) -> Tensor:
    """``a + b`` with broadcasting."""
    return _Add.apply(a, b)


def sub(a, b) -> Tensor:
    """``a - b`` with broadcasting."""
    return _Sub.apply(a, b)


def mul(a, b) -> Tensor:
    """``a * b`` with broadcasting."""
    return _Mul.apply(a, b)


def div(a, b) -> Tensor:
    """``a / b`` with broadcasting."""
    return _Div.apply(a, b)


def power(a, b) -> Tensor:
    """``a ** b`` with broadcasting; differentiable in both (in ``b`` where ``a > 0``)."""
    return _Power.apply(a, b)


def neg(a) -> Tensor:
    return _Neg.apply(a)


def matmul(a, b) -> Tensor:
    """``a @ b`` (NumPy semantics: batched, broadcast, 1-D operands promoted)."""
    return _MatMul.apply(a, b)


# ----- elementwise maps ---------------------------------------------------------------------

class _Exp(Function):
    def forward(self, a):
        self.out = array_module(a).exp(a)
        return self.out

    def backward(self, grad):
        return grad * self.out


class _Log(Function):
    def forward(self, a):
        self.a = a
        return array_module(a).log(a)

    def backward(self, grad):
        return grad / self.a


class _Tanh(Function):
    def forward(self, a):
        self.out = array_module(a).tanh(a)
        return self.out

    def backward(self, grad):
        return grad * (1 - self.out * self.out)


class _Sigmoid(Function):
    def forward(self, a):
        xp = array_module(a)
        # exp of a non-positive number only: no overflow for large |a|
        e = xp.exp(-xp.abs(a))
        self.out = xp.where(a >= 0, 1 / (1 + e), e / (1 + e))
        return self.out

    def backward(self, grad):
        return grad * self.out * (1 - self.out)


class _Relu(Function):
    def forward(self, a):
        self.positive = a > 0
        return a * self.positive

    def backward(self, grad):
        return grad * self.positive


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


class _Gelu(Function):
    def forward(self, a, approximate="none"):
        xp = array_module(a)
        self.a, self.approximate = a, approximate
        if approximate == "tanh":
            # a * a * a, as torch's kernel: NumPy's a ** 3 takes its general power (23.9 ns a
            # value for the whole form on one Zen 3 core, 8.8-9.4 with the products)
            self.inner = xp.tanh(_SQRT_2_OVER_PI * (a + 0.044715 * (a * a * a)))
            return 0.5 * a * (1 + self.inner)
        if cpu_kernel_takes(a):  # the vector kernel (6x SciPy's erf form; its backward needs only a)
            from ..cpu.activations import gelu

            return gelu(a)
        self.cdf = 0.5 * (1 + _erf(a / math.sqrt(2.0)))
        return a * self.cdf

    def backward(self, grad):
        a = self.a
        xp = array_module(a)
        if self.approximate == "tanh":
            t = self.inner
            d_inner = _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * a * a)
            return grad * (0.5 * (1 + t) + 0.5 * a * (1 - t * t) * d_inner)
        if not hasattr(self, "cdf"):  # the vector kernel's forward
            if grad.shape == a.shape and cpu_kernel_takes(grad):
                from ..cpu.activations import gelu_gradient

                return gelu_gradient(a, grad)
            self.cdf = 0.5 * (1 + _erf(a / math.sqrt(2.0)))  # (a grad of another dtype or kind)
        density = xp.exp(-0.5 * a * a) / math.sqrt(2.0 * math.pi)
        return grad * (self.cdf + a * density)


def _erf(x):
    """The error function on NumPy or CuPy arrays (SciPy's when installed, else math.erf
    element by element)."""
    xp = array_module(x)
    if xp.__name__ == "cupy":
        from cupyx.scipy.special import erf

        return erf(x)
    try:
        from scipy.special import erf
    except ImportError:
        return xp.vectorize(math.erf, otypes=[x.dtype])(x) if x.size else x.copy()
    return erf(x).astype(x.dtype, copy=False)


class _Clip(Function):
    def forward(self, a, low=None, high=None):
        xp = array_module(a)
        self.inside = xp.ones(a.shape, bool)
        if low is not None:
            self.inside &= a >= low
        if high is not None:
            self.inside &= a <= high
        return xp.clip(a, low, high)

    def backward(self, grad):
        return grad * self.inside


def clip(a, low=None, high=None) -> Tensor:
    """Values limited to [low, high] (either may be None); the gradient passes where ``a``
    is inside the range, bounds included."""
    return _Clip.apply(a, low=low, high=high)


def exp(a) -> Tensor:
    return _Exp.apply(a)


def log(a) -> Tensor:
    return _Log.apply(a)


def tanh(a) -> Tensor:
    return _Tanh.apply(a)


def sigmoid(a) -> Tensor:
    return _Sigmoid.apply(a)


def relu(a) -> Tensor:
    return _Relu.apply(a)


def gelu(a, approximate: str = "none") -> Tensor:
    """GELU, ``x * Phi(x)``; ``approximate="tanh"`` for the tanh form (torch's signature)."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh'; got {approximate!r}")
    return _Gelu.apply(a, approximate=approximate)


# ----- reductions -----------------------------------------------------------------------------

def _axes(axis, ndim):
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    return tuple(a % ndim for a in axes)


def _expand_reduced(grad, shape, axes, keepdims):
    """A reduction's gradient reshaped so it broadcasts against the input of ``shape``."""
    if not keepdims:
        grad = grad.reshape(tuple(1 if i in axes else n for i, n in enumerate(shape)))
    return grad


class _Sum(Function):
    def forward(self, a, axis=None, keepdims=False):
        self.shape, self.axes, self.keepdims = a.shape, _axes(axis, a.ndim), keepdims
        return a.sum(axis=self.axes, keepdims=keepdims)

    def backward(self, grad):
        xp = array_module(grad)
        return xp.broadcast_to(_expand_reduced(grad, self.shape, self.axes, self.keepdims), self.shape)


class _Mean(Function):
    def forward(self, a, axis=None, keepdims=False):
        self.shape, self.axes, self.keepdims = a.shape, _axes(axis, a.ndim), keepdims
        self.count = math.prod(a.shape[i] for i in self.axes)
        return a.mean(axis=self.axes, keepdims=keepdims)

    def backward(self, grad):
        xp = array_module(grad)
        grad = _expand_reduced(grad, self.shape, self.axes, self.keepdims) / self.count
        return xp.broadcast_to(grad, self.shape)


class _Max(Function):
    """The gradient goes to the maxima, split evenly among ties (as ``torch.amax``)."""

    def forward(self, a, axis=None, keepdims=False):
        self.axes, self.keepdims = _axes(axis, a.ndim), keepdims
        best = a.max(axis=self.axes, keepdims=True)
        winners = (a == best).astype(a.dtype)  # (in a's dtype: a bool share would be float64)
        self.share = winners / winners.sum(axis=self.axes, keepdims=True)
        return best if keepdims else best.squeeze(axis=self.axes)

    def backward(self, grad):
        return _expand_reduced(grad, self.share.shape, self.axes, self.keepdims) * self.share


def sum(a, axis=None, keepdims: bool = False) -> Tensor:  # noqa: A001  (NumPy's name)
    return _Sum.apply(a, axis=axis, keepdims=keepdims)


def mean(a, axis=None, keepdims: bool = False) -> Tensor:
    return _Mean.apply(a, axis=axis, keepdims=keepdims)


def max(a, axis=None, keepdims: bool = False) -> Tensor:  # noqa: A001  (NumPy's name)
    return _Max.apply(a, axis=axis, keepdims=keepdims)


# ----- shapes --------------------------------------------------------------------------------

class _Reshape(Function):
    def forward(self, a, shape):
        self.shape = a.shape
        return a.reshape(shape)

    def backward(self, grad):
        return grad.reshape(self.shape)


class _Transpose(Function):
    def forward(self, a, axes=None):
        self.axes = tuple(reversed(range(a.ndim))) if axes is None else tuple(ax % a.ndim for ax in axes)
        return a.transpose(self.axes)

    def backward(self, grad):
        inverse = [0] * len(self.axes)
        for position, axis in enumerate(self.axes):
            inverse[axis] = position
        return grad.transpose(inverse)


class _GetItem(Function):
    def forward(self, a, index):
        self.shape, self.dtype, self.index = a.shape, a.dtype, index
        return a[index]

    def backward(self, grad):
        xp = array_module(grad)
        full = xp.zeros(self.shape, self.dtype)
        # add.at: repeated integer indices accumulate, as a gather's gradient must
        xp.add.at(full, self.index, grad)
        return full


class _Concat(Function):
    def forward(self, *arrays, axis=0):
        xp = array_module(arrays[0])
        self.axis = axis % arrays[0].ndim
        self.bounds = [0]
        for array in arrays:
            self.bounds.append(self.bounds[-1] + array.shape[self.axis])
        return xp.concatenate(arrays, axis=self.axis)

    def backward(self, grad):
        xp = array_module(grad)
        return tuple(xp.take(grad, xp.arange(lo, hi), axis=self.axis) if needed else None
                     for lo, hi, needed in zip(self.bounds, self.bounds[1:], self.needs_input_grad))


class _Stack(Function):
    def forward(self, *arrays, axis=0):
        xp = array_module(arrays[0])
        self.axis = axis
        return xp.stack(arrays, axis=axis)

    def backward(self, grad):
        xp = array_module(grad)
        return tuple(xp.take(grad, i, axis=self.axis) if needed else None
                     for i, needed in enumerate(self.needs_input_grad))


def reshape(a, shape) -> Tensor:
    return _Reshape.apply(a, shape=tuple(shape) if not isinstance(shape, int) else (shape,))


def transpose(a, axes=None) -> Tensor:
    """Axes permuted (reversed when ``axes`` is None)."""
    return _Transpose.apply(a, axes=axes)


def getitem(a, index) -> Tensor:
    """``a[index]``: basic and advanced (integer array, boolean) indexing."""
    if isinstance(index, Tensor):
        index = index.data
    elif isinstance(index, tuple):
        index = tuple(i.data if isinstance(i, Tensor) else i for i in index)
    return _GetItem.apply(a, index=index)


def concat(tensors, axis: int = 0) -> Tensor:
    """Tensors joined along an existing axis."""
    if not tensors:
        raise ValueError("concat: tensors must be a non-empty sequence; got an empty one")
    return _Concat.apply(*tensors, axis=axis)


def stack(tensors, axis: int = 0) -> Tensor:
    """Tensors joined along a new axis."""
    if not tensors:
        raise ValueError("stack: tensors must be a non-empty sequence; got an empty one")
    return _Stack.apply(*tensors, axis=axis)


def split(a, sections, axis: int = 0) -> list:
    """``numpy.split``'s pieces: ``sections`` is a count of equal parts or the split indices."""
    a = as_tensor(a)
    length = a.shape[axis]
    if isinstance(sections, int):
        if sections <= 0 or length % sections:
            raise ValueError(f"split: sections must divide the axis length {length}; got {sections}")
        step = length // sections
        cuts = list(range(step, length, step))
    else:
        cuts = list(sections)
    bounds = [0, *cuts, length]
    pieces = []
    for lo, hi in zip(bounds, bounds[1:]):
        index = [slice(None)] * a.ndim
        index[axis] = slice(lo, hi)
        pieces.append(getitem(a, tuple(index)))
    return pieces


# ----- Tensor's operators and array methods ---------------------------------------------
# Installed on the class here (as JAX installs its array methods from its numpy layer),
# so the dependency runs one way: ops -> function -> tensor.

def _shape_argument(shape):
    return shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape


def _reshape_method(self, *shape):
    return reshape(self, _shape_argument(shape))


def _transpose_method(self, *axes):
    return transpose(self, _shape_argument(axes) or None)


def _reduction_method(reduce):
    def method(self, axis=None, keepdims=False):
        return reduce(self, axis=axis, keepdims=keepdims)
    method.__doc__ = reduce.__doc__
    return method


def _reflected(operation):
    def method(self, other):
        return operation(other, self)
    return method


_METHODS = {
    "__add__": add, "__radd__": _reflected(add), "__sub__": sub, "__rsub__": _reflected(sub),
    "__mul__": mul, "__rmul__": _reflected(mul), "__truediv__": div, "__rtruediv__": _reflected(div),
    "__pow__": power, "__rpow__": _reflected(power), "__matmul__": matmul, "__rmatmul__": _reflected(matmul),
    "__neg__": neg, "__getitem__": getitem, "exp": exp, "log": log,
    "reshape": _reshape_method, "transpose": _transpose_method,
    "sum": _reduction_method(sum), "mean": _reduction_method(mean), "max": _reduction_method(max),
    "T": property(lambda self: transpose(self), doc="All axes reversed (NumPy's ``.T``)."),
}
for _name, _method in _METHODS.items():
    setattr(Tensor, _name, _method)
