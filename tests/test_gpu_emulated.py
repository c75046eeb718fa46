"""The CUDA kernels, built for the host (tests/gpu_emulation.h) and run through the GPU
backend's own driver, against the float64 reference: every option, dtype and layout,
forward and backward. This is how the kernels' logic is tested on machines with no
GPU (CI's); test_gpu.py holds them to the same properties on a real device.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn
from strategies import cases
from test_backend_equivalence import check_backward, check_forward

import gpu_emulation

pytestmark = pytest.mark.skipif(gpu_emulation.compiler() is None, reason="needs g++ to build the emulation")
layouts = st.sampled_from(["bhsd", "bshd"])
# each emulated launch runs one OS thread per CUDA thread: fewer examples than elsewhere
EXAMPLES = settings()  # the profile's count (100 in CI)


@pytest.fixture(scope="module", autouse=True)
def emulated_gpu(request):
    library, launchers = gpu_emulation.build(request.config.cache.mkdir("npattn-gpu-emulation"))
    patch = pytest.MonkeyPatch()
    with gpu_emulation.emulated_gpu(patch, library, launchers):
        yield
    patch.undo()


@EXAMPLES
@given(case=cases(dtypes=("float16", "float32", "float64")), layout=layouts)
def test_emulated_gpu_forward_matches_the_reference(case, layout):
    check_forward("gpu", case, layout)


@EXAMPLES
@given(case=cases(dtypes=("float16", "float32", "float64")), layout=layouts)
def test_emulated_gpu_backward_matches_the_reference(case, layout):
    check_backward("gpu", case, layout)


def test_emulated_gpu_wide_heads_and_many_tiles():
    """Head dims past 64 (the 256 accumulator), several query and key tiles, GQA."""
    rng = np.random.default_rng(0)
    q = rng.uniform(-1, 1, (1, 4, 40, 200)).astype(np.float32)
    k = rng.uniform(-1, 1, (1, 2, 70, 200)).astype(np.float32)
    v = rng.uniform(-1, 1, (1, 2, 70, 72)).astype(np.float32)
    options = dict(causal=True, window=(30, None), sinks=3, dropout_p=0.25, seed=11, softcap=4.0)
    out, vjp = npattn.attention_vjp(q, k, v, backend="gpu", **options)
    exact, exact_vjp = npattn.attention_vjp(*(x.astype(np.float64) for x in (q, k, v)), backend="reference",
                                            **options)
    dout = rng.normal(size=out.shape).astype(np.float32)
    np.testing.assert_allclose(out, exact, atol=1e-5)
    for grad, expected in zip(vjp(dout), exact_vjp(dout.astype(np.float64))):
        np.testing.assert_allclose(grad, expected, atol=1e-4)


def test_emulated_gpu_backward_is_deterministic():
    rng = np.random.default_rng(1)
    q, k, v = (rng.normal(size=(2, 2, 33, 16)).astype(np.float32) for _ in range(3))
    bias = rng.normal(size=(2, 1, 33, 33))
    runs = []
    for _ in range(2):
        _, vjp = npattn.attention_vjp(q, k, v, bias=bias, causal=True, dropout_p=0.1, seed=2, backend="gpu")
        runs.append(vjp(np.ones_like(q)))
    for first, again in zip(*runs):
        np.testing.assert_array_equal(first, again)
