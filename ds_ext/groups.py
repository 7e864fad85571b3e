"""Named process groups built from the topology and from parallel axes.

Two sources of groups:

* the topology (``ds_ext.topology``): ``span`` groups (ranks sharing a GCD pair, a
  node, the world) and ``cross`` groups (same local index across the domains of a
  level, e.g. 003's G_inter across nodes);
* named parallel axes, stated innermost first (``tensor`` fastest, like Megatron's
  order string ``tp-ep-dp``): a group over a subset of axes holds the ranks whose
  coordinates differ only along those axes (001 §5.2 for the X/Y/Z/data grid, §7.1 for
  tensor x expert x data).

Pure logic lives in :class:`ParallelAxes` and :class:`Topology` (no processes needed);
:class:`GroupRegistry` turns a partition into torch process groups. Creating a group
is collective: every rank creates every group of a partition, in the same order, once;
the registry caches by partition so later calls are free and identical on every rank.
torch orders a group's members by ascending global rank, so a member's group rank is
its position in the sorted list.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Sequence

from ds_ext.errors import DsExtError
from ds_ext.topology import Topology, TopologyError

Partition = tuple[tuple[int, ...], ...]


class GroupError(DsExtError, ValueError):
    """Parallel degrees that do not fit the world, or an unknown axis."""


@dataclass(frozen=True)
class ParallelAxes:
    """Named parallel degrees laid out over the ranks, innermost axis first.

    ``rank = a_0 + s_0 * (a_1 + s_1 * (...))`` for axis coordinates ``a_i`` and sizes ``s_i``.
    """

    axes: tuple[tuple[str, int], ...]

    @classmethod
    def build(cls, degrees: Sequence[tuple[str, int | None]], world_size: int) -> "ParallelAxes":
        """Resolve at most one ``None`` degree from ``world_size`` and check the product."""
        names = [n for n, _ in degrees]
        if len(set(names)) != len(names):
            raise GroupError(f"parallel axis names must be unique, got {names}")
        free = [n for n, s in degrees if s is None]
        if len(free) > 1:
            raise GroupError(f"at most one parallel degree may be inferred, got {free}")
        for n, s in degrees:
            if s is not None and s < 1:
                raise GroupError(f"parallel degree {n}={s} must be >= 1")
        fixed = math.prod(s for _, s in degrees if s is not None)
        spec = " x ".join(f"{n}={s if s is not None else '?'}" for n, s in degrees)
        if free:
            if world_size % fixed:
                raise GroupError(f"world size {world_size} is not divisible by {spec}")
            degrees = [(n, world_size // fixed if s is None else s) for n, s in degrees]
        elif fixed != world_size:
            raise GroupError(f"parallel degrees {spec} = {fixed} != world size {world_size}")
        return cls(tuple((n, int(s)) for n, s in degrees))  # type: ignore[arg-type]

    @property
    def world_size(self) -> int:
        return math.prod(s for _, s in self.axes)

    def size(self, name: str) -> int:
        return self.axes[self._index(name)][1]

    def _index(self, name: str) -> int:
        for i, (n, _) in enumerate(self.axes):
            if n == name:
                return i
        raise GroupError(f"unknown parallel axis {name!r}; axes: {[n for n, _ in self.axes]}")

    def coords(self, rank: int) -> dict[str, int]:
        out = {}
        for n, s in self.axes:
            rank, out[n] = divmod(rank, s)
        return out

    def groups(self, names: Sequence[str]) -> Partition:
        """Partition of the world into groups varying only along axes ``names``."""
        idx = {self._index(n) for n in names}
        buckets: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.world_size):
            c = list(self.coords(r).values())
            key = tuple(v for i, v in enumerate(c) if i not in idx)
            buckets.setdefault(key, []).append(r)
        return tuple(tuple(g) for g in sorted(buckets.values()))


def topology_partition(topo: Topology, kind: str, level: str) -> Partition:
    """``span`` or ``cross`` partition of ``topo`` at ``level`` as a hashable tuple."""
    if kind == "span":
        groups = topo.span_groups(level)
    elif kind == "cross":
        groups = topo.cross_groups(level)
    else:
        raise GroupError(f"group kind must be 'span' or 'cross', got {kind!r}")
    return tuple(tuple(g) for g in groups)


def member_group(partition: Partition, rank: int) -> tuple[int, ...]:
    """The group of ``partition`` that contains ``rank``."""
    for g in partition:
        if rank in g:
            return g
    raise GroupError(f"rank {rank} is in no group of the partition")


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

    def group(self, partition: Partition) -> object:
        """This rank's process group of ``partition`` (created collectively once)."""
        import torch.distributed as dist
        pg = self._by_partition.get(partition)
        if pg is not None:
            return pg
        world = tuple(range(self.topology.world_size))
        me = dist.get_rank()
        mine = None
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

    def span(self, level: str) -> object:
        """Ranks sharing one domain of ``level`` (gcd: the GCD pair, gpu: the node)."""
        return self.group(topology_partition(self.topology, "span", level))

    def cross(self, level: str) -> object:
        """Ranks with the same position inside their ``level`` domain's children."""
        return self.group(topology_partition(self.topology, "cross", level))

    def axes(self, axes: ParallelAxes, names: Sequence[str]) -> object:
        """The group over parallel ``axes`` ``names`` containing this rank."""
        return self.group(axes.groups(names))

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


# ---- 3D-PMM: the 4D grid X x Y x Z x data (001 §5.1.1, §5.1.2) ---------------------------

PMM_AXES: tuple[str, ...] = ("x", "y", "z", "data")


def pmm_axes(x: int, y: int, z: int, data: int, world_size: int) -> ParallelAxes:
    """The 4D grid laid over the ranks, X innermost, then Y, Z, data outermost (001 §5.1.2).

    With ranks numbered innermost topology level first, X groups are the closest ranks, so
    the fastest links carry X (001 Fig 5.1: 8 ranks with all degrees 2 give X groups
    (0,1),(2,3),... and Y groups (0,2),(1,3),...).
    """
    return ParallelAxes.build([("x", x), ("y", y), ("z", z), ("data", data)], world_size)


def axis_levels(axes: ParallelAxes, topology: Topology) -> dict[str, str | None]:
    """Outermost topology level any group of each axis crosses (None for a degree of 1)."""
    out: dict[str, str | None] = {}
    for name, _ in axes.axes:
        levels = {topology.level_of(g) for g in axes.groups([name])} - {None}
        out[name] = max(levels, key=topology.index) if levels else None
    return out


PMM_TENSOR: tuple[str, ...] = ("x", "y", "z")


def pmm_groups(registry: GroupRegistry, axes: ParallelAxes) -> dict[str, object | None]:
    """This rank's process group along each grid axis and over the tensor axes X x Y x Z
    (key ``tensor``, DeepSpeed's model-parallel group). X, Y and Z of degree 1 get None
    (nothing to communicate); ``data`` and ``tensor`` always get a group, since DeepSpeed
    reads None as the whole world.

    Collective: every rank calls it with the same ``axes``; groups are created in one
    order and cached by the registry.
    """
    out = {n: registry.axes(axes, [n]) if axes.size(n) > 1 else None for n in PMM_TENSOR}
    out["data"] = registry.axes(axes, ["data"])
    out["tensor"] = registry.axes(axes, PMM_TENSOR)
    return out


# ---- TED: tensor x expert x data parallelism (001 §7.1) ---------------------------------
#
# Notation (001 §7.1): G ranks; G_tensor tensor-parallel degree, shared by expert and
# non-expert blocks; G_expert expert-parallel degree; G_data^exp expert-data degree;
# G_data^nonexp non-expert data degree; E experts, E = k * G_expert (TED itself sets k = 1).
#   Eq 7.1  G_tensor * G_expert * G_data^exp = G_tensor * G_data^nonexp = G
#   Eq 7.7  G_data^exp = G_data^nonexp / G_expert
# Rank layout, tensor innermost, then expert, then expert-data (DeepSpeed's
# ``_get_expert_parallel_ranks`` and 001 Fig 7.3 agree):
#   rank = t + G_tensor * (e + G_expert * d)
# so a tensor group is G_tensor consecutive ranks (inside a GCD pair / GPU / node when
# G_tensor divides it), and an expert group the G_expert ranks of stride G_tensor next to
# it: the smallest domain the all-to-all can stay in once the tensor groups are placed.

TED_GROUP_KINDS: tuple[str, ...] = ("tensor", "expert", "expert_data", "data")


@dataclass(frozen=True)
class TEDLayout:
    """Validated TED degrees (Eq 7.1) and their rank layout."""

    tensor: int
    expert: int
    expert_data: int

    @classmethod
    def build(
        cls, world_size: int, tensor: int, expert: int, expert_data: int | None = None
    ) -> "TEDLayout":
        """Check Eq 7.1 for ``world_size`` ranks; ``expert_data=None`` infers G_data^exp."""
        for key, value in (("tensor_parallel", tensor), ("expert_parallel", expert)):
            if value < 1:
                raise GroupError(f"ds_ext.ted.{key}={value} must be >= 1")
        if expert_data is None:
            if world_size % (tensor * expert):
                raise GroupError(
                    f"ds_ext.ted: world size {world_size} is not divisible by tensor_parallel {tensor} "
                    f"x expert_parallel {expert} (Eq 7.1: G_tensor x G_expert x G_data^exp = G)"
                )
            expert_data = world_size // (tensor * expert)
        elif tensor * expert * expert_data != world_size:
            raise GroupError(
                f"ds_ext.ted: tensor_parallel {tensor} x expert_parallel {expert} x expert_data_parallel "
                f"{expert_data} = {tensor * expert * expert_data} != world size {world_size} (Eq 7.1)"
            )
        return cls(tensor, expert, expert_data)

    @property
    def axes(self) -> ParallelAxes:
        return ParallelAxes(
            (("tensor", self.tensor), ("expert", self.expert), ("expert_data", self.expert_data))
        )

    @property
    def world_size(self) -> int:
        return self.tensor * self.expert * self.expert_data

    @property
    def nonexp_data(self) -> int:
        """G_data^nonexp = G_expert x G_data^exp (Eq 7.1 / 7.7)."""
        return self.expert * self.expert_data

    def coords(self, rank: int) -> dict[str, int]:
        """``{"tensor": t, "expert": e, "expert_data": d}`` of ``rank``."""
        return self.axes.coords(rank)

    def partition(self, kind: str) -> Partition:
        """The world split into TED groups of ``kind`` (one of :data:`TED_GROUP_KINDS`).

        ``data`` is the non-expert data-parallel group (expert x expert-data axes);
        ``expert_replicas`` (tensor x expert-data axes) holds the ranks of one expert rank, which
        reduce the gradients of experts kept whole on every tensor rank (DeepSpeed's
        ``enable_expert_tensor_parallelism=False``).
        """
        names = {"tensor": ["tensor"], "expert": ["expert"], "expert_data": ["expert_data"],
                 "data": ["expert", "expert_data"], "expert_replicas": ["tensor", "expert_data"]}
        if kind not in names:
            raise GroupError(f"unknown TED group {kind!r}; allowed: {', '.join(TED_GROUP_KINDS)}")
        return self.axes.groups(names[kind])

    def check_placement(self, topo: Topology) -> None:
        """Refuse tensor groups that straddle a node (001 §7.1.1: G_tensor <= GPUs per node)."""
        if topo.world_size != self.world_size:
            raise GroupError(f"TED layout of {self.world_size} ranks on a topology of {topo.world_size}")
        node = topo.ranks_per_node if len(topo.levels) > 1 else topo.world_size
        if node % self.tensor:
            raise GroupError(
                f"ds_ext.ted.tensor_parallel={self.tensor} would split tensor groups across nodes of "
                f"{node} ranks ({topo.name}); allowed: a divisor of {node}"
            )

    def levels(self, topo: Topology, rank: int) -> dict[str, str | None]:
        """The outermost topology level each TED group of ``rank`` spans (None: one rank)."""
        return {k: topo.level_of(member_group(self.partition(k), rank)) for k in TED_GROUP_KINDS}


def ted_process_groups(registry: GroupRegistry, layout: TEDLayout) -> dict[str, object]:
    """This rank's TED process groups by kind (collective: every rank creates all of them)."""
    layout.check_placement(registry.topology)
    return {kind: registry.group(layout.partition(kind)) for kind in TED_GROUP_KINDS}
