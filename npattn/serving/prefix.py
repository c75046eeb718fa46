"""Shared-prefix (cascade) attention for the kv-cache call: one prompt prefix every
sequence of a batch sees before its own cached keys (a system prompt, a few-shot header,
beam search's common history), read once for the whole batch.

Sequence b's keys are the prefix's ``Sp`` keys (positions 0 to Sp - 1) then its own
(positions from Sp on). Attention over that union is attention over each part merged by
log-sum-exp (:func:`npattn.core.merging.merge_states`), so the call runs two parts:

- the prefix part: every query row of the batch against the prefix. Where every row sees
  every prefix key with nothing depending on the row's position (no window, no ALiBi: a
  causal mask never hides a prefix key, which precedes every query), the B x Sq rows are
  stacked as the rows of one dense problem against the one prefix: its keys stream
  through the kernels once for the batch, as one matrix product per tile instead of B
  matrix-vector ones. Otherwise each sequence is an entry against the same prefix memory
  (a stride-0 view), at its own query positions;
- each sequence's own part, as the kv-cache call computes it without a prefix, with the
  sinks the prefix does not already hold;
- the sink logits, when given, as a third part (out 0, lse ``sink_logits[h]``) for every
  row that sees a key in either part: counted once, whichever part a row's window reaches.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .. import api
from ..core import arrays as _arrays
from ..core import checks
from ..core.merging import merge_states

# Options whose arrays are laid over a batch's whole key axis, which the prefix changes
_REFUSED = {"mask": "a mask over the keys", "bias": "a bias over the keys",
            "dropout_p": "dropout (forward-only serving calls do not drop)"}


class SharedPrefix:
    """A checked prefix for a kv-cache step: ``prefix_k`` (Sp, Hkv, D) and ``prefix_v``
    (Sp, Hkv, Dv) of q's kind and dtype, the step's query positions, the options."""

    def __init__(self, q, k_cache, prefix_k, prefix_v, first_query, options: dict):
        for name, why in _REFUSED.items():
            if options.get(name) is not None and (name != "dropout_p" or options[name]):
                raise TypeError(f"attention_with_kvcache does not take {name} with prefix_k: {why} would have to "
                                f"cover the prefix's keys too (got {name}={options[name]!r})")
        prefix_k, prefix_v = checks.as_arrays(prefix_k=prefix_k, prefix_v=prefix_v, reference=q)
        for name, array, last in (("prefix_k", prefix_k, q.shape[3]), ("prefix_v", prefix_v, None)):
            checks.check_float_dtype(name, array)
            if array.dtype != q.dtype:
                raise TypeError(f"{name} has dtype {array.dtype} but q has {q.dtype}; they must share one dtype")
            if array.ndim != 3 or array.shape[1] != k_cache.shape[2] or (last is not None and array.shape[2] != last):
                raise ValueError(f"{name} must be (Sp, Hkv, {'D' if last else 'Dv'}) = (Sp, {k_cache.shape[2]}, "
                                 f"{last if last else 'Dv'}), got shape {tuple(array.shape)}")
        if prefix_k.shape[0] != prefix_v.shape[0]:
            raise ValueError(f"prefix_k and prefix_v must hold the same keys, got {prefix_k.shape[0]} and "
                             f"{prefix_v.shape[0]}")
        self.span = span = int(prefix_k.shape[0])
        self.structure = (checks.structure_of(prefix_k), checks.structure_of(prefix_v))
        batch, q_len, heads, dim = q.shape
        # the options this class changes for its parts, checked as the call's own would be
        self.want_lse = checks.check_bool("return_lse", options.get("return_lse", False))
        checks.check_count("sinks", options.get("sinks", 0))
        # every row sees every prefix key, whatever its position: no window, no ALiBi, and no
        # query before the prefix's end (a step with more queries than keys puts its first
        # rows inside the prefix, where a causal mask hides the prefix's later keys)
        causal_reaches = bool(options.get("causal")) and bool((np.asarray(first_query) < 0).any())
        visibility_free = options.get("window") is None and options.get("alibi_slopes") is None and not causal_reaches
        self.stacked = visibility_free
        xp = _arrays.array_module(q)
        part = {name: value for name, value in options.items() if name not in ("causal", "return_lse")}
        part["return_lse"] = True
        if self.stacked:  # every row sees every prefix key: B x Sq rows against one prefix
            arrays = self._stacked(q, prefix_k, prefix_v)
            part.pop("sinks", None)  # (sinks only shield keys from a window)
        else:
            arrays = self._per_entry(q, prefix_k, prefix_v)
            part.update(causal=options.get("causal", False), q_offset=xp.asarray(first_query + span))
        problem, self.implementation = api.checked_problem(*arrays, dict(part, layout="bshd"))
        # The sink logits are a third part of the merge, not the prefix part's: a row whose
        # window reaches no prefix key gets lse -inf there, and its sink column would be lost
        # with it. The part is out 0 and lse sink_logits[h] for every row that sees a key.
        self.sink = problem.sink_logits
        self.problem = dataclasses.replace(problem, sink_logits=None)
        self._plan: Any = None

    def own_options(self, options: dict) -> dict:
        """The options of each sequence's own part: its lse, the sinks the prefix does not
        hold, no sink logits (the prefix part counts them)."""
        own = dict(options, return_lse=True, sink_logits=None)
        sinks = checks.as_int(options.get("sinks", 0))
        if sinks:
            own["sinks"] = max(0, sinks - self.span)
        return own

    # (q C-contiguous in both: the part's plan is made for one layout of its rows, and the
    # step's queries come rotated, a fresh array, or as the caller laid them out)
    def _stacked(self, q, prefix_k, prefix_v):
        batch, q_len, heads, dim = q.shape
        q = _arrays.array_module(q).ascontiguousarray(q)
        return q.reshape(1, batch * q_len, heads, dim), prefix_k[None], prefix_v[None]

    def _per_entry(self, q, prefix_k, prefix_v):
        xp = _arrays.array_module(q)
        batch = q.shape[0]
        return (xp.ascontiguousarray(q), xp.broadcast_to(prefix_k[None], (batch, *prefix_k.shape)),
                xp.broadcast_to(prefix_v[None], (batch, *prefix_v.shape)))

    def attend(self, q, prefix_k, prefix_v, own_part) -> Any:
        """What the call returns: the prefix part of ``q`` (the step's rotated queries)
        merged with ``own_part`` (the own keys' ``(out, lse)``). The first run runs the
        checked problem; later ones its plan."""
        batch, q_len, heads, _ = q.shape
        arrays = (self._stacked if self.stacked else self._per_entry)(q, prefix_k, prefix_v)
        if self._plan is None:
            self._plan = api.Plan(api.owned(self.problem), self.implementation)
        out, lse = self._plan.run_trusted(*arrays)
        if self.stacked:  # (1, B Sq, H, Dv) and (1, H, B Sq) back to the batch's shapes
            out = out.reshape(batch, q_len, heads, out.shape[-1])
            lse = lse.reshape(heads, batch, q_len).transpose(1, 0, 2)
        outs, lses = [out, own_part[0]], [lse, own_part[1]]
        if self.sink is not None:
            xp = _arrays.array_module(q)
            seen = (lse > -np.inf) | (own_part[1] > -np.inf)
            lses.append(xp.where(seen, self.sink.astype(lse.dtype)[None, :, None], -np.inf))
            outs.append(xp.zeros_like(out))
        merged_out, merged_lse = merge_states(outs, lses, layout="bshd")
        return (merged_out, merged_lse) if self.want_lse else merged_out

    def check_run(self, prefix_k, prefix_v) -> None:
        """A later run's prefix arrays against the planned structure."""
        checks.check_structure("prefix_k", prefix_k, self.structure[0])
        checks.check_structure("prefix_v", prefix_v, self.structure[1])
