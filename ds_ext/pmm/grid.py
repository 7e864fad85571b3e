"""This rank's place on the 4D grid X x Y x Z x data (001 §5.1.1): one :class:`Axis` per grid group.

The grid itself is :class:`ds_ext.parallel.Grid` (a view of the job's parallel dimensions);
:func:`build_axes` creates its process groups (:func:`ds_ext.groups.build_process_groups`) and
turns the bundle into the axes the layers use (:func:`grid_axes`): a process group with its size and this rank's
coordinate.
"""

from __future__ import annotations

from dataclasses import dataclass

from ds_ext.groups import GroupRegistry, ProcessGroups, build_process_groups
from ds_ext.parallel import Grid


@dataclass(frozen=True)
class Axis:
    """One grid axis as this rank sees it: process group (None if size 1), size, coordinate."""

    name: str
    group: object | None
    size: int
    rank: int


def unsplit(axis: Axis) -> Axis:
    """``axis`` as a placement that does not split over it (a layer's out-features whole on
    every rank of the axis): size one, so the engine issues no collective over it."""
    return Axis(axis.name, None, 1, 0)


def grid_axes(groups: ProcessGroups) -> dict[str, Axis]:
    """This rank's axes x, y, z, data and tensor from the grid's group bundle."""
    return {n: Axis(n, groups[n], groups.size(n), groups.rank(n)) for n in groups}


def build_axes(grid: Grid, registry: GroupRegistry, rank: int) -> dict[str, Axis]:
    """Create the grid's process groups (collective); this rank's axes."""
    grid.check_world(registry.topology.world_size)
    return grid_axes(build_process_groups(registry, grid, rank))
