"""Memory a call cannot do without, checked before any work.

The fused kernels need memory in proportion to their inputs and outputs, but two
things grow with Sq x Sk: the weights (``return_weights=True``: one (B, H, Sq, Sk)
array) and the reference backend, which materializes its float64 scores,
probabilities and their products. A call whose lower bound on these exceeds the
memory this machine has free raises a MemoryError naming the size, the shape and the
option that needs it, instead of computing the whole forward first (a 200000 x 200000
weights request used to run 25 s before failing). The bound counts only arrays that
are certainly made, so a call that would fit is never refused.

Bounds under :data:`CHECKED_FROM_BYTES` are not checked: reading the free memory costs
more than a small call's kernels, and such a call is planned like any other
(:mod:`npattn.runtime.plans`), where one that is checked takes the full path every time.
"""
from __future__ import annotations

import os

import numpy as np

from ..core.arrays import is_cupy

# Float64 (B, H, Sq, Sk) arrays the reference certainly holds at once in its forward: the
# scores, the exponentials and the probabilities (it makes more, briefly).
REFERENCE_SCORE_ARRAYS = 3

# Bounds of fewer bytes than this are not checked. Reading the free memory takes 17 us on
# the 2-core Zen 4 VM (/proc/meminfo), where a planned (1, 8, 16 x 16, 64) call with its
# weights takes 32-40 us in all, and a 16 MiB array is written in a few milliseconds: the
# check is for requests that would compute for seconds before failing. An allocation this
# small that cannot be met means the machine is out of memory whatever the call asks.
CHECKED_FROM_BYTES = 16 << 20


def checks_memory(problem, backend_name: str) -> bool:
    """Whether :func:`check_memory` reads the free memory for ``problem`` (its bound is at
    least :data:`CHECKED_FROM_BYTES`): such calls take the full path every time."""
    return sum(size for size, _ in _needs(problem, backend_name)) >= CHECKED_FROM_BYTES


def check_memory(problem, backend_name: str, because: str = "") -> None:
    """Raise MemoryError when ``problem``'s weights or the reference's score arrays cannot
    fit in the free memory of the device its arrays live on (unknown: no check; a bound
    under :data:`CHECKED_FROM_BYTES`: none either); ``because`` starts the message (why
    the reference runs, when the caller did not ask)."""
    needs = _needs(problem, backend_name)
    total = sum(size for size, _ in needs)
    if total < CHECKED_FROM_BYTES:
        return
    available = free_bytes(problem.q)
    if available is None or total <= available:
        return
    size, option = max(needs)
    raise MemoryError(f"{because}{option} needs {_readable(size)} for {_what(option, problem)}, and "
                      f"{_readable(available)} of memory is free here; ask for return_lse instead of the "
                      "weights, or pass fewer query rows per call")


_WEIGHTS, _REFERENCE = "return_weights=True", "backend='reference'"


def _needs(problem, backend_name: str) -> list:
    """``(bytes, option)`` of each array the call certainly makes that grows with
    Sq x Sk: the weights, the reference's score arrays."""
    scores = problem.batch * problem.heads * problem.q_len * problem.kv_len
    needs = []
    if problem.return_weights:
        needs.append((scores * np.dtype(problem.accumulate_dtype).itemsize, _WEIGHTS))
    if backend_name == "reference":
        needs.append((scores * 8 * REFERENCE_SCORE_ARRAYS, _REFERENCE))
    return needs


def _what(option: str, problem) -> str:
    """What the need of ``option`` (one of :func:`_needs`') is for, for the message."""
    if option == _WEIGHTS:
        return f"the weights (B, H, Sq, Sk) = {_shape(problem)} in {np.dtype(problem.accumulate_dtype)}"
    return (f"at least {REFERENCE_SCORE_ARRAYS} float64 (B, H, Sq, Sk) = {_shape(problem)} arrays "
            "(it materializes every score)")


def _readable(size: int) -> str:
    """``size`` bytes in the largest unit that keeps it at least 1 (KiB to TiB)."""
    for unit, power in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << power:
            return f"{size / (1 << power):.1f} {unit}"
    return f"{size} bytes"


def free_bytes(array) -> int | None:
    """Memory free for new arrays where ``array`` lives: the GPU's free memory plus CuPy's
    pool for a CuPy array; MemAvailable (Linux) for a NumPy one; None if unknown."""
    if is_cupy(array):
        import cupy

        free, _ = cupy.cuda.runtime.memGetInfo()
        return int(free + cupy.get_default_memory_pool().free_bytes())
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _shape(problem) -> tuple:
    return (problem.batch, problem.heads, problem.q_len, problem.kv_len)
