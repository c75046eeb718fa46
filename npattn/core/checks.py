"""The argument checks :mod:`npattn.core.options` and :mod:`npattn.core.validation` are built from.

Each check takes a user's value and returns it normalized, or raises an error that names
the argument, what was expected and what was received, e.g. ``ValueError: window must
be non-negative, got -1``. Nothing here modifies an input: arrays are only viewed
(reshaped to 4-D, broadcast) or, for array-likes and the other byte order, copied.
"""
from __future__ import annotations

import math
import operator
from numbers import Integral, Real

import numpy as np

from . import arrays as _arrays

LAYOUTS = ("bhsd", "bshd")
FLOAT_DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64")


def check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def as_array(name, value):
    """``value`` itself if it is a NumPy or CuPy array, else ``np.asarray(value)``, with
    NumPy's complaint about a ragged or odd array-like turned into one naming ``name``.
    A NumPy array in the other byte order is copied once to the machine's, so every
    backend, and every dtype comparison, sees native numbers."""
    if _arrays.is_cupy(value):
        return value
    if not isinstance(value, np.ndarray):
        if _arrays.is_torch_bfloat16(value):  # NumPy has no bfloat16 of its own to take it as
            return _arrays.torch_bfloat16_to_numpy(name, value)
        try:
            value = np.asarray(value)
        except (ValueError, TypeError) as error:
            raise ValueError(f"{name} must be an array or a nested sequence of numbers of one shape, "
                             f"got a {type(value).__name__} NumPy cannot read as one: {error}") from None
    if not value.dtype.isnative:
        value = value.astype(value.dtype.newbyteorder("="))
    return value


def as_arrays(reference=None, **named):
    """NumPy/CuPy arrays for each named input; array-likes become NumPy arrays.
    All must be of one kind: the kind of ``reference`` when given, else the first's."""
    values = list(named.values())
    if (all(type(a) is np.ndarray and a.dtype.isnative for a in values)
            and (reference is None or type(reference) is np.ndarray)):
        return values  # plain NumPy arrays, the common case: nothing to convert or compare
    arrays = [as_array(name, a) for name, a in named.items()]
    first_name, first = next(iter(named)), arrays[0]
    if reference is not None:
        first_name, first = "q", reference
    for name, array in zip(named, arrays):
        if _arrays.array_kind(array) != _arrays.array_kind(first):
            raise TypeError(f"{name} is a {_arrays.array_kind(array)} array but {first_name} is a "
                            f"{_arrays.array_kind(first)} array; mixing NumPy and CuPy arrays is "
                            "not supported (move them to one device first)")
    return arrays


# NumPy's own float dtypes, compared directly: dtype.name builds a string (5 us a call)
_NUMPY_FLOATS = frozenset(np.dtype(name) for name in ("float16", "float32", "float64"))


def check_float_dtype(name, array):
    if array.dtype in _NUMPY_FLOATS:
        return
    if array.dtype.name not in FLOAT_DTYPE_NAMES:  # bfloat16 (ml_dtypes) and the rest
        raise TypeError(f"{name} must be a floating-point array ({', '.join(FLOAT_DTYPE_NAMES)}), "
                        f"got dtype {array.dtype}")


def qkv_arrays(q, k, v, described):
    """q, k and v as 4-D float arrays of one kind and one dtype (``described``: their axes,
    for the error), or an error naming the first that is not."""
    q, k, v = as_arrays(q=q, k=k, v=v)
    for name, array in (("q", q), ("k", k), ("v", v)):
        check_float_dtype(name, array)
        if array.ndim != 4:
            raise ValueError(f"{name} must be 4-D {described}, got {array.ndim}-D shape {tuple(array.shape)}")
    for name, array in (("k", k), ("v", v)):
        if array.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {array.dtype} but q has {q.dtype}; q, k and v must share one dtype")
    return q, k, v


def check_qkv_shapes(q, k, v, layout, paged=False):
    """Shape agreement, with shapes reported back in the user's layout (``paged``: k and v
    are pools of pages, whose first axis counts pages, not batch entries)."""
    def user(shape):
        return tuple(shape[i] for i in ((0, 2, 1, 3) if layout == "bshd" else (0, 1, 2, 3)))

    batch, heads, _, head_dim = q.shape
    if paged and v.shape[0] != k.shape[0]:
        raise ValueError(f"v has {v.shape[0]} pages but k has {k.shape[0]}; they must match")
    for name, array in (("k", k), ("v", v)):
        if not paged and array.shape[0] != batch:
            raise ValueError(f"{name} has batch size {array.shape[0]} but q has {batch} "
                             f"(q {user(q.shape)}, {name} {user(array.shape)})")
    if heads < 1 or k.shape[1] < 1:
        raise ValueError(f"q and k need at least one head, got q {user(q.shape)} and k {user(k.shape)}")
    if heads % k.shape[1]:
        raise ValueError(f"k has {k.shape[1]} heads, which does not divide q's {heads} heads")
    if v.shape[1] != k.shape[1]:
        raise ValueError(f"v has {v.shape[1]} heads but k has {k.shape[1]}; they must match")
    if v.shape[2] != k.shape[2]:
        what = "keys per page" if paged else "keys (Sk)"
        raise ValueError(f"v has {v.shape[2]} {what} but k has {k.shape[2]}; they must match")
    if k.shape[3] != head_dim:
        raise ValueError(f"k has head dim {k.shape[3]} but q has {head_dim}; they must match")
    if head_dim < 1 or v.shape[3] < 1:
        raise ValueError(f"head dims must be at least 1, got q's D = {head_dim} and v's Dv = {v.shape[3]}")


def as_int(value):
    """``value`` as a Python int when it is one: an int, a NumPy integer, or a 0-d integer
    array or tensor (anything with ``__index__`` but a bool); None otherwise. Lets a
    ``window=np.array(2)`` or ``q_offset=torch.tensor(1)`` mean what it says."""
    if type(value) is int:  # the common case, first
        return value
    if type(value) is np.ndarray:  # (the checks below cost an array 3 us: str of its dtype, an ABC test)
        return operator.index(value) if value.ndim == 0 and value.dtype.kind in "iu" else None
    if isinstance(value, (bool, np.bool_)) or "bool" in str(getattr(value, "dtype", "")):
        return None
    if isinstance(value, Integral):
        return int(value)
    if getattr(value, "ndim", None) != 0:
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def int_array(name, value, reference, described):
    """``value`` as an integer array of ``reference``'s kind (NumPy or CuPy), in its own
    integer dtype (not converted: a uint64 2**63 must not wrap before it is compared)."""
    (array,) = as_arrays(**{name: value}, reference=reference)
    if array.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array {described}, got dtype {array.dtype}")
    return array


def check_int_range(name, array, low, high, limit="", bounds=None):
    """Raise ValueError naming the first element of the integer ``array`` outside
    ``[low, high]`` (Python ints: compared in the array's own dtype, which NumPy does
    without overflow, so a uint64 2**63 or an int64 -2**63 is reported as it is).
    ``bounds``: how the message writes the interval (default ``[low, high]``), then ``limit``."""
    host = _arrays.to_numpy(array)
    if not host.size or (host.min() >= low and host.max() <= high):  # two reductions, no mask
        return array
    bad = np.argwhere((host < low) | (host > high))
    if bad.size:
        where = tuple(int(i) for i in bad[0])
        index = f"[{', '.join(map(str, where))}]" if where else ""
        bounds = f"[{low}, {high}]" if bounds is None else bounds
        raise ValueError(f"{name} must lie in {bounds}{limit}, got {name}{index} = {int(host[where])}")
    return array


def structure_of(array):
    """``(exact, compared)`` of an array (None for None), for a plan's check that later
    arrays are laid out as the one it was made for: ``exact`` (type, dtype, shape,
    strides) is the fast first test, ``compared`` the same with the strides of length-1
    axes as 0 (they address nothing, and NumPy leaves them arbitrary: two C-contiguous
    arrays of one shape may differ there)."""
    if array is None:
        return None
    exact = (type(array), array.dtype, array.shape, array.strides)
    return exact, exact[:3] + (tuple(0 if size == 1 else stride for size, stride in zip(array.shape, array.strides)),)


def exact_structures(*arrays) -> tuple:
    """Each array's ``exact`` of :func:`structure_of` (None for None), as one tuple: a plan
    holding its arrays' tuple passes a run whose tuple is equal with one comparison
    (1 us for five arrays, where :func:`check_structure` on each costs 2), and checks each
    array only when it differs, to name the one that does."""
    try:
        # (a list made first: a generator into tuple() costs 0.15 us more)
        return tuple([None if array is None else (type(array), array.dtype, array.shape, array.strides)
                      for array in arrays])
    except AttributeError:  # not an array: the checks one by one name it
        return ()


def check_structure(name, array, expected):
    """Raise ValueError naming ``name`` unless ``array`` has the ``expected`` structure (of
    :func:`structure_of`; None: the plan was made without this array)."""
    if expected is None or array is None:
        if expected is None and array is None:
            return
        raise ValueError(f"{name} is {'None' if array is None else 'given'}, but the plan was made "
                         f"{'without' if expected is None else 'with'} it")
    exact, compared = expected
    if (type(array) is exact[0] and array.dtype == exact[1] and array.shape == exact[2]
            and array.strides == exact[3]):
        return
    got = structure_of(array)[1] if hasattr(array, "strides") and hasattr(array, "dtype") else None
    if got == compared:
        return
    kind, dtype, shape, strides = compared
    described = (f"{type(array).__name__} {array.dtype} shape {tuple(array.shape)} strides {got[3]}"
                 if got is not None else f"a {type(array).__name__}")
    raise ValueError(f"{name} is {described}, but the plan was made for {kind.__name__} {dtype} shape {tuple(shape)} "
                     f"strides {strides} (0: a length-1 axis): make a plan for arrays of another structure")


def check_bool(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def check_count(name, value):
    number = as_int(value)
    if number is None:
        raise TypeError(f"{name} must be a non-negative int, got {type(value).__name__} {value!r}")
    value = number
    if value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value}")
    return int(value)


def check_real(name, value):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def check_representable(name, value, compute):
    """``value`` must keep its meaning in the ``compute`` dtype: not past its largest finite value."""
    largest = float(np.finfo(compute).max)
    if abs(value) > largest:
        raise ValueError(f"{name} must be at most {largest:.4g} in magnitude for inputs computed in "
                         f"{compute} (it would become infinite), got {value!r}")
    return value


def broadcast_4d(name, array, target):
    """A 4-D view of ``array`` that broadcasts to ``target`` without growing it."""
    shape = tuple(array.shape)
    if array.ndim > 4 or any(s not in (1, t) for s, t in zip(shape[::-1], target[::-1])):
        raise ValueError(f"{name} of shape {shape} does not broadcast to (B, H, Sq, Sk) = {target}")
    return array.reshape((1,) * (4 - array.ndim) + shape)


def check_broadcastable(name, array, q, target, *, want_bool):
    if array is None:
        return None
    (array,) = as_arrays(**{name: array}, reference=q)
    if want_bool and array.dtype != np.bool_:
        raise TypeError(f"{name} must be a bool array (True = may attend), got dtype {array.dtype}; "
                        "pass an additive float mask as bias=")
    if not want_bool:
        check_float_dtype(name, array)
    return broadcast_4d(name, array, target)


def check_vector(name, array, q, shape, described):
    if array is None:
        return None
    (array,) = as_arrays(**{name: array}, reference=q)
    check_float_dtype(name, array)
    if tuple(array.shape) != shape:
        raise ValueError(f"{name} must have shape {described} = {shape}, got {tuple(array.shape)}")
    return array


def check_finite_values(name, array, compute, reach=1):
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


def check_all_finite(name, array):
    """Raise a ValueError naming ``array``'s first NaN or inf (in C order of its own
    indices), as ``check_finite=True`` asks; None passes. Costs a min and a max over it."""
    if _arrays.all_finite(array):  # the common case, without a mask
        return
    finite = _arrays.to_numpy(_arrays.array_module(array).isfinite(array))
    where = np.unravel_index(int(np.argmin(finite)), finite.shape)
    where = tuple(int(i) for i in where)
    value = float(_arrays.to_numpy(array[where]))
    raise ValueError(f"{name} must be finite (check_finite=True), got {name}[{', '.join(map(str, where))}] "
                     f"= {value!r}")


def check_lengths(name, lengths, q, batch, limit, limit_name):
    if lengths is None:
        return None
    (lengths,) = as_arrays(**{name: lengths}, reference=q)
    if lengths.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array of shape (B,), got dtype {lengths.dtype}")
    if tuple(lengths.shape) != (batch,):
        raise ValueError(f"{name} must have shape (B,) = ({batch},), got {tuple(lengths.shape)}")
    check_int_range(name, lengths, 0, limit, bounds=f"[0, {limit_name}] = [0, {limit}]")
    return lengths.astype(np.int64)
