"""The options table (npattn/core/options.py) is the one list of options: every option in it
is read by every backend's forward and backward, drawn by the test strategies, and shown
in the public signatures and docs. A new option left out of any of them fails here."""
from __future__ import annotations

import inspect

import numpy as np
import pytest

import npattn
from npattn.core import options as table
from conftest import NUMPY_BACKENDS
import strategies

# Options that change what is computed ("visibility", "score", "softmax", "randomness")
# each have a decisive example in strategies.DECISIVE_EXAMPLES: the change must move every
# backend's output and gradients.
COMPUTING_KINDS = ("visibility", "score", "softmax", "randomness")
B, H, HKV, SQ, SK, D = strategies.EXAMPLE_DIMS
EXAMPLES = strategies.DECISIVE_EXAMPLES


def _run(backend, options, dtype):
    rng = np.random.default_rng(0)
    q = rng.normal(size=(B, H, SQ, D)).astype(dtype)
    k, v = (rng.normal(size=(B, HKV, SK, D)).astype(dtype) for _ in "kv")
    out, vjp = npattn.attention_vjp(q, k, v, backend=backend, **options)
    return (out, *vjp(np.ones_like(out))[:3])


def check_option_is_read(backend, name, dtype="float64"):
    """``name``'s example changes ``backend``'s out, dq, dk and dv for inputs of ``dtype``."""
    baseline, change = EXAMPLES[name]
    without, with_ = _run(backend, baseline, dtype), _run(backend, {**baseline, **change}, dtype)
    for what, a, b in zip(("out", "dq", "dk", "dv"), without, with_):
        # an ignored option leaves the same computation, so the same bits
        assert not np.array_equal(a, b), f"{backend} ignores {name} in {what}"


def test_every_computing_option_has_an_example():
    computing = {option.name for option in table.OPTIONS if option.kind in COMPUTING_KINDS}
    assert computing == set(EXAMPLES)


@pytest.mark.parametrize("backend", NUMPY_BACKENDS)
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_option_is_read_by_every_backend_forward_and_backward(backend, name):
    check_option_is_read(backend, name)


def test_the_strategies_draw_every_option():
    drawn = set()
    for drawer in strategies._OPTION_DRAWERS.values():
        class Draw:  # a stand-in for hypothesis's draw: the first value of each strategy
            def __call__(self, strategy):
                return strategy.example()
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            drawn |= set(drawer(Draw(), np.random.default_rng(0), strategies.Dims(2, 2, 1, 5, 7, 4, 4),
                                np.dtype(np.float32)))
    computing = {option.name for option in table.OPTIONS if option.kind in COMPUTING_KINDS}
    assert computing <= drawn, f"no strategy draws {sorted(computing - drawn)}"


@pytest.mark.parametrize("function", [npattn.attention, npattn.attention_vjp])
def test_signatures_and_docs_list_every_option(function):
    parameters = inspect.signature(function).parameters
    assert list(parameters) == ["q", "k", "v", *table.NAMES, "backend"]
    for option in table.OPTIONS:
        assert parameters[option.name].default is option.default or parameters[option.name].default == option.default
        assert f"{option.name}: {option.doc}" in " ".join(function.__doc__.split())


def test_an_unknown_option_is_named_with_the_nearest():
    q = np.zeros((1, 1, 2, 2))
    with pytest.raises(TypeError, match="unknown option 'windows'; did you mean 'window'"):
        npattn.attention(q, q, q, windows=2)
    with pytest.raises(TypeError, match="unknown option 'windows'"):
        npattn.attention_vjp(q, q, q, windows=2)


def test_every_table_entry_names_slots_that_exist():
    """An entry's problem field, kernel flag and GPU option bit are one line each elsewhere:
    a name that does not exist there fails here, not at the first call that uses it."""
    import dataclasses

    from npattn.gpu.options import Option as GpuOption
    from npattn.core.kernel_params import Int
    from npattn.core.problem import AttentionProblem

    fields = {field.name for field in dataclasses.fields(AttentionProblem)}
    for option in table.OPTIONS:
        assert option.field is None or option.field in fields, option.name
        assert option.flag is None or option.flag in Int.__members__, option.name
        assert option.gpu_option is None or option.gpu_option in GpuOption.__members__, option.name
        assert (option.flag is None and option.gpu_option is None) or option.present is not None, option.name


# ---- the facts the calls built on attention read from the table ----------------------------

def _value_for(name):
    """A value of option ``name`` for the small call below (any value: the calls refuse by name)."""
    return {"q_offset": 0, "layout": "bshd", "block_table": np.zeros((1, 1), np.int64), "mask": np.ones((1,), bool),
            "bias": np.zeros((1,), np.float32), "return_weights": True}.get(name, np.zeros(1, np.int64))


@pytest.mark.parametrize("name", [name for name in npattn.core.options.set_by(npattn.core.options.KVCACHE)
                                  if name != "block_table"])  # (an argument of its own there)
def test_the_kvcache_call_refuses_what_the_table_says_it_sets(name):
    q, cache = np.ones((1, 1, 1, 4), np.float32), np.zeros((1, 4, 1, 4), np.float32)
    with pytest.raises(TypeError, match=f"attention_with_kvcache sets {name} itself"):
        npattn.attention_with_kvcache(q, cache, cache, cache_seqlens=1, **{name: _value_for(name)})


@pytest.mark.parametrize("name", [*(name for name in npattn.core.options.set_by(npattn.core.options.VARLEN)
                                    if name != "block_table"),  # (an argument of its own there: paged keys)
                                  *npattn.core.options.refused_by(npattn.core.options.VARLEN)])
def test_the_packed_call_refuses_what_the_table_says(name):
    x, cu = np.ones((2, 1, 4), np.float32), np.array([0, 2])
    with pytest.raises(TypeError, match=f"attention_varlen does not take {name}"):
        npattn.attention_varlen(x, x, x, cu, cu, **{name: _value_for(name)})


def test_the_gradients_follow_the_tables_order():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 3, 4))
    given = {"bias": rng.standard_normal((3, 3)), "sink_logits": rng.standard_normal(2)}
    assert set(npattn.core.options.DIFFERENTIABLE) == set(given)
    out, vjp = npattn.attention_vjp(q, q, q, **given)
    grads = vjp(np.ones_like(out))[3:]
    assert [grad.shape for grad in grads] == [given[name].shape for name in npattn.core.options.DIFFERENTIABLE]
    from npattn.adapters.arrays import DIFFERENTIABLE

    assert DIFFERENTIABLE == npattn.core.options.DIFFERENTIABLE


def test_every_array_option_has_its_ring_sharding_or_is_refused():
    from npattn.core.problem import ARRAY_FIELDS

    refused = npattn.core.options.refused_by(npattn.core.options.RING)
    for option in npattn.core.options.OPTIONS:
        # (ALiBi slopes pass as a plain value, compared with the other options across ranks)
        if option.field in ARRAY_FIELDS and option.name not in refused and option.name != "alibi_slopes":
            assert option.sharding in ("rows", "shared"), option.name
    assert set(npattn.core.options.sharded("rows")) == {"mask", "bias"}


# The options whose decisive examples stop the CPU's GQA fold: they read a row's own head or
# row index per score (masks and biases per head, dropout's hash) or, past one query row,
# bound a row's keys on the left (a window; sinks come with one). Dropout's seed and offset
# come with dropout. ALiBi slopes and sink logits, a value per head, fold.
STOP_THE_FOLD = {"window", "sinks", "mask", "bias", "dropout_p", "seed", "dropout_offset"}
# those of them that fold a decode step's one query row (the folded rows share one band)
FOLD_ONE_ROW = {"window", "sinks"}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_gqa_fold_stops_for_the_options_the_table_says(name):
    """The CPU folds a GQA group's heads into one kv head's rows unless an option's ``folds``
    entry in the table stops it (cpu/folding.py keeps no list of its own): each option's
    decisive example, with a group of 2 and one query row (decoding) and with 5 rows,
    folds exactly when it is not in STOP_THE_FOLD, or, with one query row, in FOLD_ONE_ROW."""
    from npattn.cpu import folding
    from npattn.cpu.tuning import current
    from npattn.core.validation import build_problem

    baseline, change = EXAMPLES[name]
    for q_len in (1, SQ):
        rng = np.random.default_rng(0)
        q = rng.normal(size=(B, H, q_len, D))
        k, v = (rng.normal(size=(B, HKV, SK, D)) for _ in "kv")
        options = {**baseline, **change}
        if name in ("mask", "bias"):
            options[name] = options[name][..., -q_len:, :]
        if name in ("q_lengths", "q_start"):
            options[name] = np.minimum(options[name], q_len)
        problem = build_problem(q, k, v, **options)
        folds = name not in STOP_THE_FOLD or (q_len == 1 and name in FOLD_ONE_ROW)
        assert folding.foldable(problem, current()) == folds, (name, q_len)
    assert (table.BY_NAME[name].folds is not None) == (name in STOP_THE_FOLD - {"seed", "dropout_offset"})
