// The tiled backward (FlashAttention-2), deterministic: every output element has one
// owning block, which sums its terms in a fixed order, so there are no atomics and the
// bits are the same on every run.
//
// Probabilities are recomputed tile by tile from the forward's lse (gradient_tile):
// P = exp(s - lse), dP = dO V^T (times the dropout keep mask and 1/(1-p)),
// dS = P * (dP - delta) with delta = rowsum(dO * O). Then
//   dkdv_kernel:  one block per (batch, kv head, BK keys): dV += P~^T dO and
//                 dK += scale dS^T Q over every query head of the group and every
//                 query tile that sees the keys;
//   dq_kernel:    one block per (batch, head, BQ rows): dQ += scale dS K;
//   dbias_kernel: one block per tile of dbias: dS summed over the axes the bias was
//                 broadcast along.
#include "common.cuh"

#define NPATTN_THREADS 128
#define NPATTN_BQ 16
#define NPATTN_BK 16

// Shared-memory layout of the backward kernels, in Acc elements: the query, dout, key
// and value tiles, the three score-shaped tiles and the rows' lse and delta.
struct BackwardLayout {
    int ld_q, ld_o, ld_k, ld_v, ld_s;
    int q, o, k, v, p, ds, tanh, lse, delta, total;
    __device__ BackwardLayout(int head_dim, int value_dim) {
        ld_q = head_dim;
        ld_o = value_dim;
        ld_k = head_dim + 1;  // +1: lanes reading a column hit distinct banks
        ld_v = value_dim + 1;
        ld_s = NPATTN_BK + 1;
        q = 0;
        o = q + NPATTN_BQ * ld_q;
        k = o + NPATTN_BQ * ld_o;
        v = k + NPATTN_BK * ld_k;
        p = v + NPATTN_BK * ld_v;
        ds = p + NPATTN_BQ * ld_s;
        tanh = ds + NPATTN_BQ * ld_s;
        lse = tanh + NPATTN_BQ * ld_s;
        delta = lse + NPATTN_BQ;
        total = delta + NPATTN_BQ;
    }
};

template <typename Acc> struct BackwardTiles {
    BackwardLayout at;
    Acc *q, *o, *k, *v, *p, *ds, *tanh, *lse, *delta;
    __device__ BackwardTiles(Acc* shared, int head_dim, int value_dim) : at(head_dim, value_dim) {
        q = shared + at.q; o = shared + at.o; k = shared + at.k; v = shared + at.v;
        p = shared + at.p; ds = shared + at.ds; tanh = shared + at.tanh;
        lse = shared + at.lse; delta = shared + at.delta;
    }
};

// Query rows [i0, i0 + rows) of head h: q and dout tiles, lse and delta (then a barrier).
template <typename T, typename Acc>
__device__ inline void load_query_side(const Operands<T, Acc>& in, const Acc* dout, const i64* dout_strides,
                                       const Acc* lse, const Acc* delta, BackwardTiles<Acc>& t, i64 b, i64 h,
                                       i64 i0, int rows) {
    const i64* ints = in.ints;
    const int head_dim = (int)ints[NPATTN_INT_HEAD_DIM], value_dim = (int)ints[NPATTN_INT_VALUE_DIM];
    load_tile(in.q, q_row(ints, b, h, i0),
              ints[NPATTN_INT_Q_STRIDE_S], rows, head_dim, NPATTN_BQ, head_dim, t.q, t.at.ld_q);
    load_tile(dout, b * dout_strides[0] + h * dout_strides[1] + i0 * dout_strides[2], dout_strides[2], rows,
              value_dim, NPATTN_BQ, value_dim, t.o, t.at.ld_o);
    const i64 row_offset = (b * ints[NPATTN_INT_HEADS] + h) * ints[NPATTN_INT_Q_LEN] + i0;
    if (threadIdx.x < NPATTN_BQ) {
        const bool real = (int)threadIdx.x < rows;
        t.lse[threadIdx.x] = real ? lse[row_offset + threadIdx.x] : negative_infinity<Acc>();
        t.delta[threadIdx.x] = real ? delta[row_offset + threadIdx.x] : (Acc)0;
    }
    __syncthreads();
}

// Keys [j0, j0 + cols) of kv head kv_head: key and value tiles (then a barrier).
template <typename T, typename Acc>
__device__ inline void load_key_side(const Operands<T, Acc>& in, BackwardTiles<Acc>& t, i64 b, i64 kv_head, i64 j0,
                                     int cols) {
    const i64* ints = in.ints;
    const int head_dim = (int)ints[NPATTN_INT_HEAD_DIM], value_dim = (int)ints[NPATTN_INT_VALUE_DIM];
    load_tile(in.k, k_row(ints, b, kv_head, j0),
              ints[NPATTN_INT_K_STRIDE_S], cols, head_dim, NPATTN_BK, head_dim, t.k, t.at.ld_k);
    load_tile(in.v, v_row(ints, b, kv_head, j0),
              ints[NPATTN_INT_V_STRIDE_S], cols, value_dim, NPATTN_BK, value_dim, t.v, t.at.ld_v);
    __syncthreads();
}

// With the four tiles loaded: t.p = probabilities after dropout (P~, what dV needs) and
// t.ds = the gradient of the final scores, after every score option (what dbias needs),
// or, with `to_raw_scores`, of the scaled scores before them (what dK and dQ need, before
// the scale; score_gradient applies the options' derivatives). Zero outside the tile. Ends with a barrier.
template <typename T, typename Acc>
__device__ inline void gradient_tile(const Operands<T, Acc>& in, BackwardTiles<Acc>& t, i64 b, i64 h, i64 i0,
                                     int rows, i64 j0, int cols, bool to_raw_scores,
                                     const DominantKey<T, Acc, Acc>& dominant) {
    const i64* ints = in.ints;
    const int value_dim = (int)ints[NPATTN_INT_VALUE_DIM];
    score_tile<T, Acc, NPATTN_BQ, NPATTN_BK>(in, t.q, t.at.ld_q, t.k, t.at.ld_k, t.p, t.at.ld_s, t.tanh, b, h, i0,
                                             rows, j0, cols);
    for (int index = threadIdx.x; index < NPATTN_BQ * NPATTN_BK; index += blockDim.x) {
        const int r = index / NPATTN_BK, c = index % NPATTN_BK;
        const int at = r * t.at.ld_s + c;  // read and rewritten by this thread only
        const Acc row_lse = t.lse[r];
        // an empty row (lse -inf) has no probability and passes no gradient
        const Acc probability = row_lse > negative_infinity<Acc>() ? exp_of(t.p[at] - row_lse) : (Acc)0;
        Acc dp = 0;
        for (int d = 0; d < value_dim; ++d) dp += t.o[r * t.at.ld_o + d] * t.v[c * t.at.ld_v + d];
        t.ds[at] = score_gradient(ints, in.reals, b, h, i0 + r, j0 + c, r < rows && c < cols, probability, dp,
                                  t.delta[r], t.tanh[at], to_raw_scores, &t.p[at], dominant);
    }
    __syncthreads();
}

// The rows of [i0, i0 + BQ) before the entry's Q_STOP (rows before Q_START among them
// see no key: key_band).
__device__ inline int query_rows(const i64* ints, const i64* spans, i64 b, i64 i0) {
    return (int)(smaller(smaller(ints[NPATTN_INT_Q_LEN], i0 + NPATTN_BQ), span(spans, b, NPATTN_SPAN_Q_STOP)) - i0);
}

// dk (Acc, C-contiguous (B, Hkv, Sk, D)) and dv (likewise with Dv) of one tile of BK keys.
// Each thread owns key row threadIdx.x / 8 and every 8th column.
template <typename T, typename Acc, int MAX_D>
__global__ void __launch_bounds__(NPATTN_THREADS)
dkdv_kernel(NPATTN_OPERAND_PARAMS, const Acc* dout, const i64* dout_strides, const Acc* lse, const Acc* delta,
            const T* out, Acc* dk, Acc* dv) {
    const Operands<T, Acc> in = NPATTN_OPERANDS;
    const DominantKey<T, Acc, Acc> dominant = {v, dout, dout_strides, out, ints, nullptr};
    const i64 kv_heads = ints[NPATTN_INT_KV_HEADS], kv_len = ints[NPATTN_INT_KV_LEN];
    const i64 key_tiles = (kv_len + NPATTN_BK - 1) / NPATTN_BK;
    const i64 b = blockIdx.x / (kv_heads * key_tiles);
    const i64 kv_head = (blockIdx.x / key_tiles) % kv_heads;
    const i64 j0 = (blockIdx.x % key_tiles) * NPATTN_BK;
    const int cols = (int)smaller(NPATTN_BK, smaller(kv_len, span(spans, b, NPATTN_SPAN_KV_STOP)) - j0);
    const int head_dim = (int)ints[NPATTN_INT_HEAD_DIM], value_dim = (int)ints[NPATTN_INT_VALUE_DIM];
    const int my_key = threadIdx.x / 8, my_column = threadIdx.x % 8;
    Acc dk_acc[MAX_D / 8], dv_acc[MAX_D / 8];
#pragma unroll
    for (int x = 0; x < MAX_D / 8; ++x) dk_acc[x] = dv_acc[x] = 0;
    if (cols > 0) {  // the same for the whole block
        NPATTN_DYNAMIC_SHARED(shared_bytes);
        BackwardTiles<Acc> t(reinterpret_cast<Acc*>(shared_bytes), head_dim, value_dim);
        const Acc scale = in.reals[NPATTN_REAL_SCALE];
        const i64 group = ints[NPATTN_INT_HEADS] / kv_heads;
        load_key_side(in, t, b, kv_head, j0, cols);
        for (i64 h = kv_head * group; h < (kv_head + 1) * group; ++h) {
            for (i64 i0 = 0; i0 < ints[NPATTN_INT_Q_LEN]; i0 += NPATTN_BQ) {
                const int rows = query_rows(ints, spans, b, i0);
                if (rows <= 0) break;
                if (!tile_is_live(ints, spans, b, i0, i0 + rows, j0, j0 + cols)) continue;
                load_query_side(in, dout, dout_strides, lse, delta, t, b, h, i0, rows);
                gradient_tile(in, t, b, h, i0, rows, j0, cols, true, dominant);
                for (int r = 0; r < rows; ++r) {
                    const Acc p = t.p[r * t.at.ld_s + my_key], ds = t.ds[r * t.at.ld_s + my_key];
#pragma unroll
                    for (int x = 0; x < MAX_D / 8; ++x) {
                        const int d = my_column + 8 * x;
                        if (d < value_dim) dv_acc[x] += p * t.o[r * t.at.ld_o + d];
                        if (d < head_dim) dk_acc[x] += ds * t.q[r * t.at.ld_q + d];
                    }
                }
                __syncthreads();  // the next query tile overwrites q, o, p and ds
            }
        }
#pragma unroll
        for (int x = 0; x < MAX_D / 8; ++x) dk_acc[x] *= scale;
    }
    if (my_key < cols) {
        const i64 key = (b * kv_heads + kv_head) * kv_len + j0 + my_key;
#pragma unroll
        for (int x = 0; x < MAX_D / 8; ++x) {
            const int d = my_column + 8 * x;
            if (d < head_dim) dk[key * head_dim + d] = dk_acc[x];
            if (d < value_dim) dv[key * value_dim + d] = dv_acc[x];
        }
    }
}

// dq (Acc, C-contiguous (B, H, Sq, D)) of one tile of BQ rows. Each thread owns row
// threadIdx.x / 8 and every 8th column.
template <typename T, typename Acc, int MAX_D>
__global__ void __launch_bounds__(NPATTN_THREADS)
dq_kernel(NPATTN_OPERAND_PARAMS, const Acc* dout, const i64* dout_strides, const Acc* lse, const Acc* delta,
          const T* out, Acc* dq) {
    const Operands<T, Acc> in = NPATTN_OPERANDS;
    const DominantKey<T, Acc, Acc> dominant = {v, dout, dout_strides, out, ints, nullptr};
    const i64 heads = ints[NPATTN_INT_HEADS], q_len = ints[NPATTN_INT_Q_LEN];
    const i64 tiles = (q_len + NPATTN_BQ - 1) / NPATTN_BQ;
    const i64 b = blockIdx.x / (heads * tiles), h = (blockIdx.x / tiles) % heads;
    const i64 i0 = (blockIdx.x % tiles) * NPATTN_BQ;
    const int rows = query_rows(ints, spans, b, i0);
    if (rows <= 0) return;  // padding rows keep dq's zeros
    const int head_dim = (int)ints[NPATTN_INT_HEAD_DIM], value_dim = (int)ints[NPATTN_INT_VALUE_DIM];
    NPATTN_DYNAMIC_SHARED(shared_bytes);
    BackwardTiles<Acc> t(reinterpret_cast<Acc*>(shared_bytes), head_dim, value_dim);
    const int my_row = threadIdx.x / 8, my_column = threadIdx.x % 8;
    Acc acc[MAX_D / 8];
#pragma unroll
    for (int x = 0; x < MAX_D / 8; ++x) acc[x] = 0;
    const i64 kv_head = h / (heads / ints[NPATTN_INT_KV_HEADS]);
    load_query_side(in, dout, dout_strides, lse, delta, t, b, h, i0, rows);
    const KeyRanges keys = key_ranges(ints, spans, b, i0, i0 + rows, NPATTN_BK, 0, 1);
    for (int segment = 0; segment < 2; ++segment) {
        for (i64 j0 = keys.first[segment]; j0 < keys.last[segment]; j0 += NPATTN_BK) {
            const int cols = (int)smaller(NPATTN_BK, keys.last[segment] - j0);
            load_key_side(in, t, b, kv_head, j0, cols);
            gradient_tile(in, t, b, h, i0, rows, j0, cols, true, dominant);
            for (int c = 0; c < cols; ++c) {
                const Acc ds = t.ds[my_row * t.at.ld_s + c];
#pragma unroll
                for (int x = 0; x < MAX_D / 8; ++x) {
                    const int d = my_column + 8 * x;
                    if (d < head_dim) acc[x] += ds * t.k[c * t.at.ld_k + d];
                }
            }
            __syncthreads();  // the next key tile overwrites k, v, p and ds
        }
    }
    if (my_row < rows) {
        const Acc scale = in.reals[NPATTN_REAL_SCALE];
        const i64 row = (b * heads + h) * q_len + i0 + my_row;
#pragma unroll
        for (int x = 0; x < MAX_D / 8; ++x) {
            const int d = my_column + 8 * x;
            if (d < head_dim) dq[row * head_dim + d] = scale * acc[x];
        }
    }
}

// dbias (Acc, C-contiguous with shape `shape`, each axis 1 or full) for one block's tile
// of it: dS summed, in a fixed order, over every axis the bias was broadcast along.
// A block covers BQ rows of dbias (or, when the query axis is broadcast, all rows
// summed) by BK columns (or all keys summed).
template <typename T, typename Acc>
__global__ void __launch_bounds__(NPATTN_THREADS)
dbias_kernel(NPATTN_OPERAND_PARAMS, const Acc* dout, const i64* dout_strides, const Acc* lse, const Acc* delta,
             const T* out, Acc* dbias, const i64* shape) {
    const Operands<T, Acc> in = NPATTN_OPERANDS;
    const DominantKey<T, Acc, Acc> dominant = {v, dout, dout_strides, out, ints, nullptr};
    const i64 batch = ints[NPATTN_INT_BATCH], heads = ints[NPATTN_INT_HEADS];
    const i64 q_len = ints[NPATTN_INT_Q_LEN], kv_len = ints[NPATTN_INT_KV_LEN];
    const i64 q_tiles = shape[2] > 1 ? (q_len + NPATTN_BQ - 1) / NPATTN_BQ : 1;
    const i64 k_tiles = shape[3] > 1 ? (kv_len + NPATTN_BK - 1) / NPATTN_BK : 1;
    i64 item = blockIdx.x;
    const i64 k_tile = item % k_tiles; item /= k_tiles;
    const i64 q_tile = item % q_tiles; item /= q_tiles;
    const i64 h_out = item % shape[1], b_out = item / shape[1];
    const int head_dim = (int)ints[NPATTN_INT_HEAD_DIM], value_dim = (int)ints[NPATTN_INT_VALUE_DIM];
    NPATTN_DYNAMIC_SHARED(shared_bytes);
    BackwardTiles<Acc> t(reinterpret_cast<Acc*>(shared_bytes), head_dim, value_dim);
    constexpr int PER_THREAD = NPATTN_BQ * NPATTN_BK / NPATTN_THREADS;
    Acc acc[PER_THREAD];
#pragma unroll
    for (int x = 0; x < PER_THREAD; ++x) acc[x] = 0;

    for (i64 b = shape[0] > 1 ? b_out : 0; b < (shape[0] > 1 ? b_out + 1 : batch); ++b) {
        for (i64 h = shape[1] > 1 ? h_out : 0; h < (shape[1] > 1 ? h_out + 1 : heads); ++h) {
            const i64 kv_head = h / (heads / ints[NPATTN_INT_KV_HEADS]);
            const i64 i_first = shape[2] > 1 ? q_tile * NPATTN_BQ : 0;
            const i64 i_last = shape[2] > 1 ? i_first + NPATTN_BQ : q_len;
            for (i64 i0 = i_first; i0 < i_last; i0 += NPATTN_BQ) {
                const int rows = query_rows(ints, spans, b, i0);
                if (rows <= 0) break;
                bool loaded = false;
                const i64 j_first = shape[3] > 1 ? k_tile * NPATTN_BK : 0;
                const i64 j_last = shape[3] > 1 ? smaller(kv_len, j_first + NPATTN_BK) : kv_len;
                for (i64 j0 = j_first; j0 < j_last; j0 += NPATTN_BK) {
                    const int cols = (int)smaller(NPATTN_BK, j_last - j0);
                    if (!tile_is_live(ints, spans, b, i0, i0 + rows, j0, j0 + cols)) continue;
                    if (!loaded) {
                        load_query_side(in, dout, dout_strides, lse, delta, t, b, h, i0, rows);
                        loaded = true;
                    }
                    load_key_side(in, t, b, kv_head, j0, cols);
                    gradient_tile(in, t, b, h, i0, rows, j0, cols, false, dominant);
#pragma unroll
                    for (int x = 0; x < PER_THREAD; ++x) {
                        const int index = threadIdx.x + x * NPATTN_THREADS;
                        acc[x] += t.ds[(index / NPATTN_BK) * t.at.ld_s + index % NPATTN_BK];
                    }
                    __syncthreads();  // the next tile overwrites the shared tiles
                }
            }
        }
    }
    // reduce the broadcast rows / columns of the tile in a fixed order, then write
#pragma unroll
    for (int x = 0; x < PER_THREAD; ++x) {
        const int index = threadIdx.x + x * NPATTN_THREADS;
        t.ds[(index / NPATTN_BK) * t.at.ld_s + index % NPATTN_BK] = acc[x];
    }
    __syncthreads();
    const int out_rows = shape[2] > 1 ? (int)smaller(NPATTN_BQ, q_len - q_tile * NPATTN_BQ) : 1;
    const int out_cols = shape[3] > 1 ? (int)smaller(NPATTN_BK, kv_len - k_tile * NPATTN_BK) : 1;
    for (int index = threadIdx.x; index < out_rows * out_cols; index += blockDim.x) {
        const int r = index / out_cols, c = index % out_cols;
        Acc total = 0;
        for (int rr = shape[2] > 1 ? r : 0; rr < (shape[2] > 1 ? r + 1 : NPATTN_BQ); ++rr) {
            for (int cc = shape[3] > 1 ? c : 0; cc < (shape[3] > 1 ? c + 1 : NPATTN_BK); ++cc) {
                total += t.ds[rr * t.at.ld_s + cc];
            }
        }
        const i64 i = shape[2] > 1 ? q_tile * NPATTN_BQ + r : 0;
        const i64 j = shape[3] > 1 ? k_tile * NPATTN_BK + c : 0;
        dbias[((b_out * shape[1] + h_out) * shape[2] + i) * shape[3] + j] = total;
    }
}
