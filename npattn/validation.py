"""Every argument check of :func:`npattn.attention`, run before any kernel.

Each error names the argument, what was expected and what was received, e.g.
``ValueError: k has 3 heads, which does not divide q's 8 heads``. Nothing here
modifies an input: arrays are only viewed (transposed, reshaped to 4-D).
"""
from __future__ import annotations

import math
from numbers import Integral, Real

import numpy as np

from . import _arrays
from .masks import Visibility
from .problem import AttentionProblem, accumulate_dtype_of

LAYOUTS = ("bhsd", "bshd")
FLOAT_DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64")
_AXES = {"bhsd": "(B, H, S, D)", "bshd": "(B, S, H, D)"}


def build_problem(q, k, v, *, causal=False, window=None, sinks=0, sink_logits=None, mask=None,
                  bias=None, alibi_slopes=None, q_lengths=None, kv_lengths=None, scale=None,
                  softcap=None, dropout_p=0.0, seed=None, layout="bhsd", return_lse=False,
                  return_weights=False) -> AttentionProblem:
    """Check every argument of :func:`npattn.attention` and normalize it (see its docstring)."""
    layout = _check_layout(layout)
    q, k, v = _as_arrays(q=q, k=k, v=v)
    xp = _arrays.array_module(q)
    for name, array in (("q", q), ("k", k), ("v", v)):
        _check_float_dtype(name, array)
        if array.ndim != 4:
            raise ValueError(f"{name} must be 4-D {_AXES[layout]} in layout {layout!r}, "
                             f"got {array.ndim}-D shape {tuple(array.shape)}")
    for name, array in (("k", k), ("v", v)):
        if array.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {array.dtype} but q has {q.dtype}; "
                            "q, k and v must share one dtype")
    if layout == "bshd":
        q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
    _check_qkv_shapes(q, k, v, layout)
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    target = (batch, heads, q_len, kv_len)

    # Bounds past every distance in the problem mean "no bound": clamping them keeps the
    # kernels' int64 (and the GPU's int32) positions from overflowing.
    reach = q_len + kv_len
    visibility = Visibility.from_options(_check_bool("causal", causal), _check_window(window, reach),
                                         min(_check_count("sinks", sinks), kv_len))
    dropout_p = _check_dropout_p(dropout_p)
    compute = accumulate_dtype_of(q.dtype)
    return AttentionProblem(
        xp=xp, q=q, k=k, v=v, layout=layout,
        scale=_check_scale(scale, head_dim, compute),
        visibility=visibility,
        sink_logits=_check_finite_values(
            "sink_logits", _check_vector("sink_logits", sink_logits, q, (heads,), "(H,)"), compute),
        mask=_check_broadcastable("mask", mask, q, target, want_bool=True),
        bias=_check_broadcastable("bias", bias, q, target, want_bool=False),
        bias_shape=None if bias is None else tuple(np.shape(bias)),
        alibi_slopes=_check_alibi(alibi_slopes, q, batch, heads, reach, compute),
        q_lengths=_check_lengths("q_lengths", q_lengths, q, batch, q_len, "Sq"),
        kv_lengths=_check_lengths("kv_lengths", kv_lengths, q, batch, kv_len, "Sk"),
        softcap=_check_softcap(softcap, compute),
        dropout_p=dropout_p,
        seed=_check_seed(seed, dropout_p),
        return_lse=_check_bool("return_lse", return_lse),
        return_weights=_check_bool("return_weights", return_weights),
    )


def check_cotangent(name, grad, expected_like, expected_shape):
    """Check a gradient handed to a vjp: same array kind as ``expected_like``, float, exact shape."""
    (grad,) = _as_arrays(**{name: grad}, reference=expected_like)
    _check_float_dtype(name, grad)
    if tuple(grad.shape) != tuple(expected_shape):
        raise ValueError(f"{name} must have the output's shape {tuple(expected_shape)}, "
                         f"got {tuple(grad.shape)}")
    return grad


def _check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def _as_array(name, value):
    """``value`` itself if it is a NumPy or CuPy array, else ``np.asarray(value)``, with
    NumPy's complaint about a ragged or odd array-like turned into one naming ``name``.
    A NumPy array in the other byte order is copied once to the machine's, so every
    backend, and every dtype comparison, sees native numbers."""
    if _arrays.is_cupy(value):
        return value
    if not isinstance(value, np.ndarray):
        try:
            value = np.asarray(value)
        except (ValueError, TypeError) as error:
            raise ValueError(f"{name} must be an array or a nested sequence of numbers of one shape, "
                             f"got a {type(value).__name__} NumPy cannot read as one: {error}") from None
    if not value.dtype.isnative:
        value = value.astype(value.dtype.newbyteorder("="))
    return value


def _as_arrays(reference=None, **named):
    """NumPy/CuPy arrays for each named input; array-likes become NumPy arrays.
    All must be of one kind: the kind of ``reference`` when given, else the first's."""
    arrays = [_as_array(name, a) for name, a in named.items()]
    first_name, first = next(iter(named)), arrays[0]
    if reference is not None:
        first_name, first = "q", reference
    for name, array in zip(named, arrays):
        if _arrays.array_kind(array) != _arrays.array_kind(first):
            raise TypeError(f"{name} is a {_arrays.array_kind(array)} array but {first_name} is a "
                            f"{_arrays.array_kind(first)} array; mixing NumPy and CuPy arrays is "
                            "not supported (move them to one device first)")
    return arrays


def _check_float_dtype(name, array):
    if array.dtype.name not in FLOAT_DTYPE_NAMES:
        raise TypeError(f"{name} must be a floating-point array ({', '.join(FLOAT_DTYPE_NAMES)}), "
                        f"got dtype {array.dtype}")


def _check_qkv_shapes(q, k, v, layout):
    """Shape agreement, with shapes reported back in the user's layout."""
    def user(shape):
        return tuple(shape[i] for i in ((0, 2, 1, 3) if layout == "bshd" else (0, 1, 2, 3)))

    batch, heads, _, head_dim = q.shape
    for name, array in (("k", k), ("v", v)):
        if array.shape[0] != batch:
            raise ValueError(f"{name} has batch size {array.shape[0]} but q has {batch} "
                             f"(q {user(q.shape)}, {name} {user(array.shape)})")
    if heads < 1 or k.shape[1] < 1:
        raise ValueError(f"q and k need at least one head, got q {user(q.shape)} and k {user(k.shape)}")
    if heads % k.shape[1]:
        raise ValueError(f"k has {k.shape[1]} heads, which does not divide q's {heads} heads")
    if v.shape[1] != k.shape[1]:
        raise ValueError(f"v has {v.shape[1]} heads but k has {k.shape[1]}; they must match")
    if v.shape[2] != k.shape[2]:
        raise ValueError(f"v has {v.shape[2]} keys (Sk) but k has {k.shape[2]}; they must match")
    if k.shape[3] != head_dim:
        raise ValueError(f"k has head dim {k.shape[3]} but q has {head_dim}; they must match")
    if head_dim < 1 or v.shape[3] < 1:
        raise ValueError(f"head dims must be at least 1, got q's D = {head_dim} and v's Dv = {v.shape[3]}")


def _check_bool(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def _check_count(name, value):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be a non-negative int, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value}")
    return int(value)


def _check_window(window, reach):
    """None, an int w >= 0, or a (left, right) pair of ints >= 0 or None; bounds above
    ``reach`` (Sq + Sk, beyond any query-key distance) become ``reach``."""
    if window is None:
        return None
    if isinstance(window, (tuple, list)):
        if len(window) != 2:
            raise ValueError(f"window must be None, an int or a (left, right) pair, got {window!r}")
        bounds = tuple(None if w is None else _window_bound(w, window, reach) for w in window)
        return bounds
    return _window_bound(window, window, reach)


def _window_bound(bound, window, reach):
    if isinstance(bound, (bool, np.bool_)) or not isinstance(bound, Integral):
        raise TypeError(f"window must be None, an int or a (left, right) pair of ints or None, got {window!r}")
    if bound < 0:
        raise ValueError(f"window must be non-negative, got {window!r}")
    return min(int(bound), reach)


def _check_real(name, value):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def _check_representable(name, value, compute):
    """``value`` must keep its meaning in the ``compute`` dtype: not past its largest finite value."""
    largest = float(np.finfo(compute).max)
    if abs(value) > largest:
        raise ValueError(f"{name} must be at most {largest:.4g} in magnitude for inputs computed in "
                         f"{compute} (it would become infinite), got {value!r}")
    return value


def _check_scale(scale, head_dim, compute):
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    return _check_representable("scale", _check_real("scale", scale), compute)


def _check_softcap(softcap, compute):
    """None or 0 turn soft-capping off (0 as in FlashAttention); otherwise it must be positive
    and a normal number of the ``compute`` dtype (scores are divided by it)."""
    if softcap is None:
        return None
    softcap = _check_representable("softcap", _check_real("softcap", softcap), compute)
    if softcap < 0:
        raise ValueError(f"softcap must be positive (or None/0 for none), got {softcap}")
    smallest = float(np.finfo(compute).tiny)
    if 0 < softcap < smallest:
        raise ValueError(f"softcap must be at least {smallest:.4g} for inputs computed in {compute} "
                         f"(scores are divided by it), got {softcap!r}")
    return softcap or None


def _check_dropout_p(dropout_p):
    dropout_p = _check_real("dropout_p", dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return dropout_p


def _check_seed(seed, dropout_p):
    """An int (any size: it is taken mod 2**64), or None: a fresh random seed when dropout is on."""
    if seed is None:
        return int(np.random.SeedSequence().generate_state(1, np.uint64)[0]) if dropout_p else 0
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, Integral):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__} {seed!r}")
    return int(seed)


def _broadcast_4d(name, array, target):
    """A 4-D view of ``array`` that broadcasts to ``target`` without growing it."""
    shape = tuple(array.shape)
    if array.ndim > 4 or any(s not in (1, t) for s, t in zip(shape[::-1], target[::-1])):
        raise ValueError(f"{name} of shape {shape} does not broadcast to (B, H, Sq, Sk) = {target}")
    return array.reshape((1,) * (4 - array.ndim) + shape)


def _check_broadcastable(name, array, q, target, *, want_bool):
    if array is None:
        return None
    (array,) = _as_arrays(**{name: array}, reference=q)
    if want_bool and array.dtype != np.bool_:
        raise TypeError(f"{name} must be a bool array (True = may attend), got dtype {array.dtype}; "
                        "pass an additive float mask as bias=")
    if not want_bool:
        _check_float_dtype(name, array)
    return _broadcast_4d(name, array, target)


def _check_vector(name, array, q, shape, described):
    if array is None:
        return None
    (array,) = _as_arrays(**{name: array}, reference=q)
    _check_float_dtype(name, array)
    if tuple(array.shape) != shape:
        raise ValueError(f"{name} must have shape {described} = {shape}, got {tuple(array.shape)}")
    return array


def _check_finite_values(name, array, compute, reach=1):
    """Every element of ``array`` (None passes) finite, and times ``reach`` still finite in
    the ``compute`` dtype; the error names the first offending element."""
    if array is None:
        return None
    host = np.asarray(_arrays.to_numpy(array), np.float64)
    largest = float(np.finfo(compute).max) / max(reach, 1)
    bad = np.argwhere(~(np.abs(host) <= largest))  # catches NaN too
    if bad.size:
        where = tuple(int(i) for i in bad[0])
        limit = f"finite in {compute}" if reach <= 1 else f"at most {largest:.4g} in magnitude (Sq + Sk = {reach} times it must stay finite in {compute})"
        raise ValueError(f"{name} must be {limit}, got {name}[{', '.join(map(str, where))}] = {float(host[where])!r}")
    return array


def _check_alibi(slopes, q, batch, heads, reach, compute):
    """(H,) or (B, H) slopes, broadcast to (B, H); each times the longest distance
    (``reach`` = Sq + Sk) must stay finite in the ``compute`` dtype."""
    if slopes is None:
        return None
    (slopes,) = _as_arrays(alibi_slopes=slopes, reference=q)
    _check_float_dtype("alibi_slopes", slopes)
    if tuple(slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes must have shape (H,) = ({heads},) or (B, H) = ({batch}, {heads}), "
                         f"got {tuple(slopes.shape)}")
    _check_finite_values("alibi_slopes", slopes, compute, reach)
    xp = _arrays.array_module(slopes)
    return xp.broadcast_to(slopes, (batch, heads))


def _check_lengths(name, lengths, q, batch, limit, limit_name):
    if lengths is None:
        return None
    (lengths,) = _as_arrays(**{name: lengths}, reference=q)
    if lengths.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array of shape (B,), got dtype {lengths.dtype}")
    if tuple(lengths.shape) != (batch,):
        raise ValueError(f"{name} must have shape (B,) = ({batch},), got {tuple(lengths.shape)}")
    host = _arrays.to_numpy(lengths)
    bad = np.flatnonzero((host < 0) | (host > limit))
    if bad.size:
        raise ValueError(f"{name} must lie in [0, {limit_name}] = [0, {limit}], "
                         f"got {name}[{bad[0]}] = {host[bad[0]]}")
    return lengths.astype(np.int64)
