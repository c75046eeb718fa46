"""Compiling the CUDA sources without a GPU: NVRTC through ctypes.

:func:`compile_cubin` turns :func:`npattn.gpu.sources.source` into the machine code
(a cubin) of one architecture, the same way CuPy's ``RawModule`` does on a GPU, but
needing only the ``nvidia-cuda-nvrtc-cu12`` wheel: no GPU, no driver, no CuPy. CI uses
it to catch a syntax or template error in kernels it cannot run
(:func:`check_compiles`; :func:`compile_ptx` stops at PTX, unoptimized where only the
compile is checked, for kernels whose machine code it does not read) and to read the
machine code itself (:mod:`npattn.gpu.sass`; :func:`compile_cubins` makes it for several
architectures from one NVVM compile, with ptxas of NVRTC's release where installed).

Imports nothing but the standard library. :mod:`.sources` is imported inside the
functions that need it, because :mod:`.sources` re-exports this module's names at
its bottom: a module-level import here would make the two a cycle.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import importlib.util
import os
import re
import subprocess
import tempfile


class CompileError(RuntimeError):
    """NVRTC rejected the sources; the message holds its log."""


def nvrtc_library_path() -> str | None:
    """libnvrtc from the ``nvidia-cuda-nvrtc-cu12`` (or CUDA 13) wheel, else from
    ``CUDA_PATH`` / ``CUDA_HOME``, else None."""
    candidates = []
    spec = importlib.util.find_spec("nvidia")
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            # nvidia-cuda-nvrtc-cu12 puts it in cuda_nvrtc/lib; the CUDA 13 wheels in cu13/lib
            for folder in ("cuda_nvrtc", "cu1[3-9]"):
                candidates += sorted(glob.glob(os.path.join(root, folder, "lib", "libnvrtc.so*")))
    for variable in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(variable):
            candidates += sorted(glob.glob(os.path.join(os.environ[variable], "lib64", "libnvrtc.so*")))
    # the plain soname first: the versioned builtins library sits beside it
    candidates.sort(key=lambda path: ("builtins" in path, len(os.path.basename(path))))
    usable = [path for path in candidates if "builtins" not in path and "alt" not in path]
    return usable[0] if usable else None


def _library() -> ctypes.CDLL:
    path = nvrtc_library_path()
    if path is None:
        raise RuntimeError("no NVRTC library found: pip install nvidia-cuda-nvrtc-cu12")
    nvrtc = ctypes.CDLL(path)
    nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
    return nvrtc


def version() -> tuple[int, int]:
    """NVRTC's (major, minor) version."""
    nvrtc = _library()
    major, minor = ctypes.c_int(), ctypes.c_int()
    _checker(nvrtc)(nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def _checker(nvrtc: ctypes.CDLL):
    """A function that raises :class:`CompileError` naming the call when a status is not
    NVRTC_SUCCESS (0)."""
    def check(status: int, what: str) -> None:
        if status != 0:
            raise CompileError(f"{what}: {nvrtc.nvrtcGetErrorString(status).decode()}")
    return check


def _log(nvrtc: ctypes.CDLL, program: ctypes.c_void_p) -> str:
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(program, log)
    return log.value.decode(errors="replace")


def _cubin(nvrtc: ctypes.CDLL, program: ctypes.c_void_p, architecture: str) -> bytes:
    check = _checker(nvrtc)
    size = ctypes.c_size_t()
    check(nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
    # a virtual architecture ("compute_90") gives PTX and no cubin: nothing to read or run
    if size.value == 0:
        raise CompileError(f"NVRTC produced no machine code for {architecture}")
    cubin = ctypes.create_string_buffer(size.value)
    check(nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
    return cubin.raw


def compile_cubin(architecture: str, names=None, text: str | None = None) -> tuple[bytes, dict[str, str]]:
    """Compile ``text`` (default: :func:`~npattn.gpu.sources.source`) to machine code for
    ``architecture`` (say "sm_90"), instantiating the name expressions ``names`` (default:
    :func:`~npattn.gpu.sources.name_expressions`). Returns the cubin's bytes and each
    name's lowered (mangled) symbol, the name the cubin's functions carry.

    Raises :class:`CompileError` with NVRTC's log, or RuntimeError when no NVRTC library
    is found. Needs no GPU and no CuPy; NVRTC runs without the GIL (ctypes releases it),
    so architectures compile in parallel threads."""
    return _compiled(architecture, names, text, machine_code=True)


def compile_ptx(architecture: str, names=None, text: str | None = None,
                optimized: bool = True) -> tuple[bytes, dict[str, str]]:
    """:func:`compile_cubin` up to PTX, for ``architecture``'s virtual architecture
    ("sm_90" compiles for "compute_90"): the C++ front end and NVVM, which find every
    template or syntax error, without ptxas's machine code. Returns the PTX's bytes and
    the lowered symbols.

    ``optimized=False`` compiles at NVRTC's fastest compile level (``--Ofast-compile=max``,
    NVRTC 12.8 and later; an older NVRTC optimizes as usual), which leaves out most of
    NVVM's optimizer, where the time of an optimized compile goes: for a check that the
    instantiations compile, and nothing that reads their code. On the 2-core Zen 3 VM, one
    core's time for the 61 instantiations whose machine code no test reads: 1.9 s against
    23.7 s optimized; for the 31 tiles the tuning harness times, 2.0 against 26.5 s.
    (``--device-debug`` leaves the optimizer out too, but took 90 s for those tiles.)"""
    extra = () if optimized else _fast_compile_options()
    return _compiled(virtual_architecture(architecture), names, text, machine_code=False, extra_options=extra)


def compile_cubins(names_by_architecture, text: str | None = None) -> dict[str, tuple[bytes, dict[str, str]]]:
    """:func:`compile_cubin` of each architecture in ``names_by_architecture``
    (``{"sm_80": names, "sm_90": names}``): ``{architecture: (cubin, lowered symbols)}``.

    NVRTC makes a cubin in two steps, NVVM to PTX and then its own ptxas; where a ptxas
    of NVRTC's release is installed (:func:`ptxas_path`), this takes them apart: NVVM
    runs once for each set of architectures that define the same macros
    (:func:`~npattn.gpu.sources.architecture_defines`: sm_80 apart from sm_89 and later),
    to PTX for the set's lowest architecture with every name of the set (the sets side by
    side, in threads), and ptxas compiles each architecture's kernels from its set's PTX
    (the ``.target`` raised to that architecture), in processes side by side. The machine
    code is NVRTC's, function for function (in another order within the cubin), as long
    as NVVM's PTX of the sources depends on the architecture through those macros alone:
    the sources name no ``__CUDA_ARCH__``, and tests/test_gpu_machine_code.py compares
    the two routes. On the 2-core Zen 3 VM,
    each alone: NVRTC took 120 s for sm_80's 55 kernels and 125 s for sm_90's 59; NVVM
    once took 55 s, and ptxas 64 s and 70 s. Without a matching ptxas, NVRTC compiles
    each architecture whole, in threads side by side (NVRTC runs without the GIL).

    Raises :class:`CompileError` with NVRTC's or ptxas's log."""
    from concurrent.futures import ThreadPoolExecutor

    from .sources import architecture_defines, architecture_number

    architectures = sorted(names_by_architecture, key=architecture_number)
    ptxas = ptxas_path() if len(architectures) > 1 else None
    if ptxas is None:
        with ThreadPoolExecutor(max(1, len(architectures))) as pool:
            compiled = pool.map(lambda architecture: compile_cubin(architecture, names_by_architecture[architecture],
                                                                   text), architectures)
            return dict(zip(architectures, compiled))
    sets: dict[tuple[str, ...], list[str]] = {}
    for architecture in architectures:
        sets.setdefault(architecture_defines(architecture), []).append(architecture)

    def set_ptx(members):
        every_name = tuple(dict.fromkeys(name for architecture in members
                                         for name in names_by_architecture[architecture]))
        return compile_ptx(members[0], every_name, text)

    with ThreadPoolExecutor(len(sets)) as pool:
        ptx_of = dict(zip(sets, pool.map(set_ptx, sets.values())))
    with tempfile.TemporaryDirectory(prefix="npattn-ptxas-") as directory:
        running = {}
        lowered = {}
        for architecture in architectures:
            ptx, lowered[architecture] = ptx_of[architecture_defines(architecture)]
            source = os.path.join(directory, f"{architecture}.ptx")
            with open(source, "wb") as stream:
                stream.write(retargeted(ptx, architecture))
            entries = [argument for name in names_by_architecture[architecture]
                       for argument in ("-e", lowered[architecture][name])]
            command = [ptxas, f"--gpu-name={architecture}", "-O3", source, "-o", source[:-len(".ptx")] + ".cubin",
                       *entries]
            running[architecture] = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        logs = {architecture: process.communicate()[0].decode(errors="replace")  # (all done before any raise)
                for architecture, process in running.items()}
        results = {}
        for architecture, process in running.items():
            if process.returncode != 0:
                raise CompileError(f"ptxas failed for {architecture} ({process.returncode}):\n{logs[architecture]}")
            with open(os.path.join(directory, f"{architecture}.cubin"), "rb") as stream:
                results[architecture] = (stream.read(), {name: lowered[architecture][name]
                                                         for name in names_by_architecture[architecture]})
    return results


def retargeted(ptx: bytes, architecture: str) -> bytes:
    """``ptx`` with its ``.target`` directive naming ``architecture`` ("sm_90")."""
    changed, count = re.subn(rb"^\.target\s+sm_\w+", b".target " + architecture.encode(), ptx, count=1, flags=re.M)
    if count != 1:
        raise CompileError("the PTX has no .target directive")
    return changed


@functools.cache
def ptxas_path() -> str | None:
    """A ptxas of NVRTC's own release (major.minor, as ``ptxas --version`` and
    :func:`version` say): the ``nvidia-cuda-nvcc-cu12`` wheel's, CUDA's or one on PATH
    (:func:`npattn.gpu.sass.tool_candidates`); None where there is none. A ptxas of
    another release may make other machine code than NVRTC's own, so it is not used."""
    from .sass import tool_candidates

    wanted = version()
    for path in tool_candidates("ptxas"):
        try:
            done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            continue
        match = re.search(r"release (\d+)\.(\d+)", done.stdout)
        if match is not None and (int(match[1]), int(match[2])) == wanted:
            return path
    return None


FAST_COMPILE_OPTION = "--Ofast-compile=max"


@functools.cache
def _fast_compile_options() -> tuple[str, ...]:
    """``(FAST_COMPILE_OPTION,)`` where this NVRTC takes it, else ``()``: a trivial
    program compiled with it once per process (0.2 s) tells."""
    probe = "template <int N> __global__ void probe(float* x) { x[N] = 1.0f; }"
    try:
        _compiled("compute_80", ["probe<0>"], probe, machine_code=False, extra_options=(FAST_COMPILE_OPTION,))
    except CompileError:
        return ()
    return (FAST_COMPILE_OPTION,)


def virtual_architecture(architecture: str) -> str:
    """The virtual architecture of a real one: "sm_90" -> "compute_90" (one already
    virtual, as it is)."""
    return "compute_" + architecture[len("sm_"):] if architecture.startswith("sm_") else architecture


def _compiled(architecture: str, names, text: str | None, machine_code: bool,
              extra_options: tuple[str, ...] = ()) -> tuple[bytes, dict[str, str]]:
    from .sources import compile_options, name_expressions, source

    nvrtc = _library()
    check = _checker(nvrtc)
    names = tuple(name_expressions() if names is None else names)
    text = source() if text is None else text
    program = ctypes.c_void_p()
    check(nvrtc.nvrtcCreateProgram(ctypes.byref(program), text.encode(), b"npattn.cu", 0, None, None),
          "nvrtcCreateProgram")
    try:
        for name in names:
            check(nvrtc.nvrtcAddNameExpression(program, name.encode()), f"nvrtcAddNameExpression({name})")
        options = [option.encode() for option in (*compile_options(architecture), *extra_options)]
        status = nvrtc.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
        if status != 0:
            raise CompileError(f"NVRTC failed for {architecture}:\n{_log(nvrtc, program)}")
        lowered = {}
        for name in names:
            symbol = ctypes.c_char_p()
            check(nvrtc.nvrtcGetLoweredName(program, name.encode(), ctypes.byref(symbol)),
                  f"nvrtcGetLoweredName({name})")
            lowered[name] = symbol.value.decode()
        return (_cubin if machine_code else _ptx)(nvrtc, program, architecture), lowered
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))


def _ptx(nvrtc: ctypes.CDLL, program: ctypes.c_void_p, architecture: str) -> bytes:
    check = _checker(nvrtc)
    size = ctypes.c_size_t()
    check(nvrtc.nvrtcGetPTXSize(program, ctypes.byref(size)), "nvrtcGetPTXSize")
    ptx = ctypes.create_string_buffer(size.value)
    check(nvrtc.nvrtcGetPTX(program, ptx), "nvrtcGetPTX")
    return ptx.value


def check_compiles(architecture: str, names=None, machine_code: bool = True) -> dict[str, str]:
    """Compile :func:`~npattn.gpu.sources.source` to machine code for ``architecture``
    (say "sm_90") with NVRTC, or with ``machine_code=False`` to unoptimized PTX only
    (:func:`compile_ptx`, ``optimized=False``: the check that every instantiation
    compiles, at a tenth of an optimized compile's time), instantiating ``names``
    (default: every name expression); returns each name's lowered (mangled) symbol.
    Raises :class:`CompileError` with NVRTC's log, or RuntimeError when no NVRTC library
    is found. Needs no GPU and no CuPy."""
    if machine_code:
        return compile_cubin(architecture, names)[1]
    return compile_ptx(architecture, names, optimized=False)[1]
