"""Which x86 vector instructions the CPU kernels are compiled for, and the switch to force AVX2.

Numba compiles for the CPU its target machine names (the host's, unless
``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES`` say otherwise), and the kernels'
micro-kernels are shaped for its widest vectors:

- ``"avx512"``: 512-bit vectors, 32 registers (Intel since Skylake-SP, AMD since Zen 4);
- ``"avx2"``: 256-bit vectors with FMA, 16 registers (AMD Zen 1-3, Intel Haswell on);
- ``"baseline"``: neither; the tile products fall back to SciPy's BLAS.

Where the host has AMX (Intel Sapphire Rapids on), bfloat16 pair products run on its
tiles (:mod:`npattn.cpu.amx`), once Linux has granted the process their register state
(:func:`apply_tile_permission`).

``NPATTN_CPU_ISA=avx2`` in the environment, set before the process compiles any Numba
code, makes Numba target the host CPU with its AVX-512 features switched off, so a
developer on an AVX-512 machine measures exactly what an AVX2-only CPU would run (the
benchmark compares it with ``ATEN_CPU_CAPABILITY=avx2`` torch); ``NPATTN_CPU_ISA=avx512``
switches off AMX alone (what an AVX-512 CPU without tiles runs). It changes Numba's
target for the whole process, which is why it is an environment variable and not a
per-call option. Importing this module does not import Numba.
"""
from __future__ import annotations

import functools
import os

FORCE_VARIABLE = "NPATTN_CPU_ISA"
FORCEABLE = ("avx2", "avx512")
# Each forceable ISA's LLVM features switched off (by prefix)
_SWITCHED_OFF = {"avx2": ("avx512", "avx10", "amx", "evex512"), "avx512": ("amx",)}


def _host_features() -> dict[str, bool]:
    import llvmlite.binding as llvm

    return dict(llvm.get_host_cpu_features())


def _without(features: dict[str, bool], prefixes: tuple[str, ...]) -> str:
    """LLVM's feature string for ``features`` with every extension named by ``prefixes`` off."""
    return ",".join(("+" if on and not name.startswith(prefixes) else "-") + name
                    for name, on in sorted(features.items()))


def _set_numba_features(features: str) -> None:
    # Numba re-reads its configuration from the environment before each compilation,
    # and fixes its target machine at the first one.
    os.environ["NUMBA_CPU_FEATURES"] = features
    from numba.core import config

    config.CPU_FEATURES = features


def apply_forced_isa() -> None:
    """Point Numba's target at the ISA ``NPATTN_CPU_ISA`` names, if set. Runs before the
    package's first ``@njit``; a no-op without the variable."""
    forced = os.environ.get(FORCE_VARIABLE, "").strip().lower()
    if not forced:
        return
    if forced not in FORCEABLE:
        raise ValueError(f"{FORCE_VARIABLE} must be one of {', '.join(FORCEABLE)} (or unset), got {forced!r}")
    _set_numba_features(_without(_host_features(), _SWITCHED_OFF[forced]))
    if compiled_isa() != forced:
        raise RuntimeError(f"{FORCE_VARIABLE}={forced} came too late: Numba already compiled code for "
                           f"{compiled_isa()} in this process; set it before the process starts")


# Linux's arch_prctl: its syscall number on x86-64, the request for a permission, and
# the state component of AMX's tile data
_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18


def _request_tile_data() -> bool:
    """Ask Linux for AMX's tile state in this process (every thread, those to come
    too); False where it refuses (a kernel before 5.16, a signal stack too small for the
    state) or this is not x86-64 Linux."""
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def apply_tile_permission() -> None:
    """Before the package's first ``@njit``: where Numba's target has AMX's tiles, ask
    Linux for their state, and where it refuses, switch them off in Numba's target (so
    no kernel compiles to instructions that would fault, and the cache keeps their
    machine code apart)."""
    from numba.core import config

    configured = getattr(config, "CPU_FEATURES", None) or os.environ.get("NUMBA_CPU_FEATURES")
    if configured:
        has_tiles = "+amx-tile" in configured.split(",")
    else:
        has_tiles = bool(_host_features().get("amx-tile"))
    if has_tiles and not _request_tile_data():
        features = ({item[1:]: item[0] == "+" for item in configured.split(",") if item}
                    if configured else _host_features())
        _set_numba_features(_without(features, ("amx",)))


def target_features() -> str:
    """The feature string Numba's CPU target machine was made with (its own rule: the
    configured features, else the host's; fixed at its first compilation)."""
    from numba.core.registry import cpu_target

    return cpu_target.target_context.codegen()._tm_features


def compiled_isa() -> str:
    """``"avx512"``, ``"avx2"`` or ``"baseline"``: the widest vectors the kernels compile for."""
    enabled = {item[1:] for item in target_features().split(",") if item.startswith("+")}
    if "avx512f" in enabled:
        return "avx512"
    if {"avx2", "fma"} <= enabled:
        return "avx2"
    return "baseline"


def bf16_pairs_pay() -> bool:
    """Whether a bfloat16 forward should multiply in bfloat16 (vdpbf16ps pair products) on
    this CPU by default, where it has AVX512_BF16: on AMD's cores (Zen 4 on) and not on
    Intel's. A 512-bit vdpbf16ps makes 32 products; an FMA 16. Zen 4 issues one of each
    per cycle, so pairs double the products' rate (a bfloat16 forward 1.8-2.0x npattn's
    float32). Sapphire and Emerald Rapids issue two FMAs per cycle but a vdpbf16ps every
    second cycle: on the Emerald Rapids VM, 12 independent chains of each took 0.742 ns per
    vdpbf16ps against 0.182 ns per FMA, and a (1, 8, 2048, 64) causal bfloat16 forward
    took 34.2 ms as pairs against 21.5 ms converted to float32 (float32 itself: 19.0 ms).
    ``npattn.cpu.bfloat16_products`` overrides it per call. Where the pairs run on AMX
    tiles (:mod:`npattn.cpu.amx`) they pay on Intel's cores too: that is
    :data:`npattn.cpu.simd.BF16_PAIRS_BY_DEFAULT`'s other half."""
    return host_cpu_name().startswith("znver")


def converted_value_rows() -> int:
    """The rows from which a forward that reads 16-bit keys and values a tile at a time
    (``Int.KV_CODES`` FLOAT16 or BFLOAT16) has P V read each tile's values converted to
    float32 once (``tiles.convert_value_rows``); shorter query tiles read them in registers
    (``code_products.code_product``), converting each value row once per block of rows.
    The bits are the same either way. On Intel's cores the conversions share the two FMA
    ports: on the Emerald Rapids VM (one thread, perf), (4, 16, 1024, 64) with bfloat16
    computed in float32 spent 48% of its time in the in-register P V against the float32
    forward's 39%, so tiles from 16 rows convert. AMD's cores convert on other pipes than
    their FMAs: on the 2-core Zen 4 VM (2026-11-30, float16 over float32 on the same
    values, alternating in one process, 11 rounds), 16, 24 and 32 rows against 1024 keys
    (1, 8, S x 1024, 64) took 0.97x, 0.97x and 1.00x float32's time in registers against
    1.06x, 1.05x and 1.02x converted, (1, 8, 16 x 16, 64) causal 1.08x against 1.15x,
    (1, 8, 32 x 32, 64) causal 1.02x against 1.05x, while 64 rows kept converting (1.07x
    against 1.10x in registers); forced to AVX2 both ways were within that VM's noise."""
    return 33 if host_cpu_name().startswith("znver") else 16


# AMD's cores that keep a decode item's bursts (:func:`tile_prefetch_pays`) where the
# products read codes in registers: Zen 4, where the bursts were measured against no
# requests and the rows-ahead requests were not measured (Zen 5 measured them: they pay)
_BURSTING_CORES = ("znver4",)


def row_prefetch_pays() -> bool:
    """Whether a decode step's products that read a contiguous cache's codes in registers
    (int8, float8 e4m3, float16, bfloat16) should ask L2 for the key rows a tile on, key
    by key as they go (:mod:`npattn.cpu.code_products`), instead of the next tile's rows in
    two bursts per head (:func:`tile_prefetch_pays`). On Intel's cores, where a software
    request holds a fill buffer until its line arrives, a burst of 128 lines left the
    products' own loads waiting for buffers. Emerald Rapids VM, ``bench --caches``, three
    alternating processes each way: int8 (1, 32/8, 16384, 128) 3.7-3.9 -> 2.9-3.1 ms and
    (16, 32/8, 2048, 128) 6.7-7.0 -> 5.1-5.4 ms. On the AVX2 Zen 3 VM (2026-11-29), two
    alternating processes each way: int8 11.4-13.5 -> 8.9-9.4 ms and 19.3-21.2 ->
    13.6-15.5 ms, e4m3 13.2-20.0 -> 11.0-11.2 and 21.9-29.1 -> 17.2-19.3 ms, float16 within
    the VM's noise (13.6-20.2 against 15.3-16.0 ms). On a 2-core Zen 5 VM (2026-12-02,
    one process, 7 alternating rounds of 5 steps, two runs; rows ahead over bursts): int8
    (16, 32/8, 2048, 128) 0.75x and 0.82x the time, (1, 32/8, 16384, 128) 1.01x and 0.97x;
    float16 0.99x and 0.99x, 0.91x and 0.90x; e4m3 0.83x and 0.98x, 1.03x and 0.96x. Zen 4
    keeps the bursts (:data:`_BURSTING_CORES`: not measured this way)."""
    return host_cpu_name() not in _BURSTING_CORES


# The shortest slice of a key row (one head's keys or values, in bytes) from which Intel's
# cores stream a decode step's cache faster without the next tile asked for
HARDWARE_STREAMED_SLICE = 512


def tile_prefetch_pays(slice_bytes: int) -> bool:
    """Whether a decode step's work items, which visit each key tile head by head on caches
    whose key rows hold every head, should ask memory for the next tile's rows
    (:func:`npattn.cpu.tiles.prefetch_key_rows`) where each head's slice of a row is
    ``slice_bytes`` long. Always on AMD's cores (on the Zen 4 VM those requests came with
    items of every head, 1.09-1.62x on decode steps). On Intel's cores only below
    :data:`HARDWARE_STREAMED_SLICE`: on the Emerald Rapids VM, ``bench --caches``, two
    alternating processes each way, a float32 cache at (1, 32/8, 16384, 128) (512-byte
    slices) took 10.7-11.0 ms with the requests and 9.0 without, and 19.3-20.7 against
    16.0-16.6 ms at (16, 32/8, 2048, 128): the requests of a 512-line half tile wait for
    fill buffers that the hardware's own stream prefetch does without. Shorter slices need
    the requests there too: at (1, 32/8, 16384, 128) a float16 cache (256-byte slices)
    took 7.5-8.2 ms with them and 9.5-11.1 without, an int8 cache (128) 3.8-4.1 against
    4.4-5.2; a float32 cache at (1, 32/8, 16384, 64) (256) was within 10% either way."""
    return slice_bytes < HARDWARE_STREAMED_SLICE or host_cpu_name().startswith("znver")


@functools.cache
def host_cpu_name() -> str:
    """LLVM's name for the host's cores (``"znver4"``, ``"emeraldrapids"``), asked once: it
    takes LLVM about 0.1 ms, and plans ask it per call."""
    import llvmlite.binding as llvm

    return llvm.get_host_cpu_name()

