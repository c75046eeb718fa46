"""Every argument check of :func:`npattn.attention`, run before any kernel.

q, k and v are checked here; every keyword option through its entry in
:data:`npattn.core.options.OPTIONS` (in table order), with the checks of
:mod:`npattn.core.checks`. Each error names the argument, what was expected and what was
received, e.g. ``ValueError: k has 3 heads, which does not divide q's 8 heads``.
Nothing here modifies an input: arrays are only viewed (transposed, reshaped to 4-D).
"""
from __future__ import annotations

import numpy as np

from . import arrays as _arrays
from . import checks
from . import options as _options
from .masks import row_shifts
from .problem import AttentionProblem, accumulate_dtype_of

_AXES = {"bhsd": "(B, H, S, D)", "bshd": "(B, S, H, D)"}


def build_problem(q, k, v, **options) -> AttentionProblem:
    """Check q, k, v and every option of :func:`npattn.attention` (keywords of
    :data:`npattn.core.options.OPTIONS`; absent ones take their defaults) and normalize them."""
    _options.check_names(options)
    layout = checks.check_layout(options.get("layout", _options.BY_NAME["layout"].default))
    q, k, v = checks.qkv_arrays(q, k, v, f"{_AXES[layout]} in layout {layout!r}")
    user_arrays = {"q": q, "k": k, "v": v}
    if layout == "bshd":
        q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
    paged = options.get("block_table") is not None  # k and v are pools of pages: (pages, Hkv, page_size, D)
    checks.check_qkv_shapes(q, k, v, layout, paged)
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    if paged:
        table_shape = np.shape(options["block_table"])
        kv_len *= table_shape[1] if len(table_shape) == 2 else 0  # (the option's check names a bad shape)
    call = _options.Call(q=q, batch=batch, heads=heads, q_len=q_len, kv_len=kv_len, head_dim=head_dim,
                         compute=accumulate_dtype_of(q.dtype), checked={}, pages=k.shape[0] if paged else 0)
    for option in _options.OPTIONS:
        call.checked[option.name] = option.check(options.get(option.name, option.default), call)
    fields = {option.field: call.checked[option.name] for option in _options.OPTIONS if option.field}
    fields["row_shifts"] = row_shifts(call.checked["q_offset"], call.checked["q_start"], call.checked["kv_start"])
    bias = options.get("bias")
    if call.checked["check_finite"]:
        if bias is not None:  # in the user's shape, for the index the error names
            user_arrays["bias"] = call.checked["bias"].reshape(np.shape(bias))
        for name, array in user_arrays.items():
            checks.check_all_finite(name, array)
    return AttentionProblem(xp=_arrays.array_module(q), q=q, k=k, v=v,
                            visibility=_options.visibility(call.checked),
                            bias_shape=None if bias is None else tuple(np.shape(bias)), **fields)


def check_cotangent(name, grad, expected_like, expected_shape):
    """Check a gradient handed to a vjp: same array kind as ``expected_like``, float, exact shape."""
    (grad,) = checks.as_arrays(**{name: grad}, reference=expected_like)
    checks.check_float_dtype(name, grad)
    if tuple(grad.shape) != tuple(expected_shape):
        raise ValueError(f"{name} must have the output's shape {tuple(expected_shape)}, "
                         f"got {tuple(grad.shape)}")
    return grad
