"""Any array that speaks DLPack in, the caller's kind out, without torch or JAX: a minimal
array kind defined here (its own type, its own namespace with ``from_dlpack``) goes through
the same path as theirs (npattn/adapters/arrays.py)."""
import sys
import types

import numpy as np
import pytest

import npattn
from npattn.adapters import arrays as foreign

# The namespace of the array kind below, as a module would be: from_dlpack builds one.
minimal = types.ModuleType("minimal_arrays")


class MinimalArray:
    """An array kind npattn has never heard of: DLPack export and an array namespace only."""

    def __init__(self, data, device=1):
        self._data, self._device = data, device

    def __dlpack__(self, **kwargs):
        return self._data.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return (self._device, 0)

    def __array_namespace__(self, api_version=None):
        return minimal

    @property
    def dtype(self):
        return self._data.dtype


minimal.from_dlpack = lambda array: MinimalArray(np.from_dlpack(array))
minimal.__name__ = "minimal_arrays"


@pytest.fixture(autouse=True)
def registered_namespace(monkeypatch):
    monkeypatch.setitem(sys.modules, "minimal_arrays", minimal)


def arrays(shape=(1, 2, 5, 4), seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]


def test_outputs_and_gradients_come_back_in_the_callers_kind():
    q, k, v = arrays()
    wrapped = [MinimalArray(a) for a in (q, k, v)]
    mask = np.tril(np.ones((5, 5), bool))
    out, lse = npattn.attention(*wrapped, mask=MinimalArray(mask), return_lse=True)
    assert isinstance(out, MinimalArray) and isinstance(lse, MinimalArray)
    expected_out, expected_lse = npattn.attention(q, k, v, mask=mask, return_lse=True)
    np.testing.assert_array_equal(out._data, expected_out)
    np.testing.assert_array_equal(lse._data, expected_lse)
    out, vjp = npattn.attention_vjp(*wrapped, causal=True)
    expected_out, expected_vjp = npattn.attention_vjp(q, k, v, causal=True)
    dout = np.ones_like(expected_out)
    for grad, expected in zip(vjp(MinimalArray(dout)), expected_vjp(dout)):
        assert isinstance(grad, MinimalArray)
        np.testing.assert_array_equal(grad._data, expected)


def test_inputs_are_viewed_not_copied_and_not_modified():
    q, k, v = arrays()
    copies = [a.copy() for a in (q, k, v)]
    view = foreign.foreign_kind(MinimalArray(q)).native("q", MinimalArray(q))
    assert np.shares_memory(view, q)
    npattn.attention(*(MinimalArray(a) for a in (q, k, v)), causal=True)
    for array, copy in zip((q, k, v), copies):
        np.testing.assert_array_equal(array, copy)


def test_cuda_memory_without_cupy_names_what_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # as if CuPy were not installed
    q, k, v = arrays()
    with pytest.raises(TypeError, match=r"q is a minimal_arrays array in CUDA memory: running it needs CuPy"):
        npattn.attention(MinimalArray(q, device=2), k, v)


def test_memory_npattn_cannot_run_on_is_refused_by_name():
    q, k, v = arrays()
    with pytest.raises(TypeError, match=r"q is a minimal_arrays array on DLPack device type 14"):
        npattn.attention(MinimalArray(q, device=14), k, v)


def test_numpy_cupy_lists_and_objects_without_a_way_back_are_not_foreign():
    q, _, _ = arrays()

    class ExportOnly:  # DLPack, but no namespace to hand results back through
        def __dlpack__(self, **kwargs):
            return q.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return (1, 0)
    for value in (q, q.tolist(), 1.0, None, ExportOnly()):
        assert foreign.foreign_kind(value) is None
