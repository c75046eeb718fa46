"""The problem npattn solves, independent of any backend.

The options table (:mod:`~npattn.core.options`) and the checks of every argument
(:mod:`~npattn.core.checks`, :mod:`~npattn.core.validation`), the checked problem the
backends receive (:mod:`~npattn.core.problem`), which keys a row sees
(:mod:`~npattn.core.masks`), the parameter arrays the kernels read
(:mod:`~npattn.core.kernel_params`), the dropout stream (:mod:`~npattn.core.dropout`),
what a backend returns (:mod:`~npattn.core.results`), the merge of partial results by
their log-sum-exp (:mod:`~npattn.core.merging`), the checks of constructor arguments
(:mod:`~npattn.core.arguments`), and the array-kind helpers under them all, which tell
NumPy from CuPy without importing CuPy (:mod:`~npattn.core.arrays`). The float64 oracle
is :mod:`npattn.reference`.
"""
