"""``python -m npattn bench --plans``: what a planned call saves, side by side in one process.

Small calls, where the checks and the set-up cost as much as the kernels (float32 on the
CPU; each number the best of ``5 * repeats`` runs of ``calls`` back-to-back calls, in us,
the runs of every call taken in turn):

- (1, 8, 16 x 16, 64): ``attention`` against ``plan(...).run``, causal, with
  ``kv_lengths``, and with a (16, 16) bias and ALiBi slopes (``attention`` plans only calls
  of plain option values, and checks option arrays in full at every call), and causal in
  float16 (its conversions on top of float32's call); where torch is
  importable, its CPU SDPA of the causal call as the bar;
- one layer of a decode step, (1, 8/2, 1 new + 40 cached, 64) on a contiguous cache and a
  batch of 4 on pages of 16: ``attention_with_kvcache`` as a step's first layer ("first":
  every check), as a decode loop's next step's first layer ("next": the plan of the step
  before, moved on) and as a later one (the first layer's plan, kept), against
  ``plan_with_kvcache(...).run``,
  and the attention call each layer makes after its append, plain and planned (what a
  kv-cache plan could come down to); the contiguous layer on int8 and float8 e4m3 caches
  too (each run quantizes its new key and value into them);
- one layer of a packed batch (3 decode steps and a 16-token chunk, 8/2 heads, D 64):
  ``attention_varlen`` as a batch's first layer and as a later one, against
  ``plan_varlen(...).run``.
"""
from __future__ import annotations

import sys
import time
from functools import partial

import numpy as np

from ..adapters.dispatch import attention, attention_varlen, attention_with_kvcache
from ..api import plan
from ..core.quantization import code_dtype, quantize_rows
from ..serving.kvcache import _MOVING, _STEPS, plan_with_kvcache
from ..serving.varlen import _BATCHES, plan_varlen


def best_us(calls_by_label: dict, calls: int, repeats: int) -> dict:
    """``{label: (us a call, plain; us a call, planned or NaN)}`` for ``{label: (plain call,
    planned call or None)}``: each the best of ``repeats`` runs of ``calls`` back-to-back
    calls, the runs of every call taken in turn (round by round, so that a slow spell of
    the machine reaches every row alike, and a row's plain and planned times come from
    the same rounds)."""
    timed = [(label, which, call) for label, pair in calls_by_label.items() for which, call in enumerate(pair)
             if call is not None]
    for _, _, call in timed:
        for _ in range(max(1, calls // 10)):  # warm: compiled, planned, caches filled
            call()
    best = {(label, which): float("inf") for label, which, _ in timed}
    for _ in range(repeats):
        for label, which, call in timed:
            start = time.perf_counter()
            for _ in range(calls):
                call()
            best[label, which] = min(best[label, which], (time.perf_counter() - start) / calls * 1e6)
    return {label: (best[label, 0], best.get((label, 1), float("nan"))) for label in calls_by_label}


def compare(calls: int = 400, repeats: int = 5, out=sys.stdout) -> dict:
    """Print and return ``{label: (through the plain call, through the plan)}`` in us:
    the best of ``5 * repeats`` rounds of ``calls`` calls of each (:func:`best_us`)."""
    rng = np.random.default_rng(0)
    results = {}
    q = rng.standard_normal((1, 8, 16, 64)).astype(np.float32)
    half = q.astype(np.float16)  # computed in float32: q widened, keys read as 16-bit a tile at a time, out narrowed
    for label, x, options in (("causal", q, dict(causal=True)),
                              ("causal, kv_lengths", q, dict(causal=True, kv_lengths=np.array([12]))),
                              ("bias (16, 16) and ALiBi", q, dict(bias=np.zeros((16, 16), np.float32),
                                                                  alibi_slopes=np.linspace(0.1, 0.8, 8))),
                              ("causal, float16", half, dict(causal=True))):
        planned = plan(x, x, x, **options)
        results[f"(1, 8, 16 x 16, 64) {label}"] = (partial(attention, x, x, x, **options),
                                                   partial(planned.run, x, x, x))
    torch_causal = _torch_causal(q)
    if torch_causal is not None:  # the bar, in the same process (where torch is importable)
        results["(1, 8, 16 x 16, 64) causal, torch SDPA"] = (torch_causal, None)
    heads, kv_heads, dim = 8, 2, 64
    q1, k1 = rng.standard_normal((1, 1, heads, dim)).astype(np.float32), rng.standard_normal(
        (1, 1, kv_heads, dim)).astype(np.float32)
    caches = tuple(rng.standard_normal((1, 64, kv_heads, dim)).astype(np.float32) for _ in range(2))
    q4, k4 = rng.standard_normal((4, 1, heads, dim)).astype(np.float32), rng.standard_normal(
        (4, 1, kv_heads, dim)).astype(np.float32)
    pools = tuple(rng.standard_normal((32, 16, kv_heads, dim)).astype(np.float32) for _ in range(2))
    steps = (("decode layer, contiguous (1, 8/2, 1 + 40, 64)", q1, k1, caches, dict(cache_seqlens=40)),
             ("decode layer, paged, 4 sequences, pages of 16", q4, k4, pools,
              dict(cache_seqlens=np.array([40, 30, 20, 50]), block_table=np.arange(16).reshape(4, 4))))
    for label, qs, ks, (key_cache, value_cache), metadata in steps:
        step = plan_with_kvcache(qs, key_cache, value_cache, ks, ks, **metadata)
        call = partial(attention_with_kvcache, qs, key_cache, value_cache, ks, ks, **metadata)
        results[f"{label}, first"] = (partial(_first_layer, call), None)
        results[f"{label}, next"] = (partial(_next_steps_first_layer, call), None)
        results[label] = (call, partial(step.run, qs, key_cache, value_cache, ks, ks))
    # the contiguous layer on quantized caches: each run quantizes the new key and value
    for kind in ("int8", "float8_e4m3"):
        (key_codes, key_scales), (value_codes, value_scales) = (quantize_rows(cache, code_dtype(kind))
                                                                for cache in caches)
        scales = dict(k_scale=key_scales, v_scale=value_scales)
        step = plan_with_kvcache(q1, key_codes, value_codes, k1, k1, cache_seqlens=40, **scales)
        call = partial(attention_with_kvcache, q1, key_codes, value_codes, k1, k1, cache_seqlens=40, **scales)
        results[f"decode layer, contiguous, {kind} cache, first"] = (partial(_first_layer, call), None)
        results[f"decode layer, contiguous, {kind} cache, next"] = (partial(_next_steps_first_layer, call), None)
        results[f"decode layer, contiguous, {kind} cache"] = (call, partial(step.run, q1, key_codes, value_codes,
                                                                            k1, k1, **scales))
    # a packed batch of 4 sequences (decode steps and a short prefill chunk), one layer
    cu_q, cu_k = np.array([0, 1, 2, 3, 19]), np.array([0, 40, 70, 90, 130])
    packed = [rng.standard_normal((int(cu[-1]), h, dim)).astype(np.float32)
              for cu, h in ((cu_q, heads), (cu_k, kv_heads), (cu_k, kv_heads))]
    varlen_step = plan_varlen(*packed, cu_q, cu_k, causal=True)
    call = partial(attention_varlen, *packed, cu_q, cu_k, causal=True)
    results["packed layer (1, 1, 1, 16 x 40-90 keys), first"] = (partial(_first_layer, call), None)
    results["packed layer (1, 1, 1, 16 x 40-90 keys)"] = (call, partial(varlen_step.run, *packed))
    # the attention each layer runs after its append: q against the contiguous cache's 41
    # keys; the 4 sequences against their pages, each at its own length
    keys, values = caches[0][:, :41], caches[1][:, :41]
    lengths = steps[1][4]["cache_seqlens"] + 1
    paged = dict(layout="bshd", block_table=steps[1][4]["block_table"], kv_lengths=lengths, q_offset=lengths - 1)
    for label, arrays, options in (("the contiguous layer's attention alone", (q1, keys, values), dict(layout="bshd")),
                                   ("the paged layer's attention alone", (q4, *pools), paged)):
        alone = plan(*arrays, **options)
        results[label] = (partial(attention, *arrays, **options), partial(alone.run, *arrays))
    results = best_us(results, calls, 5 * repeats)
    print(f"npattn planned calls on the CPU (float32 but the float16 row and the quantized caches), best of {5 * repeats} rounds of {calls} "
          "calls of each, in turn, us a call", file=out)
    print(f"{'call':<52} {'plain call':>11} {'planned':>9}", file=out)
    for label, (plain, planned) in results.items():
        print(f"{label:<52} {plain:>11.1f} {'-' if planned != planned else f'{planned:.1f}':>9}", file=out)
    return results


def _first_layer(call):
    """``call()`` (an ``attention_with_kvcache`` or ``attention_varlen``) as a step's first
    layer, checked in full: no plan kept from an earlier layer
    (:data:`npattn.serving.kvcache._STEPS`, :data:`npattn.serving.varlen._BATCHES`; the
    later layers of a step run the first one's; :data:`npattn.serving.kvcache._MOVING`, the
    next step's first)."""
    _STEPS.clear()
    _MOVING.clear()
    _BATCHES.clear()
    return call()


def _next_steps_first_layer(call):
    """``call()`` (an ``attention_with_kvcache``) as a decode loop's next step's first layer:
    the plan of the step before moved on to its lengths (here the same ones), not the
    step's own kept plan."""
    _STEPS.clear()
    return call()


def _torch_causal(q):
    """torch's CPU SDPA of ``q`` against itself, causal, under no_grad; None without torch."""
    try:
        import torch
    except ImportError:
        return None
    tq = torch.from_numpy(q)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def call():
        with torch.no_grad():
            sdpa(tq, tq, tq, is_causal=True)
    return call
