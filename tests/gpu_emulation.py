"""Run npattn's CUDA kernels on the CPU: the sources built by the host C++ compiler with
tests/gpu_emulation.h (one fiber per CUDA thread), launched through ctypes in place
of CuPy.

:func:`emulated_gpu` patches :mod:`npattn.gpu.launch` and the backend's availability so
that ``backend="gpu"`` takes NumPy arrays and runs every kernel here: the driver, the
kernels' indexing, masking, online softmax, dropout and gradients are all exercised
before any GPU is at hand. Only the instantiations of :data:`EMULATED` can run (the
menu: building every one takes minutes of compile time), and of those, only the ones
listed in tests/data/emulated_ahead.txt are built before the first test: the rest, all at
once, when a test first launches one (:class:`Emulation`).
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

import numpy as np

from npattn.gpu import launch, sources
from npattn.gpu.options import ALL, Option

_HEADER = Path(__file__).with_name("gpu_emulation.h")
# (dtype name, head-dim bound) pairs built for the emulation
EMULATED = (("float32", 64), ("float64", 64), ("float16", 64), ("bfloat16", 64), ("float32", 256),
            ("float16", 128), ("float16", 256))
# option sets of the tensor-core forward built for the emulation (a call runs the smallest
# built superset of its options): the plain path, the band alone and everything, each at
# head dims that fill the bound and at narrower ones, everything on unaligned rows,
# paged keys (a decode step's band and pages alone), and a quantized cache's codes
# (CODES, narrow heads) under the band alone, contiguous and paged (the builds a 16-bit
# cache's step takes, but for CODES), and under everything on unaligned rows.
# Wider bounds get the two general sets only.
_NARROW, _UNALIGNED = Option.NARROW, Option.UNALIGNED
FORWARD_TC_OPTIONS = {64: (0, Option.BAND, ALL, _NARROW, Option.BAND | _NARROW, ALL | _NARROW,
                           ALL | _NARROW | _UNALIGNED, Option.BAND | Option.PAGED | _NARROW,
                           Option.BAND | _NARROW | Option.CODES, Option.BAND | Option.PAGED | _NARROW | Option.CODES,
                           ALL | _NARROW | _UNALIGNED | Option.CODES),
                      128: (0, ALL | _NARROW, ALL | _NARROW | _UNALIGNED),
                      256: (ALL | _NARROW, ALL | _NARROW | _UNALIGNED)}
# option sets of the tensor-core backward built: plain, the band alone, and everything
BACKWARD_TC_OPTIONS = (0, Option.BAND, ALL)


def compiler() -> str | None:
    return shutil.which("g++")


# tiles built beside those the driver picks (tests force them, as the tuning harness
# does): two row fragments per warp, and two K/V stages; with the option sets of the
# test that forces them (plain, the band on narrow heads, everything, everything on
# unaligned narrow rows)
EXTRA_TILES = {64: (sources.ForwardTile(8, 2, 64), sources.ForwardTile(4, 2, 64), sources.ForwardTile(2, 2, 32),
                    sources.ForwardTile(2, 2, 32, 2), sources.ForwardTile(2, 1, 16, 2), sources.ForwardTile(1, 1, 32, 2))}
EXTRA_TILE_OPTIONS = (0, Option.BAND | _NARROW, ALL, ALL | _NARROW | _UNALIGNED)
# and a quantized cache's decode step on two K/V stages, whose codes are staged at once
# (the one-stage loop fetches them ahead of use); and the decode tile of a contiguous
# quantized cache at full width, whose codes go straight into registers (REGISTER_CODES),
# under the band alone, contiguous and paged, and (float16 only: the property tests'
# 16-bit q) under everything, without pages and with, at 64, and under the band at 128
# (its 32-key tile), contiguous and paged; each untransposed and,
# for steps of at most 8 packed rows, transposed (TRANSPOSED, on its own tile of
# sources.TRANSPOSED_WARPS warps). (tile, options, dtypes)
_REGISTERS = Option.CODES | Option.REGISTER_CODES
_SIXTEEN_BIT = ("float16", "bfloat16")
_DECODE = {bound: sources.forward_tc_config(1, bound) for bound in (64, 128)}
EXTRA_CODE_TILES = {64: ((sources.ForwardTile(1, 1, 32, 2), Option.BAND | _NARROW | Option.CODES, _SIXTEEN_BIT),
                         *((tile, Option.BAND | paged | _REGISTERS | transposed, _SIXTEEN_BIT)
                           for tile, transposed in ((_DECODE[64], 0), (sources.TRANSPOSED_TILE, Option.TRANSPOSED))
                           for paged in (0, Option.PAGED)),
                         *((tile, options | _REGISTERS | transposed, ("float16",))
                           for tile, transposed in ((_DECODE[64], 0), (sources.TRANSPOSED_TILE, Option.TRANSPOSED))
                           for options in (ALL & ~Option.PAGED, ALL))),
                    128: tuple((tile, Option.BAND | paged | _REGISTERS | transposed, _SIXTEEN_BIT)
                               for tile, transposed in ((_DECODE[128], 0), (sources.TRANSPOSED_TILE, Option.TRANSPOSED))
                               for paged in (0, Option.PAGED))}


def _forward_tc_configs(dtype_name, bound):
    """(tile, options) of every tensor-core forward built for (dtype, bound)."""
    picked = {sources.forward_tc_config(rows, bound, options) for rows in (1, 64, 65)
              for options in (0, Option.BAND, ALL)}
    configs = {(tile, int(options)) for tile in picked for options in FORWARD_TC_OPTIONS[bound]}
    configs |= {(tile, int(options)) for tile in EXTRA_TILES.get(bound, ()) for options in EXTRA_TILE_OPTIONS}
    configs |= {(tile, int(options)) for tile, options, dtypes in EXTRA_CODE_TILES.get(bound, ()) if dtype_name in dtypes}
    # each also as a split step of few splits a row takes it, merging them (MERGES; heads of
    # up to 128 dims: driver.merges_in_forward)
    if bound <= 128:
        configs |= {(tile, options | int(Option.MERGES)) for tile, options in configs}
    return sorted(configs)


def _names():
    names = []
    for dtype_name, bound in EMULATED:
        for kind in sources.KINDS:
            if kind == "forward_tc" and dtype_name in sources.TENSOR_CORE_STORAGE:
                names += [sources.kernel_name(kind, dtype_name, bound, tile=tile, options=options)
                          for tile, options in _forward_tc_configs(dtype_name, bound)]
                continue
            if kind in ("dkdv_tc", "dq_tc"):
                if bound in sources.TENSOR_CORE_BACKWARD_BOUNDS and dtype_name in sources.TENSOR_CORE_STORAGE:
                    names += [sources.kernel_name(kind, dtype_name, bound, options=options)
                              for options in BACKWARD_TC_OPTIONS]
                continue
            name = sources.kernel_name(kind, dtype_name, bound)
            if name in sources.name_expressions() and name not in names:
                names.append(name)
    return names


def _built_name(menu, kind, storage, bound, config):
    """The menu's instantiation that computes what ``kind`` at ``bound`` with ``config``
    asks for: the smallest larger-or-equal head-dim bound (a larger accumulator computes
    the same) and, for the tensor-core forward, the same tile with the fewest options
    that include the asked-for ones (an option compiled in but off at run time is a
    no-op), CODES and REGISTER_CODES exactly when asked for."""
    candidates = []
    for candidate in sorted(b for b in sources.HEAD_DIM_BOUNDS if b >= bound):
        if kind in ("dkdv_tc", "dq_tc"):  # the fewest options that include the asked-for ones
            wanted = int(config["options"])
            for options in sorted((o for o in BACKWARD_TC_OPTIONS if int(o) & wanted == wanted),
                                  key=lambda o: bin(int(o)).count("1")):
                candidates.append(sources.kernel_name(kind, storage, candidate, options=options))
            continue
        if kind != "forward_tc":
            candidates.append(sources.kernel_name(kind, storage, candidate))
            continue
        # (CODES, REGISTER_CODES and TRANSPOSED are no options to leave off at run time:
        # they say how the kernel reads k and v)
        exact = Option.CODES | Option.REGISTER_CODES | Option.TRANSPOSED
        built = [c for c in _forward_tc_configs(storage, candidate) if storage in dict(EMULATED)
                 and c[0] == config["tile"] and c[1] & config["options"] == config["options"]
                 and c[1] & exact == config["options"] & exact]
        for tile, options in sorted(built, key=lambda c: bin(c[1]).count("1")):
            candidates.append(sources.kernel_name(kind, storage, candidate, tile=tile, options=options))
    built = [name for name in candidates if name in menu]
    if not built:
        raise AssertionError(f"no {kind} kernel for {storage} with bound >= {bound} and {config} is on the "
                             "emulation's menu; add it to EMULATED")
    return built[0]


# The menu's instantiations that the ci profile's examples launch (written by a run of
# tests/test_gpu_emulated.py with NPATTN_WRITE_EMULATED_AHEAD=1): built before the first
# test. On the 2-core Zen 3 VM, g++ built those 96 in 30 s of a core, and all 215 of the
# menu in 70 s. The other profiles' examples reach more of the menu: the first launch of
# one not built ahead builds the rest, once.
AHEAD_LIST = Path(__file__).parent / "data" / "emulated_ahead.txt"
WRITE_AHEAD_VARIABLE = "NPATTN_WRITE_EMULATED_AHEAD"


def ahead_names() -> list[str]:
    """The names of :data:`AHEAD_LIST` that are on the menu (a stale entry is skipped)."""
    menu = set(_names())
    listed = AHEAD_LIST.read_text().split("\n") if AHEAD_LIST.exists() else []
    return [name for name in listed if name in menu]


class Emulation:
    """The emulation's kernels: the instantiations built ahead (one library), and on the
    first launch of any other on the menu, every one not yet built (a second library).
    Remembers which it launched."""

    def __init__(self, directory: Path, text: str, menu, ahead):
        self._directory, self._text, self._menu = directory, text, tuple(menu)
        self._symbols: dict = {}  # name -> (library, its launcher's symbol)
        self._lock = threading.Lock()
        self.launched: set = set()
        self.reversed_blocks = False  # (every library's launches: run_kernel sets its own flag)
        ahead = set(ahead) or set(self._menu)  # (no list: everything ahead)
        self._add(build_source(directory, text, [name for name in self._menu if name in ahead]))

    def _add(self, built) -> None:
        library, launchers = built
        self._symbols.update({name: (library, symbol) for name, symbol in launchers.items()})

    @property
    def menu(self) -> tuple[str, ...]:
        return self._menu

    def run(self, name: str, blocks: int, threads: int, shared_bytes: int, arguments) -> None:
        """:func:`run_kernel` for the menu's instantiation ``name``, built if it was not."""
        with self._lock:
            if name not in self._symbols:
                if name not in self._menu:
                    raise AssertionError(f"{name} is not on the emulation's menu (gpu_emulation.EMULATED)")
                self._add(build_source(self._directory, self._text,
                                       [other for other in self._menu if other not in self._symbols]))
            self.launched.add(name)
            library, symbol = self._symbols[name]
        library.npattn_emulation_reverse_blocks(int(self.reversed_blocks))
        run_kernel(library, {name: symbol}, name, blocks, threads, shared_bytes, arguments)

    @contextlib.contextmanager
    def blocks_reversed(self):
        """Launches run their blocks last to first inside the block (first to last outside):
        what depends on which block of a launch runs last then runs on another one."""
        self.reversed_blocks = True
        try:
            yield
        finally:
            self.reversed_blocks = False

    def write_ahead_list(self) -> None:
        """Write what this session launched as :data:`AHEAD_LIST`, in the menu's order."""
        AHEAD_LIST.write_text("".join(f"{name}\n" for name in self._menu if name in self.launched))


def build(directory: Path) -> Emulation:
    """The :class:`Emulation` of the sources, its libraries built into ``directory``
    (reused while the sources are unchanged)."""
    return Emulation(directory, switched(sources.source()), _names(), ahead_names())


def switched(text: str) -> str:
    """``text`` after a ``#define`` of each name in ``$NPATTN_GPU_DEFINES`` (the switches
    a lent GPU times, which NVRTC gets as -D options): so that a switch's code runs in the
    emulation too, ``NPATTN_GPU_DEFINES=NAME pytest tests/test_gpu_emulated.py``."""
    names = os.environ.get("NPATTN_GPU_DEFINES", "").split()
    return "".join(f"#define {name}\n" for name in names) + text


def build_source(directory: Path, text: str, names) -> tuple[ctypes.CDLL, dict]:
    """:func:`build` for any CUDA source ``text`` and its kernels' name expressions
    ``names`` (the emulation's own tests build small kernels of their own)."""
    launchers = {name: f"npattn_launch_{index}" for index, name in enumerate(names)}
    text = "\n".join([_HEADER.read_text(), text] + [
        f'extern "C" void {symbol}(int blocks, int threads, size_t shared, void** args) '
        f"{{ emulate_launch(&{name}, blocks, threads, shared, args); }}"
        for name, symbol in launchers.items()])
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    library = directory / f"npattn_emulated_{digest}.so"
    if not library.exists():
        source = directory / f"npattn_emulated_{digest}.cpp"
        source.write_text(text)
        subprocess.run([compiler(), "-std=c++20", "-O1", "-ffp-contract=off", "-pthread", "-shared", "-fPIC", "-w",
                        "-o", str(library), str(source)], check=True)
    return ctypes.CDLL(str(library)), launchers


def run_kernel(library: ctypes.CDLL, launchers: dict, name: str, blocks: int, threads: int, shared_bytes: int,
           arguments) -> None:
    """Run the kernel ``name`` on ``blocks`` blocks of ``threads`` threads with
    ``arguments`` (NumPy arrays by their data pointers, ints as 64-bit integers, NumPy
    one-element structured arrays, structs passed by value, by their bytes)."""
    values = [_argument(a) for a in arguments]
    pointers = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
    getattr(library, launchers[name])(int(blocks), int(threads), ctypes.c_size_t(shared_bytes), pointers)


def _argument(value):
    if isinstance(value, np.ndarray) and value.dtype.fields is not None:
        # a struct passed by value (CuPy's way: a one-element structured array): its bytes
        return ctypes.create_string_buffer(value.tobytes(), value.nbytes)
    if isinstance(value, np.ndarray):
        return ctypes.c_void_p(value.ctypes.data)
    return ctypes.c_longlong(int(value))


@contextlib.contextmanager
def emulated_gpu(monkeypatch, emulation: Emulation):
    """``backend="gpu"`` on NumPy arrays, every launch run by ``emulation``."""
    import npattn.gpu
    import npattn.gpu.driver

    def run(kind, storage, bound, blocks, shared_bytes, arguments, threads=None, **config):
        if blocks <= 0:
            return
        name = _built_name(emulation.menu, kind, storage, bound, config)
        threads = threads or launch.threads_of(kind, config.get("tile"))
        emulation.run(name, blocks, threads, shared_bytes, arguments)

    def kernel(kind, storage, bound, shared_bytes, threads=None, **config):
        # looked up at each launch, so a test's spy on launch.run sees plans' launches too
        return lambda blocks, arguments: launch.run(kind, storage, bound, blocks, shared_bytes, arguments,
                                                    threads=threads, **config)

    def unfilled(cp, shape, dtype):  # poisoned: an element the kernel leaves unwritten is NaN
        return cp.full(shape, np.nan, dtype)

    with monkeypatch.context() as patch:
        patch.setattr(launch, "run", run)
        patch.setattr(launch, "kernel", kernel)
        patch.setattr(npattn.gpu.driver, "_unfilled", unfilled)
        patch.setattr(npattn.gpu, "unavailable_reason", lambda array_kind="cupy": None)
        yield
