"""``python -m npattn bench --adapters``: what calling npattn through torch or JAX costs.

One shape (default (1, 8, 512, 64), causal, float32), each way of calling npattn timed
against the same call on NumPy arrays, interleaved in one process:

- torch tensors (no autograd): the DLPack views of :mod:`npattn.adapters.arrays`, forward
  and ``attention_vjp`` with its vjp;
- torch tensors that require grad: :func:`npattn.torch.attention` under autograd,
  forward, and forward+backward (``out.backward(dout)``, grads reset to None as
  ``zero_grad()`` does);
- JAX arrays (eager) as torch tensors, and ``jax.jit`` of :func:`npattn.jax.attention`,
  forward, and ``jit(grad)``;

each forward+backward against ``attention_vjp`` and its vjp on NumPy.

Each sample is the mean of back-to-back calls filling about 20 ms (the VMs this project
runs on change speed for minutes at a time, so the ratios are medians of per-round
ratios). Frameworks that are not importable are skipped; neither is a dependency.
"""
from __future__ import annotations

import numpy as np

from ..adapters.dispatch import attention, attention_vjp
from .bench import Shape, _calls_per_run, _repeated
from .timing import elapsed, interleaved_samples

DEFAULT_SHAPE = Shape(1, 8, 8, 512, 64)


def _numpy_runs(q, k, v, dout):
    def forward():
        attention(q, k, v, causal=True)

    def forward_backward():
        attention_vjp(q, k, v, causal=True)[1](dout)
    return {"numpy": (forward, forward_backward)}


def _torch_runs(q, k, v, dout):
    try:
        import torch
    except ImportError:
        return {}
    import npattn.torch

    tensors = [torch.from_numpy(x) for x in (q, k, v)]
    leaves = [torch.from_numpy(x.copy()).requires_grad_(True) for x in (q, k, v)]
    tensor_dout = torch.from_numpy(dout)

    def plain():
        attention(*tensors, causal=True)

    def plain_forward_backward():
        attention_vjp(*tensors, causal=True)[1](tensor_dout)

    def op_forward():
        npattn.torch.attention(*leaves, causal=True)

    def op_forward_backward():
        for leaf in leaves:
            leaf.grad = None
        npattn.torch.attention(*leaves, causal=True).backward(tensor_dout)
    return {"torch tensors": (plain, plain_forward_backward), "torch autograd": (op_forward, op_forward_backward)}


def _jax_runs(q, k, v, dout):
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        return {}
    import npattn.jax

    arrays = [jnp.asarray(x) for x in (q, k, v)]
    jax_dout = jnp.asarray(dout)
    jitted = jax.jit(lambda q, k, v: npattn.jax.attention(q, k, v, causal=True))
    gradient = jax.jit(jax.grad(lambda q, k, v: (npattn.jax.attention(q, k, v, causal=True) * jax_dout).sum(),
                                argnums=(0, 1, 2)))

    def eager():
        attention(*arrays, causal=True).block_until_ready()

    def eager_forward_backward():
        jax.block_until_ready(attention_vjp(*arrays, causal=True)[1](jax_dout))

    def jit_forward():
        jitted(*arrays).block_until_ready()

    def jit_forward_backward():
        jax.block_until_ready(gradient(*arrays))
    return {"jax arrays": (eager, eager_forward_backward), "jax jit": (jit_forward, jit_forward_backward)}


def contenders(shape: Shape = DEFAULT_SHAPE) -> dict:
    """{way of calling: (forward, forward_backward)} for every framework importable here,
    on arrays of ``shape`` (float32; the asv suite times the same callables)."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((shape.batch, shape.heads, shape.q_len, shape.head_dim), np.float32)
    k, v = (rng.standard_normal((shape.batch, shape.kv_heads, shape.kv_len, shape.head_dim), np.float32)
            for _ in range(2))
    dout = np.ones(q.shape, np.float32)
    return {**_numpy_runs(q, k, v, dout), **_torch_runs(q, k, v, dout), **_jax_runs(q, k, v, dout)}


def compare(shape: Shape = DEFAULT_SHAPE, repeats: int = 15) -> dict:
    """Print and return {(name, pass): (median ms, median ratio to numpy)}; pass is
    "forward" or "fwd+bwd"."""
    contenders_here = contenders(shape)
    results = {}
    print(f"npattn through the frameworks' adapters, {shape} causal float32, medians of {repeats} rounds")
    print(f"{'called as':<16} {'forward ms':>10} {'x numpy':>8} {'fwd+bwd ms':>11} {'x numpy':>8}")
    for index, name in enumerate(("forward", "fwd+bwd")):
        runs = {who: passes[index] for who, passes in contenders_here.items()}
        calls = {who: _calls_per_run(run) for who, run in runs.items()}
        samples = interleaved_samples({who: _repeated(run, calls[who]) for who, run in runs.items()}, repeats,
                                      elapsed)
        base = samples["numpy"] / calls["numpy"]
        for who, seconds in samples.items():
            per_call = seconds / calls[who]
            results[(who, name)] = (1e3 * float(np.median(per_call)), float(np.median(per_call / base)))
    for who in contenders_here:
        (forward_ms, forward_ratio), (both_ms, both_ratio) = results[(who, "forward")], results[(who, "fwd+bwd")]
        print(f"{who:<16} {forward_ms:>10.3f} {forward_ratio:>7.3f}x {both_ms:>11.3f} {both_ratio:>7.3f}x")
    return results
