"""Neural-network functions as fused autograd nodes, with torch.nn.functional's signatures
where one exists: linear, softmax, log_softmax, cross_entropy, layer_norm, rms_norm,
dropout, embedding, and attention (one node around :func:`npattn.attention_vjp`).

Each is one :class:`~npattn.autograd.function.Function` with a closed-form backward
rather than a chain of elementwise nodes: fewer temporaries and one rounding path.
"""
from __future__ import annotations

from ..core.arrays import array_module
from .function import Function, as_tensor, cpu_kernel_takes
from .tensor import Tensor, is_grad_enabled


def _matmul_rows(a, b):
    """``a @ b`` for a (..., k) and a matrix b (k, n), as one matrix product of a's rows: NumPy
    runs a stacked ``a @ b`` as one BLAS call per leading index (a (32, 45, 384) @ (384, 1536)
    took 15.9 ms against 9.1 ms flattened)."""
    if a.ndim <= 2:
        return a @ b
    return (a.reshape(-1, a.shape[-1]) @ b).reshape(*a.shape[:-1], b.shape[-1])


class _Linear(Function):
    def forward(self, x, weight, bias=None):
        self.save_for_backward(x, weight)
        out = _matmul_rows(x, weight.T)
        if bias is None:
            return out
        if array_module(out).result_type(out, bias) != out.dtype:  # (a bias that promotes: a new array)
            return out + bias
        out += bias  # (out is the product's own fresh array: no second one of its size, nor its pages)
        return out

    def backward(self, grad):
        x, weight = self.saved
        needs = self.needs_input_grad
        d_x = _matmul_rows(grad, weight) if needs[0] else None
        flat_grad = grad.reshape(-1, grad.shape[-1])
        d_weight = flat_grad.T @ x.reshape(-1, x.shape[-1]) if needs[1] else None
        d_bias = flat_grad.sum(axis=0) if len(needs) > 2 and needs[2] else None
        return d_x, d_weight, d_bias


def linear(x, weight, bias=None) -> Tensor:
    """``x @ weight.T + bias``: x (..., in), weight (out, in), bias (out,) or None."""
    x, weight = as_tensor(x), as_tensor(weight)
    if weight.ndim != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: weight must be (out_features, {x.shape[-1]}) for x of shape "
                         f"{x.shape}; got {weight.shape}")
    if bias is None:
        return _Linear.apply(x, weight)
    bias = as_tensor(bias)
    if bias.shape != (weight.shape[0],):
        raise ValueError(f"linear: bias must have shape ({weight.shape[0]},); got {bias.shape}")
    return _Linear.apply(x, weight, bias)


def _softmax_array(x, axis):
    xp = array_module(x)
    shifted = x - x.max(axis=axis, keepdims=True)
    e = xp.exp(shifted)
    return e / e.sum(axis=axis, keepdims=True)


def _log_softmax_array(x, axis):
    xp = array_module(x)
    shifted = x - x.max(axis=axis, keepdims=True)
    return shifted - xp.log(xp.exp(shifted).sum(axis=axis, keepdims=True))


class _Softmax(Function):
    def forward(self, x, axis=-1):
        self.axis = axis
        self.out = _softmax_array(x, axis)
        return self.out

    def backward(self, grad):
        y = self.out
        return y * (grad - (grad * y).sum(axis=self.axis, keepdims=True))


class _LogSoftmax(Function):
    def forward(self, x, axis=-1):
        self.axis = axis
        self.out = _log_softmax_array(x, axis)
        return self.out

    def backward(self, grad):
        xp = array_module(grad)
        return grad - xp.exp(self.out) * grad.sum(axis=self.axis, keepdims=True)


def softmax(x, axis: int = -1) -> Tensor:
    """``exp(x) / sum(exp(x))`` along ``axis`` (shifted by the max: no overflow)."""
    return _Softmax.apply(x, axis=axis)


def log_softmax(x, axis: int = -1) -> Tensor:
    """``x - logsumexp(x)`` along ``axis``."""
    return _LogSoftmax.apply(x, axis=axis)


class _CrossEntropy(Function):
    def forward(self, logits, targets, ignore_index=-100, reduction="mean", label_smoothing=0.0):
        xp = array_module(logits)
        classes = logits.shape[-1]
        log_p = _log_softmax_array(logits, -1)
        kept = targets != ignore_index
        safe_targets = xp.where(kept, targets, 0)
        picked = xp.take_along_axis(log_p, safe_targets[..., None], axis=-1)[..., 0]
        losses = -((1 - label_smoothing) * picked + label_smoothing * log_p.mean(axis=-1))
        losses = xp.where(kept, losses, 0)
        count = int(kept.sum())
        self.log_p, self.targets, self.kept = log_p, safe_targets, kept
        self.reduction, self.smoothing, self.classes = reduction, label_smoothing, classes
        # mean over no kept target is NaN in torch; 0 here keeps a fully padded batch finite
        self.divisor = max(count, 1) if reduction == "mean" else 1
        if reduction == "none":
            return losses
        total = losses.sum()
        return total / self.divisor if reduction == "mean" else total

    def backward(self, grad):
        xp = array_module(grad)
        probabilities = xp.exp(self.log_p)
        one_hot = xp.arange(self.classes) == self.targets[..., None]
        # (in the logits' dtype: a bool array times a Python float is float64, which made every
        # gradient of a float32 model float64 behind it, at twice the cost)
        target = ((1 - self.smoothing) * one_hot + self.smoothing / self.classes).astype(probabilities.dtype)
        per_row = grad[..., None] if self.reduction == "none" else grad / self.divisor
        d_logits = (probabilities - target) * self.kept[..., None] * per_row
        return d_logits, None


def cross_entropy(logits, target_indices, ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0) -> Tensor:
    """Softmax cross-entropy against class indices (torch's semantics).

    Args:
        logits: (N, C), (C,), or (N, C, d1, ...) with the classes on axis 1, as torch.
        target_indices: integer array of logits' shape without the class axis; entries equal
            to ``ignore_index`` count for nothing.
        reduction: "mean" (over kept targets; 0 when none is kept), "sum" or "none".
        label_smoothing: in [0, 1): the target puts that mass uniformly over the classes.
    """
    logits = as_tensor(logits)
    targets = target_indices.data if isinstance(target_indices, Tensor) else target_indices
    targets = logits.xp.asarray(targets)
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"cross_entropy: reduction must be 'mean', 'sum' or 'none'; got {reduction!r}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"cross_entropy: label_smoothing must be in [0, 1); got {label_smoothing}")
    if targets.dtype.kind not in "iu":
        raise TypeError(f"cross_entropy: target_indices must be integers; got dtype {targets.dtype}")
    class_axis = 0 if logits.ndim == 1 else 1
    expected = logits.shape[:class_axis] + logits.shape[class_axis + 1:]
    if targets.shape != expected:
        raise ValueError(f"cross_entropy: target_indices must have shape {expected} for logits of shape "
                         f"{logits.shape}; got {targets.shape}")
    classes = logits.shape[class_axis]
    kept = targets != ignore_index
    if bool(((targets < 0) | (targets >= classes))[kept].any()):
        raise ValueError(f"cross_entropy: target_indices must be in [0, {classes}) or ignore_index; "
                         f"got values from {int(targets.min())} to {int(targets.max())}")
    if logits.ndim > 2:  # classes last for the node; its gradient moves them back
        axes = (0, *range(2, logits.ndim), 1)
        logits = logits.transpose(axes)
    return _CrossEntropy.apply(logits, Tensor(targets), ignore_index=ignore_index,
                               reduction=reduction, label_smoothing=label_smoothing)


class _Normalize(Function):
    """layer_norm (``center``: subtract the mean) and rms_norm (no centering) in one node."""

    def forward(self, x, weight=None, bias=None, eps=1e-5, center=True):
        xp = array_module(x)
        self.weight, self.center = weight, center
        if cpu_kernel_takes(x, weight, bias):  # one pass a row, float64 sums (npattn.cpu.normalization)
            from ..cpu.normalization import normalize

            out, self.normalized, self.inverse_std = normalize(
                x, weight, bias, eps, center, keep=is_grad_enabled() and any(self.needs_input_grad))
            return out
        mean = x.mean(axis=-1, keepdims=True) if center else 0.0
        centered = x - mean
        inverse_std = 1.0 / xp.sqrt((centered * centered).mean(axis=-1, keepdims=True) + eps)
        normalized = centered * inverse_std
        self.normalized, self.inverse_std = normalized, inverse_std
        out = normalized if weight is None else normalized * weight
        return out if bias is None else out + bias

    def backward(self, grad):
        needs = self.needs_input_grad
        normalized = self.normalized
        d_normalized = grad if self.weight is None else grad * self.weight
        d_x = None
        if needs[0]:
            # d/dx of (x - mean) / std, contracted: subtract the mean of the incoming gradient
            # (when centering) and its projection on the normalized values
            inner = d_normalized - (normalized * d_normalized).mean(axis=-1, keepdims=True) * normalized
            if self.center:
                inner = inner - d_normalized.mean(axis=-1, keepdims=True)
            d_x = inner * self.inverse_std
        flat = (-1, grad.shape[-1])
        d_weight = (grad * normalized).reshape(flat).sum(axis=0) if len(needs) > 1 and needs[1] else None
        d_bias = grad.reshape(flat).sum(axis=0) if len(needs) > 2 and needs[2] else None
        return d_x, d_weight, d_bias


def _norm(name, x, weight, bias, eps, center):
    x = as_tensor(x)
    features = x.shape[-1]
    for label, parameter in (("weight", weight), ("bias", bias)):
        if parameter is not None and tuple(parameter.shape) != (features,):
            raise ValueError(f"{name}: {label} must have shape ({features},) for x of shape {x.shape}; "
                             f"got {tuple(parameter.shape)}")
    inputs = [x]
    if weight is not None:
        inputs.append(as_tensor(weight))
    if bias is not None:
        if weight is None:
            inputs.append(Tensor(x.xp.ones(features, x.dtype)))
        inputs.append(as_tensor(bias))
    return _Normalize.apply(*inputs, eps=eps, center=center)


def layer_norm(x, weight=None, bias=None, eps: float = 1e-5) -> Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last axis (biased variance,
    as torch); weight and bias are (features,) or None."""
    return _norm("layer_norm", x, weight, bias, eps, center=True)


def rms_norm(x, weight=None, eps: float | None = None) -> Tensor:
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last axis; ``eps`` None is the
    dtype's machine epsilon (torch's default)."""
    x = as_tensor(x)
    if eps is None:
        eps = float(x.xp.finfo(x.dtype).eps)
    return _norm("rms_norm", x, weight, None, eps, center=False)


class _Dropout(Function):
    def forward(self, x, p=0.5, seed=None):
        xp = array_module(x)
        keep = xp.random.default_rng(seed).random(x.shape) >= p
        # 1 / (1 - p) rounded once to x's dtype, times the mask in that dtype: the bits of
        # the float64 quotient cast, without its float64 array (0.58 -> 0.36 ms for 131072
        # float32 values, the mask's draws 0.30 of it)
        self.scale = keep.astype(x.dtype) * xp.asarray(1.0 / (1.0 - p), x.dtype)
        return x * self.scale

    def backward(self, grad):
        return grad * self.scale


def dropout(x, p: float = 0.5, training: bool = True, seed=None) -> Tensor:
    """Zero each element with probability ``p`` and scale the rest by 1 / (1 - p).

    The mask is ``default_rng(seed).random(x.shape) >= p`` of x's array module, so a
    given seed reproduces it; ``seed`` None draws a fresh one. Identity when not
    ``training`` or ``p`` is 0."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout: p must be in [0, 1); got {p}")
    x = as_tensor(x)
    if not training or p == 0.0:
        return x
    return _Dropout.apply(x, p=p, seed=seed)


class _Embedding(Function):
    def forward(self, weight, indices=None):
        self.indices, self.shape, self.dtype = indices, weight.shape, weight.dtype
        return weight[indices]

    def backward(self, grad):
        xp = array_module(grad)
        d_weight = xp.zeros(self.shape, self.dtype)
        xp.add.at(d_weight, self.indices, grad)  # a repeated index sums its rows
        return d_weight


def embedding(indices, weight) -> Tensor:
    """Rows of ``weight`` (num_embeddings, dim) at integer ``indices`` of any shape:
    out (*indices.shape, dim) (torch's argument order)."""
    weight = as_tensor(weight)
    indices = indices.data if isinstance(indices, Tensor) else weight.xp.asarray(indices)
    if indices.dtype.kind not in "iu":
        raise TypeError(f"embedding: indices must be integers; got dtype {indices.dtype}")
    if indices.size and (int(indices.min()) < 0 or int(indices.max()) >= weight.shape[0]):
        raise ValueError(f"embedding: indices must be in [0, {weight.shape[0]}); got values from "
                         f"{int(indices.min())} to {int(indices.max())}")
    return _Embedding.apply(weight, indices=indices)


class _Attention(Function):
    """One node for the whole attention: the forward keeps the vjp closure of
    :func:`npattn.attention_vjp` (which holds out and lse, nothing Sq x Sk), and one
    backward call returns every input's gradient together."""

    def forward(self, q, k, v, *extra, names=(), options=None):
        from ..api import attention_vjp

        outputs, self.vjp = attention_vjp(q, k, v, **dict(zip(names, extra)), **options)
        self.extras = outputs[1:] if isinstance(outputs, tuple) else ()
        return outputs[0] if isinstance(outputs, tuple) else outputs

    def backward(self, grad):
        return self.vjp(grad)


def attention(q, k, v, **options):
    """:func:`npattn.attention` as one differentiable node.

    Takes the keywords of :func:`npattn.attention`; ``q``, ``k``, ``v``, ``bias`` and
    ``sink_logits`` may be Tensors and receive gradients. Returns ``out`` as a Tensor, or
    with ``return_lse`` / ``return_weights`` the tuple ``(out, lse?, weights?)``, where
    lse and weights are constant Tensors (no gradient flows back through them).
    """
    q, k, v = as_tensor(q), as_tensor(k), as_tensor(v)
    differentiable = {name: options.pop(name) for name in ("bias", "sink_logits")
                      if options.get(name) is not None}
    names = tuple(differentiable)
    out, ctx = _Attention.apply_with_context(q, k, v, *(as_tensor(t) for t in differentiable.values()),
                                             names=names, options=options)
    extras, ctx.extras = ctx.extras, ()  # the graph keeps no S x S weights alive
    if not extras:
        return out
    return (out, *(Tensor(x) for x in extras))
