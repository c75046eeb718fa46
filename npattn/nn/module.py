"""Module: parameters, submodules, train/eval mode and state dicts, in torch's manner.

Assigning a :class:`~npattn.autograd.Tensor` that requires gradients to an attribute
registers it as a parameter; assigning a Module registers a submodule. Names are
dotted paths (``q_proj.weight``), in assignment order, so ``state_dict`` keys match
torch's for the same layout of attributes.

Called with arrays of another kind that speaks DLPack (torch tensors, JAX arrays), a
module computes on views of them and returns its arrays in that kind
(:mod:`npattn.adapters.arrays`); its own autograd does not reach into the caller's
framework (use :mod:`npattn.torch` or :mod:`npattn.jax` for that).
"""
from __future__ import annotations

import numpy as np

from ..core.arrays import array_module, to_numpy
from ..adapters import arrays as _foreign
from ..autograd import Tensor


class Module:
    """Base class of npattn's layers. Subclasses assign parameters and submodules in
    ``__init__``, compute in ``forward`` and initialize their own parameters in
    ``_reset_own(rng)`` (called by :meth:`reset_parameters`, parents before children)."""

    def __init__(self):
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "training", True)

    def __setattr__(self, name, value):
        if "_parameters" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__}: call Module.__init__() before assigning {name!r}")
        self._parameters.pop(name, None)
        self._modules.pop(name, None)
        if isinstance(value, Tensor) and value.requires_grad:
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        object.__setattr__(self, name, value)

    def __call__(self, *args, **kwargs):
        kind = next((kind for kind in map(_foreign.foreign_kind, (*args, *kwargs.values())) if kind is not None), None)
        if kind is None:
            return self.forward(*args, **kwargs)
        args = [kind.native(f"{type(self).__name__} argument {index}", value) for index, value in enumerate(args)]
        kwargs = {name: kind.native(name, value) for name, value in kwargs.items()}
        return _in_kind(kind, self.forward(*args, **kwargs))

    def forward(self, *args, **kwargs):
        raise NotImplementedError

    # ----- traversal -----------------------------------------------------------------------
    def named_modules(self, prefix: str = ""):
        """``(dotted name, module)`` for this module ("" for itself) and every descendant."""
        yield prefix, self
        for name, module in self._modules.items():
            yield from module.named_modules(f"{prefix}.{name}" if prefix else name)

    def named_parameters(self, prefix: str = ""):
        """``(dotted name, Tensor)`` for every parameter, this module's first."""
        for module_name, module in self.named_modules(prefix):
            for name, parameter in module._parameters.items():
                yield (f"{module_name}.{name}" if module_name else name), parameter

    def parameters(self) -> list:
        return [parameter for _, parameter in self.named_parameters()]

    def num_parameters(self) -> int:
        """The number of trainable scalars."""
        return sum(int(p.size) for p in self.parameters())

    # ----- modes ----------------------------------------------------------------------------
    def train(self, mode: bool = True) -> "Module":
        """Training mode (dropout on) for this module and its descendants; returns self."""
        for _, module in self.named_modules():
            object.__setattr__(module, "training", bool(mode))
        return self

    def eval(self) -> "Module":
        return self.train(False)

    # ----- initialization and state -----------------------------------------------------------
    def reset_parameters(self, seed=None) -> "Module":
        """Draw every parameter afresh from ``numpy.random.default_rng(seed)`` (the same seed
        gives the same parameters); returns self."""
        rng = np.random.default_rng(seed)
        for _, module in self.named_modules():
            module._reset_own(rng)
        return self

    def _reset_own(self, rng) -> None:
        """Initialize this module's own parameters (not its submodules')."""

    def to(self, kind: str) -> "Module":
        """Move every parameter to ``kind`` arrays, "numpy" or "cupy" (then calls on CuPy
        inputs run on the gpu backend), in place: the Tensors stay the same objects, so
        an optimizer built on them keeps working (its state follows on the next step).
        Gradients are cleared. Returns the module."""
        if kind not in ("numpy", "cupy"):
            raise ValueError(f"to() takes 'numpy' or 'cupy', got {kind!r}")
        if kind == "cupy":
            import cupy

            convert = cupy.asarray
        else:
            convert = to_numpy
        for _, parameter in self.named_parameters():
            parameter.data = convert(parameter.data)
            parameter.grad = None
        return self

    def state_dict(self) -> dict:
        """``{dotted name: NumPy array}``: copies of every parameter."""
        return {name: to_numpy(parameter.data).copy() for name, parameter in self.named_parameters()}

    def load_state_dict(self, state: dict) -> None:
        """Copy arrays into the parameters, in place (optimizers keep working).

        Raises KeyError naming every missing and every unexpected key, or ValueError
        naming the first key whose shape differs, before anything is changed."""
        parameters = dict(self.named_parameters())
        missing = [name for name in parameters if name not in state]
        unexpected = [name for name in state if name not in parameters]
        if missing or unexpected:
            raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        for name, parameter in parameters.items():
            shape = tuple(np.shape(state[name]))
            if shape != parameter.shape:
                raise ValueError(f"load_state_dict: {name!r} must have shape {parameter.shape}; got {shape}")
        for name, parameter in parameters.items():
            xp = array_module(parameter.data)
            parameter.data[...] = xp.asarray(state[name], dtype=parameter.dtype)

    def __repr__(self):
        children = "".join(f"\n  ({name}): " + repr(module).replace("\n", "\n  ")
                           for name, module in self._modules.items())
        return f"{type(self).__name__}({self.extra_repr()}{children}{chr(10) if children else ''})"

    def extra_repr(self) -> str:
        return ""


def _in_kind(kind, result):
    """A forward's result (a Tensor, an array or a tuple of them) as arrays of ``kind``."""
    if isinstance(result, tuple):
        return tuple(_in_kind(kind, item) for item in result)
    if isinstance(result, Tensor):
        return kind.back(result.data)
    return kind.back(result) if _foreign.is_native(result) else result


def parameter(shape, dtype) -> Tensor:
    """A zero-filled parameter (a module's ``_reset_own`` then draws its values)."""
    return Tensor(np.zeros(shape, dtype=np.dtype(dtype)), requires_grad=True)


def xavier_uniform(rng, tensor: Tensor) -> None:
    """Fill a (fan_out, fan_in) weight in place from U(-a, a), a = sqrt(6 / (fan_in + fan_out))."""
    fan_out, fan_in = tensor.shape[0], int(np.prod(tensor.shape[1:]))
    bound = np.sqrt(6.0 / (fan_in + fan_out))
    tensor.data[...] = rng.uniform(-bound, bound, tensor.shape)
