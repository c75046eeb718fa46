"""The asv benchmarks stay runnable: each benchmark method runs once, at the first value of each
parameter, on every backend available here (a smoke test: nothing is timed or asserted about speed)."""
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "asv_benchmarks"))
from benchmarks import attention as suite  # noqa: E402


@pytest.mark.parametrize("suite_class", [suite.Attention, suite.Variants, suite.TargetShapes, suite.LowPrecision,
                                         suite.Serving, suite.SlidingWindow, suite.Adapters, suite.Layouts,
                                         suite.DecodeCaches],
                         ids=lambda c: c.__name__)
def test_benchmark_methods_run(suite_class):
    backends, *others = suite_class.params
    ran = 0
    for backend in backends:
        params = [backend] + [values[0] for values in others]
        instance = suite_class()
        try:
            instance.setup(*params)
        except NotImplementedError:
            continue
        for name in dir(instance):
            if name.startswith(("time_", "peakmem_")):
                getattr(instance, name)(*params)
                ran += 1
    assert ran, "no benchmark could run on any backend"
