"""Memory a call cannot do without, checked before any work.

The fused kernels need memory in proportion to their inputs and outputs, but two
things grow with Sq x Sk: the weights (``return_weights=True``: one (B, H, Sq, Sk)
array) and the reference backend, which materializes its float64 scores,
probabilities and their products. A call whose lower bound on these exceeds the
memory this machine has free raises a MemoryError naming the size, the shape and the
option that needs it, instead of computing the whole forward first (a 200000 x 200000
weights request used to run 25 s before failing). The bound counts only arrays that
are certainly made, so a call that would fit is never refused.
"""
from __future__ import annotations

import os

import numpy as np

from ..core.arrays import is_cupy

# Float64 (B, H, Sq, Sk) arrays the reference certainly holds at once in its forward: the
# scores, the exponentials and the probabilities (it makes more, briefly).
REFERENCE_SCORE_ARRAYS = 3


def check_memory(problem, backend_name: str, because: str = "") -> None:
    """Raise MemoryError when ``problem``'s weights or the reference's score arrays cannot
    fit in the free memory of the device its arrays live on (unknown: no check);
    ``because`` starts the message (why the reference runs, when the caller did not ask)."""
    scores = problem.batch * problem.heads * problem.q_len * problem.kv_len
    needs = []
    if problem.return_weights:
        itemsize = np.dtype(problem.accumulate_dtype).itemsize
        needs.append((scores * itemsize, "return_weights=True",
                      f"the weights (B, H, Sq, Sk) = {_shape(problem)} in {np.dtype(problem.accumulate_dtype)}"))
    if backend_name == "reference":
        needs.append((scores * 8 * REFERENCE_SCORE_ARRAYS, "backend='reference'",
                      f"at least {REFERENCE_SCORE_ARRAYS} float64 (B, H, Sq, Sk) = {_shape(problem)} arrays "
                      "(it materializes every score)"))
    if not needs:
        return
    available = free_bytes(problem.q)
    total = sum(size for size, _, _ in needs)
    if available is None or total <= available:
        return
    size, option, what = max(needs)
    raise MemoryError(f"{because}{option} needs {_readable(size)} for {what}, and {_readable(available)} of "
                      "memory is free here; ask for return_lse instead of the weights, or pass fewer query "
                      "rows per call")


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
