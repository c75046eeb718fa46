"""What every call passes through between the API and a backend's kernels.

The plan caches (:mod:`~npattn.runtime.plans`), the memory a call cannot do without
(:mod:`~npattn.runtime.limits`) and the answer to non-finite inputs
(:mod:`~npattn.runtime.nonfinite`).
"""
