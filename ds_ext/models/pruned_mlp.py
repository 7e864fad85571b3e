"""A pruned MLP for SAMO's benchmark (001 ch. 4): bias-free square linears, tanh between, each
weight pruned by ``torch.nn.utils.prune.custom_from_mask`` with a seeded mask of exactly
round(p n) pruned entries, initialised from its own seed (the same on every rank and in every
pipeline layout)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import prune


def layer_mask(i: int, shape: tuple[int, int], p: float) -> torch.Tensor:
    """Layer ``i``'s bool mask (True = kept): exactly round(p n) pruned entries, seeded."""
    n = shape[0] * shape[1]
    pruned = torch.randperm(n, generator=torch.Generator().manual_seed(11 + i))[: round(p * n)]
    mask = torch.ones(n, dtype=torch.bool, device="cpu")  # built on the host, like the module: the engine moves both
    mask[pruned] = False
    return mask.view(shape)


class PrunedLayer(nn.Module):
    """Linear ``i`` of ``layers`` (``width`` x ``width``, no bias; tanh after all but the last),
    pruned to sparsity ``p`` (a ``weight_mask`` buffer beside ``weight_orig``)."""

    def __init__(self, i: int, width: int, layers: int, p: float) -> None:
        super().__init__()
        self.fc, self.last = nn.Linear(width, width, bias=False), i == layers - 1
        with torch.no_grad():
            g = torch.Generator().manual_seed(1000 + i)
            self.fc.weight.copy_(torch.randn(width, width, generator=g, device="cpu") / width**0.5)  # host generator
        prune.custom_from_mask(self.fc, "weight", layer_mask(i, (width, width), p))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y if self.last else torch.tanh(y)


def pruned_mlp(width: int, layers: int, p: float) -> nn.Sequential:
    """The whole MLP on one rank (data parallelism)."""
    return nn.Sequential(*[PrunedLayer(i, width, layers, p) for i in range(layers)])
