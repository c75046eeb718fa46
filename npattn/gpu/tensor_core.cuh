// The tensor-core building blocks of the float16/bfloat16 kernels (sm_80 and newer):
// mma.sync m16n8k16 with float32 accumulation, ldmatrix fragment loads, cp.async
// global -> shared copies, the XOR swizzle of shared tiles, and exp2.
//
// Shared tiles of 16-bit values hold rows of `ld` elements (a multiple of 64: eight
// 16-byte chunks), and chunk c of row r sits at chunk position c ^ (r & 7). The eight
// row addresses of one ldmatrix 8x8 matrix (same chunk, eight consecutive rows) then
// fall in eight different 16-byte bank groups, so neither ldmatrix nor the 16-byte
// cp.async stores conflict, without padding.
//
// The host emulation of the tests (tests/gpu_emulation.h) supplies emulated_* versions
// of every PTX instruction here, following the PTX ISA's definitions.
#pragma once
#include "common.cuh"

// the online softmax runs in base 2: log2(e) folded into the scale, ln(2) back at the end
#define NPATTN_LOG2E 1.4426950408889634f
#define NPATTN_LN2 0.6931471805599453f

template <typename T> struct TensorCore;
template <> struct TensorCore<half_bits> { static constexpr bool bf16 = false; };
template <> struct TensorCore<bf16_bits> { static constexpr bool bf16 = true; };

// d += a b for one m16n8k16 tile (fragment layouts of the PTX ISA, "Matrix Fragments
// for mma.m16n8k16 with floating point type").
template <typename T> __device__ inline void mma_16816(float* c, const u32* a, const u32* b) {
#ifdef NPATTN_HOST_EMULATION
    emulated_mma_16816(c, a, b, TensorCore<T>::bf16);
#else
    if constexpr (TensorCore<T>::bf16) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                     "{%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                     "{%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
#endif
}

// Two floats as one register of two 16-bit values, `low` in the low half (round to nearest).
template <typename T> __device__ inline u32 pack_pair(float low, float high) {
#ifdef NPATTN_HOST_EMULATION
    return emulated_pack_pair(low, high, TensorCore<T>::bf16);
#else
    u32 packed;
    if constexpr (TensorCore<T>::bf16) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(high), "f"(low));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(high), "f"(low));
    }
    return packed;
#endif
}

// 2^x on the special-function unit (ex2.approx: about 2 ulp; -inf gives +0).
__device__ inline float exp2_approx(float x) {
#ifdef NPATTN_HOST_EMULATION
    return std::exp2(x);
#else
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#endif
}

// Byte i of the result is byte (selector >> 4 i) & 7 of the eight bytes of x (0-3) and y
// (4-7): PTX's prmt.b32 in its default mode.
__device__ inline u32 byte_permute(u32 x, u32 y, u32 selector) {
#ifdef NPATTN_HOST_EMULATION
    const unsigned long long bytes = ((unsigned long long)y << 32) | x;
    u32 result = 0;
    for (int i = 0; i < 4; ++i) result |= (u32)((bytes >> (8 * ((selector >> (4 * i)) & 7))) & 0xff) << (8 * i);
    return result;
#else
    u32 result;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(result) : "r"(x), "r"(y), "r"(selector));
    return result;
#endif
}

// The values of the four codes of `word` (the first in its low byte), exactly, as
// code_value gives them, in integer and float instructions (no conversion instruction,
// which sm_90 runs at an eighth of the float rate, and no branch): an int8 code b,
// flipped to b + 128 and put under a float's exponent of 2^23, is 2^23 + 128 + b, less
// 2^23 + 128; an e4m3 code's sign and its 7 other bits, moved to a float's sign and bits
// 26-20, are a float of 2^-120 times its value (subnormal codes to subnormal floats),
// times 2^120; S.1111.111 is NaN. (H200, decode steps replayed in CUDA graphs, against
// code_value: int8 1.05-1.07x faster, e4m3 2.1-2.3x; TUNING.md.)
template <bool E4M3> __device__ inline void four_code_values(u32 word, float* values) {
    if constexpr (E4M3) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 code = (word >> (8 * i)) & 0xffu;
            const float value = __uint_as_float(((code & 0x80u) << 24) | ((code & 0x7fu) << 20)) * 0x1p120f;
            values[i] = (code & 0x7fu) == 0x7fu ? __int_as_float(0x7fc00000) : value;
        }
    } else {
        const u32 flipped = word ^ 0x80808080u;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            values[i] = __uint_as_float(byte_permute(flipped, 0x4b000000u, 0x7650u + i)) - 8388736.0f;
        }
    }
}

// ---- codes straight into mma fragments ---------------------------------------------------
// A decode step over a contiguous quantized cache reads its codes into the registers of
// the mma B fragments (forward_tc.cu, REGISTER_CODES) and converts them there, unscaled:
// an int8 code or an e4m3 code is exact in float16 and bfloat16, and the scales, one per
// key, are applied in float32 outside the products.

// 1024 + u - 1152 in each float16 half of `biased` (1024 + u: u in the low mantissa byte
// under 0x64): the int8 code u - 128, exactly (sub.f16x2).
__device__ inline u32 int8_half_pair(u32 biased) {
#ifdef NPATTN_HOST_EMULATION
    return emulated_pack_pair(half_to_float((unsigned short)(biased & 0xffffu)) - 1152.0f,
                              half_to_float((unsigned short)(biased >> 16)) - 1152.0f, false);
#else
    u32 result;
    asm("sub.f16x2 %0, %1, %2;" : "=r"(result) : "r"(biased), "r"(0x64806480u));
    return result;
#endif
}

// The four codes of `word` as two pairs of T (pairs[0]: bytes 0 and 1, byte 0 in the low
// half; pairs[1]: bytes 2 and 3), exactly, unscaled. int8 into float16: each code flipped
// to u = code + 128 under float16's exponent of 1024 (0x64), less 1152: a logic operation,
// two byte permutes and two half2 subtractions for four codes; else through float32
// (four_code_values) and a rounding that changes nothing.
template <typename T, bool E4M3> __device__ inline void code_pairs(u32 word, u32* pairs) {
#if defined(NPATTN_HARDWARE_E4M3) && !defined(NPATTN_HOST_EMULATION)
    // e4m3 pairs into float16 by sm_89's conversion, each 16-bit half's low byte into the
    // low half: defined for sm_89 and newer by sources.architecture_defines (the source
    // itself tests no architecture, test_gpu.py), which says what it measured on an H200
    if constexpr (E4M3 && !TensorCore<T>::bf16) {
        asm("{ .reg .b16 low, high; mov.b32 {low, high}, %2; cvt.rn.f16x2.e4m3x2 %0, low; "
            "cvt.rn.f16x2.e4m3x2 %1, high; }"
            : "=r"(pairs[0]), "=r"(pairs[1]) : "r"(word));
        return;
    }
#endif
    if constexpr (!E4M3 && !TensorCore<T>::bf16) {
        const u32 flipped = word ^ 0x80808080u;
        pairs[0] = int8_half_pair(byte_permute(flipped, 0x64646464u, 0x4140u));
        pairs[1] = int8_half_pair(byte_permute(flipped, 0x64646464u, 0x4342u));
    } else {
        float values[4];
        four_code_values<E4M3>(word, values);
        pairs[0] = pack_pair<T>(values[0], values[1]);
        pairs[1] = pack_pair<T>(values[2], values[3]);
    }
}

// Lane l holds row l / 4, columns 2 (l % 4) and + 1 (low half first) of an 8x8 matrix
// of 16-bit values (an mma accumulator's layout, packed by pack_pair); returns the same
// elements of its transpose: column l / 4, rows 2 (l % 4) and + 1 (movmatrix, sm_75 and
// newer). The whole warp calls it.
__device__ inline u32 transpose_8x8(u32 word) {
#ifdef NPATTN_HOST_EMULATION
    return emulated_transpose_8x8(word);
#else
    u32 result;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(result) : "r"(word));
    return result;
#endif
}

// The codes-in-registers tiles' R (forward_tc.cu, decode_tc.cu), the largest value scale
// seen, grown to a tile's: the largest of this lane's value scales of the tile (`scales`,
// two keys per block), reduced over the lanes that hold the tile's other keys (XOR offsets
// FIRST, 2 FIRST, ... below LAST; a NaN scale is skipped here and makes its own P entry
// NaN). Sets `ratio` to the old R over the new one (O, kept in units of R, shrinks by it)
// and returns 1 / R (0 while R is 0), by which each key's P entry is scaled with its value
// scale.
template <int FIRST, int LAST, int BLOCKS>
__device__ inline float grow_value_reference(const float (&scales)[BLOCKS][2], float& reference, float& ratio) {
    float largest = 0.0f;
#pragma unroll
    for (int n = 0; n < BLOCKS; ++n) {
        largest = scales[n][0] > largest ? scales[n][0] : largest;
        largest = scales[n][1] > largest ? scales[n][1] : largest;
    }
#pragma unroll
    for (int offset = FIRST; offset < LAST; offset <<= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, largest, offset);
        largest = other > largest ? other : largest;
    }
    const float grown = largest > reference ? largest : reference;
    ratio = grown > 0.0f ? reference / grown : 1.0f;
    reference = grown;
    return grown > 0.0f ? 1.0f / grown : 0.0f;
}

// ---- shared-memory addresses ------------------------------------------------------------

// Element offset of (row, column) in a swizzled tile of row length `ld` (a multiple of
// 64); `column` is a multiple of 8 (one 16-byte chunk) or any column inside one.
__device__ inline int swizzled(int row, int column, int ld) {
    return row * ld + ((((column >> 3) ^ row) & 7) | ((column >> 3) & ~7)) * 8 + (column & 7);
}

#ifndef NPATTN_HOST_EMULATION
__device__ inline u32 shared_address(const void* pointer) {
    u32 address;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(address) : "l"(pointer));
    return address;
}
#endif

// ---- ldmatrix ---------------------------------------------------------------------------

// Four 8x8 matrices of 16-bit values: lanes 8m .. 8m + 7 give the addresses of matrix
// m's rows (16 bytes each); register m of lane l holds matrix m's row l / 4, columns
// 2 (l % 4) and 2 (l % 4) + 1 (TRANSPOSE: column l / 4, rows 2 (l % 4) and + 1).
template <bool TRANSPOSE> __device__ inline void ldmatrix_x4(u32* r, const unsigned short* row) {
#ifdef NPATTN_HOST_EMULATION
    emulated_ldmatrix(r, 4, TRANSPOSE, row);
#else
    if constexpr (TRANSPOSE) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(row)));
    } else {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(row)));
    }
#endif
}

// The A fragment of rows [row0, row0 + 16) x columns [k0, k0 + 16) of a swizzled tile.
__device__ inline void load_a_fragment(u32* a, const unsigned short* tile, int ld, int row0, int k0, int lane) {
    ldmatrix_x4<false>(a, tile + swizzled(row0 + (lane & 15), k0 + (lane >> 4) * 8, ld));
}

// B fragments of two 8-column blocks [n0, n0 + 8) and [n0 + 8, n0 + 16) over depth
// [k0, k0 + 16), from a swizzled tile whose rows are B's columns (the depth contiguous,
// as K is for S = Q K^T): b[0..1] for the first block, b[2..3] for the second.
__device__ inline void load_b_fragments(u32* b, const unsigned short* tile, int ld, int n0, int k0, int lane) {
    ldmatrix_x4<false>(b, tile + swizzled(n0 + (lane >> 4) * 8 + (lane & 7), k0 + ((lane >> 3) & 1) * 8, ld));
}

// The same two B fragments from a swizzled tile whose rows are the depth (B's columns
// contiguous, as V is for O = P V): ldmatrix's transpose.
__device__ inline void load_b_fragments_transposed(u32* b, const unsigned short* tile, int ld, int n0, int k0,
                                                   int lane) {
    ldmatrix_x4<true>(b, tile + swizzled(k0 + ((lane >> 3) & 1) * 8 + (lane & 7), n0 + (lane >> 4) * 8, ld));
}

// ---- cp.async ----------------------------------------------------------------------------

// Copy 16 bytes from global `source` to shared `destination`, of which the first
// `bytes` (0..16) are read and the rest zero-filled; completes at cp_async_wait.
__device__ inline void cp_async_16(unsigned short* destination, const void* source, int bytes) {
#ifdef NPATTN_HOST_EMULATION
    emulated_cp_async(destination, source, bytes);
#else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(shared_address(destination)), "l"(source), "r"(bytes) : "memory");
#endif
}

// Copy 4 bytes from global `source` to shared `destination` (both on 4 bytes), of which
// the first `bytes` (0 or 4) are read and the rest zero-filled; completes at cp_async_wait.
__device__ inline void cp_async_4(void* destination, const void* source, int bytes) {
#ifdef NPATTN_HOST_EMULATION
    emulated_cp_async(destination, source, bytes, 4);
#else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;"
                 :: "r"(shared_address(destination)), "l"(source), "r"(bytes) : "memory");
#endif
}

// Close the group of copies issued since the last commit.
__device__ inline void cp_async_commit() {
#ifdef NPATTN_HOST_EMULATION
    emulated_cp_async_commit();
#else
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// Wait until at most `PENDING` of this thread's committed groups are still in flight
// (groups complete in order). Other threads' copies need a __syncthreads() after it.
template <int PENDING> __device__ inline void cp_async_wait() {
#ifdef NPATTN_HOST_EMULATION
    emulated_cp_async_wait(PENDING);
#else
    asm volatile("cp.async.wait_group %0;" :: "n"(PENDING) : "memory");
#endif
}

// ---- staging tiles ----------------------------------------------------------------------

// rows x width 16-bit values into the swizzled tile (tile_rows x chunks 16-byte chunks
// of row length ld), zeros past `rows` and `width`: row r starts at x + row_offset(r).
// ASYNC: by cp.async (needs each row 16-byte aligned; the caller commits and waits);
// else by plain loads, for unaligned rows or widths.
template <bool ASYNC, typename T, typename RowOffset>
__device__ inline void stage_tile(unsigned short* tile, int ld, const T* x, RowOffset row_offset, int rows,
                                  int width, int tile_rows, int chunks) {
    for (int index = threadIdx.x; index < tile_rows * chunks; index += blockDim.x) {
        const int r = index / chunks, c = index % chunks;
        const int valid = r < rows ? (int)smaller(8, larger(0, width - 8 * c)) : 0;
        unsigned short* destination = tile + swizzled(r, 8 * c, ld);
        if constexpr (ASYNC) {
            cp_async_16(destination, valid > 0 ? (const void*)(x + row_offset(r) + 8 * c) : (const void*)x,
                        2 * valid);
        } else {
            const T* source = valid > 0 ? x + row_offset(r) + 8 * c : x;
            for (int e = 0; e < 8; ++e) destination[e] = e < valid ? source[e].bits : (unsigned short)0;
        }
    }
}

// A quantized cache's K or V tile (OPTIONS has CODES) staged in two steps, as cp.async
// stages a 16-bit one. fetch() copies this thread's 16-code chunks of the tile into a
// tile of bytes in shared memory (`staged`: TILE_ROWS rows of ld + CODE_ROW_PAD bytes,
// `ld` the 16-bit tile's row length), by
// cp.async where every row starts on 16 bytes (ASYNC_COPY), else by plain loads, and
// loads their rows' scales into registers. deposit(), once those copies landed
// (cp_async_wait), dequantizes the same chunks into the swizzled 16-bit tile: each code
// times its row's scale, rounded once from float32 to T (codes are converted, so they
// cannot go to that tile by cp.async). A thread reads back only what it copied itself,
// so no barrier sits between the two, and a tile's loads are in flight together and
// under whatever the kernel does between them, where staging a chunk at a time waited
// one memory latency per chunk. Thread t takes PER_THREAD consecutive chunks (t *
// PER_THREAD onwards: part of one row, or whole rows), so it keeps one scale per row it
// touches; staged rows are padded by CODE_ROW_PAD bytes, so that the eight rows a quarter
// warp reads at once fall in different banks. Columns past `width` and
// rows past `rows` deposit zeros.
constexpr int CODE_ROW_PAD = 16;
template <int THREADS, int TILE_ROWS, int MAX_D> struct CodeTile {
    static constexpr int CHUNKS = MAX_D / 16, TOTAL = TILE_ROWS * CHUNKS;
    static constexpr int PER_THREAD = TOTAL > THREADS ? TOTAL / THREADS : 1;
    static constexpr int SCALES = PER_THREAD > CHUNKS ? PER_THREAD / CHUNKS : 1;
    static_assert(MAX_D % 16 == 0 && (TOTAL < THREADS || TOTAL % THREADS == 0) &&
                      (PER_THREAD % CHUNKS == 0 || CHUNKS % PER_THREAD == 0),
                  "whole 16-code chunks, shared evenly, each thread's in whole rows or in one row");
    float scale[SCALES];  // 0 for rows past `rows`

    // Rows [j0, j0 + rows) of kv head h of entry b of k's codes (`values`: v's); PAGED:
    // each row looked up in its page, else one stride from entry b's first row.
    template <bool PAGED, bool ASYNC_COPY, typename T, typename Acc>
    __device__ inline void fetch(unsigned char* staged, int ld, const Operands<T, Acc>& in, bool values, i64 b, i64 h,
                                 i64 j0, int rows, int width) {
        const int first = threadIdx.x * PER_THREAD;
        if (first >= TOTAL) return;
        const int staged_ld = ld + CODE_ROW_PAD;
        const i64* ints = in.ints;
        const unsigned char* codes = values ? in.v_codes : in.k_codes;
        const float* scales = values ? in.v_scale : in.k_scale;
        const int strides = values ? NPATTN_INT_V_STRIDE_B : NPATTN_INT_K_STRIDE_B;
        const int scale_strides = values ? NPATTN_INT_V_SCALE_STRIDE_B : NPATTN_INT_K_SCALE_STRIDE_B;
        const i64 sb = ints[strides], sh = ints[strides + 1], ss = ints[strides + 2];
        const i64 scale_sb = ints[scale_strides], scale_sh = ints[scale_strides + 1],
                  scale_ss = ints[scale_strides + 2];
        // (the same for the whole block)
        const unsigned long long starts =
            reinterpret_cast<unsigned long long>(codes) | (unsigned long long)(sb | sh | ss);
        const bool aligned = ASYNC_COPY && (starts & 15) == 0;
        const unsigned char* row_codes = codes;
#pragma unroll
        for (int k = 0; k < PER_THREAD; ++k) {
            const int r = (first + k) / CHUNKS, c = (first + k) % CHUNKS;
            if (k % CHUNKS == 0) {  // a row's first chunk of this thread's: its row and scale
                const i64 j = j0 + r;
                scale[k / CHUNKS] = 0.0f;
                if (r < rows) {
                    row_codes = codes + (PAGED ? key_row(ints, in.pages, b, h, j, sb, sh, ss)
                                               : b * sb + h * sh + j * ss);
                    scale[k / CHUNKS] = scales[PAGED ? key_row(ints, in.pages, b, h, j, scale_sb, scale_sh, scale_ss)
                                                     : b * scale_sb + h * scale_sh + j * scale_ss];
                }
            }
            const int valid = r < rows ? (int)smaller(16, larger(0, width - 16 * c)) : 0;
            const unsigned char* source = valid > 0 ? row_codes + 16 * c : codes;
            unsigned char* destination = staged + r * staged_ld + 16 * c;
            if (aligned) {
                cp_async_16(reinterpret_cast<unsigned short*>(destination), source, valid);
            } else {
#pragma unroll 1
                for (int e = 0; e < 16; ++e) destination[e] = e < valid ? source[e] : (unsigned char)0;
            }
        }
    }

    template <typename T>
    __device__ inline void deposit(const unsigned char* staged, unsigned short* tile, int ld, int width,
                                   bool e4m3) const {
        if (e4m3) {
            deposit_codes<T, true>(staged, tile, ld, width);
        } else {
            deposit_codes<T, false>(staged, tile, ld, width);
        }
    }

    template <typename T, bool E4M3>
    __device__ inline void deposit_codes(const unsigned char* staged, unsigned short* tile, int ld, int width) const {
        const int first = threadIdx.x * PER_THREAD;
        if (first >= TOTAL) return;
        const int staged_ld = ld + CODE_ROW_PAD;
        constexpr int ROW_CHUNKS = PER_THREAD / SCALES;  // this thread's chunks of each row it touches
#pragma unroll
        for (int row = 0; row < SCALES; ++row) {
            const float row_scale = scale[row];
            // (two chunks at a time, not all: the decode tile's eight unrolled took every
            // register the kernel had)
#pragma unroll 2
            for (int k = row * ROW_CHUNKS; k < (row + 1) * ROW_CHUNKS; ++k) {
                const int r = (first + k) / CHUNKS, c = (first + k) % CHUNKS;
                const uint4 codes = *reinterpret_cast<const uint4*>(staged + r * staged_ld + 16 * c);
                const u32 words[4] = {codes.x, codes.y, codes.z, codes.w};
                // every column of the chunk inside the width: none to test (a code past it is
                // 0, but 0 times a scale of inf would be NaN)
                const bool whole = 16 * c + 16 <= width;
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    u32 pairs[4];
#pragma unroll
                    for (int w = 0; w < 2; ++w) {
                        float values[4];
                        four_code_values<E4M3>(words[2 * half + w], values);
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            values[e] *= row_scale;
                            if (!whole) values[e] = 16 * c + 8 * half + 4 * w + e < width ? values[e] : 0.0f;
                        }
                        pairs[2 * w] = pack_pair<T>(values[0], values[1]);
                        pairs[2 * w + 1] = pack_pair<T>(values[2], values[3]);
                    }
                    uint4 chunk;
                    chunk.x = pairs[0];
                    chunk.y = pairs[1];
                    chunk.z = pairs[2];
                    chunk.w = pairs[3];
                    *reinterpret_cast<uint4*>(tile + swizzled(r, 16 * c + 8 * half, ld)) = chunk;
                }
            }
        }
    }
};

// Whether the decode forward's one-warp tiles stage whole-width K and V rows with
// stage_strided_rows (forward_tc.cu). NPATTN_GENERIC_STAGING (through
// NPATTN_GPU_DEFINES, npattn.gpu.sources.compile_options) turns it off, to time the two
// in one GPU call: `.ci/gpu-variants NPATTN_GENERIC_STAGING`. Untimed so far.
#ifdef NPATTN_GENERIC_STAGING
constexpr bool STRIDED_STAGING = false;
#else
constexpr bool STRIDED_STAGING = true;
#endif

// stage_tile for the commonest K and V tile: rows `row_stride` apart from `first`, every
// chunk of each row copied by cp.async (aligned, full-width rows), `rows` of TILE_ROWS
// live (the rest zero-filled). Thread t copies chunk c = t % CHUNKS of rows r0 = t / CHUNKS,
// r0 + P, r0 + 2P, ... (P = THREADS / CHUNKS, a power of two, so r0 + kP = r0 | kP and
// the swizzle's (c ^ r) & 7 is (c ^ r0) & 7 ^ kP & 7: one logic operation per copy). Its
// source pointer steps by a constant and every bound is known at compile time, so a
// 16-byte copy costs a few instructions where stage_tile spends about 60 on its division,
// bounds and offsets (a one-warp decode tile of 32 x 128 values is 16 copies per lane
// for K and 16 for V). THREADS % CHUNKS == 0.
template <int THREADS, int TILE_ROWS, int CHUNKS, typename T>
__device__ inline void stage_strided_rows(unsigned short* tile, int ld, const T* first, i64 row_stride, int rows) {
    constexpr int P = THREADS / CHUNKS;
    static_assert(THREADS % CHUNKS == 0 && (P & (P - 1)) == 0 && TILE_ROWS % P == 0, "whole passes over the tile");
    const int c = threadIdx.x % CHUNKS, r0 = threadIdx.x / CHUNKS;
    const int low = (c ^ r0) & 7, high = c & ~7;
    unsigned short* destination = tile + r0 * ld;
    const T* source = first + r0 * row_stride + 8 * c;
    const i64 step = P * row_stride;
    if (rows == TILE_ROWS) {  // a whole tile: no row is past the keys
#pragma unroll
        for (int k = 0; k < TILE_ROWS / P; ++k) {
            cp_async_16(destination + k * P * ld + (((low ^ (k * P)) & 7) | high) * 8, source + k * step, 16);
        }
    } else {
#pragma unroll
        for (int k = 0; k < TILE_ROWS / P; ++k) {
            const bool live = r0 + k * P < rows;
            cp_async_16(destination + k * P * ld + (((low ^ (k * P)) & 7) | high) * 8,
                        live ? (const void*)(source + k * step) : (const void*)first, live ? 16 : 0);
        }
    }
}

// ---- codes staged for registers ------------------------------------------------------

// A decode step's codes, for the tiles that read them into registers (forward_tc.cu's
// REGISTER_CODES, decode_tc.cu): where kv head h of entry b's K and V code rows and scales
// lie. Contiguous, key j's rows are j strides from the entry's first; PAGED, slot j %
// PAGE_SIZE of page pages[b, j / PAGE_SIZE] (key_row's lookup, once per key).
template <bool PAGED> struct HeadCodes {
    const unsigned char *k, *v;
    const float *k_scale, *v_scale;
    i64 k_slot, v_slot, k_scale_slot, v_scale_slot;  // a key's (slot's) strides
    const i64* ints;     // PAGED: the pages' strides and size, read where a tile's copies are
                         // issued rather than kept in registers through the key loop
    const i64* page_of;  // PAGED: entry b's row of the page table
    template <typename T, typename Acc> __device__ HeadCodes(const Operands<T, Acc>& in, i64 b, i64 h) : ints(in.ints) {
        k_slot = ints[NPATTN_INT_K_STRIDE_S];
        v_slot = ints[NPATTN_INT_V_STRIDE_S];
        k_scale_slot = ints[NPATTN_INT_K_SCALE_STRIDE_S];
        v_scale_slot = ints[NPATTN_INT_V_SCALE_STRIDE_S];
        const i64 entry = PAGED ? 0 : b;  // (paged, the page's stride takes the B axis's place)
        k = in.k_codes + entry * ints[NPATTN_INT_K_STRIDE_B] + h * ints[NPATTN_INT_K_STRIDE_H];
        v = in.v_codes + entry * ints[NPATTN_INT_V_STRIDE_B] + h * ints[NPATTN_INT_V_STRIDE_H];
        k_scale = in.k_scale + entry * ints[NPATTN_INT_K_SCALE_STRIDE_B] + h * ints[NPATTN_INT_K_SCALE_STRIDE_H];
        v_scale = in.v_scale + entry * ints[NPATTN_INT_V_SCALE_STRIDE_B] + h * ints[NPATTN_INT_V_SCALE_STRIDE_H];
        page_of = in.pages + b * ints[NPATTN_INT_PAGES];
    }
    // key j's page and slot (contiguous: no page, slot j)
    __device__ void place(i64 j, i64& page, i64& slot) const {
        if constexpr (PAGED) {
            const i64 page_size = ints[NPATTN_INT_PAGE_SIZE], block = j / page_size;
            page = page_of[block];
            slot = j - block * page_size;
        } else {
            page = 0;
            slot = j;
        }
    }
    // the offset of (page, slot) in the array whose B (a page's) stride is ints[STRIDE_B]
    // and whose S stride is `slot_stride`
    template <int STRIDE_B> __device__ i64 offset(i64 page, i64 slot, i64 slot_stride) const {
        return (PAGED ? page * ints[STRIDE_B] : 0) + slot * slot_stride;
    }
};

// Two shared stages of a key tile's codes (BK keys at head dims up to MAX_D), from
// `base`: stage s holds BK rows of K codes, BK rows of V codes (rows CODE_ROW_PAD bytes
// longer than MAX_D, so the eight rows a quarter warp reads at once fall in different
// banks), then the BK K scales and the BK V scales. Tile t takes stage t % 2: its copies
// run under tile t - 1's work.
template <int BK, int MAX_D> struct CodeStages {
    static constexpr int LD = MAX_D + CODE_ROW_PAD, BYTES = 2 * BK * LD + 2 * BK * 4;
    unsigned char* base;
    __device__ unsigned char* stage(i64 t) const { return base + (int)(t & 1) * BYTES; }
    __device__ static const unsigned char* k_row(const unsigned char* stage, int key) { return stage + key * LD; }
    __device__ static const unsigned char* v_row(const unsigned char* stage, int key) { return stage + (BK + key) * LD; }
    __device__ static float k_scale(const unsigned char* stage, int key) {
        return reinterpret_cast<const float*>(stage + 2 * BK * LD)[key];
    }
    __device__ static float v_scale(const unsigned char* stage, int key) {
        return reinterpret_cast<const float*>(stage + 2 * BK * LD)[BK + key];
    }

    // Copy keys [j0, j0 + keys) of `codes` into stage t by cp.async (the caller commits);
    // rows past `keys` get zeros. The code rows are copied coalesced: 16-byte chunk c of a
    // row by lane c % CHUNKS of a run of CHUNKS lanes, so one warp-wide copy covers
    // 32 / CHUNKS whole rows (4 at 128-wide heads), each one line read in full sectors.
    // (Lane r copying all of row r made each copy touch 32 lines 1 KB apart, half of each
    // sector it read: on an H200 the int8 step's warps stalled on the load/store queue,
    // lg_throttle and mio, for a quarter of the forward's samples, Nsight Compute.)
    // PAGED, each lane finds the rows of keys lane, lane + 32, ... (their pages) and the
    // rows' runs of lanes take them by shuffles. The scales, 4 bytes a key, stay lane-per-key.
    template <bool PAGED>
    __device__ void fetch(const HeadCodes<PAGED>& codes, i64 t, i64 j0, int keys, int lane) const {
        static_assert(MAX_D % 16 == 0 && 32 % (MAX_D / 16) == 0 && BK % (32 / (MAX_D / 16)) == 0,
                      "whole rows a copy, whole copies a tile");
        constexpr int CHUNKS = MAX_D / 16, ROWS = 32 / CHUNKS;  // a row's 16-byte chunks; rows a copy
        unsigned char* destination = stage(t);
        float* scales = reinterpret_cast<float*>(destination + 2 * BK * LD);
        constexpr int MINE = (BK + 31) / 32;  // keys lane, lane + 32, ... of the tile
        i64 k_offset[MINE], v_offset[MINE];
#pragma unroll
        for (int u = 0; u < MINE; ++u) {
            const int r = lane + 32 * u;
            const bool live = r < keys;
            i64 page = 0, slot = 0;
            if (live) codes.place(j0 + r, page, slot);
            k_offset[u] = codes.template offset<NPATTN_INT_K_STRIDE_B>(page, slot, codes.k_slot);
            v_offset[u] = codes.template offset<NPATTN_INT_V_STRIDE_B>(page, slot, codes.v_slot);
            if (r < BK) {
                cp_async_4(scales + r, codes.k_scale + codes.template offset<NPATTN_INT_K_SCALE_STRIDE_B>(page, slot, codes.k_scale_slot),
                           live ? 4 : 0);
                cp_async_4(scales + BK + r, codes.v_scale + codes.template offset<NPATTN_INT_V_SCALE_STRIDE_B>(page, slot, codes.v_scale_slot),
                           live ? 4 : 0);
            }
        }
        const int chunk = lane % CHUNKS;
#pragma unroll
        for (int r0 = 0; r0 < BK; r0 += ROWS) {
            const int r = r0 + lane / CHUNKS;  // this lane's row of the copy; key r's lane is r % 32
            const int u = r0 / 32;              // (the same for the copy's every row: ROWS divides 32)
            i64 k_at, v_at;
            if constexpr (PAGED) {
                k_at = shuffle_i64(k_offset[u], r % 32);
                v_at = shuffle_i64(v_offset[u], r % 32);
            } else {  // key j0 + r's rows, without shuffles (a row past `keys` copies no byte
                      // but names key j0's, an address inside the cache, as a paged one does)
                const i64 key = j0 + (r < keys ? r : keys - 1);
                k_at = key * codes.k_slot;
                v_at = key * codes.v_slot;
            }
            const int size = r < keys ? 16 : 0;
            cp_async_16(reinterpret_cast<unsigned short*>(destination + r * LD + 16 * chunk), codes.k + k_at + 16 * chunk, size);
            cp_async_16(reinterpret_cast<unsigned short*>(destination + (BK + r) * LD + 16 * chunk), codes.v + v_at + 16 * chunk,
                        size);
        }
    }
};
