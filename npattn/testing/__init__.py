"""Hypothesis equivalence tests for anyone's attention kernel, with npattn as the oracle.

A property test of your kernel in a few lines::

    from hypothesis import given
    import npattn.testing as nt

    @given(nt.attention_problems(dtypes=("float32",), options=("causal", "window", "scale")))
    def test_my_kernel(problem):
        q, k, v = problem.q, problem.k, problem.v          # NumPy, in problem.layout
        out = my_attention(q, k, v, **problem.options)
        nt.assert_attention_close(out, problem)

- :func:`attention_problems` draws problems: shapes (batch, heads with GQA groups,
  sequence lengths, head dims), dtypes, layouts, value ranges (logits past float32's
  ``exp`` overflow included) and values of the options you name, as
  :func:`npattn.attention` keywords.
- :func:`reference` is the float64 answer (:mod:`npattn.reference`), and
  :func:`assert_attention_close` / :func:`assert_attention_grads_close` compare a result
  with it within :func:`error_bound`: the error a correct kernel computing in ``dtype``
  may make on that problem, derived from the dtype's precision (the bound npattn's own
  tests use), or, with ``rule="low_precision_reference"``, FlashAttention's rule (within
  ``factor`` times the error of the same attention done in the low dtype).
- :func:`dropout_keep` is npattn's dropout mask for a problem, for kernels that
  implement dropout to npattn's specification (:mod:`npattn.core.dropout`).

Importing this module needs hypothesis (``pip install 'npattn[testing]'``).
"""
from __future__ import annotations

try:
    import hypothesis  # noqa: F401
except ImportError as missing:  # pragma: no cover - exercised without hypothesis only
    raise ImportError("npattn.testing needs hypothesis: pip install 'npattn[testing]' (or pip install hypothesis)") \
        from missing

from .checks import (assert_attention_close, assert_attention_grads_close, dropout_keep, error_bound,
                     gradient_error_bound, reference, reference_gradients)
from .problems import OPTION_NAMES, Problem, attention_problems

__all__ = ["attention_problems", "Problem", "OPTION_NAMES", "reference", "reference_gradients",
           "assert_attention_close", "assert_attention_grads_close", "error_bound", "gradient_error_bound",
           "dropout_keep"]
