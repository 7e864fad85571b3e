"""The parallel dimensions of a job, stated once (the ``parallel`` layer of docs/architecture.md; torchtitan's ``ParallelDims``).

:class:`ParallelDims` holds validated degrees of named axes, innermost first, laid over the
ranks in that order::

    rank = a_0 + s_0 * (a_1 + s_1 * (...))        # coordinate a_i, degree s_i of axis i

so a group over a subset of axes holds the ranks whose coordinates differ only along those
axes, and the innermost axes get the closest ranks (the fastest topology level; :meth:`spans`
says which level each axis crosses). A plugin's layout is a view of one: a ``ParallelDims`` plus
its named groups (each a set of axes), which :func:`ds_ext.groups.build_process_groups` turns
into process groups:

* :class:`TEDLayout` (001 §7.1): ``tensor`` x ``expert`` x ``expert_data``;
* :class:`Grid` (001 §5.1.1, §5.1.2): ``x`` x ``y`` x ``z`` x ``data``;
* :class:`JobLayout`: the job's layout, stated once: which axes form the tensor, pipeline,
  data, expert and expert-data groups, from the caller's mpu (Megatron's rank order) or from
  one of the layouts above (``runtime.parallel``; ZeRO-topo shards over its data group).

Pure index logic: no torch, no processes (the planner, the schema and the CLI use it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Mapping, Sequence

from ds_ext.errors import DsExtError
from ds_ext.topology import Topology

Partition = tuple[tuple[int, ...], ...]


class GroupError(DsExtError, ValueError):
    """Parallel degrees that do not fit the world, or an unknown axis or group."""


def member_group(partition: Partition, rank: int) -> tuple[int, ...]:
    """The group of ``partition`` that contains ``rank``."""
    for g in partition:
        if rank in g:
            return g
    raise GroupError(f"rank {rank} is in no group of the partition")


@dataclass(frozen=True)
class ParallelDims:
    """Named parallel degrees laid out over the ranks, innermost axis first (see module)."""

    axes: tuple[tuple[str, int], ...]

    @classmethod
    def build(
        cls,
        degrees: Sequence[tuple[str, int | None]],
        world_size: int,
        owner: str = "parallel",
        keys: Mapping[str, str] | None = None,
        note: str = "",
        error: type[GroupError] | None = None,
    ) -> "ParallelDims":
        """Resolve at most one ``None`` degree from ``world_size`` and check the product: the one
        validator of every layout (Megatron's mpu, TED, 3D-PMM). Errors are one line that names
        ``owner`` and each degree by its config key (``keys``, default the axis name), then
        ``note`` (the paper's equation), as ``error`` (default :class:`GroupError`)."""
        error = error or GroupError
        label = dict(keys or {})
        names = [n for n, _ in degrees]
        if len(set(names)) != len(names):
            raise error(f"{owner}: parallel axis names must be unique, got {names}")
        free = [label.get(n, n) for n, s in degrees if s is None]
        if len(free) > 1:
            raise error(f"{owner}: at most one parallel degree may be inferred, got {free}")
        for n, s in degrees:
            if s is not None and s < 1:
                raise error(f"{owner}.{label.get(n, n)}={s} must be >= 1")
        fixed = math.prod(s for _, s in degrees if s is not None)
        given = " * ".join(f"{label.get(n, n)}={s}" for n, s in degrees if s is not None)
        if free:
            if world_size % fixed:
                raise error(f"{owner}: world size {world_size} is not divisible by {given}{note}")
            degrees = [(n, world_size // fixed if s is None else s) for n, s in degrees]
        elif fixed != world_size:
            raise error(f"{owner}: {given} = {fixed} != world size {world_size}{note}")
        return cls(tuple((n, int(s)) for n, s in degrees))  # type: ignore[arg-type]

    @property
    def world_size(self) -> int:
        return math.prod(s for _, s in self.axes)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.axes)

    def size(self, *names: str) -> int:
        """Ranks of a group over axes ``names`` (the product of their degrees)."""
        return math.prod(self.axes[self._index(n)][1] for n in names)

    def _index(self, name: str) -> int:
        for i, (n, _) in enumerate(self.axes):
            if n == name:
                return i
        raise GroupError(f"unknown parallel axis {name!r}; axes: {list(self.names)}")

    def coords(self, rank: int) -> dict[str, int]:
        out = {}
        for n, s in self.axes:
            rank, out[n] = divmod(rank, s)
        return out

    def group_rank(self, names: Sequence[str], rank: int) -> int:
        """``rank``'s position in its group over axes ``names`` (their coordinates, the first
        fastest: the order of the group's ascending global ranks)."""
        coords, out, stride = self.coords(rank), 0, 1
        for n in sorted(names, key=self._index):
            out += coords[n] * stride
            stride *= self.size(n)
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

    def spans(self, topology: Topology) -> dict[str, str | None]:
        """Outermost topology level any group of each axis crosses (None for a degree of 1), in
        O(levels) per axis: the groups of an axis of stride S (product of the inner degrees) and
        degree g tile blocks of S g consecutive ranks, so some group crosses a domain of D ranks
        exactly when D is not a multiple of S g; the axis spans the outermost level whose inner
        domain size is not."""
        out: dict[str, str | None] = {}
        stride = 1
        for name, g in self.axes:
            block, level, domain = stride * g, None, 1
            if g > 1:
                for lv in topology.levels:
                    if domain % block:
                        level = lv.name
                    domain *= lv.size  # type: ignore[operator]
            out[name] = level
            stride = block
        return out


class Layout:
    """A plugin's view of :class:`ParallelDims`: its named groups, each a set of axes.

    ``GROUPS``: name -> axes, in the order the groups are created; ``OPTIONAL``: groups that
    get no process group (None) when they hold one rank (nothing to communicate);
    ``AUXILIARY``: groups built for a plugin's own use, left out of :meth:`levels`.
    """

    NAME: ClassVar[str]
    GROUPS: ClassVar[Mapping[str, tuple[str, ...]]]
    OPTIONAL: ClassVar[frozenset[str]] = frozenset()
    AUXILIARY: ClassVar[frozenset[str]] = frozenset()
    parallel_dims: ParallelDims

    @property
    def world_size(self) -> int:
        return self.parallel_dims.world_size

    def coords(self, rank: int) -> dict[str, int]:
        return self.parallel_dims.coords(rank)

    def axes_of(self, group: str) -> tuple[str, ...]:
        try:
            return self.GROUPS[group]
        except KeyError:
            raise GroupError(f"unknown {self.NAME} group {group!r}; allowed: {', '.join(self.GROUPS)}") from None

    def partition(self, group: str) -> Partition:
        """The world split into the groups named ``group``."""
        return self.parallel_dims.groups(self.axes_of(group))

    def levels(self, topo: Topology, rank: int) -> dict[str, str | None]:
        """The outermost topology level each named group of ``rank`` spans (None: one rank)."""
        return {g: topo.level_of(member_group(self.partition(g), rank)) for g in self.GROUPS if g not in self.AUXILIARY}


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


@dataclass(frozen=True)
class TEDLayout(Layout):
    """Validated TED degrees (Eq 7.1) and their named groups.

    ``data`` is the non-expert data-parallel group (expert x expert-data axes);
    ``expert_replicas`` (tensor x expert-data axes) holds the ranks of one expert rank, which
    reduce the gradients of experts kept whole on every tensor rank (DeepSpeed's
    ``enable_expert_tensor_parallelism=False``; auxiliary). ``pipeline``: the stages of a
    DeepSpeed PipelineEngine, the outermost axis (DeepSpeed's ``PipeModelDataParallelTopology``
    and Megatron order pipe outside data outside model), so Eq 7.1 holds per stage:
    G_tensor x G_expert x G_data^exp x G_pipe = G; the axis and its group exist from 2 stages on.
    """

    NAME: ClassVar[str] = "TED"
    AUXILIARY: ClassVar[frozenset[str]] = frozenset({"expert_replicas"})
    STAGE_GROUPS: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "tensor": ("tensor",),
        "expert": ("expert",),
        "expert_data": ("expert_data",),
        "data": ("expert", "expert_data"),
        "expert_replicas": ("tensor", "expert_data"),
    }

    parallel_dims: ParallelDims

    @property
    def GROUPS(self) -> Mapping[str, tuple[str, ...]]:  # type: ignore[override]
        """The groups of one stage (``STAGE_GROUPS``), and ``pipeline`` over 2 or more stages."""
        return {**self.STAGE_GROUPS, "pipeline": ("pipeline",)} if self.pipeline > 1 else self.STAGE_GROUPS

    @classmethod
    def build(
        cls, world_size: int, tensor: int, expert: int, expert_data: int | None = None, pipeline: int = 1
    ) -> "TEDLayout":
        """Check Eq 7.1 for ``world_size`` ranks over ``pipeline`` stages (the ranks of one stage;
        a PipelineModule's grid divides the world); ``expert_data=None`` infers G_data^exp."""
        if pipeline < 1 or world_size % pipeline:
            raise GroupError(f"ds_ext.ted: world size {world_size} is not {pipeline} equal pipeline stages")
        stage = ParallelDims.build(
            (("tensor", tensor), ("expert", expert), ("expert_data", expert_data)),
            world_size // pipeline,
            "ds_ext.ted",
            keys={"tensor": "tensor_parallel", "expert": "expert_parallel", "expert_data": "expert_data_parallel"},
            note=" (Eq 7.1: G_tensor x G_expert x G_data^exp = G)"
            + ("" if pipeline == 1 else f", the ranks of one of {pipeline} pipeline stages"),
        )
        return cls(stage if pipeline == 1 else ParallelDims((*stage.axes, ("pipeline", pipeline))))

    @property
    def pipeline(self) -> int:
        """Pipeline stages (1: no PipelineEngine)."""
        return self.parallel_dims.size("pipeline") if "pipeline" in self.parallel_dims.names else 1

    @property
    def tensor(self) -> int:
        """G_tensor."""
        return self.parallel_dims.size("tensor")

    @property
    def expert(self) -> int:
        """G_expert."""
        return self.parallel_dims.size("expert")

    @property
    def expert_data(self) -> int:
        """G_data^exp."""
        return self.parallel_dims.size("expert_data")

    @property
    def nonexp_data(self) -> int:
        """G_data^nonexp = G_expert x G_data^exp (Eq 7.1 / 7.7)."""
        return self.parallel_dims.size("expert", "expert_data")

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


# ---- 3D-PMM: the 4D grid X x Y x Z x data (001 §5.1.1, §5.1.2) ---------------------------


class GridError(GroupError):
    """A grid that does not fit the world or the model; the message names the key."""


@dataclass(frozen=True)
class Grid(Layout):
    """The 4D grid: degrees (G_x, G_y, G_z, G_data) laid over the ranks X innermost, then Y, Z,
    data outermost (001 §5.1.2).

    With ranks numbered innermost topology level first, X groups are the closest ranks, so the
    fastest links carry X (001 Fig 5.1: 8 ranks with all degrees 2 give X groups (0,1),(2,3),...
    and Y groups (0,2),(1,3),...). Groups: each grid axis (X, Y, Z of degree 1 get none), and
    ``tensor`` over X x Y x Z (DeepSpeed's model-parallel group); ``data`` and ``tensor`` always
    get one, since DeepSpeed reads None as the whole world.
    """

    NAME: ClassVar[str] = "3D-PMM"
    GROUPS: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "x": ("x",),
        "y": ("y",),
        "z": ("z",),
        "data": ("data",),
        "tensor": ("x", "y", "z"),
    }
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"x", "y", "z"})

    x: int = 1
    y: int = 1
    z: int = 1
    data: int = 1

    @property
    def dims(self) -> tuple[int, int, int, int]:
        return (self.x, self.y, self.z, self.data)

    @property
    def parallel_dims(self) -> ParallelDims:
        return ParallelDims((("x", self.x), ("y", self.y), ("z", self.z), ("data", self.data)))

    @property
    def tensor(self) -> int:
        """G_tensor = G_x G_y G_z."""
        return self.x * self.y * self.z

    def __str__(self) -> str:
        return f"(x={self.x}, y={self.y}, z={self.z}, data={self.data})"

    def check_world(self, world_size: int) -> None:
        """The product x * y * z * data must equal the world size (001 §5.1.2)."""
        ParallelDims.build(self.parallel_dims.axes, world_size, "ds_ext.pmm3d.grid", error=GridError)


# ---- the job's layout: every parallel axis of one job, stated once ------------------------


@dataclass(frozen=True)
class JobLayout(Layout):
    """The job's parallel layout, built once (torchtitan's ``ParallelDims``, megatron-core's
    ``ProcessGroupCollection``): which axes of :attr:`parallel_dims` form the tensor (model-parallel),
    pipeline and data-parallel groups, and for MoE the expert and expert-data groups.

    Sources: the caller's mpu (:meth:`megatron`: Megatron-DeepSpeed and GPT-NeoX order tensor
    innermost, then data, then pipeline), a plugin's layout (:meth:`of`: TED, 3D-PMM), or
    plain data parallelism over the world (:meth:`data_parallel`). Plugins take their groups
    from it; :meth:`describe` prints each group's degree and the outermost topology level it
    crosses (the start-up banner).
    """

    NAME: ClassVar[str] = "job"
    parallel_dims: ParallelDims
    tensor_axes: tuple[str, ...] = ()
    pipeline_axes: tuple[str, ...] = ()
    data_axes: tuple[str, ...] = ()
    expert_axes: tuple[str, ...] = ()
    expert_data_axes: tuple[str, ...] = ()
    source: str = "data parallelism over the world"

    ROLES: ClassVar[tuple[str, ...]] = ("tensor", "pipeline", "data", "expert", "expert_data")

    @property
    def GROUPS(self) -> Mapping[str, tuple[str, ...]]:  # type: ignore[override]
        """Each role with axes -> its axes; the model-parallel group (tensor x pipeline, what
        DeepSpeed sums gradient norms over) as ``model``; with experts, ``expert_model``
        (tensor x pipeline x expert: the ranks that hold other slices or other experts, over
        which an expert gradient's norm is summed after its expert-data group)."""
        roles = {r: getattr(self, f"{r}_axes") for r in self.ROLES}
        model = self.tensor_axes + self.pipeline_axes
        expert_model = tuple(a for a in model + self.expert_axes if a not in self.expert_data_axes)
        experts = {"expert_model": expert_model} if self.expert_axes else {}
        return {**{r: a for r, a in roles.items() if a}, "model": model, **experts}

    def degree(self, role: str) -> int:
        """Ranks in one group of ``role`` (1 where the job has no such axis)."""
        return self.parallel_dims.size(*self.GROUPS.get(role, ()))

    @classmethod
    def data_parallel(cls, world_size: int) -> "JobLayout":
        return cls(ParallelDims((("data", world_size),)), data_axes=("data",))

    @classmethod
    def megatron(cls, world_size: int, tensor: int, pipeline: int, source: str) -> "JobLayout":
        """Megatron's order: rank = t + T (d + D p) (tensor innermost, pipeline outermost)."""
        dims = ParallelDims.build((("tensor", tensor), ("data", None), ("pipeline", pipeline)), world_size)
        return cls(dims, tensor_axes=("tensor",), pipeline_axes=("pipeline",), data_axes=("data",), source=source)

    @classmethod
    def of(cls, layout: Layout, source: str, whole_experts: bool = False) -> "JobLayout":
        """The job view of a plugin's layout: TED (tensor; data = expert x expert-data) or a
        3D-PMM grid (tensor = X x Y x Z; data). ``whole_experts``: TED's experts are kept whole
        on every tensor rank, so the group that reduces their gradients (DeepSpeed's expert-data
        group) is TED's ``expert_replicas`` (tensor x expert-data), not its ``expert_data``."""
        g = layout.GROUPS
        expert_data = g.get("expert_replicas" if whole_experts else "expert_data", ())
        return cls(
            layout.parallel_dims,
            tensor_axes=g["tensor"],
            pipeline_axes=g.get("pipeline", ()),
            data_axes=g["data"],
            expert_axes=g.get("expert", ()),
            expert_data_axes=expert_data,
            source=source + (" (experts whole on every tensor rank)" if whole_experts else ""),
        )

    def check_groups(self, rank: int, groups: Mapping[str, Sequence[int]]) -> None:
        """Refuse an mpu whose groups (role -> this rank's member ranks) are not this layout's."""
        for role, ranks in groups.items():
            want = member_group(self.partition(role), rank) if role in self.GROUPS else (rank,)
            if tuple(sorted(ranks)) != want:
                raise GroupError(
                    f"the mpu's {role} group of rank {rank} is {sorted(ranks)}, not {list(want)} as the layout "
                    f"{self.describe_degrees()} puts it (tensor innermost, then data, then pipeline); allowed: "
                    "Megatron's rank order"
                )

    def describe_degrees(self) -> str:
        return " x ".join(f"{r} {self.degree(r)}" for r in self.ROLES if r in self.GROUPS)

    def describe(self, topology: Topology) -> str:
        """One line: each group's degree and the outermost level it crosses."""
        parts = []
        for role in self.ROLES:
            if role in self.GROUPS:
                level = topology.level_of(member_group(self.partition(role), 0))
                parts.append(f"{role} {self.degree(role)} ({'within a rank' if level is None else 'crosses ' + level})")
        return f"{', '.join(parts)}; from {self.source}"
