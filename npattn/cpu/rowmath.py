"""Row operations of the online softmax, on explicit 512-bit vectors.

Numba's ``np.exp`` is a scalar libm call here (no SVML), about 5 ns an
element: slower than the matrix products it sits between. For float32,
:func:`exp_shifted` uses ``2**x = 2**n * 2**f`` with ``n = round(x)`` and ``f``
in [-1/2, 1/2]: a degree-7 Taylor polynomial for ``2**f`` (relative error below
1e-8, under float32's rounding) times ``2**n`` assembled in the exponent bits.
Results below about 2**-126 are exactly 0 (the exponent field is 0), so masked
scores (-inf) contribute exactly nothing; results from 2**127.5 up (near float32's
largest, 2**128) are +inf.
float64 uses the exact ``exp``.

A bfloat16 forward's probabilities are rounded to bfloat16 (relative steps of 2**-8)
before P V: there :func:`exp_shifted` takes ``brief``, a degree-4 polynomial fitted for
the least relative error on [-1/2, 1/2] (2.7e-6 at most, a thousandth of bfloat16's
rounding) with ``(x - shift) * log2(e)`` as one FMA, and on AVX-512 ``n`` rounded by
``vrndscaleps`` and ``2**n * 2**f`` made by ``vscalefps``: 9 instructions per vector
where the exact one takes 17, and 2 more that make every result below 2**-126 exactly 0
(masked scores among them) without computing it: a subnormal result costs Intel's
cores a microcode assist each (AMD's none), and a causal bfloat16 forward's masked
scores made them by the million (below). A bfloat16 forward's tiles go to pairs with
the thread's MXCSR flushing subnormal results to zero instead, the same bits with one
instruction for the three (:func:`exp_tile_to_pairs`).

Measured on one core of the project's machine, per element of a 192 x 384 score
tile: the polynomial as a plain loop left to LLVM's vectorizer took 0.87 ns with its
sum; written here on :mod:`~npattn.cpu.simd` vectors (one instruction sequence per
16 lanes on AVX-512, 8 on AVX2, rounding by the 1.5 * 2**23 shift instead of a round
and a convert), 0.38 ns. :func:`row_max` likewise keeps a vector of partial maxima: 0.14 ns an
element, where a loop of scalar compares took 0.37 ns (and a plain max reduction
does not vectorize at all: 5 ns).
"""
from __future__ import annotations

import math

import numpy as np

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .jit import HELPER_OPTIONS, OPTIONS
from .signatures import plain_int, scalar_like
from .microkernels import pair_bits
from .simd import (BF16_DOT, VECTOR_BYTES, Vector, add, call_llvm_intrinsic, fill, horizontal_max, horizontal_sum,
                   lanes_in, load, load_first, maximum, multiply, store, store_bfloat16, store_bfloat16_two,
                   store_first)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# 2**f = exp(f ln2) = sum (f ln2)^k / k!
_C = tuple(LN2 ** k / math.factorial(k) for k in range(8))
# brief: the degree-4 polynomial with the least largest relative error against 2**f on
# [-1/2, 1/2] (fitted by reweighted least squares on Chebyshev nodes: 2.7e-6 in float32)
_BRIEF_C = (0.9999992613205271, 0.6931218144108566, 0.2402474520466758, 0.05591786358602077, 0.009570088179461197)
# 2**-127 has exponent field 0: exactly 0; 2**128 has field 255: +inf
_LOWEST, _HIGHEST = -127.0, 128.0
_ROUNDING_SHIFT = 1.5 * 2.0 ** 23
# brief on AVX-512, where vscalefps makes p * 2**n: below 2**-126 (float32's least normal)
# the result is 0, and scalef is handed 0 there instead (only arguments within half a
# step of it still make a subnormal: p is 2**f, f in [-1/2, 1/2]). With the result
# subnormal or 0 by underflow, every such lane took an Intel core's microcode assist (on
# the Sapphire Rapids VM, 2026-12-02, one thread, a (4, 16, 1024, 64) causal bfloat16
# forward's exp to pairs took 41 ms against 12 for the full problem's, twice the scores).
# Values that small are nothing beside the row's largest (1), and bfloat16 products read
# subnormals as 0 anyway. Past 2**128 the result is +inf by itself. No upper clamp: it
# only turned an argument of +inf (a score of +inf) into +inf instead of inf - inf = NaN,
# and such a score's row is NaN anyway, as the reference's is (its max is +inf); the
# clamp took 1-2% of a bfloat16 forward.
_SCALED_LOWEST = -126.0
# The same zeros where the thread's MXCSR flushes subnormal results to zero (FTZ, which
# spares the assist: :func:`flushing_subnormals`): the argument raised to at least -127
# (-inf among them; a NaN stays NaN), whence every result below 2**-126 is subnormal, so
# 0, and the others are the bits of the compare-and-select. On the AMX VM, one core, a
# 192 x 384 tile: 0.150 ns an element against 0.175 (one vmaxps for a compare and two
# selects).
_FLUSHED_LOWEST = -127.0
# MXCSR's flush-to-zero bit: results below float32's least normal become 0
_FLUSH_TO_ZERO = 0x8000


@intrinsic
def _exp_float32(typingctx, x, shift, brief):
    """``exp(x - shift)`` for float32 scalars or float32 vectors (lane by lane), by the
    polynomial of the module docstring; ``brief`` (a compile-time bool): bfloat16's."""
    float32_vector = isinstance(x, Vector) and x.dtype == types.float32
    if not (x == shift and (x == types.float32 or float32_vector) and isinstance(brief, types.BooleanLiteral)):
        return None

    def codegen(context, builder, signature, args):
        return _exp_code(builder, args[0], args[1], brief.literal_value)
    return x(x, shift, brief), codegen


@intrinsic
def _exp_float32_flushed(typingctx, x, multiplier, shift):
    """bfloat16's brief ``exp(scale * x - shift)`` on float32 vectors, ``multiplier`` being
    ``scale * log2(e)`` (rounded to float32: ``log2(e)``'s float32 itself where scale is 1,
    so the bits of :func:`_exp_float32`'s brief exp then), for code run between
    :func:`flushing_subnormals` and :func:`restore_control` (``flushed``: see :func:`_exp_code`)."""
    if not (isinstance(x, Vector) and x.dtype == types.float32 and x.lanes == 16 and x == multiplier == shift):
        return None

    def codegen(context, builder, signature, args):
        return _exp_code(builder, args[0], args[2], True, multiplier=args[1], flushed=True)
    return x(x, multiplier, shift), codegen


def _control_word(builder, name, slot):
    function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [ir.PointerType(
        ir.IntType(8))]), name)
    builder.call(function, [builder.bitcast(slot, ir.PointerType(ir.IntType(8)))])


@intrinsic
def flushing_subnormals(typingctx):
    """Set this thread's MXCSR to flush subnormal float results to zero; returns the
    control word it had, for :func:`restore_control`. (An Intel core takes a microcode
    assist for each subnormal result it makes unflushed; AMD's cores none.) x86 only."""
    def codegen(context, builder, signature, args):
        slot = cgutils.alloca_once(builder, ir.IntType(32))
        _control_word(builder, "llvm.x86.sse.stmxcsr", slot)
        saved = builder.load(slot)
        builder.store(builder.or_(saved, ir.Constant(ir.IntType(32), _FLUSH_TO_ZERO)), slot)
        _control_word(builder, "llvm.x86.sse.ldmxcsr", slot)
        return saved
    return types.int32(), codegen


@intrinsic
def restore_control(typingctx, saved):
    """Set this thread's MXCSR back to ``saved`` (:func:`flushing_subnormals`' result)."""
    if saved != types.int32:
        return None

    def codegen(context, builder, signature, args):
        slot = cgutils.alloca_once(builder, ir.IntType(32))
        builder.store(args[0], slot)
        _control_word(builder, "llvm.x86.sse.ldmxcsr", slot)
        return context.get_dummy_value()
    return types.void(saved), codegen


def _float_intrinsic(builder, stem, *operands):
    """``llvm.<stem>`` on float32 or float64 scalars or vectors of one type."""
    if isinstance(operands[0].type, ir.VectorType):
        return call_llvm_intrinsic(builder, stem, *operands)
    value_type = operands[0].type
    function = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(value_type, [value_type] * len(operands)),
        f"llvm.{stem}.{'f32' if isinstance(value_type, ir.FloatType) else 'f64'}")
    return builder.call(function, operands)


def _exp_code(builder, x, shift, brief, fused_scalars=False, multiplier=None, flushed=False):
    """The instructions of :func:`_exp_float32` (``brief``: a Python bool). ``fused_scalars``:
    a scalar's polynomial by FMAs too, as a vector's (the same bits in a vector's lane).
    ``multiplier`` (brief only): x's factor in place of log2(e) (:func:`_exp_float32_flushed`).
    ``flushed`` (brief on AVX-512 only): code for a thread whose MXCSR flushes subnormal
    results to zero (:func:`flushing_subnormals`), the same bits in one instruction where
    the others take three (:data:`_FLUSHED_LOWEST`)."""
    value_type = x.type
    lanes = value_type.count if isinstance(value_type, ir.VectorType) else None
    integer_type = ir.IntType(32) if lanes is None else ir.VectorType(ir.IntType(32), lanes)
    coefficients = _BRIEF_C if brief else _C

    def constant(kind, number):
        return ir.Constant(kind, number if lanes is None else [number] * lanes)

    def floating(number):
        return constant(value_type, float(np.float32(number)))

    def fused(a, b, c):  # a b + c: an FMA on vectors
        if lanes is None and not fused_scalars:
            return builder.fadd(builder.fmul(a, b), c)
        return _float_intrinsic(builder, "fma", a, b, c)

    def clamp(value, compare, bound):
        # compare-and-select, not minnum/maxnum, and unordered: a NaN stays NaN (exp of
        # a NaN score is NaN, so the row it is in becomes NaN, as the reference's)
        return builder.select(builder.fcmp_unordered(compare, value, bound), value, bound)

    if brief:  # x log2(e) - shift log2(e), one FMA (the product hoisted out of loops)
        exponent = fused(x, floating(LOG2E) if multiplier is None else multiplier,
                         builder.fneg(builder.fmul(shift, floating(LOG2E))))
    else:
        exponent = builder.fmul(builder.fsub(x, shift), floating(LOG2E))
    if brief and lanes == 16:  # AVX-512: vrndscaleps, then vscalefps makes p * 2**n
        if flushed:  # vmaxps(lowest, x): x where x is NaN (its second operand), so NaN stays NaN
            maximum = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
                value_type, [value_type, value_type, ir.IntType(32)]), "llvm.x86.avx512.max.ps.512")
            exponent = builder.call(maximum, [floating(_FLUSHED_LOWEST), exponent, ir.Constant(ir.IntType(32), 4)])
        else:  # (ordered: a NaN is not low, and stays NaN)
            low = builder.fcmp_ordered("<", exponent, floating(_SCALED_LOWEST))
            exponent = builder.select(low, floating(0.0), exponent)
        whole = call_llvm_intrinsic(builder, "roundeven", exponent)
        fraction = builder.fsub(exponent, whole)
        polynomial = floating(coefficients[-1])
        for coefficient in reversed(coefficients[:-1]):
            polynomial = fused(polynomial, fraction, floating(coefficient))
        scalef = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
            value_type, [value_type, value_type, value_type, ir.IntType(16), ir.IntType(32)]),
            "llvm.x86.avx512.mask.scalef.ps.512")
        scaled = builder.call(scalef, [polynomial, whole, ir.Constant(value_type, None),
                                       ir.Constant(ir.IntType(16), -1), ir.Constant(ir.IntType(32), 4)])
        return scaled if flushed else builder.select(low, floating(0.0), scaled)
    exponent = clamp(clamp(exponent, ">", floating(_LOWEST)), "<", floating(_HIGHEST))
    # round to nearest by adding 1.5 * 2**23: the sum's low mantissa bits then hold the
    # integer, so 2**n's exponent field is those bits shifted (no round or convert)
    rounded = builder.fadd(exponent, floating(_ROUNDING_SHIFT))
    whole = builder.fsub(rounded, floating(_ROUNDING_SHIFT))
    fraction = builder.fsub(exponent, whole)
    for instruction in (rounded, whole, fraction):
        # Numba gives every float instruction without flags its fastmath flags, and
        # "reassoc" would fold (x + c) - c into x: a flag of their own keeps them exact
        instruction.flags.append("nsz")
    polynomial = floating(coefficients[-1])
    for coefficient in reversed(coefficients[:-1]):
        polynomial = fused(polynomial, fraction, floating(coefficient))
    bits = builder.shl(builder.bitcast(rounded, integer_type), constant(integer_type, 23))
    bits = builder.add(bits, constant(integer_type, 127 << 23))
    return builder.fmul(polynomial, builder.bitcast(bits, value_type))


# tanh on float32 (softcap's): below |x| = 5/8, x + x z P(z) with z = x^2 and P of degree 4
# fitted here for the least largest relative error of tanh on [0, 5/8] (reweighted least
# squares on Chebyshev nodes: 4.4e-9 in exact arithmetic, under float32's rounding); from
# 5/8 up, 1 - 2 / (exp(2|x|) + 1) by the exp above (the result is at least 0.55 there, so
# the subtraction loses nothing), its sign then x's. libm's scalar tanhf, which a loop of
# math.tanh calls (no SVML), had made a softcapped (1, 8, 1024, 64) causal forward take
# 4.3x the time of one without softcap.
_TANH_SMALL = 0.625
_TANH_C = (-0.33333281951665805, 0.13331442405669203, -0.05373972962088878, 0.02063912846262014,
           -0.0057050279736542185)


@intrinsic
def _tanh_float32(typingctx, x):
    """``tanh(x)`` for a float32 scalar or vector (lane by lane, each lane the scalar's bits):
    NaN for NaN, +-1 for +-inf, within 2 ulps of the correctly rounded value."""
    if not (x == types.float32 or (isinstance(x, Vector) and x.dtype == types.float32)):
        return None

    def codegen(context, builder, signature, args):
        value = args[0]
        value_type = value.type
        lanes = value_type.count if isinstance(value_type, ir.VectorType) else None

        def floating(number):
            number = float(np.float32(number))
            return ir.Constant(value_type, number if lanes is None else [number] * lanes)

        def in_order(instruction):  # (no fastmath flags: "arcp" and "afn" may approximate the division)
            instruction.flags.append("nsz")
            return instruction

        magnitude = _float_intrinsic(builder, "fabs", value)
        square = in_order(builder.fmul(magnitude, magnitude))
        polynomial = floating(_TANH_C[-1])
        for coefficient in reversed(_TANH_C[:-1]):
            polynomial = _float_intrinsic(builder, "fma", polynomial, square, floating(coefficient))
        small = _float_intrinsic(builder, "fma", in_order(builder.fmul(magnitude, square)), polynomial, magnitude)
        grown = _exp_code(builder, in_order(builder.fadd(magnitude, magnitude)), floating(0.0), False, True)
        large = in_order(builder.fsub(floating(1.0), in_order(builder.fdiv(
            floating(2.0), in_order(builder.fadd(grown, floating(1.0)))))))
        chosen = builder.select(builder.fcmp_ordered("<", magnitude, floating(_TANH_SMALL)), small, large)
        return _float_intrinsic(builder, "copysign", chosen, value)
    return x(x), codegen


@njit(inline="always")
def soft_capped(s, tanh, start, n, softcap):
    """``tanh[c] = tanh(s[c] / softcap)``, then ``s[c] = softcap * tanh[c]`` for ``start <= c
    < start + n`` (a row of a score tile; the tanh kept for the backward's derivative):
    float32 by :func:`_tanh_float32` on vectors, float64 by libm's exact tanh. Jitted code
    only."""
    _soft_capped(s, tanh, plain_int(start), plain_int(n), scalar_like(softcap, s))


def _soft_capped(s, tanh, start, n, softcap):
    raise NotImplementedError


@overload(_soft_capped, jit_options=OPTIONS, inline="always")
def _soft_capped_overload(s, tanh, start, n, softcap):
    if s.dtype == types.float32:
        lanes = VECTOR_BYTES // 4

        def vectors(s, tanh, start, n, softcap):
            inverse = scalar_like(1.0, s) / softcap
            full = start + n - n % lanes
            inverses, caps = fill(inverse, s), fill(softcap, s)
            for c in range(start, full, lanes):
                t = _tanh_float32(multiply(load(s, c), inverses))
                store(tanh, c, t)
                store(s, c, multiply(t, caps))
            tail = start + n - full
            if tail:  # the last, partial vector by a masked load and stores
                t = _tanh_float32(multiply(load_first(s, full, tail, 0.0), inverses))
                store_first(tanh, full, t, tail)
                store_first(s, full, multiply(t, caps), tail)
        return vectors

    def exact(s, tanh, start, n, softcap):
        inverse = 1.0 / softcap
        for c in range(start, start + n):
            t = math.tanh(s[c] * inverse)
            tanh[c] = t
            s[c] = softcap * t
    return exact


@njit(inline="always")
def exp_tile_to_pairs(x, ld, rows, n, shifts, pairs, pair_ld, scale, sums):
    """A bfloat16 forward's probabilities, rounded to bfloat16 pairs as exp makes them:
    for each row r < ``rows`` of ``n`` scores from ``x[r * ld]``, :func:`exp_shifted`
    with ``brief`` of ``scale * x`` against ``shifts[r]``, the values going to ``pairs``
    from ``r * pair_ld`` as bfloat16 pairs along the row, ``pairs[r * pair_ld + p]`` =
    pair (value ``2p``, value ``2p + 1``), 0 past ``n`` (:func:`~npattn.cpu.tiles.pair_rows`'
    bits), not to ``x`` (which keeps its scores but for each row's last values, fewer than
    a vector), and each row's sum to ``sums[r]`` (``shifts[r]`` is read first: they may
    be one array). ``scale`` > 0 is applied in exp's own multiply (scores whose products
    left it out, SOFTMAX_SCALE; 1 for scaled scores, with exp_shifted's bits).
    float32 only, where the CPU has AVX512_BF16 (elsewhere nothing calls it). Jitted
    code only.

    One call for the tile: the thread's MXCSR flushes subnormals for the whole of it
    (:func:`flushing_subnormals`, then exp's low clamp is one instruction), and two
    vectors go to pairs with one conversion (:func:`~npattn.cpu.simd.store_bfloat16_two`).
    On the AMX VM, one core, a 192 x 384 tile: 0.145-0.150 ns an element, where a call
    per row with exp_shifted's clamp and a conversion per vector took 0.188-0.273."""
    _exp_tile_to_pairs(x, plain_int(ld), plain_int(rows), plain_int(n), shifts, pairs, plain_int(pair_ld),
                       scalar_like(scale, x), sums)


def _exp_tile_to_pairs(x, ld, rows, n, shifts, pairs, pair_ld, scale, sums):
    raise NotImplementedError


@overload(_exp_tile_to_pairs, jit_options=OPTIONS)
def _exp_tile_to_pairs_overload(x, ld, rows, n, shifts, pairs, pair_ld, scale, sums):
    if not (BF16_DOT and x.dtype == types.float32):  # (nothing to compile elsewhere; BF16_DOT: AVX-512)
        return lambda x, ld, rows, n, shifts, pairs, pair_ld, scale, sums: None
    lanes = VECTOR_BYTES // 4
    log2e = np.float32(LOG2E)

    def polynomial(x, ld, rows, n, shifts, pairs, pair_ld, scale, sums):
        two, full = n - n % (2 * lanes), n - n % lanes
        multipliers = fill(scale * log2e, x)
        saved = flushing_subnormals()
        for r in range(rows):
            start, pair_start = r * ld, r * pair_ld
            row_shifts = fill(shifts[r], x)
            row_sums = fill(0.0, x)
            for c in range(0, two, 2 * lanes):
                first = _exp_float32_flushed(load(x, start + c), multipliers, row_shifts)
                second = _exp_float32_flushed(load(x, start + c + lanes), multipliers, row_shifts)
                store_bfloat16_two(pairs, pair_start + c // 2, first, second)
                row_sums = add(add(row_sums, first), second)  # (exp_shifted's order)
            if full > two:
                value = _exp_float32_flushed(load(x, start + two), multipliers, row_shifts)
                store_bfloat16(pairs, pair_start + two // 2, value)
                row_sums = add(row_sums, value)
            if n > full:  # (exp_shifted's last, partial vector, kept in x for its pairs)
                value = _exp_float32_flushed(load_first(x, start + full, n - full, -np.inf), multipliers,
                                             row_shifts)
                store_first(x, start + full, value, n - full)
                row_sums = add(row_sums, value)
            sums[r] = horizontal_sum(row_sums)
            for c in range(full, n, 2):
                high = x[start + c + 1] if c + 1 < n else 0.0
                pairs[pair_start + c // 2] = pair_bits(x[start + c], high)
        restore_control(saved)
    return polynomial


@njit(**HELPER_OPTIONS)
def row_max(x, start, n):
    """max(x[start : start + n]), -inf for n == 0 or all -inf (NaNs are skipped)."""
    lanes = lanes_in(x)
    full = start + n - n % lanes
    best_lanes = fill(-np.inf, x)
    for c in range(start, full, lanes):
        best_lanes = maximum(load(x, c), best_lanes)
    if full < start + n:  # the last, partial vector: its other lanes -inf
        best_lanes = maximum(load_first(x, full, start + n - full, -np.inf), best_lanes)
    return horizontal_max(best_lanes)


# A short row: 64 bytes of scores (16 float32 keys, 8 float64), one AVX-512 vector or two
# AVX2 ones; the rows of a small call's tiles are this long
SHORT_ROW_BYTES = 64
_SHORT_ROW_VECTORS = SHORT_ROW_BYTES // VECTOR_BYTES


@njit(inline="always")
def short_row_max(x, start):
    """:func:`row_max` of exactly one short row, ``x[start : start + SHORT_ROW_BYTES //
    itemsize]``, with its bits (the same lane maxima in the same order), inlined into the
    caller (no call: the rows of a short tile then overlap)."""
    start = plain_int(start)
    best = maximum(load(x, start), fill(-np.inf, x))
    if _SHORT_ROW_VECTORS == 2:
        best = maximum(load(x, start + lanes_in(x)), best)
    return horizontal_max(best)


@njit(inline="always")
def exp_short_row_shifted(x, start, shift):
    """:func:`exp_shifted` of exactly one short row (:func:`short_row_max`'s), with its
    bits, inlined into the caller.

    A tile of a small call has short rows (16 keys of float32). Through
    :func:`exp_shifted` each row was a call, then a chain of the polynomial's FMAs and a
    horizontal sum that the next row's call could not overlap; inlined, the rows' chains
    run side by side."""
    return _exp_short_row(x, plain_int(start), scalar_like(shift, x))


def _exp_short_row(x, start, shift):
    raise NotImplementedError


@overload(_exp_short_row, jit_options=OPTIONS, inline="always")
def _exp_short_row_overload(x, start, shift):
    if x.dtype == types.float32:
        lanes = VECTOR_BYTES // 4

        def polynomial(x, start, shift):
            shifts = fill(shift, x)
            value = _exp_float32(load(x, start), shifts, False)
            store(x, start, value)
            sums = add(fill(0.0, x), value)  # exp_shifted's sums, vector by vector: its bits
            if _SHORT_ROW_VECTORS == 2:
                value = _exp_float32(load(x, start + lanes), shifts, False)
                store(x, start + lanes, value)
                sums = add(sums, value)
            return horizontal_sum(sums)
        return polynomial
    elements = SHORT_ROW_BYTES // (x.dtype.bitwidth // 8)

    def exact(x, start, shift):
        return _exp_shifted(x, start, elements, shift, False)
    return exact


@njit(inline="always")
def exp_shifted(x, start, n, shift, brief):
    """``x[c] = exp(x[c] - shift)`` for ``start <= c < start + n``, in place (a row of a
    score tile, without the cost of a slice); returns the sum of the new values (in
    x's dtype). A caller that guessed ``shift`` below the row's max
    can check the guess after the fact from the sum alone: it is at least
    ``exp(max - shift)`` (+inf on float32 overflow). ``brief``: float32's values by the
    bfloat16 polynomial (module docstring). float32 runs on whole vectors, the last,
    partial one by a masked load and store, so a value's bits never depend on its place
    in the row (a 77-key row's max and exp took 73 ns with its last 13 values one by one,
    36 ns so, on the Zen 4 VM). Jitted code only."""
    return _exp_shifted(x, plain_int(start), plain_int(n), scalar_like(shift, x), bool(brief))


def _exp_shifted(x, start, n, shift, brief):
    raise NotImplementedError


@overload(_exp_shifted, jit_options=OPTIONS)
def _exp_shifted_overload(x, start, n, shift, brief):
    if x.dtype == types.float32:
        lanes = VECTOR_BYTES // 4

        def polynomial(x, start, n, shift, brief):
            full = start + n - n % lanes
            shifts = fill(shift, x)
            sums = fill(0.0, x)
            tail = start + n - full
            # (one loop per polynomial: the test stays out of the loop) the last, partial
            # vector by a masked load and store, its other lanes -inf: exactly 0 in the sums
            if brief:
                for c in range(start, full, lanes):
                    value = _exp_float32(load(x, c), shifts, True)
                    store(x, c, value)
                    sums = add(sums, value)
                if tail:
                    value = _exp_float32(load_first(x, full, tail, -np.inf), shifts, True)
                    store_first(x, full, value, tail)
                    sums = add(sums, value)
            else:
                for c in range(start, full, lanes):
                    value = _exp_float32(load(x, c), shifts, False)
                    store(x, c, value)
                    sums = add(sums, value)
                if tail:
                    value = _exp_float32(load_first(x, full, tail, -np.inf), shifts, False)
                    store_first(x, full, value, tail)
                    sums = add(sums, value)
            return horizontal_sum(sums)
        return polynomial

    def exact(x, start, n, shift, brief):
        total = x.dtype.type(0.0)
        for c in range(start, start + n):
            value = math.exp(x[c] - shift)
            x[c] = value
            total = add(total, value)
        return total
    return exact
