// The forward for float16 and bfloat16 inputs on tensor cores, the way FlashAttention-2
// does it: mma.sync m16n8k16 with float32 accumulation, K and V streamed by cp.async
// into swizzled shared tiles, every operand fragment loaded by ldmatrix, the online
// softmax in registers in base 2, P fed to P V straight from S's registers.
//
// One block of WARPS warps per (batch, kv head, tile of 16 * FRAGS * WARPS packed rows);
// warp w owns FRAGS m16 fragments of 16 rows for the whole key loop, so a row's max and
// sum live in the 4 lanes of a quad. With FRAGS = 2 (FlashAttention-2's layout at
// d = 128: 4 warps x 32 rows) each K or V fragment a warp loads by ldmatrix feeds two
// mma instead of one, and each lane has two independent softmax chains in flight. The rows are the query heads of one GQA group interleaved with the query rows
// (packed row p is query row p / group of head kv_head * group + p % group), so each
// K/V byte a block loads serves the whole group: a decode step (one query row) fills
// `group` rows instead of one. Causal bands stay monotone in p, so tile skipping works
// on packed rows as on plain ones.
//
// Per key tile of BK keys, with STAGES = 1 (FlashAttention-2's overlap): wait for K_t;
// issue V_t's copies; S = Q K_t^T; issue K_t+1's copies; scores and softmax; wait for
// V_t; O += P V_t. So each tile's loads run under the previous product. With STAGES = 2
// (two K and two V tiles in shared memory): wait for K_t and V_t; issue K_t+1 and V_t+1
// into the other stage; S, softmax and P V with no wait, the next tile's loads running
// under all of it.
//
// A quantized cache's codes (OPTIONS has CODES) take the same path through shared memory
// (CodeTile, tensor_core.cuh): copied by cp.async as 16-bit tiles are, then dequantized
// into the 16-bit tiles by the threads that copied them, each code times its row's scale
// rounded once to T. A decode step (REGISTER_CODES; contiguous or paged) instead reads
// the raw codes from shared memory into the mma fragments' registers, converts them
// there unscaled, and applies the scales in float32 outside the products (see the key
// loop).
//
// OPTIONS (npattn.gpu.options) compiles in only the options a call has; tiles that
// every row sees whole and no score option touches run the scale alone. The output is
// normalized once at the end, staged in shared memory and written as 16-byte rows in
// the input dtype (split-KV partials stay float32 for combine_kernel).
#include "common.cuh"
#include "tensor_core.cuh"
#include "merge.cuh"
#include "forward.cu"
#include "decode_tc.cu"

// A decode step's one-warp tiles stage whole-width contiguous K and V tiles with
// stage_strided_rows (tensor_core.cuh; STRIDED_STAGING): a few instructions per 16-byte
// copy where stage_tile's general loop spends about 60, which was three quarters of such
// a tile's instructions (about 2,500 -> 1,000 per 32-key tile at d = 128, read off the
// SASS; untimed).

// Shared memory of forward_tc_kernel, in 16-bit elements: swizzled Q (BQ rows), then
// `stages` K tiles and `stages` V tiles (BK rows each); head dims rounded up to whole mma
// tiles (16), rows to 64 elements. With CODES, a K tile and a V tile of a quantized
// cache's byte codes follow (CodeTile: BK rows of ld_qk and of ld_v bytes, each row
// CODE_ROW_PAD bytes more). After the key loop the same bytes stage the output tile
// (BQ x value_dim).
struct ForwardTensorCoreLayout {
    int head_dim, value_dim, ld_qk, ld_v, q, k, v, k_stage, v_stage, k_codes, v_codes;
    __device__ ForwardTensorCoreLayout(int head_dim_, int value_dim_, int block_q, int block_k, int stages) {
        head_dim = (head_dim_ + 15) / 16 * 16;
        value_dim = (value_dim_ + 15) / 16 * 16;
        ld_qk = (head_dim + 63) / 64 * 64;
        ld_v = (value_dim + 63) / 64 * 64;
        k_stage = block_k * ld_qk;
        v_stage = block_k * ld_v;
        q = 0;
        k = q + block_q * ld_qk;
        v = k + stages * k_stage;
        k_codes = v + stages * v_stage;
        v_codes = k_codes + block_k * (ld_qk + CODE_ROW_PAD) / 2;
    }
};

// body(f, n, e, x, c) for every score a lane holds in S's accumulators (FRAGS row
// fragments x KEY_BLOCKS 8-key blocks x 4): fragment f, block n, element e, which is of
// the lane's row x and the tile's column c (the lane's place in its quad: in_quad).
template <int FRAGS, int KEY_BLOCKS, typename Body> __device__ inline void each_score(int in_quad, Body&& body) {
#pragma unroll
    for (int f = 0; f < FRAGS; ++f) {
#pragma unroll
        for (int n = 0; n < KEY_BLOCKS; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) body(f, n, e, 2 * f + e / 2, n * 8 + 2 * in_quad + (e & 1));
        }
    }
}

// REGISTER_CODES (below): S (one 16-row fragment x 8 KEY_BLOCKS keys) = Q K^T from the
// lane's K codes (k_words[n]: key 8 n + quad, dims [in_quad MAX_D / 4, + MAX_D / 4)) and
// Q's A fragments read in the same order of dims from the swizzled Q tile; unscaled.
template <typename T, bool E4M3, int MAX_D, int KEY_BLOCKS, int K_WORDS>
__device__ inline void code_scores(float (&s)[KEY_BLOCKS][4], const u32 (&k_words)[KEY_BLOCKS][K_WORDS],
                                   const unsigned short* qs, int ld, int quad, int in_quad) {
#pragma unroll
    for (int kk = 0; kk < MAX_D / 16; ++kk) {
        const int column = in_quad * (MAX_D / 4) + 4 * kk;
        const uint2 upper = *reinterpret_cast<const uint2*>(qs + swizzled(quad, column, ld));
        const uint2 lower = *reinterpret_cast<const uint2*>(qs + swizzled(quad + 8, column, ld));
        const u32 a[4] = {upper.x, lower.x, upper.y, lower.y};
#pragma unroll
        for (int n = 0; n < KEY_BLOCKS; ++n) {
            u32 bk[2];
            code_pairs<T, E4M3>(k_words[n][kk], bk);
            mma_16816<T>(s[n], a, bk);
        }
    }
}

// REGISTER_CODES: O (one 16-row fragment, value block n's column slot quad being value
// dim quad MAX_D / 8 + n) += P V for one 16-key block, P's A fragment `a`, the lane's V
// codes v_words[r] (its rows 16 kk + 2 in_quad, + 1, + 8, + 9). Value block 4 w + i + e
// takes byte i + e of word w of the four rows: rows 0 and 1 in its bv[0], 2 and 3 in bv[1].
template <typename T, bool E4M3, int VALUE_BLOCKS, int V_WORDS>
__device__ inline void add_code_values(float (&o)[VALUE_BLOCKS][4], const u32 (&a)[4], const u32 (&v_words)[4][V_WORDS]) {
#pragma unroll
    for (int w = 0; w < V_WORDS; ++w) {
#pragma unroll
        for (int i = 0; i < 4; i += 2) {
            const u32 selector = i | (4 + i) << 4 | (i + 1) << 8 | (5 + i) << 12;
            u32 upper[2], lower[2];
            code_pairs<T, E4M3>(byte_permute(v_words[0][w], v_words[1][w], selector), upper);
            code_pairs<T, E4M3>(byte_permute(v_words[2][w], v_words[3][w], selector), lower);
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const u32 bv[2] = {upper[e], lower[e]};
                mma_16816<T>(o[4 * w + i + e], a, bv);
            }
        }
    }
}

// The blocks of the TRANSPOSED decode tile an SM should hold: its shared memory (18.5 KB a
// warp at 128-wide heads) lets 3 blocks of 4 warps share one, and its registers are
// capped to match (168, with 8 bytes of stack at 128-wide heads and none at 64; uncapped,
// NVRTC's sm_90 build took 168 or 244-246 as the code around it changed, and 244 lets 2
// blocks fit). Every other instantiation: no cap (0).
#define NPATTN_TRANSPOSED_BLOCKS_PER_SM 3

// The kernel; under NPATTN_PARAMETER_SCALARS its block, which forward_tc_kernel (at the
// end of this file) calls with the ints and reals it took by value. (Only under the
// switch: as a device function called by the kernel, the default build's 64-wide
// one-warp tile took 8 bytes of stack at 168 registers on sm_90, where the kernel itself
// keeps none.)
//
// Its launch bounds: TRANSPOSED's cap (above); with MERGES at least 1 block an SM, which
// lets the merge's code (after the key loop) leave the loop's registers alone (sm_90,
// forward_tc.cu's 128-wide decode tile: 212 registers and no stack; with the bound left
// open, ptxas took 168 and spilled inside the loop); else none.
#define NPATTN_FORWARD_TC_BOUNDS                                                                   \
    __launch_bounds__(WARPS * 32, (OPTIONS & NPATTN_OPTION_TRANSPOSED) ? NPATTN_TRANSPOSED_BLOCKS_PER_SM \
                                  : (OPTIONS & NPATTN_OPTION_MERGES)   ? 1                               \
                                                                       : 0)
#ifdef NPATTN_PARAMETER_SCALARS
#define NPATTN_FORWARD_TC_ENTRY __device__ __forceinline__ void forward_tc_block
#else
#define NPATTN_FORWARD_TC_ENTRY __global__ void NPATTN_FORWARD_TC_BOUNDS forward_tc_kernel
#endif
template <typename T, typename Acc, int MAX_D, int WARPS, int FRAGS, int BK, int STAGES, unsigned OPTIONS>
NPATTN_FORWARD_TC_ENTRY(NPATTN_OPERAND_PARAMS, T* out, i64 out_sb, i64 out_sh, i64 out_ss, Acc* lse, i64 splits,
                        Acc* partial) {
    static_assert(sizeof(Acc) == 4, "tensor-core tiles accumulate in float32");
    static_assert(BK % 16 == 0 && MAX_D % 16 == 0, "whole mma tiles");
    static_assert(FRAGS == 1 || FRAGS == 2, "one or two m16 row fragments per warp");
    static_assert(STAGES == 1 || STAGES == 2, "one K/V tile in shared memory, or two");
    constexpr int WARP_ROWS = 16 * FRAGS;
    constexpr int BQ = WARP_ROWS * WARPS;
    constexpr int ROWS = 2 * FRAGS;          // rows per lane: fragment f's quad + 0 and quad + 8
    constexpr int KEY_BLOCKS = BK / 8;       // 8-key column blocks of S
    constexpr int VALUE_BLOCKS = MAX_D / 8;  // 8-column blocks of O
    constexpr bool ASYNC = !(OPTIONS & NPATTN_OPTION_UNALIGNED);
    constexpr bool SCORE_OPTIONS = (OPTIONS & NPATTN_OPTION_PER_SCORE) != 0;
    constexpr bool CODES = (OPTIONS & NPATTN_OPTION_CODES) != 0, PAGED = (OPTIONS & NPATTN_OPTION_PAGED) != 0;
    const Operands<T, Acc> in = NPATTN_OPERANDS;
    prefetch_lines(ints, NPATTN_INT_COUNT, threadIdx.x % 32);  // (NPATTN_PREFETCH_PARAMETERS)
    prefetch_lines(reals, NPATTN_REAL_COUNT, threadIdx.x % 32);
    const i64 heads = ints[NPATTN_INT_HEADS], kv_heads = ints[NPATTN_INT_KV_HEADS], q_len = ints[NPATTN_INT_Q_LEN];
    const i64 group = heads / kv_heads;
    const i64 tiles = (q_len * group + BQ - 1) / BQ;
    const i64 item = blockIdx.x / splits, split = blockIdx.x % splits;
    const i64 b = item / (kv_heads * tiles), kv_head = (item / tiles) % kv_heads;
    // the last row tiles first: under causal masking they see the most keys, and a wave
    // that starts with the longest blocks ends with the shortest ones (less tail)
    const i64 tile_p0 = (tiles - 1 - item % tiles) * BQ;
    // its live packed rows: those of the entry's live queries [Q_START, Q_STOP)
    const i64 p0 = larger(tile_p0, span(spans, b, NPATTN_SPAN_Q_START) * group);
    const int rows = (int)(smaller(smaller(q_len, span(spans, b, NPATTN_SPAN_Q_STOP)) * group, tile_p0 + BQ) - p0);
    if (rows <= 0) return;  // the same for the whole block
    const int head_dim = (int)ints[NPATTN_INT_HEAD_DIM], value_dim = (int)ints[NPATTN_INT_VALUE_DIM];
    NPATTN_DYNAMIC_SHARED(shared_bytes);
    // TRANSPOSED: a decode step of at most 8 packed rows over a quantized cache,
    // with the products transposed (decode_tc.cu)
    constexpr bool TRANSPOSED = (OPTIONS & NPATTN_OPTION_TRANSPOSED) != 0;
    if constexpr (TRANSPOSED) {
        static_assert((OPTIONS & NPATTN_OPTION_REGISTER_CODES) && FRAGS == 1 && STAGES == 1,
                      "transposed products: REGISTER_CODES's decode tile, its warps sharing the keys");
        transposed_code_decode<T, Acc, MAX_D, BK, WARPS, OPTIONS>(in, b, kv_head, p0, rows, split, splits, out, out_sb,
                                                                  out_sh, out_ss, lse, partial, shared_bytes);
        if constexpr ((OPTIONS & NPATTN_OPTION_MERGES) != 0) {  // (the driver's merges_in_forward)
            if (splits > 1) {
                merge_item_if_last<T, Acc, MAX_D>(in, item, b, kv_head, group, p0, rows, splits, partial, out, out_sb,
                                                  out_sh, out_ss, lse, shared_bytes);
            }
        }
        return;
    }
    unsigned short* shared = reinterpret_cast<unsigned short*>(shared_bytes);
    // without NARROW both head dims round up to MAX_D: the layout and every loop bound
    // over them are compile-time constants (no run-time tests inside the unrolled loops)
    constexpr bool NARROW = (OPTIONS & NPATTN_OPTION_NARROW) != 0;
    const ForwardTensorCoreLayout at(NARROW ? head_dim : MAX_D, NARROW ? value_dim : MAX_D, BQ, BK, STAGES);
    // A decode step's one-warp tile over a quantized cache (contiguous or paged) reads its codes
    // straight into registers in the mma fragments' order (see the key loop) instead of
    // staging them (CodeTile), whose conversion in one-warp blocks bounded the step. The
    // driver asks for it (npattn.gpu.sources.reads_codes_into_registers) where it fits:
    constexpr bool REGISTER_CODES = (OPTIONS & NPATTN_OPTION_REGISTER_CODES) != 0;
    static_assert(!REGISTER_CODES || (CODES && ASYNC && !NARROW && (WARPS == 1 || TRANSPOSED) && FRAGS == 1 &&
                                      STAGES == 1 && (MAX_D == 64 || MAX_D == 128)),
                  "codes in registers: aligned, full-width codes on the one-warp decode tile");
    unsigned short* qs = shared + at.q;
    // K and V tiles of key tile t (its stage's)
    auto ks = [&](i64 t) { return shared + at.k + (STAGES == 2 ? (int)(t & 1) * at.k_stage : 0); };
    auto vs = [&](i64 t) { return shared + at.v + (STAGES == 2 ? (int)(t & 1) * at.v_stage : 0); };
    const int qk_chunks = at.head_dim / 8, v_chunks = at.value_dim / 8;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int quad = lane / 4, in_quad = lane % 4;  // the PTX ISA's groupID and threadID_in_group
    const float lowest = negative_infinity<float>();
    // the tile row of this lane's row x: fragment x / 2, then quad or quad + 8
    auto tile_row = [&](int x) { return warp * WARP_ROWS + (x / 2) * 16 + quad + 8 * (x % 2); };


    // Q, by packed rows
    stage_tile<ASYNC>(qs, at.ld_qk, q, [&](int r) {
        const i64 p = p0 + r;
        return q_row(ints, b, kv_head * group + p % group, p / group);
    }, rows, head_dim, BQ, qk_chunks);
    cp_async_commit();

    // this lane's rows; rows past `rows` stand in for the last one and are never written.
    // Their heads and query positions are worked out where needed, not kept in registers
    // through the key loop.
    auto row_packed = [&](int x) { return p0 + (tile_row(x) < rows ? tile_row(x) : rows - 1); };
    auto row_head = [&](int x) { return kv_head * group + row_packed(x) % group; };
    auto row_query = [&](int x) { return row_packed(x) / group; };
    bool row_valid[ROWS];
#pragma unroll
    for (int x = 0; x < ROWS; ++x) row_valid[x] = tile_row(x) < rows;
    // The rows' ScoreRows (the band's edges, the options' rows): with one fragment, built
    // once and kept through the key loop; with two, whose accumulators take every
    // register, built again for each tile that needs them.
    constexpr bool KEEP_SCORERS = !REGISTER_CODES && FRAGS == 1 && (SCORE_OPTIONS || (OPTIONS & NPATTN_OPTION_BAND) != 0);
    ScoreRow<T, Acc, OPTIONS> kept_scorer[KEEP_SCORERS ? ROWS : 1];
    if constexpr (KEEP_SCORERS) {
#pragma unroll
        for (int x = 0; x < ROWS; ++x) kept_scorer[x] = ScoreRow<T, Acc, OPTIONS>(in, b, row_head(x), row_query(x));
    }
    const bool has_sink = (OPTIONS & NPATTN_OPTION_SINK) && ints[NPATTN_INT_HAS_SINK] != 0 && splits == 1;
    const bool has_dropout = (OPTIONS & NPATTN_OPTION_DROPOUT) && ints[NPATTN_INT_HAS_DROPOUT] != 0;
    u32 dropout_state[ROWS];
    // m: the running max in base 2 (log2(e) folded into the scale); l: this lane's share
    // of the running sum (the quad's four shares are added once, at the end)
    float m[ROWS], l[ROWS];
    bool seen[ROWS];
#pragma unroll
    for (int x = 0; x < ROWS; ++x) {
        seen[x] = false;
        m[x] = has_sink ? (float)sink[row_head(x)] * NPATTN_LOG2E : lowest;  // a first column of value 0
        l[x] = has_sink && in_quad == 0 ? 1.0f : 0.0f;
        dropout_state[x] = has_dropout ? dropout_row_state(ints, b, row_head(x), row_query(x)) : 0u;
    }
    float o[FRAGS][VALUE_BLOCKS][4];
#pragma unroll
    for (int f = 0; f < FRAGS; ++f) {
#pragma unroll
        for (int n = 0; n < VALUE_BLOCKS; ++n) o[f][n][0] = o[f][n][1] = o[f][n][2] = o[f][n][3] = 0.0f;
    }
    const float scale_log2 = (float)in.reals[NPATTN_REAL_SCALE] * NPATTN_LOG2E;

    const i64 i_first = p0 / group, i_last = (p0 + rows - 1) / group;
    const bool e4m3 = CODES && ints[NPATTN_INT_KV_CODES] == NPATTN_KVCODES_FLOAT8;
    unsigned char* k_staged = reinterpret_cast<unsigned char*>(shared + at.k_codes);
    unsigned char* v_staged = reinterpret_cast<unsigned char*>(shared + at.v_codes);
    const KeyTiles key_tiles(key_ranges(ints, spans, b, i_first, i_last + 1, BK, split, splits), BK);
    const i64 tile_count = key_tiles.total();
    // (a decode step's usual case: no tile needs the band's test)
    const bool every_tile_visible = (OPTIONS & NPATTN_OPTION_BAND) && !SCORE_OPTIONS &&
                                    tiles_fully_visible(ints, spans, b, i_first, i_last + 1, key_tiles);
    // key tile t of K or V (strides sb, sh, ss): one stride from its first key's row, or
    // with PAGED, each key's row looked up in its page
    auto stage_keys = [&](const T* x, i64 sb, i64 sh, i64 ss, unsigned short* tile, int ld, int width, int chunks,
                          i64 t, bool values) {
        const i64 j0 = key_tiles.start(t);
        if constexpr (CODES) {  // (x is a stand-in, unread: the codes are in `in`)
            // fetched by plain loads and dequantized at once (the pipelined loop below
            // fetches by cp.async ahead of use instead)
            CodeTile<WARPS * 32, BK, MAX_D> codes;
            unsigned char* staged = values ? v_staged : k_staged;
            codes.template fetch<PAGED, false>(staged, ld, in, values, b, kv_head, j0, key_tiles.keys(t), width);
            codes.template deposit<T>(staged, tile, ld, width, e4m3);
        } else if constexpr (PAGED) {
            stage_tile<ASYNC>(tile, ld, x, [&](int r) { return key_row(ints, pages, b, kv_head, j0 + r, sb, sh, ss); },
                              key_tiles.keys(t), width, BK, chunks);
        } else {
            const i64 row = b * sb + kv_head * sh + j0 * ss;
            constexpr int THREADS = WARPS * 32, CHUNKS = MAX_D / 8;
            if constexpr (STRIDED_STAGING && WARPS == 1 && ASYNC && !NARROW && THREADS % CHUNKS == 0 &&
                          BK % (THREADS / CHUNKS) == 0) {
                stage_strided_rows<THREADS, BK, CHUNKS>(tile, ld, x + row, ss, key_tiles.keys(t));
            } else {
                stage_tile<ASYNC>(tile, ld, x, [&](int r) { return row + r * ss; }, key_tiles.keys(t), width, BK,
                                  chunks);
            }
        }
    };
    auto stage_k = [&](i64 t) {
        stage_keys(k, ints[NPATTN_INT_K_STRIDE_B], ints[NPATTN_INT_K_STRIDE_H], ints[NPATTN_INT_K_STRIDE_S], ks(t),
                   at.ld_qk, head_dim, qk_chunks, t, false);
    };
    auto stage_v = [&](i64 t) {
        stage_keys(v, ints[NPATTN_INT_V_STRIDE_B], ints[NPATTN_INT_V_STRIDE_H], ints[NPATTN_INT_V_STRIDE_S], vs(t),
                   at.ld_v, value_dim, v_chunks, t, true);
    };
    // With CODES and one stage, the codes are staged as 16-bit tiles are (CodeTile): K_t+1's
    // copies issued after S = Q K_t^T and dequantized into K's tile at tile t+1's barrier,
    // V_t's issued after that barrier and dequantized before P V_t's, each under the work
    // between
    constexpr bool PIPELINED_CODES = CODES && STAGES == 1 && !REGISTER_CODES;
    CodeTile<WARPS * 32, BK, MAX_D> k_tile_codes, v_tile_codes;
    auto fetch_codes = [&](CodeTile<WARPS * 32, BK, MAX_D>& codes, bool values, i64 t) {
        codes.template fetch<PAGED, true>(values ? v_staged : k_staged, values ? at.ld_v : at.ld_qk, in, values, b,
                                          kv_head, key_tiles.start(t), key_tiles.keys(t),
                                          values ? value_dim : head_dim);
    };
    // REGISTER_CODES: S = Q K^T sums over the head dims in any order, so each lane takes
    // the dims of its K fragments as one contiguous run of a key row: lane (quad, in_quad)
    // holds key 8 n + quad of each 8-key block n, dims [in_quad MAX_D / 4, + MAX_D / 4),
    // 4 of them per 16-dim step (k-slots 2 in_quad, + 1, + 8, + 9 of step kk are dims
    // in_quad MAX_D / 4 + 4 kk + 0, 1, 2, 3), and Q's A fragments follow the same order.
    // O = P V's output columns are ours to place: column slot `quad` of 8-column block n
    // is value dim quad MAX_D / 8 + n, so the lane's V fragments of each 16-key block are
    // one contiguous run, [quad MAX_D / 8, + MAX_D / 8), of its four key rows (16 kk +
    // 2 in_quad, + 1, + 8, + 9). A K score is the product with the codes, times its key's
    // scale in float32 (exact but for float32's rounding); a V row's scale goes into P
    // instead: P's entries are p times the key's scale over R, the largest V scale seen so
    // far (O is kept in units of R, rescaled with the running max when R grows), so they
    // stay within [0, 1] and round to T as P does for a 16-bit cache.
    constexpr int K_WORDS = MAX_D / 16, V_WORDS = MAX_D / 32, KEY_PAIRS = BK / 16;
    constexpr int CODE_BLOCKS = REGISTER_CODES ? KEY_BLOCKS : 1, CODE_PAIRS = REGISTER_CODES ? KEY_PAIRS : 1;
    u32 k_words[CODE_BLOCKS][K_WORDS], v_words[CODE_PAIRS][4][V_WORDS];
    float k_scales[CODE_BLOCKS][2], v_scales[CODE_BLOCKS][2];
    float value_reference = 0.0f;  // R
    // REGISTER_CODES: tile t + 2's codes and scales are copied by cp.async into one of two
    // shared stages after Q's tile (CodeStages) while tile t is worked on (no register
    // holds them in flight), and read into registers in the fragments' order just before
    // use. (Loading each tile's codes from global memory into registers one tile ahead
    // instead kept 32 bytes in local memory and ran 0.78-1.04x as fast: TUNING.md.)
    const CodeStages<BK, MAX_D> code_stages{reinterpret_cast<unsigned char*>(shared + at.k)};
    constexpr int CODE_LD = CodeStages<BK, MAX_D>::LD;
    const HeadCodes<PAGED> head_codes(in, b, kv_head);  // (unread without REGISTER_CODES)
    auto stage_register_codes = [&](i64 t) {
        code_stages.fetch(head_codes, t, key_tiles.start(t), key_tiles.keys(t), lane);
    };
    // tile t's K codes and both scales (`values`: its V codes) from its stage into this
    // lane's registers: the scales of its columns of S and P (keys 8 n + 2 in_quad + e)
    auto read_register_codes = [&](i64 t, bool values) {
        const unsigned char* stage = code_stages.stage(t);
        const float* stage_scales = reinterpret_cast<const float*>(stage + 2 * BK * CODE_LD);  // K's, then V's
        if (!values) {
#pragma unroll
            for (int n = 0; n < CODE_BLOCKS; ++n) {
                const uint2 k_pair = *reinterpret_cast<const uint2*>(stage_scales + n * 8 + 2 * in_quad);
                const uint2 v_pair = *reinterpret_cast<const uint2*>(stage_scales + BK + n * 8 + 2 * in_quad);
                k_scales[n][0] = __uint_as_float(k_pair.x);
                k_scales[n][1] = __uint_as_float(k_pair.y);
                v_scales[n][0] = __uint_as_float(v_pair.x);
                v_scales[n][1] = __uint_as_float(v_pair.y);
#pragma unroll
                for (int w = 0; w < K_WORDS; w += 4) {
                    const uint4 chunk =
                        *reinterpret_cast<const uint4*>(stage + (n * 8 + quad) * CODE_LD + in_quad * (MAX_D / 4) + 4 * w);
                    k_words[n][w] = chunk.x;
                    k_words[n][w + 1] = chunk.y;
                    k_words[n][w + 2] = chunk.z;
                    k_words[n][w + 3] = chunk.w;
                }
            }
        } else {
#pragma unroll
            for (int kk = 0; kk < CODE_PAIRS; ++kk) {
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int c = kk * 16 + 2 * in_quad + (r & 1) + 8 * (r >> 1);
                    const unsigned char* run = stage + (BK + c) * CODE_LD + quad * (MAX_D / 8);
                    if constexpr (V_WORDS == 4) {
                        const uint4 chunk = *reinterpret_cast<const uint4*>(run);
                        v_words[kk][r][0] = chunk.x;
                        v_words[kk][r][1] = chunk.y;
                        v_words[kk][r][2] = chunk.z;
                        v_words[kk][r][3] = chunk.w;
                    } else {
                        const uint2 chunk = *reinterpret_cast<const uint2*>(run);
                        v_words[kk][r][0] = chunk.x;
                        v_words[kk][r][1] = chunk.y;
                    }
                }
            }
        }
    };
    if (tile_count > 0) {
        if constexpr (REGISTER_CODES) {
            stage_register_codes(0);
        } else if constexpr (PIPELINED_CODES) {
            fetch_codes(k_tile_codes, false, 0);
        } else {
            stage_k(0);
            if constexpr (STAGES == 2) stage_v(0);
        }
    }
    cp_async_commit();
    if constexpr (REGISTER_CODES) {
        if (tile_count > 1) stage_register_codes(1);
        cp_async_commit();
    }

    for (i64 t = 0; t < tile_count; ++t) {
        const i64 j0 = key_tiles.start(t);
        const int cols = key_tiles.keys(t);
        const unsigned short *kt = ks(t), *vt = vs(t);
        if constexpr (REGISTER_CODES) {
            cp_async_wait<1>();  // tile t's stage (tile t + 1's may still be in flight)
        } else {
            cp_async_wait<0>();
        }
        if constexpr (PIPELINED_CODES) {
            k_tile_codes.template deposit<T>(k_staged, ks(t), at.ld_qk, head_dim, e4m3);
        }
        // K_t (and Q; with two stages V_t too) landed for every thread; every warp is done
        // with V_t-1 (with two stages: with tile t-1's stage, which tile t+1 now takes)
        __syncthreads();
        if constexpr (STAGES == 2) {
            if (t + 1 < tile_count) {
                stage_k(t + 1);
                stage_v(t + 1);
            }
        } else if constexpr (PIPELINED_CODES) {
            fetch_codes(v_tile_codes, true, t);
        } else if constexpr (!REGISTER_CODES) {
            stage_v(t);
        }
        if constexpr (!REGISTER_CODES) cp_async_commit();
        if constexpr (REGISTER_CODES) read_register_codes(t, false);

        // S (16 FRAGS x BK per warp) = Q K^T: each K fragment pair feeds every row fragment
        float s[FRAGS][KEY_BLOCKS][4];
#pragma unroll
        for (int f = 0; f < FRAGS; ++f) {
#pragma unroll
            for (int n = 0; n < KEY_BLOCKS; ++n) s[f][n][0] = s[f][n][1] = s[f][n][2] = s[f][n][3] = 0.0f;
        }
        if constexpr (REGISTER_CODES) {
            if (e4m3) {
                code_scores<T, true, MAX_D>(s[0], k_words, qs, at.ld_qk, quad, in_quad);
            } else {
                code_scores<T, false, MAX_D>(s[0], k_words, qs, at.ld_qk, quad, in_quad);
            }
#pragma unroll
            for (int n = 0; n < KEY_BLOCKS; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) s[0][n][e] *= k_scales[n][e & 1];
            }
        }
#pragma unroll
        for (int k0 = 0; k0 < MAX_D; k0 += 16) {
            if (!REGISTER_CODES && k0 < at.head_dim) {
                u32 a[FRAGS][4];
#pragma unroll
                for (int f = 0; f < FRAGS; ++f) load_a_fragment(a[f], qs, at.ld_qk, warp * WARP_ROWS + f * 16, k0, lane);
#pragma unroll
                for (int n = 0; n < KEY_BLOCKS; n += 2) {
                    u32 bk[4];
                    load_b_fragments(bk, kt, at.ld_qk, n * 8, k0, lane);
#pragma unroll
                    for (int f = 0; f < FRAGS; ++f) {
                        mma_16816<T>(s[f][n], a[f], bk);
                        mma_16816<T>(s[f][n + 1], a[f], bk + 2);
                    }
                }
            }
        }
        if constexpr (STAGES == 1) {
            __syncthreads();  // every warp is done with K_t
            if (t + 1 < tile_count) {
                if constexpr (PIPELINED_CODES) {
                    fetch_codes(k_tile_codes, false, t + 1);
                } else if constexpr (!REGISTER_CODES) {  // (whose tile t + 2 goes at the loop's end)
                    stage_k(t + 1);
                }
            }
            if constexpr (!REGISTER_CODES) cp_async_commit();
        }

        // scores in base 2, then the online softmax of this lane's rows
        bool plain_tile = !SCORE_OPTIONS;
        if (plain_tile && (OPTIONS & NPATTN_OPTION_BAND) && !every_tile_visible) {
            plain_tile = tile_fully_visible(ints, spans, b, i_first, i_last + 1, j0, j0 + cols);
        }
        if (plain_tile) {
            each_score<FRAGS, KEY_BLOCKS>(in_quad, [&](int f, int n, int e, int, int c) { s[f][n][e] = c < cols ? scale_log2 * s[f][n][e] : lowest; });
        } else {
            auto score_row = [&](int x, const ScoreRow<T, Acc, OPTIONS>& scorer) {
#pragma unroll
                for (int n = 0; n < KEY_BLOCKS; ++n) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int c = n * 8 + 2 * in_quad + e;
                        float& score = s[x / 2][n][2 * (x % 2) + e];
                        float tanh_unused;
                        score = (row_valid[x] && c < cols) ? scorer.score(j0 + c, score, &tanh_unused) * NPATTN_LOG2E
                                                           : lowest;
                    }
                }
            };
#pragma unroll
            for (int x = 0; x < ROWS; ++x) {
                if constexpr (KEEP_SCORERS) {
                    score_row(x, kept_scorer[x]);
                } else {
                    score_row(x, ScoreRow<T, Acc, OPTIONS>(in, b, row_head(x), row_query(x)));
                }
            }
        }
        float tile_max[ROWS];
#pragma unroll
        for (int x = 0; x < ROWS; ++x) {
            tile_max[x] = lowest;
#pragma unroll
            for (int n = 0; n < KEY_BLOCKS; ++n) {
                const float* pair = &s[x / 2][n][2 * (x % 2)];
                tile_max[x] = pair[0] > tile_max[x] ? pair[0] : tile_max[x];
                tile_max[x] = pair[1] > tile_max[x] ? pair[1] : tile_max[x];
            }
        }
        float shift[ROWS], correction[ROWS];
#pragma unroll
        for (int x = 0; x < ROWS; ++x) {
#pragma unroll
            for (int offset = 1; offset < 4; offset <<= 1) {  // a row's 4 lanes: lane bits 0 and 1
                const float other = __shfl_xor_sync(0xffffffffu, tile_max[x], offset);
                tile_max[x] = other > tile_max[x] ? other : tile_max[x];
            }
            const float new_max = tile_max[x] > m[x] ? tile_max[x] : m[x];
            const bool any = new_max > lowest;
            shift[x] = any ? new_max : 0.0f;  // nothing visible yet: 2^(-inf - 0) = 0, not NaN
            correction[x] = any ? exp2_approx(m[x] - new_max) : 1.0f;
            m[x] = new_max;
            seen[x] = seen[x] || tile_max[x] > lowest;
            l[x] *= correction[x];
        }
        // REGISTER_CODES: R grows to the tile's largest V scale (the quad's lanes hold all
        // its keys: the reduction runs over lane bits 0-1); O, in units of R, shrinks by
        // the old R over the new one
        float value_factor[CODE_BLOCKS][2], reference_ratio = 1.0f;
        if constexpr (REGISTER_CODES) {
            const float inverse = grow_value_reference<1, 4>(v_scales, value_reference, reference_ratio);
#pragma unroll
            for (int n = 0; n < CODE_BLOCKS; ++n) {
                value_factor[n][0] = v_scales[n][0] * inverse;
                value_factor[n][1] = v_scales[n][1] * inverse;
            }
        }
        each_score<FRAGS, KEY_BLOCKS>(in_quad, [&](int f, int n, int e, int x, int c) {
            float p = exp2_approx(s[f][n][e] - shift[x]);
            l[x] += p;
            if (has_dropout && row_valid[x] && c < cols && !dropout_keeps(ints, dropout_state[x], j0 + c)) p = 0.0f;
            if constexpr (REGISTER_CODES) p *= value_factor[n][e & 1];
            s[f][n][e] = p;
        });
#pragma unroll
        for (int f = 0; f < FRAGS; ++f) {
            const float upper = correction[2 * f] * reference_ratio, lower = correction[2 * f + 1] * reference_ratio;
#pragma unroll
            for (int n = 0; n < VALUE_BLOCKS; ++n) {
                o[f][n][0] *= upper;
                o[f][n][1] *= upper;
                o[f][n][2] *= lower;
                o[f][n][3] *= lower;
            }
        }
        if constexpr (STAGES == 1 && !REGISTER_CODES) {
            cp_async_wait<1>();
            if constexpr (PIPELINED_CODES) {
                v_tile_codes.template deposit<T>(v_staged, vs(t), at.ld_v, value_dim, e4m3);
            }
            __syncthreads();  // V_t landed for every thread
        }
        if constexpr (REGISTER_CODES) read_register_codes(t, true);

        // O (16 FRAGS x Dv per warp) += P V: S's accumulators of two 8-key blocks are the
        // A fragment of one 16-key block; each V fragment pair feeds every row fragment
#pragma unroll
        for (int kb = 0; kb < BK / 16; ++kb) {
            u32 a[FRAGS][4];
#pragma unroll
            for (int f = 0; f < FRAGS; ++f) {
                a[f][0] = pack_pair<T>(s[f][2 * kb][0], s[f][2 * kb][1]);
                a[f][1] = pack_pair<T>(s[f][2 * kb][2], s[f][2 * kb][3]);
                a[f][2] = pack_pair<T>(s[f][2 * kb + 1][0], s[f][2 * kb + 1][1]);
                a[f][3] = pack_pair<T>(s[f][2 * kb + 1][2], s[f][2 * kb + 1][3]);
            }
            if constexpr (REGISTER_CODES) {
                if (e4m3) {
                    add_code_values<T, true>(o[0], a[0], v_words[kb]);
                } else {
                    add_code_values<T, false>(o[0], a[0], v_words[kb]);
                }
            }
#pragma unroll
            for (int n = 0; n < VALUE_BLOCKS; n += 2) {
                if (!REGISTER_CODES && n * 8 < at.value_dim) {
                    u32 bv[4];
                    load_b_fragments_transposed(bv, vt, at.ld_v, n * 8, kb * 16, lane);
#pragma unroll
                    for (int f = 0; f < FRAGS; ++f) {
                        mma_16816<T>(o[f][n], a[f], bv);
                        mma_16816<T>(o[f][n + 1], a[f], bv + 2);
                    }
                }
            }
        }
        if constexpr (REGISTER_CODES) {
            __syncthreads();  // every lane is done with tile t's stage, which tile t + 2 takes
            if (t + 2 < tile_count) stage_register_codes(t + 2);
            cp_async_commit();
        }
    }
    cp_async_wait<0>();  // the last (empty) group
    // O's column of this lane's accumulator e (0 or 1) of value block n; REGISTER_CODES:
    // O back from units of R
    auto value_column = [&](int n, int e) {
        return REGISTER_CODES ? (2 * in_quad + e) * (MAX_D / 8) + n : n * 8 + 2 * in_quad + e;
    };
    if constexpr (REGISTER_CODES) {
#pragma unroll
        for (int n = 0; n < VALUE_BLOCKS; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) o[0][n][e] *= value_reference;
        }
    }

#pragma unroll
    for (int x = 0; x < ROWS; ++x) {
        l[x] += __shfl_xor_sync(0xffffffffu, l[x], 1);
        l[x] += __shfl_xor_sync(0xffffffffu, l[x], 2);
        seen[x] = seen[x] || l[x] != l[x];  // a visible NaN score (the max skips it): a NaN row, not empty
    }
    if (splits > 1) {  // unnormalized rows, max and sum (natural log): merged by the item's last block
                       // (merge_item_if_last) or by combine_kernel
#pragma unroll
        for (int x = 0; x < ROWS; ++x) {
            if (!row_valid[x]) continue;
            const i64 row = (b * heads + row_head(x)) * q_len + row_query(x);
            Acc* mine = partial + (row * splits + split) * (value_dim + 3);
#pragma unroll
            for (int n = 0; n < VALUE_BLOCKS; ++n) {
                for (int e = 0; e < 2; ++e) {
                    const int d = value_column(n, e);
                    if (d < value_dim) mine[d] = o[x / 2][n][2 * (x % 2) + e];
                }
            }
            if (in_quad == 0) {
                mine[value_dim] = m[x] * NPATTN_LN2;
                mine[value_dim + 1] = l[x];
                mine[value_dim + 2] = seen[x];
            }
        }
        if constexpr ((OPTIONS & NPATTN_OPTION_MERGES) != 0) {
            merge_item_if_last<T, Acc, MAX_D>(in, item, b, kv_head, group, p0, rows, splits, partial, out, out_sb,
                                              out_sh, out_ss, lse, shared_bytes);
        }
        return;
    }

    // normalize, stage this warp's rows in shared memory as 16-bit pairs, then write
    // them out a 16-byte chunk at a time
    __syncthreads();  // every warp is done with V (the staging area overlaps Q, K and V)
    unsigned short* os = shared;
#pragma unroll
    for (int x = 0; x < ROWS; ++x) {
        const float factor = seen[x] ? (float)in.reals[NPATTN_REAL_KEEP_SCALE] / l[x] : 0.0f;
        const int r = tile_row(x);
#pragma unroll
        for (int n = 0; n < VALUE_BLOCKS; ++n) {
            const u32 pair = pack_pair<T>(o[x / 2][n][2 * (x % 2)] * factor, o[x / 2][n][2 * (x % 2) + 1] * factor);
            if constexpr (REGISTER_CODES) {  // (the pair's columns are MAX_D / 8 apart)
                os[swizzled(r, value_column(n, 0), at.ld_v)] = (unsigned short)(pair & 0xffffu);
                os[swizzled(r, value_column(n, 1), at.ld_v)] = (unsigned short)(pair >> 16);
            } else if (n * 8 < at.value_dim) {
                *reinterpret_cast<u32*>(os + swizzled(r, n * 8 + 2 * in_quad, at.ld_v)) = pair;
            }
        }
        if (in_quad == 0 && row_valid[x]) {  // every live row's lse: -inf for a row that saw no key
            lse[(b * heads + row_head(x)) * q_len + row_query(x)] = seen[x] ? m[x] * NPATTN_LN2 + log_of(l[x])
                                                                             : negative_infinity<float>();
        }
    }
    __syncwarp();
    const int out_chunks = (value_dim + 7) / 8;
    for (int index = lane; index < WARP_ROWS * out_chunks; index += 32) {
        const int r = warp * WARP_ROWS + index / out_chunks, c = index % out_chunks;
        if (r >= rows) continue;
        const i64 p = p0 + r;
        T* destination = out + b * out_sb + (kv_head * group + p % group) * out_sh + (p / group) * out_ss + 8 * c;
        const unsigned short* source = os + swizzled(r, 8 * c, at.ld_v);
        if constexpr (ASYNC) {  // aligned rows: one 16-byte store
            *reinterpret_cast<uint4*>(destination) = *reinterpret_cast<const uint4*>(source);
        } else {
            for (int e = 0; e < 8 && 8 * c + e < value_dim; ++e) destination[e].bits = source[e];
        }
    }
}

#ifdef NPATTN_PARAMETER_SCALARS
template <typename T, typename Acc, int MAX_D, int WARPS, int FRAGS, int BK, int STAGES, unsigned OPTIONS>
__global__ void NPATTN_FORWARD_TC_BOUNDS
forward_tc_kernel(NPATTN_OPERAND_PARAMS, T* out, i64 out_sb, i64 out_sh, i64 out_ss, Acc* lse, i64 splits,
                  Acc* partial NPATTN_SCALARS_PARAMETER) {
    forward_tc_block<T, Acc, MAX_D, WARPS, FRAGS, BK, STAGES, OPTIONS>(
        NPATTN_OPERAND_ARGUMENTS(NPATTN_KERNEL_INTS, NPATTN_KERNEL_REALS), out, out_sb, out_sh, out_ss, lse, splits, partial);
}
#endif
