"""The ds_ext runtime of one rank: parsed config, topology, groups, communicator, plugins.

Built once by ``ds_ext.initialize`` after torch.distributed is up, and reachable as
``engine.ds_ext``. Plugins get it in their constructor and take groups and the
communicator from it explicitly (docs/architecture.md, Style).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import ContextManager, Iterable

import torch
import torch.distributed as dist
from pydantic import BaseModel

from ds_ext import config as cfgmod
from ds_ext.comm import Communicator, Ledger, TimeEmulator
from ds_ext.groups import GroupRegistry
from ds_ext.parallel import JobLayout
from ds_ext.perf import collectives
from ds_ext.plugin import Plugin, registered_plugins
from ds_ext.topology import JobEnvironment, Topology, detect_environment, resolve_topology
from ds_ext.version import __version__


def builtin_plugins() -> tuple[type[Plugin], ...]:
    """The built-in plugins in hook order: one line per built-in plugin (its section is listed in
    ``ds_ext.config.BUILTIN_SECTIONS``). The plugins that define the job's layout (3D-PMM, TED)
    prepare first, so ZeRO-topo shards over the data axis of the model they converted, and attach
    first, before ZeRO-topo swaps the engine's optimizer; SAMO runs beside no other plugin but the
    tiled optimizer (which attaches after it) and checks first, so its refusal is the one that names
    both settings. Imported here, on use: the
    plugin modules import DeepSpeed."""
    from ds_ext.goldfish.plugin import GoldfishPlugin
    from ds_ext.moe.plugin import TEDPlugin
    from ds_ext.optim.plugin import TiledOptimizerPlugin
    from ds_ext.pccl.plugin import PCCLPlugin
    from ds_ext.pmm.plugin import Pmm3dPlugin
    from ds_ext.samo.plugin import SamoPlugin
    from ds_ext.zero_topo.plugin import ZeroTopoPlugin

    return (SamoPlugin, Pmm3dPlugin, TEDPlugin, ZeroTopoPlugin, TiledOptimizerPlugin, PCCLPlugin, GoldfishPlugin)


def plugin_classes() -> dict[str, type[Plugin]]:
    """Name -> plugin class in hook order: the built-ins, then the plugins registered with
    :func:`ds_ext.plugin.register_plugin`, as registered (``ds_ext.config.plugin_sections`` refuses a
    registered name that is a built-in's)."""
    return {p.name: p for p in builtin_plugins()} | registered_plugins()


@dataclass
class Runtime:
    """Everything ds_ext knows about this rank's job."""

    config: BaseModel
    job: JobEnvironment
    topology: Topology
    groups: GroupRegistry
    comm: Communicator
    plugins: list[Plugin] = field(default_factory=list)
    # the arguments of ds_ext.initialize beyond model / optimizer / config (mpu, ...)
    initialize_kwargs: dict = field(default_factory=dict)
    model_bytes: int | None = None  # M: bytes of the model's parameters in the training dtype
    # the job's parallel layout: the caller's mpu or a plugin's, else data parallelism over the world
    parallel: JobLayout | None = None

    @property
    def rank(self) -> int:
        return dist.get_rank()

    def plugin(self, name: str) -> Plugin:
        """The enabled plugin ``name`` (``"zero_topo"``, ``"pmm3d"``, ...)."""
        for plugin in self.plugins:
            if plugin.name == name:
                return plugin
        raise cfgmod.DsExtConfigError(
            f"ds_ext.{name} is not enabled; enabled: {', '.join(p.name for p in self.plugins) or 'none'}"
        )

    def step_owner(self) -> Plugin | None:
        """The enabled plugin that replaces DeepSpeed's optimizer step (``Plugin.owns_step``), or
        None when DeepSpeed's own optimizer (ZeRO stage, fp16 / bf16 wrappers) steps."""
        return next((p for p in self.plugins if p.owns_step), None)

    def parameter_sharder(self) -> Plugin | None:
        """The enabled plugin that shards the parameters into gathered units and saves them sharded
        (``Plugin.shards_parameters``), or None."""
        return next((p for p in self.plugins if p.shards_parameters), None)

    @property
    def ledger(self) -> Ledger:
        return self.comm.ledger

    def gathered_parameters(
        self, params: Iterable[torch.Tensor] | None = None, modify: bool = False, modifier_rank: int | None = 0
    ) -> ContextManager[None]:
        """Full parameters inside the block, like DeepSpeed's ``zero.GatheredParameters``:
        collective when a plugin shards them (ZeRO-topo), a no-op otherwise. ``params``
        None = all; ``modify`` writes changes back into the shards and fp32 masters
        (``modifier_rank``'s values, None = every rank changed them alike)."""
        for plugin in self.plugins:
            ctx = plugin.gathered_parameters(params, modify, modifier_rank)
            if ctx is not None:
                return ctx
        return contextlib.nullcontext()

    def settle(self) -> None:
        """Complete every collective a plugin left in flight past the last optimizer step
        (collective): ZeRO-topo's weight all-gathers under ``gather_across_step``, which the next
        forward would otherwise wait for. For a timed region that must hold all of its steps' work,
        or before reading the weights' storage outside the model."""
        for plugin in self.plugins:
            plugin.settle()

    @classmethod
    def create(
        cls, config: BaseModel, world_size: int | None = None, initialize_kwargs: dict | None = None
    ) -> "Runtime":
        """Build topology, groups and communicator from a parsed ``"ds_ext"`` block.

        Topology errors are raised before any collective.
        """
        job = detect_environment()
        if world_size is None:
            world_size = dist.get_world_size() if dist.is_initialized() else job.world_size
        topology = resolve_topology(config.topology, world_size, job)
        groups = GroupRegistry(topology, config.comm.timeout_s)
        ledger = Ledger(topology.level_names)
        ledger.enabled = config.comm.ledger
        emulator = TimeEmulator(topology, config.comm.time_scale) if config.comm.emulate_time else None
        comm = Communicator(groups, ledger, emulator, config.comm.timeout_s, config.comm.algorithm, collectives)
        runtime = cls(
            config,
            job,
            topology,
            groups,
            comm,
            initialize_kwargs=dict(initialize_kwargs or {}),
            parallel=JobLayout.data_parallel(topology.world_size),
        )
        sections = cfgmod.plugin_configs(config)
        for name, plugin in plugin_classes().items():  # in hook order
            if name in sections and sections[name].enabled:
                runtime.plugins.append(plugin(sections[name], runtime))
        _CREATED.append(runtime)
        return runtime

    def banner(self) -> str:
        """What ds_ext set up, for rank 0's start-up log: topology, plugins with their plan, the
        communicator, and this rank's group on each topology level (``ds-ext detect``'s spans)."""
        from ds_ext.groups import topology_partition
        from ds_ext.parallel import member_group

        cfg = self.config.comm
        plugins = [f"  {p.name}: {p.describe()}" for p in self.plugins] or ["  none enabled"]
        spans = "; ".join(
            f"{name} {list(member_group(topology_partition(self.topology, 'span', name), self.rank))}"
            for name in self.topology.level_names
        )
        comm = (
            f"ledger {'on' if cfg.ledger else 'off'}"
            + (" (torch.distributed collectives counted too)" if cfg.ledger and cfg.count_torch_collectives else "")
            + f", algorithm {cfg.algorithm}, timeout {cfg.timeout_s:g} s"
            + (f", alpha-beta time emulation x{cfg.time_scale:g}" if cfg.emulate_time else "")
        )
        layout = [f"parallel: {self.parallel.describe(self.topology)}"] if self.parallel else []
        return "\n".join(
            [
                f"ds_ext {__version__}: {self.topology.describe()}",
                *layout,
                "plugins:",
                *plugins,
                f"comm: {comm}",
                f"groups of rank {self.rank}: {spans}",
            ]
        )

    def report(self, skip: int = 1) -> str:
        """The topology and the per-level traffic table (bytes per optimizer step)."""
        from ds_ext.report import traffic_table

        return self.topology.describe() + "\n" + traffic_table(self.ledger, self.topology, self.model_bytes, skip)


_CREATED: list[Runtime] = []


def latest() -> Runtime | None:
    """The runtime ds_ext.initialize built last in this process (for exit reports)."""
    return _CREATED[-1] if _CREATED else None
