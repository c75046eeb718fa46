// A decode step over a quantized cache (contiguous or paged) when a kv head has at most 8 packed
// rows (a GQA group of up to 8 query heads at one query, or a smaller group over a few
// queries): the one-warp tile of forward_tc.cu's REGISTER_CODES with its products
// transposed (Option.TRANSPOSED, which the driver adds to REGISTER_CODES for such
// steps). forward_tc_kernel hands such a block to transposed_code_decode.
//
// forward_tc.cu's decode tile puts the packed rows on mma.m16n8k16's 16 rows, so a
// step with a group of 4 fills 4 of them and three quarters of every product, every
// softmax element and O's 64 accumulators a lane holds work on rows that do not exist.
// Here the keys take the 16 rows and the packed rows the 8 columns:
//
//   S^T (16 keys x 8 rows)  = K (keys x dims)  Q^T (dims x rows)
//   O^T (16 dims x 8 rows) += V^T (dims x keys) P^T (keys x rows)
//
// which halves the mma of a tile (S^T: a 16-key block takes MAX_D / 16 products, where
// S took that many per 8 keys; O^T: MAX_D / 16 products per 16 keys, where O took
// MAX_D / 8), the scores a lane exponentiates (8 per 32-key tile, not 16) and O's
// accumulators (MAX_D / 4 per lane, not MAX_D / 2). Q^T's fragments stay in registers
// for the whole key loop, so Q takes no shared memory.
//
// The orders that are free are chosen so that every lane reads runs of its own rows:
// - Q K^T sums over the head dims in any order: lane (quad, in_quad) takes the dims of
//   its K fragments as one contiguous run, [in_quad MAX_D / 4, + MAX_D / 4), 4 of them
//   per 16-dim step (k-slots 2 in_quad, + 1, + 8, + 9 of step kk are dims 4 kk + 0..3
//   of the run), for its keys `quad` and `quad + 8` of each 16-key block; Q^T's B
//   fragment is then 8 bytes of Q's row `quad` at the same dims.
// - O^T's rows (value dims) are ours to place: m-block mb's row slot `quad` is value
//   dim quad MAX_D / 8 + 2 mb and slot `quad + 8` the dim after it, so the lane's V
//   fragments of a 16-key block are one contiguous run [quad MAX_D / 8, + MAX_D / 8) of
//   its four key rows (2 in_quad, + 1, + 8, + 9), and each row of out it writes is one
//   contiguous run too.
// - P^T's B fragment needs, per lane, one row and four keys, where S^T's accumulators
//   give it two keys of two rows: each 8 x 8 block of P (as 16-bit pairs) is transposed
//   in registers by movmatrix (two per 16-key block).
//
// The block's WARPS warps (sources.TRANSPOSED_WARPS) take their own shares of its keys,
// each with its own two stages, and merge their rows in shared memory at the end (in warp
// order), so that a split step's combine reads a partial row per block, not per warp:
// four times fewer at the same warps in flight.
//
// Everything else is the REGISTER_CODES tile's: codes staged two tiles ahead by
// cp.async (CodeStages) and converted in registers unscaled, the keys' scales on the
// scores in float32, the values' scales in P relative to R (the largest value scale
// seen; O kept in units of R), the online softmax in base 2, every option through
// ScoreRow. A row's keys are spread over the lanes of one in_quad (its 8 quads), so its
// max and sum are reduced across lane bits 2-4 where the untransposed tile reduces
// across bits 0-1.
#pragma once
#include "common.cuh"
#include "tensor_core.cuh"

// NPATTN_EARLY_COPIES (a switch for a lent GPU to time, through NPATTN_GPU_DEFINES;
// untimed so far): the block's first two tiles' copies issued as soon as the warp knows its
// keys and where their codes lie, before Q's load and the rest of the loop's set-up, so
// that the first tile's latency overlaps them. By default they come last, and ptxas
// placed two of the loop's scalar loads (the codes' kind, the softmax scale) behind them
// in the load/store queue (H200, 2026-11-30: 172 of the forward's 1973 samples).
#ifdef NPATTN_EARLY_COPIES
constexpr bool EARLY_COPIES = true;
#else
constexpr bool EARLY_COPIES = false;
#endif

// S^T (16 keys x 8 rows, unscaled) += K Q^T for one 16-key block: k_words[h][kk] the
// lane's codes of key quad + 8 h at dims 4 kk + 0..3 of its run, q_words Q^T's B
// fragments (dims 4 kk + 0, 1 in word 2 kk; + 2, 3 in word 2 kk + 1).
template <typename T, bool E4M3, int MAX_D>
__device__ inline void transposed_scores(float (&s)[4], const u32 (&k_words)[2][MAX_D / 16],
                                         const u32 (&q_words)[MAX_D / 8]) {
#pragma unroll
    for (int kk = 0; kk < MAX_D / 16; ++kk) {
        u32 upper[2], lower[2];  // keys quad and quad + 8, dims (0, 1) and (2, 3)
        code_pairs<T, E4M3>(k_words[0][kk], upper);
        code_pairs<T, E4M3>(k_words[1][kk], lower);
        const u32 a[4] = {upper[0], lower[0], upper[1], lower[1]};
        const u32 b[2] = {q_words[2 * kk], q_words[2 * kk + 1]};
        mma_16816<T>(s, a, b);
    }
}

// O^T += V^T P^T for one 16-key block: v_words[r][w] the lane's codes of key row
// 2 in_quad + (r & 1) + 8 (r >> 1) at dims 4 w + 0..3 of its run; p P^T's B fragment.
// Dim pair (2 mb, 2 mb + 1) of the run is byte pair i, i + 1 of word w = mb / 2 (i =
// 2 (mb % 2)): one byte permute gathers it from two key rows as (key, next key) pairs.
template <typename T, bool E4M3, int MAX_D>
__device__ inline void transposed_values(float (&o)[MAX_D / 16][4], const u32 (&v_words)[4][MAX_D / 32],
                                         const u32 (&p)[2]) {
#pragma unroll
    for (int w = 0; w < MAX_D / 32; ++w) {
#pragma unroll
        for (int i = 0; i < 4; i += 2) {
            const u32 selector = i | (4 + i) << 4 | (i + 1) << 8 | (5 + i) << 12;
            u32 upper[2], lower[2];  // keys (2 in_quad, + 1) and (+ 8, + 9), dims 2 mb and 2 mb + 1
            code_pairs<T, E4M3>(byte_permute(v_words[0][w], v_words[1][w], selector), upper);
            code_pairs<T, E4M3>(byte_permute(v_words[2][w], v_words[3][w], selector), lower);
            const u32 a[4] = {upper[0], upper[1], lower[0], lower[1]};
            mma_16816<T>(o[2 * w + i / 2], a, p);
        }
    }
}

// One block (WARPS warps) of forward_tc_kernel under TRANSPOSED: packed rows [p0, p0 +
// rows) of kv head `kv_head` of entry b (rows <= 8), split `split` of `splits` of the
// keys; out, lse and the split partials as forward_tc_kernel writes them. `shared`:
// the block's dynamic shared memory (two CodeStages a warp).
template <typename T, typename Acc, int MAX_D, int BK, int WARPS, unsigned OPTIONS>
__device__ inline void transposed_code_decode(const Operands<T, Acc>& in, i64 b, i64 kv_head, i64 p0, int rows,
                                              i64 split, i64 splits, T* out, i64 out_sb, i64 out_sh, i64 out_ss,
                                              Acc* lse, Acc* partial, unsigned char* shared) {
    static_assert(BK % 16 == 0 && (MAX_D == 64 || MAX_D == 128), "whole 16-key blocks; a run of whole words");
    constexpr int BLOCKS = BK / 16;            // 16-key blocks of a tile (S^T's m16 fragments)
    constexpr int DIM_BLOCKS = MAX_D / 16;     // 16-dim blocks (O^T's m16 fragments)
    constexpr int V_WORDS = MAX_D / 32;        // a lane's words of one value row
    constexpr int RUN = MAX_D / 8;             // value dims of a lane's run (and of out's rows it writes)
    constexpr bool SCORE_OPTIONS = (OPTIONS & NPATTN_OPTION_PER_SCORE) != 0;
    constexpr bool BAND = (OPTIONS & NPATTN_OPTION_BAND) != 0;
    using Stages = CodeStages<BK, MAX_D>;
    const i64* ints = in.ints;
    const i64 heads = ints[NPATTN_INT_HEADS], q_len = ints[NPATTN_INT_Q_LEN];
    const i64 group = heads / ints[NPATTN_INT_KV_HEADS];
    const int value_dim = (int)ints[NPATTN_INT_VALUE_DIM];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, quad = lane / 4, in_quad = lane % 4;
    const float lowest = negative_infinity<float>();
    // tile row r is packed row p0 + r; rows past `rows` stand in for the last one
    auto packed = [&](int r) { return p0 + (r < rows ? r : rows - 1); };
    auto head_of = [&](int r) { return kv_head * group + packed(r) % group; };
    auto query_of = [&](int r) { return packed(r) / group; };
    // this lane's two rows: S^T's and O^T's columns 2 in_quad + x
    const int my_rows[2] = {2 * in_quad, 2 * in_quad + 1};
    const bool row_valid[2] = {my_rows[0] < rows, my_rows[1] < rows};

    // Q^T's B fragments, for the whole loop: row `quad` at the dims of this lane's run
    // (zeros for a row past `rows`: its column of S^T is never read)
    u32 q_words[MAX_D / 8];
    auto load_q = [&]() {
        const T* run = in.q + q_row(ints, b, head_of(quad), query_of(quad)) + in_quad * (MAX_D / 4);
#pragma unroll
        for (int w = 0; w < MAX_D / 8; w += 4) {
            uint4 chunk = {0u, 0u, 0u, 0u};
            if (quad < rows) chunk = *reinterpret_cast<const uint4*>(run + 2 * w);
            q_words[w] = chunk.x;
            q_words[w + 1] = chunk.y;
            q_words[w + 2] = chunk.z;
            q_words[w + 3] = chunk.w;
        }
    };
    if constexpr (!EARLY_COPIES) load_q();

    const i64 i_first = p0 / group, i_last = (p0 + rows - 1) / group;
    // this warp's share of the block's split: sub-split split WARPS + warp of splits WARPS
    const KeyTiles key_tiles(
        key_ranges(ints, in.spans, b, i_first, i_last + 1, BK, split * WARPS + warp, splits * WARPS), BK);
    const i64 tile_count = key_tiles.total();
    // (a decode step's usual case: no tile needs the band's test)
    const bool every_tile_visible = BAND && !SCORE_OPTIONS && tiles_fully_visible(ints, in.spans, b, i_first, i_last + 1, key_tiles);
    const HeadCodes<(OPTIONS & NPATTN_OPTION_PAGED) != 0> codes(in, b, kv_head);
    const Stages stages{shared + warp * 2 * Stages::BYTES};
    // the first two tiles' copies, issued where EARLY_COPIES says (the loads of Q and of
    // the scalars the loop reads come before them by default, after them with it)
    auto first_copies = [&]() {
        if (tile_count > 0) stages.fetch(codes, 0, key_tiles.start(0), key_tiles.keys(0), lane);
        cp_async_commit();
        if (tile_count > 1) stages.fetch(codes, 1, key_tiles.start(1), key_tiles.keys(1), lane);
        cp_async_commit();
    };
    if constexpr (EARLY_COPIES) {
        first_copies();
        load_q();
    }
    const bool e4m3 = ints[NPATTN_INT_KV_CODES] == NPATTN_KVCODES_FLOAT8;
    // the rows' ScoreRows, built for each tile that needs them (a tile past the band's
    // edges and with no score option, a decode step's usual one, needs none): kept through
    // the loop, their state took registers the tile needs (8-16 bytes of stack at 168)
    auto scorer = [&](int x) { return ScoreRow<T, Acc, OPTIONS>(in, b, head_of(my_rows[x]), query_of(my_rows[x])); };
    // (the sink's column once a row: in warp 0's share)
    const bool has_sink = (OPTIONS & NPATTN_OPTION_SINK) && ints[NPATTN_INT_HAS_SINK] != 0 && splits == 1 && warp == 0;
    const bool has_dropout = (OPTIONS & NPATTN_OPTION_DROPOUT) && ints[NPATTN_INT_HAS_DROPOUT] != 0;
    // m: a row's running max in base 2; l: this lane's share of its running sum (its 8
    // quads' shares are added once, at the end)
    float m[2], l[2];
    bool seen[2];
    u32 dropout_state[2];
#pragma unroll
    for (int x = 0; x < 2; ++x) {
        seen[x] = false;
        m[x] = has_sink ? (float)in.sink[head_of(my_rows[x])] * NPATTN_LOG2E : lowest;  // a first column of value 0
        l[x] = has_sink && quad == 0 ? 1.0f : 0.0f;
        dropout_state[x] = has_dropout ? dropout_row_state(ints, b, head_of(my_rows[x]), query_of(my_rows[x])) : 0u;
    }
    float o[DIM_BLOCKS][4];  // O^T: [mb][2 h + x] is dim quad RUN + 2 mb + h of row x
#pragma unroll
    for (int mb = 0; mb < DIM_BLOCKS; ++mb) o[mb][0] = o[mb][1] = o[mb][2] = o[mb][3] = 0.0f;
    float value_reference = 0.0f;  // R
    const float scale_log2 = (float)in.reals[NPATTN_REAL_SCALE] * NPATTN_LOG2E;

    if constexpr (!EARLY_COPIES) first_copies();

    for (i64 t = 0; t < tile_count; ++t) {
        const i64 j0 = key_tiles.start(t);
        const int cols = key_tiles.keys(t);
        const unsigned char* stage = stages.stage(t);
        cp_async_wait<1>();  // tile t's stage (tile t + 1's may still be in flight)
        __syncwarp();        // every lane's copies of it landed

        // S^T = K Q^T, times each key's scale: s[n][2 h + x] is key 16 n + quad + 8 h of row x
        float s[BLOCKS][4], value_scale[BLOCKS][2];
#pragma unroll
        for (int n = 0; n < BLOCKS; ++n) {
            u32 k_words[2][MAX_D / 16];
            float key_scale[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int key = 16 * n + quad + 8 * h;
                key_scale[h] = Stages::k_scale(stage, key);
                value_scale[n][h] = Stages::v_scale(stage, key);
                const unsigned char* run = Stages::k_row(stage, key) + in_quad * (MAX_D / 4);
#pragma unroll
                for (int w = 0; w < MAX_D / 16; w += 4) {
                    const uint4 chunk = *reinterpret_cast<const uint4*>(run + 4 * w);
                    k_words[h][w] = chunk.x;
                    k_words[h][w + 1] = chunk.y;
                    k_words[h][w + 2] = chunk.z;
                    k_words[h][w + 3] = chunk.w;
                }
            }
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
            if (e4m3) {
                transposed_scores<T, true, MAX_D>(s[n], k_words, q_words);
            } else {
                transposed_scores<T, false, MAX_D>(s[n], k_words, q_words);
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] *= key_scale[e >> 1];
        }

        // scores in base 2
        bool plain_tile = !SCORE_OPTIONS;
        if (plain_tile && BAND && !every_tile_visible) {
            plain_tile = tile_fully_visible(ints, in.spans, b, i_first, i_last + 1, j0, j0 + cols);
        }
        if (plain_tile) {
#pragma unroll
            for (int n = 0; n < BLOCKS; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int c = 16 * n + quad + 8 * (e >> 1);
                    s[n][e] = c < cols ? scale_log2 * s[n][e] : lowest;
                }
            }
        } else {
#pragma unroll
            for (int x = 0; x < 2; ++x) {
                const ScoreRow<T, Acc, OPTIONS> row = scorer(x);
#pragma unroll
                for (int n = 0; n < BLOCKS; ++n) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int c = 16 * n + quad + 8 * h;
                        float tanh_unused;
                        float& score = s[n][2 * h + x];
                        score = (row_valid[x] && c < cols) ? row.score(j0 + c, score, &tanh_unused) * NPATTN_LOG2E
                                                           : lowest;
                    }
                }
            }
        }
        // the online softmax of this lane's two rows, each reduced over its 8 quads
        float shift[2], correction[2];
#pragma unroll
        for (int x = 0; x < 2; ++x) {
            float tile_max = lowest;
#pragma unroll
            for (int n = 0; n < BLOCKS; ++n) {
                tile_max = s[n][x] > tile_max ? s[n][x] : tile_max;
                tile_max = s[n][2 + x] > tile_max ? s[n][2 + x] : tile_max;
            }
#pragma unroll
            for (int offset = 4; offset < 32; offset <<= 1) {  // lane bits 2-4: the quads
                const float other = __shfl_xor_sync(0xffffffffu, tile_max, offset);
                tile_max = other > tile_max ? other : tile_max;
            }
            const float new_max = tile_max > m[x] ? tile_max : m[x];
            const bool any = new_max > lowest;
            shift[x] = any ? new_max : 0.0f;  // nothing visible yet: 2^(-inf - 0) = 0, not NaN
            correction[x] = any ? exp2_approx(m[x] - new_max) : 1.0f;
            m[x] = new_max;
            seen[x] = seen[x] || tile_max > lowest;
            l[x] *= correction[x];
        }
        // R grows to the tile's largest V scale (each quad holds its own keys' scales: the
        // reduction runs over lane bits 2-4); O, in units of R, shrinks by the old R over the new
        float reference_ratio;
        const float inverse = grow_value_reference<4, 32>(value_scale, value_reference, reference_ratio);
#pragma unroll
        for (int n = 0; n < BLOCKS; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int c = 16 * n + quad + 8 * (e >> 1), x = e & 1;
                float p = exp2_approx(s[n][e] - shift[x]);
                l[x] += p;
                if (has_dropout && row_valid[x] && c < cols && !dropout_keeps(ints, dropout_state[x], j0 + c)) p = 0.0f;
                s[n][e] = p * (value_scale[n][e >> 1] * inverse);
            }
        }
#pragma unroll
        for (int mb = 0; mb < DIM_BLOCKS; ++mb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) o[mb][e] *= correction[e & 1] * reference_ratio;
        }

        // O^T += V^T P^T, a 16-key block at a time
#pragma unroll
        for (int kb = 0; kb < BLOCKS; ++kb) {
            const u32 p[2] = {transpose_8x8(pack_pair<T>(s[kb][0], s[kb][1])),
                              transpose_8x8(pack_pair<T>(s[kb][2], s[kb][3]))};
            u32 v_words[4][V_WORDS];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int key = 16 * kb + 2 * in_quad + (r & 1) + 8 * (r >> 1);
                const unsigned char* run = Stages::v_row(stage, key) + quad * RUN;
                if constexpr (V_WORDS == 4) {
                    const uint4 chunk = *reinterpret_cast<const uint4*>(run);
                    v_words[r][0] = chunk.x;
                    v_words[r][1] = chunk.y;
                    v_words[r][2] = chunk.z;
                    v_words[r][3] = chunk.w;
                } else {
                    const uint2 chunk = *reinterpret_cast<const uint2*>(run);
                    v_words[r][0] = chunk.x;
                    v_words[r][1] = chunk.y;
                }
            }
            if (e4m3) {
                transposed_values<T, true, MAX_D>(o, v_words, p);
            } else {
                transposed_values<T, false, MAX_D>(o, v_words, p);
            }
        }
        __syncwarp();  // every lane is done with tile t's stage, which tile t + 2 takes
        if (t + 2 < tile_count) stages.fetch(codes, t + 2, key_tiles.start(t + 2), key_tiles.keys(t + 2), lane);
        cp_async_commit();
    }
    cp_async_wait<0>();  // the last (empty) groups

#pragma unroll
    for (int x = 0; x < 2; ++x) {
#pragma unroll
        for (int offset = 4; offset < 32; offset <<= 1) l[x] += __shfl_xor_sync(0xffffffffu, l[x], offset);
        seen[x] = seen[x] || l[x] != l[x];  // a visible NaN score (the max skips it): a NaN row, not empty
    }
    // O back from units of R; this lane's run of row x is dims quad RUN + [0, RUN)
#pragma unroll
    for (int mb = 0; mb < DIM_BLOCKS; ++mb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mb][e] *= value_reference;
    }
    if constexpr (WARPS > 1) {
        // the warps' rows merged by warp 0, in warp order, through the stages' bytes: each
        // warp's accumulators (lane-minor, so a warp's stores and loads take every bank
        // once), then each row's max, sum and seen flag. A share whose max is -inf saw no
        // key (its sum and rows are 0) or only NaN scores (NaN): any factor keeps those, so
        // 1, not exp2's NaN of -inf less -inf.
        constexpr int ACCUMULATORS = DIM_BLOCKS * 4, PER_WARP = 32 * ACCUMULATORS + 3 * 8;
        static_assert(WARPS * PER_WARP * 4 <= WARPS * 2 * Stages::BYTES, "the merge fits the stages");
        float* merged = reinterpret_cast<float*>(shared);
        __syncthreads();  // every warp is done with its stages
        float* mine = merged + warp * PER_WARP;
#pragma unroll
        for (int mb = 0; mb < DIM_BLOCKS; ++mb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) mine[(4 * mb + e) * 32 + lane] = o[mb][e];
        }
        if (quad == 0) {
#pragma unroll
            for (int x = 0; x < 2; ++x) {
                float* row = mine + 32 * ACCUMULATORS + 3 * my_rows[x];
                row[0] = m[x];
                row[1] = l[x];
                row[2] = seen[x] ? 1.0f : 0.0f;
            }
        }
        __syncthreads();
        if (warp != 0) return;
        float factor[2][WARPS];
#pragma unroll
        for (int x = 0; x < 2; ++x) {
            float top = lowest;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                const float their_max = merged[w * PER_WARP + 32 * ACCUMULATORS + 3 * my_rows[x]];
                top = their_max > top ? their_max : top;
            }
            float sum = 0.0f;
            bool any = false;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                const float* row = merged + w * PER_WARP + 32 * ACCUMULATORS + 3 * my_rows[x];
                factor[x][w] = row[0] > lowest ? exp2_approx(row[0] - top) : 1.0f;
                sum += row[1] * factor[x][w];
                any = any || row[2] != 0.0f;
            }
            m[x] = top;
            l[x] = sum;
            seen[x] = any;
        }
#pragma unroll
        for (int mb = 0; mb < DIM_BLOCKS; ++mb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float total = 0.0f;
#pragma unroll
                for (int w = 0; w < WARPS; ++w) total += merged[w * PER_WARP + (4 * mb + e) * 32 + lane] * factor[e & 1][w];
                o[mb][e] = total;
            }
        }
    }
    if (splits > 1) {  // unnormalized rows, max and sum (natural log), merged as forward_tc_kernel says
#pragma unroll
        for (int x = 0; x < 2; ++x) {
            if (!row_valid[x]) continue;
            const i64 row = (b * heads + head_of(my_rows[x])) * q_len + query_of(my_rows[x]);
            Acc* mine = partial + (row * splits + split) * (value_dim + 3);
#pragma unroll
            for (int mb = 0; mb < DIM_BLOCKS; ++mb) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int d = quad * RUN + 2 * mb + h;
                    if (d < value_dim) mine[d] = o[mb][2 * h + x];
                }
            }
            if (quad == 0) {
                mine[value_dim] = m[x] * NPATTN_LN2;
                mine[value_dim + 1] = l[x];
                mine[value_dim + 2] = seen[x];
            }
        }
        return;
    }
    // normalized, rounded to T in pairs and written as 16-byte chunks of the run
#pragma unroll
    for (int x = 0; x < 2; ++x) {
        if (!row_valid[x]) continue;
        const float factor = seen[x] ? (float)in.reals[NPATTN_REAL_KEEP_SCALE] / l[x] : 0.0f;
        u32 pairs[DIM_BLOCKS];
#pragma unroll
        for (int mb = 0; mb < DIM_BLOCKS; ++mb) pairs[mb] = pack_pair<T>(o[mb][x] * factor, o[mb][2 + x] * factor);
        const int r = my_rows[x];
        T* destination = out + b * out_sb + head_of(r) * out_sh + query_of(r) * out_ss + quad * RUN;
#pragma unroll
        for (int w = 0; w < DIM_BLOCKS; w += 4) {
            uint4 chunk;
            chunk.x = pairs[w];
            chunk.y = pairs[w + 1];
            chunk.z = pairs[w + 2];
            chunk.w = pairs[w + 3];
            *reinterpret_cast<uint4*>(destination + 2 * w) = chunk;
        }
        if (quad == 0) {  // every live row's lse: -inf for a row that saw no key
            lse[(b * heads + head_of(r)) * q_len + query_of(r)] = seen[x] ? m[x] * NPATTN_LN2 + log_of(l[x])
                                                                         : negative_infinity<float>();
        }
    }
}
