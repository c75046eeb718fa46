"""The command line (``python -m npattn``) and what it runs: benchmarks, timing, viz.

:mod:`~npattn.tools.cli` parses the commands; :mod:`~npattn.tools.bench` and its
``bench_*`` suites time npattn against torch, :mod:`~npattn.tools.timing` holds the
timing loops they share, :mod:`~npattn.tools.variants` the CPU kernel variants a
tuning run compares, and :mod:`~npattn.tools.viz` draws attention weights.
"""
