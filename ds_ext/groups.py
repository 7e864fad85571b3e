"""Named process groups built from the topology and from the parallel dimensions.

Two sources of groups:

* the topology (``ds_ext.topology``): ``span`` groups (ranks sharing a GCD pair, a
  node, the world) and ``cross`` groups (same local index across the domains of a
  level, e.g. 003's G_inter across nodes);
* a plugin's :class:`~ds_ext.parallel.Layout` (a view of :class:`~ds_ext.parallel.ParallelDims`):
  :func:`build_process_groups` creates its named groups and hands the plugin one explicit
  :class:`ProcessGroups` bundle (megatron-core's ``ProcessGroupCollection``); layers take their
  groups from it, never from globals (docs/architecture.md, Style).

:class:`GroupRegistry` turns a partition into torch process groups. Creating a group is
collective: every rank creates every group of a partition, in the same order, once; the
registry caches by partition so later calls are free and identical on every rank. torch orders
a group's members by ascending global rank, so a member's group rank is its position in the
sorted list.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Iterator, Mapping, Optional, overload

from ds_ext.parallel import Grid, GroupError, Layout, Partition, TEDLayout, member_group
from ds_ext.topology import Topology, TopologyError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def topology_partition(topo: Topology, kind: str, level: str) -> Partition:
    """``span`` or ``cross`` partition of ``topo`` at ``level`` as a hashable tuple."""
    if kind == "span":
        groups = topo.span_groups(level)
    elif kind == "cross":
        groups = topo.cross_groups(level)
    else:
        raise GroupError(f"group kind must be 'span' or 'cross', got {kind!r}")
    return tuple(tuple(g) for g in groups)


class GroupRegistry:
    """Creates and caches torch process groups; knows each group's ranks and level.

    All methods that create groups are collective over the world.
    """

    def __init__(self, topology: Topology, timeout_s: float | None = None) -> None:
        import torch.distributed as dist  # here, not at the top: the planner imports this module without torch

        if dist.is_initialized() and dist.get_world_size() != topology.world_size:
            raise TopologyError(
                f"world size {dist.get_world_size()} does not match topology "
                f"{topology.name!r} of {topology.world_size} ranks"
            )
        self.topology = topology
        self.timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        self._by_partition: dict[Partition, object] = {}
        self._ranks: dict[object, tuple[int, ...]] = {}
        self._levels: dict[object, str | None] = {}  # per group, computed once (the ledger's hot path)
        self._group_rank: dict[object, int] = {}
        self._downward: object | None = None

    def group(self, partition: Partition) -> object:
        """This rank's process group of ``partition`` (created collectively once)."""
        import torch.distributed as dist

        pg = self._by_partition.get(partition)
        if pg is not None:
            return pg
        world = tuple(range(self.topology.world_size))
        me = dist.get_rank()
        mine = None
        if any(ranks != world for ranks in partition) and dist.get_backend() == "gloo":
            self.make_p2p_downward()  # collective here, like every group of the partition
        for ranks in partition:
            if ranks == world:
                pg_i = dist.group.WORLD
            else:
                pg_i = dist.new_group(list(ranks), timeout=self.timeout)
            if me in ranks:
                mine = pg_i
                self._ranks[mine] = ranks
        if mine is None:
            raise GroupError(f"rank {me} is in no group of {partition}")
        self._by_partition[partition] = mine
        return mine

    def p2p_downward(self) -> object | None:
        """On gloo, a second group of all ranks over which ``ds_ext.comm.algorithms`` send their
        point-to-point messages to lower ranks, so a pair exchanging both ways uses two
        connections (gloo moves a pair's two directions over one connection one after the other);
        None until made: with this registry's first group, or by :meth:`make_p2p_downward`."""
        return self._downward

    def make_p2p_downward(self) -> object:
        """Make :meth:`p2p_downward` now (once). Collective over the world."""
        import torch.distributed as dist

        if self._downward is None:
            self._downward = dist.new_group(list(range(self.topology.world_size)), timeout=self.timeout)
        return self._downward

    def span(self, level: str) -> object:
        """Ranks sharing one domain of ``level`` (gcd: the GCD pair, gpu: the node)."""
        return self.group(topology_partition(self.topology, "span", level))

    def cross(self, level: str) -> object:
        """Ranks with the same position inside their ``level`` domain's children."""
        return self.group(topology_partition(self.topology, "cross", level))

    def ranks(self, group: object | None) -> tuple[int, ...]:
        """Global ranks of ``group`` (None or WORLD: all ranks), ascending."""
        import torch.distributed as dist

        if group is None or group is dist.group.WORLD:
            return tuple(range(self.topology.world_size))
        ranks = self._ranks.get(group)
        if ranks is None:
            ranks = tuple(dist.get_process_group_ranks(group))
            self._ranks[group] = ranks
        return ranks

    def level(self, group: object | None) -> str | None:
        """Outermost topology level the group crosses (None for one rank); computed once
        per group."""
        import torch.distributed as dist

        key = dist.group.WORLD if group is None else group
        try:
            return self._levels[key]
        except KeyError:
            level = self._levels[key] = self.topology.level_of(self.ranks(group))
            return level

    def group_rank(self, group: object | None) -> int:
        """This rank's position in ``group`` (cached per group)."""
        import torch.distributed as dist

        key = dist.group.WORLD if group is None else group
        try:
            return self._group_rank[key]
        except KeyError:
            me = self._group_rank[key] = self.ranks(group).index(dist.get_rank())
            return me


@dataclass(frozen=True)
class ProcessGroups(Mapping[str, object]):
    """One rank's named process groups of a layout: ``bundle[name]`` is the group (None for an
    optional group of one rank), :meth:`size`, :meth:`rank` and :meth:`ranks` its degree, this
    rank's place in it and its members (from the layout, no torch call)."""

    layout: Layout
    global_rank: int
    groups: Mapping[str, object | None]

    def __getitem__(self, name: str) -> object | None:
        return self.groups[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.groups)

    def __len__(self) -> int:
        return len(self.groups)

    def size(self, name: str) -> int:
        return self.layout.parallel_dims.size(*self.layout.axes_of(name))

    def rank(self, name: str) -> int:
        return self.layout.parallel_dims.group_rank(self.layout.axes_of(name), self.global_rank)

    def ranks(self, name: str) -> tuple[int, ...]:
        return member_group(self.layout.partition(name), self.global_rank)


class TEDGroups(ProcessGroups):
    """TED's groups by name (001 §7.1): ``bundle.tensor`` is ``bundle["tensor"]``."""

    @property
    def tensor(self) -> Optional["ProcessGroup"]:
        """G_tensor: the ranks that shard one expert's and one dense layer's weights."""
        return self.groups["tensor"]

    @property
    def expert(self) -> Optional["ProcessGroup"]:
        """G_expert: the ranks that hold different experts (the all-to-all group)."""
        return self.groups["expert"]

    @property
    def expert_data(self) -> Optional["ProcessGroup"]:
        """G_data^exp: the replicas of one expert shard (its gradient reduction)."""
        return self.groups["expert_data"]

    @property
    def data(self) -> Optional["ProcessGroup"]:
        """G_data^nonexp = expert x expert-data: the dense parameters' data-parallel group."""
        return self.groups["data"]

    @property
    def expert_replicas(self) -> Optional["ProcessGroup"]:
        """tensor x expert-data: the holders of an expert kept whole on every tensor rank."""
        return self.groups["expert_replicas"]

    @property
    def pipeline(self) -> Optional["ProcessGroup"]:
        """The ranks at this rank's place in every pipeline stage (None without a PipelineEngine)."""
        return self.groups.get("pipeline")


class GridGroups(ProcessGroups):
    """3D-PMM's groups by name (001 §5.1.2); ``x``, ``y``, ``z`` are None at degree 1."""

    @property
    def x(self) -> Optional["ProcessGroup"]:
        return self.groups["x"]

    @property
    def y(self) -> Optional["ProcessGroup"]:
        return self.groups["y"]

    @property
    def z(self) -> Optional["ProcessGroup"]:
        return self.groups["z"]

    @property
    def data(self) -> Optional["ProcessGroup"]:
        return self.groups["data"]

    @property
    def tensor(self) -> Optional["ProcessGroup"]:
        """X x Y x Z: DeepSpeed's model-parallel group."""
        return self.groups["tensor"]


BUNDLES: Mapping[type[Layout], type[ProcessGroups]] = {TEDLayout: TEDGroups, Grid: GridGroups}


@overload
def build_process_groups(registry: GroupRegistry, layout: TEDLayout, rank: int) -> TEDGroups: ...
@overload
def build_process_groups(registry: GroupRegistry, layout: Grid, rank: int) -> GridGroups: ...
@overload
def build_process_groups(registry: GroupRegistry, layout: Layout, rank: int) -> ProcessGroups: ...
def build_process_groups(registry: GroupRegistry, layout: Layout, rank: int) -> ProcessGroups:
    """Create every named group of ``layout`` (collective: all ranks, in ``layout.GROUPS`` order;
    an optional group of one rank is skipped) and return this rank's bundle (:class:`TEDGroups`
    for TED, :class:`GridGroups` for a 3D-PMM grid: the groups as typed fields)."""
    if layout.world_size != registry.topology.world_size:
        raise GroupError(
            f"{layout.NAME} layout of {layout.world_size} ranks on a topology of {registry.topology.world_size}"
        )
    groups = {
        name: None
        if name in layout.OPTIONAL and layout.parallel_dims.size(*axes) == 1
        else registry.group(layout.partition(name))
        for name, axes in layout.GROUPS.items()
    }
    return BUNDLES.get(type(layout), ProcessGroups)(layout, rank, groups)
