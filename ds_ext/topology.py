"""Hierarchical machine topology: ordered levels, rank coordinates, level attribution.

A topology is a list of *levels*, innermost first. Each level is a link class (003 §IV):
on Frontier, ``gcd`` joins the 2 GCDs of one MI250X (200 GB/s), ``gpu`` joins the 4
MI250X of a node over Infinity Fabric (100 GB/s per GCD), ``node`` joins nodes over Slingshot
(4 x 25 GB/s per node). ``size`` of a level is its fan-out: how many domains of the
level below it joins. Ranks are laid out by rank order, innermost level fastest::

    rank = gcd + 2 * (gpu + 4 * node)          # Frontier preset

Notation (003 Table III): P = ranks per node, N = nodes, W = N * P.

A collective over a set of ranks travels over the *outermost* level on which the
ranks' coordinates differ; :meth:`Topology.level_of` returns that level. This is
how the communication ledger attributes bytes to links.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Protocol, Sequence

from ds_ext.errors import DsExtError

GB = 1e9
US = 1e-6


class TopologyError(DsExtError, ValueError):
    """A topology that cannot be built or does not fit the job."""


@dataclass(frozen=True)
class Level:
    """One link class of the hierarchy.

    ``bandwidth`` is bytes/s one rank can push over this link class while all ranks
    use it at once; ``latency`` is seconds per message (alpha of the alpha-beta model).
    ``size`` is None only for the outermost level before the world size is known.
    ``link_bandwidth``: bytes/s of one flow alone on one link of the class (a ring's hop out
    of a node), where measured (``ds_ext.cluster.measure``); None: the link's ranks' shares
    together.
    """

    name: str
    size: int | None
    bandwidth: float
    latency: float
    link_bandwidth: float | None = None

    def link(self, sharing: int) -> float:
        """Bytes/s of one flow alone on one link of the class: ``link_bandwidth`` where measured,
        else the shares of the ``sharing`` ranks behind the link together."""
        return self.link_bandwidth if self.link_bandwidth is not None else sharing * self.bandwidth


# Frontier (003 §IV, Table II; 004 §III-A, Fig. 4): GCD-GCD 200 GB/s inside one MI250X; between
# MI250X 100 GB/s per GCD (004 §III-A: "across the die" half the in-die 200; an MI250X's links to
# the other three, 2 x 50 GB/s to its adjacent pair and 50 to each cross pair, carry 200 GB/s for its
# 2 GCDs; ds-ext plan's figure, ds_ext.planner.hardware ``gpu_bandwidth``; 003 Table II's one-link
# 50 GB/s is the planner's sensitivity row); 4 x Slingshot-11 200 Gb/s = 100 GB/s per node, one NIC
# per MI250X -> 12.5 GB/s per GCD.
# Latencies are not given by the papers: assumed RCCL-like values, documented in README.
_PRESETS: dict[str, tuple[Level, ...]] = {
    "frontier": (
        Level("gcd", 2, 200 * GB, 5 * US),
        Level("gpu", 4, 100 * GB, 8 * US),
        Level("node", None, 12.5 * GB, 15 * US),
    ),
    # DGX-A100 (003 §IV, Table I): 8 A100 on NVLink3 600 GB/s; 8 x HDR 200 Gb/s = 200 GB/s
    # per node, one HCA per GPU -> 25 GB/s per GPU.
    "dgx-a100": (
        Level("gpu", 8, 600 * GB, 3 * US),
        Level("node", None, 25 * GB, 10 * US),
    ),
}

PRESET_NAMES: tuple[str, ...] = tuple(_PRESETS)

# Without a preset or levels: one level inside the node and one across nodes, sized from the
# launcher (LOCAL_SIZE / SLURM_NTASKS_PER_NODE).
DETECTED_LEVELS = (Level("local", None, 50 * GB, 8 * US), Level("node", None, 12.5 * GB, 15 * US))


def preset_levels(name: str) -> tuple[Level, ...]:
    """The levels of a named preset (outermost size unresolved)."""
    try:
        return _PRESETS[name]
    except KeyError:
        raise TopologyError(f"unknown topology preset {name!r}; allowed: {', '.join(PRESET_NAMES)}") from None


@dataclass(frozen=True)
class Topology:
    """A resolved hierarchy: every level has a size and the product is the world size."""

    levels: tuple[Level, ...]
    name: str = "custom"
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.levels:
            raise TopologyError("a topology needs at least one level")
        names = [lv.name for lv in self.levels]
        if len(set(names)) != len(names):
            raise TopologyError(f"level names must be unique, got {names}")
        for lv in self.levels:
            if lv.size is None or lv.size < 1:
                raise TopologyError(f"level {lv.name!r} has size {lv.size}; sizes must be >= 1")
            if lv.bandwidth <= 0 or lv.latency < 0 or (lv.link_bandwidth is not None and lv.link_bandwidth <= 0):
                raise TopologyError(f"level {lv.name!r} needs bandwidth > 0 and latency >= 0")
        object.__setattr__(self, "_index", {n: i for i, n in enumerate(names)})

    # ---- construction -------------------------------------------------------------
    @classmethod
    def build(
        cls,
        levels: Sequence[Level],
        world_size: int,
        name: str = "custom",
        sizes: Mapping[str, int] | None = None,
    ) -> "Topology":
        """Resolve ``levels`` for ``world_size`` ranks.

        ``sizes`` overrides level sizes by name (e.g. emulate 2 GPUs per node). The
        outermost level's size, if unset, becomes ``world_size / ranks-per-node``; a
        world size that is not a multiple of the inner levels' product is an error.
        """
        known = {lv.name for lv in levels}
        for key in sizes or {}:
            if key not in known:
                raise TopologyError(f"topology {name!r} has no level {key!r}; levels: {', '.join(known)}")
        levels = [replace(lv, size=(sizes or {}).get(lv.name, lv.size)) for lv in levels]
        inner = math.prod(lv.size or 1 for lv in levels[:-1])
        outer = levels[-1].size
        shape = " x ".join(f"{lv.size} {lv.name}" for lv in levels[:-1])
        if world_size < 1:
            raise TopologyError(f"world size must be >= 1, got {world_size}")
        if outer is None:
            if world_size % inner:
                raise TopologyError(
                    f"world size {world_size} does not fit topology {name!r} "
                    f"({shape} = {inner} ranks per {levels[-1].name}): "
                    f"it must be a multiple of {inner}"
                )
            levels[-1] = replace(levels[-1], size=world_size // inner)
        elif inner * outer != world_size:
            raise TopologyError(
                f"world size {world_size} does not fit topology {name!r} "
                f"({shape} x {outer} {levels[-1].name} = {inner * outer} ranks)"
            )
        return cls(tuple(levels), name)

    @classmethod
    def from_preset(cls, name: str, world_size: int, sizes: Mapping[str, int] | None = None) -> "Topology":
        return cls.build(preset_levels(name), world_size, name, sizes)

    # ---- queries --------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return math.prod(lv.size for lv in self.levels)  # type: ignore[misc]

    @property
    def level_names(self) -> tuple[str, ...]:
        return tuple(lv.name for lv in self.levels)

    def level(self, name: str) -> Level:
        return self.levels[self.index(name)]

    def index(self, name: str) -> int:
        try:
            return self._index[name]
        except KeyError:
            raise TopologyError(
                f"topology {self.name!r} has no level {name!r}; levels: {', '.join(self.level_names)}"
            ) from None

    def domain_size(self, name: str) -> int:
        """Ranks in one domain of level ``name`` (gcd: 2, gpu: 8 = a node, node: W)."""
        return math.prod(lv.size for lv in self.levels[: self.index(name) + 1])  # type: ignore[misc]

    @property
    def ranks_per_node(self) -> int:
        """P: ranks inside one domain of the second-outermost level."""
        return self.world_size // self.levels[-1].size  # type: ignore[operator]

    def coords(self, rank: int) -> tuple[int, ...]:
        """Mixed-radix coordinates of ``rank``, innermost level first."""
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} outside world of {self.world_size}")
        out = []
        for lv in self.levels:
            rank, c = divmod(rank, lv.size)  # type: ignore[arg-type]
            out.append(c)
        return tuple(out)

    def level_of(self, ranks: Sequence[int]) -> str | None:
        """Outermost level on which ``ranks`` differ; None for a single rank.

        The ranks differ on level i or an outer one iff ``r // stride_i`` differs, and a
        floor division is monotonic, so the smallest and largest rank decide: O(len(ranks)).
        """
        lo, hi = min(ranks), max(ranks)
        self.coords(lo), self.coords(hi)  # range check
        stride = self.world_size
        for i in range(len(self.levels) - 1, -1, -1):
            stride //= self.levels[i].size  # type: ignore[operator]
            if lo // stride != hi // stride:
                return self.levels[i].name
        return None

    def of_group(self, ranks: Sequence[int], name: str) -> "Topology":
        """The hierarchy as a group of ``ranks`` sees it: on each level, as many positions as
        the members take there; levels where all members sit together are left out (one kept
        if the group is a single rank). Member i of the sorted ``ranks`` is rank i of the
        result, so shard and group logic written for a world runs unchanged over the group.

        The members must form a grid: every combination of their per-level positions is a
        member (Megatron's and DeepSpeed's data-parallel groups do: a fixed stride inside a
        block); anything else is refused."""
        members = sorted(set(ranks))
        coords = [self.coords(r) for r in members]
        taken = [sorted({c[i] for c in coords}) for i in range(len(self.levels))]
        if math.prod(len(t) for t in taken) != len(members):
            raise TopologyError(
                f"ranks {members} do not form a grid over the levels of topology {self.name!r}: "
                "a group must hold every combination of its members' positions"
            )
        levels = tuple(replace(lv, size=len(t)) for lv, t in zip(self.levels, taken) if len(t) > 1)
        return Topology(levels or (replace(self.levels[0], size=1),), name)

    def span_groups(self, name: str) -> list[list[int]]:
        """Partition of the world into the domains of level ``name``.

        ``span_groups("gcd")`` are the GCD pairs, ``span_groups("gpu")`` the nodes,
        ``span_groups(outermost)`` the world. Collectives inside one stay on links up to
        ``name``.
        """
        d = self.domain_size(name)
        return [list(range(s, s + d)) for s in range(0, self.world_size, d)]

    def cross_groups(self, name: str) -> list[list[int]]:
        """Ranks that differ only in their coordinate at level ``name``.

        ``cross_groups("node")`` holds the ranks with the same local index on every
        node (003's G_inter); ``cross_groups("gpu")`` the same GCD index on each MI250X
        of one node.
        """
        i = self.index(name)
        stride = self.domain_size(name) // self.levels[i].size  # type: ignore[operator]
        size = self.levels[i].size
        groups = []
        for base in range(0, self.world_size, stride * size):  # type: ignore[operator]
            for off in range(stride):
                groups.append([base + off + k * stride for k in range(size)])  # type: ignore[arg-type]
        return groups

    def describe(self) -> str:
        parts = [f"{lv.name}={lv.size} ({lv.bandwidth / GB:g} GB/s, {lv.latency / US:g} us)" for lv in self.levels]
        return f"{self.name}: world {self.world_size} = " + " x ".join(parts)


# ---- detection ----------------------------------------------------------------------

_VISIBLE_VARS = ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")


@dataclass(frozen=True)
class JobEnvironment:
    """What the launcher told this process about the job."""

    world_size: int
    rank: int
    local_rank: int | None
    local_size: int | None
    num_nodes: int | None
    visible_devices: tuple[str, ...]
    source: str


def _slurm_tasks_per_node(value: str) -> int | None:
    """First count of a Slurm task list such as ``8(x2)`` or ``8,8``."""
    m = re.match(r"(\d+)", value)
    return int(m.group(1)) if m else None


def _int_env(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        if env.get(name, "").strip():
            try:
                return int(env[name])
            except ValueError:
                raise TopologyError(f"environment variable {name}={env[name]!r} is not an integer")
    return None


def detect_environment(env: Mapping[str, str] | None = None) -> JobEnvironment:
    """Read world, rank and per-node layout from launcher variables.

    Sources, first match wins: torchrun / DeepSpeed launcher (``WORLD_SIZE``, ``RANK``,
    ``LOCAL_RANK``, ``LOCAL_SIZE`` or ``LOCAL_WORLD_SIZE``), then Slurm (``SLURM_NTASKS``,
    ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NTASKS_PER_NODE``, ``SLURM_NNODES``).
    Visible devices come from ROCR/HIP/CUDA_VISIBLE_DEVICES.
    """
    env = os.environ if env is None else env
    visible: tuple[str, ...] = ()
    for var in _VISIBLE_VARS:
        if env.get(var):
            visible = tuple(v for v in env[var].split(",") if v)
            break
    if "WORLD_SIZE" in env:
        world = _int_env(env, "WORLD_SIZE") or 1
        local_size = _int_env(env, "LOCAL_SIZE", "LOCAL_WORLD_SIZE")
        nodes = _int_env(env, "SLURM_NNODES")
        if nodes is None and local_size:
            nodes = world // local_size if world % local_size == 0 else None
        return JobEnvironment(
            world,
            _int_env(env, "RANK") or 0,
            _int_env(env, "LOCAL_RANK"),
            local_size,
            nodes,
            visible,
            "launcher",
        )
    if "SLURM_NTASKS" in env:
        per_node = _slurm_tasks_per_node(env.get("SLURM_NTASKS_PER_NODE", ""))
        return JobEnvironment(
            _int_env(env, "SLURM_NTASKS") or 1,
            _int_env(env, "SLURM_PROCID") or 0,
            _int_env(env, "SLURM_LOCALID"),
            per_node,
            _int_env(env, "SLURM_NNODES"),
            visible,
            "slurm",
        )
    return JobEnvironment(1, 0, None, None, None, visible, "single-process")


def slurm_rank_variables(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """torch.distributed's rank variables for a task started by ``srun`` (one task per GCD).

    Empty when a launcher already set ``WORLD_SIZE`` or outside Slurm. ``MASTER_ADDR`` /
    ``MASTER_PORT`` are not derivable from the task's own variables; the batch script
    sets them (launch/frontier.sbatch).
    """
    env = os.environ if env is None else env
    job = detect_environment(env)
    if job.source != "slurm":
        return {}
    out = {"WORLD_SIZE": str(job.world_size), "RANK": str(job.rank)}
    if job.local_rank is not None:
        out["LOCAL_RANK"] = str(job.local_rank)
    if job.local_size is not None:
        out["LOCAL_SIZE"] = str(job.local_size)
    return out


def check_fits_job(topo: Topology, job: JobEnvironment) -> None:
    """Raise unless the real job has the topology's ranks per node.

    Skipped in emulation, where the hierarchy is imposed on one host by rank order.
    """
    if job.local_size is not None and job.local_size != topo.ranks_per_node:
        raise TopologyError(
            f"the job runs {job.local_size} ranks per node (launcher variables) but topology "
            f"{topo.name!r} needs {topo.ranks_per_node}; fix the launch, or set "
            f"ds_ext.topology.emulate=true to impose the hierarchy by rank order"
        )


class TopologyRequest(Protocol):
    """What :func:`resolve_topology` reads of the ``topology`` section (``ds_ext.config.TopologyConfig``,
    a schema above this layer)."""

    preset: str | None
    levels: Sequence[Any] | None  # each with ``to_level() -> Level``
    sizes: Mapping[str, int]
    emulate: bool


def resolve_topology(cfg: TopologyRequest, world_size: int, job: JobEnvironment) -> Topology:
    """Build the topology the config asks for and check it against the job."""
    if cfg.levels is not None:
        topo = Topology.build([lv.to_level() for lv in cfg.levels], world_size, "custom", cfg.sizes)
    elif cfg.preset is not None:
        topo = Topology.build(preset_levels(cfg.preset), world_size, cfg.preset, cfg.sizes)
    else:
        local = job.local_size or world_size
        inner, outer = DETECTED_LEVELS
        topo = Topology.build(
            [replace(inner, size=local), outer],
            world_size,
            "detected",
            cfg.sizes,
        )
    if not cfg.emulate:
        check_fits_job(topo, job)
    return topo
