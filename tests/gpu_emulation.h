// A host build of npattn's CUDA kernels, for tests on machines with no GPU.
//
// Every CUDA thread of a block runs as a fiber (its own stack and registers, switched in
// user space) on the launching OS thread; __syncthreads() is a barrier of the block's
// fibers, __shfl_xor_sync and __shfl_sync an exchange through a per-warp buffer between two barriers of
// the warp's 32 fibers, and mma.sync m16n8k16 a product computed from the whole warp's
// fragments as the PTX ISA lays them out; ldmatrix gathers the warp's row addresses the
// same way. A fiber runs until it waits at a barrier, then the next one runs, in thread
// order: a launch is deterministic, and a barrier costs two context switches in user
// space instead of a futex wake of every OS thread (the emulation ran 3-5x slower with
// one OS thread per CUDA thread, most of it in the kernel's scheduler). A barrier that
// can never complete (warp divergence around a shuffle) aborts with a message instead
// of hanging. cp.async copies are queued per thread and carried out
// only when cp.async.wait_group retires their group, so a tile read before its wait
// (or before the barrier after it) reads stale or NaN bytes, as it could on a GPU. Blocks run one after another
// (first to last, or last to first after npattn_emulation_reverse_blocks(1))
// on the same fibers. Dynamic shared memory starts filled with NaN bytes, so a read
// before a write shows up in the results. What this cannot show: races the hardware's
// memory model would expose, the hardware's own rounding inside mma, performance.
//
// tests/gpu_emulation.py prepends this to npattn.gpu.sources.source() and adds one
// extern "C" launcher per instantiation.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sys/mman.h>
#include <ucontext.h>
#include <tuple>
#include <utility>
#include <vector>

#define NPATTN_HOST_EMULATION 1
#define __global__
#define __device__
#define __launch_bounds__(...)
#define __noinline__ __attribute__((noinline))
#define __forceinline__ inline
#define __grid_constant__
#define __align__(bytes) alignas(bytes)

struct uint3 { unsigned x, y, z; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };

// A barrier of `expected` fibers: the last to arrive opens it (a new generation); the
// others yield to the next fiber until it has opened.
struct EmulatedBarrier {
    explicit EmulatedBarrier(int expected) : expected(expected) {}
    void arrive_and_wait();
    int expected, arrived = 0;
    unsigned long generation = 0;
};

struct EmulatedBlock {
    explicit EmulatedBlock(int threads, size_t shared_bytes)
        : barrier(threads), shared(shared_bytes + 16, 0xFF) {
        for (int w = 0; w < (threads + 31) / 32; ++w) warps.push_back(std::make_unique<EmulatedBarrier>(32));
    }
    EmulatedBarrier barrier;
    std::vector<std::unique_ptr<EmulatedBarrier>> warps;
    std::vector<unsigned char> shared;
    double exchange[32][32];
    unsigned mma_a[32][32][4], mma_b[32][32][2];  // [warp][lane][register]
    const unsigned short* rows[32][32];           // ldmatrix row addresses, [warp][lane]
};

// One thread's cp.async copies: committed groups, oldest first, and the open group.
struct EmulatedCopy { void* destination; const void* source; int bytes, size; };
struct EmulatedCopies {
    std::vector<std::vector<EmulatedCopy>> committed;
    std::vector<EmulatedCopy> open;
};

// A suspended fiber's registers. On x86-64, its stack pointer, with the callee-saved
// registers pushed on its stack: a switch is a few pushes and pops, where swapcontext
// also saves the signal mask with a system call (a quarter of the emulation's time).
// Elsewhere, a ucontext.
#if defined(__x86_64__)
struct EmulatedContext { void* stack_pointer = nullptr; };
extern "C" void npattn_emulated_switch(void** save, void* load);
asm(R"(
    .text
    .p2align 4
    .hidden npattn_emulated_switch
    .globl npattn_emulated_switch
    .type npattn_emulated_switch, @function
npattn_emulated_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size npattn_emulated_switch, .-npattn_emulated_switch
)");
// Save the running context into `from`, resume `to`.
inline void emulated_switch(EmulatedContext& from, EmulatedContext& to) {
    npattn_emulated_switch(&from.stack_pointer, to.stack_pointer);
}
// A context that starts `entry` (which never returns) on `stack`: the first switch to it
// pops zeroed registers and returns into `entry` with the stack aligned as after a call.
inline void emulated_start(EmulatedContext& context, char* stack, size_t bytes, void (*entry)()) {
    void** top = reinterpret_cast<void**>(stack + bytes);
    *--top = nullptr;                                 // entry's own return address: none
    *--top = reinterpret_cast<void*>(entry);
    for (int r = 0; r < 6; ++r) *--top = nullptr;     // rbp, rbx, r12-r15
    context.stack_pointer = top;
}
#else
struct EmulatedContext { ucontext_t context; };
inline void emulated_switch(EmulatedContext& from, EmulatedContext& to) { swapcontext(&from.context, &to.context); }
inline void emulated_start(EmulatedContext& context, char* stack, size_t bytes, void (*entry)()) {
    getcontext(&context.context);
    context.context.uc_stack.ss_sp = stack;
    context.context.uc_stack.ss_size = bytes;
    context.context.uc_link = nullptr;
    makecontext(&context.context, entry, 0);
}
#endif

// The running fiber's view, set by the launch's scheduler before it switches to a fiber
// (thread_local: launches on different OS threads run side by side).
struct EmulatedFiber;
thread_local uint3 threadIdx, blockIdx, blockDim;
thread_local EmulatedBlock* emulated_block;
thread_local EmulatedFiber* emulated_fiber;
thread_local EmulatedCopies* emulated_copies_of_fiber;
#define emulated_copies (*emulated_copies_of_fiber)

// One CUDA thread: its context, its stack and its cp.async queue.
struct EmulatedFiber {
    EmulatedContext context;
    EmulatedCopies copies;
    int thread = 0;
    unsigned block = 0;
    bool finished = false;
};

// The launch's scheduler: its own context, the fiber running, and a count of events
// (arrivals, openings, finished fibers) by which it tells a wait from a deadlock.
thread_local EmulatedContext* emulated_scheduler;
thread_local unsigned long emulated_progress;

// Back to the scheduler, which resumes the next fiber in thread order.
inline void emulated_yield() { emulated_switch(emulated_fiber->context, *emulated_scheduler); }

inline void EmulatedBarrier::arrive_and_wait() {
    ++emulated_progress;
    if (++arrived == expected) {
        arrived = 0;
        ++generation;
        return;
    }
    const unsigned long waiting_for = generation;
    while (generation == waiting_for) emulated_yield();
}

#define NPATTN_DYNAMIC_SHARED(name) unsigned char* name = emulated_block->shared.data()

inline void __syncthreads() { emulated_block->barrier.arrive_and_wait(); }
// Blocks run one after another, and only one thread of a block at a time: a fence orders
// nothing more, and an atomic is a plain read and write.
inline void __threadfence() {}
inline unsigned atomicAdd(unsigned* address, unsigned value) {
    const unsigned old = *address;
    *address = old + value;
    return old;
}
inline void __syncwarp() { emulated_block->warps[threadIdx.x / 32]->arrive_and_wait(); }

template <typename V> V __shfl_xor_sync(unsigned, V value, int offset) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    emulated_block->exchange[warp][lane] = (double)value;  // exact for float and double
    emulated_block->warps[warp]->arrive_and_wait();
    const V other = (V)emulated_block->exchange[warp][lane ^ offset];
    emulated_block->warps[warp]->arrive_and_wait();
    return other;
}

template <typename V> V __shfl_sync(unsigned, V value, int from) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    emulated_block->exchange[warp][lane] = (double)value;  // exact for 32-bit values, float and double
    emulated_block->warps[warp]->arrive_and_wait();
    const V other = (V)emulated_block->exchange[warp][from % 32];
    emulated_block->warps[warp]->arrive_and_wait();
    return other;
}

inline float __int_as_float(int bits) { float x; std::memcpy(&x, &bits, 4); return x; }
inline float __uint_as_float(unsigned bits) { float x; std::memcpy(&x, &bits, 4); return x; }
inline unsigned __float_as_uint(float x) { unsigned bits; std::memcpy(&bits, &x, 4); return bits; }
inline double __longlong_as_double(unsigned long long bits) { double x; std::memcpy(&x, &bits, 8); return x; }
// products rounded on their own (the build adds -ffp-contract=off, so nothing fuses them)
inline float __fmul_rn(float a, float b) { return a * b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline float half_to_float(unsigned short bits) { _Float16 h; std::memcpy(&h, &bits, 2); return (float)h; }
inline float bits_to_float(unsigned short bits, bool bf16) {
    if (bf16) return __uint_as_float(((unsigned)bits) << 16);
    return half_to_float(bits);
}

// cvt.rn.f16x2.f32 / cvt.rn.bf16x2.f32: round to nearest even, `low` in the low half
inline unsigned emulated_pack_pair(float low, float high, bool bf16) {
    auto convert = [bf16](float x) -> unsigned {
        if (bf16) {
            unsigned bits;
            std::memcpy(&bits, &x, 4);
            if (std::isnan(x)) return 0x7FC0u;
            return (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
        }
        const _Float16 h = (_Float16)x;
        unsigned short bits;
        std::memcpy(&bits, &h, 2);
        return bits;
    };
    return convert(low) | (convert(high) << 16);
}

// cvt.rn.f16.f32 / cvt.rn.bf16.f32, back to float: x rounded to the 16-bit type
inline unsigned short half_bits_of(float x) { return (unsigned short)emulated_pack_pair(x, 0.0f, false); }
inline unsigned short bf16_bits_of(float x) { return (unsigned short)emulated_pack_pair(x, 0.0f, true); }
inline float round_to_half(float x) { return bits_to_float((unsigned short)emulated_pack_pair(x, 0.0f, false), false); }
inline float round_to_bf16(float x) { return bits_to_float((unsigned short)emulated_pack_pair(x, 0.0f, true), true); }

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: every lane deposits its fragments,
// then computes its own four elements of D from the whole warp's, following the PTX
// ISA's fragment layouts (groupID = lane / 4, threadID_in_group = lane % 4).
inline void emulated_mma_16816(float* c, const unsigned* a, const unsigned* b, bool bf16) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    EmulatedBlock& block = *emulated_block;
    for (int x = 0; x < 4; ++x) block.mma_a[warp][lane][x] = a[x];
    for (int x = 0; x < 2; ++x) block.mma_b[warp][lane][x] = b[x];
    block.warps[warp]->arrive_and_wait();
    auto element_a = [&](int row, int k) {  // a_i: rows g / g + 8, columns 2t + (0, 1) (+ 8)
        const unsigned word = block.mma_a[warp][(row % 8) * 4 + (k % 8) / 2][(row >= 8) + 2 * (k >= 8)];
        return bits_to_float((unsigned short)(k % 2 ? word >> 16 : word & 0xFFFFu), bf16);
    };
    auto element_b = [&](int k, int column) {  // b_i: rows 2t + (0, 1) (+ 8), column g
        const unsigned word = block.mma_b[warp][column * 4 + (k % 8) / 2][k >= 8];
        return bits_to_float((unsigned short)(k % 2 ? word >> 16 : word & 0xFFFFu), bf16);
    };
    float d[4];
    for (int e = 0; e < 4; ++e) {  // c_i: rows g (i < 2) / g + 8, columns 2t + (i & 1)
        const int row = lane / 4 + 8 * (e >= 2), column = 2 * (lane % 4) + (e & 1);
        double total = c[e];
        for (int k = 0; k < 16; ++k) total += (double)element_a(row, k) * element_b(k, column);
        d[e] = (float)total;
    }
    block.warps[warp]->arrive_and_wait();  // every lane has read the deposits
    for (int e = 0; e < 4; ++e) c[e] = d[e];
}

// ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16: lanes 8m .. 8m + 7 give the
// row addresses of matrix m; register m of lane l gets matrix m's row l / 4, columns
// 2 (l % 4) and + 1 (transposed: column l / 4 of rows 2 (l % 4) and + 1), low half first.
inline void emulated_ldmatrix(unsigned* registers, int count, bool transpose, const unsigned short* row) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    EmulatedBlock& block = *emulated_block;
    block.rows[warp][lane] = row;
    block.warps[warp]->arrive_and_wait();
    for (int m = 0; m < count; ++m) {
        const unsigned short* const* matrix = block.rows[warp] + 8 * m;
        unsigned short low, high;
        if (transpose) {
            low = matrix[2 * (lane % 4)][lane / 4];
            high = matrix[2 * (lane % 4) + 1][lane / 4];
        } else {
            low = matrix[lane / 4][2 * (lane % 4)];
            high = matrix[lane / 4][2 * (lane % 4) + 1];
        }
        registers[m] = (unsigned)low | ((unsigned)high << 16);
    }
    block.warps[warp]->arrive_and_wait();  // every lane has read the addresses
}

// movmatrix.sync.aligned.m8n8.trans.b16: lane l holds row l / 4, columns 2 (l % 4) and + 1
// of an 8x8 matrix (low half first), and gets the same elements of its transpose.
inline unsigned emulated_transpose_8x8(unsigned word) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    EmulatedBlock& block = *emulated_block;
    block.exchange[warp][lane] = (double)word;  // exact
    block.warps[warp]->arrive_and_wait();
    auto element = [&](int row, int column) {  // of the matrix as the lanes hold it
        const unsigned held = (unsigned)block.exchange[warp][row * 4 + column / 2];
        return column % 2 ? held >> 16 : held & 0xFFFFu;
    };
    const int row = lane / 4, column = 2 * (lane % 4);
    const unsigned result = element(column, row) | (element(column + 1, row) << 16);
    block.warps[warp]->arrive_and_wait();  // every lane has read the deposits
    return result;
}

// cp.async.{cg,ca}.shared.global [destination], [source], size, bytes: queued until retired.
inline void emulated_cp_async(void* destination, const void* source, int bytes, int size = 16) {
    emulated_copies.open.push_back({destination, source, bytes, size});
}

inline void emulated_cp_async_commit() {
    emulated_copies.committed.push_back(std::move(emulated_copies.open));
    emulated_copies.open.clear();
}

// cp.async.wait_group pending: carry out every committed group but the newest `pending`.
inline void emulated_cp_async_wait(int pending) {
    auto& groups = emulated_copies.committed;
    const size_t retire = groups.size() > (size_t)pending ? groups.size() - pending : 0;
    for (size_t g = 0; g < retire; ++g) {
        for (const EmulatedCopy& copy : groups[g]) {
            unsigned char* destination = static_cast<unsigned char*>(copy.destination);
            std::memcpy(destination, copy.source, copy.bytes);
            std::memset(destination + copy.bytes, 0, copy.size - copy.bytes);
        }
    }
    groups.erase(groups.begin(), groups.begin() + retire);
}

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

// A fiber's stack: its own mapping, touched only as deep as the kernel goes.
constexpr size_t EMULATED_STACK_BYTES = 1 << 20;

template <typename... P>
struct EmulatedLaunch {
    void (*kernel)(P...);
    std::tuple<P...> values;
    int blocks, threads;
    EmulatedBlock* state;
    std::vector<EmulatedFiber>* fibers;
};

template <typename... P>
thread_local EmulatedLaunch<P...>* emulated_launch;

// Whether launches run their blocks last to first (npattn_emulation_reverse_blocks): a
// kernel whose blocks depend on their order (the last of a split work item to finish
// merges it) is then run with another block last.
inline bool emulated_reversed_blocks = false;
extern "C" void npattn_emulation_reverse_blocks(int reversed) { emulated_reversed_blocks = reversed != 0; }

// A fiber's body: every block in turn on CUDA thread `emulated_fiber->thread`.
template <typename... P>
void emulated_fiber_body() {
    EmulatedLaunch<P...>& launch = *emulated_launch<P...>;
    EmulatedFiber& fiber = *emulated_fiber;
    EmulatedBlock& state = *launch.state;
    for (int index = 0; index < launch.blocks; ++index) {
        const int block = emulated_reversed_blocks ? launch.blocks - 1 - index : index;
        fiber.block = (unsigned)block;
        blockIdx = {(unsigned)block, 0, 0};
        std::apply(launch.kernel, launch.values);
        if (!fiber.copies.open.empty() || !fiber.copies.committed.empty()) {
            std::fprintf(stderr, "npattn emulation: a kernel returned with cp.async copies never waited for\n");
            std::abort();
        }
        state.barrier.arrive_and_wait();  // the whole block is done
        if (fiber.thread == 0) std::fill(state.shared.begin(), state.shared.end(), (unsigned char)0xFF);
        state.barrier.arrive_and_wait();  // fresh NaN-filled shared memory for the next block
    }
    fiber.finished = true;
    ++emulated_progress;
    emulated_yield();  // for good: the scheduler never resumes a finished fiber
    std::abort();
}

template <typename... P>
void emulate_launch(void (*kernel)(P...), int blocks, int threads, size_t shared_bytes, void** args) {
    EmulatedBlock state(threads, shared_bytes);
    std::vector<EmulatedFiber> fibers(threads);
    EmulatedLaunch<P...> launch{kernel, unpack_arguments<P...>(args, std::index_sequence_for<P...>{}), blocks,
                                threads, &state, &fibers};
    EmulatedContext scheduler;
    const size_t stacks_bytes = EMULATED_STACK_BYTES * threads;
    void* stacks = mmap(nullptr, stacks_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                        -1, 0);
    if (stacks == MAP_FAILED) {
        std::fprintf(stderr, "npattn emulation: no memory for %d fiber stacks\n", threads);
        std::abort();
    }
    emulated_launch<P...> = &launch;
    emulated_scheduler = &scheduler;
    emulated_block = &state;
    blockDim = {(unsigned)threads, 1, 1};
    for (int t = 0; t < threads; ++t) {
        EmulatedFiber& fiber = fibers[t];
        fiber.thread = t;
        emulated_start(fiber.context, static_cast<char*>(stacks) + EMULATED_STACK_BYTES * t, EMULATED_STACK_BYTES,
                       emulated_fiber_body<P...>);
    }
    // Round after round, resume each unfinished fiber in thread order; a round in which
    // nothing arrived, opened or finished means every fiber waits on a barrier that cannot open.
    for (int alive = threads; alive > 0;) {
        const unsigned long before = emulated_progress;
        alive = 0;
        for (EmulatedFiber& fiber : fibers) {
            if (fiber.finished) continue;
            emulated_fiber = &fiber;
            emulated_copies_of_fiber = &fiber.copies;
            threadIdx = {(unsigned)fiber.thread, 0, 0};
            blockIdx = {fiber.block, 0, 0};
            emulated_switch(scheduler, fiber.context);
            alive += !fiber.finished;
        }
        if (alive > 0 && emulated_progress == before) {
            std::fprintf(stderr, "npattn emulation: every thread of the block waits at a barrier that cannot open "
                                 "(a barrier or shuffle some threads of a block or warp never reach)\n");
            std::abort();
        }
    }
    munmap(stacks, stacks_bytes);
}
