"""Numba's on-disk cache of the CPU kernels (npattn/cpu/_cache.py): a save of one of the
package's entries holds the cache directory's lock, so that processes compiling
different specializations of one kernel at once (``python -m npattn compile``'s dtypes
side by side) cannot both pick one data file for them; and the package's cache locator
answers for the standard locator's attributes that Numba reads directly."""
import pytest

from npattn.cpu import _cache

fcntl = pytest.importorskip("fcntl")


def _lock_held(directory) -> bool:
    """Whether another open file description holds ``directory``'s lock now."""
    with open(directory / _cache._LOCK_NAME, "a") as other:
        try:
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(other, fcntl.LOCK_UN)
        return False


def test_a_save_of_the_packages_entry_holds_the_lock_and_no_other_does(tmp_path, monkeypatch):
    from numba.core import caching

    ours = caching.IndexDataCacheFile(str(tmp_path), f"kernel-1_{_cache._DIGEST[:_cache._DIGEST_CHARS]}.py311",
                                      "stamp")
    theirs = caching.IndexDataCacheFile(str(tmp_path), "elsewhere.kernel-1.py311", "stamp")
    held = []
    save_index = caching.IndexDataCacheFile._save_index

    def watched(self, overloads):
        held.append(_lock_held(tmp_path))
        save_index(self, overloads)
    monkeypatch.setattr(caching.IndexDataCacheFile, "_save_index", watched)
    ours.save(("(float32,)", "cpu"), b"float32 code")
    ours.save(("(float64,)", "cpu"), b"float64 code")
    theirs.save(("(float32,)", "cpu"), b"other code")
    assert held == [True, True, False]
    assert not _lock_held(tmp_path)  # (released after each save)
    # each key names its own data file, as Numba's save would
    assert ours.load(("(float32,)", "cpu")) == b"float32 code"
    assert ours.load(("(float64,)", "cpu")) == b"float64 code"


def test_a_kernel_numba_cannot_cache_gets_numbas_warning_not_an_attribute_error():
    """Numba warns, naming the locator's ``_py_file``, when a compile result cannot be cached
    (some kernels cannot under NUMBA_OPT=0); the package's locator must answer for it."""
    from types import SimpleNamespace

    from numba.core import caching
    from numba.core.errors import NumbaWarning

    from npattn.cpu import rowmath

    kernel = rowmath.row_max
    impl = caching.CompileResultCacheImpl(kernel.py_func)
    assert isinstance(impl._locator, _cache.PackageStampedLocator)
    assert impl._locator._py_file == kernel.py_func.__code__.co_filename
    uncachable = SimpleNamespace(lifted=(), library=SimpleNamespace(has_dynamic_globals=True),
                                 fndesc=SimpleNamespace(qualname=kernel.py_func.__qualname__))
    with pytest.warns(NumbaWarning, match="Cannot cache"):
        assert impl.check_cachable(uncachable) is False
