"""Ring attention: exact attention over a sequence split across MPI processes.

Each rank holds its shard of the sequence (:mod:`.sharding`): q, k and v for the same
positions. The ranks pass their K/V blocks around the ring; while a block travels on to the
next rank (non-blocking send and receive), the rank attends its queries to the block in
hand, one npattn call per pair of chunks, and folds the partial result into its running
output by log-sum-exp (:func:`npattn.core.merging.merge`), in a fixed order: step by step, the
block owners in ring order. So the result never depends on timing, and differs from the
one-process call only by rounding.

Each pair of chunks is one npattn call whose ``q_offset`` puts its query rows where the
whole sequence has them relative to its keys, so causal, windows, sinks and ALiBi
distances are the whole sequence's; a pair whose rows see none of its keys (a key chunk
after the query chunk under ``causal``, or outside the window) is skipped.

The backward (:func:`ring_attention_vjp`) sends the blocks around again, each followed by
its dK and dV sums, to which every rank adds its queries' share
(:func:`npattn.attention_backward` from the final out and lse; the share is computed while
the sums so far are still on their way); after a full turn they reach their owners. dq
sums in step order, dk and dv in ring order: deterministic too.

NumPy shards run on the cpu backend; CuPy shards on the gpu backend, their blocks and sums
staged through host memory for the transfers (any MPI build, CUDA-aware or not).

Before any work, the ranks exchange what they were given (shapes, dtypes, options,
whether the inputs are finite) and every rank checks every rank's, so a mismatched shard
raises the same error on every rank instead of hanging; every wait on a peer has a
timeout that raises ``TimeoutError`` naming it.
"""
from __future__ import annotations

import dataclasses
import math
import pickle
import time
from numbers import Real
from typing import Any, Callable, NamedTuple

import numpy as np

from ..core import arrays as _arrays
from ..core import checks
from ..core import options as _options
from ..api import attention, attention_backward
from ..core.masks import Visibility
from ..core.merging import merge
from ..core.options import dropout_requested
from ..core.problem import to_user_layout
from ..core.validation import build_problem
from .sharding import Chunk, check_sharding, chunks

# From the options table: the arrays each rank passes as its own query rows, those every
# rank passes alike, and what the ring cannot cut into its blocks' calls (yet), and why
_PER_ROW_ARRAYS = _options.sharded("rows")
_NOT_YET = _options.refused_by(_options.RING)
_LENGTHS = ("q_lengths", "kv_lengths")


def ring_attention(q, k, v, comm, *, sharding: str = "contiguous", strategy: str = "ring", timeout: float = 300.0,
                   **options):
    """:func:`npattn.attention` over a sequence sharded across the ranks of ``comm`` (an
    mpi4py communicator). Collective: every rank calls it with its own shard.

    q, k, v: the rank's shard, in layout "bhsd" (B, H, S_local, D) or "bshd", holding the
    positions ``sharding`` gives it ("contiguous": after the lower ranks' positions;
    "zigzag": chunks r and 2R-1-r of 2R equal chunks, see :mod:`npattn.distributed.sharding`).
    Options as :func:`npattn.attention`, counting positions over the whole sequence:
    ``causal``, ``q_offset``, ``window``, ``sinks``, ``alibi_slopes``, ``scale``,
    ``softcap``, ``sink_logits`` (the same on every rank), ``q_lengths`` and ``kv_lengths``
    (global lengths), ``mask`` and ``bias`` as the rank's own query rows of the whole
    problem's (broadcastable to (B, H, S_local, S)), ``layout``, ``return_lse``,
    ``backend``. Each pair of chunks runs with its own ``q_offset`` (its query start minus
    its key start) and its share of the sinks; pairs that see no key are skipped.
    ``dropout_p``: each pair's call draws the one-process call's mask (its
    ``dropout_offset`` is its place in the whole problem); with ``seed=None`` rank 0 draws
    the seed, and every rank uses it. ``return_weights`` raises ValueError (S_local x S
    per rank).

    ``strategy="heads"`` (DeepSpeed-Ulysses, :mod:`npattn.distributed.heads`) exchanges the
    shards all-to-all so that each rank runs whole sequences of H/R heads: not ``mask``
    or ``bias``, and H and Hkv must divide by the number of ranks.

    Returns the rank's rows of what the one-process call returns: ``out`` (and ``lse``).
    Raises the same ValueError on every rank when the shards disagree (shapes, dtypes,
    options) or an input is not finite, and TimeoutError when a peer does not answer within
    ``timeout`` seconds.
    """
    outputs, _ = _ring(q, k, v, comm, sharding, strategy, timeout, options, backward=False)
    return outputs


def ring_attention_vjp(q, k, v, comm, *, sharding: str = "contiguous", strategy: str = "ring",
                       timeout: float = 300.0, **options):
    """``(outputs, vjp)`` as :func:`npattn.attention_vjp`, over the ring: ``vjp(dout)``
    (collective; dout the rank's rows) returns the rank's ``(dq, dk, dv)``, then ``dbias``
    and ``dsink_logits`` when given. dk and dv are the gradients of the rank's own keys and
    values, summed over every rank's queries. ``dsink_logits`` is summed over all ranks
    (the logits are shared), as is ``dbias`` where the bias has one query row (it then
    broadcasts over every rank's rows: with one position per rank, a rank's own single row
    counts as such); a bias of the rank's own rows gets the rank's own gradient."""
    return _ring(q, k, v, comm, sharding, strategy, timeout, options, backward=True)


class _Ring:
    """The communicator seen as a ring: each rank sends to the next and receives from the
    previous, every wait bounded by ``timeout``. ``xp``: the module of the ranks' arrays;
    CuPy arrays travel through host memory (a copy to the host before each send, to the
    device once received: :meth:`arrived`), so any MPI will do, CUDA-aware or not."""

    def __init__(self, comm, timeout: float, xp=np):
        from mpi4py import MPI

        self.MPI, self.comm, self.timeout, self.xp = MPI, comm, float(timeout), xp
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.next, self.previous = (self.rank + 1) % self.size, (self.rank - 1) % self.size

    def host(self, array):
        """``array`` in host memory, C-contiguous (a copy for a device array)."""
        return np.ascontiguousarray(_arrays.to_numpy(array))

    def arrived(self, arrays: list) -> list:
        """Received (host) arrays as arrays of the ranks' module, once their requests are done."""
        return [self.xp.asarray(array) for array in arrays]

    def shift(self, arrays: list, shapes: list, tag: int) -> tuple[list, list]:
        """Start sending ``arrays`` (C-contiguous) to the next rank and receiving arrays of
        ``shapes`` (and the same dtypes) from the previous one; returns (the receiving
        arrays, in host memory: :meth:`arrived` gives them back in the ranks' module, and
        the requests to :meth:`wait` on)."""
        arrays = [self.host(array) for array in arrays]  # kept alive by their requests
        received = [np.empty(shape, array.dtype) for array, shape in zip(arrays, shapes)]
        requests = []
        for index, (sent, into) in enumerate(zip(arrays, received)):
            requests.append(self.comm.Irecv(into, source=self.previous, tag=tag + index))
            requests.append(self.comm.Isend(sent, dest=self.next, tag=tag + index))
        return received, requests

    def exchange(self, sends: list, shapes: list, dtype, tag: int) -> list:
        """All-to-all: ``sends[j]`` (C-contiguous) to rank j, an array of ``shapes[j]`` from
        each rank j back (this rank's own is copied), in rank order, in the ranks' module."""
        sends = [self.host(array) for array in sends]
        received = [np.empty(shape, dtype) for shape in shapes]
        requests = []
        for peer in range(self.size):
            if peer == self.rank:
                received[peer][...] = sends[peer]
                continue
            requests.append(self.comm.Irecv(received[peer], source=peer, tag=tag))
            requests.append(self.comm.Isend(sends[peer], dest=peer, tag=tag))
        self._poll(lambda: self.MPI.Request.Testall(requests), "the all-to-all exchange of head groups")
        return self.arrived(received)

    def wait(self, requests: list, what: str) -> None:
        self._poll(lambda: self.MPI.Request.Testall(requests),
                   f"{what} (from rank {self.previous}, to rank {self.next})")

    def _poll(self, done: Callable[[], bool], what: str) -> None:
        """Wait until ``done()``, polling (an MPI wait cannot time out), with a back-off from
        50 us to 5 ms, so that a long wait does not take a core from the ranks' kernels."""
        deadline, pause = time.monotonic() + self.timeout, 5e-5
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"ring attention: rank {self.rank} waited {self.timeout:g} s for {what}; a peer "
                                   "failed or did not make the same call. The communicator still holds the "
                                   "unanswered operation: end the job (comm.Abort()) rather than reuse it")
            time.sleep(pause)
            pause = min(2 * pause, 5e-3)

    def gather(self, value: Any) -> list:
        """Every rank's ``value`` (a small picklable object), in rank order, within the
        timeout: its pickle's size, then the pickles, through non-blocking all-gathers."""
        data = np.frombuffer(pickle.dumps(value), np.uint8)
        sizes = np.zeros(self.size, np.int64)
        request = self.comm.Iallgather(np.array([data.size], np.int64), sizes)
        self._poll(request.Test, "every rank to make the same call")
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        gathered = np.empty(int(sizes.sum()), np.uint8)
        request = self.comm.Iallgatherv(data, [gathered, sizes, offsets, self.MPI.BYTE])
        self._poll(request.Test, "every rank's description of its call")
        return [pickle.loads(gathered[start:start + size].tobytes()) for start, size in zip(offsets, sizes)]


class _Schedule(NamedTuple):
    """What every rank agreed on: the ranks' chunks and the options of the pair calls."""

    chunks: list            # rank -> [Chunk]
    kv_shapes: list         # rank -> (k shape, v shape), bhsd
    visibility: Visibility  # causal, window and sinks over the whole sequence
    q_offset: int           # the whole sequence's: query position i + q_offset (Sq == Sk: 0 by default)
    dropout_offset: tuple   # the whole problem's (b, h, i, j) offsets of the dropout hash
    xp: Any                 # numpy or cupy: the module of the shards and the array options
    plain: dict             # options passed to every pair call as they are (the agreed seed included)
    arrays: dict            # name -> array option (mask, bias, lengths, sink logits)


def _ring(q, k, v, comm, sharding, strategy, timeout, options, backward):
    if not all(hasattr(comm, name) for name in ("Get_rank", "Get_size", "Iallgather")):
        raise TypeError(f"comm must be an mpi4py communicator (MPI.COMM_WORLD or one split from it), got "
                        f"{type(comm).__name__} {comm!r}")
    timeout, timeout_error = _checked_timeout(timeout)
    try:
        local = _Local.of(q, k, v, sharding, strategy, options)
        described = local.description
    except Exception as error:  # anything: every rank must hear of it, or its peers would wait
        local, described = None, {"error": (type(error).__name__, str(error))}
    if timeout_error is not None and "error" not in described:
        described = {"error": ("ValueError", timeout_error)}
    ring = _Ring(comm, timeout, local.xp if local is not None else np)
    everyone = ring.gather(described)
    _raise_any(everyone)
    schedule = _agree(ring, local, everyone, sharding, strategy, options)
    xp, layout, (qb, kb, vb) = local.xp, local.layout, local.bhsd
    compute = np.dtype(np.float64) if qb.dtype == np.float64 else np.dtype(np.float32)
    qc, kc, vc = (xp.ascontiguousarray(x, dtype=compute) for x in (qb, kb, vb))
    if strategy == "heads":
        from . import heads

        agreed = {"seed": schedule.plain["seed"]} if "seed" in schedule.plain else {}
        out, lse, backward_of = heads.forward(ring, schedule, qc, kc, vc, {**options, **agreed}, backward)
    else:
        out, lse = _forward(ring, schedule, qc, kc, vc)
        backward_of = lambda dout: _backward(ring, schedule, qc, kc, vc, out, lse, dout)  # noqa: E731
    user_out = xp.ascontiguousarray(to_user_layout(out, layout)).astype(qb.dtype, copy=False)
    outputs = (user_out, lse.astype(compute, copy=False)) if options.get("return_lse") else user_out
    if not backward:
        return outputs, None

    def vjp(dout):
        try:  # every rank checks its own dout, then all hear of any rank's error
            dout_b = _checked_dout(dout, local, user_out)
            described = {"finite": True}
        except Exception as error:
            dout_b, described = None, {"error": (type(error).__name__, str(error))}
        _raise_any(ring.gather(described), what="dout")
        grads = backward_of(xp.ascontiguousarray(dout_b, dtype=compute))
        dq, dk, dv = (xp.ascontiguousarray(to_user_layout(g, layout)).astype(x.dtype, copy=False)
                      for g, x in zip(grads[:3], (qb, kb, vb)))
        return (dq, dk, dv, *grads[3:])
    return outputs, vjp


def _checked_timeout(timeout):
    """``(seconds, error)``: a finite timeout > 0 and None, or the default with the error
    every rank is then told of (a rank must still wait for its peers to hear it)."""
    if isinstance(timeout, (bool, np.bool_)) or not isinstance(timeout, Real):
        return DEFAULT_TIMEOUT, f"timeout must be a number of seconds > 0, got {type(timeout).__name__} {timeout!r}"
    if not (math.isfinite(timeout) and timeout > 0):
        return DEFAULT_TIMEOUT, f"timeout must be a finite number of seconds > 0, got {timeout!r}"
    return float(timeout), None


DEFAULT_TIMEOUT = 300.0
_ERRORS = {"ValueError": ValueError, "TypeError": TypeError, "MemoryError": MemoryError}


def _raise_any(everyone: list, what: str = "inputs") -> None:
    """Raise, on every rank alike, the first rank's error among the gathered descriptions."""
    for rank, theirs in enumerate(everyone):
        if "error" in theirs:
            kind, message = theirs["error"]
            raise _ERRORS.get(kind, ValueError)(f"ring attention: rank {rank}'s {what}: {message}")


def _checked_dout(dout, local, user_out):
    """The rank's ``dout`` as a bhsd array of its shards' kind, of out's shape and a float dtype."""
    (dout,) = checks.as_arrays(dout=dout, reference=local.bhsd[0])
    checks.check_float_dtype("dout", dout)
    if tuple(dout.shape) != tuple(user_out.shape):
        raise ValueError(f"dout must have out's shape {tuple(user_out.shape)}, got {tuple(dout.shape)}")
    if not _arrays.all_finite(dout):
        raise ValueError("dout holds NaN or inf; the ring takes finite inputs")
    return _bhsd(dout, local.layout)


def _bhsd(array, layout):
    return array.transpose(0, 2, 1, 3) if layout == "bshd" else array


STRATEGIES = ("ring", "heads")
# the options given as arrays that each rank passes, and those all ranks share
_SHARED_ARRAYS = _options.sharded("shared")


class _Local(NamedTuple):
    """One rank's inputs, checked on their own: the array module, the layout, q, k and v as
    bhsd views, the array options as arrays of the shards' kind, and the description of
    all that (shapes, dtypes, options, which inputs are not finite) the ranks exchange."""

    xp: Any
    layout: str
    bhsd: tuple
    arrays: dict
    description: dict

    @classmethod
    def of(cls, q, k, v, sharding, strategy, options) -> "_Local":
        """Everything a rank can check alone, raising the error its peers will hear of."""
        _options.check_names({name: value for name, value in options.items() if name != "backend"})
        check_sharding(sharding)
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        for name, why in _NOT_YET.items():
            value = options.get(name)
            if name == "return_weights":
                if value:
                    raise ValueError(f"ring attention does not return weights: {why}")
            elif value is not None and not (name == "q_offset" and checks.as_int(value) is not None):
                raise ValueError(f"ring attention does not take {name} yet: {why}")
        layout = checks.check_layout(options.get("layout", "bhsd"))
        q, k, v = checks.qkv_arrays(q, k, v, "(B, H, S_local, D) or (B, S_local, H, D)")
        qb, kb, vb = (_bhsd(x, layout) for x in (q, k, v))
        arrays = {name: checks.as_arrays(**{name: options[name]}, reference=q)[0]
                  for name in (*_PER_ROW_ARRAYS, *_SHARED_ARRAYS) if options.get(name) is not None}
        given = {name: value for name, value in options.items() if name not in (*_PER_ROW_ARRAYS, *_SHARED_ARRAYS)}
        nonfinite = [name for name, array in (("q", q), ("k", k), ("v", v), *arrays.items())
                     if array.dtype.kind == "f" and not _arrays.all_finite(array)]
        description = {
            "shapes": (qb.shape, kb.shape, vb.shape), "dtype": str(q.dtype), "kv_dtypes": (str(k.dtype), str(v.dtype)),
            "sharding": sharding, "strategy": strategy, "options": repr(sorted(given.items(), key=lambda kv: kv[0])),
            "shared": {name: _arrays.to_numpy(arrays[name]).tolist() for name in _SHARED_ARRAYS if name in arrays},
            "shared_dtypes": {name: str(arrays[name].dtype) for name in _SHARED_ARRAYS if name in arrays},
            "row_shapes": {name: tuple(arrays[name].shape) for name in _PER_ROW_ARRAYS if name in arrays},
            "row_dtypes": {name: str(arrays[name].dtype) for name in _PER_ROW_ARRAYS if name in arrays},
            "nonfinite": nonfinite,
            # dropout with seed=None: rank 0's draw becomes every rank's seed
            "drawn_seed": int(np.random.SeedSequence().generate_state(1, np.uint64)[0]),
        }
        return cls(_arrays.array_module(q), layout, (qb, kb, vb), arrays, description)


def _agree(ring: _Ring, local: _Local, everyone: list, sharding, strategy, options) -> _Schedule:
    """Check what every rank was given against rank 0's and against the whole problem;
    the checks read only the gathered descriptions, so every rank raises the same error
    or none. Returns the schedule all ranks share."""
    q = local.bhsd[0]
    for rank, theirs in enumerate(everyone):
        for field in ("dtype", "kv_dtypes", "sharding", "strategy", "options", "shared", "shared_dtypes"):
            if theirs[field] != everyone[0][field]:
                raise ValueError(f"ring attention: rank {rank}'s {field} differs from rank 0's: "
                                 f"{theirs[field]!r} against {everyone[0][field]!r}; every rank must make the same call")
        for field in ("row_shapes", "row_dtypes"):
            if set(theirs[field]) != set(everyone[0][field]):
                raise ValueError(f"ring attention: rank {rank} passes {sorted(theirs[field]) or 'no mask or bias'} and "
                                 f"rank 0 {sorted(everyone[0][field]) or 'no mask or bias'}; every rank must make the "
                                 "same call")
        (q_shape, k_shape, v_shape), (q0, k0, v0) = theirs["shapes"], everyone[0]["shapes"]
        if (q_shape[:2], q_shape[3], k_shape[:2], k_shape[3], v_shape[:2], v_shape[3]) != \
                (q0[:2], q0[3], k0[:2], k0[3], v0[:2], v0[3]):
            raise ValueError(f"ring attention: rank {rank}'s q, k, v shapes (bhsd) {theirs['shapes']} differ from "
                             f"rank 0's {everyone[0]['shapes']} in more than their sequence lengths")
        if not q_shape[2] == k_shape[2] == v_shape[2]:
            raise ValueError(f"ring attention: rank {rank}'s q, k and v hold {q_shape[2]}, {k_shape[2]} and "
                             f"{v_shape[2]} positions; a shard holds q, k and v for the same positions")
        if sharding == "zigzag" and (q_shape[2] % 2 or q_shape[2] != q0[2]):
            raise ValueError(f"ring attention: zigzag shards are two equal chunks of one length on every rank; "
                             f"rank {rank} holds {q_shape[2]} positions, rank 0 {q0[2]}")
        if theirs["nonfinite"]:
            raise ValueError(f"ring attention: rank {rank}'s {theirs['nonfinite'][0]} holds NaN or inf; the ring takes "
                             "finite inputs")
    if strategy == "heads":
        from .heads import check_heads

        check_heads(ring.size, q.shape[1], local.bhsd[1].shape[1], options)
    lengths = [theirs["shapes"][0][2] for theirs in everyone]
    total = sum(lengths)
    for rank, theirs in enumerate(everyone):
        for name, shape in theirs["row_shapes"].items():
            want = "bool" if name == "mask" else "a float dtype"
            dtype = theirs["row_dtypes"][name]
            if (dtype == "bool") != (name == "mask") or (name == "bias" and dtype not in checks.FLOAT_DTYPE_NAMES):
                raise ValueError(f"ring attention: rank {rank}'s {name} has dtype {dtype}; it must be {want}")
            full = (1,) * (4 - len(shape)) + tuple(shape)
            if len(shape) > 4 or full[2] not in (1, lengths[rank]) or full[3] not in (1, total):
                raise ValueError(f"ring attention: rank {rank}'s {name} has shape {shape}; it must broadcast to the "
                                 f"rank's rows of the whole problem, (B, H, {lengths[rank]}, {total})")
    _check_whole_problem(everyone[0], q, local.bhsd[1], local.bhsd[2], total, options)
    given = {name: value for name, value in options.items() if name not in (*_PER_ROW_ARRAYS, *_SHARED_ARRAYS)}
    plain = {name: value for name, value in given.items()
             if name not in ("layout", "return_lse", "causal", "q_offset", "window", "sinks", "dropout_offset")}
    if dropout_requested(options) and options.get("seed") is None:
        plain["seed"] = everyone[0]["drawn_seed"]
    return _Schedule(chunks=[chunks(rank, lengths, sharding) for rank in range(ring.size)],
                 kv_shapes=[(theirs["shapes"][1], theirs["shapes"][2]) for theirs in everyone],
                 visibility=Visibility.from_options(bool(options.get("causal", False)), options.get("window"),
                                                    int(options.get("sinks", 0))),
                 q_offset=int(checks.as_int(options.get("q_offset")) or 0),
                 dropout_offset=tuple(options.get("dropout_offset") or (0, 0, 0, 0)), xp=ring.xp, plain=plain,
                 arrays={name: (_four_d(array) if name in _PER_ROW_ARRAYS else array)
                         for name, array in local.arrays.items()})


def _check_whole_problem(description, q, k, v, total, options):
    """Every option as :func:`npattn.attention` checks it for the whole sequence (S = the
    ranks' lengths summed), on stand-ins of the whole problem's shapes and the values every
    rank shares, so every rank reaches the same verdict."""
    def stand_in(array, length):
        shape = (*array.shape[:2], length, array.shape[3])
        return np.broadcast_to(np.zeros((), np.dtype(description["dtype"])), shape)

    shared = {name: np.asarray(value, description["shared_dtypes"][name])
              for name, value in description["shared"].items()}
    plain = {name: _arrays.to_numpy(value) if _arrays.is_cupy(value) else value for name, value in options.items()
             if name not in (*_PER_ROW_ARRAYS, *_SHARED_ARRAYS, "backend", "layout")}
    build_problem(stand_in(q, total), stand_in(k, total), stand_in(v, total), **plain, **shared)


def _four_d(array):
    return array.reshape((1,) * (4 - array.ndim) + array.shape)


def _pairs(schedule: _Schedule, rank: int, owner: int, step: int):
    """The (query chunk, key chunk, options) calls rank ``rank`` makes on ``owner``'s block
    at ``step``, in a fixed order; pairs with no visible key left out."""
    for q_chunk in schedule.chunks[rank]:
        for k_chunk in schedule.chunks[owner]:
            visibility = _pair_visibility(schedule, q_chunk, k_chunk)
            if _sees_a_key(visibility, q_chunk.length, k_chunk.length):
                yield q_chunk, k_chunk, _pair_options(schedule, q_chunk, k_chunk, visibility)


def _pair_visibility(schedule: _Schedule, q_chunk: Chunk, k_chunk: Chunk) -> Visibility:
    """Causal, window and sinks as the pair's call sees them: its query row i sits at
    ``i + q_offset`` among its keys, where the whole sequence puts it, and the sinks are
    the first keys of the whole sequence that fall in its key chunk."""
    whole = schedule.visibility
    return dataclasses.replace(
        whole, q_offset=schedule.q_offset + q_chunk.global_start - k_chunk.global_start,
        sinks=max(0, min(whole.sinks - k_chunk.global_start, k_chunk.length)))


def _sees_a_key(visibility: Visibility, q_len: int, kv_len: int) -> bool:
    """Whether causal, window and sinks leave some row of the pair a key (bounds are
    monotone in the row: the first row's low and the last row's high bound the rest)."""
    lo, _ = visibility.key_range(0, q_len, kv_len)
    _, hi = visibility.key_range(q_len - 1, q_len, kv_len)
    return lo < hi or visibility.sink_end(q_len - 1, q_len, kv_len) > 0


def _pair_options(schedule: _Schedule, q_chunk: Chunk, k_chunk: Chunk, visibility: Visibility) -> dict:
    window = (visibility.window_left, visibility.window_right) if visibility.has_window else None
    options = dict(schedule.plain, causal=visibility.causal, q_offset=visibility.q_offset, window=window,
                   sinks=visibility.sinks)
    if schedule.plain.get("dropout_p"):  # the pair's rows and keys hash as the whole problem's
        b, h, i, j = schedule.dropout_offset
        options["dropout_offset"] = (b, h, i + q_chunk.global_start, j + k_chunk.global_start)
    rows = slice(q_chunk.local_start, q_chunk.local_start + q_chunk.length)
    columns = slice(k_chunk.global_start, k_chunk.global_start + k_chunk.length)
    for name in _PER_ROW_ARRAYS:
        if name in schedule.arrays:
            array = schedule.arrays[name]
            array = array[:, :, rows] if array.shape[2] > 1 else array
            options[name] = array[..., columns] if array.shape[3] > 1 else array
    if "q_lengths" in schedule.arrays:
        options["q_lengths"] = schedule.xp.clip(schedule.arrays["q_lengths"] - q_chunk.global_start, 0, q_chunk.length)
    if "kv_lengths" in schedule.arrays:
        options["kv_lengths"] = schedule.xp.clip(schedule.arrays["kv_lengths"] - k_chunk.global_start, 0, k_chunk.length)
    return options


def _rows(array, chunk: Chunk):
    return array[:, :, chunk.local_start:chunk.local_start + chunk.length]


def _around(ring: _Ring, blocks: list, sums: list, visit: Callable, shapes_of: Callable, tag: int) -> list:
    """Send the rank's own ``blocks`` once around the ring. At each step: start passing the
    blocks in hand on, ``visit(step, owner, blocks, parts)`` them, and wait for the next.

    With running ``sums`` (zeros of the blocks' shapes: dK and dV), the visit adds this
    rank's share of the owner's sums into ``parts``, fresh zeros; the owner's running sums
    meanwhile travel from the previous rank, which finished its share a step earlier. Once
    they are in, the rank adds its parts and passes the sums on without waiting for them to
    arrive: their transfer overlaps the next step's visit. After the last step the sums go
    one rank further, which brings each home. The sums add in ring order, whatever the
    timing. ``shapes_of(owner)`` gives the shapes of an owner's blocks (and of its sums).
    Returns the rank's own sums."""
    dtypes = [total.dtype for total in sums]
    sum_requests, received = None, None
    for step in range(ring.size):
        owner = (ring.rank - step) % ring.size
        following = (owner - 1) % ring.size  # whose block arrives next
        last = step == ring.size - 1
        if not last:
            incoming, requests = ring.shift(blocks, shapes_of(following), tag + 8 * step)
        parts = [ring.xp.zeros(shape, dtype) for shape, dtype in zip(shapes_of(owner), dtypes)] if sums else []
        visit(step, owner, blocks, parts)
        if sums:
            totals = parts  # step 0: the rank's own block, whose sums start here
            if sum_requests is not None:  # the owner's sums so far, from the previous rank
                ring.wait(sum_requests, f"the gradient sums of rank {owner}'s block")
                totals = [total + part for total, part in zip(ring.arrived(received), parts)]
            received, sum_requests = ring.shift(totals, shapes_of(following), tag + 8 * step + 4)
        if not last:
            ring.wait(requests, f"the K/V block of rank {following}")
            blocks = ring.arrived(incoming)
    if sums:
        ring.wait(sum_requests, "the gradient sums of this rank's own block")
        return ring.arrived(received)
    return sums


def _forward(ring: _Ring, schedule: _Schedule, q, k, v):
    """The rank's (out, lse), bhsd, in the compute dtype."""
    xp = schedule.xp
    batch, heads, _, _ = q.shape
    parts: dict = {}  # query chunk -> (out, lse) merged so far

    def visit(step, owner, blocks, sums):
        key_block, value_block = blocks
        for q_chunk, k_chunk, options in _pairs(schedule, ring.rank, owner, step):
            out, lse = attention(_rows(q, q_chunk), _rows(key_block, k_chunk), _rows(value_block, k_chunk),
                                 return_lse=True, **options)
            if q_chunk not in parts:
                parts[q_chunk] = (out, lse)
            else:  # fold in, in the fixed order of steps and chunks
                merged_out, merged_lse = parts[q_chunk]
                merge(xp.stack([merged_out, out]), xp.stack([merged_lse, lse]), merged_out, merged_lse)

    _around(ring, [k, v], [], visit, lambda owner: schedule.kv_shapes[owner], tag=100)
    for chunk in schedule.chunks[ring.rank]:  # rows no pair gave a key: out 0, lse -inf
        if chunk not in parts:
            parts[chunk] = (xp.zeros((batch, heads, chunk.length, v.shape[3]), q.dtype),
                            xp.full((batch, heads, chunk.length), -np.inf, q.dtype))
    out = xp.concatenate([parts[chunk][0] for chunk in schedule.chunks[ring.rank]], axis=2)
    lse = xp.concatenate([parts[chunk][1] for chunk in schedule.chunks[ring.rank]], axis=2)
    if "sink_logits" in schedule.arrays:
        # the sink is one more, value-less part of every row that saw a key, merged last:
        # given to one pair's call instead, it would be lost where that pair hides the row's keys
        seen = lse > -np.inf
        sink = xp.where(seen, schedule.arrays["sink_logits"].astype(lse.dtype)[None, :, None], -np.inf)
        merge(xp.stack([out, xp.zeros_like(out)]), xp.stack([lse, sink]), out, lse)
    return out, lse


def _backward(ring: _Ring, schedule: _Schedule, q, k, v, out, lse, dout):
    """The rank's gradients: [dq, dk, dv] bhsd in the compute dtype, then dbias and
    dsink_logits when given."""
    xp = schedule.xp
    dq = xp.zeros_like(q)
    dbias = xp.zeros(schedule.arrays["bias"].shape, q.dtype) if "bias" in schedule.arrays else None

    def visit(step, owner, blocks, sums):
        key_block, value_block = blocks
        dk_sum, dv_sum = sums
        for q_chunk, k_chunk, options in _pairs(schedule, ring.rank, owner, step):
            grads = attention_backward(_rows(q, q_chunk), _rows(key_block, k_chunk), _rows(value_block, k_chunk),
                                       _rows(out, q_chunk), _rows(lse, q_chunk), _rows(dout, q_chunk), **options)
            _rows(dq, q_chunk)[...] += grads[0]
            _rows(dk_sum, k_chunk)[...] += grads[1]
            _rows(dv_sum, k_chunk)[...] += grads[2]
            if dbias is not None:
                _add_bias_gradient(dbias, grads[3], q_chunk, k_chunk)

    # dK and dV sums travel with their block and reach its owner one step after the turn
    home = _around(ring, [k, v], [xp.zeros_like(k), xp.zeros_like(v)], visit, lambda owner: schedule.kv_shapes[owner],
                   tag=1000)
    grads = [dq, *home]
    if dbias is not None:
        grads.append(_shared_sum(ring, dbias) if dbias.shape[2] == 1 else dbias)
    if "sink_logits" in schedule.arrays:
        grads.append(_shared_sum(ring, _sink_gradient(schedule.arrays["sink_logits"].astype(q.dtype), out, lse, dout)))
    return grads


def _sink_gradient(sink_logits, out, lse, dout):
    """The rank's rows' share of d(sum(out * dout)) / d(sink_logits): a value-less column of
    probability ``P = exp(sink - lse)`` scales every other weight by ``1 - P``, so each row
    adds ``-P * rowsum(dout * out)``; rows that saw no key (lse -inf) add nothing."""
    xp = _arrays.array_module(out)
    seen = lse > -np.inf
    probability = xp.exp(xp.where(seen, sink_logits[None, :, None] - xp.where(seen, lse, 0.0), -np.inf))
    delta = (dout * out).sum(axis=-1)
    return -(probability * delta).sum(axis=(0, 2))


def _add_bias_gradient(dbias, grad, q_chunk: Chunk, k_chunk: Chunk) -> None:
    """Add a pair call's bias gradient (the pair's slice of the bias, as given) into the rank's."""
    grad = _four_d(grad)
    target = dbias[:, :, q_chunk.local_start:q_chunk.local_start + q_chunk.length] if dbias.shape[2] > 1 else dbias
    if dbias.shape[3] > 1:
        target = target[..., k_chunk.global_start:k_chunk.global_start + k_chunk.length]
    target += grad


def _shared_sum(ring: _Ring, array):
    """The sum over the ranks of ``array`` (the gradient of a value all ranks share), in
    rank order: the same bits on every rank and every run."""
    total = np.zeros(array.shape, array.dtype)
    for part in ring.gather(ring.host(array)):
        total += part
    return ring.xp.asarray(total)
