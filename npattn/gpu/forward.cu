// The tiled forward (FlashAttention-2 order, SIMT with Acc accumulation): out and lse
// with an online softmax, and the exact attention weights recomputed from lse.
//
// One block of THREADS threads per (batch, head, tile of BQ query rows); it visits the
// key tiles that masking leaves alive (key_segments), BK keys at a time. It also reads
// quantized caches (load_key_tile dequantizes their tiles), for every input dtype. Shared memory
// (dynamic, sized by npattn/gpu/launch.py from the actual head dims): the query tile,
// one key and one value tile, the score tile and per-row softmax state. No Sq x Sk
// array exists anywhere.
#include "common.cuh"

#define NPATTN_THREADS 128
#define NPATTN_BQ 16

// Shared-memory layout of forward_kernel and weights_kernel, in Acc elements.
struct ForwardLayout {
    int ld_q, ld_k, ld_v, ld_s;
    int q, k, v, s, m, l, correction, seen, total;
    __device__ ForwardLayout(int head_dim, int value_dim, int block_k) {
        ld_q = head_dim;
        ld_k = head_dim + 1;  // +1: lanes reading a column of K hit distinct banks
        ld_v = value_dim;
        ld_s = block_k + 1;
        q = 0;
        k = q + NPATTN_BQ * ld_q;
        v = k + block_k * ld_k;
        s = v + block_k * ld_v;
        m = s + NPATTN_BQ * ld_s;
        l = m + NPATTN_BQ;
        correction = l + NPATTN_BQ;
        seen = correction + NPATTN_BQ;
        total = seen + NPATTN_BQ;
    }
};

struct QueryTile { i64 b, h, i0; int rows; };

// Work item -> (b, h, first row, rows), cut to the entry's live rows (rows <= 0: all padding).
__device__ inline QueryTile query_tile(const i64* ints, const i64* spans, i64 item) {
    const i64 heads = ints[NPATTN_INT_HEADS], q_len = ints[NPATTN_INT_Q_LEN];
    const i64 tiles = (q_len + NPATTN_BQ - 1) / NPATTN_BQ;
    QueryTile tile;
    tile.b = item / (heads * tiles);
    tile.h = (item / tiles) % heads;
    const LiveRows live = live_rows(ints, spans, tile.b, (item % tiles) * NPATTN_BQ, NPATTN_BQ);
    tile.i0 = live.first;
    tile.rows = live.rows;
    return tile;
}

// Fill out (Acc, element strides out_sb/out_sh/out_ss, zero on entry) and lse
// (flat (B, H, Sq), -inf on entry) for one query tile. Rows outside the live ones
// (spans) stay as they are. Each thread owns row threadIdx.x / 8 and every 8th output column.
//
// Split-KV (splits > 1, for short queries against a long cache, where B * H query
// tiles cannot fill the GPU): block x handles query tile x / splits against the keys
// of split x % splits only, and writes its unnormalized rows to `partial` (flat
// (B * H * Sq, splits, Dv + 3): the output row, then the row's max, sum and whether
// it saw a key) for combine_kernel, which also adds the sink logit. With splits == 1
// `partial` is not touched.
template <typename T, typename Acc, int MAX_D, int BK>
__global__ void __launch_bounds__(NPATTN_THREADS)
forward_kernel(NPATTN_OPERAND_PARAMS, Acc* out, i64 out_sb, i64 out_sh, i64 out_ss, Acc* lse, i64 splits,
               Acc* partial) {
    const Operands<T, Acc> in = NPATTN_OPERANDS;
    const i64 split = blockIdx.x % splits;
    const QueryTile tile = query_tile(ints, spans, blockIdx.x / splits);
    if (tile.rows <= 0) return;  // the same for the whole block
    const i64 b = tile.b, h = tile.h, i0 = tile.i0;
    const int rows = tile.rows;
    const int head_dim = (int)ints[NPATTN_INT_HEAD_DIM], value_dim = (int)ints[NPATTN_INT_VALUE_DIM];
    NPATTN_DYNAMIC_SHARED(shared_bytes);
    Acc* shared = reinterpret_cast<Acc*>(shared_bytes);
    const ForwardLayout at(head_dim, value_dim, BK);
    Acc *qs = shared + at.q, *ks = shared + at.k, *vs = shared + at.v, *s = shared + at.s;
    Acc *row_m = shared + at.m, *row_l = shared + at.l, *row_correction = shared + at.correction;
    Acc* row_seen = shared + at.seen;
    const i64 kv_head = kv_head_of(ints, h);
    const bool has_sink = ints[NPATTN_INT_HAS_SINK] != 0 && splits == 1;  // else combine_kernel adds it
    const bool has_dropout = ints[NPATTN_INT_HAS_DROPOUT] != 0;

    load_tile(q, q_row(ints, b, h, i0),
              ints[NPATTN_INT_Q_STRIDE_S], rows, head_dim, NPATTN_BQ, head_dim, qs, at.ld_q);
    if (threadIdx.x < NPATTN_BQ) {
        // the sink logit enters as a first column of value 0
        row_m[threadIdx.x] = has_sink ? sink[h] : negative_infinity<Acc>();
        row_l[threadIdx.x] = has_sink ? (Acc)1 : (Acc)0;
        row_seen[threadIdx.x] = 0;
    }
    const int my_row = threadIdx.x / 8, my_column = threadIdx.x % 8;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    Acc acc[MAX_D / 8];
#pragma unroll
    for (int x = 0; x < MAX_D / 8; ++x) acc[x] = 0;
    __syncthreads();

    const KeyRanges keys = key_ranges(ints, spans, b, i0, i0 + rows, BK, split, splits);
    for (int segment = 0; segment < 2; ++segment) {
        for (i64 j0 = keys.first[segment], next; j0 < keys.last[segment]; j0 = next) {
            const int cols = tile_keys(ints, j0, keys.last[segment], BK);  // within one page
            next = j0 + cols;
            load_key_tile(in, false, b, kv_head, j0, paged_k_row(ints, pages, b, kv_head, j0),
                          ints[NPATTN_INT_K_STRIDE_S], cols, head_dim, BK, head_dim, ks, at.ld_k);
            load_key_tile(in, true, b, kv_head, j0, paged_v_row(ints, pages, b, kv_head, j0),
                          ints[NPATTN_INT_V_STRIDE_S], cols, value_dim, BK, value_dim, vs, at.ld_v);
            __syncthreads();
            score_tile<T, Acc, NPATTN_BQ, BK>(in, qs, at.ld_q, ks, at.ld_k, s, at.ld_s, nullptr, b, h, i0, rows, j0,
                                              cols);
            // online softmax, one warp per row: new max, exp, running sum, correction
            for (int r = warp; r < NPATTN_BQ; r += NPATTN_THREADS / 32) {
                const Acc score = lane < BK ? s[r * at.ld_s + lane] : negative_infinity<Acc>();
                const Acc tile_max = warp_max(score);
                const Acc old_max = row_m[r];
                const Acc new_max = tile_max > old_max ? tile_max : old_max;
                // nothing visible yet: a shift of 0 keeps every exp at 0 (not NaN)
                const bool any = new_max > negative_infinity<Acc>();
                Acc p = exp_of(score - (any ? new_max : (Acc)0));
                const Acc tile_sum = warp_sum(p);
                if (has_dropout && r < rows && lane < cols &&
                    !dropout_keeps(ints, dropout_row_state(ints, b, h, i0 + r), j0 + lane)) {
                    p = 0;
                }
                if (lane < BK) s[r * at.ld_s + lane] = p;
                if (lane == 0) {
                    const Acc correction = any ? exp_of(old_max - new_max) : (Acc)1;
                    row_correction[r] = correction;
                    row_l[r] = row_l[r] * correction + tile_sum;
                    row_m[r] = new_max;
                    // a visible NaN score (the max skips it) makes the row NaN, not empty
                    if (tile_max > negative_infinity<Acc>() || tile_sum != tile_sum) row_seen[r] = 1;
                }
            }
            __syncthreads();
            // O (rows x Dv) = O * correction + P (rows x cols) . V (cols x Dv)
            const Acc correction = row_correction[my_row];
#pragma unroll
            for (int x = 0; x < MAX_D / 8; ++x) acc[x] *= correction;
            for (int c = 0; c < cols; ++c) {
                const Acc p = s[my_row * at.ld_s + c];
#pragma unroll
                for (int x = 0; x < MAX_D / 8; ++x) {
                    const int d = my_column + 8 * x;
                    if (d < value_dim) acc[x] += p * vs[c * at.ld_v + d];
                }
            }
            __syncthreads();  // the next tile overwrites ks, vs and s
        }
    }

    if (splits > 1) {
        const i64 value_dim3 = value_dim + 3;
        const i64 row = (b * ints[NPATTN_INT_HEADS] + h) * ints[NPATTN_INT_Q_LEN] + i0 + my_row;
        Acc* mine = partial + (row * splits + split) * value_dim3;
        if (my_row < rows) {
#pragma unroll
            for (int x = 0; x < MAX_D / 8; ++x) {
                const int d = my_column + 8 * x;
                if (d < value_dim) mine[d] = acc[x];
            }
            if (my_column == 0) {
                mine[value_dim] = row_m[my_row];
                mine[value_dim + 1] = row_l[my_row];
                mine[value_dim + 2] = row_seen[my_row];
            }
        }
        return;
    }
    if (my_row < rows) {
        const bool seen = row_seen[my_row] != 0;
        const Acc factor = seen ? in.reals[NPATTN_REAL_KEEP_SCALE] / row_l[my_row] : (Acc)0;
        const i64 o = b * out_sb + h * out_sh + (i0 + my_row) * out_ss;
#pragma unroll
        for (int x = 0; x < MAX_D / 8; ++x) {
            const int d = my_column + 8 * x;
            if (d < value_dim) out[o + d] = acc[x] * factor;
        }
    }
    if (threadIdx.x < rows && row_seen[threadIdx.x] != 0) {
        lse[(b * ints[NPATTN_INT_HEADS] + h) * ints[NPATTN_INT_Q_LEN] + i0 + threadIdx.x] =
            row_m[threadIdx.x] + log_of(row_l[threadIdx.x]);
    }
}

// Fill weights (Acc, C-contiguous (B, H, Sq, Sk), zero on entry) with exp(s - lse): the
// exact probabilities after masking and before dropout. Same blocks as forward_kernel.
template <typename T, typename Acc, int BK>
__global__ void __launch_bounds__(NPATTN_THREADS)
weights_kernel(NPATTN_OPERAND_PARAMS, const Acc* lse, Acc* weights) {
    const Operands<T, Acc> in = NPATTN_OPERANDS;
    const QueryTile tile = query_tile(ints, spans, blockIdx.x);
    if (tile.rows <= 0) return;
    const i64 b = tile.b, h = tile.h, i0 = tile.i0;
    const int rows = tile.rows;
    const int head_dim = (int)ints[NPATTN_INT_HEAD_DIM], value_dim = (int)ints[NPATTN_INT_VALUE_DIM];
    const i64 kv_len = ints[NPATTN_INT_KV_LEN];
    NPATTN_DYNAMIC_SHARED(shared_bytes);
    Acc* shared = reinterpret_cast<Acc*>(shared_bytes);
    const ForwardLayout at(head_dim, value_dim, BK);
    Acc *qs = shared + at.q, *ks = shared + at.k, *s = shared + at.s;
    const i64 kv_head = kv_head_of(ints, h);
    const i64 row_offset = (b * ints[NPATTN_INT_HEADS] + h) * ints[NPATTN_INT_Q_LEN] + i0;
    load_tile(q, q_row(ints, b, h, i0),
              ints[NPATTN_INT_Q_STRIDE_S], rows, head_dim, NPATTN_BQ, head_dim, qs, at.ld_q);
    const KeyRanges keys = key_ranges(ints, spans, b, i0, i0 + rows, BK, 0, 1);
    for (int segment = 0; segment < 2; ++segment) {
        for (i64 j0 = keys.first[segment], next; j0 < keys.last[segment]; j0 = next) {
            const int cols = tile_keys(ints, j0, keys.last[segment], BK);  // within one page
            next = j0 + cols;
            load_key_tile(in, false, b, kv_head, j0, paged_k_row(ints, pages, b, kv_head, j0),
                          ints[NPATTN_INT_K_STRIDE_S], cols, head_dim, BK, head_dim, ks, at.ld_k);
            __syncthreads();
            score_tile<T, Acc, NPATTN_BQ, BK>(in, qs, at.ld_q, ks, at.ld_k, s, at.ld_s, nullptr, b, h, i0, rows, j0,
                                              cols);
            for (int index = threadIdx.x; index < rows * cols; index += blockDim.x) {
                const int r = index / cols, c = index % cols;
                const Acc row_lse = lse[row_offset + r];
                if (row_lse > negative_infinity<Acc>()) {  // an empty row keeps its zeros
                    weights[(row_offset + r) * kv_len + j0 + c] = exp_of(s[r * at.ld_s + c] - row_lse);
                }
            }
            __syncthreads();
        }
    }
}
