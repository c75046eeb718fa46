"""Compiled kernels kept on disk: one cubin per (instantiation, GPU architecture, source,
NVRTC build).

CuPy's ``RawModule`` caches compiled code on disk, but not when it is given
``name_expressions`` (it recompiles to learn the C++ mangled names), and every npattn
kernel is a template instantiation: without this cache every new process would wait
for NVRTC again. Here NVRTC (:mod:`npattn.gpu.nvrtc`, the ``nvidia-cuda-nvrtc-cu12``
wheel) compiles one instantiation, and the cubin is stored beside its mangled symbol;
the launcher loads the cubin with ``cupy.RawModule(path=...)``.

The directory is ``$NPATTN_CACHE_DIR``, else ``$CUPY_CACHE_DIR/npattn``, else
``~/.cupy/kernel_cache/npattn``. A key hashes everything the machine code depends on,
so a changed source or NVRTC never loads a stale cubin; files are written to a
temporary name and renamed, so concurrent processes never read half a file.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import tempfile
from pathlib import Path

from . import nvrtc


def directory() -> Path:
    """Where cubins are kept (created on first use)."""
    if os.environ.get("NPATTN_CACHE_DIR"):
        return Path(os.environ["NPATTN_CACHE_DIR"])
    cupy_cache = os.environ.get("CUPY_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cupy", "kernel_cache")
    return Path(cupy_cache) / "npattn"


@functools.lru_cache(maxsize=None)
def _nvrtc_build() -> str:
    """NVRTC's library path and version: part of every key."""
    library = nvrtc.nvrtc_library_path()
    if library is None:
        raise RuntimeError("no NVRTC library found: pip install nvidia-cuda-nvrtc-cu12")
    major, minor = ctypes.c_int(), ctypes.c_int()
    ctypes.CDLL(library).nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{library} {major.value}.{minor.value}"


def key(architecture: str, name: str) -> str:
    """The cache key of instantiation ``name`` compiled for ``architecture`` ("sm_90")."""
    from .sources import compile_options, source

    text = "\0".join([_nvrtc_build(), architecture, " ".join(compile_options(architecture)), name, source()])
    return hashlib.sha256(text.encode()).hexdigest()[:40]


def _write(path: Path, data: bytes) -> None:
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as file:
        file.write(data)
    os.replace(file.name, path)


def cubin(architecture: str, name: str) -> tuple[Path, str]:
    """``(path of the cubin, mangled symbol)`` of instantiation ``name`` for
    ``architecture``: read from the cache, or compiled by NVRTC and stored. Raises
    RuntimeError when no NVRTC library is found, :class:`~npattn.gpu.nvrtc.CompileError`
    when NVRTC rejects the source."""
    folder = directory()
    stem = key(architecture, name)
    cubin_path, symbol_path = folder / f"{stem}.cubin", folder / f"{stem}.symbol"
    if cubin_path.exists() and symbol_path.exists():  # the symbol is written last
        return cubin_path, symbol_path.read_text()
    machine_code, lowered = nvrtc.compile_cubin(architecture, [name])
    folder.mkdir(parents=True, exist_ok=True)
    _write(cubin_path, machine_code)
    _write(symbol_path, lowered[name].encode())
    return cubin_path, lowered[name]
