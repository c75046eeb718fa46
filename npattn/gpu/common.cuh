// Pieces every npattn CUDA kernel shares: element loads for each storage
// type, which keys a query row may see, the dropout hash, and one tile of fully
// optioned scores. They mirror npattn/cpu/tiles.py (and so npattn/reference.py)
// step for step; the int64 and real parameter arrays are indexed by the NPATTN_INT_*
// and NPATTN_REAL_* positions that npattn/gpu/sources.py prepends from
// npattn/core/kernel_params.py.
//
// No CUDA headers are included: NVRTC compiles this with nothing but its built-in
// definitions, so half and bfloat16 are handled as their 16-bit patterns through
// PTX conversions (sm_80 and newer).
#pragma once

typedef long long i64;
typedef unsigned int u32;

// 16-bit storage types: the bits of an IEEE half / a bfloat16.
struct half_bits { unsigned short bits; };
struct bf16_bits { unsigned short bits; };

// Storage<T>::load<Acc>(p, i): element i of p in the compute dtype (outputs are
// written in the compute dtype; the caller casts them).
template <typename T> struct Storage;

// Storage<T>::round(x): a float32/float64 x rounded to T and back (what storing it in T keeps);
// Storage<T>::store(p, i, x): x into element i of p (16-bit types: rounded from float32).
template <> struct Storage<float> {
    template <typename Acc> __device__ static Acc load(const float* p, i64 i) { return (Acc)p[i]; }
    template <typename Acc> __device__ static Acc round(Acc x) { return (Acc)(float)x; }
    __device__ static void store(float* p, i64 i, double x) { p[i] = (float)x; }
};

template <> struct Storage<double> {
    template <typename Acc> __device__ static Acc load(const double* p, i64 i) { return (Acc)p[i]; }
    template <typename Acc> __device__ static Acc round(Acc x) { return x; }
    __device__ static void store(double* p, i64 i, double x) { p[i] = x; }
};

// half -> float through PTX. A host build of these sources (the
// emulation the tests run without a GPU, tests/gpu_emulation.h) defines its own.
#ifndef NPATTN_HOST_EMULATION
__device__ inline float half_to_float(unsigned short bits) {
    float x;
    asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(bits));
    return x;
}
__device__ inline unsigned short half_bits_of(float x) {
    unsigned short bits;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(x));
    return bits;
}
__device__ inline unsigned short bf16_bits_of(float x) {
    unsigned short bits;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(x));
    return bits;
}
__device__ inline float round_to_half(float x) { return half_to_float(half_bits_of(x)); }
__device__ inline float round_to_bf16(float x) { return __uint_as_float(((u32)bf16_bits_of(x)) << 16); }
#define NPATTN_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
#endif

template <> struct Storage<half_bits> {
    template <typename Acc> __device__ static Acc load(const half_bits* p, i64 i) {
        return (Acc)half_to_float(p[i].bits);
    }
    template <typename Acc> __device__ static Acc round(Acc x) { return (Acc)round_to_half((float)x); }
    __device__ static void store(half_bits* p, i64 i, double x) { p[i].bits = half_bits_of((float)x); }
};

template <> struct Storage<bf16_bits> {
    template <typename Acc> __device__ static Acc load(const bf16_bits* p, i64 i) {
        return (Acc)__uint_as_float(((u32)p[i].bits) << 16);
    }
    template <typename Acc> __device__ static Acc round(Acc x) { return (Acc)round_to_bf16((float)x); }
    __device__ static void store(bf16_bits* p, i64 i, double x) { p[i].bits = bf16_bits_of((float)x); }
};

template <typename Acc> __device__ inline Acc negative_infinity();
template <> __device__ inline float negative_infinity<float>() { return __int_as_float(0xff800000); }
template <> __device__ inline double negative_infinity<double>() {
    return __longlong_as_double(0xfff0000000000000ULL);
}

__device__ inline float exp_of(float x) { return expf(x); }
__device__ inline double exp_of(double x) { return exp(x); }
__device__ inline float log_of(float x) { return logf(x); }
__device__ inline double log_of(double x) { return log(x); }
__device__ inline float tanh_of(float x) { return tanhf(x); }
__device__ inline double tanh_of(double x) { return tanh(x); }

__device__ inline i64 smaller(i64 a, i64 b) { return a < b ? a : b; }
__device__ inline i64 larger(i64 a, i64 b) { return a > b ? a : b; }

// ---- which keys a row sees (npattn.core.masks.Visibility; tiles.key_band) ------------------

struct KeyBand { i64 lo, hi, sink_start, sink_end; };

// Entry `column` (NPATTN_SPAN_*) of batch entry b in the spans operand
// (npattn.core.kernel_params.Span: live rows and keys, row 0's position).
__device__ inline i64 span(const i64* spans, i64 b, int column) { return spans[b * NPATTN_SPAN_FIELDS + column]; }

// Row i of batch b sees keys in [lo, hi) and in [sink_start, sink_end) (causal, window,
// sinks, the live keys of spans); a row before Q_START sees none. Each bound is
// nondecreasing in i, so a tile of rows is bounded by its first and last row.
__device__ inline KeyBand key_band(const i64* ints, const i64* spans, i64 b, i64 i) {
    const i64 kv_first = span(spans, b, NPATTN_SPAN_KV_START), kv_valid = span(spans, b, NPATTN_SPAN_KV_STOP);
    const i64 kv_len = ints[NPATTN_INT_KV_LEN];
    const i64 left = ints[NPATTN_INT_WINDOW_LEFT], right = ints[NPATTN_INT_WINDOW_RIGHT];
    const i64 position = i + span(spans, b, NPATTN_SPAN_SHIFT);
    KeyBand band;
    // (clipped to the keys: a row may sit past the last key)
    band.lo = left < 0 ? kv_first : smaller(kv_len, larger(kv_first, position - left));
    band.hi = right < 0 ? kv_len : smaller(kv_len, position + right + 1);
    if (ints[NPATTN_INT_CAUSAL]) band.hi = smaller(band.hi, position + 1);
    band.hi = larger(band.lo, smaller(band.hi, kv_valid));
    band.sink_start = kv_first;
    band.sink_end = kv_first;
    if (left >= 0 || right >= 0) {
        band.sink_end = smaller(kv_first + ints[NPATTN_INT_SINKS], kv_valid);
        if (ints[NPATTN_INT_CAUSAL]) band.sink_end = smaller(band.sink_end, position + 1);
        band.sink_end = larger(kv_first, band.sink_end);
    }
    if (i < span(spans, b, NPATTN_SPAN_Q_START)) band.hi = band.lo;  // left padding sees no key
    return band;
}

__device__ inline bool key_visible(const KeyBand& band, i64 j) {
    return (band.sink_start <= j && j < band.sink_end) || (band.lo <= j && j < band.hi);
}

// The keys rows [i0, i1) may see, as two disjoint segments [sink_start, sink_end) and
// [start, stop).
struct KeySegments { i64 sink_start, sink_end, start, stop; };

__device__ inline KeySegments key_segments(const i64* ints, const i64* spans, i64 b, i64 i0, i64 i1) {
    const KeyBand first = key_band(ints, spans, b, i0);
    const KeyBand last = key_band(ints, spans, b, i1 - 1);
    KeySegments segments;
    segments.sink_start = last.sink_start;
    segments.sink_end = last.sink_end;
    segments.start = larger(first.lo, last.sink_end);
    segments.stop = larger(segments.start, last.hi);
    return segments;
}

// The keys a tile of rows [i0, i1) visits, as two ranges [first[x], last[x]): the
// visible segments of key_segments, cut to split `split` of `splits` (whole tiles of
// block_k keys, as even a share as can be; splits == 1: every key).
struct KeyRanges { i64 first[2], last[2]; };

__device__ inline KeyRanges key_ranges(const i64* ints, const i64* spans, i64 b, i64 i0, i64 i1, int block_k,
                                       i64 split, i64 splits) {
    const i64 tiles = (ints[NPATTN_INT_KV_LEN] + block_k - 1) / block_k;
    const i64 per_split = (tiles + splits - 1) / splits;
    const i64 lo = split * per_split * block_k, hi = (split + 1) * per_split * block_k;
    const KeySegments segments = key_segments(ints, spans, b, i0, i1);
    KeyRanges ranges;
    ranges.first[0] = larger(lo, segments.sink_start);
    ranges.last[0] = smaller(hi, segments.sink_end);
    ranges.first[1] = larger(lo, segments.start);
    ranges.last[1] = smaller(hi, segments.stop);
    return ranges;
}

// The key tiles of a KeyRanges, numbered 0, 1, ... across both ranges.
struct KeyTiles {
    i64 first[2], last[2], count[2];
    int block_k;
    __device__ KeyTiles(const KeyRanges& ranges, int block_k_) : block_k(block_k_) {
        for (int x = 0; x < 2; ++x) {
            first[x] = ranges.first[x];
            last[x] = ranges.last[x];
            count[x] = last[x] > first[x] ? (last[x] - first[x] + block_k - 1) / block_k : 0;
        }
    }
    __device__ i64 total() const { return count[0] + count[1]; }
    __device__ i64 start(i64 t) const { return t < count[0] ? first[0] + t * block_k : first[1] + (t - count[0]) * block_k; }
    __device__ int keys(i64 t) const { return (int)smaller(block_k, (t < count[0] ? last[0] : last[1]) - start(t)); }
};

// With NPATTN_PREFETCH_PARAMETERS (a switch for a lent GPU to time, through
// NPATTN_GPU_DEFINES; untimed so far): the 128-byte lines holding `count` elements from
// `p` asked into L1 at once, lane i of the warp asking for line i (every lane calls it).
// Why: a decode step's forward spent 55% of its warp samples before its key loop (H200,
// 2026-11-30), in a chain of about 7 loads of ints, spans and Q, each touching a new line
// of ints only after the load before it came back, behind the other warps' copies in
// the memory queues. Asked for at the kernel's first instruction, every later read of
// ints would hit L1. A no-op in the host emulation and without the switch.
template <typename V> __device__ inline void prefetch_lines(const V* p, int count, int lane) {
#if defined(NPATTN_PREFETCH_PARAMETERS) && !defined(NPATTN_HOST_EMULATION)
    const unsigned long long first = reinterpret_cast<unsigned long long>(p) & ~127ull;
    const unsigned long long end = reinterpret_cast<unsigned long long>(p + count);
    const unsigned long long line = first + 128ull * (unsigned long long)lane;
    if (line < end) asm volatile("prefetch.global.L1 [%0];" ::"l"(line));
#else
    (void)p, (void)count, (void)lane;
#endif
}

// x from lane `from` of the warp (every lane calls it), as two 32-bit shuffles
__device__ inline i64 shuffle_i64(i64 x, int from) {
    const unsigned low = __shfl_sync(0xffffffffu, (unsigned)((unsigned long long)x & 0xffffffffu), from);
    const unsigned high = __shfl_sync(0xffffffffu, (unsigned)((unsigned long long)x >> 32), from);
    return (i64)(((unsigned long long)high << 32) | low);
}

// True when every row of [i0, i1) sees every key of [j0, j1) through causal, window,
// sinks and the live keys (bounds are monotone, so the first and last rows decide).
__device__ inline bool tile_fully_visible(const i64* ints, const i64* spans, i64 b, i64 i0, i64 i1, i64 j0,
                                          i64 j1) {
    const KeyBand first = key_band(ints, spans, b, i0);
    const KeyBand last = key_band(ints, spans, b, i1 - 1);
    return (first.sink_start <= j0 && j1 <= first.sink_end) || (last.lo <= j0 && j1 <= first.hi);
}

// True when every row of [i0, i1) sees every key of both of `tiles`' ranges: a key loop
// then tests no tile, where each tile's test loaded the band's bounds again (on an H200
// such loads waited behind the tile copies in flight, 4% of a decode step's samples).
__device__ inline bool tiles_fully_visible(const i64* ints, const i64* spans, i64 b, i64 i0, i64 i1,
                                           const KeyTiles& tiles) {
    for (int x = 0; x < 2; ++x) {
        if (tiles.count[x] > 0 && !tile_fully_visible(ints, spans, b, i0, i1, tiles.first[x], tiles.last[x])) return false;
    }
    return true;
}

// True when some row of [i0, i1) may see some key of [j0, j1).
__device__ inline bool tile_is_live(const i64* ints, const i64* spans, i64 b, i64 i0, i64 i1,
                                    i64 j0, i64 j1) {
    const KeySegments s = key_segments(ints, spans, b, i0, i1);
    return (j0 < s.sink_end && s.sink_start < j1) || (j0 < s.stop && s.start < j1);
}

// The live rows of batch entry b among [i0, i0 + block_rows), cut to Sq: their first
// row (i0, or Q_START when later) and how many (<= 0: none, all padding).
struct LiveRows { i64 first; int rows; };

__device__ inline LiveRows live_rows(const i64* ints, const i64* spans, i64 b, i64 i0, i64 block_rows) {
    LiveRows live;
    live.first = larger(i0, span(spans, b, NPATTN_SPAN_Q_START));
    live.rows = (int)(smaller(smaller(ints[NPATTN_INT_Q_LEN], i0 + block_rows), span(spans, b, NPATTN_SPAN_Q_STOP))
                      - live.first);
    return live;
}

// ---- the dropout hash (npattn/core/dropout.py) -----------------------------------------------

__device__ inline u32 fmix32(u32 x) {
    x ^= x >> 16;
    x *= 0x85EBCA6Bu;
    x ^= x >> 13;
    x *= 0xC2B2AE35u;
    return x ^ (x >> 16);
}

__device__ inline u32 absorb(u32 state, u32 word) { return fmix32((state ^ word) + 0x9E3779B9u); }

// The hash state after absorbing (seed_lo, seed_hi, b, h, i): one per query row.
__device__ inline u32 dropout_row_state(const i64* ints, i64 b, i64 h, i64 i) {
    u32 state = absorb(0u, (u32)ints[NPATTN_INT_SEED_LO]);
    state = absorb(state, (u32)ints[NPATTN_INT_SEED_HI]);
    state = absorb(state, (u32)(b + ints[NPATTN_INT_DROPOUT_OFFSET_B]));
    state = absorb(state, (u32)(h + ints[NPATTN_INT_DROPOUT_OFFSET_H]));
    return absorb(state, (u32)(i + ints[NPATTN_INT_DROPOUT_OFFSET_I]));
}

// j: the key's index in the call; the dropout_offset option's key offset is added here
__device__ inline bool dropout_keeps(const i64* ints, u32 row_state, i64 j) {
    return (absorb(row_state, (u32)(j + ints[NPATTN_INT_DROPOUT_OFFSET_J])) >> 8)
           >= (u32)ints[NPATTN_INT_DROPOUT_THRESHOLD];
}

// ---- operands -------------------------------------------------------------------------

// Everything a kernel reads besides its own outputs. Arrays are device pointers to
// element [0, 0, 0, 0] of bhsd-ordered views with the element strides in `ints`
// (the last axis of q, k, v and dout is unit-stride).
// The arrays every kernel takes first: their order, types and meaning are
// npattn.core.kernel_params.OPERANDS, which npattn.gpu.sources.source() writes here as
// NPATTN_OPERAND_FIELDS (the struct's members), NPATTN_OPERAND_PARAMS (a kernel's leading
// parameters) and NPATTN_OPERANDS (the struct built from them).
template <typename T, typename Acc> struct Operands {
    NPATTN_OPERAND_FIELDS
};

// NPATTN_PARAMETER_SCALARS (a switch for a lent GPU to time, through NPATTN_GPU_DEFINES;
// untimed so far): the tensor-core forward takes a copy of its ints and reals by value, as
// its last kernel parameter (the constant bank: a __grid_constant__ parameter's address
// reads it there, LDC), and reads them there rather than from the device arrays. Why: a
// decode step's forward spent 55% of its warp samples before its key loop (H200,
// 2026-11-30), in a chain of loads of ints, spans and Q; a load of ints from global memory
// is a round trip to L2 or DRAM behind the other warps' copies, a constant-bank read is
// not. The combine (repair.cu) takes them the same way. The driver passes the struct only
// under the switch (npattn.gpu.sources.switched_on).
template <typename Acc> struct ParameterScalars {
    i64 ints[NPATTN_INT_COUNT];
    Acc reals[NPATTN_REAL_COUNT];
};
#ifdef NPATTN_PARAMETER_SCALARS
#define NPATTN_SCALARS_PARAMETER , const __grid_constant__ ParameterScalars<Acc> scalars
#define NPATTN_KERNEL_INTS scalars.ints
#define NPATTN_KERNEL_REALS scalars.reals
#else
#define NPATTN_SCALARS_PARAMETER
#define NPATTN_KERNEL_INTS ints
#define NPATTN_KERNEL_REALS reals
#endif

// The kv head that query head h reads (a GQA group is heads / kv_heads consecutive heads)
__device__ inline i64 kv_head_of(const i64* ints, i64 h) {
    return h / (ints[NPATTN_INT_HEADS] / ints[NPATTN_INT_KV_HEADS]);
}

// Element offsets of row i of head h (a kv head for k and v) of batch b in q, k and v.
__device__ inline i64 q_row(const i64* ints, i64 b, i64 h, i64 i) {
    return b * ints[NPATTN_INT_Q_STRIDE_B] + h * ints[NPATTN_INT_Q_STRIDE_H] + i * ints[NPATTN_INT_Q_STRIDE_S];
}
// (k_row and v_row: k and v as (B, Hkv, Sk, D) arrays, as the backward takes them; the
// forward reads them through paged_k_row and paged_v_row.)
__device__ inline i64 k_row(const i64* ints, i64 b, i64 h, i64 j) {
    return b * ints[NPATTN_INT_K_STRIDE_B] + h * ints[NPATTN_INT_K_STRIDE_H] + j * ints[NPATTN_INT_K_STRIDE_S];
}
__device__ inline i64 v_row(const i64* ints, i64 b, i64 h, i64 j) {
    return b * ints[NPATTN_INT_V_STRIDE_B] + h * ints[NPATTN_INT_V_STRIDE_H] + j * ints[NPATTN_INT_V_STRIDE_S];
}

// Element offset of key j's row of head h in batch entry b of k or v (strides sb, sh, ss):
// row j % PAGE_SIZE of page pages[b * PAGES + j / PAGE_SIZE] (npattn.core.kernel_params; not
// paged, entry b's one page is b and PAGE_SIZE covers every key).
__device__ inline i64 key_row(const i64* ints, const i64* pages, i64 b, i64 h, i64 j, i64 sb, i64 sh, i64 ss) {
    const i64 page_size = ints[NPATTN_INT_PAGE_SIZE], block = j / page_size;
    return pages[b * ints[NPATTN_INT_PAGES] + block] * sb + h * sh + (j - block * page_size) * ss;
}
// key_row with the strides ints[STRIDE_B], ints[STRIDE_B + 1], ints[STRIDE_B + 2] (an
// array's B, H and S strides, consecutive in npattn.core.kernel_params.Int)
template <int STRIDE_B> __device__ inline i64 strided_key_row(const i64* ints, const i64* pages, i64 b, i64 h, i64 j) {
    return key_row(ints, pages, b, h, j, ints[STRIDE_B], ints[STRIDE_B + 1], ints[STRIDE_B + 2]);
}
__device__ inline i64 paged_k_row(const i64* ints, const i64* pages, i64 b, i64 h, i64 j) {
    return strided_key_row<NPATTN_INT_K_STRIDE_B>(ints, pages, b, h, j);
}
__device__ inline i64 paged_v_row(const i64* ints, const i64* pages, i64 b, i64 h, i64 j) {
    return strided_key_row<NPATTN_INT_V_STRIDE_B>(ints, pages, b, h, j);
}

// ---- quantized caches ----------------------------------------------------------------
// With ints[KV_CODES] (NPATTN_KVCODES_INT8 or _FLOAT8) k and v are placeholders and the
// keys are byte codes (in.k_codes, in.v_codes; strides K_STRIDE_* / V_STRIDE_* in codes)
// with one float32 scale per key row and kv head (in.k_scale, in.v_scale; strides
// K_SCALE_STRIDE_* / V_SCALE_STRIDE_*): element d of key j reads as its code's value
// times the row's scale (npattn.core.quantization), dequantized as it is read, never
// into a copy of the cache.

// The value of a code: an int8's integer, or float8 e4m3's (sign, 4 exponent bits with
// bias 7, 3 mantissa bits; exponent 0: subnormal, m * 2^-9; S.1111.111: NaN; no inf).
// Exact in float32.
__device__ inline float code_value(unsigned char code, bool e4m3) {
    if (!e4m3) return (float)(signed char)code;
    const int exponent = (code >> 3) & 15, mantissa = code & 7;
    if (exponent == 15 && mantissa == 7) return __int_as_float(0x7fc00000);
    // (8 + m) * 2^(e - 10), or m * 2^-9: a power of two assembled in the exponent bits
    const float magnitude = exponent == 0 ? (float)mantissa * __int_as_float((127 - 9) << 23)
                                          : (float)(8 + mantissa) * __int_as_float((127 + exponent - 10) << 23);
    return (code & 0x80) ? -magnitude : magnitude;
}
__device__ inline i64 paged_k_scale_row(const i64* ints, const i64* pages, i64 b, i64 h, i64 j) {
    return strided_key_row<NPATTN_INT_K_SCALE_STRIDE_B>(ints, pages, b, h, j);
}
__device__ inline i64 paged_v_scale_row(const i64* ints, const i64* pages, i64 b, i64 h, i64 j) {
    return strided_key_row<NPATTN_INT_V_SCALE_STRIDE_B>(ints, pages, b, h, j);
}

// Element d of key j's row of kv head h in batch entry b, of k (`values`: of v), in R: as
// the array holds it, or a quantized cache's code times its scale (in R: exact in double).
template <typename R, typename T, typename Acc>
__device__ inline R key_element(const Operands<T, Acc>& in, bool values, i64 b, i64 h, i64 j, int d) {
    const i64* ints = in.ints;
    const i64 codes = ints[NPATTN_INT_KV_CODES];
    if (codes == NPATTN_KVCODES_NONE) {
        return values ? Storage<T>::template load<R>(in.v, paged_v_row(ints, in.pages, b, h, j) + d)
                      : Storage<T>::template load<R>(in.k, paged_k_row(ints, in.pages, b, h, j) + d);
    }
    const bool e4m3 = codes == NPATTN_KVCODES_FLOAT8;
    const unsigned char code = values ? in.v_codes[paged_v_row(ints, in.pages, b, h, j) + d]
                                      : in.k_codes[paged_k_row(ints, in.pages, b, h, j) + d];
    const float scale = values ? in.v_scale[paged_v_scale_row(ints, in.pages, b, h, j)]
                               : in.k_scale[paged_k_scale_row(ints, in.pages, b, h, j)];
    return (R)code_value(code, e4m3) * (R)scale;
}

// Keys of the tile starting at key j0: up to block_k, `last` and the end of j0's page (so
// one stride reaches every key of the tile).
__device__ inline int tile_keys(const i64* ints, i64 j0, i64 last, int block_k) {
    const i64 page_size = ints[NPATTN_INT_PAGE_SIZE];
    return (int)smaller(smaller((i64)block_k, last - j0), (j0 / page_size + 1) * page_size - j0);
}

// ---- tiles in shared memory -------------------------------------------------------------

// rows x width of x (bhsd, row stride `row_stride`, starting at `offset`) into
// tile[r * ld + c] in the compute dtype; zeros past `rows` and `width` up to the tile's
// size, so tile products need no bounds checks.
template <typename T, typename Acc>
__device__ inline void load_tile(const T* x, i64 offset, i64 row_stride, int rows, int width,
                                 int tile_rows, int tile_width, Acc* tile, int ld) {
    for (int index = threadIdx.x; index < tile_rows * tile_width; index += blockDim.x) {
        const int r = index / tile_width, c = index % tile_width;
        tile[r * ld + c] = (r < rows && c < width)
                               ? Storage<T>::template load<Acc>(x, offset + r * row_stride + c)
                               : (Acc)0;
    }
}

// The rows [j0, j0 + rows) of kv head h of batch entry b of k (`values`: of v), width
// `width`, as load_tile loads them (zeros past rows and width); `offset` is the first row's
// in k or v (paged_k_row / paged_v_row: a tile lies in one page, so the rows are `row_stride`
// apart). A quantized cache's rows are dequantized here (key_element's values).
template <typename T, typename Acc>
__device__ inline void load_key_tile(const Operands<T, Acc>& in, bool values, i64 b, i64 h, i64 j0, i64 offset,
                                     i64 row_stride, int rows, int width, int tile_rows, int tile_width, Acc* tile,
                                     int ld) {
    const i64 codes = in.ints[NPATTN_INT_KV_CODES];
    if (codes == NPATTN_KVCODES_NONE) {
        load_tile(values ? in.v : in.k, offset, row_stride, rows, width, tile_rows, tile_width, tile, ld);
        return;
    }
    const bool e4m3 = codes == NPATTN_KVCODES_FLOAT8;
    const unsigned char* code_rows = values ? in.v_codes : in.k_codes;
    const float* scales = values ? in.v_scale : in.k_scale;
    const i64 scale_at = values ? paged_v_scale_row(in.ints, in.pages, b, h, j0)
                                : paged_k_scale_row(in.ints, in.pages, b, h, j0);
    const i64 scale_stride = in.ints[values ? NPATTN_INT_V_SCALE_STRIDE_S : NPATTN_INT_K_SCALE_STRIDE_S];
    for (int index = threadIdx.x; index < tile_rows * tile_width; index += blockDim.x) {
        const int r = index / tile_width, c = index % tile_width;
        tile[r * ld + c] = (r < rows && c < width)
                               ? (Acc)code_value(code_rows[offset + r * row_stride + c], e4m3) *
                                     (Acc)scales[scale_at + r * scale_stride]
                               : (Acc)0;
    }
}

// The score pipeline of one query row i of head h in batch b: scale, softcap (its tanh
// in *tanh_out), bias, ALiBi, then -inf where key j is invisible to the row (causal,
// window, sinks, the live keys, mask). Every kernel's scores go through here, whatever
// computed the dot q_i . k_j. OPTIONS (NPATTN_OPTION_* bits, from npattn.gpu.options)
// says which options the code is compiled for: an option outside it is assumed off
// (the driver picks an instantiation whose OPTIONS cover the call's), so a plain call
// runs none of their code. NPATTN_OPTION_BAND covers causal, windows, sinks,
// kv_lengths and kv_start; without it every key below kv_len is visible.
template <typename T, typename Acc, unsigned OPTIONS = NPATTN_OPTION_ALL> struct ScoreRow {
    KeyBand band;
    const unsigned char* mask_row;
    const Acc* bias_row;
    i64 mask_stride, bias_stride, position;
    Acc scale, softcap, slope;

    __device__ ScoreRow() {}  // filled by assignment (arrays of rows, one per lane row)
    __device__ ScoreRow(const Operands<T, Acc>& in, i64 b, i64 h, i64 i) {
        const i64* ints = in.ints;
        if (OPTIONS & NPATTN_OPTION_BAND) band = key_band(ints, in.spans, b, i);
        mask_row = nullptr;
        bias_row = nullptr;
        if ((OPTIONS & NPATTN_OPTION_MASK) && ints[NPATTN_INT_HAS_MASK]) {
            mask_row = in.mask + b * ints[NPATTN_INT_MASK_STRIDE_B] + h * ints[NPATTN_INT_MASK_STRIDE_H] +
                       i * ints[NPATTN_INT_MASK_STRIDE_Q];
        }
        mask_stride = ints[NPATTN_INT_MASK_STRIDE_K];
        if ((OPTIONS & NPATTN_OPTION_BIAS) && ints[NPATTN_INT_HAS_BIAS]) {
            bias_row = in.bias + b * ints[NPATTN_INT_BIAS_STRIDE_B] + h * ints[NPATTN_INT_BIAS_STRIDE_H] +
                       i * ints[NPATTN_INT_BIAS_STRIDE_Q];
        }
        bias_stride = ints[NPATTN_INT_BIAS_STRIDE_K];
        position = i + span(in.spans, b, NPATTN_SPAN_SHIFT);
        scale = in.reals[NPATTN_REAL_SCALE];
        softcap = ((OPTIONS & NPATTN_OPTION_SOFTCAP) && ints[NPATTN_INT_HAS_SOFTCAP]) ? in.reals[NPATTN_REAL_SOFTCAP]
                                                                                      : (Acc)0;
        slope = ((OPTIONS & NPATTN_OPTION_ALIBI) && ints[NPATTN_INT_HAS_ALIBI])
                    ? in.alibi[b * ints[NPATTN_INT_HEADS] + h] : (Acc)0;
    }

    // Whether key j is visible to the row (j < kv_len).
    __device__ bool visible(i64 j) const {
        bool seen = true;
        if (OPTIONS & NPATTN_OPTION_BAND) seen = key_visible(band, j);
        if ((OPTIONS & NPATTN_OPTION_MASK) && mask_row != nullptr && seen) seen = mask_row[j * mask_stride] != 0;
        return seen;
    }

    // The score of key j from `dot`, before any scale: the natural-log-domain logit.
    __device__ Acc score(i64 j, Acc dot, Acc* tanh_out) const {
        Acc score = scale * dot;
        *tanh_out = 0;
        if ((OPTIONS & NPATTN_OPTION_SOFTCAP) && softcap != (Acc)0) {
            *tanh_out = tanh_of(score / softcap);
            score = softcap * *tanh_out;
        }
        if ((OPTIONS & NPATTN_OPTION_BIAS) && bias_row != nullptr) score += bias_row[j * bias_stride];
        if (OPTIONS & NPATTN_OPTION_ALIBI) {
            const i64 distance = position > j ? position - j : j - position;
            score -= slope * (Acc)distance;
        }
        return visible(j) ? score : negative_infinity<Acc>();
    }
};

// One score through ScoreRow with every option compiled in (the SIMT kernels' way).
template <typename T, typename Acc>
__device__ inline Acc finish_score(const Operands<T, Acc>& in, i64 b, i64 h, i64 i, i64 j, Acc dot, Acc* tanh_out) {
    return ScoreRow<T, Acc>(in, b, h, i).score(j, dot, tanh_out);
}

// Scores of rows [i0, i0 + rows) of head h against keys [j0, j0 + cols) into
// s[r * ld + c], from the query tile qs (BQ x D, row stride ld_q) and key tile ks
// (BK x D, row stride ld_k) in shared memory (finish_score; the tanh of softcap in
// `tanh_out` when not null). Places past `rows` or `cols` get -inf. Ends with
// __syncthreads().
template <typename T, typename Acc, int BQ, int BK>
__device__ inline void score_tile(const Operands<T, Acc>& in, const Acc* qs, int ld_q, const Acc* ks,
                                  int ld_k, Acc* s, int ld, Acc* tanh_out, i64 b, i64 h, i64 i0,
                                  int rows, i64 j0, int cols) {
    const int head_dim = (int)in.ints[NPATTN_INT_HEAD_DIM];
    for (int index = threadIdx.x; index < BQ * BK; index += blockDim.x) {
        const int r = index / BK, c = index % BK;
        Acc score = negative_infinity<Acc>();
        Acc t = 0;
        if (r < rows && c < cols) {
            Acc dot = 0;
            for (int d = 0; d < head_dim; ++d) dot += qs[r * ld_q + d] * ks[c * ld_k + d];
            score = finish_score(in, b, h, i0 + r, j0 + c, dot, &t);
        }
        s[r * ld + c] = score;
        if (tanh_out != nullptr) tanh_out[r * ld + c] = t;
    }
    __syncthreads();
}

// Products rounded on their own, never fused into a following add or subtract (an FMA
// would keep P~ v unrounded where the forward rounded it into O).
__device__ inline float product_rounded(float a, float b) { return __fmul_rn(a, b); }
__device__ inline double product_rounded(double a, double b) { return __dmul_rn(a, b); }

// Above this probability a key's score gradient is computed as DominantKey does. Above
// 1/2 at most one key per row qualifies; 3/4 keeps an exact tie of two keys at 1/2 (both
// recomputed a rounding above it) out, so two keys qualify only where lse's rounding
// makes P meaningless (|lse| above about 7e6 in float32). npattn/cpu uses the same.
#define NPATTN_DOMINANT_PROBABILITY 0.75

// The score gradient of the one key a row may give P > 3/4: P dO_i . (z v_j - O_i), with
// z dropout's keep factor (1 without dropout). P (dP - delta) cancels there: dP and delta are both about
// |dO| |v|, their difference about (1 - P) |dO| |v|, so one rounding of either, times
// the scale and |k|, can dwarf the exact gradient of a nearly one-hot row. Subtracting
// the vectors first leaves only O's own rounding: z v is rounded to T as the forward
// rounded O, so where the row is exactly one-hot the two are equal. Reads dO, v and O
// from global memory (at most one key per row takes this path). Dout: dO's storage type
// (16-bit in the tensor-core kernels, the compute dtype in the SIMT ones). O: (B, H, Sq,
// Dv) C-contiguous, in T. `record`, when not null, keeps each result (float32) with its
// key at its row's place (B, H, Sq) for a DominantLookup: (j + 1) << 32 | the float's bits,
// one 64-bit store, so a reader sees a key with its own value; 0 means none.
template <typename T, typename Acc, typename Dout> struct DominantKey {
    const T* v;
    const Dout* dout;
    const i64* dout_strides;
    const T* out;
    const i64* ints;
    unsigned long long* record;

    __device__ Acc gradient(i64 b, i64 h, i64 i, i64 j, Acc factor, Acc probability, Acc) const {
        const i64 heads = ints[NPATTN_INT_HEADS];
        const i64 row = (b * heads + h) * ints[NPATTN_INT_Q_LEN] + i;
        const int value_dim = (int)ints[NPATTN_INT_VALUE_DIM];
        const i64 v_at = v_row(ints, b, h / (heads / ints[NPATTN_INT_KV_HEADS]), j);
        const i64 dout_at = b * dout_strides[0] + h * dout_strides[1] + i * dout_strides[2];
        const i64 out_at = row * value_dim;
        Acc total = 0;
        for (int d = 0; d < value_dim; ++d) {
            const Acc kept = Storage<T>::round(product_rounded(factor, Storage<T>::template load<Acc>(v, v_at + d)));
            total += Storage<Dout>::template load<Acc>(dout, dout_at + d) *
                     (kept - Storage<T>::template load<Acc>(out, out_at + d));
        }
        const Acc gradient = probability * total;
        if (record != nullptr) {
            record[row] = ((unsigned long long)(j + 1) << 32) | __float_as_uint((float)gradient);
        }
        return gradient;
    }
};

// The gradients a DominantKey recorded, staged per query tile in shared memory (`key`:
// the recorded j + 1, 0 for none; `value`: its gradient; both indexed by i - i0): how
// the tensor-core dK/dV pass takes them from the dQ pass (which runs first and meets the
// same keys with the same recomputed P) instead of running the D-long dot in a loop
// whose registers its accumulators fill. A key the dQ pass did not record (possible
// only where P is meaningless, see NPATTN_DOMINANT_PROBABILITY) keeps the ordinary
// P (dP - delta).
template <typename Acc> struct DominantLookup {
    const int* key;
    const float* value;
    i64 i0;

    __device__ Acc gradient(i64, i64, i64 i, i64 j, Acc, Acc, Acc ordinary) const {
        return key[i - i0] == (int)(j + 1) ? (Acc)value[i - i0] : ordinary;
    }
};

// One score's gradient from its probability P, dP = dO_i . v_j, the row's delta =
// rowsum(dO * O) and softcap's tanh t: dS = P (dP~ - delta), where dP~ is dP times the
// dropout keep factor (for a key with P > 3/4, dominant.gradient: see DominantKey);
// times 1 - t^2 (softcap's derivative) with `to_raw_scores`. *dropped gets P after
// dropout (what dV sums). `valid`: (i, j) lies inside the problem. OPTIONS (as ScoreRow's)
// compiles in dropout and softcap only where the call may have them.
template <unsigned OPTIONS = NPATTN_OPTION_ALL, typename Acc, typename Dominant>
__device__ inline Acc score_gradient(const i64* ints, const Acc* reals, i64 b, i64 h, i64 i, i64 j, bool valid,
                                     Acc probability, Acc dp, Acc delta, Acc t, bool to_raw_scores, Acc* dropped,
                                     const Dominant& dominant) {
    *dropped = probability;
    Acc factor = 1;
    if ((OPTIONS & NPATTN_OPTION_DROPOUT) && ints[NPATTN_INT_HAS_DROPOUT]) {
        const bool kept = valid && dropout_keeps(ints, dropout_row_state(ints, b, h, i), j);
        factor = kept ? reals[NPATTN_REAL_KEEP_SCALE] : (Acc)0;
        *dropped *= factor;
        dp *= factor;
    }
    Acc gradient = probability * (dp - delta);
    if (valid && probability > (Acc)NPATTN_DOMINANT_PROBABILITY) {
        gradient = dominant.gradient(b, h, i, j, factor, probability, gradient);
    }
    if ((OPTIONS & NPATTN_OPTION_SOFTCAP) && to_raw_scores && ints[NPATTN_INT_HAS_SOFTCAP]) gradient *= (Acc)1 - t * t;
    return gradient;
}

template <typename Acc> __device__ inline Acc warp_max(Acc x) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        const Acc other = __shfl_xor_sync(0xffffffffu, x, offset);
        x = other > x ? other : x;
    }
    return x;
}

template <typename Acc> __device__ inline Acc warp_sum(Acc x) {
    for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}
