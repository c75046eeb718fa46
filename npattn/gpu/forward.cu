// The tiled forward (FlashAttention-2 order, SIMT with Acc accumulation): out and lse
// with an online softmax, and the exact attention weights recomputed from lse.
//
// One block of THREADS threads per (batch, head, tile of BQ query rows); it visits the
// key tiles that masking leaves alive (key_segments), BK keys at a time. Shared memory
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

__device__ inline i64 kv_head_of(const i64* ints, i64 h) {
    return h / (ints[NPATTN_INT_HEADS] / ints[NPATTN_INT_KV_HEADS]);
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
            load_tile(k, paged_k_row(ints, pages, b, kv_head, j0), ints[NPATTN_INT_K_STRIDE_S], cols, head_dim, BK,
                      head_dim, ks, at.ld_k);
            load_tile(v, paged_v_row(ints, pages, b, kv_head, j0), ints[NPATTN_INT_V_STRIDE_S], cols, value_dim, BK,
                      value_dim, vs, at.ld_v);
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
            load_tile(k, paged_k_row(ints, pages, b, kv_head, j0), ints[NPATTN_INT_K_STRIDE_S], cols, head_dim, BK,
                      head_dim, ks, at.ld_k);
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

// Merge the forward's split-KV partial rows (the same bits on every run for a given
// number of splits): one block per query row, of blockDim.x / 32 warps (the driver's
// combine_warps: one per 32 splits, at most NPATTN_COMBINE_THREADS / 32), with the sink
// logit as the starting max and sum. All threads find the max over the splits (a max is
// exact in any order). Then warp w takes splits in chunks of 32 (w, w + warps, ... in
// chunk order): lane j reads split j's max, sum and seen flag (one load each for the
// whole chunk) and works out its weight; the chunk's rows are added in split order, lane
// d holding columns d, d + 32, ..., each split's weight and flag broadcast by a shuffle,
// so no row load waits on another split's flag and a chunk's loads are in flight
// together. The lanes' sums are added by a fixed tree, and the warps' results in warp
// order. (One warp per row, reading split after split, made a decode step at batch 1
// with one kv head and 256 splits take 274-277 us of device time on an H200, where the
// forward kernel takes 13-14.) Shared memory: combine_shared_bytes (launch.py), a row of
// value_dim + 1 sums per warp.
template <typename T, typename Acc>
__global__ void __launch_bounds__(NPATTN_COMBINE_THREADS)
combine_kernel(NPATTN_OPERAND_PARAMS, T* out, i64 out_sb, i64 out_sh, i64 out_ss, Acc* lse, i64 splits,
               const Acc* partial) {
    constexpr int COLUMNS = NPATTN_MAX_HEAD_DIM / 32;  // columns per lane
    const int warps = (int)(blockDim.x / 32);
    const i64 heads = ints[NPATTN_INT_HEADS], q_len = ints[NPATTN_INT_Q_LEN];
    const i64 row = blockIdx.x;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= ints[NPATTN_INT_BATCH] * heads * q_len) return;  // whole blocks
    const i64 b = row / (heads * q_len), h = (row / q_len) % heads, i = row % q_len;
    // padding keeps its zeros and -inf
    if (i < span(spans, b, NPATTN_SPAN_Q_START) || i >= span(spans, b, NPATTN_SPAN_Q_STOP)) return;
    NPATTN_DYNAMIC_SHARED(shared_bytes);
    Acc* shared = reinterpret_cast<Acc*>(shared_bytes);
    const i64 value_dim = ints[NPATTN_INT_VALUE_DIM], value_dim3 = value_dim + 3;
    const Acc* parts = partial + row * splits * value_dim3;
    const bool has_sink = ints[NPATTN_INT_HAS_SINK] != 0;
    Acc m = has_sink ? sink[h] : negative_infinity<Acc>();
    int seen = 0;
    for (i64 s = threadIdx.x; s < splits; s += blockDim.x) {
        const Acc* part = parts + s * value_dim3;
        if (part[value_dim + 2] != 0) {
            seen = 1;
            m = part[value_dim] > m ? part[value_dim] : m;
        }
    }
    m = warp_max(m);
    seen = warp_sum(seen);
    if (lane == 0) {
        shared[2 * warp] = m;
        shared[2 * warp + 1] = (Acc)seen;
    }
    __syncthreads();
    seen = 0;
    for (int w = 0; w < warps; ++w) {
        m = shared[2 * w] > m ? shared[2 * w] : m;
        seen += shared[2 * w + 1] != 0;
    }
    __syncthreads();  // every thread has read the maxima before the sums take their place
    T* row_out = out + b * out_sb + h * out_sh + i * out_ss;  // in the inputs' dtype, rounded once
    if (seen == 0) {  // no visible key: zeros and -inf, as without splits (out is not filled)
        for (i64 d = threadIdx.x; d < value_dim; d += blockDim.x) Storage<T>::store(row_out, d, 0.0);
        if (threadIdx.x == 0) lse[row] = negative_infinity<Acc>();
        return;
    }
    Acc l = 0;  // this lane's share of the sum (its splits'), added across lanes at the end
    Acc total[COLUMNS];
#pragma unroll
    for (int c = 0; c < COLUMNS; ++c) total[c] = 0;
    for (i64 s0 = 32 * warp; s0 < splits; s0 += 32 * warps) {
        const i64 s = s0 + lane;
        int kept = 0;
        Acc weight = 0;
        if (s < splits) {
            const Acc* part = parts + s * value_dim3;
            kept = part[value_dim + 2] != 0;
            weight = kept ? exp_of(part[value_dim] - m) : (Acc)0;
            l = kept ? l + part[value_dim + 1] * weight : l;
        }
        const int count = (int)smaller((i64)32, splits - s0);
        // 8 splits at a time: their rows loaded into registers first, then added in split
        // order. Every load is unconditional, from an address that exists (split 0 of the
        // chunk for one past its end, column 0 for one past value_dim), and masked after:
        // a load under a condition became a predicated load and a move that waited for it,
        // one latency per value (the combine took 50-54 us under Nsight Compute at batch 1
        // with one kv head and 256 splits, H200; read off the SASS, the fix is untimed)
        for (int j0 = 0; j0 < count; j0 += 8) {
            Acc rows[8][COLUMNS];
            int kept_j[8];
            Acc weight_j[8];
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) {
                const int j = j0 + jj;  // below 32: a lane of this warp
                kept_j[jj] = __shfl_xor_sync(0xffffffffu, kept, lane ^ j) && j < count;
                weight_j[jj] = __shfl_xor_sync(0xffffffffu, weight, lane ^ j);
                const Acc* part = parts + (s0 + (j < count ? j : 0)) * value_dim3;
#pragma unroll
                for (int c = 0; c < COLUMNS; ++c) {
                    const i64 d = lane + 32 * c;
                    rows[jj][c] = part[d < value_dim ? d : 0];
                }
            }
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) {
#pragma unroll
                for (int c = 0; c < COLUMNS; ++c) {
                    // a split that saw no key adds nothing (its row may hold 0 * NaN of a key it masked)
                    if (kept_j[jj] && lane + 32 * c < value_dim) total[c] += rows[jj][c] * weight_j[jj];
                }
            }
        }
    }
    l = warp_sum(l);
    Acc* mine = shared + warp * (value_dim + 1);
#pragma unroll
    for (int c = 0; c < COLUMNS; ++c) {
        const i64 d = lane + 32 * c;
        if (d < value_dim) mine[d] = total[c];
    }
    if (lane == 0) mine[value_dim] = l;
    __syncthreads();
    if (warp != 0) return;
    l = has_sink ? exp_of(sink[h] - m) : (Acc)0;
#pragma unroll
    for (int c = 0; c < COLUMNS; ++c) total[c] = 0;
    for (int w = 0; w < warps; ++w) {
        const Acc* theirs = shared + w * (value_dim + 1);
        l += theirs[value_dim];
#pragma unroll
        for (int c = 0; c < COLUMNS; ++c) {
            const i64 d = lane + 32 * c;
            if (d < value_dim) total[c] += theirs[d];
        }
    }
    const Acc factor = reals[NPATTN_REAL_KEEP_SCALE] / l;
#pragma unroll
    for (int c = 0; c < COLUMNS; ++c) {
        const i64 d = lane + 32 * c;
        if (d < value_dim) Storage<T>::store(row_out, d, (double)(total[c] * factor));
    }
    if (lane == 0) lse[row] = m + log_of(l);
}
