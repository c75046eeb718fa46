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
// One warp per query row: a row whose out and lse are finite (lse may
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

// The float64 score of key j for the row of `scorer` (ScoreRow's steps, in double).
template <typename T, typename Acc>
__device__ inline double score_in_double(const ScoreRow<T, Acc>& scorer, const T* q, i64 q_offset, const T* k,
                                         i64 k_offset, int head_dim, i64 j) {
    double dot = 0;
    for (int d = 0; d < head_dim; ++d) {
        dot += Storage<T>::template load<double>(q, q_offset + d) * Storage<T>::template load<double>(k, k_offset + d);
    }
    double score = (double)scorer.scale * dot;
    if (scorer.softcap != (Acc)0) score = (double)scorer.softcap * tanh(score / (double)scorer.softcap);
    if (scorer.bias_row != nullptr) score += (double)scorer.bias_row[j * scorer.bias_stride];
    const i64 distance = scorer.position > j ? scorer.position - j : j - scorer.position;
    return score - (double)scorer.slope * (double)distance;
}

template <typename T, typename Acc>
__global__ void __launch_bounds__(NPATTN_THREADS)
repair_kernel(NPATTN_OPERAND_PARAMS, T* out, i64 out_sb, i64 out_sh, i64 out_ss, Acc* lse) {
    constexpr int COLUMNS = NPATTN_MAX_HEAD_DIM / 32;  // columns per lane
    const Operands<T, Acc> in = NPATTN_OPERANDS;
    const i64 heads = ints[NPATTN_INT_HEADS], q_len = ints[NPATTN_INT_Q_LEN], kv_len = ints[NPATTN_INT_KV_LEN];
    const i64 row = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (row >= ints[NPATTN_INT_BATCH] * heads * q_len) return;  // whole warps
    const i64 b = row / (heads * q_len), h = (row / q_len) % heads, i = row % q_len;
    // padding rows keep the zeros and -inf they were given
    if (i < span(spans, b, NPATTN_SPAN_Q_START) || i >= span(spans, b, NPATTN_SPAN_Q_STOP)) return;
    const int value_dim = (int)ints[NPATTN_INT_VALUE_DIM], head_dim = (int)ints[NPATTN_INT_HEAD_DIM];
    T* row_out = out + b * out_sb + h * out_sh + i * out_ss;

    // the check: x - x is 0 for a finite x, NaN for NaN and inf
    int bad = 0;
    for (int d = lane; d < value_dim; d += 32) {
        const double x = Storage<T>::template load<double>(row_out, d);
        bad |= !(x - x == 0);
    }
    if (lane == 0) bad |= lse[row] != lse[row] || lse[row] == -negative_infinity<Acc>();
    if (warp_sum(bad) == 0) return;

    const ScoreRow<T, Acc> scorer(in, b, h, i);
    const i64 kv_head = kv_head_of(ints, h), q_offset = q_row(ints, b, h, i);
    auto score_of = [&](i64 j) {
        return score_in_double(scorer, q, q_offset, k, paged_k_row(ints, pages, b, kv_head, j), head_dim, j);
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
            const i64 v_offset = paged_v_row(ints, pages, b, kv_head, j0 + t);
#pragma unroll
            for (int c = 0; c < COLUMNS; ++c) {
                const int d = lane + 32 * c;
                if (d < value_dim) sums[c] += key_weight * Storage<T>::template load<double>(v, v_offset + d);
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
