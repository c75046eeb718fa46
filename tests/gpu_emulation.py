"""Run npattn's CUDA kernels on the CPU: the sources built by the host C++ compiler with
tests/gpu_emulation.h (one OS thread per CUDA thread), launched through ctypes in place
of CuPy.

:func:`emulated_gpu` patches :mod:`npattn.gpu.launch` and the backend's availability so
that ``backend="gpu"`` takes NumPy arrays and runs every kernel here: the driver, the
kernels' indexing, masking, online softmax, dropout and gradients are all exercised
before any GPU is at hand. Only the instantiations in :data:`EMULATED` are built (a
full build takes minutes of compile time).
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import shutil
import subprocess
from pathlib import Path

import numpy as np

from npattn.gpu import launch, sources

_HEADER = Path(__file__).with_name("gpu_emulation.h")
# (dtype name, head-dim bound) pairs built for the emulation
EMULATED = (("float32", 64), ("float64", 64), ("float16", 64), ("bfloat16", 64), ("float32", 256),
            ("float16", 128), ("float16", 256))


def compiler() -> str | None:
    return shutil.which("g++")


def _names():
    names = []
    for dtype_name, bound in EMULATED:
        for kind in sources.KINDS:
            name = sources.kernel_name(kind, dtype_name, bound)
            if name in sources.name_expressions() and name not in names:
                names.append(name)
    return names


def build(directory: Path) -> tuple[ctypes.CDLL, dict]:
    """Compile the emulation library into ``directory`` (reused while the sources are
    unchanged); returns it and a map from name expression to its launcher."""
    names = _names()
    launchers = {name: f"npattn_launch_{index}" for index, name in enumerate(names)}
    text = "\n".join([_HEADER.read_text(), sources.source()] + [
        f'extern "C" void {symbol}(int blocks, int threads, size_t shared, void** args) '
        f"{{ emulate_launch(&{name}, blocks, threads, shared, args); }}"
        for name, symbol in launchers.items()])
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    library = directory / f"npattn_emulated_{digest}.so"
    if not library.exists():
        source = directory / f"npattn_emulated_{digest}.cpp"
        source.write_text(text)
        subprocess.run([compiler(), "-std=c++20", "-O1", "-pthread", "-shared", "-fPIC", "-w",
                        "-o", str(library), str(source)], check=True)
    return ctypes.CDLL(str(library)), launchers


def _argument(value):
    if isinstance(value, np.ndarray):
        return ctypes.c_void_p(value.ctypes.data)
    return ctypes.c_longlong(int(value))


@contextlib.contextmanager
def emulated_gpu(monkeypatch, library, launchers):
    """``backend="gpu"`` on NumPy arrays, every launch run by ``library``."""
    import npattn.gpu

    def run(kind, storage, bound, blocks, shared_bytes, arguments):
        if blocks <= 0:
            return
        # a larger accumulator bound computes the same: use the smallest one built
        built = [name for name in (sources.kernel_name(kind, storage, b) for b in sorted(sources.HEAD_DIM_BOUNDS)
                                   if b >= bound) if name in launchers]
        if not built:
            raise AssertionError(f"no {kind} kernel for {storage} with bound >= {bound} is built; add it to EMULATED")
        name = built[0]
        values = [_argument(a) for a in arguments]
        pointers = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
        getattr(library, launchers[name])(int(blocks), sources.THREADS, ctypes.c_size_t(shared_bytes), pointers)

    with monkeypatch.context() as patch:
        patch.setattr(launch, "run", run)
        patch.setattr(npattn.gpu, "unavailable_reason", lambda array_kind="cupy": None)
        yield
