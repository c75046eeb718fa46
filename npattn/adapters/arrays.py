"""Any array in, the caller's kind out.

npattn's backends run on NumPy arrays (host memory: the cpu backend) and CuPy arrays (CUDA
memory: the gpu backend). An array of any other kind that speaks DLPack (torch tensors,
JAX arrays, and whatever else exports ``__dlpack__``) is viewed as one of these, by its
device, without a copy where the memory allows; the results go back through the caller's
own ``from_dlpack``, onto the caller's device. The caller's namespace is its array API
namespace (``x.__array_namespace__()``) where it has one, else the top-level module of
its type when that module has ``from_dlpack`` (torch).

bfloat16, which NumPy's DLPack cannot carry, crosses as int16 bits (the host side holds
it as ml_dtypes' bfloat16, which the cpu backend reads).
"""
from __future__ import annotations

import sys
from typing import Any, NamedTuple

import numpy as np

from ..core import arrays as _arrays
from ..core import options as _options
from ..core.problem import ARRAY_FIELDS

# The options given as arrays, in table order (the framework adapters pass them as
# array inputs, the rest as static values), and those with gradients, in the order
# attention_vjp returns them after dq, dk, dv.
ARRAY_OPTIONS = tuple(option.name for option in _options.OPTIONS if option.field in ARRAY_FIELDS)
DIFFERENTIABLE = _options.DIFFERENTIABLE


def with_plain_offsets(options: dict) -> dict:
    """``options`` with a per-entry ``q_offset`` (an int array or tensor (B,)) as a tuple of
    ints: a value the adapters can carry as a setting (torch's op schema, JAX's static
    arguments), which npattn reads as the same (B,) offsets."""
    offset = options.get("q_offset")
    if (offset is not None and getattr(offset, "ndim", 0) == 1 and hasattr(offset, "tolist")
            and "int" in str(getattr(offset, "dtype", ""))):  # other dtypes are left for the check to name
        return {**options, "q_offset": tuple(int(x) for x in offset.tolist())}
    return options


# NumPy dtypes DLPack carries (compared directly: dtype.name builds a string, 5 us)
_DLPACK_DTYPES = frozenset(np.dtype(name) for name in ("float16", "float32", "float64", "bool", "int32", "int64"))

# DLPack device types (dlpack.h): host memory, and CUDA memory CuPy can view
_HOST = frozenset({1, 3})  # kDLCPU, kDLCUDAHost
_CUDA = frozenset({2, 13})  # kDLCUDA, kDLCUDAManaged


def is_native(value: Any) -> bool:
    """A NumPy or CuPy array: what the backends take as it is."""
    return isinstance(value, np.ndarray) or _arrays.is_cupy(value)


class ForeignKind(NamedTuple):
    """The kind of the caller's arrays: their namespace, which has ``from_dlpack``."""

    namespace: Any

    @property
    def name(self) -> str:
        return self.namespace.__name__.split(".")[0]

    def native(self, name: str, value: Any) -> Any:
        """``value`` as a NumPy (host) or CuPy (CUDA) array sharing its memory; values of
        other kinds (NumPy, lists, None, scalars) pass through unchanged."""
        if is_native(value) or not hasattr(value, "__dlpack__"):
            return value
        value = value.detach() if hasattr(value, "detach") else value  # torch: no autograd through here
        device, _ = value.__dlpack_device__()
        if device in _CUDA:
            try:
                import cupy
            except ImportError:
                raise TypeError(f"{name} is a {self.name} array in CUDA memory: running it needs CuPy "
                                "(pip install 'npattn[gpu]')") from None
            return cupy.from_dlpack(value)
        if device not in _HOST:
            raise TypeError(f"{name} is a {self.name} array on DLPack device type {int(device)}; npattn runs "
                            "arrays in host memory (cpu backend) or CUDA memory (gpu backend)")
        try:
            return np.from_dlpack(value)
        except (BufferError, TypeError, RuntimeError):  # bfloat16 and other dtypes NumPy's DLPack lacks
            if _arrays.is_torch_bfloat16(value):
                return _arrays.torch_bfloat16_to_numpy(name, value)
            return np.asarray(value)  # JAX hands bfloat16 over as ml_dtypes' bfloat16

    def back(self, array: Any) -> Any:
        """A NumPy or CuPy result as the caller's kind, on the device of its memory."""
        if array is None:
            return None
        if array.dtype not in _DLPACK_DTYPES and array.dtype.name == "bfloat16":
            # DLPack of NumPy has no bfloat16: cross as int16 bits
            bits = self.namespace.from_dlpack(array.view(np.int16))
            return bits.view(self.namespace.bfloat16)
        return self.namespace.from_dlpack(array)

    def back_all(self, arrays: Any) -> Any:
        """:meth:`back` over an output or a tuple of them."""
        if isinstance(arrays, tuple):
            return tuple(self.back(array) for array in arrays)
        return self.back(arrays)


def foreign_kind(value: Any) -> ForeignKind | None:
    """The kind of ``value`` when it is an array npattn must convert (it exports DLPack
    and is neither NumPy nor CuPy); None otherwise."""
    if is_native(value) or not hasattr(value, "__dlpack__"):
        return None
    if hasattr(value, "__array_namespace__"):
        namespace = value.__array_namespace__()
    else:
        namespace = sys.modules.get(type(value).__module__.split(".")[0])
    if namespace is None or not hasattr(namespace, "from_dlpack"):
        return None  # no way back to the caller's kind: NumPy's array-like path takes it
    return ForeignKind(namespace)


def native_options(kind: ForeignKind, options: dict) -> dict:
    """``options`` with every array value of the caller's kind viewed natively."""
    return {name: kind.native(name, value) for name, value in options.items()}


# The framework adapters that take over a call their arrays need (autograd, tracing):
# by namespace name, each module's ``takes(values)`` says when.
_FRAMEWORK_ADAPTERS = {"torch": "npattn.adapters.torch", "jax": "npattn.adapters.jax"}


def _framework_adapter(kind: ForeignKind, values: tuple) -> Any:
    """The framework adapter module that must run a call on ``values``, or None."""
    module_name = _FRAMEWORK_ADAPTERS.get(kind.name)
    if module_name is None:
        return None
    import importlib

    adapter = importlib.import_module(module_name)
    return adapter if adapter.takes(values) else None


def attention(kind: ForeignKind, run: Any, q: Any, k: Any, v: Any, options: dict) -> Any:
    """``run(q, k, v, **options)`` (:func:`npattn.attention`) on arrays of ``kind``:
    through its framework's adapter where autograd or tracing needs one, else on native
    views, with the outputs handed back in ``kind``."""
    adapter = _framework_adapter(kind, (q, k, v, *options.values()))
    if adapter is not None:
        return adapter.attention(q, k, v, **options)
    outputs = run(kind.native("q", q), kind.native("k", k), kind.native("v", v), **native_options(kind, options))
    return kind.back_all(outputs)


def attention_vjp(kind: ForeignKind, run: Any, q: Any, k: Any, v: Any, options: dict) -> tuple[Any, Any]:
    """``run(q, k, v, **options)`` (:func:`npattn.attention_vjp`) on arrays of ``kind``:
    outputs, and a vjp taking and returning arrays of ``kind``."""
    if kind.name == "jax" and _framework_adapter(kind, (q, k, v, *options.values())) is not None:
        raise TypeError("attention_vjp got JAX tracers (inside jit, grad or vmap): use npattn.jax.attention, "
                        "which JAX differentiates itself")
    outputs, vjp = run(kind.native("q", q), kind.native("k", k), kind.native("v", v),
                       **native_options(kind, options))

    def foreign_vjp(dout: Any) -> tuple:
        return kind.back_all(vjp(kind.native("dout", dout)))

    return kind.back_all(outputs), foreign_vjp


def foreign_kind_of(*groups: Any) -> ForeignKind | None:
    """The kind of the first value of ``groups`` (iterables of values) that npattn must
    convert, or None when every value is NumPy, CuPy or no array."""
    for values in groups:
        for value in values:
            if type(value) not in _NOT_FOREIGN and (kind := foreign_kind(value)) is not None:
                return kind
    return None


_NOT_FOREIGN = frozenset({np.ndarray, type(None), bool, int, float, str, tuple})


def forward_only_call(kind: ForeignKind, name: str, run: Any, arguments: dict, options: dict,
                      written: tuple = ()) -> Any:
    """``run(**arguments, **options)`` for a call without gradients (the serving calls) on
    arrays of ``kind``: each array viewed natively (so the arrays named in ``written`` are
    written where they lie), the outputs handed back in ``kind``. Refuses, naming the
    argument, a tensor that autograd records (its gradient would be lost without a word)
    and a written array that cannot be written in place (JAX arrays are immutable)."""
    values = {**arguments, **options}
    if kind.name == "torch":
        import torch

        if torch.is_grad_enabled():
            for argument, value in values.items():
                if isinstance(value, torch.Tensor) and value.requires_grad:
                    raise TypeError(f"{name} has no gradients (it is for inference), but {argument} requires grad: "
                                    f"call it under torch.no_grad(), or pass {argument}.detach()")
    for argument in written:
        value = values[argument]
        if not is_native(value) and hasattr(value, "__dlpack__") and type(value).__module__.split(".")[0] in (
                "jax", "jaxlib"):
            raise TypeError(f"{argument} is a JAX array, which cannot be written in place, and {name} writes the new "
                            "keys into it: pass NumPy (or CuPy) caches, or call it without new keys")
    native = {argument: kind.native(argument, value) for argument, value in values.items()}
    return kind.back_all(run(**native))


def varlen_call(kind: ForeignKind, run: Any, arrays: dict, options: dict, with_vjp: bool) -> Any:
    """:func:`npattn.attention_varlen` (``run``; ``with_vjp``: its vjp form) on arrays of
    ``kind``: through the framework adapter where autograd or tracing needs one (forward
    only: the framework differentiates), else on native views with the outputs (and the
    vjp's gradients) handed back in ``kind``."""
    adapter = _framework_adapter(kind, (*arrays.values(), *options.values()))
    if adapter is not None:
        if with_vjp:
            raise TypeError(f"attention_varlen_vjp got {kind.name} arrays that {kind.name} differentiates (tensors "
                            f"that require grad, or tracers): call attention_varlen, which {kind.name}'s autograd "
                            "differentiates itself")
        return adapter.attention_varlen(**arrays, **options)
    native = {name: kind.native(name, value) for name, value in {**arrays, **options}.items()}
    if not with_vjp:
        return kind.back_all(run(**native))
    outputs, vjp = run(**native)
    return kind.back_all(outputs), lambda dout: kind.back_all(vjp(kind.native("dout", dout)))
