"""CPU backend: Numba-jitted, tiled (FlashAttention-style online softmax) kernels.

The kernels are not built yet, so this backend reports itself unavailable and
``backend="auto"`` runs NumPy arrays on the float64 reference meanwhile.
A backend module provides ``NAME``, ``unavailable_reason(array_kind)``,
``forward(problem) -> ForwardResult`` and ``backward(problem, saved, dout) -> Gradients``
(see :mod:`npattn.reference`, the model implementation).
"""
NAME = "cpu"


def unavailable_reason(array_kind: str = "numpy") -> str | None:
    if array_kind != "numpy":
        return f"the cpu backend takes NumPy arrays, got {array_kind} arrays"
    return "the Numba CPU kernels are not implemented yet"
