"""``ds_ext.initialize``: a drop-in for ``deepspeed.initialize``.

Same arguments, same returned tuple ``(engine, optimizer, dataloader, lr_scheduler)``.
It validates the ``"ds_ext"`` block before anything distributed happens, starts
torch.distributed without DeepSpeed's JIT builds, builds topology, groups and
communicator (the :class:`~ds_ext.runtime.Runtime`), lets every enabled plugin wrap
the model, optimizer and ds_config, calls DeepSpeed, and attaches the runtime as
``engine.ds_ext``. The user's loop (``engine(batch)``, ``engine.backward(loss)``,
``engine.step()``) is unchanged; ds_ext only tags ledger phases around those calls and
closes a ledger step at each optimizer step.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

from ds_ext import config as cfgmod
from ds_ext import log
from ds_ext.comm import instrument
from ds_ext.errors import DsExtConfigError
from ds_ext.integration import ds_engine
from ds_ext.integration.ds_initialize import deepspeed_initialize
from ds_ext.integration.ds_version import check_version
from ds_ext.mpu import model_parallel_sizes
from ds_ext.parallel import GroupError, JobLayout
from ds_ext.runtime import Runtime


def _resolve_config(args: Any, config: Any, config_params: Any) -> Any:
    """The ds_config as ``deepspeed.initialize`` would find it."""
    if config is not None and config_params is not None:
        raise DsExtConfigError("pass the ds_config as 'config' or 'config_params', not both")
    if config is None:
        config = config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None)
    if config is None:
        raise DsExtConfigError("no ds_config: pass config=... or args with --deepspeed_config to ds_ext.initialize")
    return config


class _ArgsWithoutConfig:
    """``args`` as DeepSpeed should see it once ds_ext has read the config from it:
    ``deepspeed_config`` (and the old ``deepscale_config``) read None, since DeepSpeed
    refuses a config in both ``args`` and ``config=``; everything else, reads and writes
    (DeepSpeed sets ``args.local_rank``), goes to the caller's object. A view, not a copy:
    GPT-NeoX's ``deepspeed_config`` is a property without a setter."""

    _HIDDEN = ("deepspeed_config", "deepscale_config")

    def __init__(self, args: Any) -> None:
        object.__setattr__(self, "_args", args)

    def __getattr__(self, name: str) -> Any:
        return None if name in self._HIDDEN else getattr(self._args, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._args, name, value)


def _without_config_path(args: Any) -> Any:
    """``args`` with its config path hidden from DeepSpeed (see :class:`_ArgsWithoutConfig`)."""
    if args is None or getattr(args, "deepspeed_config", None) is None:
        return args
    return _ArgsWithoutConfig(args)


def _with_plugin_mpu(runtime: Runtime, kwargs: dict) -> dict:
    """``kwargs`` with the mpu a plugin provides; refuse two sources of one."""
    sources = [(p, p.mpu()) for p in runtime.plugins]
    sources = [(p, m) for p, m in sources if m is not None]
    if (
        kwargs.get("mpu") is not None
        and sources
        and not (len(sources) == 1 and _same_groups(kwargs["mpu"], sources[0][1]))
    ):
        names = " and ".join(["the caller's mpu= argument"] + [f"ds_ext.{p.name}" for p, _ in sources])
        raise cfgmod.DsExtConfigError(
            f"two model-parallel units for DeepSpeed with different groups: {names}; "
            "allowed: an mpu with the plugin's tensor and data groups, or only one"
        )
    if len(sources) > 1:
        names = " and ".join(f"ds_ext.{p.name}" for p, _ in sources)
        raise cfgmod.DsExtConfigError(f"two model-parallel units for DeepSpeed: {names}; allowed: one")
    if sources:
        kwargs = {**kwargs, "mpu": sources[0][1]}
    return kwargs


def _caller_layout(world_size: int, rank: int, mpu: Any, source: str = "the caller's mpu= argument") -> JobLayout:
    """The job layout of the caller's mpu (Megatron-DeepSpeed's ``megatron.core.mpu``, GPT-NeoX's
    topology-backed mpu, or a ``PipelineModule``'s grid, which DeepSpeed's PipelineEngine takes as
    its mpu): its tensor and pipeline degrees in Megatron's rank order, each of this rank's groups
    checked against it. Collective (every rank learns whether any refused), so a layout one rank
    refuses fails on all before any other collective."""
    import torch.distributed as dist

    error, layout = None, JobLayout.data_parallel(world_size)
    try:
        groups = _mpu_groups(mpu)
        if groups is not None:
            tensor, data, pipeline = groups
            layout = JobLayout.megatron(world_size, len(tensor), pipeline, source)
            layout.check_groups(rank, {"tensor": tensor, "data": data})
        else:
            sizes = model_parallel_sizes(mpu)
            if set(sizes.values()) != {1}:
                shown = ", ".join(f"{k} {v}" for k, v in sizes.items())
                raise cfgmod.DsExtConfigError(
                    f"the caller's mpu= argument reports {shown} but no get_tensor_model_parallel_group / "
                    "get_data_parallel_group; allowed: a Megatron-style mpu (megatron.core.mpu) or none"
                )
    except (cfgmod.DsExtConfigError, GroupError) as err:
        error = str(err)
    errors: list[str | None] = [None] * world_size
    dist.all_gather_object(errors, error)
    failed = next(((r, e) for r, e in enumerate(errors) if e), None)
    if error is not None:
        raise cfgmod.DsExtConfigError(error)
    if failed is not None:
        raise cfgmod.DsExtConfigError(f"rank {failed[0]}: {failed[1]}")
    return layout


def _mpu_groups(mpu: Any) -> tuple[Any, ...] | None:
    """(tensor group ranks, data group ranks, pipeline size) of a Megatron-style mpu, or None
    if it does not expose them."""
    import torch.distributed as dist

    def call(*names: str) -> Any:
        fn = next((getattr(mpu, n) for n in names if callable(getattr(mpu, n, None))), None)
        return None if fn is None else fn()

    # a PipelineModule's grid: its model-parallel group is pipeline x tensor, the slice group the tensor one
    tensor = call("get_tensor_model_parallel_group", "get_slice_parallel_group", "get_model_parallel_group")
    data = call("get_data_parallel_group")
    if tensor is None or data is None:
        return None
    pipe = call("get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size") or 1
    return tuple(dist.get_process_group_ranks(tensor)), tuple(dist.get_process_group_ranks(data)), pipe


def _same_groups(caller: Any, own: Any) -> bool:
    """Collective: whether the caller's mpu has, on every rank, the tensor and data groups of
    the plugin's (then the plugin's is used; otherwise both sources are refused)."""
    import torch.distributed as dist

    same = [None] * dist.get_world_size()
    groups = _mpu_groups(caller)
    dist.all_gather_object(same, groups is not None and groups == _mpu_groups(own))
    return all(same)


def _tag_engine(engine: Any, runtime: Runtime) -> None:
    """Tag forward / backward / step phases and close a ledger step per optimizer step."""
    ledger = runtime.ledger

    def in_phase(name: str, fn):
        @functools.wraps(fn)
        def wrapped(*a, **kw):
            with ledger.phase(name):
                return fn(*a, **kw)

        return wrapped

    if ds_engine.is_pipeline_engine(engine):
        _tag_pipeline_engine(engine, in_phase, ledger)
        return
    engine.forward = in_phase("forward", engine.forward)
    engine.backward = in_phase("backward", engine.backward)
    engine.step = _marking_steps(engine, in_phase("step", engine.step), ledger)


def _marking_steps(engine: Any, fn, ledger):
    """``fn`` (``engine.step`` / ``train_batch``) closing a ledger step when it took an optimizer step."""

    @functools.wraps(fn)
    def call_and_mark(*a, **kw):
        before = engine.global_steps
        out = fn(*a, **kw)
        if engine.global_steps != before:
            ledger.mark_step()
        return out

    return call_and_mark


def _tag_pipeline_engine(engine: Any, in_phase, ledger) -> None:
    """DeepSpeed's PipelineEngine runs a whole batch in ``train_batch``: its schedule's
    instructions get the phases; a ledger step closes when ``train_batch`` took an optimizer step."""
    ds_engine.tag_pipeline_instructions(engine, in_phase)
    engine.train_batch = _marking_steps(engine, engine.train_batch, ledger)


class Initialized(NamedTuple):
    """What :func:`ds_ext.initialize` returns: ``deepspeed.initialize``'s four values in its order
    (``engine, optimizer, training_dataloader, lr_scheduler = ...`` and ``engine, *_ = ...`` work
    as with DeepSpeed), each also by name."""

    engine: Any  # deepspeed.DeepSpeedEngine (a PipelineEngine for a PipelineModule)
    optimizer: Any  # what DeepSpeed wrapped around the optimizer (e.g. DeepSpeedZeroOptimizer), or None
    training_dataloader: Any  # DeepSpeed's loader of ``training_data``, or None
    lr_scheduler: Any  # the scheduler, or None


def initialize(
    args: Any = None,
    model: Any = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
) -> Initialized:
    """Validate the ``"ds_ext"`` block, set ds_ext up, and call ``deepspeed.initialize``
    (:func:`ds_ext.initialize`: DeepSpeed's arguments, order and defaults).

    ``mpu``, ``collate_fn``, ``mesh_param`` and ``distributed_port`` pass through to
    DeepSpeed unchanged.
    """
    kwargs = {"distributed_port": distributed_port, "mpu": mpu, "collate_fn": collate_fn, "mesh_param": mesh_param}
    check_version()
    ds_config = cfgmod.load_ds_config(_resolve_config(args, config, config_params))
    parsed = cfgmod.parse(ds_config.get(cfgmod.BLOCK))
    ds_engine.init_distributed(dist_init_required, parsed.comm.timeout_s)
    runtime = Runtime.create(parsed, initialize_kwargs={**kwargs, "args": args})
    for plugin in runtime.plugins:
        plugin.check(model)
    builders = [p for p in runtime.plugins if p.builds_model_parallel]
    if len(builders) > 1:
        raise cfgmod.DsExtConfigError(
            f"ds_ext.{builders[0].name} with ds_ext.{builders[1].name}: each builds the job's model-parallel groups "
            "and hands DeepSpeed its mpu; allowed: one of the two"
        )
    if mpu is not None:
        runtime.parallel = _caller_layout(runtime.topology.world_size, runtime.rank, mpu)
    elif (grid := ds_engine.pipeline_grid(model)) is not None:  # DeepSpeed's PipelineEngine takes it as the mpu
        runtime.parallel = _caller_layout(
            runtime.topology.world_size, runtime.rank, grid, "the PipelineModule's topology"
        )
    if parsed.comm.ledger and parsed.comm.count_torch_collectives:
        instrument.install(runtime.comm, parsed.comm.torch_gloo_reduce_scatter)
        ds_engine.rebind_backend_collectives()
    for plugin in runtime.plugins:
        model, optimizer, ds_config = plugin.prepare(model, optimizer, ds_config)
        layout = plugin.job_layout()
        if layout is not None:
            runtime.parallel = layout
    kwargs = _with_plugin_mpu(runtime, kwargs)
    runtime.model_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    engine, opt, loader, sched = deepspeed_initialize()(
        args=_without_config_path(args),
        model=model,
        optimizer=optimizer,
        model_parameters=model_parameters,
        training_data=training_data,
        lr_scheduler=lr_scheduler,
        config=ds_config,
        **kwargs,
    )
    ds_engine.release_mpu_on_destroy(engine)
    for plugin in runtime.plugins:
        plugin.attach(engine)
    engine.ds_ext = runtime
    _tag_engine(engine, runtime)
    runtime.ledger.reset()
    log.banner(runtime.banner())
    return Initialized(engine, opt, loader, sched)
