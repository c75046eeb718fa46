"""Run by tests/test_ring.py under ``mpiexec -n R``: each rank runs ring attention on its
shard of cases drawn from a seed, and compares with the one-process call it computes
itself. Exits non-zero (with the case and the error) on any difference beyond the dtype's
rounding bound; prints one "ok" line per rank at the end.

Usage: ring_worker.py correctness ring|heads SEED CASES [cupy] | mismatch | silent-peer | refusals | safety | fuzz SEED CASES
(with "cupy", the ranks' shards and options are CuPy arrays on the one GPU they share, and
their outputs come back as CuPy arrays: the gpu backend, host-staged transfers.)
"""
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import npattn
from npattn.distributed import ring_attention, ring_attention_vjp, shard
from tolerances import bound

COMM = MPI.COMM_WORLD
RANK, RANKS = COMM.Get_rank(), COMM.Get_size()
OPTION_NAMES = {"ring": ("causal", "scale", "softcap", "sink_logits", "mask", "bias", "q_lengths", "kv_lengths",
                         "window", "sinks", "alibi_slopes", "q_offset", "dropout"),
                "heads": ("causal", "scale", "softcap", "sink_logits", "q_lengths", "kv_lengths", "window", "sinks",
                          "alibi_slopes", "q_offset", "dropout")}


def draw_case(rng, strategy):
    """dims, dtype, layout, sharding and a random subset of the strategy's options."""
    sharding = ["contiguous", "zigzag"][rng.integers(2)]
    chunk = int(rng.integers(1, 5))
    length = chunk * RANKS * (2 if sharding == "zigzag" else 1)
    kv_heads = int(rng.integers(1, 3)) * (RANKS if strategy == "heads" else 1)
    heads = kv_heads * int(rng.integers(1, 3))
    batch, head_dim, value_dim = int(rng.integers(1, 3)), int(rng.integers(1, 9)), int(rng.integers(1, 9))
    dtype = np.dtype(["float64", "float32", "float16"][rng.integers(3)])
    layout = ["bhsd", "bshd"][rng.integers(2)]
    q = rng.uniform(-2, 2, (batch, heads, length, head_dim)).astype(dtype)
    k = rng.uniform(-2, 2, (batch, kv_heads, length, head_dim)).astype(dtype)
    v = rng.uniform(-2, 2, (batch, kv_heads, length, value_dim)).astype(dtype)
    options = {}
    for name in OPTION_NAMES[strategy]:
        if rng.random() < 0.5:
            continue
        if name == "causal":
            options["causal"] = True
        elif name == "scale":
            options["scale"] = float(rng.uniform(0.1, 1.0))
        elif name == "softcap":
            options["softcap"] = float(rng.uniform(0.5, 5.0))
        elif name == "sink_logits":
            options["sink_logits"] = rng.normal(0, 2, heads)
        elif name == "mask":
            options["mask"] = rng.random((batch, 1, length, length)) < 0.7
        elif name == "bias":
            # one row broadcasts over all query rows (its gradient summed over the ranks); with
            # one position per rank a rank's own row would look the same, so draw those only
            # where ranks hold more
            rows = [1, length][rng.integers(2)] if length > RANKS else 1
            options["bias"] = rng.normal(0, 1, (1, heads, rows, length))
        elif name == "q_lengths":
            options["q_lengths"] = rng.integers(0, length + 1, batch)
        elif name == "kv_lengths":
            options["kv_lengths"] = rng.integers(0, length + 1, batch)
        elif name == "window":
            options["window"] = (int(rng.integers(0, length)), int(rng.integers(0, length)))
        elif name == "sinks":
            options["sinks"] = int(rng.integers(0, 3))
        elif name == "alibi_slopes":
            options["alibi_slopes"] = rng.uniform(0, 1, heads)
        elif name == "q_offset":
            options["q_offset"] = int(rng.integers(-3, 4))
        elif name == "dropout":  # the one-process call's mask, drawn block by block
            options.update(dropout_p=float(rng.choice([0.2, 0.5])), seed=int(rng.integers(0, 2**63)))
            if rng.random() < 0.5:
                options["dropout_offset"] = tuple(int(x) for x in rng.integers(0, 2**32, 4))
    return q, k, v, dtype, layout, sharding, options


def rank_part(array, sharding, axis):
    return shard(array, RANK, RANKS, axis, sharding)


def to_layout(array, layout):
    return np.ascontiguousarray(array.transpose(0, 2, 1, 3)) if layout == "bshd" else array


def check(name, ours, expected, dtype, length, magnitude, case):
    ours, expected = np.asarray(ours, np.float64), np.asarray(expected, np.float64)
    tolerance = bound(dtype, length, magnitude)
    if ours.shape != expected.shape:
        raise AssertionError(f"rank {RANK}: {name} has shape {ours.shape}, not {expected.shape}, in {case}")
    both_inf = np.isneginf(ours) & np.isneginf(expected)
    difference = np.abs(np.where(both_inf, 0.0, ours) - np.where(both_inf, 0.0, expected))
    if not (difference <= tolerance).all():
        difference = difference.max()
        raise AssertionError(f"rank {RANK}: {name} differs by {difference} (tolerance {tolerance:.3g}) in {case}")


def on_device(value, device):
    """``value`` as a CuPy array when ``device`` (arrays only), else unchanged."""
    if not device or not isinstance(value, np.ndarray):
        return value
    import cupy

    return cupy.asarray(value)


def to_host(value):
    """A NumPy array of a CuPy or NumPy one, insisting on CuPy's kind where the input had it."""
    return value.get() if hasattr(value, "get") else value


def correctness(strategy, seed, cases, device=False):
    rng = np.random.default_rng(seed)
    for index in range(cases):
        q, k, v, dtype, layout, sharding, options = draw_case(rng, strategy)
        dout = rng.uniform(-1, 1, (*q.shape[:3], v.shape[-1])).astype(dtype)
        user = [to_layout(x, layout) for x in (q, k, v, dout)]
        (out, lse), vjp = npattn.attention_vjp(*user[:3], return_lse=True, layout=layout, **options)
        expected = vjp(user[3])
        seq = 2 if layout == "bhsd" else 1
        local = {name: (rank_part(value, sharding, 2) if name in ("mask", "bias") and value.shape[2] > 1 else value)
                 for name, value in options.items()}
        local = {name: on_device(value, device) for name, value in local.items()}
        (ring_out, ring_lse), ring_vjp = ring_attention_vjp(
            *(on_device(rank_part(x, sharding, seq), device) for x in user[:3]), COMM, sharding=sharding,
            strategy=strategy, return_lse=True, layout=layout, **local)
        grads = ring_vjp(on_device(rank_part(user[3], sharding, seq), device))
        if device:  # the caller's kind back, then compared on the host
            kinds = {type(x).__module__.split(".")[0] for x in (ring_out, ring_lse, *grads)}
            assert kinds == {"cupy"}, f"rank {RANK}: CuPy inputs gave {kinds}"
        ring_out, ring_lse, *grads = (to_host(x) for x in (ring_out, ring_lse, *grads))
        case = f"case {index}: {dtype} {layout} {sharding} shapes {q.shape} {k.shape} {v.shape} options {sorted(options)}"
        length, magnitude = q.shape[2] + q.shape[3] + v.shape[3], 4.0 * (1 + 4 * q.shape[3])
        check("out", ring_out, rank_part(out, sharding, seq), dtype, length, magnitude, case)
        check("lse", ring_lse, rank_part(lse, sharding, 2), np.float32 if dtype != np.float64 else dtype, length,
              magnitude, case)
        for name, ours, theirs in zip(("dq", "dk", "dv"), grads, expected):
            check(name, ours, rank_part(theirs, sharding, seq), dtype, 4 * length, 4 * magnitude * q.shape[2], case)
        compute = np.float64 if dtype == np.float64 else np.float32  # dbias and dsink_logits: in it, then widened
        extra = iter(zip(grads[3:], expected[3:]))
        if "bias" in options:
            ours, theirs = next(extra)
            theirs = rank_part(theirs, sharding, 2) if theirs.shape[2] > 1 else theirs
            check("dbias", ours, theirs, compute, 4 * length, 4 * magnitude * q.shape[2], case)
        if "sink_logits" in options:
            ours, theirs = next(extra)
            check("dsink_logits", ours, theirs, compute, 4 * length, 4 * magnitude * q.shape[2] * q.shape[0], case)
    print(f"ok rank {RANK} of {RANKS}: {cases} {strategy} cases", flush=True)


def mismatch():
    """Rank 1 passes a shard with another head count: every rank must raise the same error."""
    q = np.ones((1, 2 if RANK != 1 else 4, 3, 4))
    try:
        ring_attention(q, q, q, COMM, timeout=60)
    except ValueError as error:
        print(f"raised rank {RANK}: {error}", flush=True)


def silent_peer():
    """Rank 0 never makes the call: the others must time out, naming the wait. Then every
    rank leaves without MPI_Finalize, which would wait forever on the unanswered call, once
    all have had time to say what they caught (mpiexec ends the rest when one leaves so)."""
    q = np.ones((1, 2, 3, 4))
    start = time.monotonic()
    if RANK != 0:
        try:
            ring_attention(q, q, q, COMM, timeout=1.0)
        except TimeoutError as error:
            print(f"timed out rank {RANK}: {error}", flush=True)
    time.sleep(max(0.0, start + 5 - time.monotonic()))
    os._exit(0)


def refusals():
    """The weights, left padding, per-entry offsets and what the head split cannot do are
    refused by name on every rank."""
    q = np.ones((1, 2, 4, 4))
    for strategy, options in (("ring", {"return_weights": True}), ("heads", {"mask": np.ones((4, 8), bool)}),
                              ("heads", {"kv_heads": 1}), ("ring", {"q_start": np.zeros(1, np.int64)}),
                              ("ring", {"q_offset": np.zeros(1, np.int64)})):
        kv = q[:, :options.pop("kv_heads", 2)]
        try:
            ring_attention(q, kv, kv, COMM, strategy=strategy, timeout=60, **options)
        except ValueError as error:
            print(f"refused rank {RANK}: {error}", flush=True)


def safety():
    """Calls that one or all ranks get wrong: every rank must raise the same error naming
    what is wrong, at once (no rank returns, none waits for a peer that has given up)."""
    folder = os.environ.get("NPATTN_FUZZ_OUT")  # one file per rank: the ranks' lines never interleave there
    report = open(os.path.join(folder, f"rank{RANK}.txt"), "w") if folder else sys.stdout

    def say(line):
        print(line, file=report, flush=True)

    q = np.ones((1, 2, 4, 4))
    cases = {
        "3-D q on rank 0": (lambda: (q[0] if RANK == 0 else q, q, q), {}),
        "float mask on rank 1": (lambda: (q, q, q), {"mask": np.ones((1, 1, 4, 4 * RANKS),
                                                                   np.float32 if RANK == 1 else bool)}),
        "mask on rank 1 only": (lambda: (q, q, q), {"mask": np.ones((1, 1, 4, 4 * RANKS), bool)} if RANK == 1 else {}),
        "NaN sink_logits": (lambda: (q, q, q), {"sink_logits": np.array([np.nan, 0.0])}),
        "unknown option": (lambda: (q, q, q), {"softmax_scale": 0.5}),
        "window on rank 1": (lambda: (q, q, q), {"window": -1 if RANK == 1 else 2}),
        "timeout nan": (lambda: (q, q, q), {"timeout": float("nan")}),
        "timeout -1": (lambda: (q, q, q), {"timeout": -1}),
        "timeout text": (lambda: (q, q, q), {"timeout": "abc"}),
        "timeout nan on rank 1": (lambda: (q, q, q), {"timeout": float("nan") if RANK == 1 else 60}),
        "alibi too steep": (lambda: (q, q, q), {"alibi_slopes": np.full(2, 1e308)}),
    }
    for label, (arrays, options) in cases.items():
        options = {"timeout": 60, **options}
        for entry in ("forward", "vjp"):
            start = time.monotonic()
            try:
                if entry == "forward":
                    ring_attention(*arrays(), COMM, **options)
                else:
                    ring_attention_vjp(*arrays(), COMM, **options)
                say(f"case {label} {entry} rank {RANK}: returned")
            except Exception as error:
                say(f"case {label} {entry} rank {RANK}: {type(error).__name__} in {time.monotonic() - start:.1f} s: "
                    f"{error}")
    # a dout of the wrong shape on rank 1 only: both ranks raise from the vjp
    out, vjp = ring_attention_vjp(q, q, q, COMM, timeout=60)
    try:
        vjp(out[..., :-1] if RANK == 1 else out)
        say(f"case dout on rank 1 vjp rank {RANK}: returned")
    except Exception as error:
        say(f"case dout on rank 1 vjp rank {RANK}: {type(error).__name__} in 0.0 s: {error}")
    if folder:
        report.close()


def fuzz(seed, cases):
    """Drawn ring calls from ``seed`` (the same draws on every rank), about half of them
    broken on one rank or on all: each rank prints its class of each call. A valid call
    must match the one-process call; a broken one must raise ValueError or TypeError
    naming the argument on every rank (tests/test_serving_fuzz.py compares the ranks)."""
    import serving_fuzz

    folder = os.environ.get("NPATTN_FUZZ_OUT")  # one file per rank: the ranks' lines never interleave there
    report = open(os.path.join(folder, f"rank{RANK}.txt"), "w") if folder else sys.stdout

    def say(line):
        print(line, file=report, flush=True)

    rng = np.random.default_rng(seed)
    for index in range(cases):
        q, k, v, dtype, layout, sharding, options = draw_case(rng, "ring")
        options.pop("dropout_p", None), options.pop("seed", None), options.pop("dropout_offset", None)
        seq = 2 if layout == "bhsd" else 1
        user = [to_layout(x, layout) for x in (q, k, v)]
        local = {name: (rank_part(value, sharding, 2) if name in ("mask", "bias") and value.shape[2] > 1 else value)
                 for name, value in options.items()}
        arrays = [rank_part(x, sharding, seq) for x in user]
        call = dict(sharding=sharding, layout=layout, timeout=60, **local)
        culprit = int(rng.integers(RANKS + 1))  # RANKS: every rank
        mine = culprit in (RANK, RANKS)
        mutations = [
            (("q",), lambda: arrays.__setitem__(0, arrays[0][0] if mine else arrays[0])),
            (("k",), lambda: arrays.__setitem__(1, arrays[1].astype(np.float16) if mine and dtype != np.float16
                                                 else arrays[1].astype(np.float32) if mine else arrays[1])),
            (("mask",), lambda: call.update(mask=np.ones((1, 1, arrays[0].shape[seq], q.shape[2]),
                                                         np.float32 if mine else bool))),
            (("mask",), lambda: call.update(mask=np.ones((1, 1, arrays[0].shape[seq], q.shape[2]), bool))
             if RANK == culprit % RANKS else call.pop("mask", None)),  # on one rank only
            (("bias",), lambda: call.update(bias=np.zeros((1, 1, 1, q.shape[2] + 1)))),
            (("window",), lambda: call.update(window=-1 if mine else 1)),
            (("timeout",), lambda: call.update(timeout=float("nan") if mine else 60)),
            (("timeout",), lambda: call.update(timeout="abc" if mine else 60)),
            (("sink_logits",), lambda: call.update(sink_logits=np.full(q.shape[1], np.nan))),
            (("softmax_scale", "scale"), lambda: call.update(softmax_scale=0.5)),
            (("q_start",), lambda: call.update(q_start=np.zeros(q.shape[0], np.int64))),
            (("weights",), lambda: call.update(return_weights=True)),
            (("sharding",), lambda: call.update(sharding="striped")),
            (("layout",), lambda: call.update(layout="bhds")),
            (("alibi_slopes",), lambda: call.update(alibi_slopes=np.ones(q.shape[1] + 1))),
            (("q_lengths",), lambda: call.update(q_lengths=np.full(q.shape[0], q.shape[2] + 1))),
            (("scale",), lambda: call.update(scale=float("inf"))),
        ]
        names, label = (), "valid"
        if rng.random() < 0.6:
            choice = int(rng.integers(len(mutations)))
            names, mutate = mutations[choice]
            mutate()
            label = f"broken in {names[0]} ({'every rank' if culprit == RANKS else f'rank {culprit}'})"
        entry = ring_attention_vjp if rng.random() < 0.5 else ring_attention
        watched = [*arrays, *(value for value in call.values() if isinstance(value, np.ndarray))]
        before = serving_fuzz.snapshot(*watched)
        start = time.monotonic()
        try:
            result = entry(*arrays, COMM, **call)
        except Exception as error:  # noqa: BLE001
            seconds = time.monotonic() - start
            message = f"{type(error).__name__}: {error}".replace("\n", " ")
            if serving_fuzz.snapshot(*watched) != before:
                klass = "changed by failure"
            elif not isinstance(error, serving_fuzz.ALLOWED):
                klass = "foreign exception"
            elif not names:
                klass = "valid call refused"
            elif not serving_fuzz.names_any(str(error), names):
                klass = "unnamed"
            elif seconds > 30:
                klass = "hang"
            else:
                klass = "rejected"
            say(f"fuzz rank {RANK} case {index} {label}: {klass}: {message}")
            continue
        if names:
            say(f"fuzz rank {RANK} case {index} {label}: silent wrong answer: returned")
            continue
        out = result[0] if entry is ring_attention_vjp else result
        expected = npattn.attention(*user, layout=layout, **options)
        try:
            check("out", out, rank_part(expected, sharding, seq), dtype, q.shape[2] + q.shape[3] + v.shape[3],
                  4.0 * (1 + 4 * q.shape[3]), label)
            klass = "ok"
        except AssertionError as error:
            klass = f"silent wrong answer: {error}"
        say(f"fuzz rank {RANK} case {index} {label}: {klass}")
    if folder:
        report.close()


if __name__ == "__main__":
    MODES = {"correctness": lambda: correctness(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
                                                device=sys.argv[5:] == ["cupy"]),
             "mismatch": mismatch,
             "silent-peer": silent_peer, "refusals": refusals, "safety": safety,
             "fuzz": lambda: fuzz(int(sys.argv[2]), int(sys.argv[3]))}
    MODES[sys.argv[1]]()
