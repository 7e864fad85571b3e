"""The 4D virtual grid X x Y x Z x data of one job (001 §5.1.1) and this rank's place in it.

Pure index logic lives in :func:`ds_ext.groups.pmm_axes`; :class:`Grid` adds validation
against the world size and the model, and :class:`Axis` carries one process group with its
size and this rank's coordinate, which is all the layers need.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ds_ext.errors import DsExtError
from ds_ext.groups import GroupRegistry, ParallelAxes, pmm_axes, pmm_groups
from ds_ext.pmm.config import KEY


class GridError(DsExtError, ValueError):
    """A grid that does not fit the world or the model; the message names the key."""


@dataclass(frozen=True)
class Grid:
    """Degrees (G_x, G_y, G_z, G_data), in the order of 001 §5.1.2's hierarchy."""

    x: int = 1
    y: int = 1
    z: int = 1
    data: int = 1

    @property
    def dims(self) -> tuple[int, int, int, int]:
        return (self.x, self.y, self.z, self.data)

    @property
    def tensor(self) -> int:
        """G_tensor = G_x G_y G_z."""
        return self.x * self.y * self.z

    @property
    def world_size(self) -> int:
        return math.prod(self.dims)

    def __str__(self) -> str:
        return f"(x={self.x}, y={self.y}, z={self.z}, data={self.data})"

    def check_world(self, world_size: int) -> None:
        if self.world_size != world_size:
            raise GridError(
                f"{KEY}.grid {self} has product {self.world_size} but the world has {world_size} ranks; "
                "the product x*y*z*data must equal the world size"
            )

    def axes(self) -> ParallelAxes:
        return pmm_axes(self.x, self.y, self.z, self.data, self.world_size)

    def coords(self, rank: int) -> dict[str, int]:
        return self.axes().coords(rank)


@dataclass(frozen=True)
class Axis:
    """One grid axis as this rank sees it: process group (None if size 1), size, coordinate."""

    name: str
    group: object | None
    size: int
    rank: int


def build_axes(grid: Grid, registry: GroupRegistry, rank: int) -> dict[str, Axis]:
    """Create the grid's process groups (collective); this rank's axes x, y, z, data and tensor."""
    grid.check_world(registry.topology.world_size)
    layout = grid.axes()
    groups = pmm_groups(registry, layout)
    coords = layout.coords(rank)
    out = {n: Axis(n, groups[n], layout.size(n), coords[n]) for n in ("x", "y", "z", "data")}
    out["tensor"] = Axis("tensor", groups["tensor"], grid.tensor,
                         coords["x"] + grid.x * (coords["y"] + grid.y * coords["z"]))
    return out
