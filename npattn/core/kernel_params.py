"""The kernels' scalar parameters: positions in the int64 and real arrays that every
backend's kernels take (the Numba kernels index them with :class:`Int` and :class:`Real`;
the CUDA sources get the same positions as ``#define``s, see :mod:`npattn.gpu.sources`),
so the two backends cannot drift apart."""
from __future__ import annotations

from enum import IntEnum

import numpy as np

from . import arrays as _arrays
from .dropout import seed_words
from .options import OPTIONS


def _positions(name: str, names) -> type[IntEnum]:
    """An IntEnum numbering ``names`` 0, 1, ... (an enum's member is a compile-time
    constant to Numba, and each becomes a ``#define`` of the CUDA sources)."""
    return IntEnum(name, [(member, position) for position, member in enumerate(names)])  # type: ignore[return-value]


# Positions in the kernels' int64 parameter array (flat arrays of scalars compile several
# times faster in Numba than a named tuple of them): the shapes and strides, a HAS_* flag
# (or CAUSAL) per option of the table that names one, the visibility and dropout scalars,
# then what the backend's tuning fills in.
Int = _positions("Int", (
    "BATCH", "HEADS", "KV_HEADS", "Q_LEN", "KV_LEN", "HEAD_DIM", "VALUE_DIM",
    # element strides of the bhsd views (the last axis is unit); 0 along broadcast axes
    "Q_STRIDE_B", "Q_STRIDE_H", "Q_STRIDE_S", "K_STRIDE_B", "K_STRIDE_H", "K_STRIDE_S",
    "V_STRIDE_B", "V_STRIDE_H", "V_STRIDE_S", "BIAS_STRIDE_B", "BIAS_STRIDE_H", "BIAS_STRIDE_Q",
    "BIAS_STRIDE_K", "MASK_STRIDE_B", "MASK_STRIDE_H", "MASK_STRIDE_Q", "MASK_STRIDE_K",
    *(option.flag for option in OPTIONS if option.flag is not None),
    "SAVES_SCORES",  # some option present keeps a value per score (Option.saves_score)
    "WINDOW_LEFT", "WINDOW_RIGHT",  # -1 = unbounded
    "SINKS",
    # key j of entry b sits in page pages[b * PAGES + j // PAGE_SIZE], row j % PAGE_SIZE
    # (not paged: one page of all keys per entry, page b)
    "PAGES", "PAGE_SIZE",
    "DROPOUT_THRESHOLD", "SEED_LO", "SEED_HI",
    # added to (b, h, i, j) before the dropout hash takes them (the dropout_offset option)
    "DROPOUT_OFFSET_B", "DROPOUT_OFFSET_H", "DROPOUT_OFFSET_I", "DROPOUT_OFFSET_J",
    "BLOCK_Q", "BLOCK_K",
    "SCORE_LD",       # row stride of score tiles: BLOCK_K, or it rounded up to whole vectors
    "VECTOR_SCORES",  # scores through :mod:`npattn.cpu.microkernels` (else BLAS)
    "VECTOR_VALUES",  # P V and dV through them too (needs Dv a whole number of vectors)
    "VECTOR_KEYS",    # dQ and dK through them too (needs D a whole number of vectors)
    "DOT_SCORES",     # CPU forward: scores as dot products of the key rows, no packed keys
    "EDGE_BAND",      # rows per band of a tile the causal/window edge cuts (tiles.band_keys)
    "KEY_SPLITS",     # CPU forward: key ranges per query tile, merged by lse (cpu.splitting)
    "SPLIT_KEYS",     # keys per range, a multiple of BLOCK_K
    "ROW_GROUP",      # CPU: query rows per position (GQA heads folded into rows, cpu.folding)
    "HEAD_GROUP",     # CPU forward: heads per work item, each key tile visited for all of them in turn
                      # (decode tiles on caches whose key rows hold every head: cpu.operands.head_group)
    "TILE_PREFETCH",  # CPU forward: whether such an item asks memory for the next key tile's rows
                      # (cpu.tiles.prefetch_key_rows; where it pays: cpu.isa.tile_prefetch_pays)
    "ROW_PREFETCH",   # CPU forward: rows ahead whose slices such an item's products read in registers
                      # ask for, key by key (cpu.code_products; 0: none; cpu.operands.row_prefetch)
    "PACKED_ROWS",    # CPU: every entry's rows in one memory batch (attention_varlen): out, lse and
                      # the gradients hold one batch, which each entry's disjoint live rows fill
    # CPU: how the forward (and a 16-bit backward) reads k and v (a KvCodes): as they are, or
    # a tile at a time from the k_codes / v_codes operands (bytes; strides K_STRIDE_* /
    # V_STRIDE_* count their elements), int8 times a scale per key (k_scale / v_scale, element
    # strides below, bhs) or float16 / bfloat16 bits converted to float32
    # CPU forward: bfloat16 products on AVX512_BF16 (Q K^T and P V on pairs of bfloat16,
    # P rounded to bfloat16 as GPU kernels round it): q, k and v are then bfloat16 memory
    # seen as float32 words, their strides counting words (cpu.tiles.key_words)
    "BF16_PRODUCTS",
    "KV_CODES", "K_SCALE_STRIDE_B", "K_SCALE_STRIDE_H", "K_SCALE_STRIDE_S",
    "V_SCALE_STRIDE_B", "V_SCALE_STRIDE_H", "V_SCALE_STRIDE_S",
    # CPU forward and backward: how they read q (a KvCodes): as it is, or (where KV_CODES
    # reads float16 or bfloat16 keys a tile at a time) its 16-bit memory, seen as float32
    # words, rows converted to float32 where a tile uses them (Q_STRIDE_* then count bytes)
    "Q_CODES",
    # CPU forward: with Q_CODES or BF16_PRODUCTS and one key range, out is 16-bit memory
    # (q's dtype, a KvCodes) seen as float32 words: each item sums its rows in float32
    # scratch and writes them rounded (out_strides still count out's own elements)
    "OUT_CODES",
    # CPU forward with BF16_PRODUCTS: the key tiles a thread keeps packed for the kv head
    # it works on (0: none), so the next query tile or head of that kv head reads them
    # packed (cpu.tiles.cached_key_tile)
    "KEY_CACHE_SLOTS",
    # CPU forward: the work items a thread claims at once (cpu.threads.claim_items): with
    # KEY_CACHE_SLOTS a kv head's, which then packs its key tiles once; else 1
    "CLAIM_RUN",
    # GPU forward with split keys: where its work items' arrival counters (unsigned ints)
    # start in the split partials' buffer, in its floats; the last block of an item to
    # finish merges the item's rows (merge.cuh). 0: combine_kernel merges them.
    "SPLIT_COUNTERS",
    # CPU kernels (score_tile): how they read a bias (a KvCodes): in the compute dtype,
    # or (FLOAT16, BFLOAT16: a 16-bit bias of a float32 computation) its 16-bit memory seen
    # as float32 words, each value converted where a score adds it (BIAS_STRIDE_* still
    # count its elements)
    "BIAS_CODES",
    # CPU forward reading 16-bit keys and values a tile at a time (KV_CODES FLOAT16 or
    # BFLOAT16): query tiles of at least this many rows have P V read each tile's values
    # converted to float32 once; shorter ones read them in registers (cpu.code_products),
    # each value row converted once per block of rows (cpu.isa.converted_value_rows)
    "CONVERTED_VALUE_ROWS",
    # CPU forward with BF16_PRODUCTS on AMX tiles, where the scale is 2**-KEY_SCALE_SHIFT: the
    # packed keys carry it (each bfloat16's exponent lowered: exact), and the score products
    # take none (cpu.tiles.pack_key_tile; 0: the products scale their sums)
    "KEY_SCALE_SHIFT",
    # CPU forward with BF16_PRODUCTS on AMX tiles, with a scale that is not a power of two and
    # no softcap, bias, ALiBi or dropout: the score products leave the scale out and the
    # softmax applies it (its max pass and exp's own multiply: cpu.rowmath.exp_tile_to_pairs)
    "SOFTMAX_SCALE",
    # CPU forward with BF16_PRODUCTS on AMX tiles: the row stride (float32 words, whole cache
    # lines) of a copy of each work item's query rows, made where q's rows do not start on
    # 64-byte lines (cpu.tiles.copy_query_rows); 0: q read where it lies
    "QUERY_COPY_WORDS",
))

# The values of Int.KV_CODES
KvCodes = _positions("KvCodes", ("NONE", "INT8", "FLOAT16", "BFLOAT16", "FLOAT8"))

# Columns of the kernels' ``spans`` operand, int64 (B, len(Span)) C-contiguous: per batch
# entry, its live query rows [Q_START, Q_STOP), its live keys [KV_START, KV_STOP) and the
# key position of its query row 0 (row i sits at i + SHIFT). See :func:`problem_spans`.
Span = _positions("Span", ("Q_START", "Q_STOP", "KV_START", "KV_STOP", "SHIFT"))
SPAN_FIELDS = len(Span)

# Positions in the kernels' parameter array of the compute dtype: one per option of the
# table that names a real slot (SCALE, SOFTCAP with 0 = off, KEEP_SCALE = 1 / (1 - p)).
Real = _positions("Real", tuple(option.real[0] for option in OPTIONS if option.real is not None))


# The arrays every kernel takes first, in order, with their CUDA types (T: the storage
# type, Acc: the compute type) and what each holds: the CPU's Operands tuple, the GPU
# driver's argument tuple and the CUDA sources' Operands struct and parameter macros
# (written by npattn.gpu.sources.source()) all follow this one list.
OPERANDS = (
    ("q", "const T*", "bhsd rows of queries"),
    ("k", "const T*", "bhsd rows of keys"),
    ("v", "const T*", "bhsd rows of values"),
    ("bias", "const Acc*", "compute dtype, or a 1-element placeholder"),
    ("mask", "const unsigned char*", "bool as bytes, or a placeholder"),
    ("alibi", "const Acc*", "(B * H,) slopes, or a placeholder"),
    ("sink", "const Acc*", "(H,) sink logits, or a placeholder"),
    ("spans", "const i64*", "(B, SPAN_FIELDS): live rows and keys and row 0's position, per batch entry"),
    ("pages", "const i64*", "(B, PAGES): the page of k and v (their batch index) of each entry's key block"),
    ("ints", "const i64*", "NPATTN_INT_* / Int"),
    ("reals", "const Acc*", "NPATTN_REAL_* / Real"),
    # a quantized cache (ints KV_CODES, strides K_STRIDE_* / V_STRIDE_* in codes and
    # K_SCALE_STRIDE_* / V_SCALE_STRIDE_*; k and v are then placeholders), else placeholders
    ("k_codes", "const unsigned char*", "int8 or float8 e4m3 key codes as bytes, or a placeholder"),
    ("v_codes", "const unsigned char*", "the value codes, or a placeholder"),
    ("k_scale", "const float*", "float32 scale of each key row, or a placeholder"),
    ("v_scale", "const float*", "float32 scale of each value row, or a placeholder"),
)
OPERAND_NAMES = tuple(name for name, _, _ in OPERANDS)


def operand_defines() -> list[str]:
    """The CUDA lines for :data:`OPERANDS`: the Operands struct's fields, the kernels'
    leading parameters, the struct built from them, and the parameters as arguments of a
    call with other ints and reals (a kernel that passes its scalars by value on)."""
    fields = " ".join(f"{ctype} {name};" for name, ctype, _ in OPERANDS)
    params = ", ".join(f"{ctype} {name}" for name, ctype, _ in OPERANDS)
    # (the kernel parameters passed on, with the kernel's ints and reals or others in their place)
    arguments = ", ".join({"ints": "INTS", "reals": "REALS"}.get(name, name) for name in OPERAND_NAMES)
    return [f"#define NPATTN_OPERAND_FIELDS {fields}",
            f"#define NPATTN_OPERAND_PARAMS {params}",
            f"#define NPATTN_OPERANDS {{{', '.join(OPERAND_NAMES)}}}",
            f"#define NPATTN_OPERAND_ARGUMENTS(INTS, REALS) {arguments}"]


def element_strides(array) -> tuple:
    """``array``'s strides in elements, 0 along axes of length 1 (so broadcast views and
    size-1 axes read the same element)."""
    return tuple(0 if n == 1 else s // array.itemsize for n, s in zip(array.shape, array.strides))


def problem_spans(problem):
    """The kernels' ``spans`` for ``problem``: int64 (B, SPAN_FIELDS) C-contiguous NumPy
    (the GPU backend uploads it): q_start (0), q_lengths (Sq), kv_start (0), kv_lengths
    (Sk) and the row shift (``row_shifts``, else the visibility's one shift)."""
    return spans_with(default_spans(problem), problem)


def default_spans(problem):
    """:func:`problem_spans` of a problem with no lengths, starts or per-entry shifts:
    a function of the shapes and the visibility alone (so, of the problem's signature)."""
    spans = np.zeros((problem.batch, SPAN_FIELDS), np.int64)
    spans[:, Span.Q_STOP], spans[:, Span.KV_STOP] = problem.q_len, problem.kv_len
    spans[:, Span.SHIFT] = problem.visibility.shift(problem.q_len, problem.kv_len)
    return spans


def spans_with(defaults, arrays):
    """``defaults`` (from :func:`default_spans`) with the columns ``arrays`` (a problem, or
    anything with its q_start, q_lengths, kv_start, kv_lengths and row_shifts) gives; the
    defaults themselves when it gives none."""
    given = [(column, getattr(arrays, name)) for column, name in _SPAN_ARRAYS if getattr(arrays, name) is not None]
    if not given:
        return defaults
    spans = defaults.copy()
    for column, values in given:
        spans[:, column] = _arrays.to_numpy(values)
    return spans


def problem_pages(problem):
    """The kernels' ``pages``: int64 (B * PAGES,) NumPy, ``block_table`` flat, or
    ``arange(B)`` (one page per entry: its own batch index) when not paged."""
    if problem.block_table is None:
        return np.arange(problem.batch, dtype=np.int64)
    return np.ascontiguousarray(_arrays.to_numpy(problem.block_table), dtype=np.int64).reshape(-1)


def spans_are_default(problem) -> bool:
    """Whether ``problem``'s spans are the whole rows and keys with one shift (no
    lengths, starts or per-entry shifts): then :func:`default_spans` gives them."""
    return all(getattr(problem, name) is None for _, name in _SPAN_ARRAYS)


_SPAN_ARRAYS = ((Span.Q_START, "q_start"), (Span.Q_STOP, "q_lengths"), (Span.KV_START, "kv_start"),
                (Span.KV_STOP, "kv_lengths"), (Span.SHIFT, "row_shifts"))


def problem_parameters(problem, dtype):
    """``(ints, reals)`` for ``problem``: int64 (len(Int),) and ``dtype`` (len(Real),) arrays
    with the shapes, options, dropout seed and scalars filled in. The strides, tiles and
    product choices are the backend's to fill (zero here)."""
    return np.array(problem_int_values(problem), np.int64), problem_reals(problem, dtype)


def quantized_codes(problem) -> int:
    """The KvCodes of a quantized problem's k and v (int8, or float8 e4m3 bits held as
    uint8); NONE for float keys."""
    if not problem.quantized:
        return KvCodes.NONE
    return KvCodes.FLOAT8 if problem.k.dtype == np.uint8 else KvCodes.INT8


def problem_int_values(problem) -> list:
    """:func:`problem_parameters`'s ints as a list, for a backend that fills in its own
    entries before making the array once (a small call's every microsecond counts)."""
    visibility = problem.visibility
    values = [0] * len(Int)
    values[Int.BATCH:Int.VALUE_DIM + 1] = (problem.batch, problem.heads, problem.kv_heads, problem.q_len,
                                           problem.kv_len, problem.head_dim, problem.value_dim)
    for index, option in _FLAGGED_OPTIONS:  # HAS_BIAS, HAS_MASK, ..., CAUSAL: from the options table
        values[index] = int(option.present(problem))
    values[Int.SAVES_SCORES] = int(any(option.present(problem) for option in _SAVING_OPTIONS))
    values[Int.WINDOW_LEFT] = -1 if visibility.window_left is None else visibility.window_left
    values[Int.WINDOW_RIGHT] = -1 if visibility.window_right is None else visibility.window_right
    values[Int.SINKS] = visibility.sinks
    if problem.block_table is None:
        values[Int.PAGES], values[Int.PAGE_SIZE] = 1, max(problem.kv_len, 1)
    else:
        values[Int.PAGES], values[Int.PAGE_SIZE] = problem.block_table.shape[1], problem.page_size
    values[Int.DROPOUT_THRESHOLD] = problem.dropout_threshold
    values[Int.PACKED_ROWS] = int(problem.packed_rows)
    values[Int.KV_CODES] = quantized_codes(problem)
    if problem.dropout_p:  # the seed means nothing without dropout: problems differing in it alone share ints
        values[Int.SEED_LO], values[Int.SEED_HI] = seed_words(problem.seed)
        values[Int.DROPOUT_OFFSET_B:Int.DROPOUT_OFFSET_J + 1] = problem.dropout_offset
    return values


def problem_reals(problem, dtype):
    """:func:`problem_parameters`'s reals."""
    return np.array([value(problem) for _, value in _REAL_OPTIONS], dtype)


_FLAGGED_OPTIONS = tuple((Int[option.flag], option) for option in OPTIONS if option.flag is not None)
_SAVING_OPTIONS = tuple(option for option in OPTIONS if option.saves_score)
_REAL_OPTIONS = tuple(option.real for option in OPTIONS if option.real is not None)  # in Real's order


def sink_logits_gradient(xp, problem, lse, delta):
    """d loss / d sink_logits (H,) from the forward's lse (B, H, Sq) and delta = rowsum(dO * O)
    (B, H, Sq), arrays of module ``xp``: the sink column's probability is
    exp(sink - lse), and d out / d sink = -P(sink) * out, so the gradient is
    -sum over b and i of P(sink) * delta. Rows with no visible key (lse -inf) give 0."""
    sink = problem.sink_logits.astype(lse.dtype)[None, :, None]
    seen = xp.isfinite(lse)
    sink_probability = xp.exp(xp.where(seen, sink - xp.where(seen, lse, 0.0), -xp.inf))
    return -(sink_probability * delta).sum(axis=(0, 2))
