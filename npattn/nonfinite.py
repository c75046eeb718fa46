"""Non-finite inputs: every backend gives the reference's answer.

The semantics (:mod:`npattn.reference`): IEEE arithmetic through the steps of
attention, where a row reads only the keys it sees. A NaN or +inf among a row's
visible scores makes its ``out`` row and lse NaN; a NaN or inf in ``v[j]`` reaches
every row that sees key j (even at weight 0, since ``0 * NaN`` is NaN) and no row
that does not; gradients likewise.

The CPU and GPU kernels follow the score rules themselves (the exp keeps a NaN score
NaN, and a row of NaN scores is not taken for an empty one). What a tile product cannot know
is which zero weights belong to keys a row does not see: ``0 * NaN`` there would leak
a value the row never reads. So a result is checked after the kernel, at the cost of
a min and a max over ``out``: finite, it stands; not (a NaN or an inf),
the call is answered by the float64 reference, and its vjp by the reference's
backward (a MemoryError says so first when the reference's S x S arrays cannot fit:
:mod:`npattn.limits`). Backends whose kernels do not follow the score rules (``NAN_SCORES_EXACT``
unset) also have q, k and bias checked, since a row of NaN scores could come back
as an empty row's zeros. Finite inputs pay a min and a max over out (and over dout
and the gradients in the backward) and get the kernels' results.
"""
from __future__ import annotations

import math

from . import limits, reference


def forward(problem, implementation):
    """``(result, implementation)``: ``implementation``'s forward of ``problem``, or the
    reference's where the inputs or the result are not all finite (then the reference
    also runs the backward)."""
    result = implementation.forward(problem)
    if implementation is reference or _all_finite(problem, result.out, implementation):
        return result, implementation
    limits.check_memory(problem, reference.NAME, because=_WHY_REFERENCE)
    return reference.forward(problem), reference


def backward(problem, implementation, saved, dout):
    """The gradients from ``implementation``'s backward, or from the reference's where
    ``dout`` or a gradient is not all finite."""
    if implementation is not reference and _finite(dout):
        grads = implementation.backward(problem, saved, dout)
        if all(_finite(g) for g in (grads.dq, grads.dk, grads.dv, grads.dbias, grads.dsink_logits)):
            return grads
    limits.check_memory(problem, reference.NAME, because=_WHY_REFERENCE)
    return reference.backward(problem, None, dout)


_WHY_REFERENCE = ("the result holds NaN or inf (from non-finite inputs, or float32 overflow), which the "
                  "float64 reference recomputes exactly; check_finite=True names a non-finite input. ")


def _all_finite(problem, out, implementation) -> bool:
    if not _finite(out):
        return False
    if getattr(implementation, "NAN_SCORES_EXACT", False):
        return True
    return _finite(problem.q) and _finite(problem.k) and _finite(problem.bias)


def _finite(array) -> bool:
    """No NaN or inf in ``array`` (None passes): its min and max are finite. Two
    reductions, but neither warns nor overflows (a sum does both), and no boolean mask
    (``isfinite(a).all()`` writes one): 4 us on a (1, 8, 16, 64) output."""
    if array is None or array.size == 0:
        return True
    return math.isfinite(array.min()) and math.isfinite(array.max())
