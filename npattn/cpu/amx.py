"""bfloat16 pair products on AMX tiles (Intel Sapphire Rapids and later).

An AMX core holds eight tile registers of up to 16 rows x 64 bytes and multiplies them
with one instruction: ``tdpbf16ps C, A, B`` adds to each float32 ``C[m, n]`` (16 x 16)
the sum over 16 pairs ``k`` of ``A[m, k].lo B[k, n].lo + A[m, k].hi B[k, n].hi`` (A: 16
rows of 16 pairs of bfloat16, B: 16 rows of pairs for 16 columns), 8192 products
where a 512-bit ``vdpbf16ps`` makes 32. The operands are the layouts
:func:`npattn.cpu.microkernels.pair_product` already reads (A's rows of pairs as they
lie, B as rows of column pairs: the packed K^T of the scores, the value pairs of P V),
so :func:`tile_pair_product` computes the same products from the same memory.

A depth of whole steps of 16 pairs keeps C in four tiles (two blocks of 16 rows by two of
16 columns), A in two and B in two (:func:`_configure_quad`). A depth that ends part way
through a step keeps C in tiles 0 and 1 (one block of rows), A in tile 2 and B in tiles 4
and 5 for the whole steps, and A's last pairs in tile 3 and B's in 6 and 7, configured
that short (:func:`_configure`); so do the rows the four-tile blocks leave. A block of
fewer than 16 rows is configured that short too (configurations change only between
blocks: loading one clears the tiles).

Rounding: each pair's products are exact in float32 and summed in float32 with round
to nearest even, denormal inputs read as zero and denormal sums flushed, as vdpbf16ps
sums them; the order of the sums within a step is the hardware's (not vdpbf16ps's), so
results agree with the vector path to float32 rounding, not to the bit.

Linux hands the tiles' 8 KiB of register state to a process only when it asks
(``arch_prctl(ARCH_REQ_XCOMP_PERM)``, :func:`npattn.cpu.isa.apply_tile_permission`,
made before Numba's first compilation); where the kernel refuses, or the ISA is forced
(``NPATTN_CPU_ISA=avx512`` or ``avx2``), Numba's target has the AMX features off and
:data:`TILES` is False, so nothing here is compiled.
"""
from __future__ import annotations

from . import _cache  # noqa: F401  (before any @njit: stamps caches, asks for the tiles)
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .isa import target_features
from .jit import helper
from .signatures import as_offset

_FEATURES = set(target_features().split(","))
# Whether the kernels compile bfloat16 pair products to AMX tiles
TILES = {"+amx-tile", "+amx-bf16"} <= _FEATURES

ROWS = 16  # a tile's rows
PAIRS = 16  # a step's pairs: a tile row's 64 bytes of A, a tile's 16 rows of B
COLUMNS = 16  # a C tile's float32 columns

# The tiles of a depth with a last part step (:func:`_configure`): one block of rows
_C_LEFT, _C_RIGHT, _A, _A_TAIL, _B_LEFT, _B_RIGHT, _B_TAIL_LEFT, _B_TAIL_RIGHT = range(8)
# The tiles of whole steps (:func:`_configure_quad`): two blocks of rows by two of columns
_C_TOP_LEFT, _C_TOP_RIGHT, _C_LOW_LEFT, _C_LOW_RIGHT, _A_TOP, _A_LOW, _B_0, _B_1 = range(8)

_I8, _I16, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(64)
_BYTES = ir.PointerType(_I8)


def _declared(builder, name, arguments):
    module = builder.module
    if name in module.globals:
        return module.globals[name]
    return ir.Function(module, ir.FunctionType(ir.VoidType(), arguments), name)


def _tile(literal) -> ir.Constant:
    return _I8(literal.literal_value)


def _load_configuration(builder, shape):
    """``ldtilecfg`` of palette 1 with ``shape``: tile -> (rows, bytes per row) as LLVM
    integers (tiles not named: unused, neither rows nor bytes)."""
    config = cgutils.alloca_once(builder, ir.ArrayType(_I8, 64))
    base = builder.bitcast(config, _BYTES)
    builder.store(ir.Constant(ir.ArrayType(_I8, 64), None), config)
    builder.store(_I8(1), base)  # palette 1
    for tile, (tile_rows, tile_bytes) in shape.items():
        width = builder.bitcast(builder.gep(base, [_I64(16 + 2 * tile)]), ir.PointerType(_I16))
        builder.store(builder.trunc(tile_bytes, _I16) if tile_bytes.type != _I16 else tile_bytes, width)
        builder.store(builder.trunc(tile_rows, _I8), builder.gep(base, [_I64(48 + tile)]))
    builder.call(_declared(builder, "llvm.x86.ldtilecfg", [_BYTES]), [base])


@intrinsic
def _configure(typingctx, rows, tail_pairs):
    """Load the tile configuration for blocks of ``rows`` rows (at most 16) and a last step
    of ``tail_pairs`` pairs (0: none): see the module's docstring. Clears every tile."""
    def codegen(context, builder, signature, arguments):
        rows, tail = (context.cast(builder, value, kind, types.int64)
                      for value, kind in zip(arguments, signature.args))
        row_bytes = _I16(4 * PAIRS)
        # (a tile not used is configured with no rows and no bytes: one without the other
        # is an invalid configuration, a fault)
        has_tail = builder.icmp_unsigned("!=", tail, _I64(0))
        tail_rows = builder.select(has_tail, rows, _I64(0))
        tail_bytes = builder.trunc(builder.mul(tail, _I64(4)), _I16)
        tail_row_bytes = builder.select(has_tail, row_bytes, _I16(0))
        _load_configuration(builder, {
            _C_LEFT: (rows, row_bytes), _C_RIGHT: (rows, row_bytes),
            _A: (rows, row_bytes), _A_TAIL: (tail_rows, tail_bytes),
            _B_LEFT: (_I64(PAIRS), row_bytes), _B_RIGHT: (_I64(PAIRS), row_bytes),
            _B_TAIL_LEFT: (tail, tail_row_bytes), _B_TAIL_RIGHT: (tail, tail_row_bytes),
        })
        return context.get_dummy_value()
    return types.void(rows, tail_pairs), codegen


@intrinsic
def _configure_quad(typingctx):
    """Load the tile configuration of whole steps: eight tiles of 16 rows x 64 bytes."""
    def codegen(context, builder, signature, arguments):
        _load_configuration(builder, {tile: (_I64(ROWS), _I16(4 * PAIRS)) for tile in range(8)})
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def _release(typingctx):
    """Return the tiles to their initial state (unconfigured: nothing for the OS to save)."""
    def codegen(context, builder, signature, arguments):
        builder.call(_declared(builder, "llvm.x86.tilerelease", []), [])
        return context.get_dummy_value()
    return types.void(), codegen


def _address(context, builder, array_type, array, offset, offset_type):
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [context.cast(builder, offset, offset_type, types.intp)]), _BYTES)


def _tile_memory(name: str, llvm_name: str, doc: str):
    """An intrinsic ``(tile, array, offset, row_stride)`` calling ``llvm_name`` (a tile's
    load or store) on ``array``'s float32 words from ``offset``, rows ``row_stride`` words
    apart; ``tile`` a literal."""
    def typer(typingctx, tile, array, offset, row_stride):
        if not isinstance(tile, types.IntegerLiteral):
            return None

        def codegen(context, builder, signature, arguments):
            _, array, offset, stride = arguments
            stride = builder.mul(context.cast(builder, stride, signature.args[3], types.int64), _I64(4))
            builder.call(_declared(builder, llvm_name, [_I8, _BYTES, _I64]),
                         [_tile(signature.args[0]),
                          _address(context, builder, signature.args[1], array, offset, signature.args[2]), stride])
            return context.get_dummy_value()
        return types.void(tile, array, offset, row_stride), codegen
    typer.__doc__, typer.__name__, typer.__qualname__ = doc, name, name
    return intrinsic(prefer_literal=True)(typer)


_load = _tile_memory("_load", "llvm.x86.tileloadd64",
                     "Tile ``tile`` from ``array`` (its configured rows and bytes).")
_store = _tile_memory("_store", "llvm.x86.tilestored64",
                      "Tile ``tile`` into ``array`` (its configured rows and bytes).")


@intrinsic(prefer_literal=True)
def _zero(typingctx, tile):
    if not isinstance(tile, types.IntegerLiteral):
        return None

    def codegen(context, builder, signature, arguments):
        builder.call(_declared(builder, "llvm.x86.tilezero", [_I8]), [_tile(signature.args[0])])
        return context.get_dummy_value()
    return types.void(tile), codegen


@intrinsic(prefer_literal=True)
def _multiply(typingctx, c, a, b):
    """``tdpbf16ps c, a, b`` (tile numbers, literals)."""
    if not all(isinstance(x, types.IntegerLiteral) for x in (c, a, b)):
        return None

    def codegen(context, builder, signature, arguments):
        builder.call(_declared(builder, "llvm.x86.tdpbf16ps", [_I8, _I8, _I8]),
                     [_tile(x) for x in signature.args])
        return context.get_dummy_value()
    return types.void(c, a, b), codegen


@helper
def tile_pair_product(a, a_offset, a_row, b, b_offset, b_row, c, c_offset, c_row, rows, pairs, width, alpha,
                      accumulate):
    """:func:`npattn.cpu.microkernels.pair_product` with ``a_col`` 1 on AMX tiles:
    ``C[r, x] = [C[r, x] +] alpha * sum_p (A[r, p].lo B[p, x].lo + A[r, p].hi B[p, x].hi)``
    for r < ``rows``, x < ``width``, p < ``pairs``, with ``A[r, p] = a[a_offset + r * a_row + p]``,
    ``B[p, x] = b[b_offset + p * b_row + x]`` and ``C[r, x] = c[c_offset + r * c_row + x]``
    (float32 arrays; A and B hold bfloat16 pairs). ``width`` is whole tiles (a multiple of
    16); ``alpha`` is 1 where ``accumulate`` is set (the sums start from C in the tiles,
    which hold no scale). Indices are not checked.

    C goes in blocks of rows x 32 columns, the columns outermost: a block's B (its 32
    columns over the whole depth; 4 KiB at a head dim of 64) stays in L1 while the rows'
    A goes by. (Rows outermost, the scores' packed keys, 48 KiB at D = 64 and 384 keys,
    came from L2 for each block of rows.) A depth of whole steps takes 32 rows a block,
    four independent sums (:func:`_quad`): a tile register is not renamed, so a step's
    loads wait for the products that read the tiles they replace, and one block's sums
    (:func:`_block`), at a head dim of 64 two steps, waited on each other (38 ns a
    product against 5.2 for the instruction alone). The rows those leave, and every
    block of a depth that ends part way through a step, take :func:`_block`, a last
    block of fewer than 16 rows with a configuration of its own."""
    steps, tail = pairs // PAIRS, pairs % PAIRS
    r0 = 0
    if tail == 0 and rows >= 2 * ROWS:
        r0 = rows - rows % (2 * ROWS)
        _configure_quad()
        for x0 in range(0, width, 2 * COLUMNS):
            for r in range(0, r0, 2 * ROWS):
                _quad(a, a_offset + r * a_row, a_row, b, b_offset + x0, b_row, c, c_offset + r * c_row + x0,
                      c_row, steps, x0 + COLUMNS < width, accumulate)
    whole_rows = rows - rows % ROWS
    if r0 < whole_rows:
        _configure(ROWS, tail)
        for x0 in range(0, width, 2 * COLUMNS):
            for r in range(r0, whole_rows, ROWS):
                _block(a, a_offset + r * a_row, a_row, b, b_offset + x0, b_row, c, c_offset + r * c_row + x0,
                       c_row, steps, tail, x0 + COLUMNS < width, accumulate)
    if whole_rows < rows:
        _configure(rows - whole_rows, tail)
        for x0 in range(0, width, 2 * COLUMNS):
            _block(a, a_offset + whole_rows * a_row, a_row, b, b_offset + x0, b_row, c,
                   c_offset + whole_rows * c_row + x0, c_row, steps, tail, x0 + COLUMNS < width, accumulate)
    _release()
    if alpha != 1:  # (a pass of its own: C read back right after the tiles' stores waits for them)
        for r in range(rows):
            at = c_offset + r * c_row
            for x in range(as_offset(at), as_offset(at + width)):
                c[x] *= alpha


@njit(inline="always")
def _quad(a, a_at, a_row, b, b_at, b_row, c, c_at, c_row, steps, two, accumulate):
    """32 rows of C at ``c_at``, its 16 columns (32 where ``two``), over whole steps."""
    low = 16 * c_row
    if accumulate:
        _load(_C_TOP_LEFT, c, c_at, c_row)
        _load(_C_LOW_LEFT, c, c_at + low, c_row)
        if two:
            _load(_C_TOP_RIGHT, c, c_at + COLUMNS, c_row)
            _load(_C_LOW_RIGHT, c, c_at + low + COLUMNS, c_row)
    else:
        _zero(_C_TOP_LEFT)
        _zero(_C_LOW_LEFT)
        _zero(_C_TOP_RIGHT)
        _zero(_C_LOW_RIGHT)
    for step in range(steps):
        at = b_at + step * PAIRS * b_row
        _load(_A_TOP, a, a_at + step * PAIRS, a_row)
        _load(_B_0, b, at, b_row)
        _multiply(_C_TOP_LEFT, _A_TOP, _B_0)
        _load(_A_LOW, a, a_at + ROWS * a_row + step * PAIRS, a_row)
        _multiply(_C_LOW_LEFT, _A_LOW, _B_0)
        if two:
            _load(_B_1, b, at + COLUMNS, b_row)
            _multiply(_C_TOP_RIGHT, _A_TOP, _B_1)
            _multiply(_C_LOW_RIGHT, _A_LOW, _B_1)
    _store(_C_TOP_LEFT, c, c_at, c_row)
    _store(_C_LOW_LEFT, c, c_at + low, c_row)
    if two:
        _store(_C_TOP_RIGHT, c, c_at + COLUMNS, c_row)
        _store(_C_LOW_RIGHT, c, c_at + low + COLUMNS, c_row)


@njit(inline="always")
def _block(a, a_at, a_row, b, b_at, b_row, c, c_at, c_row, steps, tail, two, accumulate):
    """One block of :func:`tile_pair_product`: the configured rows of C at ``c_at``, its
    16 columns (32 where ``two``) over the whole depth."""
    if accumulate:
        _load(_C_LEFT, c, c_at, c_row)
        if two:
            _load(_C_RIGHT, c, c_at + COLUMNS, c_row)
    else:
        _zero(_C_LEFT)
        _zero(_C_RIGHT)
    for step in range(steps):
        _load(_A, a, a_at + step * PAIRS, a_row)
        _load(_B_LEFT, b, b_at + step * PAIRS * b_row, b_row)
        _multiply(_C_LEFT, _A, _B_LEFT)
        if two:
            _load(_B_RIGHT, b, b_at + step * PAIRS * b_row + COLUMNS, b_row)
            _multiply(_C_RIGHT, _A, _B_RIGHT)
    if tail:
        tail_at = steps * PAIRS
        _load(_A_TAIL, a, a_at + tail_at, a_row)
        _load(_B_TAIL_LEFT, b, b_at + tail_at * b_row, b_row)
        _multiply(_C_LEFT, _A_TAIL, _B_TAIL_LEFT)
        if two:
            _load(_B_TAIL_RIGHT, b, b_at + tail_at * b_row + COLUMNS, b_row)
            _multiply(_C_RIGHT, _A_TAIL, _B_TAIL_RIGHT)
    _store(_C_LEFT, c, c_at, c_row)
    if two:
        _store(_C_RIGHT, c, c_at + COLUMNS, c_row)
