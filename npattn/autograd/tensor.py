"""The Tensor: an array, its gradient, and the Function that made it (the graph's edges).

A Tensor wraps a NumPy or CuPy array without copying it. Functions applied to
Tensors that require gradients record themselves in the result's ``_ctx``;
:meth:`Tensor.backward` walks those records in reverse topological order (the
engine, in the manner of micrograd), accumulates gradients into the leaves'
``.grad`` and releases the graph as it goes.
"""
from __future__ import annotations

import contextlib
import threading

import numpy as np

from ..core.arrays import array_module

_STATE = threading.local()


def is_grad_enabled() -> bool:
    """False inside :func:`no_grad` (per thread)."""
    return getattr(_STATE, "grad_enabled", True)


@contextlib.contextmanager
def no_grad():
    """Run the block without recording: results do not require gradients."""
    previous = is_grad_enabled()
    _STATE.grad_enabled = False
    try:
        yield
    finally:
        _STATE.grad_enabled = previous


class Tensor:
    """An array with an optional gradient.

    Args:
        data: a NumPy or CuPy array (kept as is, not copied), or anything
            ``numpy.asarray`` takes.
        requires_grad: whether :meth:`backward` should fill ``.grad`` for this tensor.

    ``grad`` is None until a backward pass reaches the tensor; later passes add to it
    (call ``grad = None`` or an optimizer's ``zero_grad`` between steps).
    """

    __array_priority__ = 1000  # ndarray (op) Tensor defers to Tensor's reflected operators

    def __init__(self, data, requires_grad: bool = False):
        if isinstance(data, Tensor):
            data = data.data
        if isinstance(data, np.generic) or not (hasattr(data, "__array_namespace__")
                                                or hasattr(data, "__cuda_array_interface__")):
            data = np.asarray(data)  # lists, numbers and NumPy scalars become arrays
        self.data = data
        self.grad = None
        self.requires_grad = bool(requires_grad)
        self._ctx = None          # the Function that made this tensor, while the graph lives
        self._freed = False       # True once a backward pass released the graph behind it

    # ----- plain facts -------------------------------------------------------------------
    shape = property(lambda self: self.data.shape)
    dtype = property(lambda self: self.data.dtype)
    ndim = property(lambda self: self.data.ndim)
    size = property(lambda self: self.data.size)
    is_leaf = property(lambda self: self._ctx is None and not self._freed)

    def __len__(self):
        return len(self.data)

    def __repr__(self):
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor({self.data!r}{grad})"

    def numpy(self):
        """The data as a NumPy array (copied from the GPU for CuPy)."""
        from ..core.arrays import to_numpy

        return to_numpy(self.data)

    def item(self):
        """The one element as a Python number (raises for more than one element)."""
        return self.data.item()

    # ----- interop: NumPy, DLPack, Python numbers (the data only; the graph stays behind) --
    def __array__(self, dtype=None, copy=None):
        """``np.asarray(tensor)``: the data for NumPy data; CuPy data must be fetched
        explicitly with :meth:`numpy` (as CuPy arrays themselves require)."""
        if array_module(self.data) is not np:
            raise TypeError("np.asarray(tensor) of a tensor on the GPU: call tensor.numpy() to copy it "
                            "to the host")
        if copy:
            return np.array(self.data, dtype=dtype, copy=True)
        return self.data if dtype is None else self.data.astype(dtype, copy=False)

    def __dlpack__(self, *args, **kwargs):
        """The data through DLPack (``torch.from_dlpack(tensor)``, ``np.from_dlpack``), no copy."""
        return self.data.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self.data.__dlpack_device__()

    def __float__(self):
        """``float(loss)`` for a one-element tensor."""
        return float(self.item())

    def __int__(self):
        return int(self.item())

    def detach(self) -> "Tensor":
        """The same data, cut from the graph."""
        return Tensor(self.data)

    @property
    def xp(self):
        """``numpy`` or ``cupy``, whichever holds the data."""
        return array_module(self.data)

    # ----- the engine --------------------------------------------------------------------
    def backward(self, grad=None) -> None:
        """Add d(self)/d(leaf), contracted with ``grad``, into every leaf's ``.grad``.

        Args:
            grad: the gradient of the final quantity with respect to this tensor, of its
                shape; may be omitted only when this tensor has one element (a loss).

        Raises RuntimeError when the tensor does not require gradients, when ``grad`` is
        missing for a non-scalar, or when the graph was already released by an earlier
        backward pass.
        """
        if not self.requires_grad:
            raise RuntimeError("backward: this tensor does not require gradients (no input of the "
                               "computation had requires_grad=True, or it ran under no_grad())")
        if self._freed:
            raise RuntimeError("backward: the graph behind this tensor was released by an earlier "
                               "backward pass; recompute the forward to differentiate again")
        if grad is None:
            if self.size != 1:
                raise RuntimeError(f"backward: grad must be given for a non-scalar tensor of shape "
                                   f"{self.shape}; got None")
            grad = self.xp.ones_like(self.data)
        else:
            grad = grad.data if isinstance(grad, Tensor) else self.xp.asarray(grad, dtype=self.dtype)
            if grad.shape != self.shape:
                raise ValueError(f"backward: grad must have the tensor's shape {self.shape}; got {grad.shape}")

        pending = {id(self): grad}
        for node in reversed(_topological_order(self)):
            node_grad = pending.pop(id(node), None)
            ctx = node._ctx
            if ctx is None:  # a leaf
                if node_grad is not None:  # a copy: never a view of a caller's array or a broadcast
                    node.grad = node_grad.copy() if node.grad is None else node.grad + node_grad
                continue
            # release this step's saved arrays and edges as soon as they are used
            node._ctx, node._freed = None, True
            if node_grad is None:
                continue
            input_grads = ctx.backward(node_grad)
            if not isinstance(input_grads, tuple):
                input_grads = (input_grads,)
            for parent, parent_grad in zip(ctx.parents, input_grads):
                if parent_grad is None or not parent.requires_grad:
                    continue
                parent_grad = in_dtype(parent_grad, parent.data.dtype)
                key = id(parent)
                pending[key] = parent_grad if key not in pending else pending[key] + parent_grad
            ctx.release()

    # The operators (+, @, [], ...) and array methods (sum, reshape, T, ...) are installed
    # by ops.py, where the operations are: this module imports nothing of it.


def in_dtype(grad, dtype):
    """``grad`` in ``dtype``, its tensor's: a tensor's gradient always has the tensor's dtype
    (as torch's), whatever an operation's mixed dtypes promoted it to (a float32 tensor
    times a float64 array gives a float64 product, whose gradient the float32 tensor
    takes in float32)."""
    return grad if grad.dtype == dtype else grad.astype(dtype)


def _topological_order(root: Tensor) -> list:
    """Every tensor ``root`` depends on through recorded Functions, each after its inputs.
    Iterative (a deep graph must not hit Python's recursion limit)."""
    order, visited = [], set()
    stack = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if id(node) in visited:
            continue
        visited.add(id(node))
        stack.append((node, True))
        if node._ctx is not None:
            for parent in node._ctx.parents:
                if parent.requires_grad and id(parent) not in visited:
                    stack.append((parent, False))
        elif node._freed:
            raise RuntimeError("backward: part of the graph was released by an earlier backward "
                               "pass; recompute the forward to differentiate again")
    return order

