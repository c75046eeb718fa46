// Rows that are not finite recomputed as the reference computes them (recompute_row; why
// a row can need it: repair.cu), and split-KV partial rows merged into out and lse: by
// combine_kernel (repair.cu), a block a query row, or by the forward itself, where the
// last block of a work item to finish merges the item's rows (merge_item_if_last).
//
// Why the forward merges: a split decode step's combine is a second launch whose time is
// nearly all fixed cost where a row has few splits (a launch, then a chain of dependent
// loads of its scalars, spans and partials before its first add): at (16, 32/8, 1 x 2048,
// 128), 2 splits a row, the combine took 6-7 us under Nsight Compute beside a 33.6 us int8
// step in a CUDA graph (H200, 2026-11-30).
// The forward's blocks count themselves per work item (an atomic a counter, kept after
// the partials in the same buffer), and the last one merges while the others are done.
// For at most COMBINE_CHUNK splits (the driver's MERGED_SPLITS) the merge takes the
// combine's steps in the combine's order (one warp a row, one chunk), so its bits are
// the combine's. Only instantiations with Option.MERGES carry it (the driver's
// merges_in_forward), inlined: as a called function it kept more in local memory; inlined
// under open launch bounds it took forward_tc.cu's 128-wide decode tile from 220 registers
// to 168 with spills inside its key loop, so a MERGES kernel asks for at least 1 block an
// SM (forward_tc.cu), and keeps 212 and no local memory (sm_90).
#pragma once
#include "common.cuh"

// max(a, b) where a NaN in either gives NaN (NumPy's max; the reference's row max)
__device__ inline double nan_max(double a, double b) { return a != a || b != b ? a + b : (a > b ? a : b); }

// The float64 score of key j (of kv head h in batch entry b) for the row of `scorer`
// (ScoreRow's steps, in double; a quantized cache's keys dequantized in double, exactly).
template <typename T, typename Acc>
__device__ inline double score_in_double(const ScoreRow<T, Acc>& scorer, const Operands<T, Acc>& in, i64 q_offset,
                                         i64 b, i64 h, int head_dim, i64 j) {
    double dot = 0;
    for (int d = 0; d < head_dim; ++d) {
        dot += Storage<T>::template load<double>(in.q, q_offset + d) * key_element<double>(in, false, b, h, j, d);
    }
    double score = (double)scorer.scale * dot;
    if (scorer.softcap != (Acc)0) score = (double)scorer.softcap * tanh(score / (double)scorer.softcap);
    if (scorer.bias_row != nullptr) score += (double)scorer.bias_row[j * scorer.bias_stride];
    const i64 distance = scorer.position > j ? scorer.position - j : j - scorer.position;
    return score - (double)scorer.slope * (double)distance;
}

// The recompute of query row `row` (batch-major, then head, then query; a live row whose
// out or lse is not finite) by one warp (`lane` its thread's), as the top of repair.cu
// says: what repair_row runs where its check fails, and store_merged_row (below) where
// the row it merged is not finite.
template <typename T, typename Acc>
__device__ inline void recompute_row(const Operands<T, Acc>& in, i64 row, int lane, T* out, i64 out_sb, i64 out_sh,
                                     i64 out_ss, Acc* lse) {
    constexpr int COLUMNS = NPATTN_MAX_HEAD_DIM / 32;  // columns per lane
    const Acc *sink = in.sink, *reals = in.reals;
    const i64* ints = in.ints;
    const i64 heads = ints[NPATTN_INT_HEADS], q_len = ints[NPATTN_INT_Q_LEN], kv_len = ints[NPATTN_INT_KV_LEN];
    const i64 b = row / (heads * q_len), h = (row / q_len) % heads, i = row % q_len;
    const int value_dim = (int)ints[NPATTN_INT_VALUE_DIM], head_dim = (int)ints[NPATTN_INT_HEAD_DIM];
    T* row_out = out + b * out_sb + h * out_sh + i * out_ss;
    const ScoreRow<T, Acc> scorer(in, b, h, i);
    const i64 kv_head = kv_head_of(ints, h), q_offset = q_row(ints, b, h, i);
    auto score_of = [&](i64 j) {
        return score_in_double(scorer, in, q_offset, b, kv_head, head_dim, j);
    };
    // the row's max over the keys it sees, and whether it sees any (a NaN score counts)
    int has_key = 0;
    double top = negative_infinity<double>();
    for (i64 j = lane; j < kv_len; j += 32) {
        if (!scorer.visible(j)) continue;
        const double score = score_of(j);
        has_key |= score != negative_infinity<double>();
        top = nan_max(top, score);
    }
    for (int offset = 16; offset > 0; offset >>= 1) top = nan_max(top, __shfl_xor_sync(0xffffffffu, top, offset));
    if (warp_sum(has_key) == 0) {  // sees nothing: zeros and -inf, whatever its keys hold
        for (int d = lane; d < value_dim; d += 32) Storage<T>::store(row_out, d, 0.0);
        if (lane == 0) lse[row] = negative_infinity<Acc>();
        return;
    }
    const bool has_sink = ints[NPATTN_INT_HAS_SINK] != 0;
    if (has_sink) top = nan_max(top, (double)sink[h]);
    const bool has_dropout = ints[NPATTN_INT_HAS_DROPOUT] != 0;
    const u32 dropout_state = has_dropout ? dropout_row_state(ints, b, h, i) : 0u;
    const double keep_scale = (double)reals[NPATTN_REAL_KEEP_SCALE];
    // out = sum over the keys the row sees of exp(s - top) * keep * v, in key order: each
    // lane scores one key of 32, then the warp adds the 32 keys' rows one after another
    // (the scores of the first pass are computed again: only rows that are not finite
    // come here, and no buffer of one score per key is kept)
    double total = 0, sums[COLUMNS];
#pragma unroll
    for (int c = 0; c < COLUMNS; ++c) sums[c] = 0;
    for (i64 j0 = 0; j0 < kv_len; j0 += 32) {
        const i64 j = j0 + lane;
        const int seen = j < kv_len && scorer.visible(j);
        double weight = 0;
        if (seen) {
            weight = exp(score_of(j) - top);
            total += weight;
            if (has_dropout && !dropout_keeps(ints, dropout_state, j)) weight = 0;  // 0 * v: NaN stays NaN
            weight *= keep_scale;
        }
        for (int t = 0; t < 32; ++t) {
            const int key_seen = __shfl_xor_sync(0xffffffffu, seen, lane ^ t);
            const double key_weight = __shfl_xor_sync(0xffffffffu, weight, lane ^ t);
            if (!key_seen) continue;  // the same for every lane
#pragma unroll
            for (int c = 0; c < COLUMNS; ++c) {
                const int d = lane + 32 * c;
                if (d < value_dim) sums[c] += key_weight * key_element<double>(in, true, b, kv_head, j0 + t, d);
            }
        }
    }
    total = warp_sum(total);
    if (has_sink) total += exp((double)sink[h] - top);
#pragma unroll
    for (int c = 0; c < COLUMNS; ++c) {
        const int d = lane + 32 * c;
        if (d < value_dim) Storage<T>::store(row_out, d, sums[c] / total);
    }
    if (lane == 0) lse[row] = (Acc)(top + log(total));
}


// A split partial's element: with COHERENT, read past L1 (ld.global.cg), as the forward's
// merge must read rows that other blocks of the same launch wrote, whose lines this SM's
// L1 could hold from before; the combine (a later launch) reads them plainly.
template <bool COHERENT, typename Acc> __device__ inline Acc partial_value(const Acc* p) {
#ifndef NPATTN_HOST_EMULATION
    if constexpr (COHERENT) return __ldcg(p);
#endif
    return *p;
}

// A row's partials `parts` (splits rows of row_length = value_dim + 3 floats: the row,
// then its max, sum and seen flag): the largest max of splits first, first + stride, ...
// that saw a key folded into `m`, and `seen` set to 1 where one did.
template <bool COHERENT, typename Acc>
__device__ inline void fold_split_maxima(const Acc* parts, i64 splits, i64 row_length, i64 value_dim, i64 first,
                                         i64 stride, Acc& m, int& seen) {
    for (i64 s = first; s < splits; s += stride) {
        const Acc* part = parts + s * row_length;
        if (partial_value<COHERENT>(part + value_dim + 2) != 0) {
            seen = 1;
            const Acc their_max = partial_value<COHERENT>(part + value_dim);
            m = their_max > m ? their_max : m;
        }
    }
}

// One warp's chunks of COMBINE_CHUNK splits (chunks first, first + stride, ...) added
// to a row's merge: `total` (lane d: columns d, d + 32, ...) gains each kept split's row
// times its weight exp(max - m), in split order, and `l` (lane j < the chunk's splits)
// split j's sum times it. Lane j reads split j's max, sum and seen flag and works out its
// weight; the chunk's rows are loaded together and added in split order, each split's
// weight and flag broadcast by a shuffle, so no row load waits on another split's flag.
template <bool COHERENT, int COLUMNS, typename Acc>
__device__ inline void add_split_chunks(const Acc* parts, i64 splits, int row_length, i64 value_dim, Acc m,
                                        int first, int stride, int lane, Acc (&total)[COLUMNS], Acc& l) {
    for (int s0 = NPATTN_COMBINE_CHUNK * first; s0 < splits; s0 += NPATTN_COMBINE_CHUNK * stride) {
        const int count = (int)smaller((i64)NPATTN_COMBINE_CHUNK, splits - s0);
        int kept = 0;
        Acc weight = 0;
        if (lane < count) {
            const Acc* part = parts + (s0 + lane) * row_length;
            kept = partial_value<COHERENT>(part + value_dim + 2) != 0;
            weight = kept ? exp_of(partial_value<COHERENT>(part + value_dim) - m) : (Acc)0;
            l = kept ? l + partial_value<COHERENT>(part + value_dim + 1) * weight : l;
        }
        // the chunk's rows loaded into registers first, then added in split order. Every
        // load is unconditional, from an address that exists (split s0 for one past the
        // chunk's end, column 0 for one past value_dim), and masked after: a load under a
        // condition became a predicated load and a move that waited for it, one latency
        // per value (the combine took 50-54 us under Nsight Compute at batch 1 with one kv
        // head and 256 splits, H200)
        Acc rows[NPATTN_COMBINE_CHUNK][COLUMNS];
        int kept_j[NPATTN_COMBINE_CHUNK];
        Acc weight_j[NPATTN_COMBINE_CHUNK];
#pragma unroll
        for (int j = 0; j < NPATTN_COMBINE_CHUNK; ++j) {
            kept_j[j] = __shfl_xor_sync(0xffffffffu, kept, lane ^ j) && j < count;
            weight_j[j] = __shfl_xor_sync(0xffffffffu, weight, lane ^ j);
            const Acc* part = parts + (s0 + (j < count ? j : 0)) * row_length;
#pragma unroll
            for (int c = 0; c < COLUMNS; ++c) {
                const int d = lane + 32 * c;
                rows[j][c] = partial_value<COHERENT>(part + (d < value_dim ? d : 0));
            }
        }
#pragma unroll
        for (int j = 0; j < NPATTN_COMBINE_CHUNK; ++j) {
#pragma unroll
            for (int c = 0; c < COLUMNS; ++c) {
                // a split that saw no key adds nothing (its row may hold 0 * NaN of a key it masked)
                if (kept_j[j] && lane + 32 * c < value_dim) total[c] += rows[j][c] * weight_j[j];
            }
        }
    }
}

// A merged row that saw no key: zeros (threads first, first + stride, ... of those that
// take the row) and -inf, as without splits (out is not filled)
template <typename T, typename Acc>
__device__ inline void store_empty_row(T* row_out, Acc* row_lse, i64 value_dim, int first, int stride) {
    for (i64 d = first; d < value_dim; d += stride) Storage<T>::store(row_out, d, 0.0);
    if (first == 0) *row_lse = negative_infinity<Acc>();
}

// Query row `row`'s out (row_out, in T, rounded once) and lse from its merged sums (one
// warp; lane d's columns d, d + 32, ... of `total`, and the sum `l` and max `m` of the
// whole row, sink included): total / l times the dropout's keep scale. Then repair_row's
// check, on the values as stored (rounded to T) while they are in registers rather than
// read back (a round trip to L2); a row left alone when finite, else given the reference's
// answer (recompute_row): a split call launches no repair_kernel.
template <typename T, typename Acc, int COLUMNS>
__device__ inline void store_merged_row(const Operands<T, Acc>& in, i64 row, int lane, const Acc (&total)[COLUMNS],
                                        Acc l, Acc m, T* row_out, i64 value_dim, T* out, i64 out_sb, i64 out_sh,
                                        i64 out_ss, Acc* lse) {
    const Acc factor = in.reals[NPATTN_REAL_KEEP_SCALE] / l;
    int bad = 0;
#pragma unroll
    for (int c = 0; c < COLUMNS; ++c) {
        const i64 d = lane + 32 * c;
        if (d < value_dim) {
            const Acc value = total[c] * factor;
            Storage<T>::store(row_out, d, (double)value);
            const Acc stored = Storage<T>::template round<Acc>(value);
            bad |= !(stored - stored == 0);
        }
    }
    const Acc row_lse = m + log_of(l);
    if (lane == 0) lse[row] = row_lse;
    bad |= row_lse != row_lse || row_lse == -negative_infinity<Acc>();
    if (warp_sum(bad) == 0) return;
    __syncwarp();
    recompute_row(in, row, lane, out, out_sb, out_sh, out_ss, lse);
}

// Query row `row` (of head h; its out at row_out) merged from its `splits` partials by
// one warp: the combine's steps for a block of one warp (combine_kernel), whose order
// and so whose bits they are wherever the combine takes one warp (at most COMBINE_CHUNK
// splits), reading the partials past L1 (they were written in this launch).
template <typename T, typename Acc, int MAX_D>
__device__ inline void merge_row_by_warp(const Operands<T, Acc>& in, i64 row, i64 h, T* row_out, i64 splits,
                                         const Acc* partial, int lane, T* out, i64 out_sb, i64 out_sh, i64 out_ss,
                                         Acc* lse) {
    constexpr int COLUMNS = MAX_D / 32;
    const i64* ints = in.ints;
    const i64 value_dim = ints[NPATTN_INT_VALUE_DIM], row_length = value_dim + 3;
    const Acc* parts = partial + row * splits * row_length;
    const bool has_sink = ints[NPATTN_INT_HAS_SINK] != 0;
    Acc m = has_sink ? in.sink[h] : negative_infinity<Acc>();
    int seen = 0;
    fold_split_maxima<true>(parts, splits, row_length, value_dim, lane, 32, m, seen);
    m = warp_max(m);
    if (warp_sum(seen) == 0) {
        store_empty_row(row_out, lse + row, value_dim, lane, 32);
        return;
    }
    Acc l = 0, total[COLUMNS];
#pragma unroll
    for (int c = 0; c < COLUMNS; ++c) total[c] = 0;
    add_split_chunks<true, COLUMNS>(parts, splits, (int)row_length, value_dim, m, 0, 1, lane, total, l);
    l = (has_sink ? exp_of(in.sink[h] - m) : (Acc)0) + warp_sum(l);
    store_merged_row(in, row, lane, total, l, m, row_out, value_dim, out, out_sb, out_sh, out_ss, lse);
}

// Whether this block is the last of its work item's `splits` blocks to have written its
// partials (every thread of the block calls it, after its own writes): a count per item
// (`counter`) taken by an atomic, set back to 0 by that last block, so that the next
// launch (a CUDA graph's replay too) starts from 0. The fence before the count makes each
// block's partials visible to every other before its count is, the one after it orders
// the last block's reads after every count (the CUDA programming guide's last-block
// pattern). `flag`: an int of the block's shared memory, unused by then.
__device__ inline bool last_of_splits(unsigned* counter, i64 splits, int* flag) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const bool last = atomicAdd(counter, 1u) == (unsigned)(splits - 1);
        if (last) *counter = 0u;  // (every block of the item has counted itself)
        *flag = last;
    }
    __syncthreads();
    const bool last = *flag != 0;
    if (last) __threadfence();
    return last;
}

// The forward's merge of a split work item (entry b, kv head kv_head, packed rows [p0,
// p0 + rows) of a GQA group of `group` query heads; block `item` / splits of the launch)
// by the last of its blocks: each warp takes rows warp, warp + warps, ... The item's
// counter is the unsigned int at float ints[SPLIT_COUNTERS] + item of the partials'
// buffer (the driver zeroes the counters once, with the buffer). The driver sets it for
// every plan whose kernel has Option.MERGES; a 0 there (a driver that did not) leaves the
// rows unmerged, and the poisoned out shows it, rather than counting in the partials.
template <typename T, typename Acc, int MAX_D>
__device__ inline void merge_item_if_last(const Operands<T, Acc>& in, i64 item, i64 b, i64 kv_head, i64 group, i64 p0,
                                          int rows, i64 splits, Acc* partial, T* out, i64 out_sb, i64 out_sh,
                                          i64 out_ss, Acc* lse, unsigned char* shared) {
    const i64* ints = in.ints;
    const i64 counters = ints[NPATTN_INT_SPLIT_COUNTERS];
    if (counters == 0) return;  // the same for the whole block
    unsigned* counter = reinterpret_cast<unsigned*>(partial + counters) + item;
    if (!last_of_splits(counter, splits, reinterpret_cast<int*>(shared))) return;
    const i64 heads = ints[NPATTN_INT_HEADS], q_len = ints[NPATTN_INT_Q_LEN];
    const int warps = (int)(blockDim.x / 32), lane = threadIdx.x % 32;
    for (int r = threadIdx.x / 32; r < rows; r += warps) {
        const i64 p = p0 + r, h = kv_head * group + p % group, i = p / group;
        merge_row_by_warp<T, Acc, MAX_D>(in, (b * heads + h) * q_len + i, h, out + b * out_sb + h * out_sh + i * out_ss,
                                         splits, partial, lane, out, out_sb, out_sh, out_ss, lse);
    }
}
