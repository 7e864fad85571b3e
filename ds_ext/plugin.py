"""Plugin contract and registry: each ds_ext plugin is one module and one config section.

A plugin subclasses :class:`Plugin`, sets ``name`` (its key in the ``"ds_ext"`` block)
and ``Config`` (a :class:`PluginConfig`), and decorates itself with
:func:`register_plugin`. ``ds_ext.initialize`` instantiates every *enabled* plugin in
hook order (:data:`HOOK_ORDER`) and calls its hooks around ``deepspeed.initialize``:

0. ``check(model)`` right after the runtime is built, before any collective: refuses in one
   line what the plugin cannot run beside (the other enabled plugins, the caller's ``mpu``,
   the model);
1. ``prepare(model, optimizer, ds_config)`` before DeepSpeed sees them; returns the
   (possibly wrapped) model, optimizer and ds_config dict. The other arguments the
   caller gave ``initialize`` (``args``, ``mpu``, ``collate_fn``, ...) are in
   ``runtime.initialize_kwargs``, so a plugin can refuse what it cannot combine with;
2. ``job_layout()`` right after the plugin's ``prepare``: the view of its groups, which becomes
   the job's (``runtime.parallel``, a :class:`ds_ext.parallel.JobLayout`) for the plugins that
   prepare after it; ``mpu()`` after every ``prepare``: the model-parallel unit the plugin hands
   DeepSpeed (``None`` if it has none). At most one source of an mpu is allowed: the caller's (the
   job layout is read from it before any ``prepare``) or one plugin's;
3. ``attach(engine)`` once the DeepSpeed engine exists.

A plugin that replaces DeepSpeed's optimizer step sets ``owns_step`` (ZeRO-topo): the others ask
``runtime.step_owner()`` before checking anything of DeepSpeed's step (its ZeRO stage, its fp16 /
bf16 optimizers' norm and clipping), which then does not run.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import Field

from ds_ext.config_base import ConfigSection
from ds_ext.errors import DsExtError

if TYPE_CHECKING:
    from ds_ext.parallel import JobLayout


class PluginError(DsExtError, ValueError):
    """A plugin class that cannot be registered: its name is taken or reserved."""


class PluginConfig(ConfigSection):
    """Base of every plugin section (strict, as every section: :class:`ConfigSection`)."""

    enabled: bool = Field(False, description="Switch the plugin on.")


class Plugin:
    """Base class of ds_ext plugins (see module docstring)."""

    name: ClassVar[str]
    Config: ClassVar[type[PluginConfig]] = PluginConfig
    # True for a plugin that replaces DeepSpeed's optimizer step: its ZeRO stage, its fp16 / bf16
    # optimizer wrappers and their gradient norm, clipping and loss scaling (ZeRO-topo). The checks
    # other plugins make of DeepSpeed's step then do not apply: ask ``Runtime.step_owner()``.
    owns_step: ClassVar[bool] = False

    def __init__(self, config: PluginConfig, runtime: Any) -> None:
        """``runtime``: this rank's :class:`ds_ext.runtime.Runtime` (topology, groups, communicator),
        which builds the plugins and so sits above this module."""
        self.config = config
        self.runtime = runtime

    def check(self, model: Any) -> None:
        """Before any collective: raise a one-line :class:`DsExtError` for what this plugin cannot
        run beside (``runtime.plugins``, the caller's ``runtime.initialize_kwargs["mpu"]``, ``model``)."""

    def prepare(self, model: Any, optimizer: Any, ds_config: dict) -> tuple[Any, Any, dict]:
        return model, optimizer, ds_config

    def mpu(self) -> Any:
        """The model-parallel unit this plugin gives DeepSpeed, or None."""
        return None

    def job_layout(self) -> JobLayout | None:
        """The job's parallel view of the groups behind :meth:`mpu` (None without an mpu)."""
        return None

    def gathered_parameters(self, params: Any, modify: bool, modifier_rank: int | None) -> Any:
        """A context giving full parameters if this plugin shards them, else None
        (``Runtime.gathered_parameters``)."""
        return None

    def attach(self, engine: Any) -> None:
        """Called with the DeepSpeed engine after ``deepspeed.initialize``."""

    def settle(self) -> None:
        """Complete the collectives this plugin left in flight past the optimizer step
        (collective; ``Runtime.settle``); by default it leaves none."""

    def parameters_sharded(self, units: list[list[Any]]) -> None:
        """Told by a plugin that shards parameters into gather units (ZeRO-topo, at its attach):
        each unit's parameters, valid only while that unit is gathered (inside its modules'
        forward and backward), never at the model's forward start."""

    def describe(self) -> str:
        """One line for the start-up banner: what this plugin does in this job (after
        ``prepare``); by default the settings that differ from the defaults."""
        changed = self.config.model_dump(exclude_defaults=True, exclude={"enabled"})
        return ", ".join(f"{k}={v}" for k, v in changed.items()) or "defaults"


_REGISTRY: dict[str, type[Plugin]] = {}

# Modules that register the built-in plugins when imported (one module per plugin).
BUILTIN_PLUGIN_MODULES: tuple[str, ...] = (
    "ds_ext.zero_topo.plugin",
    "ds_ext.optim.plugin",
    "ds_ext.pmm.plugin",
    "ds_ext.moe.plugin",
    "ds_ext.pccl.plugin",
    "ds_ext.goldfish.plugin",
    "ds_ext.samo.plugin",
)
# The order of the built-ins' hooks: the plugins that define the job's layout (3D-PMM, TED)
# prepare first, so ZeRO-topo shards over the data axis of the model they converted, and attach
# first, before ZeRO-topo swaps the engine's optimizer; others follow in registration order. SAMO runs
# beside no other plugin and checks first, so its refusal is the one that names both settings.
HOOK_ORDER: tuple[str, ...] = ("samo", "pmm3d", "ted", "zero_topo", "tiled_optimizer", "pccl")


def register_plugin(cls: type[Plugin]) -> type[Plugin]:
    """Class decorator: make ``cls`` configurable as ``"ds_ext": {cls.name: {...}}``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise PluginError(
            f"a ds_ext plugin named {cls.name!r} is already registered ({_REGISTRY[cls.name].__module__})"
        )
    if cls.name in ("topology", "comm"):
        raise PluginError(f'plugin name {cls.name!r} is reserved (a section of the "ds_ext" block)')
    _REGISTRY[cls.name] = cls
    return cls


def unregister_plugin(name: str) -> None:
    _REGISTRY.pop(name, None)


# The built-ins' config sections, in modules that import no torch (``ds-ext schema``, the planner).
BUILTIN_CONFIGS: dict[str, tuple[str, str]] = {
    "zero_topo": ("ds_ext.zero_topo.plan", "ZeroTopoConfig"),
    "tiled_optimizer": ("ds_ext.optim.config", "TiledOptimizerConfig"),
    "pmm3d": ("ds_ext.pmm.config", "Pmm3dConfig"),
    "ted": ("ds_ext.moe.config", "TEDConfig"),
    "pccl": ("ds_ext.pccl.plugin", "PCCLConfig"),  # the plugin module imports no torch
    "goldfish": ("ds_ext.goldfish.config", "GoldfishConfig"),
    "samo": ("ds_ext.samo.config", "SamoConfig"),
}


def registered_configs() -> dict[str, type[PluginConfig]]:
    """Name -> config section of every plugin: the built-ins' without importing their plugin
    modules (torch), then those of the plugins registered so far."""
    out = {name: getattr(importlib.import_module(mod), cls) for name, (mod, cls) in BUILTIN_CONFIGS.items()}
    out.update({name: plugin.Config for name, plugin in _REGISTRY.items()})
    return out


def registered_plugins() -> dict[str, type[Plugin]]:
    """Name -> plugin class in hook order (:data:`HOOK_ORDER`, then the others as registered)."""
    for mod in BUILTIN_PLUGIN_MODULES:
        importlib.import_module(mod)
    rank = {name: i for i, name in enumerate(HOOK_ORDER)}
    return dict(sorted(_REGISTRY.items(), key=lambda item: rank.get(item[0], len(rank))))
