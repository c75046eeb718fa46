"""plot_attention draws one panel per head from any weights npattn hands back."""
import sys

import numpy as np
import pytest

import npattn
from npattn.tools.viz import plot_attention

PNG = b"\x89PNG\r\n\x1a\n"


def test_heatmaps_of_module_and_functional_weights(tmp_path):
    pytest.importorskip("matplotlib")
    from npattn.nn import MultiHeadAttention

    x = np.random.default_rng(0).standard_normal((2, 6, 16)).astype(np.float32)
    _, weights = MultiHeadAttention(16, 4, causal=True, seed=0)(x, need_weights=True, average_attn_weights=False)
    figure = plot_attention(weights, tmp_path / "heads.png", batch_index=1, key_labels=list("abcdef"), title="t")
    assert (tmp_path / "heads.png").read_bytes()[:8] == PNG
    assert sum(axis.get_visible() for axis in figure.axes if axis.get_title().startswith("head")) == 4
    panel = next(axis for axis in figure.axes if axis.get_title() == "head 2")
    np.testing.assert_allclose(panel.images[0].get_array(), weights.data[1, 2])  # the data drawn is exact
    _, functional = npattn.attention(x.reshape(2, 6, 4, 4), x.reshape(2, 6, 4, 4), x.reshape(2, 6, 4, 4),
                                     layout="bshd", return_weights=True)
    figure = plot_attention(functional[0], heads=[0, 3], columns=1)
    assert [a.get_title() for a in figure.axes if a.get_title()] == ["head 0", "head 3"]
    plot_attention(functional[0, 0], tmp_path / "one.png")  # a single (Sq, Sk) map
    assert (tmp_path / "one.png").read_bytes()[:8] == PNG


def test_bad_weights_are_named():
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match=r"weights must be \(Sq, Sk\), \(H, Sq, Sk\) or \(B, H, Sq, Sk\)"):
        plot_attention(np.ones(3))
    with pytest.raises(ValueError, match=r"heads must be indices in \[0, 2\)"):
        plot_attention(np.ones((2, 3, 3)), heads=[2])
    with pytest.raises(ValueError, match="key_labels must have 3 entries"):
        plot_attention(np.ones((3, 3)), key_labels=["a"])


def test_missing_matplotlib_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ImportError, match=r"pip install 'npattn\[viz\]'"):
        plot_attention(np.ones((2, 2)))
