"""bfloat16 pair products on AMX tiles (npattn.cpu.amx) against float64 products of the same
bfloat16 values, and the switch that keeps them out of processes Linux refuses the tiles.

The products run only on a CPU with AMX (Intel Sapphire Rapids on); elsewhere
``pair_product`` never reaches them (their tests are skipped there, the switch's run
everywhere). The whole forward on tiles is tested by tests/test_cpu_bf16.py, whose
bfloat16 forwards take them by default where the CPU has them.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, strategies as st
from numba import njit

from npattn.cpu import amx, isa
from npattn.cpu.microkernels import pair_product
from npattn.cpu.tiles import lower_pair_exponents

needs_tiles = pytest.mark.skipif(not amx.TILES, reason="this CPU (or this process) has no AMX tiles")


@njit  # not cached: a cache stamped with this file alone would outlive edits to amx.py
def _pair_product(a, a_offset, a_row, a_col, b, b_offset, b_row, c, c_offset, c_row, rows, pairs, width, alpha,
                  accumulate):
    pair_product(a, a_offset, a_row, a_col, b, b_offset, b_row, c, c_offset, c_row, rows, pairs, width, alpha,
                 accumulate)


def _bfloat16_bits(x):
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _widened(bits):
    with np.errstate(invalid="ignore"):  # (signaling NaNs among random bits)
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


@needs_tiles
# (whole steps of 16 pairs drawn as often as any depth: the head dims' products, whose
# schedules differ from a depth with a last part step's)
@given(rows=st.integers(1, 70), pairs=st.one_of(st.sampled_from([16, 32, 48, 64]), st.integers(1, 70)),
       tiles=st.integers(1, 5),
       a_pad=st.integers(0, 4), b_pad=st.integers(0, 2), c_pad=st.integers(0, 9), offset=st.integers(0, 5),
       alpha=st.sampled_from([1.0, 0.125, -3.0]), accumulate=st.booleans(), seed=st.integers(0, 2 ** 32 - 1))
def test_tile_products_are_float64_products_of_the_bfloat16_values_to_float32_rounding(
        rows, pairs, tiles, a_pad, b_pad, c_pad, offset, alpha, accumulate, seed):
    accumulate = accumulate and alpha == 1.0  # (pair_product's other products take scaled sums)
    width = 16 * tiles
    a_row, b_row, c_row = pairs + a_pad, width + 16 * b_pad, width + c_pad
    rng = np.random.default_rng(seed)
    a_bits = _bfloat16_bits(rng.standard_normal((rows, 2 * a_row)))
    b_bits = _bfloat16_bits(rng.standard_normal((pairs, b_row, 2)))
    a = np.concatenate([np.zeros(offset, np.float32), a_bits.reshape(-1).view(np.float32)])
    b = np.concatenate([np.zeros(offset, np.float32), b_bits.reshape(-1).view(np.float32)])
    before = rng.standard_normal(offset + rows * c_row + 7).astype(np.float32)
    c = before.copy()
    a_before, b_before = a.copy(), b.copy()

    _pair_product(a, offset, a_row, 1, b, offset, b_row, c, offset, c_row, rows, pairs, width, alpha, accumulate)

    a_values = _widened(a_bits).reshape(rows, a_row, 2)[:, :pairs].reshape(rows, 2 * pairs)
    # (the pairs as the products pair them: depth 2p low half, 2p + 1 high half)
    b_values = _widened(b_bits)[:, :width, :].transpose(0, 2, 1).reshape(2 * pairs, width)
    want = alpha * (a_values @ b_values)
    region = c[offset:offset + rows * c_row].reshape(rows, c_row)
    start = before[offset:offset + rows * c_row].reshape(rows, c_row)
    if accumulate:
        want = want + start[:, :width]
    # products of bfloat16 values are exact in float32; each of the 2 * pairs sums rounds
    # once (and the scale, and the start's sum, once more)
    bound = (2 * pairs + 2) * np.finfo(np.float32).eps * (
        abs(alpha) * (np.abs(a_values) @ np.abs(b_values)) + (np.abs(start[:, :width]) if accumulate else 0.0))
    assert np.all(np.abs(region[:, :width] - want) <= bound + np.finfo(np.float32).tiny)
    np.testing.assert_array_equal(region[:, width:], start[:, width:], err_msg="past width C is untouched")
    np.testing.assert_array_equal(c[:offset], before[:offset], err_msg="before C is untouched")
    np.testing.assert_array_equal(c[offset + rows * c_row:], before[offset + rows * c_row:],
                                  err_msg="after C is untouched")
    np.testing.assert_array_equal(a, a_before)
    np.testing.assert_array_equal(b, b_before)


@needs_tiles
def test_tile_products_treat_subnormal_inputs_as_zero_as_the_vector_path_does():
    a = np.zeros(16, np.float32)
    a_bits = np.zeros(32, np.uint16)
    a_bits[0] = 0x0001  # the least bfloat16 subnormal
    a[:] = a_bits.view(np.float32)
    b = np.full(16 * 16, np.float32(np.uint32(0x3F803F80).view(np.float32)))  # pairs of 1.0
    c = np.full(16, np.float32(7.0))
    _pair_product(a, 0, 16, 1, b, 0, 16, c, 0, 16, 1, 16, 16, 1.0, False)
    assert np.all(c == 0.0)


def test_a_process_linux_refuses_the_tiles_compiles_without_them(monkeypatch):
    from numba.core import config

    applied = []
    monkeypatch.setattr(isa, "_request_tile_data", lambda: False)
    monkeypatch.setattr(isa, "_set_numba_features", applied.append)
    monkeypatch.setattr(config, "CPU_FEATURES", "+avx512f,+amx-tile,+amx-bf16,+avx512bf16")
    isa.apply_tile_permission()
    assert applied == ["-amx-bf16,-amx-tile,+avx512bf16,+avx512f"]


def test_a_process_granted_the_tiles_or_without_them_keeps_its_target(monkeypatch):
    from numba.core import config

    applied = []
    monkeypatch.setattr(isa, "_set_numba_features", applied.append)
    monkeypatch.setattr(isa, "_request_tile_data", lambda: True)
    monkeypatch.setattr(config, "CPU_FEATURES", "+avx512f,+amx-tile,+amx-bf16")
    isa.apply_tile_permission()
    monkeypatch.setattr(isa, "_request_tile_data", lambda: pytest.fail("asked for tiles the target lacks"))
    monkeypatch.setattr(config, "CPU_FEATURES", "+avx512f,-amx-tile")
    isa.apply_tile_permission()
    assert applied == []


@njit  # not cached (as above)
def _lower_pair_exponents(packed, ld, rows, width, shift):
    lower_pair_exponents(packed, ld, rows, width, shift)


@given(shift=st.integers(1, 30), seed=st.integers(0, 2 ** 32 - 1))
def test_lowered_pair_exponents_are_the_values_times_the_power_of_two(shift, seed):
    rng = np.random.default_rng(seed)
    rows, width, ld = 3, 20, 24
    halves = rng.integers(0, 2 ** 16, size=(rows, ld, 2), dtype=np.uint64).astype(np.uint16)
    special = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0x0080, 0x8080, 0x0001, 0x3F80, 0x0F00,
                        0x1000 + (shift << 7), 0x0080 + (shift << 7)], np.uint16)
    halves.reshape(-1)[:special.size] = special
    packed = halves.reshape(-1).view(np.float32).copy()
    _lower_pair_exponents(packed, ld, rows, width, shift)
    got = _widened(packed.view(np.uint16)).reshape(rows, ld, 2)
    values = _widened(halves.reshape(-1)).reshape(rows, ld, 2)
    with np.errstate(invalid="ignore"):
        want = values * 2.0 ** -shift
    # below bfloat16's least normal the tile products read 0: the lowered value is 0 there
    want = np.where(np.abs(want) < 2.0 ** -126, np.copysign(0.0, values), want)
    inside = (slice(None), slice(0, width))
    assert np.array_equal(got[inside], want[inside], equal_nan=True)
    assert np.array_equal(np.signbit(got[inside]), np.signbit(want[inside]))
    assert np.array_equal(packed.view(np.uint16).reshape(rows, ld, 2)[:, width:], halves[:, width:]), \
        "past width the words are untouched"


@needs_tiles
@pytest.mark.parametrize("causal", [False, True])
def test_keys_that_carry_the_scale_give_the_scaled_products_bits(monkeypatch, causal):
    import ml_dtypes

    import npattn
    import npattn.cpu.operands as operands
    import npattn.runtime.plans as plans

    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, 200, 64)).astype(ml_dtypes.bfloat16) for _ in range(3))
    assert operands.key_scale_shift(type("P", (), {"scale": 0.125})(), np.float32) == 3
    assert operands.key_scale_shift(type("P", (), {"scale": 128 ** -0.5})(), np.float32) == 0
    plans.clear()
    carried = npattn.attention(q, k, v, causal=causal)
    monkeypatch.setattr(operands, "key_scale_shift", lambda problem, dtype: 0)
    plans.clear()
    scaled = npattn.attention(q, k, v, causal=causal)
    plans.clear()
    np.testing.assert_array_equal(carried.view(np.uint16), scaled.view(np.uint16))


@needs_tiles
@pytest.mark.parametrize("causal", [False, True])
def test_a_scale_left_to_the_softmax_gives_the_scaled_products_result(monkeypatch, causal):
    # 1/sqrt(128) is no power of two: the softmax applies it (exp's own multiply), against
    # the products scaling each score; exp's argument rounds differently, by about a float32
    # ulp of the scaled score, so the probabilities agree to well within bfloat16's rounding
    import ml_dtypes

    import npattn
    import npattn.cpu.operands as operands
    import npattn.runtime.plans as plans

    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 2, 150, 128)).astype(ml_dtypes.bfloat16) for _ in range(3))
    sink = rng.standard_normal(2).astype(np.float32)
    plans.clear()
    left = npattn.attention(q, k, v, causal=causal, sink_logits=sink, return_lse=True)
    monkeypatch.setattr(operands, "softmax_takes_scale", lambda problem, ints: False)
    plans.clear()
    scaled = npattn.attention(q, k, v, causal=causal, sink_logits=sink, return_lse=True)
    plans.clear()
    out_left, out_scaled = (x[0].astype(np.float64) for x in (left, scaled))
    # the bound: exp's arguments (at most ``largest`` in size) differ by a few float32 ulps of
    # their size, so each probability relatively by that much, and its rounding to bfloat16
    # for P V may then go the other way (one bfloat16 step of it); out's rows of sum p |v|
    # move by those shares, and each rounded result by at most one bfloat16 step
    eps16, eps32 = float(ml_dtypes.finfo(ml_dtypes.bfloat16).eps), float(np.finfo(np.float32).eps)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    scores = q64 @ k64.swapaxes(-1, -2) / np.sqrt(128)
    if causal:
        scores = np.where(np.tril(np.ones((150, 150), bool)), scores, -np.inf)
    with_sink = np.concatenate([scores, np.broadcast_to(sink[None, :, None, None], (1, 2, 150, 1))], axis=-1)
    largest = 2 * (np.abs(np.where(np.isfinite(scores), scores, 0)).max() + np.abs(sink).max())
    weights = np.exp(with_sink - with_sink.max(-1, keepdims=True))
    weights = (weights / weights.sum(-1, keepdims=True))[..., :150]
    drift = 8 * eps32 * largest
    bound = eps16 * np.maximum(np.abs(out_left), np.abs(out_scaled)) + (eps16 + drift) * (weights @ np.abs(v64))
    assert np.all(np.abs(out_left - out_scaled) <= bound)
    assert np.all(np.abs(left[1].astype(np.float64) - scaled[1]) <= drift + 4 * eps32 * np.abs(scaled[1]))
