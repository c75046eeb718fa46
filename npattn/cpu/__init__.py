"""CPU backend: Numba-jitted, tiled (FlashAttention-2 style) kernels, forward and backward.

Modules: :mod:`.tuning` (tile sizes and product path, per context), :mod:`.operands`
(a problem as flat arrays and strides), :mod:`.isa` (the vector ISA compiled for, and
``NPATTN_CPU_ISA``), :mod:`.simd` (explicit full-width vectors for Numba),
:mod:`.microkernels` (register-blocked tile products on them), :mod:`.blas`
(BLAS products on row blocks in place, the fallback), :mod:`.rowmath` (a vectorized exp),
:mod:`.tiles` (visibility, dropout hash, one tile of scores), :mod:`.forward_kernel`
and :mod:`.backward_kernel`; :mod:`.activations` (the exact GELU on the vector units) and
:mod:`.normalization` (layer and RMS normalization a row at a time), which the autograd
takes for float32 arrays. Importing this package needs neither Numba nor SciPy;
the kernels are imported (and compiled, or loaded from Numba's on-disk cache) on
first use.
"""
from __future__ import annotations

import functools
import importlib.util
import itertools

NAME = "cpu"
# Runs a problem with ``packed_rows`` (each batch entry's live rows are its own rows of one
# packed batch): attention_varlen hands such a backend its whole batch as one call.
PACKED_ROWS = True
# Reads int8 kv caches with their scales (problem.k_scale), a tile dequantized at a time.
QUANTIZED_KV = True
_REQUIRED = ("numba", "scipy")
# The oldest Numba the kernels compile with: before 0.68 Numba cannot index an array with
# an IntEnum (the kernels' ``ints[Int.BLOCK_K]``), and before 0.62 its cache locators
# have other names (npattn/cpu/_cache.py). setup.cfg asks for the same.
OLDEST_NUMBA = (0, 68)


def unavailable_reason(array_kind: str = "numpy") -> str | None:
    if array_kind != "numpy":
        return f"the cpu backend takes NumPy arrays, got {array_kind} arrays"
    missing = _missing_modules()
    if missing:
        return (f"needs {' and '.join(missing)} (pip install numba scipy); "
                f"{'it is' if len(missing) == 1 else 'they are'} not installed")
    return _too_old(_numba_version())


@functools.lru_cache(maxsize=4)
def _too_old(found: str | None) -> str | None:
    """Why a Numba of version ``found`` cannot run the kernels, or None (asked at every call:
    kept)."""
    if found is not None and _release(found) < OLDEST_NUMBA:
        oldest = ".".join(map(str, OLDEST_NUMBA))
        return f"needs numba>={oldest} (pip install -U 'numba>={oldest}'); numba {found} is installed"
    return None


@functools.lru_cache(maxsize=1)
def _numba_version() -> str | None:
    """The installed Numba's version string (from its metadata: Numba is not imported)."""
    from importlib import metadata

    try:
        return metadata.version("numba")
    except metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, ...]:
    """``"0.68.1"`` -> (0, 68, 1); a pre-release or local suffix ends the numbers."""
    numbers = []
    for part in version.split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        numbers.append(int(digits))
        if digits != part:
            break
    return tuple(numbers)


@functools.lru_cache(maxsize=1)
def _missing_modules() -> tuple[str, ...]:
    """The required modules that cannot be imported, looked up once per process (every
    call asks; find_spec took a tenth of a tiny call's time)."""
    return tuple(name for name in _REQUIRED if importlib.util.find_spec(name) is None)


def forward(problem):
    from .driver import forward as run
    return run(problem)


def gradient_forward(problem):
    """:func:`forward` for a call whose backward follows: a 16-bit problem's saved out in
    float32, the product the backward's exact gradients need
    (:meth:`npattn.cpu.driver.ForwardPlan.for_gradients`)."""
    from .driver import forward as run
    return run(problem, for_gradients=True)


def forward_plan(problem):
    """A callable ``(q, k, v) -> ForwardResult | None`` running the forward of any problem
    of ``problem``'s signature without option arrays (see :mod:`npattn.runtime.plans`)."""
    from .driver import forward_plan as plan
    from .tuning import current
    return plan(problem, current())


def backward_plan(problem):
    """A callable ``(q, k, v, saved, dout) -> Gradients | None``: :func:`forward_plan`'s
    counterpart for the backward, which returns None where dout or a gradient is not all
    finite (:meth:`npattn.cpu.driver.BackwardPlan.__call__`)."""
    from .driver import backward_plan as plan
    from .tuning import current
    return plan(problem, current())


def backward(problem, saved, dout):
    from .driver import backward as run
    return run(problem, saved, dout)


def slot_writer(caches, new, targets, positions):
    """The kv-cache call's append to NumPy caches, compiled: a
    :class:`~npattn.cpu.slots.SlotWriter` (one call for both caches where NumPy's
    indexing takes four)."""
    from .slots import SlotWriter
    return SlotWriter(caches, new, targets, positions)


def products(kind: str):
    """A context manager: run the block with the tiles' matrix products on ``"vector"``
    (the register-blocked micro-kernels of :mod:`.microkernels`, the default where the CPU
    has AVX-512 or AVX2) or ``"blas"`` (SciPy's BLAS, the default elsewhere). Which vectors
    the micro-kernels use is fixed per process (:mod:`.isa`). Results agree
    to rounding; the tests run both. It applies to calls from this thread (or asyncio
    task) only: see :mod:`.tuning`."""
    from .tuning import tuned

    if kind not in ("vector", "blas"):
        raise ValueError(f"products must be 'vector' or 'blas', got {kind!r}")
    return tuned(vector=kind == "vector")


def bfloat16_products(enabled: bool | None):
    """A context manager: run the block with bfloat16 forwards and backwards multiplying in
    bfloat16 (``True``: AVX512_BF16's vdpbf16ps pair products, P rounded to bfloat16, and
    in the backward dS too, where the CPU has the instruction), in float32 (``False``: the
    values converted as they are read), or as this CPU does by default (``None``: pairs on
    AMD's cores and on Intel's with AMX, whose tiles take them (:mod:`.amx`), float32 on
    Intel's without, where vdpbf16ps makes half the products per cycle of FMAs;
    :func:`.isa.bf16_pairs_pay`). Both paths keep bfloat16's error bound (the
    backward's gradients on pairs carry about 1.4x the rms error of float32's products,
    within torch's own bfloat16 backward's). It applies to calls from this thread (or
    asyncio task) only: see :mod:`.tuning`."""
    from .tuning import tuned

    if enabled not in (True, False, None):
        raise ValueError(f"enabled must be True, False or None, got {enabled!r}")
    return tuned(bf16_products=enabled)


def tile_sizes(block_q: int, block_k: int, edge_band: int | None = None):
    """A context manager: run the block with query tiles of ``block_q`` rows and key tiles
    of ``block_k`` keys in both the forward and the backward (defaults: 192 x 384 and
    96 x 192, smaller where a causal or windowed problem's band of visible keys leaves those
    mostly masked: :meth:`.tuning.Tuning.forward_tiles`, :meth:`.tuning.Tuning.backward_tiles`),
    and, when given, products on tiles the causal or window edge cuts in bands
    of ``edge_band`` rows (default 48). Results agree to rounding for any sizes; the tests
    use tiny tiles to cross many tile edges on small problems, and tuners can try others.
    It applies to calls from this thread (or asyncio task) only: see :mod:`.tuning`."""
    from .tuning import tuned

    if block_q < 1 or block_k < 1 or (edge_band is not None and edge_band < 1):
        raise ValueError(f"tile sizes must be positive, got block_q={block_q}, block_k={block_k}, "
                         f"edge_band={edge_band}")
    tiles = (int(block_q), int(block_k))
    changes = dict(forward=tiles, backward=tiles)
    if edge_band is not None:
        changes["edge_band"] = int(edge_band)
    return tuned(**changes)
