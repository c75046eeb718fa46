"""Keep Numba's on-disk cache of the CPU kernels honest across edits and upgrades.

Numba stamps a cached function with the hash of *its own* source file only, so a
kernel in ``forward_kernel.py`` would keep its stale machine code after a change to
``tiles.py``, which it calls. This module registers a cache locator that, for files
of this package, stamps with the hash of every module here and of the two outside it
that number the kernels' parameters (then defers to Numba's usual locations). Import
it before any ``@njit(cache=True)`` of the package.

Numba's save of a new entry is a read of the function's index, a free data file's name
picked from it, and the index written back: two processes compiling different
specializations of one kernel at once (``python -m npattn compile`` compiles its dtypes
side by side; services warm up in parallel) could both pick the same name, and the
index of one would then name the other's machine code. Saves of this package's entries
hold a lock on a file in the cache's directory (:func:`_locked_save`).

It also applies ``NPATTN_CPU_ISA`` (:mod:`.isa`) before that first ``@njit``. Numba
keys each cached entry by its target CPU's features, so AVX-512 and AVX2 machine
code live side by side in one cache.
"""
from __future__ import annotations

import glob
import hashlib
import os
import re

try:
    import fcntl
except ImportError:  # (not on Windows: saves are not locked there)
    fcntl = None

from numba.core import caching

from .isa import apply_forced_isa, apply_tile_permission

_HERE = os.path.dirname(os.path.abspath(__file__))


# Outside this package, the kernels read the parameter positions of core/kernel_params.py,
# which the options table (core/options.py) numbers: its file and the numbering itself (not
# the whole options.py, whose checks and docs change no machine code) go into the stamp.
_KERNEL_INPUTS = (os.path.join("core", "kernel_params.py"),)


def _package_digest() -> str:
    from ..core.kernel_params import OPERANDS, Int, Real, Span

    digest = hashlib.sha256()
    parent = os.path.dirname(_HERE)
    for path in [*sorted(glob.glob(os.path.join(_HERE, "*.py"))),
                 *(os.path.join(parent, name) for name in _KERNEL_INPUTS)]:
        with open(path, "rb") as source:
            digest.update(source.read())
    numbering = [[(member.name, int(member)) for member in positions] for positions in (Int, Real, Span)]
    digest.update(repr((numbering, OPERANDS)).encode())
    return digest.hexdigest()


_DIGEST = _package_digest()
_DIGEST_CHARS = 12
_ENTRY = re.compile(r"\.nb[ic]$")
_cleaned: set[str] = set()


def _remove_stale_entries(path: str) -> None:
    """Delete the cache files in ``path`` (a directory holding only this package's
    kernels) written by other versions of the package, once per process: they can never
    be read again. Best effort: a file another process removes first is no error."""
    if path in _cleaned:
        return
    _cleaned.add(path)
    ours = f"_{_DIGEST[:_DIGEST_CHARS]}.py"
    try:
        names = os.listdir(path)
    except OSError:
        return
    for name in names:
        if _ENTRY.search(name) and ours not in name:
            try:
                os.remove(os.path.join(path, name))
            except OSError:
                pass


class PackageStampedLocator(caching._CacheLocator):
    """Numba's first applicable standard locator, with the whole package's hash in its stamp."""

    _STANDARD = (caching.UserProvidedCacheLocator, caching.InTreeCacheLocator,
                 caching.UserWideCacheLocator)

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        # Numba reads some of its locator's attributes directly: ``_py_file``, for one,
        # names the file in its warning that a function cannot be cached (which some
        # kernels are not under NUMBA_OPT=0). Those are the wrapped locator's.
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    def ensure_cache_path(self):
        self._inner.ensure_cache_path()
        _remove_stale_entries(self._inner.get_cache_path())

    def get_cache_path(self):
        return self._inner.get_cache_path()

    def get_source_stamp(self):
        return (self._inner.get_source_stamp(), _DIGEST)

    def get_disambiguator(self):
        # The digest in the file names, not only in the stamp: Numba unpickles an index
        # before it compares stamps, and an index written before a module of npattn was
        # moved or renamed names types that no longer import (a ModuleNotFoundError
        # instead of a cache miss).
        return f"{self._inner.get_disambiguator()}_{_DIGEST[:_DIGEST_CHARS]}"

    @classmethod
    def from_function(cls, py_func, py_file):
        if os.path.dirname(os.path.abspath(py_file)) != _HERE:
            return None
        for standard in cls._STANDARD:
            inner = standard.from_function(py_func, py_file)
            if inner is not None:
                return cls(inner)
        return None


_LOCK_NAME = "npattn-cache.lock"


def _locked_save(save):
    """``IndexDataCacheFile.save`` holding an exclusive lock (``flock``) on
    :data:`_LOCK_NAME` in the entry's directory, for this package's entries (their file
    names carry the digest); others' as Numba saves them. Best effort where there is no
    ``fcntl`` (Windows) or the lock file cannot be made: Numba's save as it is."""
    ours = f"_{_DIGEST[:_DIGEST_CHARS]}.py"

    def save_locked(self, key, data):
        index_path = getattr(self, "_index_path", "")
        if fcntl is None or ours not in os.path.basename(index_path):
            return save(self, key, data)
        try:
            lock = open(os.path.join(os.path.dirname(index_path), _LOCK_NAME), "a")
        except OSError:
            return save(self, key, data)
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # (released when the file closes)
            return save(self, key, data)
    save_locked.npattn_locked = True
    return save_locked


_FILE_CLASS = getattr(caching, "IndexDataCacheFile", None)
if _FILE_CLASS is not None and not getattr(_FILE_CLASS.save, "npattn_locked", False):
    _FILE_CLASS.save = _locked_save(_FILE_CLASS.save)

_LOCATORS = getattr(getattr(caching, "CacheImpl", None), "_locator_classes", None)
if isinstance(_LOCATORS, list) and PackageStampedLocator not in _LOCATORS:
    _LOCATORS.insert(0, PackageStampedLocator)


# Numba fixes its target CPU at its first compilation: a forced ISA, and AMX's tiles
# where Linux refuses them, must come before it.
apply_forced_isa()
apply_tile_permission()
