"""The head-parallel strategy (DeepSpeed-Ulysses): an all-to-all turns the ranks' sequence
shards into whole sequences of a group of heads each, every rank runs one npattn call on
its heads, and an all-to-all turns the outputs back into sequence shards.

Each rank sees whole sequences, so every option that counts positions works as in one
process: causal, windows, sinks, ALiBi, lengths. It needs H and Hkv divisible by the number
of ranks, and moves q, k, v, out (and in the backward dout and the gradients) across the
ranks once each, where the ring moves K/V R - 1 times but never q. Refused: dense ``mask``
and ``bias`` (a rank would need whole S x S rows of its heads). Dropout draws the
one-process mask: each rank's call hashes its heads' global indices (``dropout_offset``).
"""
from __future__ import annotations

import numpy as np

from ..core import options as _options
from ..core.arrays import array_module
from ..api import attention, attention_vjp

_REFUSED = _options.refused_by(_options.HEADS)  # from the options table
_PER_HEAD = tuple(option.name for option in _options.OPTIONS if option.per_head)


def check_heads(ranks: int, heads: int, kv_heads: int, options: dict) -> None:
    """Raise ValueError (the same on every rank: all check the agreed values) for what the
    head split cannot do."""
    if heads % ranks or kv_heads % ranks:
        raise ValueError(f"strategy='heads' splits the heads: H ({heads}) and Hkv ({kv_heads}) "
                         f"must divide by the {ranks} ranks, over which it splits them")
    for name, what in _REFUSED.items():
        value = options.get(name)
        if value is not None:
            raise ValueError(f"strategy='heads' does not take {name}: {what}")


def _to_heads(ring, schedule, x, tag):
    """(B, H', S_local, ...) sequence shards -> (B, H'/R, S, ...): this rank's head group,
    the whole sequence in global order."""
    group = x.shape[1] // ring.size
    sends = [x[:, peer * group:(peer + 1) * group] for peer in range(ring.size)]
    shapes = [(x.shape[0], group, sum(c.length for c in schedule.chunks[peer]), *x.shape[3:]) for peer in range(ring.size)]
    received = ring.exchange(sends, shapes, x.dtype, tag)
    total = sum(shape[2] for shape in shapes)
    whole = array_module(x).empty((x.shape[0], group, total, *x.shape[3:]), x.dtype)
    for peer, part in enumerate(received):
        for chunk in schedule.chunks[peer]:
            whole[:, :, chunk.global_start:chunk.global_start + chunk.length] = \
                part[:, :, chunk.local_start:chunk.local_start + chunk.length]
    return whole


def _to_sequence(ring, schedule, y, tag):
    """:func:`_to_heads`'s inverse: (B, H'/R, S, ...) -> this rank's (B, H', S_local, ...)."""
    xp = array_module(y)
    sends = [xp.concatenate([y[:, :, c.global_start:c.global_start + c.length] for c in schedule.chunks[peer]], axis=2)
             for peer in range(ring.size)]
    local = sum(c.length for c in schedule.chunks[ring.rank])
    shapes = [(y.shape[0], y.shape[1], local, *y.shape[3:])] * ring.size
    return xp.concatenate(ring.exchange(sends, shapes, y.dtype, tag), axis=1)


def _head_options(ring, heads: int, options: dict) -> dict:
    """The call's options for this rank's head group: per-head arrays sliced."""
    group = heads // ring.size
    mine = slice(ring.rank * group, (ring.rank + 1) * group)
    result = {name: value for name, value in options.items() if name not in ("layout", "return_lse", "return_weights")}
    for name in _PER_HEAD:  # their last axis is the heads: the rank's group of them
        if options.get(name) is not None:
            result[name] = ring.xp.asarray(options[name])[..., mine]
    if options.get("dropout_p"):  # the rank's heads hash as their global indices
        b, h, i, j = options.get("dropout_offset") or (0, 0, 0, 0)
        result["dropout_offset"] = (b, h + mine.start, i, j)
    return result


def forward(ring, schedule, q, k, v, options: dict, backward: bool):
    """The rank's (out, lse) as sequence shards (bhsd, compute dtype), and a function of the
    rank's dout giving [dq, dk, dv] (and dsink_logits when given)."""
    heads = q.shape[1]
    qh, kh, vh = (_to_heads(ring, schedule, x, tag=200 + index) for index, x in enumerate((q, k, v)))
    call = _head_options(ring, heads, options)
    if backward:
        (out_h, lse_h), vjp = attention_vjp(qh, kh, vh, return_lse=True, **call)
    else:
        out_h, lse_h = attention(qh, kh, vh, return_lse=True, **call)
    out = _to_sequence(ring, schedule, out_h, tag=210)
    lse = _to_sequence(ring, schedule, lse_h[..., None], tag=211)[..., 0]

    def gradients(dout):
        grads = vjp(_to_heads(ring, schedule, dout, tag=220))
        result = [_to_sequence(ring, schedule, grad, tag=221 + index) for index, grad in enumerate(grads[:3])]
        if options.get("sink_logits") is not None:  # each rank's slice, gathered whole
            result.append(ring.xp.asarray(np.concatenate(ring.gather(ring.host(grads[3])))))
        return result
    return out, lse, gradients
