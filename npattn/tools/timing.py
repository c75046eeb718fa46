"""The timing harness every benchmark shares: ``python -m npattn bench``, ``bench --gpu``
and the asv suite (``asv_benchmarks/``) time npattn through the same passes.

- :func:`npattn_passes`: the forward and forward+backward of one call as callables,
  each ending with a device synchronize when the arrays are CuPy's (so wall time is
  kernel time), with dout made once outside them.
- :func:`interleaved_samples`: warm every run up once, then time rounds of all of them in
  turn (A B A B ...), so drifts of the machine's speed hit every contender alike.
- :func:`elapsed` and :func:`settled_elapsed`: one timed run, the latter after a pause
  that lets other libraries' spinning worker threads go idle first.

Imports NumPy and npattn's public functions only; CuPy when given CuPy arrays.
"""
from __future__ import annotations

import time

import numpy as np

from ..core.arrays import array_module, is_cupy
from ..adapters.dispatch import attention, attention_vjp


def synchronizer(array):
    """A callable that waits for the device work on ``array``'s device (a no-op for NumPy)."""
    if is_cupy(array):
        import cupy

        return cupy.cuda.get_current_stream().synchronize
    return lambda: None


def npattn_passes(q, k, v, **options):
    """``(forward, forward_backward)``: callables running ``attention`` and
    ``attention_vjp`` then its vjp on q, k, v with ``options``, each synchronizing at the
    end; the vjp's dout (ones of out's shape) is made here, outside the timed calls."""
    synchronize = synchronizer(q)
    xp = array_module(q)
    out_shape = (*q.shape[:-1], v.shape[-1])
    dout = xp.ones(out_shape, q.dtype)

    def forward():
        attention(q, k, v, **options)
        synchronize()

    def forward_backward():
        attention_vjp(q, k, v, **options)[1](dout)
        synchronize()
    return forward, forward_backward


def interleaved_samples(timed: dict, repeats: int, time_one) -> dict:
    """Each run of ``timed`` (name -> callable) once to warm up (compile, allocate), then
    ``repeats`` rounds of every run in turn, timed by ``time_one(run)``: name -> array of
    seconds, one per round."""
    for run in timed.values():
        run()
    samples = {name: [] for name in timed}
    for _ in range(repeats):
        for name, run in timed.items():
            samples[name].append(time_one(run))
    return {name: np.array(t) for name, t in samples.items()}


def elapsed(run) -> float:
    """Seconds ``run()`` takes (wall clock)."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


# Pause before each timed run of :func:`settled_elapsed`. BLAS and OpenMP pools (NumPy's
# OpenBLAS, torch's OpenMP) keep their threads spinning for a while after a call returns;
# on 2 cores those spinning threads take the cores from whatever runs next. Measured:
# torch's forward at (1, 8, 2048, 64) took 127 ms right after the naive NumPy run,
# against 65 ms alone.
SETTLE_S = 0.3


def settled_elapsed(run) -> float:
    """:func:`elapsed` after a pause of :data:`SETTLE_S` (the CPU bench's timing)."""
    time.sleep(SETTLE_S)
    return elapsed(run)
