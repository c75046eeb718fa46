"""The tensor-core kernels' machine code, read without a GPU: NVRTC's cubins (conftest's
``machine_code`` fixture, shared with tests/test_gpu.py) through cuobjdump and nvdisasm
(:mod:`npattn.gpu.sass`). What makes a FlashAttention-style kernel fast shows in its
SASS before it ever runs: no register spills, and mma (HMMA) fed by ldmatrix (LDSM)
from tiles that cp.async (LDGSTS) copied into shared memory. The checks are shown to
fail, too: on a kernel that spills, on a SIMT kernel, and on canned tool output.
"""
from __future__ import annotations

import collections
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from npattn.gpu import nvrtc, sass, sources
from npattn.gpu.options import Option

from conftest import (NVIDIA_WHEEL_PLATFORM, SIMT_KERNEL, checked_names, combine_kernels, machine_code_names,
                      nvrtc_or_skip, read_on)

# the split-KV combine of the tensor-core forward's decode steps (timed on an H200): its
# chunks of 8 splits' rows live in registers, 64 values a lane at once
COMBINE_KERNELS = combine_kernels()

# two kernels the checks must tell apart: one spills (a per-thread array indexed by a loaded
# value cannot live in registers), one is built the fast way (cp.async, ldmatrix, mma)
SMALL_KERNELS = r'''
template <int N>
__global__ void spilling_kernel(float* out, const int* index) {
    float scratch[N];
    for (int i = 0; i < N; ++i) scratch[i] = out[i] * i;
    out[threadIdx.x] = scratch[index[threadIdx.x] % N];
}

// one warp: a 16x16 half tile into shared memory with cp.async, ldmatrix, one mma
__global__ void tensor_core_kernel(const unsigned short* in, float* out) {
    __shared__ __align__(128) unsigned short tile[16 * 16];
    unsigned lane = threadIdx.x % 32;
    unsigned to = (unsigned)__cvta_generic_to_shared(tile + lane * 8);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(to), "l"(in + lane * 8));
    asm volatile("cp.async.wait_all;\n" ::);
    __syncwarp();
    unsigned row = (unsigned)__cvta_generic_to_shared(tile + (lane % 16) * 16 + (lane / 16) * 8);
    unsigned a0, a1, a2, a3;
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(a0), "=r"(a1), "=r"(a2), "=r"(a3) : "r"(row));
    float c0 = 0.f, c1 = 0.f, c2 = 0.f, c3 = 0.f;
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(a0), "r"(a2));
    reinterpret_cast<float4*>(out)[lane] = make_float4(c0, c1, c2, c3);
}
'''
SMALL_NAMES = ("spilling_kernel<256>", "tensor_core_kernel")


def tools_or_skip():
    """Skip where the wheels do not exist; fail where the test extra should have
    installed them."""
    nvrtc_or_skip()
    missing = [tool for tool in ("cuobjdump", "nvdisasm") if sass.tool_path(tool) is None]
    if missing:
        if NVIDIA_WHEEL_PLATFORM:
            pytest.fail(f"{' and '.join(missing)} missing: the test extra installs "
                        "nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm")
        pytest.skip(f"no {' or '.join(missing)} wheel for this platform")


def read(cubin: bytes, lowered: dict[str, str],
         code: dict[str, str] | None = None) -> dict[str, tuple[sass.Usage, collections.Counter]]:
    """Each named kernel's resources and opcode counts (from ``code``, their SASS by
    symbol, where the caller disassembled them already)."""
    usage = sass.resource_usage(cubin)
    code = sass.disassemble(cubin, lowered.values()) if code is None else code
    return {name: (usage[symbol], sass.opcodes(code[symbol])) for name, symbol in lowered.items()}


@pytest.fixture(scope="module")
def kernels(request):
    """``{architecture: {name: (Usage, opcode Counter)}}`` for the checked kernels and
    :data:`SIMT_KERNEL`; the architectures are disassembled side by side."""
    tools_or_skip()  # before the minutes of compiling, so a missing tool fails at once
    machine_code = request.getfixturevalue("machine_code")

    def inspect(architecture):
        cubin, lowered = machine_code[architecture]
        return read(cubin, {name: lowered[name] for name in machine_code_names(architecture)})

    with ThreadPoolExecutor(len(machine_code)) as pool:
        return dict(zip(machine_code, pool.map(inspect, machine_code)))


# ---- the kernels ----------------------------------------------------------------------------

def test_the_tensor_core_kernels_do_not_spill_and_use_ldmatrix_cp_async_and_mma(kernels):
    """Every problem of every checked kernel on every architecture CI reads it on
    (conftest.read_on), in one message."""
    for architecture in kernels:
        assert checked_names(architecture), f"no kernel is named for the machine-code check on {architecture}"
    failures = []
    for architecture, inspected in kernels.items():
        for name in checked_names(architecture):
            usage, counter = inspected[name]
            problems = sass.check_fast_kernel(usage, counter, sources.stack_allowance(name))
            if problems:
                failures.append(f"{architecture} {name} ({usage.registers} registers): {'; '.join(problems)}")
    assert not failures, f"{len(failures)} kernels are not built the fast way:\n" + "\n".join(failures)


def test_the_decode_combine_does_not_spill(kernels):
    failures = [f"{architecture} {name}: {'; '.join(sass.spill_evidence(*inspected[name]))}"
                for architecture, inspected in kernels.items() for name in COMBINE_KERNELS if read_on(architecture, name)
                if sass.spill_evidence(*inspected[name])]
    assert not failures, "\n".join(failures)


def test_the_quantized_decode_tiles_keep_their_codes_in_registers_without_spilling(machine_code):
    """The decode tiles of REGISTER_CODES, on the architecture CI compiles every
    instantiation for (sm_90, the Hopper GPUs they were timed on): no spill beyond
    sources.REGISTER_CODES_STACK_BYTES of stack (sources.MERGING_STACK_BYTES where they merge their
    own split keys, Option.MERGES, with no local memory between the key loop's mma, and an
    atomic count between fences), mma (HMMA), the codes' stages copied by
    cp.async (LDGSTS), and for float16 q int8 codes turned into halves by half2
    subtractions (HADD2) rather than conversion instructions; the transposed ones
    (TRANSPOSED) also transpose P's blocks by movmatrix (MOVM), with half the mma of the
    untransposed tile."""
    tools_or_skip()
    assert sources.REGISTER_CODE_KERNELS, "no REGISTER_CODES kernel is named"
    architecture = sources.EVERY_INSTANTIATION_ARCHITECTURE
    cubin, lowered = machine_code[architecture]
    code = sass.disassemble(cubin, [lowered[name] for name in sources.REGISTER_CODE_KERNELS])
    inspected = read(cubin, {name: lowered[name] for name in sources.REGISTER_CODE_KERNELS}, code)
    failures = []
    for name in sources.REGISTER_CODE_KERNELS:
        usage, counter = inspected[name]
        options = int(name.split(", ")[-1][:-2])
        allowed = sources.MERGING_STACK_BYTES if options & Option.MERGES else sources.REGISTER_CODES_STACK_BYTES
        within = not usage.local and usage.stack <= allowed
        problems = [] if within else sass.spill_evidence(usage, counter)
        wanted = ("HMMA", "LDGSTS", "HADD2") if name.startswith("forward_tc_kernel<half_bits") else ("HMMA", "LDGSTS")
        if options & Option.MERGES:  # the last block's count (an atomic between fences), and a loop kept clean
            wanted += ("ATOMG", "MEMBAR")
            inside = sass.local_memory_between(code[lowered[name]], "HMMA")
            if inside:
                problems.append(f"{inside} local-memory instructions inside the key loop (between its mma)")
        if options & Option.TRANSPOSED:
            dtype_name = "float16" if name.startswith("forward_tc_kernel<half_bits") else "bfloat16"
            bound = int(name.split(", ")[2])
            untransposed = sources.register_codes_name(dtype_name, bound, paged=bool(options & Option.PAGED))
            wanted += ("MOVM",)
            # (the key loop's static mma, per key of its tile: half)
            per_key = [inspected[n][1]["HMMA"] / int(n.split(", ")[5]) for n in (name, untransposed)]
            if 2 * per_key[0] != per_key[1]:
                problems.append(f"{per_key[0]} mma a key against the untransposed tile's {per_key[1]}")
        problems += [f"no {opcode}" for opcode in wanted if not counter[opcode]]
        if problems:
            failures.append(f"{architecture} {name}: {'; '.join(problems)}")
    assert not failures, "\n".join(failures)


def test_the_merging_decode_tiles_keep_their_key_loops_in_registers(machine_code):
    """forward_tc.cu's decode tiles that merge their own split keys (Option.MERGES,
    sources.MERGING_DECODE_KERNELS), on sm_90: no stack or local memory (at least 1 block an
    SM lets ptxas keep the merge's code out of the loop's registers: under open launch
    bounds the 128-wide tile took 168 registers and spilled inside its key loop), mma, and
    the last block's count (an atomic between fences)."""
    tools_or_skip()
    cubin, lowered = machine_code[sources.EVERY_INSTANTIATION_ARCHITECTURE]
    inspected = read(cubin, {name: lowered[name] for name in sources.MERGING_DECODE_KERNELS})
    failures = []
    for name in sources.MERGING_DECODE_KERNELS:
        usage, counter = inspected[name]
        problems = sass.spill_evidence(usage, counter)
        problems += [f"no {opcode}" for opcode in ("HMMA", "ATOMG", "MEMBAR") if not counter[opcode]]
        if problems:
            failures.append(f"{name}: {'; '.join(problems)}")
    assert sources.MERGING_DECODE_KERNELS and not failures, "\n".join(failures)


def test_e4m3_codes_take_the_hardware_conversion_from_sm_89(machine_code, monkeypatch):
    """sources.architecture_defines: CI's sm_90 build of the e4m3 decode tile converts its
    codes with sm_89's F2FP...E4M3, one per two codes; its sm_80 build has none (no such
    instruction), nor does an sm_90 build under NPATTN_SOFTWARE_E4M3 (the float32 route,
    kept to time the two)."""
    tools_or_skip()
    name = sources.register_codes_name("float16", 128)

    def conversions(cubin, symbol):
        counter = sass.opcodes(sass.disassemble(cubin, [symbol])[symbol], full=True)
        return sum(n for opcode, n in counter.items() if "E4M3" in opcode)

    counts = {architecture: conversions(cubin, lowered[name]) for architecture, (cubin, lowered) in machine_code.items()
              if name in lowered}
    assert counts == {"sm_90": 128, **({"sm_80": 0} if "sm_80" in counts else {})}, counts
    monkeypatch.setenv("NPATTN_GPU_DEFINES", "NPATTN_SOFTWARE_E4M3")
    switched, switched_lowered = nvrtc.compile_cubin("sm_90", [name])
    assert conversions(switched, switched_lowered[name]) == 0


def test_the_prefetch_switch_asks_for_the_parameters_lines(machine_code, monkeypatch):
    """NPATTN_PREFETCH_PARAMETERS (a switch for a lent GPU to time, through
    NPATTN_GPU_DEFINES): the decode tiles ask for the lines of ints and reals into L1
    (CCTL.E.PF1, one instruction each) and the combine for those of ints; the default
    build asks for none."""
    tools_or_skip()
    names = [sources.register_codes_name("float16", 128, transposed=True), sources.kernel_name("combine", "float16", 128)]

    def prefetches(cubin, lowered):
        texts = sass.disassemble(cubin, [lowered[name] for name in names])
        return [sass.opcodes(texts[lowered[name]], full=True)["CCTL.E.PF1"] for name in names]

    default, lowered = machine_code["sm_90"]
    monkeypatch.setenv("NPATTN_GPU_DEFINES", "NPATTN_PREFETCH_PARAMETERS")
    switched, switched_lowered = nvrtc.compile_cubin("sm_90", names)
    assert (prefetches(default, lowered), prefetches(switched, switched_lowered)) == ([0, 0], [2, 1])


def test_the_early_copies_switch_issues_the_first_copies_before_q(machine_code, monkeypatch):
    """NPATTN_EARLY_COPIES (a switch for a lent GPU to time): the transposed decode tile
    issues its first tiles' copies (LDGSTS) before Q's 16-byte loads; by default Q comes
    first."""
    tools_or_skip()
    name = sources.register_codes_name("float16", 128, transposed=True)

    def copies_first(cubin, symbol):
        lines = [line for line in sass.disassemble(cubin, [symbol])[symbol].splitlines() if ";" in line]
        first = {opcode: next(i for i, line in enumerate(lines) if opcode in line) for opcode in ("LDGSTS", "LDG.E.128")}
        return first["LDGSTS"] < first["LDG.E.128"]

    default, lowered = machine_code["sm_90"]
    monkeypatch.setenv("NPATTN_GPU_DEFINES", "NPATTN_EARLY_COPIES")
    switched, switched_lowered = nvrtc.compile_cubin("sm_90", [name])
    assert (copies_first(default, lowered[name]), copies_first(switched, switched_lowered[name])) == (False, True)


def test_the_parameter_scalars_switch_reads_the_ints_from_the_constant_bank(machine_code, monkeypatch):
    """NPATTN_PARAMETER_SCALARS (a switch for a lent GPU to time): the tensor-core
    forward and the combine read their ints and reals from a by-value kernel parameter,
    so their 8-byte global loads (LDG.E.64: ints, spans, pages) fall to a third or less in
    the decode tiles, transposed and not, and the combine (sm_90: 52 -> 13, 41 -> 10 and
    196 -> 34), the reads going to the constant bank (ULDC/LDC)."""
    tools_or_skip()
    names = [sources.register_codes_name("float16", 128, transposed=True),
             sources.kernel_name("forward_tc", "float16", 128, tile=sources.forward_tc_config(4, 128, Option.BAND),
                                 options=Option.BAND),
             sources.kernel_name("combine", "float16", 128)]

    def loads(cubin, lowered):
        texts = sass.disassemble(cubin, [lowered[name] for name in names])
        return [sass.opcodes(texts[lowered[name]], full=True)["LDG.E.64"] for name in names]

    default, lowered = machine_code["sm_90"]
    monkeypatch.setenv("NPATTN_GPU_DEFINES", "NPATTN_PARAMETER_SCALARS")
    switched = loads(*nvrtc.compile_cubin("sm_90", names))
    for before, after in zip(loads(default, lowered), switched):
        assert 3 * after <= before, (before, after)


def test_a_simt_kernel_fails_the_fast_kernel_check(kernels):
    for architecture, inspected in kernels.items():
        usage, counter = inspected[SIMT_KERNEL]
        assert counter["FFMA"], architecture
        assert not counter["LDSM"] and not counter["HMMA"], architecture
        problems = sass.check_fast_kernel(usage, counter)
        for opcode in sass.FAST_KERNEL_OPCODES:
            assert sass.FAST_KERNEL_OPCODES[opcode] in problems, (architecture, opcode)


@pytest.fixture(scope="module")
def small_kernels():
    """``{architecture: {name: (Usage, Counter)}}`` of :data:`SMALL_KERNELS`: a second each."""
    tools_or_skip()
    with ThreadPoolExecutor(len(sources.ARCHITECTURES)) as pool:
        compiled = pool.map(lambda architecture: nvrtc.compile_cubin(architecture, SMALL_NAMES, SMALL_KERNELS),
                            sources.ARCHITECTURES)
        return {architecture: read(*result) for architecture, result in zip(sources.ARCHITECTURES, compiled)}


@pytest.mark.parametrize("architecture", sources.ARCHITECTURES)
def test_a_spilling_kernel_is_caught(small_kernels, architecture):
    usage, counter = small_kernels[architecture]["spilling_kernel<256>"]
    assert usage.stack >= 256 * 4
    assert counter["STL"] and counter["LDL"]
    evidence = sass.spill_evidence(usage, counter)
    assert f"{usage.stack} bytes of stack" in evidence and f"{counter['STL']} STL" in evidence
    assert set(evidence) <= set(sass.check_fast_kernel(usage, counter))
    # an allowance smaller than the spill still fails, naming the allowance
    assert f"at most {usage.stack - 4} allowed" in " ".join(
        sass.check_fast_kernel(usage, counter, stack_allowance=usage.stack - 4))
    # and one as large as the spill lets it pass (the missing tensor-core opcodes remain)
    assert not any("stack" in problem for problem in
                   sass.check_fast_kernel(usage, counter, stack_allowance=usage.stack))


@pytest.mark.parametrize("architecture", sources.ARCHITECTURES)
def test_a_kernel_built_the_fast_way_passes(small_kernels, architecture):
    usage, counter = small_kernels[architecture]["tensor_core_kernel"]
    assert sass.check_fast_kernel(usage, counter) == []
    assert usage.shared >= 16 * 16 * 2


def test_a_selection_disassembles_as_the_whole_cubin_does():
    tools_or_skip()
    cubin, lowered = nvrtc.compile_cubin("sm_80", SMALL_NAMES, SMALL_KERNELS)
    whole = sass.disassemble(cubin)
    for symbol in lowered.values():
        assert sass.disassemble(cubin, [symbol]).keys() == {symbol}
        assert sass.opcodes(sass.disassemble(cubin, [symbol])[symbol]) == sass.opcodes(whole[symbol])
    together = sass.disassemble(cubin, lowered.values())  # (one nvdisasm run for all of them)
    assert together.keys() == set(lowered.values())
    assert all(sass.opcodes(together[symbol]) == sass.opcodes(whole[symbol]) for symbol in lowered.values())
    with pytest.raises(KeyError, match="no function absent"):
        sass.disassemble(cubin, ["absent"])


def comparable(sass_text: str) -> list[str]:
    """One function's instructions as two compiles of it compare: without their
    addresses, with branch labels numbered within the function and the internal helpers
    it calls unnumbered (nvdisasm numbers both across the cubin, whose order of
    functions differs between NVRTC's and ptxas's cubins)."""
    address = re.compile(r"/\*[0-9a-f]{4,}\*/")
    labels: dict[str, str] = {}
    instructions = []
    for line in sass_text.splitlines():
        if address.search(line):
            line = re.sub(r"__internal_\d+_", "__internal_", address.sub("", line)).strip()
            instructions.append(re.sub(r"\.L_x_\d+", lambda label: labels.setdefault(label[0], f".L{len(labels)}"),
                                       line))
    return instructions


def differing_symbols(first, second) -> list[str]:
    """The symbols whose resources or SASS differ between two ``(cubin, lowered)``
    compiles of the same names (each symbol must be in both)."""
    (first_cubin, first_lowered), (second_cubin, second_lowered) = first, second
    assert first_lowered == second_lowered
    symbols = list(first_lowered.values())
    usages = sass.resource_usage(first_cubin), sass.resource_usage(second_cubin)
    codes = sass.disassemble(first_cubin, symbols), sass.disassemble(second_cubin, symbols)
    return [symbol for symbol in symbols if usages[0][symbol] != usages[1][symbol]
            or comparable(codes[0][symbol]) != comparable(codes[1][symbol])]


def ptxas_or_skip():
    if nvrtc.ptxas_path() is None:
        if NVIDIA_WHEEL_PLATFORM:
            pytest.fail(f"no ptxas of NVRTC's release {nvrtc.version()}: the test extra installs "
                        "nvidia-cuda-nvcc-cu12, of the release nvidia-cuda-nvrtc-cu12 brings")
        pytest.skip("no ptxas wheel for this platform")


def test_ptxas_from_nvvms_ptx_makes_nvrtcs_machine_code():
    """compile_cubins' route (NVVM once, ptxas for each architecture, the PTX retargeted)
    against NVRTC's own compile of each, on the kernels that spill and use cp.async,
    ldmatrix and mma."""
    tools_or_skip()
    ptxas_or_skip()
    together = nvrtc.compile_cubins({architecture: SMALL_NAMES for architecture in sources.ARCHITECTURES},
                                    SMALL_KERNELS)
    assert set(together) == set(sources.ARCHITECTURES)
    assert differing_symbols(*together.values()) != []  # (the comparison tells architectures apart)
    for architecture in sources.ARCHITECTURES:
        alone = nvrtc.compile_cubin(architecture, SMALL_NAMES, SMALL_KERNELS)
        assert differing_symbols(together[architecture], alone) == [], architecture
        assert _headerflags(together[architecture][0]) == _headerflags(alone[0])
        assert _elf_flags(together[architecture][0]) == _elf_flags(alone[0])
        assert f"EF_CUDA_{architecture.upper().replace('_', '')} " in _headerflags(alone[0])


def _headerflags(cubin: bytes) -> str:
    """nvdisasm's header flags line of ``cubin`` (it names the architecture; it prints
    the whole cubin's code too: small cubins only)."""
    return next(line for line in sass._run("nvdisasm", ["--print-code"], cubin).splitlines() if "headerflags" in line)


def _elf_flags(cubin: bytes) -> bytes:
    """The ELF header's e_flags, where a cubin keeps its architecture (what nvdisasm's
    header flags line shows)."""
    return cubin[0x30:0x34]


def test_the_checked_machine_code_is_nvrtcs(machine_code):
    """The machine code the checks read (conftest's compile, with compile_cubins) is what
    NVRTC makes for a GPU of each architecture, on the decode combine and the SIMT kernel."""
    tools_or_skip()
    names = (COMBINE_KERNELS[0], SIMT_KERNEL)
    with ThreadPoolExecutor(len(sources.ARCHITECTURES)) as pool:
        alone = dict(zip(sources.ARCHITECTURES, pool.map(lambda architecture: nvrtc.compile_cubin(architecture, names),
                                                         sources.ARCHITECTURES)))
    for architecture, (cubin, lowered) in machine_code.items():
        assert differing_symbols((cubin, {name: lowered[name] for name in names}), alone[architecture]) == []
        assert _elf_flags(cubin) == _elf_flags(alone[architecture][0])


def test_a_ptx_ptxas_refuses_fails_naming_the_architecture(monkeypatch):
    tools_or_skip()
    ptxas_or_skip()
    monkeypatch.setattr(nvrtc, "retargeted", lambda ptx, architecture: ptx.replace(b".entry", b".entry_broken"))
    with pytest.raises(nvrtc.CompileError, match="ptxas failed for sm_80"):
        nvrtc.compile_cubins({architecture: SMALL_NAMES for architecture in sources.ARCHITECTURES}, SMALL_KERNELS)


def test_retargeted_names_the_architecture_in_the_target_only():
    ptx = b"//\n.version 8.8\n.target sm_80\n.address_size 64\n// .target sm_80 in a comment\n"
    assert nvrtc.retargeted(ptx, "sm_90") == ptx.replace(b".target sm_80\n", b".target sm_90\n", 1)
    with pytest.raises(nvrtc.CompileError, match="no .target"):
        nvrtc.retargeted(b".version 8.8\n", "sm_90")


# ---- the parsers, on canned tool output (no tool needed) ------------------------------------

NVDISASM = """\
\t.headerflags\t@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"

//--------------------- .text._Z3onePf     --------------------------
\t.section\t.text._Z3onePf,"ax",@progbits
_Z3onePf:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/              @!P0 LDSM.16.MT88.4 R4, [R2] ;
        /*0020*/               @P1 LDSM.16.M88.4 R8, [R2+0x200] ;
        /*0030*/                   HMMA.16816.F32.BF16 R12, R4, R8, R12 ;
.L_x_0:
        /*0040*/               @PT STL.128 [R1], R12 ;
        /*0050*/                   EXIT ;

//--------------------- .text.two         --------------------------
\t.section\t.text.two,"ax",@progbits
two:
        /*0000*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR4][R4.64] ;
        /*0010*/                   EXIT ;
"""
CUOBJDUMP_SASS = """\
\tcode for sm_80
\t\tFunction : two
\t.headerflags\t@"EF_CUDA_SM80 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM80)"
        /*0000*/                   LDL.64 R2, [R1+0x8] ;                  /* 0x0000080001027983 */
                                                                          /* 0x000ea20000100a00 */
        /*0010*/                   EXIT ;                                 /* 0x000000000000794d */
                                                                          /* 0x000fea0003800000 */
"""
RESOURCE_USAGE = """\

Resource usage:
 Common:
  GLOBAL:0
 Function _Z3onePf:
  REG:250 STACK:512 SHARED:1024 LOCAL:0 CONSTANT[0]:600 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function two:
  REG:16 STACK:0 SHARED:0 LOCAL:8 CONSTANT[0]:536 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


def test_opcodes_are_counted_by_base_mnemonic_past_predicates():
    functions = sass.split_functions(NVDISASM)
    assert set(functions) == {"_Z3onePf", "two"}
    one = sass.opcodes(functions["_Z3onePf"])
    assert one == collections.Counter({"LDC": 1, "LDSM": 2, "HMMA": 1, "STL": 1, "EXIT": 1})
    full = sass.opcodes(functions["_Z3onePf"], full=True)
    assert full["LDSM.16.MT88.4"] == 1 and full["LDSM.16.M88.4"] == 1 and full["HMMA.16816.F32.BF16"] == 1
    assert sass.opcodes(functions["two"]) == collections.Counter({"LDGSTS": 1, "EXIT": 1})


def test_local_memory_is_counted_between_the_first_and_last_of_an_opcode():
    loop = "\n".join(f"        /*{16 * i:04x}*/                   {line} ;" for i, line in enumerate(
        ["STL [R1], R2", "HMMA.16816.F32 R4, R8, R12, R4", "LDL R2, [R1]", "@P0 STL.64 [R1+0x8], R6",
         "HMMA.16816.F32 R4, R8, R12, R4", "LDL R3, [R1]", "EXIT"]))
    assert sass.local_memory_between(loop, "HMMA") == 2  # not the store before the loop or the load after
    assert sass.local_memory_between(loop, "MOVM") == 0


def test_cuobjdump_sass_splits_like_nvdisasm():
    functions = sass.split_functions(CUOBJDUMP_SASS)
    # the encodings in comments beside each instruction are not instructions
    assert sass.opcodes(functions["two"]) == collections.Counter({"LDL": 1, "EXIT": 1})


def test_resource_usage_is_read_per_function():
    usage = sass.parse_resource_usage(RESOURCE_USAGE)
    assert usage == {"_Z3onePf": sass.Usage(registers=250, stack=512, local=0, shared=1024),
                     "two": sass.Usage(registers=16, stack=0, local=8, shared=0)}


def test_every_problem_is_named():
    one = sass.opcodes(sass.split_functions(NVDISASM)["_Z3onePf"])
    problems = sass.check_fast_kernel(sass.Usage(registers=250, stack=512, local=8, shared=0), one)
    assert problems == ["512 bytes of stack", "8 bytes of local memory", "1 STL",
                        sass.FAST_KERNEL_OPCODES["LDGSTS"]]
    clean = collections.Counter({"HMMA": 4, "LDSM": 2, "LDGSTS": 1})
    assert sass.check_fast_kernel(sass.Usage(registers=128, stack=0, local=0, shared=0), clean) == []
