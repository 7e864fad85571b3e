"""Nested shard layout over a flat parameter buffer (003 §V-A; spec digest A9).

Naive contiguous chunking by rank breaks the dependency rule: with ranks numbered
``r = gcd + 2 (gpu + P/2 node)``, rank (node 1, local 0) would own optimizer chunk P
while its gradient shard is chunk 0. ds_ext numbers shards with the *innermost*
coordinate most significant instead::

    shard_index(rank, L) = digits (c_0, c_1, ..., c_L) of the rank's coordinates at
                           levels 0..L, c_0 most significant

so the shard of a rank at level L+1 is a sub-chunk of its shard at level L, for every
L: optimizer shard within gradient shard within weight shard, whatever the plan.

A flat unit of U elements (U a multiple of W x block) is cut into ``shards(L)`` equal
chunks at level L. Collectives over a group whose ranks differ on levels a..b return
chunks in group-rank order (outermost coordinate most significant); :func:`to_shard_order`
reorders them (an einops rearrange that reverses the level axes).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence, TypeVar

from einops import rearrange

from ds_ext.parallel import ParallelDims, Partition
from ds_ext.topology import Topology

if TYPE_CHECKING:  # annotations only: the planner imports this module without torch
    import torch


T = TypeVar("T")


def shard_index(topo: Topology, rank: int, level: int) -> int:
    """Index of ``rank``'s chunk among the shards at level ``level``."""
    coords = topo.coords(rank)
    idx = 0
    for i in range(level + 1):
        idx = idx * topo.levels[i].size + coords[i]  # type: ignore[operator]
    return idx


def shard_count(topo: Topology, level: int | None) -> int:
    return 1 if level is None else math.prod(lv.size for lv in topo.levels[: level + 1])  # type: ignore[misc]


def chunk(flat: torch.Tensor, topo: Topology, rank: int, level: int | None) -> torch.Tensor:
    """``rank``'s shard of ``flat`` at ``level`` (the whole tensor if ``level`` is None)."""
    if level is None:
        return flat
    n = shard_count(topo, level)
    size = flat.numel() // n
    i = shard_index(topo, rank, level)
    return flat[i * size : (i + 1) * size]


def sub_chunk(shard: torch.Tensor, topo: Topology, rank: int, unit_numel: int, outer: int, inner: int) -> torch.Tensor:
    """``rank``'s level-``inner`` shard inside its level-``outer`` shard (inner >= outer).

    ``shard`` holds the level-``outer`` shard of a unit of ``unit_numel`` elements.
    """
    size = unit_numel // shard_count(topo, inner)
    start = shard_index(topo, rank, inner) * size - shard_index(topo, rank, outer) * (
        unit_numel // shard_count(topo, outer)
    )
    return shard[start : start + size]


def level_partition(topo: Topology, levels: Sequence[int]) -> Partition:
    """Groups of ranks that differ only on the given level indices."""
    axes = ParallelDims(tuple((lv.name, lv.size) for lv in topo.levels))  # type: ignore[misc]
    return axes.groups([topo.levels[i].name for i in levels])


def to_shard_order(gathered: torch.Tensor, topo: Topology, levels: Sequence[int]) -> torch.Tensor:
    """Reorder chunks gathered over ``levels`` from group-rank order to shard order.

    ``gathered`` is 1-D: ``d`` equal chunks, chunk j from group rank j. Returns a
    contiguous tensor whose chunk k is shard sub-index k (innermost level most significant).
    """
    levels = sorted(levels)
    if len(levels) <= 1:
        return gathered
    names = [f"l{i}" for i in levels]
    sizes = {f"l{i}": topo.levels[i].size for i in levels}
    pattern = f"({' '.join(reversed(names))} c) -> ({' '.join(names)} c)"
    return rearrange(gathered, pattern, **sizes)


def from_shard_order(chunks: torch.Tensor, topo: Topology, levels: Sequence[int]) -> torch.Tensor:
    """Inverse of :func:`to_shard_order`: shard order -> group-rank order (for scatters)."""
    levels = sorted(levels)
    if len(levels) <= 1:
        return chunks
    names = [f"l{i}" for i in levels]
    sizes = {f"l{i}": topo.levels[i].size for i in levels}
    pattern = f"({' '.join(names)} c) -> ({' '.join(reversed(names))} c)"
    return rearrange(chunks, pattern, **sizes)


def param_offsets(numels: Sequence[int], block: int, aligned: bool) -> tuple[list[int], int]:
    """Offsets of a unit's parameters (``numels``, in order) in its flat buffer and where the
    last one ends: packed, or with ``aligned`` (plans that quantize) each on a block boundary,
    so no quantization block holds two parameters."""
    offsets, end = [], 0
    for n in numels:
        start = -(-end // block) * block if aligned else end
        offsets.append(start)
        end = start + n
    return offsets, end


def buckets(items: list[T], sizes: list[int], bucket_size: int) -> list[list[T]]:
    """``items`` cut, in order, into runs whose ``sizes`` sum to at most ``bucket_size`` (an item
    larger than that is a run of its own)."""
    out: list[list[T]] = []
    total = 0
    for item, n in zip(items, sizes, strict=True):
        if not out or total + n > bucket_size:
            out.append([])
            total = 0
        out[-1].append(item)
        total += n
    return out


def raw_block_mask(params: Sequence[tuple[int, int]], offsets: Sequence[int], numel: int, block: int) -> list[bool]:
    """Per block of a unit of ``numel`` elements: whether it holds a 1-D parameter (``params``:
    (numel, ndim) each), whose gradient the quantized reduction sends unquantized."""
    mask = [False] * (numel // block)
    for (n, dim), o in zip(params, offsets):
        if dim <= 1:
            mask[o // block : -(-(o + n) // block)] = [True] * (-(-(o + n) // block) - o // block)
    return mask


def padded_numel(numel: int, world_size: int, block: int) -> int:
    """Round ``numel`` up so every shard at every level is a whole number of blocks."""
    q = world_size * block
    return -(-numel // q) * q
