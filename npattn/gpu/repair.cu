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
// itself; and store_merged_row, merge.cuh, on each row that combine_kernel, below, or
// the forward merges from split keys, so a split call launches no repair_kernel): a row
// whose out and lse are finite (lse may be -inf: a row that saw nothing) is left as it
// is. Any other row is recomputed in float64 by the reference's steps
// (npattn/reference.py), reading only the keys the row sees: scores (scale, softcap,
// bias, ALiBi; ScoreRow's parameters and visibility),
// the max (NaN-propagating) with the sink logit, the sum, dropout's keep mask, and out
// as the sum over the visible keys of weight * v in key order, so 0 * NaN reaches the
// row exactly when the reference's does. Then out (in the inputs' dtype, rounded once
// from float32 for 16-bit inputs) and lse are written over the row.
#include "common.cuh"
#include "merge.cuh"

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
// warps, ... in chunk order; add_split_chunks, merge.cuh). The lanes' sums are added by a
// fixed tree, and the warps' results in warp order. (With one warp, at most COMBINE_CHUNK
// splits, these are the steps of the forward's own merge, merge_item_if_last, which the
// driver takes there instead of this launch.)
// (One warp per row, reading split after split, made a decode step at batch 1 with one kv
// head and 256 splits take 274-277 us of device time on an H200, where the forward kernel
// takes 13-14. Then a warp per 32 splits, each chunk of 32 taken 8 at a time: at batch 1
// and 33 splits a row the combine still took 13.9 us under Nsight Compute, one warp running
// four chunks of about 700 dependent instructions at 9 cycles each.) Shared memory:
// combine_shared_bytes (launch.py), a row of value_dim + 1 sums per warp.
// (The 1 lets it take the registers it wants: with repair_row inlined it kept 16 bytes of
// spills at 128 registers on sm_90; it takes 188 and none.)
// (Under NPATTN_PARAMETER_SCALARS the kernel's block, which combine_kernel, below, calls
// with the ints and reals it took by value; the default build keeps the kernel as it was.)
#ifdef NPATTN_PARAMETER_SCALARS
#define NPATTN_COMBINE_ENTRY __device__ __forceinline__ void combine_block
#else
#define NPATTN_COMBINE_ENTRY __global__ void __launch_bounds__(NPATTN_COMBINE_THREADS, 1) combine_kernel
#endif
template <typename T, typename Acc, int MAX_D>
NPATTN_COMBINE_ENTRY(NPATTN_OPERAND_PARAMS, T* out, i64 out_sb, i64 out_sh, i64 out_ss, Acc* lse, i64 splits,
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
    fold_split_maxima<false>(parts, splits, value_dim3, value_dim, threadIdx.x, blockDim.x, m, seen);
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
    if (seen == 0) {  // no visible key
        store_empty_row(row_out, lse + row, value_dim, threadIdx.x, blockDim.x);
        return;
    }
    Acc l = 0;  // this lane's share of the sum (its splits'), added across lanes at the end
    Acc total[COLUMNS];
#pragma unroll
    for (int c = 0; c < COLUMNS; ++c) total[c] = 0;
    // (a row's splits fit an int: splits x (D + 3) floats)
    add_split_chunks<false, COLUMNS>(parts, splits, (int)value_dim3, value_dim, m, warp, warps, lane, total, l);
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
    const Operands<T, Acc> in = NPATTN_OPERANDS;
    store_merged_row(in, row, lane, total, l, m, row_out, value_dim, out, out_sb, out_sh, out_ss, lse);
}

#ifdef NPATTN_PARAMETER_SCALARS
template <typename T, typename Acc, int MAX_D>
__global__ void __launch_bounds__(NPATTN_COMBINE_THREADS, 1)
combine_kernel(NPATTN_OPERAND_PARAMS, T* out, i64 out_sb, i64 out_sh, i64 out_ss, Acc* lse, i64 splits,
               const Acc* partial NPATTN_SCALARS_PARAMETER) {
    combine_block<T, Acc, MAX_D>(NPATTN_OPERAND_ARGUMENTS(NPATTN_KERNEL_INTS, NPATTN_KERNEL_REALS), out, out_sb, out_sh,
                                 out_ss, lse, splits, partial);
}
#endif
