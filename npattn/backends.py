"""The backend registry: which backends exist, which can run, and which one a call uses.

A backend is a module with ``NAME``, ``unavailable_reason(array_kind) -> str | None``,
``forward(problem) -> ForwardResult`` and ``backward(problem, saved, dout) -> Gradients``.
Adding one is one line in ``_MODULES``. Modules are imported only when asked for,
so ``import npattn`` never imports Numba or CuPy.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

_MODULES = {
    "reference": "npattn.reference",
    "cpu": "npattn.cpu",
    "gpu": "npattn.gpu",
}
BACKEND_NAMES = ("auto",) + tuple(_MODULES)
_PREFERRED = {"numpy": ("cpu", "reference"), "cupy": ("gpu", "reference")}


@dataclass(frozen=True)
class BackendStatus:
    """Whether a backend can run here; truthy when it can. ``reason`` says why not."""

    available: bool
    reason: str | None = None

    def __bool__(self) -> bool:
        return self.available


def backends() -> dict[str, BackendStatus]:
    """Each backend's name mapped to its :class:`BackendStatus` on this machine
    (for its natural array kind: NumPy for "reference" and "cpu", CuPy for "gpu")."""
    statuses = {}
    for name in _MODULES:
        kind = "cupy" if name == "gpu" else "numpy"
        reason = _unavailable_reason(name, kind)
        statuses[name] = BackendStatus(reason is None, reason)
    return statuses


def resolve(name: str, array_kind: str) -> ModuleType:
    """The backend module that runs ``array_kind`` arrays under the user's ``backend=name``.

    "auto" picks the fastest available one for the array kind. Raises ValueError for
    an unknown name and when the named backend cannot run here.
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {name!r}")
    if name == "auto":
        for candidate in _PREFERRED[array_kind]:
            if _unavailable_reason(candidate, array_kind) is None:
                return importlib.import_module(_MODULES[candidate])
        raise RuntimeError(f"no backend can run {array_kind} arrays here")  # reference always can
    reason = _unavailable_reason(name, array_kind)
    if reason is not None:
        raise ValueError(f"backend {name!r} is unavailable here: {reason}")
    return importlib.import_module(_MODULES[name])


def _unavailable_reason(name: str, array_kind: str) -> str | None:
    try:
        module = importlib.import_module(_MODULES[name])
    except ImportError as error:  # a missing optional dependency
        return f"cannot import {_MODULES[name]}: {error}"
    return module.unavailable_reason(array_kind)
