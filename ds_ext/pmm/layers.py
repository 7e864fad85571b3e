"""The norms of a 3D-PMM transformer, laid out for the residual stream.

Residual-stream layout between layers (what every normal layer takes and every
transposed layer returns): ``[rows of this rank's Z share, ..., d/G_y]``, hidden features
block y over Y, replicated over X. The modules here keep that layout (embeddings and the
LM head are vocabulary-parallel, :mod:`ds_ext.pmm.vocab`):

* :class:`LayerNorm` / :class:`RMSNorm`: affine parameters ``[d/G_y]``; the row statistics
  are partial sums over Y, all-reduced over Y (forward and backward). With G_y = 1 they are
  torch's own kernels, bit for bit.

Their parameters are replicated over Z, whose ranks see different rows, so their
gradients are all-reduced over Z (:meth:`PMMEngine.replicated`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ds_ext.comm.mappings import reduce_both
from ds_ext.pmm.engine import PMMEngine
from ds_ext.pmm.layout import ConversionError, feature_slice


class _FeatureSharded(nn.Module):
    """Parameters whose last dimension (hidden features) is split over Y."""

    engine: PMMEngine
    features: int

    def _slice(self) -> slice:
        return feature_slice(self.features, self.engine.y.size, self.engine.y.rank)

    def shard_full(self, param_name: str, full: torch.Tensor) -> torch.Tensor:
        return full[..., self._slice()].clone()

    def _mark(self) -> None:
        for p in self.parameters(recurse=False):
            p.pmm_replicated_over = ("x", "z")  # distinct over Y only (ds_ext.pmm.norm)


class LayerNorm(_FeatureSharded):
    """``nn.LayerNorm`` over hidden features split over Y."""

    def __init__(self, serial: nn.LayerNorm, engine: PMMEngine, name: str = "layernorm") -> None:
        super().__init__()
        if len(serial.normalized_shape) != 1:
            raise ConversionError(
                f"ds_ext.pmm.parallelize: {name}: only LayerNorm over the last dimension is supported"
            )
        self.engine, self.name, self.eps = engine, name, serial.eps
        self.features = serial.normalized_shape[0]
        with torch.no_grad():
            self.weight = nn.Parameter(serial.weight[self._slice()].clone()) if serial.weight is not None else None
            self.bias = nn.Parameter(serial.bias[self._slice()].clone()) if serial.bias is not None else None
        self._mark()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eng = self.engine
        w = eng.replicated(self.weight) if self.weight is not None else None
        b = eng.replicated(self.bias) if self.bias is not None else None
        if eng.y.size == 1:
            return F.layer_norm(x, (self.features,), w, b, self.eps)
        xf = x.float()
        sums = reduce_both(torch.stack([xf.sum(-1), (xf * xf).sum(-1)], dim=-1), eng.comm, eng.y.group)
        mean = sums[..., :1] / self.features
        var = sums[..., 1:] / self.features - mean * mean
        y = ((xf - mean) * torch.rsqrt(var + self.eps)).to(x.dtype)
        if w is not None:
            y = y * w
        return y + b if b is not None else y


class RMSNorm(_FeatureSharded):
    """Llama's RMSNorm (fp32 statistics, ``weight * x_normed.to(dtype)``) over features split over Y."""

    def __init__(self, serial: nn.Module, engine: PMMEngine, name: str = "rmsnorm") -> None:
        super().__init__()
        self.engine, self.name = engine, name
        self.eps = getattr(serial, "variance_epsilon", getattr(serial, "eps", None))
        if self.eps is None:
            raise ConversionError(f"ds_ext.pmm.parallelize: {name}: RMSNorm without 'variance_epsilon' or 'eps'")
        self.features = serial.weight.shape[0]
        with torch.no_grad():
            self.weight = nn.Parameter(serial.weight[self._slice()].clone())
        self._mark()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eng = self.engine
        xf = x.to(torch.float32)
        sq = reduce_both(xf.pow(2).sum(-1, keepdim=True), eng.comm, eng.y.group)
        xf = xf * torch.rsqrt(sq / self.features + self.eps)
        return eng.replicated(self.weight) * xf.to(x.dtype)
