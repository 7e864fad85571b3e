"""Plugin contract: each ds_ext plugin is one module and one config section.

A plugin subclasses :class:`Plugin` and sets ``name`` (its key in the ``"ds_ext"`` block) and
``Config`` (a :class:`PluginConfig`). The built-in plugins are listed where they are used: their
sections in ``ds_ext.config.BUILTIN_SECTIONS`` (torch-free), their classes in hook order in
``ds_ext.runtime.builtin_plugins``; a plugin outside ds_ext decorates itself with
:func:`register_plugin` (docs/adding-a-plugin.md). This module imports no plugin.
``ds_ext.initialize`` instantiates every *enabled* plugin in hook order (the built-ins', then the
registered ones) and calls its hooks around ``deepspeed.initialize``:

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

What one plugin asks of another is a capability of this contract, never a name: ``owns_step`` (it
replaces DeepSpeed's optimizer step: the others ask ``runtime.step_owner()`` before checking anything
of DeepSpeed's step, its ZeRO stage, its fp16 / bf16 optimizers' norm and clipping, which then does
not run; :meth:`Plugin.use_tiles` runs that step tiled), ``shards_parameters``
(``runtime.parameter_sharder()``; :meth:`Plugin.gathered_parameters`,
:meth:`Plugin.parameters_sharded`) and ``builds_model_parallel`` (at most one per job).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import Field

from ds_ext.config_base import ConfigSection
from ds_ext.errors import DsExtError

if TYPE_CHECKING:
    from ds_ext.parallel import JobLayout


# The ``"ds_ext"`` block's own sections: no plugin takes these names.
RESERVED: tuple[str, ...] = ("topology", "comm")


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
    # True for a plugin that shards the model's parameters into units gathered inside forward and
    # backward and saves the engine's checkpoints as its shards (ZeRO-topo): ask
    # ``Runtime.parameter_sharder()``.
    shards_parameters: ClassVar[bool] = False
    # True for a plugin that builds the job's model-parallel groups and hands DeepSpeed its mpu
    # (TED, 3D-PMM): at most one is enabled in a job.
    builds_model_parallel: ClassVar[bool] = False

    def __init__(self, config: PluginConfig, runtime: Any) -> None:
        """``runtime``: this rank's :class:`ds_ext.runtime.Runtime` (topology, groups, communicator),
        which builds the plugins and so sits above this module."""
        self.config = config
        self.runtime = runtime

    def check(self, model: Any) -> None:
        """Before any collective: raise a one-line :class:`DsExtError` for what this plugin cannot
        run beside (``runtime.plugins``, the caller's ``runtime.initialize_kwargs["mpu"]``, ``model``)."""

    def prepare(self, model: Any, optimizer: Any, ds_config: dict) -> tuple[Any, Any, dict]:
        """Before ``deepspeed.initialize``: convert or wrap the model, the optimizer and the ds_config
        DeepSpeed will see, and return the three."""
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

    def use_tiles(self, tile_size: int) -> Any:
        """For a step owner (``owns_step``) whose step can run tiled (001 §7.2, the
        ``tiled_optimizer`` plugin): run it in tiles of ``tile_size`` elements and return the tiled
        stepper; None where it cannot."""
        return None

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


def register_plugin(cls: type[Plugin]) -> type[Plugin]:
    """Class decorator for a plugin outside ds_ext: make ``cls`` configurable as
    ``"ds_ext": {cls.name: {...}}`` (the built-ins are listed where they are used: their sections
    in ``ds_ext.config``, their classes in ``ds_ext.runtime``, which refuse a registered plugin that
    takes a built-in's name)."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise PluginError(
            f"a ds_ext plugin named {cls.name!r} is already registered ({_REGISTRY[cls.name].__module__})"
        )
    if cls.name in RESERVED:
        raise PluginError(f'plugin name {cls.name!r} is reserved (a section of the "ds_ext" block)')
    _REGISTRY[cls.name] = cls
    return cls


def unregister_plugin(name: str) -> None:
    _REGISTRY.pop(name, None)


def registered_plugins() -> dict[str, type[Plugin]]:
    """Name -> class of the plugins registered with :func:`register_plugin`, in registration order."""
    return dict(_REGISTRY)
