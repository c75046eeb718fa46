"""The CPU kernels at each vector ISA: AVX-512 where the host has it (every other test), and
AVX2 forced with ``NPATTN_CPU_ISA=avx2`` in a child process, so an AVX-512 machine also
checks the 256-bit micro-kernels (6 x 2 register blocks, 8 x 8 transposes) that an
AVX2-only CPU runs.

The micro-kernels are also checked on their own against NumPy, at every ISA.
"""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytest.importorskip("numba")
pytest.importorskip("scipy")

from numba import njit  # noqa: E402

from npattn.core.kernel_params import KvCodes  # noqa: E402
from npattn.cpu import code_products, isa, microkernels, simd  # noqa: E402
from tolerances import assert_close  # noqa: E402
from conftest import started  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_child(arguments, tmp_path, isa_value="avx2"):
    """``python arguments...`` from the repository root with ``NPATTN_CPU_ISA=isa_value``."""
    environment = {**os.environ, isa.FORCE_VARIABLE: isa_value, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, *arguments], cwd=ROOT, env=environment, capture_output=True,
                          text=True, timeout=900)


@njit  # not cached: a cache stamped with this file alone would outlive edits to microkernels
def _product(a, b, c, rows, depth, width):
    microkernels.product(a, 0, depth, 1, b, 0, width, c, 0, width, rows, depth, width, 1.0, False)


@njit  # not cached, as above
def _dot_products(a, b, c, rows, cols, depth, b_row, alpha):
    microkernels.dot_products(a, 0, depth, b, 0, b_row, c, 0, cols, rows, cols, depth, alpha)


@njit  # not cached, as above
def _pack(x, rows, cols, packed, ld):
    microkernels.pack_transposed(x, 0, cols, rows, cols, packed, ld, ld)


# (rows, depth, width in vectors): 6-row blocks and their remainder, one-vector remainders
# of the chunk (2 vectors on AVX2, 4 on AVX-512) and a depth past the L1 slice.
@pytest.mark.parametrize("rows, depth, vectors", [(1, 1, 1), (6, 5, 2), (7, 33, 3), (13, 600, 5), (19, 64, 9)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_micro_kernel_products_match_numpy(rows, depth, vectors, dtype):
    rng = np.random.default_rng(rows * depth)
    width = vectors * simd.lanes_of(np.dtype(dtype))
    a = rng.standard_normal((rows, depth)).astype(dtype)
    b = rng.standard_normal((depth, width)).astype(dtype)
    c = np.full((rows, width), np.nan, dtype)
    _product(a.ravel(), b.ravel(), c.ravel(), rows, depth, width)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    assert_close(c, exact, dtype, depth, float(np.abs(a).max() * np.abs(b).max()), what="product")


@njit  # not cached, as above
def _strided_product(a, b, c, rows, depth, width, b_row, c_row, accumulate):
    microkernels.product(a, 0, depth, 1, b, 0, b_row, c, 0, c_row, rows, depth, width, 1.0, accumulate)


# (rows, depth, width in vectors): the whole vectors short of a chunk that take blocks of
# one or two vectors (1, 2 and 3 on AVX-512; 1 on AVX2), alone and after a whole chunk,
# with 6-row blocks and the rows left, depths past the L1 slice
@pytest.mark.parametrize("rows, depth, vectors", [(16, 64, 1), (9, 33, 2), (7, 600, 3), (13, 64, 5), (6, 5, 6)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_micro_kernel_columns_have_the_same_bits_in_any_block_width(rows, depth, vectors, dtype):
    """Each column of C is one chain over the depth whichever block computes it: a product
    narrower than a chunk (its columns in blocks of one or two vectors) gives the bits of
    the same columns inside a wider product (a whole chunk's block)."""
    rng = np.random.default_rng(rows + depth + vectors)
    lanes = simd.lanes_of(np.dtype(dtype))
    chunk = microkernels.chunk_columns(dtype)
    width = vectors * lanes
    wide = -(-width // chunk) * chunk + chunk  # whole chunks past the width
    a = rng.standard_normal((rows, depth)).astype(dtype)
    b = rng.standard_normal((depth, wide)).astype(dtype)
    start = rng.standard_normal((rows, wide)).astype(dtype)
    for accumulate in (False, True):
        narrow, whole = start.copy(), start.copy()
        _strided_product(a.ravel(), b.ravel(), narrow.ravel(), rows, depth, width, wide, wide, accumulate)
        _strided_product(a.ravel(), b.ravel(), whole.ravel(), rows, depth, wide, wide, wide, accumulate)
        np.testing.assert_array_equal(narrow[:, :width], whole[:, :width])
        np.testing.assert_array_equal(narrow[:, width:], start[:, width:])


# (rows, depth, width in vectors): widths a few lanes short of whole vectors (a decode
# tile's values of a head dim such as 40 with AVX-512), alone, after whole vectors of a
# chunk's tail, after whole chunks, and after a single row's wide chunks; depths past the
# L1 slice; both with rows two at a time and one left
@pytest.mark.parametrize("rows, depth, vectors", [(1, 1, 1), (1, 5, 3), (2, 33, 3), (3, 600, 5), (1, 70, 10),
                                                  (5, 40, 9)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_micro_kernel_products_of_a_partial_last_vector_read_and_write_only_their_columns(rows, depth, vectors,
                                                                                          dtype):
    """B's rows hold NaN past the width and C's rows hold a sentinel past it: a read of B's
    lanes would show as NaN, a write of C's as a changed sentinel. Each column has the bits
    of the same product over whole vectors (B zero-padded): the same chain per column."""
    rng = np.random.default_rng(rows * depth + vectors)
    lanes = simd.lanes_of(np.dtype(dtype))
    width = vectors * lanes - 3
    a = rng.standard_normal((rows, depth)).astype(dtype)
    b = np.full((depth, width + 3), np.nan, dtype)
    b[:, :width] = rng.standard_normal((depth, width))
    start = rng.standard_normal((rows, width + 2)).astype(dtype)
    start[:, width:] = 7.0
    for accumulate in (False, True):
        c = start.copy()
        _strided_product(a.ravel(), b.ravel(), c.ravel(), rows, depth, width, width + 3, width + 2, accumulate)
        np.testing.assert_array_equal(c[:, width:], 7.0)
        exact = a.astype(np.float64) @ b[:, :width].astype(np.float64) + (start[:, :width] if accumulate else 0)
        # the size of each term: a product of A and B, or C's start
        magnitude = max(float(np.abs(a).max() * np.abs(b[:, :width]).max()), float(np.abs(start[:, :width]).max()))
        assert_close(c[:, :width], exact, dtype, depth + 1, magnitude, what="product")
        whole = np.zeros((rows, width + 3), dtype)
        whole[:, :width] = start[:, :width]
        padded = np.nan_to_num(b, nan=0.0)
        _strided_product(a.ravel(), padded.ravel(), whole.ravel(), rows, depth, width + 3, width + 3, width + 3,
                         accumulate)
        np.testing.assert_array_equal(c[:, :width], whole[:, :width])


# (rows, keys, depth in vectors): 8-key blocks and the keys left after them, one-vector
# depths, and key rows farther apart than the depth (a bhsd head's rows inside a wider row);
# depths a few lanes past whole vectors too (a head dim of 40 with AVX-512), whose last
# vector is read masked: the key rows' 3 values past the depth, and A's next row, are not
# the depth's, and a read of them would show in the scores
@pytest.mark.parametrize("partial", [0, 3], ids=["whole", "partial"])
@pytest.mark.parametrize("rows, cols, vectors", [(1, 1, 1), (1, 8, 1), (3, 7, 2), (8, 17, 16), (5, 40, 3)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dot_products_match_numpy_and_each_score_is_one_fixed_sum(rows, cols, vectors, dtype, partial):
    rng = np.random.default_rng(rows * cols)
    depth = vectors * simd.lanes_of(np.dtype(dtype)) - partial
    b_row = depth + 3
    a = rng.standard_normal((rows, depth)).astype(dtype)
    b = rng.standard_normal((cols, b_row)).astype(dtype)
    c = np.full((rows, cols), np.nan, dtype)
    _dot_products(a.ravel(), b.ravel(), c.ravel(), rows, cols, depth, b_row, 0.5)
    exact = 0.5 * a.astype(np.float64) @ b[:, :depth].T.astype(np.float64)
    assert_close(c, exact, dtype, depth, 0.5 * float(np.abs(a).max() * np.abs(b).max()), what="dot_products")
    # a key's score does not depend on where its block starts: the same bits one key at a time
    alone = np.full((rows, 1), np.nan, dtype)
    for j in range(cols):
        _dot_products(a.ravel(), b[j:].ravel(), alone.ravel(), rows, 1, depth, b_row, 0.5)
        np.testing.assert_array_equal(alone[:, 0], c[:, j])


@njit  # not cached, as above
def _accumulated_product(p, b, c, rows, cols, width, b_row):
    """C (rows x width) += P (rows x cols) . B's rows (cols x width, b_row apart)."""
    microkernels.product(p, 0, cols, 1, b, 0, b_row, c, 0, width, rows, cols, width, 1.0, True)


# The two wrappers read key j's scale at scales[1 + j * scale_step]: from index 1, so that
# a scale read one key early would read index 0 (and a test that gives the keys' scales at
# odd indices catches a read of the wrong one)
@njit  # not cached, as above
def _code_dot_products(a, codes, scales, c, rows, cols, depth, b_row, scale_step, alpha, decode, ahead=0):
    code_products.code_dot_products(a, 0, depth, codes, 0, b_row, scales, 1, scale_step, c, 0, cols, rows, cols,
                                    depth, alpha, decode, ahead)


@njit  # not cached, as above
def _code_product(p, codes, scales, c, rows, cols, width, b_row, scale_step, decode, ahead=0):
    code_products.code_product(p, 0, cols, codes, 0, b_row, scales, 1, scale_step, c, 0, width, rows, cols, width,
                               decode, ahead)


# The caches' codes the products read in registers, by name: one-byte codes with a scale
# per key, and 16-bit floats without
DECODES = {name: int(code) for name, code in (("int8", KvCodes.INT8), ("float8_e4m3", KvCodes.FLOAT8),
                                              ("float16", KvCodes.FLOAT16), ("bfloat16", KvCodes.BFLOAT16))}


def _coded_rows(rng, name, cols, row_values):
    """``(codes, values)``: ``cols`` rows of ``row_values`` random codes of ``name`` as the
    kernels read them (their bytes, int8, shape (cols, bytes per row)) and their values in
    float64. One-byte codes: every byte but e4m3's NaNs (subnormals, both zeros, the
    largest); 16-bit floats: normal values of a few units."""
    import ml_dtypes

    if name in ("int8", "float8_e4m3"):
        codes = rng.integers(-127, 128, size=(cols, row_values)).astype(np.int8)
        if name == "int8":
            return codes, codes.astype(np.float64)
        codes[(codes.view(np.uint8) & 0x7F) == 0x7F] -= 1  # (0x7F and 0xFF are NaN: the largest of its sign instead)
        return codes, codes.view(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    values = (3 * rng.standard_normal((cols, row_values))).astype(np.float16 if name == "float16"
                                                                   else ml_dtypes.bfloat16)
    return values.view(np.int8).reshape(cols, 2 * row_values), values.astype(np.float64)


# (query rows, keys, vectors of the head dim): blocks of 4 rows and the rows left after
# them, blocks of code_products.KEY_BLOCK keys (4, or 2 with AVX2) and the keys left after
# them, columns VECTOR_BLOCK vectors at a time (4, or 2) and one at a time; probabilities
# scaled a vector of keys at a time (from 16 keys on AVX-512, 8 on AVX2) and the keys left
@pytest.mark.parametrize("decode", list(DECODES))
@pytest.mark.parametrize("rows, cols, vectors", [(1, 1, 1), (1, 4, 4), (2, 7, 5), (3, 9, 2), (4, 12, 9), (5, 3, 8),
                                                 (8, 5, 4), (2, 0, 1), (4, 37, 4), (3, 33, 2)])
def test_products_on_codes_match_numpy(rows, cols, vectors, decode):
    """Both products read a cache's codes as they lie, rows farther apart than the head dim:
    one-byte codes with scales every other element from element 1, or 16-bit floats,
    whose scales are never read (NaN here). They match the float64 products on the codes'
    values times their scales: the scores, and P V added to what C held (float32 sums:
    the only ones they are compiled for). Odd row counts ask for the rows a few keys on
    as they go (the requests a decode step makes, past the arrays' ends here: a request
    never faults, and changes nothing)."""
    dtype = np.float32
    rng = np.random.default_rng(rows * 100 + cols * 10 + vectors)
    depth = vectors * simd.lanes_of(np.dtype(dtype))
    codes, values = _coded_rows(rng, decode, cols, depth + 5)
    b_row = codes.shape[1]
    scaled = decode in ("int8", "float8_e4m3")
    scales = (rng.uniform(0.001, 0.05, size=2 * cols + 1) if scaled else np.full(2 * cols + 1, np.nan)).astype(dtype)
    dequantized = values[:, :depth] * (scales[1::2, None] if scaled else 1.0)
    a = rng.standard_normal((rows, depth)).astype(dtype)
    c = np.full((rows, cols), np.nan, dtype)
    ahead = 3 * (rows % 2)
    _code_dot_products(a.ravel(), codes.ravel(), scales, c.ravel(), rows, cols, depth, b_row, 2, 0.5, DECODES[decode],
                       ahead)
    exact = 0.5 * a.astype(np.float64) @ dequantized.T
    assert_close(c, exact, dtype, depth, 0.5 * float(np.abs(a).max() * np.abs(dequantized).max(initial=0)),
                 what="code_dot_products")
    p = rng.uniform(0, 1, size=(rows, cols)).astype(dtype)
    before = p.copy()
    out = rng.standard_normal((rows, depth)).astype(dtype)
    exact = out.astype(np.float64) + p.astype(np.float64) @ dequantized
    # the size of each term: C's start, or a probability (at most 1) times a value
    magnitude = max(float(np.abs(out).max()), float(np.abs(dequantized).max(initial=0)))
    _code_product(p.ravel(), codes.ravel(), scales, out.ravel(), rows, cols, depth, b_row, 2, DECODES[decode], ahead)
    assert_close(out, exact, dtype, cols + 1, magnitude, what="code_product")
    if scaled:  # the probabilities left scaled, as documented (float32, as the kernel)
        unit = np.float32(code_products.E4M3_UNIT if decode == "float8_e4m3" else 1.0)
        np.testing.assert_array_equal(p, before * (scales[1::2] * unit))
    else:
        np.testing.assert_array_equal(p, before)


@pytest.mark.parametrize("partial", [0, 6], ids=["whole", "partial"])
@pytest.mark.parametrize("decode", ["float16", "bfloat16"])
@pytest.mark.parametrize("rows, cols, vectors", [(1, 300, 4), (1, 200, 9), (1, 130, 8), (4, 300, 8), (3, 129, 5),
                                                 (5, 40, 3), (4, 40, 2), (8, 33, 6)])
def test_products_on_16_bit_values_give_the_bits_of_their_float32_rows(rows, cols, vectors, decode, partial):
    """16-bit values read in registers give exactly what the micro-kernels give on their
    float32 rows (what a float32 cache of the same values gives): each score the same one
    chain, and P V summed in the pieces microkernels.product sums in (a single row's wide
    chunks over every key, other columns over slices of DEPTH_BLOCK keys: more keys than
    one slice here, head dims past and short of a wide chunk). A head dim a few values
    short of whole vectors reads its last vector masked, scores and P V (C's rows are
    adjacent here: a write past a row's end would be the next row's start)."""
    dtype = np.float32
    rng = np.random.default_rng(rows * 1000 + cols + vectors)
    depth = vectors * simd.lanes_of(np.dtype(dtype)) - partial
    codes, values = _coded_rows(rng, decode, cols, depth + 3)
    rows32 = values.astype(dtype)
    scales = np.full(1, np.nan, dtype)
    a = rng.standard_normal((rows, depth)).astype(dtype)
    c, c32 = (np.full((rows, cols), np.nan, dtype) for _ in range(2))
    ahead = 64 * (rows % 2)  # (odd row counts ask for the rows a tile on as they go: the same bits)
    _code_dot_products(a.ravel(), codes.ravel(), scales, c.ravel(), rows, cols, depth, codes.shape[1], 0, 0.5,
                       DECODES[decode], ahead)
    _dot_products(a.ravel(), rows32.ravel(), c32.ravel(), rows, cols, depth, rows32.shape[1], 0.5)
    np.testing.assert_array_equal(c, c32)
    p = rng.uniform(0, 1, size=(rows, cols)).astype(dtype)
    start = rng.standard_normal((rows, depth)).astype(dtype)
    out, out32 = start.copy(), start.copy()
    _code_product(p.ravel(), codes.ravel(), scales, out.ravel(), rows, cols, depth, codes.shape[1], 0,
                  DECODES[decode], ahead)
    _accumulated_product(p.ravel(), rows32.ravel(), out32.ravel(), rows, cols, depth, rows32.shape[1])
    np.testing.assert_array_equal(out, out32)


@pytest.mark.parametrize("nan_code", [0x7F, -1])  # 0x7F and 0xFF (-1 as int8)
def test_an_e4m3_nan_code_reads_as_nan(nan_code):
    """e4m3's NaN bytes are NaN in the products (as in the reference's dequantized cache):
    the score of that key, and the P V column of that value, and nothing else."""
    lanes = simd.lanes_of(np.dtype(np.float32))
    rng = np.random.default_rng(5)
    codes = rng.integers(-100, 100, size=(5, lanes)).astype(np.int8)
    codes[2, 3] = nan_code
    scales = np.full(1 + 5, 0.01, np.float32)  # (read from index 1, as the wrappers do)
    a = rng.standard_normal((4, lanes)).astype(np.float32)
    c = np.zeros((4, 5), np.float32)
    _code_dot_products(a.ravel(), codes.ravel(), scales, c.ravel(), 4, 5, lanes, lanes, 1, 1.0, DECODES["float8_e4m3"])
    assert np.isnan(c[:, 2]).all() and np.isfinite(np.delete(c, 2, axis=1)).all()
    out = np.zeros((4, lanes), np.float32)
    _code_product(np.full((4, 5), 0.2, np.float32).ravel(), codes.ravel(), scales, out.ravel(), 4, 5, lanes, lanes,
                  1, DECODES["float8_e4m3"])
    assert np.isnan(out[:, 3]).all() and np.isfinite(np.delete(out, 3, axis=1)).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_packed_transposes_are_exact_and_zero_padded(dtype):
    lanes = simd.lanes_of(np.dtype(dtype))
    x = np.random.default_rng(0).standard_normal((2 * lanes + 3, lanes + 5)).astype(dtype)
    packed = np.full((x.shape[1], x.shape[0] + 4), np.nan, dtype)
    _pack(x.ravel(), x.shape[0], x.shape[1], packed.ravel(), packed.shape[1])
    np.testing.assert_array_equal(packed[:, :x.shape[0]], x.T)
    np.testing.assert_array_equal(packed[:, x.shape[0]:], 0)


# What the forced-AVX2 child runs: the micro-kernel tests above, the short-row softmax steps
# and the kernels' property test at vector widths, and the check that the switch took
_CHILD_TESTS = ("tests/test_cpu_isa.py::test_micro_kernel_products_match_numpy",
                "tests/test_cpu_isa.py::test_micro_kernel_columns_have_the_same_bits_in_any_block_width",
                "tests/test_cpu_isa.py::test_packed_transposes_are_exact_and_zero_padded",
                "tests/test_cpu_isa.py::test_dot_products_match_numpy_and_each_score_is_one_fixed_sum",
                "tests/test_cpu_isa.py::test_products_on_codes_match_numpy",
                "tests/test_cpu_isa.py::test_products_on_16_bit_values_give_the_bits_of_their_float32_rows",
                "tests/test_cpu_rowmath.py::test_the_short_row_operations_give_the_general_ones_bits",
                "tests/test_cpu_rowmath.py::test_softcap_rows_keep_their_tanh_and_scale_it",
                "tests/test_cpu_kernels.py::test_vector_products_match_the_reference_at_vector_widths")
_SWITCH_TEST = "tests/test_cpu_isa.py::test_the_child_compiles_for_avx2"


def forced_avx2_child():
    """The run of :func:`test_forced_avx2_kernels_pass_the_vector_width_properties`'s child
    (a minute, most of it compiling the AVX2 kernels): conftest starts it at collection, on
    a thread of its own, so that it overlaps the other tests. Where this process runs AVX2
    code already (an AVX2-only CPU), every other test checks what the child would, and the
    child only checks that the switch takes: its compile of the same kernels had taken a
    core for minutes while the tests waited on the other (2-core Zen 3 VM)."""
    tests = (*_CHILD_TESTS, _SWITCH_TEST) if simd.ISA != "avx2" else (_SWITCH_TEST,)
    return _run_child(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *tests], None)


def test_forced_avx2_kernels_pass_the_vector_width_properties():
    """The micro-kernel tests above, the short-row softmax steps and the kernels' property
    test at vector widths, again in a child compiled for AVX2 (on an AVX2-only CPU, what
    every test already runs: there the child only checks the switch)."""
    child = started("avx2-child", forced_avx2_child).result()
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-4000:]
    assert " passed" in child.stdout and "skipped" not in child.stdout, child.stdout[-2000:]


@pytest.mark.skipif(os.environ.get(isa.FORCE_VARIABLE) != "avx2", reason="runs in the forced child only")
def test_the_child_compiles_for_avx2():
    assert (simd.ISA, simd.VECTOR_BYTES, microkernels.VECTORS_PER_CHUNK) == ("avx2", 32, 2)


def test_an_unknown_forced_isa_is_named_in_the_error(tmp_path):
    child = _run_child(["-c", "import npattn.cpu.simd"], tmp_path, isa_value="avx9")
    assert child.returncode != 0
    assert "NPATTN_CPU_ISA must be one of avx2" in child.stderr and "'avx9'" in child.stderr


@pytest.mark.skipif(isa.compiled_isa() != "avx512", reason="forcing AVX2 changes nothing on a CPU without AVX-512")
def test_forcing_avx2_after_numba_compiled_is_an_error(tmp_path):
    child = _run_child(["-c", textwrap.dedent("""
        import os
        from numba import njit
        njit(lambda: 1)()
        os.environ["NPATTN_CPU_ISA"] = "avx2"
        import npattn.cpu.simd
    """)], tmp_path, isa_value="")
    assert child.returncode != 0
    assert "came too late" in child.stderr


def test_the_avx2_feature_string_switches_off_every_wider_extension():
    features = {"avx2": True, "fma": True, "avx512f": True, "avx512vl": True, "amx-tile": True,
                "evex512": True, "avx10.1-512": True, "sse4.2": True, "sha": False}
    assert isa._without(features, isa._SWITCHED_OFF["avx2"]).split(",") == [
        "-amx-tile", "-avx10.1-512", "+avx2", "-avx512f", "-avx512vl", "-evex512", "+fma", "-sha", "+sse4.2"]


def test_the_avx512_feature_string_switches_off_amx_alone():
    features = {"avx2": True, "avx512f": True, "avx512bf16": True, "amx-tile": True, "amx-bf16": True,
                "amx-int8": False}
    assert isa._without(features, isa._SWITCHED_OFF["avx512"]).split(",") == [
        "-amx-bf16", "-amx-int8", "-amx-tile", "+avx2", "+avx512bf16", "+avx512f"]


@pytest.mark.parametrize("features, expected", [("+avx2,+fma,+avx512f", "avx512"), ("+avx2,+fma,-avx512f", "avx2"),
                                                ("+avx2,-fma", "baseline"), ("", "baseline")])
def test_the_compiled_isa_is_read_from_numbas_target_features(monkeypatch, features, expected):
    monkeypatch.setattr(isa, "target_features", lambda: features)
    assert isa.compiled_isa() == expected


def test_the_bench_forces_every_library_to_the_same_isa():
    from npattn.tools.cli import bench_isa_variables

    variables = dict(bench_isa_variables("avx2"))
    assert variables == {"NPATTN_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                         "MKL_ENABLE_INSTRUCTIONS": "AVX2", "OPENBLAS_CORETYPE": "Haswell"}
