"""Multiway: two copies of a layer, one for the positions before a split and one after
(torchscale's MultiwayNetwork, as in BEiT-3: e.g. image tokens, then text tokens)."""
from __future__ import annotations

from .. import autograd as ag
from .module import Module


class Multiway(Module):
    """``A`` for positions ``[0, split_position)`` of axis 1, ``B`` for the rest.

    ``split_position`` -1 (the default) sends everything to A, 0 everything to B;
    the owning module sets it before each call. Parameters are named ``A.*`` and
    ``B.*``, as torchscale's; ``make`` builds each copy (they are drawn independently).
    """

    def __init__(self, make):
        super().__init__()
        self.A = make()
        self.B = make()
        self.split_position = -1

    def forward(self, x):
        split = self.split_position
        if split == -1:
            return self.A(x)
        if split == 0:
            return self.B(x)
        x = x if isinstance(x, ag.Tensor) else ag.Tensor(x)
        return ag.concat([self.A(x[:, :split]), self.B(x[:, split:])], axis=1)
