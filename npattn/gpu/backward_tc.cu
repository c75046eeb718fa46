// The backward for float16 and bfloat16 inputs on tensor cores (mma.sync m16n8k16,
// float32 accumulation), head dims up to 128 (wider heads take backward.cu's kernels:
// two accumulators of D columns per lane would not fit in registers).
//
// Deterministic like backward.cu: dkdv_tc_kernel owns 64 keys (each of its 4 warps 16
// of them) over every query head of the group and every live query tile; dq_tc_kernel
// owns 64 query rows (16 per warp) over every live key tile. Each warp recomputes its
// scores with finish_score, P from lse, dP, and dS = P (dP - delta) in registers, then
// feeds P and dS back into mma as A operands straight from the accumulator registers
// (the layout trick of forward_tc.cu), with the B operands kept transposed in shared
// memory wherever that makes each fragment one 32-bit load.
#include "common.cuh"
#include "tensor_core.cuh"

#define NPATTN_TC_WARPS 4
#define NPATTN_TC_BQ 64
#define NPATTN_TC_BK 64
#define NPATTN_TC_PAD 8  // 16-bit elements added to each shared row: spreads rows over banks


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

// P = exp(score - lse) of one recomputed score, from q_i . k_j (softcap's tanh in *t);
// 0 outside the problem (`valid` false) and in a row with no visible key.
template <typename T>
__device__ inline float recomputed_probability(const Operands<T, float>& in, i64 b, i64 h, i64 i, i64 j, bool valid,
                                               float dot, float row_lse, float* t) {
    *t = 0.0f;
    if (!valid || !(row_lse > negative_infinity<float>())) return 0.0f;
    return exp_of(finish_score(in, b, h, i, j, dot, t) - row_lse);
}

// A fragments of a 16 x 64 block held as accumulators acc[8][4] (8-column blocks): the
// 16-column block kb, packed to 16-bit pairs.
template <typename T> __device__ inline void a_from_accumulators(float (*acc)[4], int kb, u32* a) {
    a[0] = pack_pair<T>(acc[2 * kb][0], acc[2 * kb][1]);
    a[1] = pack_pair<T>(acc[2 * kb][2], acc[2 * kb][3]);
    a[2] = pack_pair<T>(acc[2 * kb + 1][0], acc[2 * kb + 1][1]);
    a[3] = pack_pair<T>(acc[2 * kb + 1][2], acc[2 * kb + 1][3]);
}

// Shared memory of the tensor-core backward kernels, in 16-bit elements: row-major tiles
// of 64 rows (ld = dims + pad) and transposed tiles of dims rows (ld = 64 + pad). Head
// dims round up to 16 (they are the k dimension of some product).
struct TensorCoreBackwardLayout {
    int head_dim, value_dim, ld_d, ld_dv, ld_t;
    int rows_d, rows_dv, transposed_d, transposed_dv;
    __device__ TensorCoreBackwardLayout(int head_dim_, int value_dim_) {
        head_dim = (head_dim_ + 15) / 16 * 16;
        value_dim = (value_dim_ + 15) / 16 * 16;
        ld_d = head_dim + NPATTN_TC_PAD;
        ld_dv = value_dim + NPATTN_TC_PAD;
        ld_t = NPATTN_TC_BK + NPATTN_TC_PAD;
        rows_d = NPATTN_TC_BQ * ld_d;      // a 64-row tile of D columns
        rows_dv = NPATTN_TC_BQ * ld_dv;    // a 64-row tile of Dv columns
        transposed_d = head_dim * ld_t;    // D rows of 64
        transposed_dv = value_dim * ld_t;  // Dv rows of 64
    }
};

template <typename T>
__device__ inline void load_rows(const T* x, i64 offset, i64 row_stride, int rows, int width, int padded,
                                 unsigned short* tile, int ld) {
    load_bits(x, offset, row_stride, rows, width, NPATTN_TC_BQ, padded, tile, ld, false);
}

template <typename T>
__device__ inline void load_transposed(const T* x, i64 offset, i64 row_stride, int rows, int width, int padded,
                                       unsigned short* tile, int ld) {
    load_bits(x, offset, row_stride, rows, width, NPATTN_TC_BQ, padded, tile, ld, true);
}

// dout (float: the driver's compute-dtype copy) as 16-bit values, like load_bits.
template <typename T>
__device__ inline void load_rows_from_float(const float* x, i64 offset, i64 row_stride, int rows, int width,
                                            int padded, unsigned short* tile, int ld, bool transpose) {
    for (int index = threadIdx.x; index < NPATTN_TC_BQ * padded; index += blockDim.x) {
        const int r = index / padded, c = index % padded;
        const float value = (r < rows && c < width) ? x[offset + r * row_stride + c] : 0.0f;
        tile[transpose ? c * ld + r : r * ld + c] = (unsigned short)(pack_pair<T>(value, 0.0f) & 0xFFFFu);
    }
}

// dk and dv (float, C-contiguous (B, Hkv, Sk, D) / (.., Dv)) of 64 keys; warp w owns keys
// 16 w .. 16 w + 15. Products per live (head, query tile): S^T = K Q^T, dP^T = V dO^T,
// dV += P~^T dO, dK += dS^T Q.
template <typename T, typename Acc, int MAX_D>
__global__ void __launch_bounds__(NPATTN_TC_WARPS * 32)
dkdv_tc_kernel(NPATTN_OPERAND_PARAMS, const Acc* dout, const i64* dout_strides, const Acc* lse, const Acc* delta,
               Acc* dk, Acc* dv) {
    static_assert(sizeof(Acc) == 4, "tensor-core tiles accumulate in float32");
    constexpr int QUERY_BLOCKS = NPATTN_TC_BQ / 8, D_BLOCKS = MAX_D / 8;  // 8-column blocks
    const Operands<T, Acc> in = NPATTN_OPERANDS;
    const i64 kv_heads = ints[NPATTN_INT_KV_HEADS], kv_len = ints[NPATTN_INT_KV_LEN];
    const i64 key_tiles = (kv_len + NPATTN_TC_BK - 1) / NPATTN_TC_BK;
    const i64 b = blockIdx.x / (kv_heads * key_tiles), kv_head = (blockIdx.x / key_tiles) % kv_heads;
    const i64 j0 = (blockIdx.x % key_tiles) * NPATTN_TC_BK;
    const int cols = (int)smaller(NPATTN_TC_BK, smaller(kv_len, kv_lengths[b]) - j0);
    if (cols <= 0) return;  // keys past kv_lengths keep their zero gradients
    const int head_dim = (int)ints[NPATTN_INT_HEAD_DIM], value_dim = (int)ints[NPATTN_INT_VALUE_DIM];
    const i64 heads = ints[NPATTN_INT_HEADS], q_len = ints[NPATTN_INT_Q_LEN];
    NPATTN_DYNAMIC_SHARED(shared_bytes);
    unsigned short* shared = reinterpret_cast<unsigned short*>(shared_bytes);
    const TensorCoreBackwardLayout at(head_dim, value_dim);
    unsigned short* ks = shared;                    // K, keys x D
    unsigned short* vs = ks + at.rows_d;            // V, keys x Dv
    unsigned short* qs = vs + at.rows_dv;           // Q, queries x D
    unsigned short* qts = qs + at.rows_d;           // Q^T, D x queries
    unsigned short* os = qts + at.transposed_d;     // dO, queries x Dv
    unsigned short* ots = os + at.rows_dv;          // dO^T, Dv x queries
    float* row_lse = reinterpret_cast<float*>(ots + at.transposed_dv);
    float* row_delta = row_lse + NPATTN_TC_BQ;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, group = lane / 4, member = lane % 4;
    const int key0 = warp * 16 + group, key1 = key0 + 8;  // this lane's two keys in the tile
    const float lowest = negative_infinity<float>();

    load_rows(k, k_row(ints, b, kv_head, j0),
              ints[NPATTN_INT_K_STRIDE_S], cols, head_dim, at.head_dim, ks, at.ld_d);
    load_rows(v, v_row(ints, b, kv_head, j0),
              ints[NPATTN_INT_V_STRIDE_S], cols, value_dim, at.value_dim, vs, at.ld_dv);
    float dk_acc[D_BLOCKS][4], dv_acc[D_BLOCKS][4];
#pragma unroll
    for (int n = 0; n < D_BLOCKS; ++n) {
        for (int e = 0; e < 4; ++e) dk_acc[n][e] = dv_acc[n][e] = 0.0f;
    }
    const i64 group_size = heads / kv_heads;
    for (i64 h = kv_head * group_size; h < (kv_head + 1) * group_size; ++h) {
        for (i64 i0 = 0; i0 < q_len; i0 += NPATTN_TC_BQ) {
            const int rows = (int)(smaller(smaller(q_len, i0 + NPATTN_TC_BQ), q_lengths[b]) - i0);
            if (rows <= 0) break;
            if (!tile_is_live(ints, kv_lengths, b, i0, i0 + rows, j0, j0 + cols)) continue;
            __syncthreads();  // every warp is done with the previous query tile
            const i64 q_offset = q_row(ints, b, h, i0);
            const i64 o_offset = b * dout_strides[0] + h * dout_strides[1] + i0 * dout_strides[2];
            load_rows(q, q_offset, ints[NPATTN_INT_Q_STRIDE_S], rows, head_dim, at.head_dim, qs, at.ld_d);
            load_transposed(q, q_offset, ints[NPATTN_INT_Q_STRIDE_S], rows, head_dim, at.head_dim, qts, at.ld_t);
            load_rows_from_float<T>(dout, o_offset, dout_strides[2], rows, value_dim, at.value_dim, os, at.ld_dv,
                                    false);
            load_rows_from_float<T>(dout, o_offset, dout_strides[2], rows, value_dim, at.value_dim, ots, at.ld_t, true);
            const i64 row_offset = (b * heads + h) * q_len + i0;
            for (int r = threadIdx.x; r < NPATTN_TC_BQ; r += blockDim.x) {
                row_lse[r] = r < rows ? (float)lse[row_offset + r] : lowest;
                row_delta[r] = r < rows ? (float)delta[row_offset + r] : 0.0f;
            }
            __syncthreads();

            // S^T (16 keys x 64 queries) = K Q^T and dP^T = V dO^T
            float s[QUERY_BLOCKS][4], dp[QUERY_BLOCKS][4];
            warp_product<T>(s, ks, at.ld_d, warp * 16 + group, qs, at.ld_d, at.head_dim, group, member);
            warp_product<T>(dp, vs, at.ld_dv, warp * 16 + group, os, at.ld_dv, at.value_dim, group, member);
            // P~^T into s, dS^T into dp
#pragma unroll
            for (int n = 0; n < QUERY_BLOCKS; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = e < 2 ? key0 : key1, r = n * 8 + 2 * member + (e & 1);
                    const bool valid = r < rows && key < cols;
                    float t;
                    const float p = recomputed_probability(in, b, h, i0 + r, j0 + key, valid, s[n][e], row_lse[r], &t);
                    dp[n][e] = score_gradient(ints, in.reals, b, h, i0 + r, j0 + key, valid, p, dp[n][e], row_delta[r],
                                              t, true, &s[n][e]);
                }
            }
            // dV += P~^T dO, dK += dS^T Q (k = the 64 queries)
#pragma unroll
            for (int kb = 0; kb < NPATTN_TC_BQ / 16; ++kb) {
                u32 p_frag[4], ds_frag[4];
                a_from_accumulators<T>(s, kb, p_frag);
                a_from_accumulators<T>(dp, kb, ds_frag);
#pragma unroll
                for (int n = 0; n < D_BLOCKS; ++n) {
                    u32 bb[2];
                    if (n * 8 < at.value_dim) {
                        b_fragment(ots, at.ld_t, n * 8 + group, kb * 16, member, bb);
                        mma_16816<T>(dv_acc[n], p_frag, bb);
                    }
                    if (n * 8 < at.head_dim) {
                        b_fragment(qts, at.ld_t, n * 8 + group, kb * 16, member, bb);
                        mma_16816<T>(dk_acc[n], ds_frag, bb);
                    }
                }
            }
        }
    }
    const float scale = (float)in.reals[NPATTN_REAL_SCALE];
    for (int x = 0; x < 2; ++x) {
        const int key = x ? key1 : key0;
        if (key >= cols) continue;
        const i64 at_key = (b * kv_heads + kv_head) * kv_len + j0 + key;
#pragma unroll
        for (int n = 0; n < D_BLOCKS; ++n) {
            for (int e = 0; e < 2; ++e) {
                const int d = n * 8 + 2 * member + e;
                if (d < head_dim) dk[at_key * head_dim + d] = scale * dk_acc[n][2 * x + e];
                if (d < value_dim) dv[at_key * value_dim + d] = dv_acc[n][2 * x + e];
            }
        }
    }
}

// dq (float, C-contiguous (B, H, Sq, D)) of 64 query rows; warp w owns rows 16 w ..
// 16 w + 15. Products per live key tile: S = Q K^T, dP = dO V^T, dQ += dS K.
template <typename T, typename Acc, int MAX_D>
__global__ void __launch_bounds__(NPATTN_TC_WARPS * 32)
dq_tc_kernel(NPATTN_OPERAND_PARAMS, const Acc* dout, const i64* dout_strides, const Acc* lse, const Acc* delta,
             Acc* dq) {
    static_assert(sizeof(Acc) == 4, "tensor-core tiles accumulate in float32");
    constexpr int KEY_BLOCKS = NPATTN_TC_BK / 8, D_BLOCKS = MAX_D / 8;
    const Operands<T, Acc> in = NPATTN_OPERANDS;
    const i64 heads = ints[NPATTN_INT_HEADS], q_len = ints[NPATTN_INT_Q_LEN];
    const i64 q_tiles = (q_len + NPATTN_TC_BQ - 1) / NPATTN_TC_BQ;
    const i64 b = blockIdx.x / (heads * q_tiles), h = (blockIdx.x / q_tiles) % heads;
    const i64 i0 = (blockIdx.x % q_tiles) * NPATTN_TC_BQ;
    const int rows = (int)(smaller(smaller(q_len, i0 + NPATTN_TC_BQ), q_lengths[b]) - i0);
    if (rows <= 0) return;  // padding rows keep dq's zeros
    const int head_dim = (int)ints[NPATTN_INT_HEAD_DIM], value_dim = (int)ints[NPATTN_INT_VALUE_DIM];
    NPATTN_DYNAMIC_SHARED(shared_bytes);
    unsigned short* shared = reinterpret_cast<unsigned short*>(shared_bytes);
    const TensorCoreBackwardLayout at(head_dim, value_dim);
    unsigned short* qs = shared;                // Q, queries x D
    unsigned short* os = qs + at.rows_d;        // dO, queries x Dv
    unsigned short* ks = os + at.rows_dv;       // K, keys x D
    unsigned short* vs = ks + at.rows_d;        // V, keys x Dv
    unsigned short* kts = vs + at.rows_dv;      // K^T, D x keys
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, group = lane / 4, member = lane % 4;
    const int row0 = warp * 16 + group, row1 = row0 + 8;
    const float lowest = negative_infinity<float>();
    const i64 row_offset = (b * heads + h) * q_len + i0;
    float my_lse[2], my_delta[2];
    for (int x = 0; x < 2; ++x) {
        const int r = x ? row1 : row0;
        my_lse[x] = r < rows ? (float)lse[row_offset + r] : lowest;
        my_delta[x] = r < rows ? (float)delta[row_offset + r] : 0.0f;
    }
    const i64 q_offset = q_row(ints, b, h, i0);
    load_rows(q, q_offset, ints[NPATTN_INT_Q_STRIDE_S], rows, head_dim, at.head_dim, qs, at.ld_d);
    load_rows_from_float<T>(dout, b * dout_strides[0] + h * dout_strides[1] + i0 * dout_strides[2], dout_strides[2],
                            rows, value_dim, at.value_dim, os, at.ld_dv, false);
    float dq_acc[D_BLOCKS][4];
#pragma unroll
    for (int n = 0; n < D_BLOCKS; ++n) dq_acc[n][0] = dq_acc[n][1] = dq_acc[n][2] = dq_acc[n][3] = 0.0f;
    const i64 kv_head = h / (heads / ints[NPATTN_INT_KV_HEADS]);
    const KeyRanges keys = key_ranges(ints, kv_lengths, b, i0, i0 + rows, NPATTN_TC_BK, 0, 1);
    for (int segment = 0; segment < 2; ++segment) {
        for (i64 j0 = keys.first[segment]; j0 < keys.last[segment]; j0 += NPATTN_TC_BK) {
            const int cols = (int)smaller(NPATTN_TC_BK, keys.last[segment] - j0);
            __syncthreads();  // every warp is done with the previous key tile (and Q, dO are loaded)
            const i64 k_offset = k_row(ints, b, kv_head, j0);
            load_rows(k, k_offset, ints[NPATTN_INT_K_STRIDE_S], cols, head_dim, at.head_dim, ks, at.ld_d);
            load_transposed(k, k_offset, ints[NPATTN_INT_K_STRIDE_S], cols, head_dim, at.head_dim, kts, at.ld_t);
            load_rows(v, v_row(ints, b, kv_head, j0), ints[NPATTN_INT_V_STRIDE_S], cols, value_dim,
                      at.value_dim, vs, at.ld_dv);
            __syncthreads();

            // S (16 rows x 64 keys) = Q K^T and dP = dO V^T
            float s[KEY_BLOCKS][4], dp[KEY_BLOCKS][4];
            warp_product<T>(s, qs, at.ld_d, warp * 16 + group, ks, at.ld_d, at.head_dim, group, member);
            warp_product<T>(dp, os, at.ld_dv, warp * 16 + group, vs, at.ld_dv, at.value_dim, group, member);
            // dS into dp
#pragma unroll
            for (int n = 0; n < KEY_BLOCKS; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int x = e / 2, r = x ? row1 : row0, c = n * 8 + 2 * member + (e & 1);
                    const bool valid = r < rows && c < cols;
                    float t, dropped;
                    const float p = recomputed_probability(in, b, h, i0 + r, j0 + c, valid, s[n][e], my_lse[x], &t);
                    dp[n][e] = score_gradient(ints, in.reals, b, h, i0 + r, j0 + c, valid, p, dp[n][e], my_delta[x], t,
                                              true, &dropped);
                }
            }
            // dQ += dS K (k = the 64 keys)
#pragma unroll
            for (int kb = 0; kb < NPATTN_TC_BK / 16; ++kb) {
                u32 ds_frag[4];
                a_from_accumulators<T>(dp, kb, ds_frag);
#pragma unroll
                for (int n = 0; n < D_BLOCKS; ++n) {
                    if (n * 8 < at.head_dim) {
                        u32 bb[2];
                        b_fragment(kts, at.ld_t, n * 8 + group, kb * 16, member, bb);
                        mma_16816<T>(dq_acc[n], ds_frag, bb);
                    }
                }
            }
        }
    }
    const float scale = (float)in.reals[NPATTN_REAL_SCALE];
    for (int x = 0; x < 2; ++x) {
        const int r = x ? row1 : row0;
        if (r >= rows) continue;
        const i64 row = row_offset + r;
#pragma unroll
        for (int n = 0; n < D_BLOCKS; ++n) {
            for (int e = 0; e < 2; ++e) {
                const int d = n * 8 + 2 * member + e;
                if (d < head_dim) dq[row * head_dim + d] = scale * dq_acc[n][2 * x + e];
            }
        }
    }
}
