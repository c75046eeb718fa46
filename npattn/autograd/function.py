"""Function: one differentiable step, whose instance is the context of its own backward.

Subclasses implement ``forward(self, *arrays, **options)``, which computes on raw
arrays and keeps what ``backward`` needs as attributes (or via
:meth:`Function.save_for_backward`), and ``backward(self, grad)``, which returns one
gradient per tensor input, None where ``self.needs_input_grad`` is False (or where the
input has no gradient at all). Use them through :meth:`Function.apply`.
"""
from __future__ import annotations

from ..core.arrays import array_module
from .tensor import Tensor, is_grad_enabled


class Function:
    """Base class of the autograd's differentiable operations (teenygrad's pattern)."""

    parents: tuple = ()
    needs_input_grad: tuple = ()

    def forward(self, *arrays, **options):
        raise NotImplementedError

    def backward(self, grad):
        raise NotImplementedError

    def save_for_backward(self, *arrays) -> None:
        self.saved = arrays

    def release(self) -> None:
        """Drop everything the backward needed (the engine calls this once it ran)."""
        self.__dict__.clear()

    @classmethod
    def apply(cls, *inputs, **options) -> Tensor:
        """Run ``forward`` on the inputs' arrays; record the step when any input requires
        a gradient and recording is on. Non-Tensor inputs become constant Tensors."""
        return cls.apply_with_context(*inputs, **options)[0]

    @classmethod
    def apply_with_context(cls, *inputs, **options):
        """:meth:`apply`, also returning the Function instance (for side outputs its
        ``forward`` kept, such as attention's lse)."""
        tensors = tuple(as_tensor(x, like=_first_tensor(inputs)) for x in inputs)
        ctx = cls()
        ctx.needs_input_grad = tuple(t.requires_grad for t in tensors)
        record = is_grad_enabled() and any(ctx.needs_input_grad)
        out = Tensor(ctx.forward(*(t.data for t in tensors), **options), requires_grad=record)
        if record:
            ctx.parents = tensors
            out._ctx = ctx
        return out, ctx


def _first_tensor(inputs):
    for x in inputs:
        if isinstance(x, Tensor):
            return x
    return None


def as_tensor(value, like=None) -> Tensor:
    """``value`` as a Tensor: Tensors pass through; Python numbers take ``like``'s dtype (so
    ``0.5 * x`` stays float32 for a float32 ``x``) and array module."""
    if isinstance(value, Tensor):
        return value
    if like is not None and isinstance(value, (int, float, bool)):
        return Tensor(like.xp.asarray(value, dtype=like.dtype))
    if like is not None and not hasattr(value, "shape"):
        return Tensor(like.xp.asarray(value))
    return Tensor(value)


def unbroadcast(grad, shape):
    """``grad`` summed down to ``shape``: the backward of NumPy broadcasting (over added
    leading axes and over axes where ``shape`` has 1)."""
    if grad.shape == tuple(shape):
        return grad
    xp = array_module(grad)
    extra = grad.ndim - len(shape)
    if extra:
        grad = grad.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    if axes:
        grad = grad.sum(axis=axes, keepdims=True)
    return xp.reshape(grad, shape)


def cpu_kernel_takes(*arrays) -> bool:
    """Whether the CPU backend's float32 kernels for the autograd (the exact GELU,
    :mod:`npattn.cpu.activations`; layer and RMS normalization,
    :mod:`npattn.cpu.normalization`) take ``arrays``: non-empty float32 NumPy arrays (None
    entries allowed: absent parameters), where Numba can run. Other arrays keep the
    NumPy or CuPy forms."""
    if any(a is not None and (a.dtype != "float32" or array_module(a).__name__ != "numpy" or a.size == 0)
           for a in arrays):
        return False
    from .. import cpu

    return cpu.unavailable_reason("numpy") is None
