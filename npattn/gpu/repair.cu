// The reference's answer for rows the forward could not give it, on the device: the
// check of out for NaN and inf that a call would otherwise make on the host (a
// reduction, a wait for the device and a copy back: 56-87 us of a small call's 83-128 us
// on an H200) becomes a kernel on the same stream, so a planned call never waits for
// the device.
//
// Why a row can need it: a tile product cannot tell a weight of 0 for a key the row does
// not see from one for a key it sees, so a NaN or inf in v of a key the row does not see
// leaks into it (0 * NaN), where the reference keeps it out; and scores can overflow
// float32 where float64 does not. Every other non-finite row (a NaN or +inf among the
// scores a row sees, a NaN in v of a key it sees) the kernels already give as the
// reference does, and recomputing it gives it again.
//
// One warp per query row (repair_row: repair_kernel after a forward that wrote out
// itself, and combine_kernel, below, on each row it merges from split keys, so a split
// call launches no repair_kernel): a row whose out and lse are finite (lse may
// be -inf: a row that saw nothing) is left as it is. Any other row is recomputed in
// float64 by the reference's steps (npattn/reference.py), reading only the keys the row
// sees: scores (scale, softcap, bias, ALiBi; ScoreRow's parameters and visibility),
// the max (NaN-propagating) with the sink logit, the sum, dropout's keep mask, and out
// as the sum over the visible keys of weight * v in key order, so 0 * NaN reaches the
// row exactly when the reference's does. Then out (in the inputs' dtype, rounded once
// from float32 for 16-bit inputs) and lse are written over the row.
#include "common.cuh"
#include "forward.cu"

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
// out or lse is not finite) by one warp (`lane` its thread's), as the top of this file
// says: what repair_row runs where its check fails, and combine_kernel where the row it
// merged is not finite.
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

// The check and, where it fails, the recompute of query row `row` by one warp: what
// repair_kernel runs on every row.
template <typename T, typename Acc>
__device__ inline void repair_row(const Operands<T, Acc>& in, i64 row, int lane, T* out, i64 out_sb, i64 out_sh,
                                  i64 out_ss, Acc* lse) {
    const i64 *spans = in.spans, *ints = in.ints;
    const i64 heads = ints[NPATTN_INT_HEADS], q_len = ints[NPATTN_INT_Q_LEN];
    const i64 b = row / (heads * q_len), h = (row / q_len) % heads, i = row % q_len;
    // padding rows keep the zeros and -inf they were given
    if (i < span(spans, b, NPATTN_SPAN_Q_START) || i >= span(spans, b, NPATTN_SPAN_Q_STOP)) return;
    const int value_dim = (int)ints[NPATTN_INT_VALUE_DIM];
    const T* row_out = out + b * out_sb + h * out_sh + i * out_ss;
    // the check: x - x is 0 for a finite x, NaN for NaN and inf
    int bad = 0;
    for (int d = lane; d < value_dim; d += 32) {
        const double x = Storage<T>::template load<double>(row_out, d);
        bad |= !(x - x == 0);
    }
    if (lane == 0) bad |= lse[row] != lse[row] || lse[row] == -negative_infinity<Acc>();
    if (warp_sum(bad) == 0) return;
    recompute_row(in, row, lane, out, out_sb, out_sh, out_ss, lse);
}

template <typename T, typename Acc>
__global__ void __launch_bounds__(NPATTN_THREADS)
repair_kernel(NPATTN_OPERAND_PARAMS, T* out, i64 out_sb, i64 out_sh, i64 out_ss, Acc* lse) {
    const i64 row = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    if (row >= ints[NPATTN_INT_BATCH] * ints[NPATTN_INT_HEADS] * ints[NPATTN_INT_Q_LEN]) return;  // whole warps
    const Operands<T, Acc> in = NPATTN_OPERANDS;
    repair_row(in, row, threadIdx.x % 32, out, out_sb, out_sh, out_ss, lse);
}

// Merge the forward's split-KV partial rows (the same bits on every run for a given
// number of splits), of value_dim <= MAX_D (the head-dim bound: each lane holds MAX_D / 32
// columns, so a 128-wide step loads and adds 4 a split where the 256-wide build took 8):
// one block per query row, of blockDim.x / 32 warps (the driver's
// combine_warps: one per COMBINE_CHUNK splits, at most NPATTN_COMBINE_THREADS / 32), with
// the sink logit as the starting max and sum. All threads find the max over the splits (a
// max is exact in any order). Then warp w takes splits in chunks of COMBINE_CHUNK (w, w +
// warps, ... in chunk order): lane j < COMBINE_CHUNK reads split j's max, sum and seen
// flag and works out its weight; the chunk's rows are loaded together and added in split
// order, lane d holding columns d, d + 32, ..., each split's weight and flag broadcast by a
// shuffle, so no row load waits on another split's flag. The lanes' sums are added by a
// fixed tree, and the warps' results in warp order.
// (One warp per row, reading split after split, made a decode step at batch 1 with one kv
// head and 256 splits take 274-277 us of device time on an H200, where the forward kernel
// takes 13-14. Then a warp per 32 splits, each chunk of 32 taken 8 at a time: at batch 1
// and 33 splits a row the combine still took 13.9 us under Nsight Compute, one warp running
// four chunks of about 700 dependent instructions at 9 cycles each.) Shared memory:
// combine_shared_bytes (launch.py), a row of value_dim + 1 sums per warp.
// (The 1 lets it take the registers it wants: with repair_row inlined it kept 16 bytes of
// spills at 128 registers on sm_90; it takes 188 and none.)
template <typename T, typename Acc, int MAX_D>
__global__ void __launch_bounds__(NPATTN_COMBINE_THREADS, 1)
combine_kernel(NPATTN_OPERAND_PARAMS, T* out, i64 out_sb, i64 out_sh, i64 out_ss, Acc* lse, i64 splits,
               const Acc* partial) {
    static_assert(MAX_D % 32 == 0, "whole columns a lane");
    constexpr int COLUMNS = MAX_D / 32;  // columns per lane (value_dim <= MAX_D)
    const int warps = (int)(blockDim.x / 32);
    prefetch_lines(ints, NPATTN_INT_COUNT, threadIdx.x % 32);  // (NPATTN_PREFETCH_PARAMETERS)
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
    const int row_length = (int)value_dim3;  // (a row's splits fit an int: splits x (D + 3) floats)
    for (int s0 = NPATTN_COMBINE_CHUNK * warp; s0 < splits; s0 += NPATTN_COMBINE_CHUNK * warps) {
        const int count = (int)smaller((i64)NPATTN_COMBINE_CHUNK, splits - s0);
        int kept = 0;
        Acc weight = 0;
        if (lane < count) {
            const Acc* part = parts + (s0 + lane) * row_length;
            kept = part[value_dim + 2] != 0;
            weight = kept ? exp_of(part[value_dim] - m) : (Acc)0;
            l = kept ? l + part[value_dim + 1] * weight : l;
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
                rows[j][c] = part[d < value_dim ? d : 0];
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
    // the repair pass of this row, by the warp that wrote it (a split call launches no
    // repair_kernel): repair_row's check, on the values as stored (rounded to T) while
    // they are in registers rather than read back (a round trip to L2 at the end of every
    // combine); left alone when finite, else the reference's answer
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
    const Operands<T, Acc> in = NPATTN_OPERANDS;
    recompute_row(in, row, lane, out, out_sb, out_sh, out_ss, lse);
}
