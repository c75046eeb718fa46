// The forward for float16 and bfloat16 inputs on tensor cores: mma.sync m16n8k16 with
// float32 accumulation (FlashAttention-2's warp layout).
//
// One block of 4 warps per (batch, head, 64 query rows), each warp owning 16 rows for
// the whole key loop, so the online softmax needs no shared memory: a row's scores
// live in the registers of the 4 lanes of one lane group and are reduced with two
// shuffles. Per 64-key tile: S = Q K^T (Q and K tiles in shared memory as 16-bit
// values), every score through finish_score (the same option pipeline as the SIMT
// kernels), the online softmax, dropout, then O += P V with P taken straight from
// S's accumulator registers (the accumulator layout of two 8-key column blocks is the
// A-operand layout of one 16-key block) and V stored transposed, so every operand
// fragment is one 32-bit shared-memory load. Split-KV for short queries works as in
// forward_kernel (forward.cu), with the same partial layout and combine_kernel.
#include "common.cuh"
#include "forward.cu"

#define NPATTN_TC_WARPS 4
#define NPATTN_TC_BQ 64
#define NPATTN_TC_BK 64
#define NPATTN_TC_PAD 8  // 16-bit elements added to each shared row: spreads rows over banks

template <typename T> struct TensorCore;
template <> struct TensorCore<half_bits> { static constexpr bool bf16 = false; };
template <> struct TensorCore<bf16_bits> { static constexpr bool bf16 = true; };

// d += a b for one m16n8k16 tile (fragment layouts of the PTX ISA, "Matrix Fragments
// for mma.m16n8k16 with floating point type"). The host emulation of the tests
// supplies its own.
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

__device__ inline u32 shared_pair(const unsigned short* tile, int at) {
    return *reinterpret_cast<const u32*>(tile + at);  // `at` is even: 4-byte aligned
}

// A 16-row A fragment (rows r, r + 8; 16 columns from c0) of a row-major 16-bit tile.
__device__ inline void a_fragment(const unsigned short* tile, int ld, int r, int c0, int member, u32* a) {
    a[0] = shared_pair(tile, r * ld + c0 + 2 * member);
    a[1] = shared_pair(tile, (r + 8) * ld + c0 + 2 * member);
    a[2] = shared_pair(tile, r * ld + c0 + 2 * member + 8);
    a[3] = shared_pair(tile, (r + 8) * ld + c0 + 2 * member + 8);
}

// The B fragment of an 8-column block whose column `column` is the row of a 16-bit tile
// holding the k dimension contiguously (16 values from k0).
__device__ inline void b_fragment(const unsigned short* tile, int ld, int column, int k0, int member, u32* b) {
    b[0] = shared_pair(tile, column * ld + k0 + 2 * member);
    b[1] = shared_pair(tile, column * ld + k0 + 2 * member + 8);
}

// acc (16 x 64, as eight 8-column blocks) = A B^T over `depth` (a multiple of 16): A's
// 16 rows from `a_row` of a_tile, B^T's 64 columns the first 64 rows of b_tile, both
// row-major 16-bit tiles holding the depth contiguously. One warp's share of a tile.
template <typename T>
__device__ inline void warp_product(float (*acc)[4], const unsigned short* a_tile, int ld_a, int a_row,
                                    const unsigned short* b_tile, int ld_b, int depth, int group, int member) {
#pragma unroll
    for (int n = 0; n < 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    for (int d0 = 0; d0 < depth; d0 += 16) {
        u32 a[4];
        a_fragment(a_tile, ld_a, a_row, d0, member, a);
#pragma unroll
        for (int n = 0; n < 8; ++n) {
            u32 b[2];
            b_fragment(b_tile, ld_b, n * 8 + group, d0, member, b);
            mma_16816<T>(acc[n], a, b);
        }
    }
}

// rows x width 16-bit values of x (row stride `row_stride` from `offset`) into
// tile[r * ld + c] (or tile[c * ld + r] when `transpose`), zeros up to tile_rows x tile_width.
template <typename T>
__device__ inline void load_bits(const T* x, i64 offset, i64 row_stride, int rows, int width, int tile_rows,
                                 int tile_width, unsigned short* tile, int ld, bool transpose) {
    for (int index = threadIdx.x; index < tile_rows * tile_width; index += blockDim.x) {
        const int r = index / tile_width, c = index % tile_width;
        const unsigned short bits = (r < rows && c < width) ? x[offset + r * row_stride + c].bits : 0;
        tile[transpose ? c * ld + r : r * ld + c] = bits;
    }
}

// Shared memory of forward_tc_kernel, in 16-bit elements: Q (64 x D), K (64 x D) and
// V^T (Dv x 64), head dims rounded up to whole mma tiles and rows padded.
struct TensorCoreLayout {
    int head_dim, value_dim, ld_q, ld_k, ld_v, q, k, v;
    __device__ TensorCoreLayout(int head_dim_, int value_dim_) {
        head_dim = (head_dim_ + 15) / 16 * 16;
        value_dim = (value_dim_ + 7) / 8 * 8;
        ld_q = ld_k = head_dim + NPATTN_TC_PAD;
        ld_v = NPATTN_TC_BK + NPATTN_TC_PAD;
        q = 0;
        k = q + NPATTN_TC_BQ * ld_q;
        v = k + NPATTN_TC_BK * ld_k;
    }
};

template <typename T, typename Acc, int MAX_D>
__global__ void __launch_bounds__(NPATTN_TC_WARPS * 32)
forward_tc_kernel(NPATTN_OPERAND_PARAMS, Acc* out, i64 out_sb, i64 out_sh, i64 out_ss, Acc* lse, i64 splits,
                  Acc* partial) {
    static_assert(sizeof(Acc) == 4, "tensor-core tiles accumulate in float32");
    constexpr int KEY_BLOCKS = NPATTN_TC_BK / 8;  // 8-key column blocks of S (warp_product's 8)
    constexpr int VALUE_BLOCKS = MAX_D / 8;       // 8-column blocks of O
    const Operands<T, Acc> in = NPATTN_OPERANDS;
    const i64 heads = ints[NPATTN_INT_HEADS], q_len = ints[NPATTN_INT_Q_LEN];
    const i64 q_tiles = (q_len + NPATTN_TC_BQ - 1) / NPATTN_TC_BQ;
    const i64 item = blockIdx.x / splits, split = blockIdx.x % splits;
    const i64 b = item / (heads * q_tiles), h = (item / q_tiles) % heads;
    const i64 i0 = (item % q_tiles) * NPATTN_TC_BQ;
    const int rows = (int)(smaller(smaller(q_len, i0 + NPATTN_TC_BQ), q_lengths[b]) - i0);
    if (rows <= 0) return;  // the same for the whole block
    const int head_dim = (int)ints[NPATTN_INT_HEAD_DIM], value_dim = (int)ints[NPATTN_INT_VALUE_DIM];
    NPATTN_DYNAMIC_SHARED(shared_bytes);
    unsigned short* shared = reinterpret_cast<unsigned short*>(shared_bytes);
    const TensorCoreLayout at(head_dim, value_dim);
    unsigned short *qs = shared + at.q, *ks = shared + at.k, *vs = shared + at.v;
    const i64 kv_head = h / (heads / ints[NPATTN_INT_KV_HEADS]);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int group = lane / 4, member = lane % 4;  // the PTX ISA's groupID, threadID_in_group
    // this lane's two rows: group and group + 8 of the warp's 16
    const int row0 = warp * 16 + group, row1 = row0 + 8;
    const bool has_sink = ints[NPATTN_INT_HAS_SINK] != 0 && splits == 1;  // else combine_kernel adds it
    const bool has_dropout = ints[NPATTN_INT_HAS_DROPOUT] != 0;
    const float lowest = negative_infinity<float>();
    // no option that changes a score: tiles inside every row's band need only the scale
    const bool plain_scores = !ints[NPATTN_INT_HAS_MASK] && !ints[NPATTN_INT_HAS_BIAS] && !ints[NPATTN_INT_HAS_ALIBI] &&
                              !ints[NPATTN_INT_HAS_SOFTCAP];
    const float scale = (float)in.reals[NPATTN_REAL_SCALE];

    load_bits(q, q_row(ints, b, h, i0),
              ints[NPATTN_INT_Q_STRIDE_S], rows, head_dim, NPATTN_TC_BQ, at.head_dim, qs, at.ld_q, false);
    float m[2], l[2];
    bool seen[2] = {false, false};
    for (int x = 0; x < 2; ++x) {
        m[x] = has_sink ? (float)sink[h] : lowest;  // the sink logit: a first column of value 0
        l[x] = has_sink ? 1.0f : 0.0f;
    }
    float o[VALUE_BLOCKS][4];
#pragma unroll
    for (int n = 0; n < VALUE_BLOCKS; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    const u32 dropout_state[2] = {dropout_row_state(ints, b, h, i0 + row0), dropout_row_state(ints, b, h, i0 + row1)};

    const KeyRanges keys = key_ranges(ints, kv_lengths, b, i0, i0 + rows, NPATTN_TC_BK, split, splits);
    for (int segment = 0; segment < 2; ++segment) {
        for (i64 j0 = keys.first[segment]; j0 < keys.last[segment]; j0 += NPATTN_TC_BK) {
            const int cols = (int)smaller(NPATTN_TC_BK, keys.last[segment] - j0);
            __syncthreads();  // every warp is done with the previous tile (and Q is loaded)
            load_bits(k, k_row(ints, b, kv_head, j0), ints[NPATTN_INT_K_STRIDE_S], cols, head_dim,
                      NPATTN_TC_BK, at.head_dim, ks, at.ld_k, false);
            load_bits(v, v_row(ints, b, kv_head, j0), ints[NPATTN_INT_V_STRIDE_S], cols, value_dim,
                      NPATTN_TC_BK, at.value_dim, vs, at.ld_v, true);
            __syncthreads();

            // S (16 x 64 per warp) = Q K^T
            float s[KEY_BLOCKS][4];
            warp_product<T>(s, qs, at.ld_q, warp * 16 + group, ks, at.ld_k, at.head_dim, group, member);
            // scores, then the online softmax of this lane's two rows (x = 0: row0, 1: row1);
            // rows past `rows` keep finite scores on plain tiles: their outputs are never written
            const bool plain_tile =
                plain_scores && tile_fully_visible(ints, kv_lengths, b, i0, i0 + rows, j0, j0 + cols);
            float tile_max[2] = {lowest, lowest};
#pragma unroll
            for (int n = 0; n < KEY_BLOCKS; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int x = e / 2, r = x ? row1 : row0, c = n * 8 + 2 * member + (e & 1);
                    float t;
                    if (plain_tile) {
                        s[n][e] = c < cols ? scale * s[n][e] : lowest;
                    } else {
                        s[n][e] = (r < rows && c < cols) ? finish_score(in, b, h, i0 + r, j0 + c, s[n][e], &t) : lowest;
                    }
                    tile_max[x] = s[n][e] > tile_max[x] ? s[n][e] : tile_max[x];
                }
            }
            float shift[2], correction[2], tile_sum[2] = {0.0f, 0.0f};
            for (int x = 0; x < 2; ++x) {
                // the 4 lanes of a group hold one row: reduce over lane bits 0 and 1
                for (int offset = 1; offset < 4; offset <<= 1) {
                    const float other = __shfl_xor_sync(0xffffffffu, tile_max[x], offset);
                    tile_max[x] = other > tile_max[x] ? other : tile_max[x];
                }
                const float new_max = tile_max[x] > m[x] ? tile_max[x] : m[x];
                const bool any = new_max > lowest;
                shift[x] = any ? new_max : 0.0f;  // nothing visible yet: exp(-inf - 0) = 0, not NaN
                correction[x] = any ? exp_of(m[x] - new_max) : 1.0f;
                m[x] = new_max;
                if (tile_max[x] > lowest) seen[x] = true;
            }
#pragma unroll
            for (int n = 0; n < KEY_BLOCKS; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int x = e / 2, r = x ? row1 : row0, c = n * 8 + 2 * member + (e & 1);
                    float p = exp_of(s[n][e] - shift[x]);
                    tile_sum[x] += p;
                    if (has_dropout && r < rows && c < cols && !dropout_keeps(ints, dropout_state[x], j0 + c)) p = 0.0f;
                    s[n][e] = p;
                }
            }
            for (int x = 0; x < 2; ++x) {
                for (int offset = 1; offset < 4; offset <<= 1) {
                    tile_sum[x] += __shfl_xor_sync(0xffffffffu, tile_sum[x], offset);
                }
                l[x] = l[x] * correction[x] + tile_sum[x];
            }
            // O (16 x Dv per warp) = O * correction + P V
#pragma unroll
            for (int n = 0; n < VALUE_BLOCKS; ++n) {
                o[n][0] *= correction[0];
                o[n][1] *= correction[0];
                o[n][2] *= correction[1];
                o[n][3] *= correction[1];
            }
#pragma unroll
            for (int kb = 0; kb < NPATTN_TC_BK / 16; ++kb) {
                const u32 a[4] = {pack_pair<T>(s[2 * kb][0], s[2 * kb][1]), pack_pair<T>(s[2 * kb][2], s[2 * kb][3]),
                                  pack_pair<T>(s[2 * kb + 1][0], s[2 * kb + 1][1]),
                                  pack_pair<T>(s[2 * kb + 1][2], s[2 * kb + 1][3])};
#pragma unroll
                for (int n = 0; n < VALUE_BLOCKS; ++n) {
                    if (n * 8 < at.value_dim) {
                        const int column = n * 8 + group;
                        const u32 bb[2] = {shared_pair(vs, column * at.ld_v + kb * 16 + 2 * member),
                                           shared_pair(vs, column * at.ld_v + kb * 16 + 2 * member + 8)};
                        mma_16816<T>(o[n], a, bb);
                    }
                }
            }
        }
    }

    // this lane's outputs: rows row0 (o[n][0..1]) and row1 (o[n][2..3]), columns n * 8 + 2 * member + {0, 1}
    for (int x = 0; x < 2; ++x) {
        const int r = x ? row1 : row0;
        if (r >= rows) continue;
        const i64 row = (b * heads + h) * q_len + i0 + r;
        if (splits > 1) {
            Acc* mine = partial + (row * splits + split) * (value_dim + 3);
#pragma unroll
            for (int n = 0; n < VALUE_BLOCKS; ++n) {
                for (int e = 0; e < 2; ++e) {
                    const int d = n * 8 + 2 * member + e;
                    if (d < value_dim) mine[d] = o[n][2 * x + e];
                }
            }
            if (member == 0) {
                mine[value_dim] = m[x];
                mine[value_dim + 1] = l[x];
                mine[value_dim + 2] = seen[x];
            }
            continue;
        }
        const float factor = seen[x] ? (float)in.reals[NPATTN_REAL_KEEP_SCALE] / l[x] : 0.0f;
        const i64 o_row = b * out_sb + h * out_sh + (i0 + r) * out_ss;
#pragma unroll
        for (int n = 0; n < VALUE_BLOCKS; ++n) {
            for (int e = 0; e < 2; ++e) {
                const int d = n * 8 + 2 * member + e;
                if (d < value_dim) out[o_row + d] = o[n][2 * x + e] * factor;
            }
        }
        if (member == 0 && seen[x]) lse[row] = m[x] + log_of(l[x]);
    }
}
