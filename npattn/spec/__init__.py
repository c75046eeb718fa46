"""The problem npattn solves, independent of any backend.

The options table (:mod:`~npattn.spec.options`) and the checks of every argument
(:mod:`~npattn.spec.checks`, :mod:`~npattn.spec.validation`), the checked problem the
backends receive (:mod:`~npattn.spec.problem`), which keys a row sees
(:mod:`~npattn.spec.masks`), the parameter arrays the kernels read
(:mod:`~npattn.spec.kernel_params`), the dropout stream (:mod:`~npattn.spec.dropout`),
what a backend returns (:mod:`~npattn.spec.results`), the merge of partial results by
their log-sum-exp (:mod:`~npattn.spec.merging`) and the checks of constructor arguments
(:mod:`~npattn.spec.arguments`). The float64 oracle is :mod:`npattn.reference`.
"""
