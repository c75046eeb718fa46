"""The host emulation of CUDA (tests/gpu_emulation.h) tested on its own small kernels:
test_gpu_emulated.py trusts it to run npattn's kernels as a GPU would, so its barriers,
shuffles, blocks and cp.async queue are held to what CUDA promises, and a kernel that
could never finish on a GPU (a barrier some threads skip) stops the process with a
message instead of hanging it.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import gpu_emulation

pytestmark = pytest.mark.skipif(gpu_emulation.compiler() is None, reason="needs g++ to build the emulation")

KERNELS = r'''
// out[block] = the sum of in[block * threads + t] over the block's threads, by a tree
// in shared memory: correct only if every __syncthreads() holds every thread
__global__ void block_sum(const float* in, float* out) {
    NPATTN_DYNAMIC_SHARED(bytes);
    float* partial = reinterpret_cast<float*>(bytes);
    const unsigned t = threadIdx.x, n = blockDim.x;
    partial[t] = in[blockIdx.x * n + t];
    __syncthreads();
    for (unsigned half = n / 2; half > 0; half /= 2) {
        if (t < half) partial[t] += partial[t + half];
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = partial[0];
}

// out[t] = the sum over each thread's warp, by a butterfly of shuffles
__global__ void warp_sum(const float* in, float* out) {
    float x = in[threadIdx.x];
    for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
    out[threadIdx.x] = x;
}

// each thread copies 16 bytes into shared memory with cp.async and reads them back
// before (out[0..]) and after (out[n..]) the wait that retires the copy
__global__ void copy_then_wait(const float* in, float* out) {
    NPATTN_DYNAMIC_SHARED(bytes);
    float* tile = reinterpret_cast<float*>(bytes);
    const unsigned t = threadIdx.x, n = blockDim.x;
    emulated_cp_async(tile + 4 * t, in + 4 * t, 16);
    emulated_cp_async_commit();
    out[t] = tile[4 * t];
    emulated_cp_async_wait(0);
    out[n + t] = tile[4 * t];
}

// thread 0 never reaches the barrier the others wait at: a deadlock on a GPU
__global__ void divergent_barrier(float* out) {
    if (threadIdx.x != 0) __syncthreads();
    out[threadIdx.x] = 1.0f;
}
'''
NAMES = ("block_sum", "warp_sum", "copy_then_wait", "divergent_barrier")


@pytest.fixture(scope="module")
def build_directory(request, tmp_path_factory):
    """Where these kernels are built: pytest's cache (kept between runs), or a directory of
    this run's where the cache is off (``-p no:cacheprovider``, as the suite's child runs use)."""
    cache = getattr(request.config, "cache", None)
    if cache is None:
        return tmp_path_factory.mktemp("npattn-gpu-emulation-tests")
    return cache.mkdir("npattn-gpu-emulation-tests")


@pytest.fixture(scope="module")
def library(build_directory):
    return gpu_emulation.build_source(build_directory, KERNELS, NAMES)


@pytest.mark.parametrize("threads, blocks", [(1, 1), (32, 3), (128, 5), (256, 2)])
def test_barriers_hold_every_thread_of_every_block(library, threads, blocks):
    values = np.random.default_rng(threads).integers(-8, 8, blocks * threads).astype(np.float32)
    out = np.full(blocks, np.nan, np.float32)
    gpu_emulation.run_kernel(*library, "block_sum", blocks, threads, 4 * threads, (values, out))
    np.testing.assert_array_equal(out, values.reshape(blocks, threads).sum(axis=1))


def test_shuffles_exchange_within_each_warp(library):
    values = np.arange(128, dtype=np.float32)
    out = np.full(128, np.nan, np.float32)
    gpu_emulation.run_kernel(*library, "warp_sum", 1, 128, 0, (values, out))
    np.testing.assert_array_equal(out, np.repeat(values.reshape(4, 32).sum(axis=1), 32))


def test_a_cp_async_copy_lands_only_at_its_wait(library):
    threads = 64
    values = np.arange(4 * threads, dtype=np.float32)
    out = np.zeros(2 * threads, np.float32)
    gpu_emulation.run_kernel(*library, "copy_then_wait", 1, threads, 16 * threads, (values, out))
    assert np.isnan(out[:threads]).all()  # shared memory starts as NaN bytes
    np.testing.assert_array_equal(out[threads:], values[::4])


def test_a_barrier_that_cannot_open_stops_the_process_with_a_message(library, build_directory, request):
    # in a child: the emulation aborts the process it runs in
    script = textwrap.dedent(f"""
        import sys, numpy as np
        sys.path.insert(0, {str(request.path.parent)!r})
        import gpu_emulation
        from test_gpu_emulation import KERNELS, NAMES
        library = gpu_emulation.build_source(__import__("pathlib").Path({str(build_directory)!r}), KERNELS, NAMES)
        gpu_emulation.run_kernel(*library, "divergent_barrier", 1, 64, 0, (np.zeros(64, np.float32),))
        print("returned")
    """)
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert child.returncode != 0 and "returned" not in child.stdout
    assert "waits at a barrier that cannot open" in child.stderr, child.stderr[-2000:]


def test_a_kernel_not_built_ahead_is_built_with_the_rest_at_its_first_launch(tmp_path):
    emulation = gpu_emulation.Emulation(tmp_path, KERNELS, NAMES, ahead=("block_sum",))
    assert len(list(tmp_path.glob("*.so"))) == 1
    values = np.arange(64, dtype=np.float32)
    out = np.full(64, np.nan, np.float32)
    emulation.run("warp_sum", 1, 64, 0, (values, out))
    np.testing.assert_array_equal(out, np.repeat(values.reshape(2, 32).sum(axis=1), 32))
    assert len(list(tmp_path.glob("*.so"))) == 2  # the three not built ahead, in one library
    sums = np.full(2, np.nan, np.float32)
    emulation.run("block_sum", 2, 32, 4 * 32, (values, sums))
    emulation.run("copy_then_wait", 1, 16, 16 * 16, (values, np.zeros(32, np.float32)))
    assert len(list(tmp_path.glob("*.so"))) == 2
    np.testing.assert_array_equal(sums, values.reshape(2, 32).sum(axis=1))
    assert emulation.launched == {"warp_sum", "block_sum", "copy_then_wait"}
    with pytest.raises(AssertionError, match="not on the emulation's menu"):
        emulation.run("grid_sum", 1, 32, 0, (values, out))


def test_the_kernels_built_ahead_are_on_the_menu():
    listed = [name for name in gpu_emulation.AHEAD_LIST.read_text().split("\n") if name]
    assert listed, "tests/data/emulated_ahead.txt lists nothing"
    stale = set(listed) - set(gpu_emulation._names())
    assert not stale, (f"{sorted(stale)} are no longer on the menu: write the list again "
                       f"({gpu_emulation.WRITE_AHEAD_VARIABLE}=1 python -m pytest tests/test_gpu_emulated.py)")
