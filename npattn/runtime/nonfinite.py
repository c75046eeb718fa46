"""Non-finite inputs: every backend gives the reference's answer.

The semantics (:mod:`npattn.reference`): IEEE arithmetic through the steps of
attention, where a row reads only the keys it sees. A NaN or +inf among a row's
visible scores makes its ``out`` row and lse NaN; a NaN or inf in ``v[j]`` reaches
every row that sees key j (even at weight 0, since ``0 * NaN`` is NaN) and no row
that does not; gradients likewise.

Every backend's kernels follow the score rules themselves: the exp keeps a NaN score
NaN, and a row of NaN scores is not taken for an empty one (a backend must, or a NaN
query row would come back as an empty row's finite zeros). What a tile product cannot
know is which zero weights belong to keys a row does not see: ``0 * NaN`` there would
leak a value the row never reads. So a result is checked after the kernel (the CPU
kernels report it as they write out's rows; elsewhere a pass over ``out``,
:func:`~npattn.core.results.out_is_finite`): finite, it stands; not (a NaN or an inf), the call is
answered by the float64 reference, and its vjp by the reference's backward (a
MemoryError says so first when the reference's S x S arrays cannot fit:
:mod:`npattn.runtime.limits`). Finite inputs pay that check (and a pass over dout and
the gradients in the backward) and get the kernels' results. The CPU's backward plans
check as they work: dout on delta = rowsum(dout * out) (NaN or infinite in every row
where dout is), before the kernels run, and 16-bit gradients as they are rounded; a
plan that finds a non-finite value returns None, and the call takes this module's
path (every CPU backward runs as a plan here, so it pays no pass of its own). The
GPU's forward checks on the device instead: a kernel after it recomputes, in float64
and reading only the keys each row sees, every row that is not finite
(``npattn/gpu/repair.cu``), and the result says it needs no check, so no call waits
for the device (calls that return the weights keep the host's check).
"""
from __future__ import annotations

from . import limits
from .. import reference
from ..core.arrays import all_finite, all_finite_arrays
from ..core.results import out_is_finite


def forward(problem, implementation, for_gradients: bool = False):
    """``(result, implementation)``: ``implementation``'s forward of ``problem``, or the
    reference's where the inputs or the result are not all finite (then the reference
    also runs the backward). ``for_gradients``: a backward follows (a backend's
    ``gradient_forward`` where it has one: its saved outputs as its backward needs them)."""
    run = getattr(implementation, "gradient_forward", implementation.forward) if for_gradients else (
        implementation.forward)
    result = run(problem)
    if implementation is reference or out_is_finite(result):
        return result, implementation
    limits.check_memory(problem, reference.NAME, because=_WHY_REFERENCE)
    return reference.forward(problem), reference


def backward(problem, implementation, saved, dout):
    """The gradients from ``implementation``'s backward, or from the reference's where
    ``dout`` or a gradient is not all finite."""
    if implementation is not reference:
        grads = _finite_gradients(problem, implementation, saved, dout)
        if grads is not None:
            return grads
    limits.check_memory(problem, reference.NAME, because=_WHY_REFERENCE)
    return reference.backward(problem, None, dout)


def _finite_gradients(problem, implementation, saved, dout):
    """``implementation``'s gradients where ``dout`` and they are all finite, else None. A
    backend with backward plans (the CPU's) checks as it works; others' dout and
    gradients take a pass each here. (On the AMX VM, a bfloat16 (2, 8, 1024, 64) causal
    vjp spent 4.7% of its time in those passes: NumPy's masks and maxima of the 16-bit
    words, four arrays.)"""
    plan = getattr(implementation, "backward_plan", None)
    if plan is not None:
        return plan(problem)(problem.q, problem.k, problem.v, saved, dout, problem)
    if not all_finite(dout):
        return None
    grads = implementation.backward(problem, saved, dout)
    return grads if all_finite_arrays((grads.dq, grads.dk, grads.dv, grads.dbias, grads.dsink_logits)) else None


_WHY_REFERENCE = ("the result holds NaN or inf (from non-finite inputs, or float32 overflow), which the "
                  "float64 reference recomputes exactly; check_finite=True names a non-finite input. ")

