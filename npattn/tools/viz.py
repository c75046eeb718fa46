"""Heatmaps of attention weights, one panel per head (needs matplotlib: ``pip install
npattn[viz]``; nothing else in npattn imports it)."""
from __future__ import annotations

import math

import numpy as np

from ..core.arrays import to_numpy


def plot_attention(weights, path=None, *, heads=None, batch_index: int = 0, query_labels=None,
                   key_labels=None, title: str | None = None, columns: int = 4, cmap: str = "viridis"):
    """Draw attention weights as heatmaps (rows: queries, columns: keys), one panel per head.

    Args:
        weights: (Sq, Sk), (H, Sq, Sk) or (B, H, Sq, Sk); a NumPy or CuPy array or an
            autograd Tensor (for example the second output of a module called with
            ``need_weights=True``, or ``npattn.attention(..., return_weights=True)``).
        path: where to save the figure as PNG; None to only return it.
        heads: which heads to draw (default: all). batch_index: the batch element of 4-D weights.
        query_labels, key_labels: tick labels (for example tokens), one per row / column.
        title: the figure's title. columns: panels per row. cmap: a matplotlib colormap.

    Returns the matplotlib ``Figure`` (built without pyplot: no global state, no window).
    Raises ImportError naming the extra when matplotlib is missing, ValueError for bad shapes.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError("plot_attention needs matplotlib: pip install 'npattn[viz]'") from error
    data = getattr(weights, "data", weights) if not isinstance(weights, np.ndarray) else weights
    data = np.asarray(to_numpy(data), dtype=np.float64)
    if data.ndim == 4:
        if not 0 <= batch_index < data.shape[0]:
            raise ValueError(f"plot_attention: batch_index must be in [0, {data.shape[0]}); got {batch_index}")
        data = data[batch_index]
    elif data.ndim == 2:
        data = data[None]
    elif data.ndim != 3:
        raise ValueError(f"plot_attention: weights must be (Sq, Sk), (H, Sq, Sk) or (B, H, Sq, Sk); "
                         f"got shape {data.shape}")
    heads = list(range(data.shape[0])) if heads is None else list(heads)
    if not heads or any(not 0 <= h < data.shape[0] for h in heads):
        raise ValueError(f"plot_attention: heads must be indices in [0, {data.shape[0]}); got {heads}")
    for name, labels, size in (("query_labels", query_labels, data.shape[1]), ("key_labels", key_labels, data.shape[2])):
        if labels is not None and len(labels) != size:
            raise ValueError(f"plot_attention: {name} must have {size} entries; got {len(labels)}")
    columns = max(1, min(columns, len(heads)))
    rows = math.ceil(len(heads) / columns)
    figure = Figure(figsize=(3.2 * columns, 3.0 * rows + (0.4 if title else 0)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = np.atleast_1d(figure.subplots(rows, columns, squeeze=False)).ravel()
    for axis, head in zip(axes, heads):
        image = axis.imshow(data[head], cmap=cmap, vmin=0.0, vmax=max(float(data[head].max()), 1e-12),
                            aspect="auto", interpolation="nearest")
        axis.set_title(f"head {head}")
        axis.set_xlabel("key")
        axis.set_ylabel("query")
        if key_labels is not None:
            axis.set_xticks(range(len(key_labels)), [str(t) for t in key_labels], rotation=90)
        if query_labels is not None:
            axis.set_yticks(range(len(query_labels)), [str(t) for t in query_labels])
        figure.colorbar(image, ax=axis, shrink=0.8)
    for axis in axes[len(heads):]:
        axis.set_visible(False)
    if title:
        figure.suptitle(title)
    if path is not None:
        figure.savefig(path, format="png", dpi=100)
    return figure
