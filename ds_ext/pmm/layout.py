"""Index arithmetic of 3D-PMM shards (001 Algorithm 3): pure functions, no processes.

Notation (001 §5.1.2 with the spec's resolution of m, k, n): a layer computes O = I W with
I of m x k (rows x in-features) and W of k x n; torch stores W transposed, as the
``[n, k]`` weight of ``nn.Linear``. A *normal* layer splits in-features over Y and
out-features over X; a *transposed* one swaps the two (001 §5.1.1, last paragraphs).
The local block ``W[out block, in block]`` (``[n/G_out, k/G_in]``, row-major) is then
flattened and cut into G_z equal chunks, Ŵ (AxoNN's memory modification of Agarwal's
algorithm). Out-features made of ``out_chunks`` stacked blocks (a fused q|k|v
projection) are split block by block, so every rank keeps whole heads of q, k and v.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ds_ext.errors import DsExtError
from ds_ext.perf.pmm import block_split_error

if TYPE_CHECKING:  # the planner imports this module without torch
    import torch


class ConversionError(DsExtError, ValueError):
    """A model or grid that :func:`ds_ext.pmm.parallelize` cannot convert."""


def feature_slice(features: int, parts: int, coord: int) -> slice:
    """Contiguous block ``coord`` of ``parts`` equal blocks of ``features``."""
    if features % parts:
        raise ValueError(f"{features} features do not split into {parts} equal blocks")
    size = features // parts
    return slice(coord * size, (coord + 1) * size)


def chunked_index(features: int, parts: int, coord: int, chunks: int) -> torch.Tensor:
    """Indices of block ``coord`` of each of ``chunks`` stacked sub-blocks of ``features``."""
    import torch

    if features % (chunks * parts):
        raise ValueError(f"{features} features do not split into {chunks} x {parts} equal blocks")
    per = features // chunks
    sl = feature_slice(per, parts, coord)
    return torch.cat([torch.arange(c * per + sl.start, c * per + sl.stop) for c in range(chunks)])


@dataclass(frozen=True)
class LinearLayout:
    """Where one rank's shard of an ``[n, k]`` weight comes from."""

    n: int  # out-features
    k: int  # in-features
    out_parts: int  # G_x (normal) or G_y (transposed)
    out_coord: int
    in_parts: int  # G_y (normal) or G_x (transposed)
    in_coord: int
    z_parts: int
    z_coord: int
    out_chunks: int = 1

    def __post_init__(self) -> None:
        err = block_split_error(self.n, self.k, self.out_parts, self.in_parts, self.z_parts, self.out_chunks)
        if err:
            raise ValueError(err)

    @property
    def n_local(self) -> int:
        return self.n // self.out_parts

    @property
    def k_local(self) -> int:
        return self.k // self.in_parts

    @property
    def block_numel(self) -> int:
        return self.n_local * self.k_local

    @property
    def shard_numel(self) -> int:
        return self.block_numel // self.z_parts

    def out_index(self) -> torch.Tensor:
        return chunked_index(self.n, self.out_parts, self.out_coord, self.out_chunks)

    def block(self, weight: torch.Tensor) -> torch.Tensor:
        """``W[out block, in block]`` of a full ``[n, k]`` weight."""
        cols = feature_slice(self.k, self.in_parts, self.in_coord)
        return weight.index_select(0, self.out_index().to(weight.device))[:, cols]

    def shard(self, weight: torch.Tensor) -> torch.Tensor:
        """Ŵ: chunk ``z_coord`` of the flattened block."""
        flat = self.block(weight).reshape(-1)
        return flat[self.z_coord * self.shard_numel : (self.z_coord + 1) * self.shard_numel].clone()

    def bias(self, bias: torch.Tensor) -> torch.Tensor:
        """The out block of a full ``[n]`` bias (replicated over the in axis and Z)."""
        return bias.index_select(0, self.out_index().to(bias.device)).clone()
