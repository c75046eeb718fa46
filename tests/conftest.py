"""Hypothesis profiles, the backend parametrization every equivalence test shares, and the
kernels' machine code (the ``machine_code`` fixture) that the GPU tests share.

Profiles: "ci" (the default; fast, derandomized so CI is reproducible) and "dev"
(many more examples): ``pytest --hypothesis-profile=dev`` or
``NPATTN_HYPOTHESIS_PROFILE=dev pytest``.
"""
import functools
import os
import platform
import subprocess
import sys
import threading

import bytecode_prefix

bytecode_prefix.keep_for_the_run()  # (before npattn, Numba and SciPy are imported: see tests/bytecode_prefix.py)

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

import npattn  # noqa: E402
import offload  # noqa: E402

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# ci draws 50 examples a property, the same ones every run: the property tests' examples
# took about half the suite's test time on the 2-core VMs (160 s of their main threads'
# CPU at 100 a property, against a 10-minute budget for the whole command); dev draws
# 1000, new ones every run, where a change is explored
settings.register_profile("ci", max_examples=50, derandomize=True, print_blob=True, **_COMMON)
settings.register_profile("dev", max_examples=1000, **_COMMON)
settings.load_profile(os.environ.get("NPATTN_HYPOTHESIS_PROFILE", "ci"))

_STATUS = npattn.backends()

# the fuzz's tables of classes (tests/test_serving_fuzz.py), printed at the end of the run
FUZZ_TABLES = pytest.StashKey[list]()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    tables = config.stash.get(FUZZ_TABLES, [])
    if tables:
        terminalreporter.section("fuzz of the serving calls, the adapters and the ring")
        for table in tables:
            terminalreporter.write_line(table)


@pytest.fixture(autouse=True)
def kernels_answer_finite_inputs(request, monkeypatch):
    """A backend result that comes back NaN or inf is answered by the float64 reference
    (npattn.runtime.nonfinite): right for non-finite inputs, but on finite ones it would
    let a kernel that writes NaN (an unfilled tile, a stale stage) pass every comparison
    with the reference. Here the reference, as the fallback, fails the test when asked to
    answer for finite inputs, unless the test is marked ``reference_may_answer`` (scores
    that overflow float32 on purpose)."""
    if request.node.get_closest_marker("reference_may_answer"):
        return
    from npattn import reference
    from npattn.core.arrays import all_finite
    from npattn.runtime import nonfinite

    def finite(problem, *more):
        return all(all_finite(getattr(problem, name))
                   for name in ("q", "k", "v", "bias", "sink_logits", "k_scale", "v_scale")) and all(
            all_finite(array) for array in more)

    class Fallback:  # npattn.reference, as npattn.runtime.nonfinite calls it
        NAME = reference.NAME

        @staticmethod
        def forward(problem):
            if finite(problem):
                pytest.fail("a backend's forward came back non-finite on finite inputs: the reference answered for it")
            return reference.forward(problem)

        @staticmethod
        def backward(problem, saved, dout):
            if finite(problem, dout):
                pytest.fail("a backend's backward came back non-finite on finite inputs and dout: the reference "
                            "answered for it")
            return reference.backward(problem, saved, dout)

    monkeypatch.setattr(nonfinite, "reference", Fallback)


@pytest.fixture(autouse=True)
def fresh_plans():
    """Every test starts with no plans kept (npattn/runtime/plans.py): a test that changes a
    module's constants or functions gets calls planned under them, not an earlier test's."""
    npattn.runtime.plans.clear()


def count_direct_entries(monkeypatch) -> list:
    """A list that grows by one at each call of a CPU kernel's typed entry point
    (npattn.cpu.threads.direct_entry, as the driver looks it up) typed from now on."""
    from npattn.cpu import driver

    calls = []
    typed = driver.direct_entry

    def counted(kernel, arguments):
        entry = typed(kernel, arguments)

        def call(*values):
            calls.append(1)
            return entry(*values)
        return call

    monkeypatch.setattr(driver, "direct_entry", counted)
    return calls


def backend_params(names=None):
    """pytest params for backends, each skipped with its reason where it cannot run here.
    A new backend is held to every parametrized property by being registered in npattn."""
    names = list(_STATUS) if names is None else names
    return [pytest.param(name, id=name,
                         marks=pytest.mark.skipif(not _STATUS[name], reason=f"{name}: {_STATUS[name].reason}"))
            for name in names]


# Backends that take NumPy arrays; the gpu backend gets its own CuPy-converting tests.
NUMPY_BACKENDS = backend_params(["reference", "cpu"])
# Backends held against the reference (the reference itself is compared with the loop oracle).
KERNEL_BACKENDS = backend_params(["cpu"])


# ---- the kernels' machine code, compiled once per session -----------------------------------

# where the nvidia-cuda-nvrtc-cu12, -cuobjdump and -nvdisasm wheels exist (setup.cfg's test
# extra installs them there), the checks that need them must run, not skip
NVIDIA_WHEEL_PLATFORM = sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64")


def nvrtc_or_skip():
    """Skip where no NVRTC wheel exists; fail where the test extra should have installed it."""
    from npattn.gpu import nvrtc

    if nvrtc.nvrtc_library_path() is None:
        if NVIDIA_WHEEL_PLATFORM:
            pytest.fail("NVRTC is missing: the test extra installs nvidia-cuda-nvrtc-cu12")
        pytest.skip("no NVRTC wheel for this platform")


# Kernels whose machine code tests/test_gpu_machine_code.py reads besides
# sources.MACHINE_CODE_CHECKED: a SIMT kernel (one multiply-add per product term, no tensor
# cores), which the fast-kernel check must fail, and the split-KV combine of the
# tensor-core forward's decode steps (its chunks of 8 splits' rows live in registers)
SIMT_KERNEL = "dkdv_kernel<float, float, 64>"


def combine_kernels() -> tuple[str, ...]:
    """The split-KV combine's instantiations for each tensor-core storage dtype, at the
    decode steps' common head-dim bound (128) and the widest (256: the most registers)."""
    from npattn.gpu import sources

    return tuple(sources.kernel_name("combine", dtype, bound) for dtype in sources.TENSOR_CORE_STORAGE
                 for bound in (128, sources.MAX_HEAD_DIM))


def checked_names(architecture: str | None = None) -> tuple[str, ...]:
    """``sources.MACHINE_CODE_CHECKED`` where sources names the kernels to hold to the
    fast-kernel check, else every tensor-core instantiation; for ``architecture``, those
    :func:`read_on` it."""
    from npattn.gpu import sources

    if hasattr(sources, "MACHINE_CODE_CHECKED"):
        names = tuple(sources.MACHINE_CODE_CHECKED)
    else:
        names = tuple(name for name in sources.name_expressions() if "_tc_kernel" in name)
    return tuple(name for name in names if read_on(architecture, name))


# The storage dtype whose tensor-core kernels CI reads on every architecture; the others'
# only on sources.EVERY_INSTANTIATION_ARCHITECTURE (sm_90). A bfloat16 instantiation is
# its float16 twin with another mma type and other conversions: at sm_80 (CUDA 12.9's
# ptxas, 2026-12-01) 25 of the 28 twins of machine_code_names() took the same registers
# and stack, the other three 1 to 4 registers apart, none spilling. sm_80's NVVM and ptxas
# took 51.8 s of a core for the 57 kernels with them, 23.3 s for these 29 (the Zen 4 VM).
EVERY_ARCHITECTURE_STORAGE = "float16"


def read_on(architecture: str | None, name: str) -> bool:
    """Whether CI reads kernel ``name``'s machine code for ``architecture`` (None: for
    any): on sources.EVERY_INSTANTIATION_ARCHITECTURE every kernel; elsewhere those of
    :data:`EVERY_ARCHITECTURE_STORAGE` and those of no tensor-core storage dtype."""
    from npattn.gpu import sources

    if architecture is None or architecture == getattr(sources, "EVERY_INSTANTIATION_ARCHITECTURE", architecture):
        return True
    others = {sources.STORAGE[dtype][0] for dtype in sources.TENSOR_CORE_STORAGE if dtype != EVERY_ARCHITECTURE_STORAGE}
    return not any(name.partition("<")[2].startswith(f"{storage},") for storage in others)


def machine_code_names(architecture: str | None = None) -> tuple[str, ...]:
    """The kernels whose machine code the checks read (on ``architecture``; None: on
    any): the checked ones, the SIMT kernel and the combine."""
    return tuple(name for name in dict.fromkeys((*checked_names(), SIMT_KERNEL, *combine_kernels()))
                 if read_on(architecture, name))


def compiled_names(architecture: str) -> tuple[str, ...]:
    """What CI compiles to machine code for ``architecture``: the kernels whose machine
    code the checks read there, and for ``sources.EVERY_INSTANTIATION_ARCHITECTURE`` the
    decode tiles that keep their codes in registers and those that merge their own splits
    (read there only)."""
    from npattn.gpu import sources

    if architecture != getattr(sources, "EVERY_INSTANTIATION_ARCHITECTURE", architecture):
        return machine_code_names(architecture)
    return tuple(dict.fromkeys((*machine_code_names(architecture), *getattr(sources, "REGISTER_CODE_KERNELS", ()),
                                *getattr(sources, "MERGING_DECODE_KERNELS", ()))))


def ptx_names() -> tuple[str, ...]:
    """Every other instantiation: CI compiles them to PTX at NVRTC's fastest compile level
    for ``sources.EVERY_INSTANTIATION_ARCHITECTURE`` (nvrtc.compile_ptx, optimized=False),
    which finds any template or syntax error. The source has no code that depends on the
    architecture (tests/test_gpu.py holds it to that), so an instantiation that compiles
    for one compiles for every one; what differs is the machine code, which no test reads
    for these. Their machine code and NVVM's optimizer are what took the time: on the
    2-core Zen 3 VM (2026-11-29), 137 s of one core to a cubin and 49 s to optimized PTX
    under the suite's load; alone, 23.7 s optimized against 1.9 s at the fastest level
    (61 instantiations; compiling all of them for sm_80 too had taken 36 s more on the
    Zen 4 VM), a core's time while the tests wait for a free one."""
    from npattn.gpu import sources

    compiled = set(compiled_names(sources.EVERY_INSTANTIATION_ARCHITECTURE))
    return tuple(name for name in dict.fromkeys(sources.name_expressions()) if name not in compiled)


# ---- slow builds started at collection, on threads of their own ---------------------------
# The NVRTC compile of every kernel (minutes of a core), the g++ build of the GPU
# emulation and the forced-AVX2 child process (a minute, compiling its kernels) start as
# soon as the run is known to need them, and go on while the CPU tests run (those keep
# one core busy, mostly): the fixtures and tests that need them wait for the result.

_STARTED: dict = {}
# How much lower than the tests' the builds' and subprocesses' priority is (a nice value):
# the main process's tests are the run's longest path, so they take a core whenever they
# can; the builds take the other, and both when the tests wait
BACKGROUND_NICE = 10


def started(name, work, background=True):
    """The future of ``work()`` run on a thread of its own, started now unless already;
    at :data:`BACKGROUND_NICE` (and so are the threads and processes it starts) unless
    not ``background``."""
    if name not in _STARTED:
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(1, thread_name_prefix=f"npattn-tests-{name}")
        _STARTED[name] = pool.submit(_niced(work) if background else work)
        pool.shutdown(wait=False)
    return _STARTED[name]


# A test's subprocess runs beside the other tests: one thread each for npattn's kernels and
# for the BLAS, whose waiting threads spin (npattn's crew for NPATTN_SPIN_US, OpenBLAS's
# longer) and, on a busy machine, spin for much of the time they wait for a core. Beside
# the suite on the 2-core Zen 3 VM, examples/train_sort.py took 252 s of CPU (40 alone).
ONE_THREAD = {"NPATTN_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
              "MKL_NUM_THREADS": "1"}


def one_thread_environment(**more) -> dict:
    """``os.environ`` with :data:`ONE_THREAD` and ``more`` set: a test subprocess's."""
    return {**os.environ, **ONE_THREAD, **more}


def _niced(work):
    """``work`` run at :data:`BACKGROUND_NICE` on its thread (Linux sets a thread's nice
    value by its id; threads and processes it starts inherit it)."""
    def run():
        if hasattr(os, "setpriority") and hasattr(threading, "get_native_id"):
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
            except OSError:
                pass
        return work()
    return run


# The CPU kernels, float32 and float64, compiled into Numba's cache before the first test
# by ``python -m npattn compile`` (a process per dtype, side by side), where a run
# collects at least PRECOMPILE_ITEMS tests: compiled by the tests instead, one after the
# other in the main process, they took 390 of its 805 s on the 2-core Zen 3 VM (with the
# builds below on the other core). Smaller runs compile what they use, or load it.
PRECOMPILE_ITEMS = 200


def _precompile_cpu_kernels():
    return subprocess.run([sys.executable, "-m", "npattn", "compile", "--dtype", "float32", "--dtype", "float64"],
                          capture_output=True, text=True)


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_compiled():
    """Wait, before the first test, for the kernels' compile where the run started one."""
    future = _STARTED.get("cpu-kernels")
    if future is not None:
        future.exception()  # (a failed compile fails no test: the tests compile what they need)


# Test subprocesses that run a program whole (the CLI's demo, the examples: a minute in all,
# most of it their own kernels' compile) start at collection too, one after another on a
# thread of their own, once the builds above are done: by then the CPU tests have compiled
# the common kernels, which the children load from Numba's cache, and the second core is
# idle. Their tests, and the forced-AVX2 child's, run last (in their place the demo's had
# waited 51 s for it).
_IN_TURN: list = []


def started_in_turn(name, work):
    """:func:`started` for a subprocess: run after the builds started before it and after
    the subprocesses started in turn before it."""
    if name not in _STARTED:
        from concurrent.futures import ThreadPoolExecutor

        if not _IN_TURN:
            _IN_TURN.append(ThreadPoolExecutor(1, thread_name_prefix="npattn-tests-in-turn"))
        earlier = list(_STARTED.values())

        def after_the_builds():
            for future in earlier:
                future.exception()  # (waits; a failed build fails its own tests)
            return work()
        _STARTED[name] = _IN_TURN[0].submit(_niced(after_the_builds))
    return _STARTED[name]


def _compile_machine_code():
    """``({architecture: (cubin, {name expression: symbol})}, {name expression: symbol})``:
    the machine code of :func:`compiled_names` for each architecture (NVVM once, then
    ptxas for each, where the test wheels bring a ptxas of NVRTC's release:
    :func:`npattn.gpu.nvrtc.compile_cubins`), and the symbols of the PTX compile of
    :func:`ptx_names`, beside it (NVRTC runs without the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    from npattn.gpu import nvrtc, sources

    with ThreadPoolExecutor(1) as pool:
        ptx = pool.submit(nvrtc.compile_ptx, sources.EVERY_INSTANTIATION_ARCHITECTURE, ptx_names(), optimized=False)
        cubins = nvrtc.compile_cubins({architecture: compiled_names(architecture)
                                       for architecture in sources.ARCHITECTURES})
        return cubins, ptx.result()[1]


def _build_emulation(config):
    import gpu_emulation

    if getattr(config, "cache", None) is not None:  # pytest's cache: the build is kept between runs
        return gpu_emulation.build(config.cache.mkdir("npattn-gpu-emulation"))
    # (-p no:cacheprovider: a directory for this run only, removed at its end)
    import atexit
    import pathlib
    import shutil
    import tempfile

    directory = tempfile.mkdtemp(prefix="npattn-gpu-emulation-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return gpu_emulation.build(pathlib.Path(directory))


def emulation(config):
    """The host-built GPU emulation (:class:`gpu_emulation.Emulation`)."""
    return started("emulation", lambda: _build_emulation(config)).result()


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected what will not run
def pytest_collection_modifyitems(session, config, items):
    if config.option.collectonly:  # (nothing will run: start no build or subprocess)
        return
    full_run = len(items) >= PRECOMPILE_ITEMS
    if full_run and _STATUS["cpu"] and not offload.is_child():
        started("cpu-kernels", _precompile_cpu_kernels, background=False)
    fixtures = {name for item in items for name in getattr(item, "fixturenames", ())}
    if "machine_code" in fixtures:
        from npattn.gpu import nvrtc

        if nvrtc.nvrtc_library_path() is not None:  # at the tests' priority: its chain (NVVM, then
            # ptxas for sm_90) is the run's longest, and at the builds' it got a core only late
            # (the main process, done with its other tests, waited 106 s for it at the end)
            started("machine_code", _compile_machine_code, background=False)
    for item in items:  # the forced-AVX2 child: its own process, compiling kernels of its own
        if item.name == "test_forced_avx2_kernels_pass_the_vector_width_properties":
            started("avx2-child", item.module.forced_avx2_child)
    if "emulated_gpu" in fixtures and hasattr(config, "cache"):
        import gpu_emulation

        if gpu_emulation.compiler() is not None:
            started("emulation", lambda: _build_emulation(config))
    waiting = []  # the tests that wait on a subprocess or a compile: run last, when it is done
    for item in items:  # then the subprocesses that run a program whole, and NVRTC's tile check
        if item.name == "test_every_tile_the_harness_times_compiles_for_hopper":
            from npattn.gpu import nvrtc

            if nvrtc.nvrtc_library_path() is None:
                continue
            started_in_turn("hopper-tiles", item.module.hopper_tiles)
        elif item.name == "test_demo_command_line":
            started_in_turn("demo-child", item.module.demo_child)
        elif item.originalname == "test_example_succeeds":
            script = item.callspec.params["script"]
            started_in_turn(f"example-{script.name}", functools.partial(item.module.run_example, script))
        elif not (item.name == "test_forced_avx2_kernels_pass_the_vector_width_properties"
                  or _background_run(item)):
            continue
        waiting.append(item)
    # the files a child pytest runs beside this process (tests/offload.py): last of all
    offloaded = offload.start(config, offload.wanted(config, items) if full_run else [], started,
                              _STARTED.get("cpu-kernels"), one_thread_environment())
    later = set(waiting) | set(offloaded)
    # the tests that read the NVRTC compile's results (minutes of a core, started at
    # collection): after the main process's other tests, which had waited behind them for
    # it (test_gpu.py's first test: 182 s on the 2-core Zen 4 VM)
    compiled = [item for item in items
                if item not in later and {"machine_code", "ptx_symbols"} & set(getattr(item, "fixturenames", ()))]
    later |= set(compiled)
    items[:] = [item for item in items if item not in later] + compiled + waiting + offloaded


def pytest_configure(config):
    config.pluginmanager.register(offload.Plugin(config), "npattn-offload")


def started_beside(item, test_name: str, name: str, work, needs: str | None = None) -> bool:
    """For a module's ``background_run``: when ``item`` is the test ``test_name`` (and the
    module ``needs`` is installed), start ``work`` (:func:`started_in_turn`, as ``name``);
    whether it did."""
    import importlib.util

    if item.originalname != test_name or (needs is not None and importlib.util.find_spec(needs) is None):
        return False
    started_in_turn(name, work)
    return True


def _background_run(item) -> bool:
    """A test module may define ``background_run(item) -> bool``: start (with
    :func:`started_in_turn`) the subprocess that ``item`` reads, and say whether it did;
    such a test runs last, when its subprocess is done (tests/test_ring.py's MPI runs)."""
    background_run = getattr(getattr(item, "module", None), "background_run", None)
    return bool(background_run is not None and background_run(item))


@pytest.fixture(scope="session")
def machine_code():
    """``{architecture: (cubin, {name expression: symbol})}`` for every architecture CI
    targets and the names :func:`compiled_names` gives it. The compile takes minutes of
    the 2-core VMs, so tests/test_gpu.py (it compiles) and tests/test_gpu_machine_code.py
    (what it compiles to) share this one, started at collection (:func:`started`)."""
    nvrtc_or_skip()
    return started("machine_code", _compile_machine_code).result()[0]


@pytest.fixture(scope="session")
def ptx_symbols():
    """``{name expression: symbol}`` of the PTX compile of :func:`ptx_names` (with the
    machine code, in the same started compile)."""
    nvrtc_or_skip()
    return started("machine_code", _compile_machine_code).result()[1]
