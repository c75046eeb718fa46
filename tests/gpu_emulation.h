// A host build of npattn's CUDA kernels, for tests on machines with no GPU.
//
// Every CUDA thread of a block runs as an OS thread; __syncthreads() is a barrier of
// the block's threads and __shfl_xor_sync an exchange through a per-warp buffer between
// two barriers of the warp's 32 threads. Blocks run one after another. Dynamic shared
// memory starts filled with NaN bytes, so a read before a write shows up in the
// results. What this cannot show: races the hardware's memory model would expose,
// warp divergence around a shuffle (a deadlock here), performance.
//
// tests/gpu_emulation.py prepends this to npattn.gpu.sources.source() and adds one
// extern "C" launcher per instantiation.
#pragma once
#include <barrier>
#include <cmath>
#include <cstring>
#include <memory>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#define NPATTN_HOST_EMULATION 1
#define __global__
#define __device__
#define __launch_bounds__(threads)
#define __align__(bytes) alignas(bytes)

struct uint3 { unsigned x, y, z; };

struct EmulatedBlock {
    explicit EmulatedBlock(int threads, size_t shared_bytes)
        : barrier(threads), shared(shared_bytes + 16, 0xFF) {
        for (int w = 0; w < (threads + 31) / 32; ++w) warps.push_back(std::make_unique<std::barrier<>>(32));
    }
    std::barrier<> barrier;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    std::vector<unsigned char> shared;
    double exchange[32][32];
};

thread_local uint3 threadIdx, blockIdx, blockDim;
thread_local EmulatedBlock* emulated_block;

#define NPATTN_DYNAMIC_SHARED(name) unsigned char* name = emulated_block->shared.data()

inline void __syncthreads() { emulated_block->barrier.arrive_and_wait(); }

template <typename V> V __shfl_xor_sync(unsigned, V value, int offset) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    emulated_block->exchange[warp][lane] = (double)value;  // exact for float and double
    emulated_block->warps[warp]->arrive_and_wait();
    const V other = (V)emulated_block->exchange[warp][lane ^ offset];
    emulated_block->warps[warp]->arrive_and_wait();
    return other;
}

inline float __int_as_float(int bits) { float x; std::memcpy(&x, &bits, 4); return x; }
inline float __uint_as_float(unsigned bits) { float x; std::memcpy(&x, &bits, 4); return x; }
inline double __longlong_as_double(unsigned long long bits) { double x; std::memcpy(&x, &bits, 8); return x; }
inline float half_to_float(unsigned short bits) { _Float16 h; std::memcpy(&h, &bits, 2); return (float)h; }
using std::exp; using std::log; using std::tanh;
inline float expf(float x) { return std::exp(x); }
inline float logf(float x) { return std::log(x); }
inline float tanhf(float x) { return std::tanh(x); }

// Run `kernel` on `blocks` blocks of `threads` threads; args[i] points to the value of
// parameter i (cudaLaunchKernel's convention).
template <typename... P, size_t... I>
std::tuple<P...> unpack_arguments(void** args, std::index_sequence<I...>) {
    return std::tuple<P...>(*static_cast<P*>(args[I])...);
}

template <typename... P>
void emulate_launch(void (*kernel)(P...), int blocks, int threads, size_t shared_bytes, void** args) {
    const std::tuple<P...> values = unpack_arguments<P...>(args, std::index_sequence_for<P...>{});
    for (int block = 0; block < blocks; ++block) {
        EmulatedBlock state(threads, shared_bytes);
        std::vector<std::thread> pool;
        for (int t = 0; t < threads; ++t) {
            pool.emplace_back([&, t] {
                threadIdx = {(unsigned)t, 0, 0};
                blockIdx = {(unsigned)block, 0, 0};
                blockDim = {(unsigned)threads, 1, 1};
                emulated_block = &state;
                std::apply(kernel, values);
            });
        }
        for (auto& thread : pool) thread.join();
    }
}
