"""Explicit full-width vectors for Numba kernels: a value type that lives in one register.

Why: Numba compiles for the host CPU, and LLVM's cost model for AVX-512 Intel
cores prefers 256-bit vectors, so Numba's own vectorized loops run at half the
width of the FMA units, and a loop cannot keep a block of accumulators in
registers. The matrix-product micro-kernels of :mod:`npattn.cpu.microkernels`
need both. Here a :class:`Vector` is one register of the ISA the kernels compile
for (:mod:`npattn.cpu.isa`): an LLVM ``<16 x float>`` (``<8 x double>``) on
AVX-512, ``<8 x float>`` (``<4 x double>``) on AVX2; every function that touches
one is marked ``"prefer-vector-width"`` at that width, so LLVM keeps it whole in a
zmm (ymm) register and vectorizes that function's plain loops at that width too.

Use only inside ``@njit`` code::

    block = repeat(repeat(fill(0.0, c), 4), 6)   # 6 rows of 4 vectors of c.dtype, all 0
    # block[r][v] += a[i + r * lda] * b[j + v * lanes :][:lanes]
    block = splat_fma_rows(a, i, lda, load_like(b, j, block[0]), block)
    store_scaled_rows(c, k, ldc, block, fill(1.0, c), False)

Loads and stores are unaligned and unchecked: ``index + lanes(x) <= len(x)`` is
the caller's to guarantee. On a CPU with neither AVX-512 nor AVX2, LLVM splits each
vector into SSE registers: correct, but the micro-kernels are then slower than BLAS,
so :data:`MICROKERNELS` tells callers whether to use them.
"""
from __future__ import annotations

from . import _cache  # noqa: F401  (before any @njit: stamps caches, applies NPATTN_CPU_ISA)
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, overload, register_model

from .amx import TILES
from .isa import bf16_pairs_pay, compiled_isa, target_features
from .jit import OPTIONS

ISA = compiled_isa()
# One register: zmm on AVX-512, ymm elsewhere (on SSE-only CPUs LLVM splits it in two).
VECTOR_BYTES = 64 if ISA == "avx512" else 32
# Whether the register-blocked micro-kernels pay off here (they lose to BLAS on SSE).
MICROKERNELS = ISA != "baseline"


class Vector(types.Type):
    """A register of ``lanes`` values of ``dtype`` (float32 x 16 or float64 x 8 on AVX-512,
    half that on AVX2)."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.lanes = VECTOR_BYTES // (dtype.bitwidth // 8)
        super().__init__(name=f"Vector({dtype} x {self.lanes})")


@register_model(Vector)
class _VectorModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        element = dmm.lookup(fe_type.dtype).get_value_type()
        super().__init__(dmm, fe_type, ir.VectorType(element, fe_type.lanes))


def _wide(builder):
    """Let LLVM use full-width registers in the function being built."""
    attributes = builder.function.attributes
    # llvmlite only knows attribute keywords; a "key"="value" string attribute goes in as text
    set.add(attributes, f'"prefer-vector-width"="{8 * VECTOR_BYTES}"')
    set.add(attributes, f'"min-legal-vector-width"="{8 * VECTOR_BYTES}"')


@intrinsic
def never_inline(typingctx):
    """Emits nothing; keeps LLVM from inlining the calling function into its callers. For
    the big micro-kernels: one copy serves every call site instead of one copy each
    (measured: a second of compile per copy)."""
    def codegen(context, builder, signature, args):
        builder.function.attributes.add("noinline")
        return context.get_dummy_value()
    return types.none(), codegen


@intrinsic
def always_inline(typingctx):
    """Emits nothing; has LLVM inline the calling function into every caller. For small
    helpers whose callers pass constants that select their code (a cache's decode, a
    block's rows): compiled once by Numba, each call site's copy folded by LLVM, where
    Numba's own inlining (``inline="always"``) types and inlines the helper again at
    each site (the code products' compile took 9.5 s of it)."""
    def codegen(context, builder, signature, args):
        builder.function.attributes.add("alwaysinline")
        return context.get_dummy_value()
    return types.none(), codegen


def _check_float_array(array):
    return isinstance(array, types.Array) and array.dtype in (types.float32, types.float64)


def _pointer(context, builder, array_type, array, index, vector_type):
    data = context.make_array(array_type)(context, builder, array).data
    address = builder.gep(data, [index])
    return builder.bitcast(address, ir.PointerType(vector_type))


def _vector_at(context, builder, signature, args, vector):
    """(the LLVM type of ``vector``, a pointer to it at ``args[0][args[1]]``) for an
    intrinsic whose first two arguments are an array and an index, in a function that
    then uses full-width registers."""
    _wide(builder)
    vector_type = context.get_value_type(vector)
    return vector_type, _pointer(context, builder, signature.args[0], args[0], args[1], vector_type)


@intrinsic
def load(typingctx, array, index):
    """The vector ``array[index : index + lanes]``."""
    if not (_check_float_array(array) and isinstance(index, types.Integer)):
        return None
    vector = Vector(array.dtype)

    def codegen(context, builder, signature, args):
        _, pointer = _vector_at(context, builder, signature, args, vector)
        return builder.load(pointer, align=array.dtype.bitwidth // 8)
    return vector(array, index), codegen


@intrinsic
def store(typingctx, array, index, value):
    """``array[index : index + lanes] = value``."""
    if not (_check_float_array(array) and isinstance(value, Vector) and value.dtype == array.dtype):
        return None

    def codegen(context, builder, signature, args):
        _, pointer = _vector_at(context, builder, signature, args, value)
        builder.store(args[2], pointer, align=array.dtype.bitwidth // 8)
        return context.get_dummy_value()
    return types.none(array, index, value), codegen


def _first_lanes(builder, count, lanes):
    """The mask of a vector's first ``count`` lanes (an int64 value)."""
    indices = ir.Constant(ir.VectorType(ir.IntType(64), lanes), list(range(lanes)))
    return builder.icmp_signed("<", indices, _splat(builder, count, indices.type))


def _masked(builder, kind, vector_type, operands):
    """A call of ``llvm.masked.<kind>`` (load or store) on ``vector_type``."""
    pointer, i32 = vector_type.as_pointer(), ir.IntType(32)
    mask = ir.VectorType(ir.IntType(1), vector_type.count)
    element = vector_type.element
    kind_of = {ir.FloatType: "f32", ir.DoubleType: "f64", ir.HalfType: "f16"}
    name = kind_of.get(type(element)) or f"i{element.width}"
    suffix = f"v{vector_type.count}{name}.p0"
    arguments = ([pointer, i32, mask, vector_type] if kind == "load" else [vector_type, pointer, i32, mask])
    function = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(vector_type if kind == "load" else ir.VoidType(), arguments),
        f"llvm.masked.{kind}.{suffix}")
    return builder.call(function, operands)


@intrinsic
def load_first(typingctx, array, index, count, other):
    """The vector of ``array[index : index + count]`` in its first ``count`` lanes (0 <=
    count <= lanes) and ``other`` in the rest: a masked load, which reads nothing past
    ``count`` (a row's last, partial vector, where the row may end its array)."""
    if not (_check_float_array(array) and isinstance(index, types.Integer) and isinstance(count, types.Integer)
            and isinstance(other, (types.Float, types.Integer))):
        return None
    vector = Vector(array.dtype)

    def codegen(context, builder, signature, args):
        vector_type, pointer = _vector_at(context, builder, signature, args, vector)
        count_value = context.cast(builder, args[2], signature.args[2], types.int64)
        fallback = _splat(builder, context.cast(builder, args[3], signature.args[3], array.dtype), vector_type)
        alignment = ir.Constant(ir.IntType(32), array.dtype.bitwidth // 8)
        return _masked(builder, "load", vector_type,
                       [pointer, alignment, _first_lanes(builder, count_value, vector_type.count), fallback])
    return vector(array, index, count, other), codegen


@intrinsic
def store_first(typingctx, array, index, value, count):
    """``array[index : index + count] = value``'s first ``count`` lanes (0 <= count <=
    lanes): a masked store, which writes nothing past ``count``."""
    if not (_check_float_array(array) and isinstance(value, Vector) and value.dtype == array.dtype
            and isinstance(count, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        vector_type, pointer = _vector_at(context, builder, signature, args, value)
        count_value = context.cast(builder, args[3], signature.args[3], types.int64)
        alignment = ir.Constant(ir.IntType(32), array.dtype.bitwidth // 8)
        _masked(builder, "store", vector_type,
                [args[2], pointer, alignment, _first_lanes(builder, count_value, vector_type.count)])
        return context.get_dummy_value()
    return types.none(array, index, value, count), codegen


@intrinsic
def fill(typingctx, value, like):
    """A vector of ``like.dtype`` with every lane ``value`` (converted)."""
    if not (isinstance(value, (types.Float, types.Integer)) and _check_float_array(like)):
        return None
    vector = Vector(like.dtype)

    def codegen(context, builder, signature, args):
        _wide(builder)
        scalar = context.cast(builder, args[0], signature.args[0], like.dtype)
        return _broadcast(context, builder, vector, scalar)
    return vector(value, like), codegen


@intrinsic
def repeat(typingctx, value, count):
    """A tuple of ``count`` (a compile-time constant) copies of ``value``: a row of
    accumulators from one vector, a block of rows from one row."""
    if not isinstance(count, types.IntegerLiteral):
        return None
    tuple_type = types.UniTuple(value, count.literal_value)

    def codegen(context, builder, signature, args):
        return context.make_tuple(builder, tuple_type, [args[0]] * tuple_type.count)
    return tuple_type(value, count), codegen


@intrinsic
def load_strided(typingctx, array, index, step):
    """The vector of ``array[index + lane * step]`` for each lane (a gather: ``vgatherqps``
    on AVX-512): a row of per-key scales that lie every ``step`` values, as a (B, S, Hkv)
    cache's scales lie for one kv head."""
    if not (_check_float_array(array) and isinstance(index, types.Integer) and isinstance(step, types.Integer)):
        return None
    vector = Vector(array.dtype)

    def codegen(context, builder, signature, args):
        _wide(builder)
        lanes, vector_type = vector.lanes, context.get_value_type(vector)
        address, words = ir.IntType(64), ir.VectorType(ir.IntType(64), lanes)
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        first = builder.ptrtoint(builder.gep(data, [args[1]]), address)
        step_bytes = builder.mul(context.cast(builder, args[2], signature.args[2], types.int64),
                                 ir.Constant(address, array.dtype.bitwidth // 8))
        offsets = builder.mul(_splat(builder, step_bytes, words), ir.Constant(words, list(range(lanes))))
        pointers = builder.inttoptr(builder.add(_splat(builder, first, words), offsets),
                                    ir.VectorType(ir.PointerType(), lanes))
        every_lane = ir.VectorType(ir.IntType(1), lanes)
        gather = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vector_type, [pointers.type, ir.IntType(32), every_lane, vector_type]),
            f"llvm.masked.gather.v{lanes}{'f32' if array.dtype == types.float32 else 'f64'}.v{lanes}p0")
        return builder.call(gather, [pointers, ir.Constant(ir.IntType(32), array.dtype.bitwidth // 8),
                                     ir.Constant(every_lane, [1] * lanes), ir.Constant(vector_type, ir.Undefined)])
    return vector(array, index, step), codegen


def _splat(builder, scalar, vector_type):
    """``scalar`` in every lane of ``vector_type``."""
    single = builder.insert_element(ir.Constant(vector_type, ir.Undefined), scalar, ir.Constant(ir.IntType(32), 0))
    mask = ir.Constant(ir.VectorType(ir.IntType(32), vector_type.count), [0] * vector_type.count)
    return builder.shuffle_vector(single, ir.Constant(vector_type, ir.Undefined), mask)


def _broadcast(context, builder, vector, scalar):
    return _splat(builder, scalar, context.get_value_type(vector))


@intrinsic
def load_like(typingctx, array, index, like):
    """As many consecutive vectors from ``array[index]`` as the tuple ``like`` holds: one
    row of a micro-kernel's B panel, shaped like its accumulators."""
    if not (_check_float_array(array) and isinstance(index, types.Integer)
            and isinstance(like, types.UniTuple) and like.dtype == Vector(array.dtype)):
        return None
    vector = like.dtype

    def codegen(context, builder, signature, args):
        _wide(builder)
        vector_type = context.get_value_type(vector)
        values = []
        for v in range(like.count):
            offset = builder.add(args[1], ir.Constant(args[1].type, v * vector.lanes))
            pointer = _pointer(context, builder, signature.args[0], args[0], offset, vector_type)
            values.append(builder.load(pointer, align=array.dtype.bitwidth // 8))
        return context.make_tuple(builder, like, values)
    return like(array, index, like), codegen


def _prefetch(locality: int, doc: str):
    """An intrinsic asking for the cache line holding ``array[index]`` ahead of its use
    (``llvm.prefetch``, a read, with ``locality`` 3: every level, 2: L2 and beyond); no
    effect on results, never faults."""
    def typer(typingctx, array, index):
        if not (isinstance(array, types.Array) and isinstance(index, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            address = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(8).as_pointer())
            i32 = ir.IntType(32)
            function = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32]),
                "llvm.prefetch.p0i8")
            builder.call(function, [address, ir.Constant(i32, 0), ir.Constant(i32, locality), ir.Constant(i32, 1)])
            return context.get_dummy_value()
        return types.none(array, index), codegen
    typer.__doc__ = doc
    return intrinsic(typer)


prefetch = _prefetch(3, "Ask for the cache line holding ``array[index]``, into L1 (``prefetcht0``): for a "
                        "use a few rows on.")
# Measured on the 2-core Zen 4 VM, an int8 decode step (1, 32/8, 16384, 128) whose next key
# tile is asked for this way, rather than into L1, in two rounds: 4.1-4.4 ms against
# 5.6-6.8 with tiles of 32 keys, 5.5-5.8 against 6.0-6.8 with 384; float32's within noise.
prefetch_to_l2 = _prefetch(2, "Ask for the cache line holding ``array[index]``, into L2 (``prefetcht1``): "
                              "for a whole tile ahead, which would crowd L1 out.")


@intrinsic
def load_float16_bits(typingctx, codes, index, like, brain):
    """The float vector (of ``like``'s type) of the lanes 16-bit floats whose bytes start
    at ``codes[index]`` (an int8 array of raw bytes): IEEE half floats converted exactly
    (``vcvtph2ps`` on F16C), or with ``brain`` (a compile-time bool) bfloat16, whose bits
    are a float32's upper half. A float16 or bfloat16 cache read in place, no float32 copy."""
    if not (isinstance(codes, types.Array) and codes.dtype == types.int8 and isinstance(index, types.Integer)
            and isinstance(like, Vector) and isinstance(brain, types.BooleanLiteral)):
        return None
    bfloat = brain.literal_value

    def codegen(context, builder, signature, args):
        _wide(builder)
        return _load_float16_bits(context, builder, signature.args[0], args[0], args[1], like.lanes,
                                  context.get_value_type(like), like.dtype == types.float32, bfloat)
    return like(codes, index, like, brain), codegen


@intrinsic
def load_float16_bits_first(typingctx, codes, index, count, like, brain):
    """:func:`load_float16_bits` of the first ``count`` lanes only (0 <= count <= lanes), the
    rest 0: a masked load, which reads nothing past ``count`` (a row's last, partial vector,
    where the row may end its array)."""
    if not (isinstance(codes, types.Array) and codes.dtype == types.int8 and isinstance(index, types.Integer)
            and isinstance(count, types.Integer) and isinstance(like, Vector)
            and isinstance(brain, types.BooleanLiteral)):
        return None
    bfloat = brain.literal_value

    def codegen(context, builder, signature, args):
        _wide(builder)
        count_value = context.cast(builder, args[2], signature.args[2], types.int64)
        return _load_float16_bits(context, builder, signature.args[0], args[0], args[1], like.lanes,
                                  context.get_value_type(like), like.dtype == types.float32, bfloat, count_value)
    return like(codes, index, count, like, brain), codegen


def _load_float16_bits(context, builder, codes_type, codes, index, lanes, vector_type, to_float32, bfloat,
                       count=None):
    """:func:`load_float16_bits`' IR: ``lanes`` 16-bit floats from byte ``index`` of
    ``codes`` as a vector of ``vector_type`` (float32 where ``to_float32``); with ``count``
    (an int64 value) the first ``count`` of them, by a masked load, the rest 0."""
    element = ir.IntType(16) if bfloat else ir.HalfType()
    halves = ir.VectorType(element, lanes)
    pointer = _pointer(context, builder, codes_type, codes, index, halves)
    if count is None:
        loaded = builder.load(pointer, align=1)
    else:
        loaded = _masked(builder, "load", halves, [pointer, ir.Constant(ir.IntType(32), 2),
                                                   _first_lanes(builder, count, lanes), ir.Constant(halves, None)])
    if bfloat:  # the bits as a float32's upper half
        wide = builder.zext(loaded, ir.VectorType(ir.IntType(32), lanes))
        shifted = builder.shl(wide, ir.Constant(ir.VectorType(ir.IntType(32), lanes), [16] * lanes))
        loaded = builder.bitcast(shifted, ir.VectorType(ir.FloatType(), lanes))
        if to_float32:
            return loaded
    return builder.fpext(loaded, vector_type)  # (exact: float16 to float32, either to float64)


@intrinsic
def load_code(typingctx, codes, index, like, e4m3):
    """The float vector (of ``like``'s type) of the lanes one-byte codes at ``codes[index]``
    (an int8 array), converted in registers with no float copy of them anywhere: int8
    values (``vpmovsxbd`` then ``vcvtdq2ps``), or with ``e4m3`` float8 e4m3 values times
    2**-8, exactly (the byte's sign and 7 magnitude bits placed in a float16's, whose
    exponent bias is 8 more, and ``vcvtph2ps``: subnormals included, with no float32
    subnormal anywhere; 0x7F and 0xFF are NaN). ``e4m3``: a bool, constant where the caller
    is compiled (both decodes are emitted and one selected: LLVM drops the other)."""
    if not (isinstance(codes, types.Array) and codes.dtype == types.int8 and isinstance(index, types.Integer)
            and isinstance(like, Vector) and isinstance(e4m3, types.Boolean)):
        return None

    def codegen(context, builder, signature, args):
        _wide(builder)
        lanes, vector_type = like.lanes, context.get_value_type(like)
        pointer = _pointer(context, builder, signature.args[0], args[0], args[1], ir.VectorType(ir.IntType(8), lanes))
        loaded = builder.load(pointer, align=1)
        as_int8 = builder.sitofp(builder.sext(loaded, ir.VectorType(ir.IntType(32), lanes)), vector_type)
        words = ir.VectorType(ir.IntType(16), lanes)

        def splat(number):
            return ir.Constant(words, [number] * lanes)
        # sign-extended to 16 bits and shifted by 7: the sign lands in bit 15 (and a copy in
        # bit 14, which the mask clears), the exponent and mantissa in bits 13..7
        half = builder.and_(builder.shl(builder.sext(loaded, words), splat(7)), splat(0xBF80))
        nan = builder.icmp_unsigned("==", builder.and_(half, splat(0x3F80)), splat(0x3F80))
        half = builder.select(nan, splat(0x7E00), half)
        as_e4m3 = builder.fpext(builder.bitcast(half, ir.VectorType(ir.HalfType(), lanes)), vector_type)
        return builder.select(args[3], as_e4m3, as_int8)
    return like(codes, index, like, e4m3), codegen


@intrinsic
def store_float16_bits(typingctx, out, index, value, brain):
    """Store the float32 vector ``value`` as lanes 16-bit floats, rounded to nearest even,
    at the bytes ``out[index : index + 2 * lanes]`` (an int8 array): IEEE half floats
    (``vcvtps2ph`` on F16C), or with ``brain`` (a compile-time bool) bfloat16, a NaN as
    the quiet NaN of its sign (both as NumPy and ml_dtypes convert)."""
    if not (isinstance(out, types.Array) and out.dtype == types.int8 and isinstance(index, types.Integer)
            and isinstance(value, Vector) and value.dtype == types.float32
            and isinstance(brain, types.BooleanLiteral)):
        return None
    bfloat = brain.literal_value

    def codegen(context, builder, signature, args):
        _store_float16_bits(context, builder, signature, args, value.lanes, bfloat)
        return context.get_dummy_value()
    return types.none(out, index, value, brain), codegen


@intrinsic
def store_float16_bits_first(typingctx, out, index, value, count, brain):
    """:func:`store_float16_bits` of the first ``count`` lanes only (0 <= count <= lanes): a
    masked store of the rounded halves, which writes nothing past ``count`` (a row's last,
    partial vector, where the next bytes are another row's)."""
    if not (isinstance(out, types.Array) and out.dtype == types.int8 and isinstance(index, types.Integer)
            and isinstance(value, Vector) and value.dtype == types.float32 and isinstance(count, types.Integer)
            and isinstance(brain, types.BooleanLiteral)):
        return None
    bfloat = brain.literal_value

    def codegen(context, builder, signature, args):
        count_value = context.cast(builder, args[3], signature.args[3], types.int64)
        _store_float16_bits(context, builder, signature, args, value.lanes, bfloat, count_value)
        return context.get_dummy_value()
    return types.none(out, index, value, count, brain), codegen


def _store_float16_bits(context, builder, signature, args, lanes, bfloat, count=None):
    """:func:`store_float16_bits`' IR (``args``: the bytes, the index, the float32 vector):
    the vector rounded to 16-bit floats and stored; with ``count`` (an int64 value) its
    first ``count`` lanes only, by a masked store."""
    _wide(builder)
    halves = ir.VectorType(ir.IntType(16) if bfloat else ir.HalfType(), lanes)
    pointer = _pointer(context, builder, signature.args[0], args[0], args[1], halves)
    narrow = _bfloat16_rounded(builder, args[2], True) if bfloat else builder.fptrunc(args[2], halves)
    if count is None:
        builder.store(narrow, pointer, align=1)
    else:
        _masked(builder, "store", halves,
                [narrow, pointer, ir.Constant(ir.IntType(32), 2), _first_lanes(builder, count, lanes)])


@intrinsic
def as_bits(typingctx, value):
    """A float32's bits as a uint32 (no conversion)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(value), codegen


@intrinsic
def as_float(typingctx, bits):
    """The float32 with the low 32 bits of an integer (no conversion; Numba's arithmetic
    widens uint32 to 64 bits)."""
    if not isinstance(bits, types.Integer) or bits.bitwidth < 32:
        return None

    def codegen(context, builder, signature, args):
        value = args[0] if bits.bitwidth == 32 else builder.trunc(args[0], ir.IntType(32))
        return builder.bitcast(value, ir.FloatType())
    return types.float32(bits), codegen


def _bfloat16_rounded(builder, value, keep_nan=False):
    """The float32 vector ``value`` as bfloat16 bits (an i16 vector), rounded to nearest
    even: ``(bits + 0x7FFF + (bits >> 16 & 1)) >> 16``; with ``keep_nan``, a NaN lane as
    the quiet NaN of its sign (the sum would carry a NaN's payload into inf or -0)."""
    lanes = value.type.count
    words = ir.VectorType(ir.IntType(32), lanes)
    if not isinstance(value.type.element, ir.FloatType):  # (float64 kernels compile it, never run it)
        value = builder.fptrunc(value, ir.VectorType(ir.FloatType(), lanes))

    def splat(number):
        return ir.Constant(words, [number] * lanes)
    if BF16_DOT and not keep_nan and lanes == 16:  # vcvtneps2bf16 (subnormals in and out are 0)
        function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
            ir.VectorType(_BFloat(), lanes), [value.type]), "llvm.x86.avx512bf16.cvtneps2bf16.512")
        return builder.bitcast(builder.call(function, [value]), ir.VectorType(ir.IntType(16), lanes))
    bits = builder.bitcast(value, words)
    high = builder.lshr(bits, splat(16))
    rounded = builder.lshr(builder.add(builder.add(bits, splat(0x7FFF)), builder.and_(high, splat(1))), splat(16))
    if keep_nan:
        nan = builder.icmp_unsigned(">", builder.and_(bits, splat(0x7FFFFFFF)), splat(0x7F800000))
        rounded = builder.select(nan, builder.or_(builder.and_(high, splat(0x8000)), splat(0x7FC0)), rounded)
    return builder.trunc(rounded, ir.VectorType(ir.IntType(16), lanes))


@intrinsic
def store_bfloat16(typingctx, out, index, value):
    """Store the float32 vector ``value`` (lanes L) rounded to bfloat16, in order, as the
    L / 2 float32 elements ``out[index : index + L / 2]`` each holding two (the lower
    lane in the low half): a row of bfloat16 pairs (:func:`splat_pair_dot_rows`). On
    AVX512_BF16 CPUs by ``vcvtneps2bf16``, which gives 0 for a subnormal value (below
    1.2e-38, where the integer rounding elsewhere keeps a subnormal bfloat16)."""
    if not (_check_float_array(out) and isinstance(value, Vector) and value.dtype == out.dtype):
        return None

    def codegen(context, builder, signature, args):
        _wide(builder)
        rounded = _bfloat16_rounded(builder, args[2])
        pointer = _pointer(context, builder, signature.args[0], args[0], args[1], rounded.type)
        builder.store(rounded, pointer, align=2)
        return context.get_dummy_value()
    return types.none(out, index, value), codegen


@intrinsic
def store_bfloat16_two(typingctx, out, index, first, second):
    """:func:`store_bfloat16` of ``first`` then ``second`` (lanes L each) as the L float32
    elements from ``out[index]``: with AVX512_BF16's 16 lanes one ``vcvtne2ps2bf16`` and
    one 64-byte store, where two stores of their own take two conversions of two
    micro-ops each (the same bits)."""
    if not (_check_float_array(out) and isinstance(first, Vector) and first == second and first.dtype == out.dtype):
        return None

    def codegen(context, builder, signature, args):
        _wide(builder)
        vector = args[2].type
        if BF16_DOT and vector.count == 16:
            function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
                ir.VectorType(_BFloat(), 32), [vector, vector]), "llvm.x86.avx512bf16.cvtne2ps2bf16.512")
            # (its first operand's lanes go high)
            both = builder.bitcast(builder.call(function, [args[3], args[2]]), ir.VectorType(ir.IntType(16), 32))
        else:  # (float64 kernels compile it, and never run it)
            low, high = _bfloat16_rounded(builder, args[2]), _bfloat16_rounded(builder, args[3])
            both = builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(ir.IntType(32), 2 * low.type.count),
                                                                 list(range(2 * low.type.count))))
        pointer = _pointer(context, builder, signature.args[0], args[0], args[1], both.type)
        builder.store(both, pointer, align=4)
        return context.get_dummy_value()
    return types.none(out, index, first, second), codegen


@intrinsic
def store_rounded_pairs(typingctx, out, index, first, second):
    """Store the float32 vectors ``first`` and ``second`` (lanes L; two rows' values at the
    same columns) rounded to bfloat16 and interleaved, as ``out[index + i]`` = pair
    (first's i, second's i), i < L: two rows of consecutive query rows as
    :func:`splat_pair_dot_rows` reads them along the rows (a backward's P, dS, dO), rounded
    as :func:`store_bfloat16` rounds (``vcvtneps2bf16`` on AVX512_BF16 CPUs), one shuffle
    for the lot."""
    # (float64 kernels compile it too, and never run it)
    if not (_check_float_array(out) and isinstance(first, Vector) and isinstance(second, Vector)):
        return None

    def codegen(context, builder, signature, args):
        _wide(builder)
        low, high = _bfloat16_rounded(builder, args[2]), _bfloat16_rounded(builder, args[3])
        _store_interleaved(context, builder, signature.args[0], args[0], args[1], low, high)
        return context.get_dummy_value()
    return types.none(out, index, first, second), codegen


@intrinsic
def store_interleaved_pairs(typingctx, out, index, pairs, first, second, has_second):
    """Store the L bfloat16 that start at word ``pairs[first]`` (a float32 array whose
    words hold two bfloat16 each: bfloat16 memory seen as float32) interleaved with the L
    at ``pairs[second]`` (zeros where ``has_second`` is False; ``second`` must still be a
    readable index, ``first`` say), as ``out[index + i]`` = pair (first's i, second's i),
    i < L (the float32 lanes of a vector): two rows of values of consecutive keys as
    :func:`splat_pair_dot_rows` reads them, with no rounding (the values are bfloat16
    already) and one shuffle for the lot."""
    # (float64 kernels compile it too, and never run it)
    if not (_check_float_array(out) and _check_float_array(pairs) and isinstance(has_second, types.Boolean)):
        return None

    def codegen(context, builder, signature, args):
        _wide(builder)
        lanes = VECTOR_BYTES // 4
        halves = ir.VectorType(ir.IntType(16), lanes)
        low = builder.load(_pointer(context, builder, signature.args[2], args[2], args[3], halves), align=2)
        high = builder.load(_pointer(context, builder, signature.args[2], args[2], args[4], halves), align=2)
        high = builder.select(args[5], high, ir.Constant(halves, [0] * lanes))
        _store_interleaved(context, builder, signature.args[0], args[0], args[1], low, high)
        return context.get_dummy_value()
    return types.none(out, index, pairs, first, second, has_second), codegen


def _store_interleaved(context, builder, out_type, out, index, low, high):
    """Store i16 vectors ``low`` and ``high`` (L lanes each) interleaved, as the L float32
    words ``out[index + i]`` = pair (low's i, high's i)."""
    lanes = low.type.count
    mask = ir.Constant(ir.VectorType(ir.IntType(32), 2 * lanes),
                       [lane // 2 + (lanes if lane % 2 else 0) for lane in range(2 * lanes)])
    interleaved = builder.shuffle_vector(low, high, mask)
    builder.store(interleaved, _pointer(context, builder, out_type, out, index, interleaved.type), align=4)


def _is_block(block, dtype):
    """Whether ``block`` is a tuple of rows, each a tuple of vectors of ``dtype``."""
    return (isinstance(block, types.UniTuple) and isinstance(block.dtype, types.UniTuple)
            and block.dtype.dtype == Vector(dtype))


def _splat_rows(step):
    """The codegen of a micro-kernel step: ``step(builder, broadcast, b, c)`` for each row's
    broadcast of ``a[index + r * a_row]`` and each vector ``b`` of ``row`` into ``c``."""
    def codegen(context, builder, signature, args):
        _wide(builder)
        a_value, index_value, a_row_value, row_value, block_value = args
        row, block = signature.args[3], signature.args[4]
        data = context.make_array(signature.args[0])(context, builder, a_value).data
        b_vectors = cgutils.unpack_tuple(builder, row_value, row.count)
        rows = []
        for r, acc in enumerate(cgutils.unpack_tuple(builder, block_value, block.count)):
            offset = builder.add(index_value, builder.mul(a_row_value, ir.Constant(a_row_value.type, r)))
            scalar = builder.load(builder.gep(data, [offset]))
            broadcast = _broadcast(context, builder, row.dtype, scalar)
            values = [step(builder, broadcast, b, c) for b, c in zip(b_vectors, cgutils.unpack_tuple(builder, acc,
                                                                                                   row.count))]
            rows.append(context.make_tuple(builder, row, values))
        return context.make_tuple(builder, block, rows)
    return codegen


@intrinsic
def splat_fma_rows(typingctx, a, index, a_row, row, block):
    """``block[r][v] + a[index + r * a_row] * row[v]`` for every row ``r`` of the block
    and vector ``v`` of ``row`` (one broadcast per row, one FMA per vector): a
    micro-kernel's step through the depth."""
    if not (_check_float_array(a) and isinstance(row, types.UniTuple) and _is_block(block, a.dtype)
            and block.dtype == row):
        return None
    return block(a, index, a_row, row, block), _splat_rows(lambda builder, a, b, c: call_llvm_intrinsic(
        builder, "fma", a, b, c))


# Whether the kernels compile bfloat16 pair products to AVX512_BF16's vdpbf16ps (Zen 4,
# Sapphire Rapids and later); elsewhere :func:`splat_pair_dot_rows` is two FMAs per pair.
BF16_DOT = VECTOR_BYTES == 64 and "+avx512bf16" in target_features().split(",")
# Whether bfloat16 forwards take those pair products unless told otherwise: where they are
# faster than float32's FMAs (AMD's cores, not Intel's vdpbf16ps: :func:`npattn.cpu.isa.bf16_pairs_pay`;
# on Intel's AMX tiles, :mod:`npattn.cpu.amx`)
BF16_PAIRS_BY_DEFAULT = BF16_DOT and (bf16_pairs_pay() or TILES)


class _BFloat(ir.types.Type):
    """LLVM's ``bfloat`` (llvmlite's IR builder has no such type), for vdpbf16ps's operands."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash("bfloat")


def _pair_dot(builder, a, b, c):
    """``c + a.lo * b.lo + a.hi * b.hi`` per float32 lane, where each lane of ``a`` and ``b``
    holds two bfloat16 (the lower-addressed in the low half): vdpbf16ps where the CPU has
    it, else the same two exact products by FMA."""
    lanes = c.type.count
    if not isinstance(c.type.element, ir.FloatType):  # (float64 kernels compile it, never run it)
        return call_llvm_intrinsic(builder, "fma", a, b, c)
    if BF16_DOT:
        pairs = ir.VectorType(_BFloat(), 2 * lanes)
        function = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(c.type, [c.type, pairs, pairs]), "llvm.x86.avx512bf16.dpbf16ps.512")
        return builder.call(function, [c, builder.bitcast(a, pairs), builder.bitcast(b, pairs)])
    words = ir.VectorType(ir.IntType(32), lanes)

    def halves(value):
        bits = builder.bitcast(value, words)
        low = builder.shl(bits, ir.Constant(words, [16] * lanes))
        high = builder.and_(bits, ir.Constant(words, [0xFFFF0000] * lanes))
        return builder.bitcast(low, c.type), builder.bitcast(high, c.type)
    (a_low, a_high), (b_low, b_high) = halves(a), halves(b)
    return call_llvm_intrinsic(builder, "fma", a_high, b_high, call_llvm_intrinsic(builder, "fma", a_low, b_low, c))


@intrinsic
def splat_pair_dot_rows(typingctx, a, index, a_row, row, block):
    """:func:`splat_fma_rows` on bfloat16 pairs: every float32 element of ``a`` and lane of
    ``row`` holds two bfloat16 of consecutive depths (see :func:`npattn.cpu.microkernels.pair_bits`),
    and each step adds both products (one vdpbf16ps per vector): half the depth steps of
    float32 for the same columns."""
    if not (_check_float_array(a) and isinstance(row, types.UniTuple) and _is_block(block, a.dtype)
            and block.dtype == row):
        return None
    return block(a, index, a_row, row, block), _splat_rows(_pair_dot)


@intrinsic
def store_scaled_rows(typingctx, c, index, c_row, block, scale, accumulate):
    """``c[index + r * c_row + v * lanes :][:lanes] = [c[...] +] scale * block[r][v]`` for
    every row and vector of ``block``: a micro-kernel's finished rows of C (``accumulate`` a
    bool)."""
    if not (_check_float_array(c) and _is_block(block, c.dtype) and scale == block.dtype.dtype
            and isinstance(accumulate, types.Boolean)):
        return None
    vector = block.dtype.dtype

    def codegen(context, builder, signature, args):
        _wide(builder)
        c_value, index_value, c_row_value, block_value, scale_value, accumulate_value = args
        vector_type = context.get_value_type(vector)
        align = c.dtype.bitwidth // 8
        pointers, results = [], []
        for r, acc in enumerate(cgutils.unpack_tuple(builder, block_value, block.count)):
            row_index = builder.add(index_value, builder.mul(c_row_value, ir.Constant(c_row_value.type, r)))
            for v, value in enumerate(cgutils.unpack_tuple(builder, acc, block.dtype.count)):
                offset = builder.add(row_index, ir.Constant(row_index.type, v * vector.lanes))
                pointers.append(_pointer(context, builder, signature.args[0], c_value, offset, vector_type))
                results.append(builder.fmul(value, scale_value))
        accumulate_bit = context.cast(builder, accumulate_value, accumulate, types.boolean)
        with builder.if_else(builder.icmp_unsigned("!=", accumulate_bit, ir.Constant(accumulate_bit.type, 0))) \
                as (adding, replacing):
            with adding:
                for pointer, result in zip(pointers, results):
                    builder.store(builder.fadd(result, builder.load(pointer, align=align)), pointer, align=align)
            with replacing:
                for pointer, result in zip(pointers, results):
                    builder.store(result, pointer, align=align)
        return context.get_dummy_value()
    return types.none(c, index, c_row, block, scale, accumulate), codegen


def _lane_sums(builder, vectors, lanes):
    """A vector whose first ``len(vectors)`` lanes (a power of two, at most ``lanes``) are the
    sums of each vector's lanes, in order: pairs of vectors folded into one, halves of each
    one's lanes added (a shuffle network of 3 (n - 1) instructions for n vectors, where a
    reduction of each costs 2 log2(lanes))."""
    group = lanes  # partial sums each vector holds per accumulator
    while len(vectors) > 1:
        half, groups = group // 2, lanes // group
        low = [g * group + x for g in range(groups) for x in range(half)]
        high = [g * group + half + x for g in range(groups) for x in range(half)]
        vectors = [builder.fadd(builder.shuffle_vector(a, b, _lane_indices(low + [lanes + i for i in low])),
                                builder.shuffle_vector(a, b, _lane_indices(high + [lanes + i for i in high])))
                   for a, b in zip(vectors[0::2], vectors[1::2])]
        group = half
    value, count = vectors[0], lanes // group  # count groups of `group` partial sums
    while group > 1:  # the rest within each group (fewer vectors than lanes)
        half = group // 2
        swapped = [lane - lane % group + (lane % group + half) % group for lane in range(lanes)]
        value = builder.fadd(value, builder.shuffle_vector(value, value, _lane_indices(swapped)))
        group = half
    step = lanes // count
    return builder.shuffle_vector(value, value, _lane_indices([(i * step) % lanes for i in range(lanes)]))


@intrinsic
def store_key_sums(typingctx, c, index, c_row, sums, factors):
    """``c[index + r * c_row + j] = factors[j] * (the sum of sums[n r + j]'s lanes)`` for
    the n keys j of each row r of a dot-product block (``factors``: n scalars, n 2 or 4;
    ``sums``: a tuple of n x rows vectors, row by row, a power of two): the lanes summed
    ``lanes`` vectors at a time by one shuffle network (:func:`_lane_sums`), scaled by one
    multiply and stored n scores a row."""
    if not (_check_float_array(c) and isinstance(sums, types.UniTuple) and isinstance(sums.dtype, Vector)
            and sums.dtype.dtype == c.dtype and isinstance(factors, types.UniTuple) and factors.count in (2, 4)
            and factors.dtype == c.dtype and sums.count % factors.count == 0
            and sums.count & (sums.count - 1) == 0):
        return None
    vector = sums.dtype
    lanes = vector.lanes
    keys = factors.count

    def codegen(context, builder, signature, args):
        _wide(builder)
        c_value, index_value, c_row_value, sums_value, factors_value = args
        accumulators = cgutils.unpack_tuple(builder, sums_value, sums.count)
        scalars = cgutils.unpack_tuple(builder, factors_value, keys)
        vector_type = context.get_value_type(vector)
        factor = ir.Constant(vector_type, ir.Undefined)
        for lane in range(lanes):
            factor = builder.insert_element(factor, scalars[lane % keys], ir.Constant(ir.IntType(32), lane))
        row_type = ir.VectorType(vector_type.element, keys)
        chunk = min(lanes, sums.count)  # accumulators a network takes: whole rows of n
        for first in range(0, sums.count, chunk):
            scores = builder.fmul(_lane_sums(builder, accumulators[first:first + chunk], lanes), factor)
            for row in range(chunk // keys):
                r = (first + keys * row) // keys
                offset = builder.add(index_value, builder.mul(c_row_value, ir.Constant(c_row_value.type, r)))
                pointer = _pointer(context, builder, signature.args[0], c_value, offset, row_type)
                part = builder.shuffle_vector(scores, scores, _lane_indices([keys * row + x for x in range(keys)]))
                builder.store(part, pointer, align=c.dtype.bitwidth // 8)
        return context.get_dummy_value()
    return types.none(c, index, c_row, sums, factors), codegen


def call_llvm_intrinsic(builder, stem, *operands):
    """``llvm.<stem>`` (``fma``, ``floor``, ...) on floating-point vector operands of one
    type. llvmlite's builder has scalar forms only; LLVM overloads them on vectors by
    name suffix (``llvm.fma.v16f32``)."""
    vector_type = operands[0].type
    suffix = f"v{vector_type.count}{'f32' if isinstance(vector_type.element, ir.FloatType) else 'f64'}"
    function = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(vector_type, [vector_type] * len(operands)), f"llvm.{stem}.{suffix}")
    return builder.call(function, operands)


# The flags of a sum whose bits must not depend on the code around it. Numba gives every
# float instruction without flags of its own the kernels' fastmath flags, "reassoc" among
# them, and with "reassoc" LLVM may regroup a chain of sums as it schedules them: a row's
# softmax sum then took other bits inlined into a short tile's code than in the general
# loop, on an Emerald Rapids CPU and not on a Zen 4. "nsz" alone keeps the order written.
IN_ORDER = ("nsz",)


@intrinsic
def add(typingctx, a, b):
    """``a + b``, lane by lane on vectors, or of two floats, in the order written (no
    "reassoc": a chain of ``add`` sums in the same order wherever it is compiled)."""
    if not (isinstance(a, (Vector, types.Float)) and a == b):
        return None

    def codegen(context, builder, signature, args):
        _wide(builder)
        return builder.fadd(*args, flags=IN_ORDER)
    return a(a, b), codegen


@intrinsic
def multiply(typingctx, a, b):
    """``a * b`` lane by lane (vectors of one type)."""
    if not (isinstance(a, Vector) and a == b):
        return None

    def codegen(context, builder, signature, args):
        _wide(builder)
        return builder.fmul(*args)
    return a(a, b), codegen


@intrinsic
def multiply_add(typingctx, a, b, c):
    """``a * b + c`` lane by lane, fused (one rounding)."""
    if not (isinstance(a, Vector) and a == b == c):
        return None

    def codegen(context, builder, signature, args):
        _wide(builder)
        return call_llvm_intrinsic(builder, "fma", *args)
    return a(a, b, c), codegen


def select_greater(builder, a, b):
    """``a > b ? a : b`` lane by lane (``b`` where either is NaN): one vmax instruction."""
    return builder.select(builder.fcmp_ordered(">", a, b), a, b)


@intrinsic
def maximum(typingctx, a, b):
    """``a > b ? a : b`` lane by lane (``b`` where ``a`` is NaN)."""
    if not (isinstance(a, Vector) and a == b):
        return None

    def codegen(context, builder, signature, args):
        _wide(builder)
        return select_greater(builder, *args)
    return a(a, b), codegen


def _reduce(combine, doc):
    """An intrinsic folding a vector's lanes into one scalar with ``combine(builder, x, y)``,
    halving the vector each round (log2(lanes) shuffles)."""
    def typer(typingctx, a):
        if not isinstance(a, Vector):
            return None

        def codegen(context, builder, signature, args):
            _wide(builder)
            value, width = args[0], a.lanes
            while width > 1:
                width //= 2
                low = builder.shuffle_vector(value, value, _lane_indices(list(range(width))))
                high = builder.shuffle_vector(value, value, _lane_indices(list(range(width, 2 * width))))
                value = combine(builder, low, high)
            return builder.extract_element(value, ir.Constant(ir.IntType(32), 0))
        return a.dtype(a), codegen
    typer.__doc__ = doc
    return intrinsic(typer)


horizontal_sum = _reduce(lambda builder, x, y: builder.fadd(x, y, flags=IN_ORDER),
                         "The sum of a vector's lanes, halves added in the same order everywhere.")
horizontal_max = _reduce(select_greater, "The largest of a vector's lanes (NaN lanes are skipped).")


@intrinsic
def transpose_square(typingctx, x, x_offset, x_row, out, out_offset, out_row):
    """``out[out_offset + c * out_row + r] = x[x_offset + r * x_row + c]`` for a square block
    of one vector's lanes (16 x 16 float32 on AVX-512, 8 x 8 on AVX2), in registers: log2(lanes)
    rounds of two-input shuffles that swap ever smaller sub-blocks (the lanes x lanes
    loads and stores are whole vectors)."""
    if not (_check_float_array(x) and _check_float_array(out) and x.dtype == out.dtype):
        return None
    vector = Vector(x.dtype)
    n = vector.lanes

    def codegen(context, builder, signature, args):
        _wide(builder)
        x_value, x_offset_value, x_row_value, out_value, out_offset_value, out_row_value = args
        vector_type = context.get_value_type(vector)
        index_type = x_offset_value.type
        rows = []
        for r in range(n):
            index = builder.add(x_offset_value, builder.mul(x_row_value, ir.Constant(index_type, r)))
            pointer = _pointer(context, builder, signature.args[0], x_value, index, vector_type)
            rows.append(builder.load(pointer, align=x.dtype.bitwidth // 8))
        _store_transposed(context, builder, rows, signature.args[3], out_value, out_offset_value, out_row_value,
                          vector_type, x.dtype.bitwidth // 8)
        return context.get_dummy_value()
    return types.none(x, x_offset, x_row, out, out_offset, out_row), codegen


@intrinsic
def transpose_converted_square(typingctx, codes, byte_offset, row_bytes, out, out_offset, out_row, brain):
    """:func:`transpose_square` of 16-bit floats (bfloat16 with ``brain``, a compile-time
    bool, else float16) into ``out`` (float32; float64 compiles, for kernels that never
    read 16-bit keys by tiles): row r of the square is the lanes values whose
    bytes start at ``codes[byte_offset + r * row_bytes]`` (an int8 array), each row
    converted as it is loaded (:func:`load_float16_bits`, exact), so a 16-bit key tile is
    packed as K^T with no float32 copy of its rows."""
    if not (isinstance(codes, types.Array) and codes.dtype == types.int8 and _check_float_array(out)
            and isinstance(brain, types.BooleanLiteral)):
        return None
    vector = Vector(out.dtype)
    n = vector.lanes
    bfloat = brain.literal_value

    def codegen(context, builder, signature, args):
        _wide(builder)
        codes_value, offset_value, row_value, out_value, out_offset_value, out_row_value, _ = args
        vector_type = context.get_value_type(vector)
        index_type = offset_value.type
        rows = []
        for r in range(n):
            index = builder.add(offset_value, builder.mul(row_value, ir.Constant(index_type, r)))
            rows.append(_load_float16_bits(context, builder, signature.args[0], codes_value, index, n, vector_type,
                                           out.dtype == types.float32, bfloat))
        _store_transposed(context, builder, rows, signature.args[3], out_value, out_offset_value, out_row_value,
                          vector_type, out.dtype.bitwidth // 8)
        return context.get_dummy_value()
    return types.none(codes, byte_offset, row_bytes, out, out_offset, out_row, brain), codegen


def _store_transposed(context, builder, rows, out_type, out_value, out_offset_value, out_row_value, vector_type,
                      align):
    """Transpose the square of vectors ``rows`` (row r's lane c to row c's lane r) in
    registers: log2(lanes) rounds of two-input shuffles that swap ever smaller sub-blocks;
    then store row c at ``out[out_offset + c * out_row]``."""
    n = len(rows)
    step = n // 2
    while step >= 1:
        low = [j if j & step == 0 else n + j - step for j in range(n)]
        high = [j + step if j & step == 0 else n + j for j in range(n)]
        for i in range(n):
            if i & step == 0:
                first, second = rows[i], rows[i + step]
                rows[i] = builder.shuffle_vector(first, second, _lane_indices(low))
                rows[i + step] = builder.shuffle_vector(first, second, _lane_indices(high))
        step //= 2
    index_type = out_offset_value.type
    for c in range(n):
        index = builder.add(out_offset_value, builder.mul(out_row_value, ir.Constant(index_type, c)))
        pointer = _pointer(context, builder, out_type, out_value, index, vector_type)
        builder.store(rows[c], pointer, align=align)


def _lane_indices(indices):
    return ir.Constant(ir.VectorType(ir.IntType(32), len(indices)), indices)


def lanes_of(dtype) -> int:
    """Lanes of a vector of ``dtype`` (a NumPy dtype): 16 for float32, 8 for float64 on
    AVX-512; 8 and 4 on AVX2."""
    return VECTOR_BYTES // dtype.itemsize


def lanes_in(array):
    """:func:`lanes_of` ``array``'s dtype, in jitted code, as a constant fixed when the
    caller is typed. ``VECTOR_BYTES // array.itemsize`` is not one: Numba reads an array's
    itemsize from the array at run time, so each such line was an integer division (an
    ``idiv`` in every row of a small call's softmax and 16-bit tile conversions, found
    by perf)."""
    raise NotImplementedError


@overload(lanes_in, jit_options=OPTIONS, inline="always")
def _lanes_in_overload(array):
    lanes = VECTOR_BYTES // (array.dtype.bitwidth // 8)
    return lambda array: lanes


def line_elements(array):
    """Elements of ``array`` per 64-byte cache line, a constant as :func:`lanes_in`'s."""
    raise NotImplementedError


@overload(line_elements, jit_options=OPTIONS, inline="always")
def _line_elements_overload(array):
    elements = max(1, 64 // (array.dtype.bitwidth // 8))
    return lambda array: elements


