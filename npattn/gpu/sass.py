"""Reading the kernels' machine code without a GPU: resources and SASS of a cubin.

A cubin from :func:`npattn.gpu.nvrtc.compile_cubin` is read with NVIDIA's own tools,
``cuobjdump`` (resource usage) and ``nvdisasm`` (SASS; its functions picked by their
index in the cubin's symbol table, read here), shipped by the PyPI wheels
``nvidia-cuda-cuobjdump`` and ``nvidia-cuda-nvdisasm``. This is how CI holds the fast
kernels to what makes them fast without running them: no register spills (stack or
local memory, ``LDL``/``STL``), and tensor-core math fed the way it should be
(``HMMA``, ``LDSM`` = ldmatrix, ``LDGSTS`` = cp.async), per :func:`check_fast_kernel`.

Imports nothing but the standard library; the tools run as subprocesses.
"""
from __future__ import annotations

import collections
import glob
import importlib.util
import os
import re
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass

# what a tensor-core kernel's SASS must contain, and what its absence means
FAST_KERNEL_OPCODES = {
    "HMMA": "no HMMA: the matrix products are not on tensor cores",
    "LDSM": "no LDSM: mma operands are not loaded from shared memory with ldmatrix",
    "LDGSTS": "no LDGSTS: tiles are not copied global->shared with cp.async",
}
# local-memory loads and stores: what a register spill (or a dynamically indexed array) costs
SPILL_OPCODES = ("LDL", "STL")

# "Function _Z...:" then "REG:40 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:536 ..."
_FUNCTION = re.compile(r"^\s*Function\s+(\S+?):\s*$")
_FIELD = re.compile(r"([A-Z]+(?:\[\d+\])?):(\d+)")
# nvdisasm: "//------ .text.SYMBOL ------"; cuobjdump -sass: "Function : SYMBOL"
_SECTION = re.compile(r"^//-+\s+\.text\.(\S+)\s+-+\s*$|^\s*Function\s*:\s*(\S+)\s*$")
# "/*0a40*/  @!P0 LDSM.16.MT88.4 R4, [R2] ;": address, optional predicate, mnemonic
_INSTRUCTION = re.compile(r"/\*[0-9a-f]+\*/\s+(?:@!?\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")


class ToolMissing(RuntimeError):
    """cuobjdump or nvdisasm is not installed."""


@dataclass(frozen=True)
class Usage:
    """One function's resources as cuobjdump reports them (bytes, except registers)."""

    registers: int
    stack: int
    local: int
    shared: int


def tool_path(name: str) -> str | None:
    """The executable ``name`` ("cuobjdump" or "nvdisasm"): the first of
    :func:`tool_candidates`; None if absent."""
    usable = tool_candidates(name)
    return usable[0] if usable else None


def tool_candidates(name: str) -> list[str]:
    """Every executable ``name`` found, in the order they are preferred: from a wheel
    under the ``nvidia`` namespace package (``nvidia/cu13/bin`` today,
    ``nvidia/cuda_<tool>/bin`` in older layouts and ``nvidia/cuda_nvcc/bin`` for ptxas),
    then ``CUDA_PATH``/``CUDA_HOME``/bin, then PATH."""
    candidates = []
    spec = importlib.util.find_spec("nvidia")
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            candidates += sorted(glob.glob(os.path.join(root, "*", "bin", name)))
    for variable in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(variable):
            candidates.append(os.path.join(os.environ[variable], "bin", name))
    candidates.append(shutil.which(name) or "")
    usable = [path for path in candidates if os.path.isfile(path) and os.access(path, os.X_OK)]
    return list(dict.fromkeys(usable))


def _required(tool: str) -> str:
    path = tool_path(tool)
    if path is None:
        raise ToolMissing(f"no {tool} found: pip install nvidia-cuda-{tool}")
    return path


def _run(tool: str, arguments: list[str], cubin: bytes) -> str:
    """``tool``'s standard output on ``cubin``, written to a temporary file: the tools
    read files only."""
    path = _required(tool)
    # cuobjdump --dump-sass runs nvdisasm, looking beside itself and on PATH: the wheels'
    # nvdisasm may be in neither when the two come from different places
    environment = dict(os.environ)
    nvdisasm = tool_path("nvdisasm")
    if nvdisasm is not None:
        environment["PATH"] = os.pathsep.join(filter(None, (os.path.dirname(nvdisasm), environment.get("PATH"))))
    with tempfile.TemporaryDirectory() as directory:
        file = os.path.join(directory, "kernels.cubin")
        with open(file, "wb") as stream:
            stream.write(cubin)
        done = subprocess.run([path, *arguments, file], capture_output=True, text=True, env=environment)
    if done.returncode != 0:
        raise RuntimeError(f"{tool} {' '.join(arguments)} failed ({done.returncode}):\n{done.stderr}")
    return done.stdout


def parse_resource_usage(text: str) -> dict[str, Usage]:
    """Each function's :class:`Usage` from ``cuobjdump --dump-resource-usage`` output."""
    usage, function = {}, None
    for line in text.splitlines():
        header = _FUNCTION.match(line)
        if header:
            function = header.group(1)
            continue
        fields = dict(_FIELD.findall(line))
        if function is not None and "REG" in fields:
            usage[function] = Usage(registers=int(fields["REG"]), stack=int(fields.get("STACK", 0)),
                                    local=int(fields.get("LOCAL", 0)), shared=int(fields.get("SHARED", 0)))
            function = None
    return usage


def resource_usage(cubin: bytes) -> dict[str, Usage]:
    """Each function's registers, stack, local and static shared memory, by symbol."""
    return parse_resource_usage(_run("cuobjdump", ["--dump-resource-usage"], cubin))


def split_functions(text: str) -> dict[str, str]:
    """The SASS of each function in nvdisasm (or ``cuobjdump -sass``) output, by symbol."""
    functions, symbol, lines = {}, None, []
    for line in text.splitlines():
        header = _SECTION.match(line)
        if header:
            if symbol is not None:
                functions[symbol] = "\n".join(lines)
            symbol, lines = header.group(1) or header.group(2), []
        elif symbol is not None:
            lines.append(line)
    if symbol is not None:
        functions[symbol] = "\n".join(lines)
    return functions


def disassemble(cubin: bytes, symbols=None) -> dict[str, str]:
    """Each function's SASS text, by symbol; only those of ``symbols`` when given (one
    nvdisasm run restricted to their symbol-table indices, :func:`symbol_indices`).
    Needs nvdisasm.

    nvdisasm's time grows with the functions it prints: on the 2-core Zen 3 VM, for an
    sm_90 cubin of 59 tensor-core kernels, 8.3 s for all 59 and 0.7 s for one.
    (``cuobjdump --dump-sass --function`` picks functions by name, but its time grew by
    0.6 s a function: 40.7 s for the 59.)"""
    _required("nvdisasm")
    if symbols is None:
        return split_functions(_run("nvdisasm", ["--print-code"], cubin))
    symbols = tuple(dict.fromkeys(symbols))
    indices = symbol_indices(cubin)
    missing = [symbol for symbol in symbols if symbol not in indices]
    if missing:
        raise KeyError(f"no function {', '.join(missing)} in the cubin")
    selection = ",".join(str(indices[symbol]) for symbol in symbols)
    functions = split_functions(_run("nvdisasm", ["--print-code", "--cuda-function-index", selection], cubin))
    missing = [symbol for symbol in symbols if symbol not in functions]
    if missing:
        raise KeyError(f"no function {', '.join(missing)} in the cubin's code")
    return functions


def symbol_indices(cubin: bytes) -> dict[str, int]:
    """Each symbol's index in the cubin's ELF symbol table (``.symtab``), by name: how
    nvdisasm's ``--cuda-function-index`` names functions."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:  # (EI_CLASS 2: a 64-bit ELF, as every cubin is)
        raise ValueError("not a 64-bit ELF cubin")
    (section_table,) = struct.unpack_from("<Q", cubin, 0x28)  # e_shoff
    entry_size, count = struct.unpack_from("<HH", cubin, 0x3A)  # e_shentsize, e_shnum
    # (sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size, sh_link, sh_info, sh_addralign, sh_entsize)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, section_table + i * entry_size) for i in range(count)]
    indices = {}
    for _, kind, _, _, offset, size, link, _, _, symbol_size in sections:
        if kind != _SHT_SYMTAB:
            continue
        names = sections[link][4]  # the string table's offset
        for index in range(size // symbol_size):
            (name,) = struct.unpack_from("<I", cubin, offset + index * symbol_size)  # st_name
            start = names + name
            indices[cubin[start:cubin.index(b"\0", start)].decode()] = index
    return indices


_SHT_SYMTAB = 2


def opcodes(sass_text: str, full: bool = False) -> collections.Counter:
    """How often each mnemonic occurs in ``sass_text``: by its base ("LDSM" for
    "LDSM.16.MT88.4"), or with ``full`` by the whole mnemonic with its suffixes.
    Predicates ("@P0", "@!PT") are not part of it."""
    counter = collections.Counter()
    for match in _INSTRUCTION.finditer(sass_text):
        mnemonic = match.group(1)
        counter[mnemonic if full else mnemonic.split(".", 1)[0]] += 1
    return counter


def local_memory_between(sass_text: str, opcode: str) -> int:
    """How many local-memory instructions (LDL, STL) lie between the first and the last
    ``opcode`` of ``sass_text`` in program order (say "HMMA": inside a key loop whose mma
    only it holds)."""
    bases = [match.group(1).split(".", 1)[0] for match in _INSTRUCTION.finditer(sass_text)]
    where = [index for index, base in enumerate(bases) if base == opcode]
    return sum(base in ("LDL", "STL") for base in bases[where[0]:where[-1]]) if where else 0


def spill_evidence(usage: Usage, counter: collections.Counter) -> list[str]:
    """What says a function keeps data in local memory: a stack frame, local memory, or
    LDL/STL instructions (each one a round trip to L1/L2 that registers would avoid)."""
    problems = []
    if usage.stack:
        problems.append(f"{usage.stack} bytes of stack")
    if usage.local:
        problems.append(f"{usage.local} bytes of local memory")
    problems += [f"{counter[opcode]} {opcode}" for opcode in SPILL_OPCODES if counter[opcode]]
    return problems


def check_fast_kernel(usage: Usage, opcode_counter: collections.Counter, stack_allowance: int = 0) -> list[str]:
    """Every reason a tensor-core kernel is not built the fast way, in words; empty when
    it has no spill (or, with ``stack_allowance``, keeps at most that many bytes of stack
    and no other local memory: a measured trade, see
    :func:`npattn.gpu.sources.stack_allowance`) and its SASS has each of
    :data:`FAST_KERNEL_OPCODES`."""
    if stack_allowance and not usage.local and usage.stack <= stack_allowance:
        problems = []  # the stack, and the LDL/STL that use it, within the allowance
    else:
        problems = spill_evidence(usage, opcode_counter)
        if stack_allowance and usage.stack:  # (the stack's entry comes first)
            problems[0] += f" (at most {stack_allowance} allowed)"
    problems += [why for opcode, why in FAST_KERNEL_OPCODES.items() if not opcode_counter[opcode]]
    return problems
