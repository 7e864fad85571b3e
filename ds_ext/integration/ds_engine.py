"""DeepSpeed engine, launcher and checkpoint touch points (read in DeepSpeed 0.19.8).

Behind the version gate of :mod:`ds_ext.integration.ds_version`.
"""

from __future__ import annotations

import functools
import os
import sys
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

from ds_ext.errors import DsExtConfigError, DsExtSetupError
from ds_ext.integration.ds_version import check_version
from ds_ext.topology import slurm_rank_variables

check_version()


def disable_jit_builds() -> None:
    """Skip the shared-memory op DeepSpeed JIT-compiles in ``init_distributed``.

    The op (``deepspeed_shm_comm``, ~1 min of g++ on first use) serves only inference
    all-reduce; ``comm/torch.py:build_shm_op`` consults ``ops.__compatible_ops__``.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def rebind_backend_collectives() -> None:
    """Make DeepSpeed's comm backend call the current torch.distributed functions.

    ``TorchBackend.__init__`` caches ``all_gather_into_tensor`` and
    ``reduce_scatter_tensor`` (comm/torch.py:210-211); after ds_ext wraps
    torch.distributed for the ledger, the cache must point at the wrappers.
    """
    cdb = sys.modules["deepspeed.comm.comm"].cdb
    if cdb is None:
        return
    cdb.all_gather_function = type(cdb).get_all_gather_function()
    cdb.reduce_scatter_function = type(cdb).get_reduce_scatter_function()


def init_distributed(dist_init_required: bool | None = None, timeout_s: float | None = None) -> None:
    """``deepspeed.init_distributed`` on the accelerator's backend, without JIT builds."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    disable_jit_builds()
    kwargs = {}
    if timeout_s is not None:
        kwargs["timeout"] = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        os.environ.update(slurm_rank_variables())  # srun tasks: SLURM_PROCID -> RANK, ...
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise DsExtSetupError(
                f"torch.distributed is not initialized and {', '.join(missing)} are unset: "
                "start the script with the deepspeed launcher, torchrun or srun "
                "(see launch/; under srun the batch script sets MASTER_ADDR / MASTER_PORT), "
                "or call torch.distributed.init_process_group first"
            )
    deepspeed.init_distributed(
        dist_backend=get_accelerator().communication_backend_name(),
        dist_init_required=dist_init_required,
        auto_mpi_discovery=False,
        **kwargs,
    )


def loss_scaler(ds_config: dict):
    """DeepSpeed's own loss scaler for the ds_config's ``fp16`` section, built as its ZeRO
    optimizers build it (stage3.py:524): dynamic scaling with ``hysteresis``,
    ``consecutive_hysteresis``, ``loss_scale_window``, ``min_loss_scale`` and the error at
    the minimum scale, or a static ``loss_scale``; scale 1 without fp16. It exposes
    ``loss_scale`` and ``update_scale(overflow)``."""
    import torch
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config

    fp16 = DeepSpeedFP16Config(**ds_config.get("fp16", {}))
    return CreateLossScaler(
        dtype=torch.float16 if fp16.enabled else torch.float32,
        static_loss_scale=fp16.loss_scale,
        dynamic_scaling=fp16.loss_scale == 0,
        dynamic_loss_args=fp16.dynamic_loss_scale_args(),
    )


def gradient_clipping(ds_config: dict) -> float:
    """``gradient_clipping`` as DeepSpeed reads it: its default is 1.0 (0.19.8,
    runtime/constants.py), not 0, when the key is absent."""
    from deepspeed.runtime.config import get_gradient_clipping

    return float(get_gradient_clipping(ds_config))


def replace_fp32_clipping(engine, clip: Callable[[], float]) -> None:
    """Make DeepSpeed's stage-0 fp32 clipping call ``clip`` (which returns the global norm).

    ``engine._take_model_step`` calls ``self.clip_fp32_gradients()`` when gradient_clipping > 0
    with ZeRO 0 and neither fp16 nor bf16 (runtime/engine.py:3505-3511, 0.19.8); its norm is
    read back by ``get_global_grad_norm`` from ``engine._global_grad_norm``.
    """

    def clip_fp32_gradients() -> None:
        engine._global_grad_norm = clip()

    engine.clip_fp32_gradients = clip_fp32_gradients


LOSS_SCALER_STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def loss_scaler_state(scaler) -> dict[str, float]:
    """The mutable state of a DeepSpeed loss scaler (for checkpoints)."""
    return {k: getattr(scaler, k) for k in LOSS_SCALER_STATE if hasattr(scaler, k)}


def load_loss_scaler_state(scaler, state: dict[str, float]) -> None:
    for k, v in state.items():
        if k in LOSS_SCALER_STATE and hasattr(scaler, k):
            setattr(scaler, k, v)


_MPU_OWNER: list[Any] = [None]  # a weak reference to the engine that last put its mpu in groups.mpu


def torch_optimizer(engine, key: str, allowed: str = "a torch.optim.Optimizer") -> Any:
    """``engine.optimizer`` if it is a ``torch.optim.Optimizer`` (the one a plugin that owns the step
    swaps for its own), else refused in one line naming ``key``: DeepSpeed wrapped it in one of its
    own (a ZeRO or fp16 optimizer), whose step the plugin cannot take over."""
    import torch

    if not isinstance(engine.optimizer, torch.optim.Optimizer):
        raise DsExtConfigError(
            f"{key}: DeepSpeed built a {type(engine.optimizer).__name__} around the optimizer; allowed: {allowed}"
        )
    return engine.optimizer


def release_mpu_on_destroy(engine) -> None:
    """Make ``engine.destroy()`` also drop the engine's mpu (the caller's, a plugin's, or a
    PipelineEngine's grid) from DeepSpeed's module-global ``deepspeed.utils.groups.mpu``, which
    the engine leaves behind: a later engine without an mpu would read its groups (a model-parallel
    size above 1, then ``None.get_model_parallel_rank()`` in ``_configure_distributed_model``).

    Only while ``engine`` is the last engine that set it: DeepSpeed's ``__del__`` calls
    ``destroy()`` again when the collector frees an engine, at a moment that differs between ranks,
    and a later engine often sets the same mpu object (a client's ``mpu`` module). Released then,
    one rank's later engine would lose its mpu mid-step, take DeepSpeed's lazily cloned world group
    for its data-parallel all-reduce while the other ranks use the mpu's, and hang
    (GPT-NeoX's plain model after earlier runs in one process)."""
    import weakref

    from deepspeed.utils import groups

    mpu, destroy = getattr(engine, "mpu", None), engine.destroy
    if mpu is None:
        return
    _MPU_OWNER[0] = weakref.ref(engine)

    @functools.wraps(destroy)
    def destroy_and_release(*args, **kwargs):
        out = destroy(*args, **kwargs)
        owner = _MPU_OWNER[0]
        if groups.mpu is mpu and owner is not None and owner() is engine:
            groups.mpu = None
            _MPU_OWNER[0] = None
        return out

    engine.destroy = destroy_and_release


def zero_config(ds_config: dict) -> Any:
    """The ``zero_optimization`` section as DeepSpeed reads it (runtime/zero/config.py
    ``get_zero_config``: ``reduce_bucket_size`` in elements, default 5e8; ``overlap_comm``)."""
    from deepspeed.runtime.zero.config import get_zero_config

    return get_zero_config(ds_config)


def pipeline_grid(model) -> Any:
    """A ``deepspeed.pipe.PipelineModule``'s process grid (what ``deepspeed.initialize`` hands its
    PipelineEngine as the mpu: runtime/pipe/topology.py ``PipelineParallelGrid``), else None."""
    from deepspeed.pipe import PipelineModule

    return model.mpu() if isinstance(model, PipelineModule) else None


def pipeline_tied_keys(model) -> list[str]:
    """The keys of a ``deepspeed.pipe.PipelineModule``'s tied layers (``TiedLayerSpec``, whose
    gradients the PipelineEngine all-reduces over their stages: runtime/pipe/module.py
    ``tied_modules``); empty for any other model."""
    from deepspeed.pipe import PipelineModule

    return list(model.tied_modules.keys()) if isinstance(model, PipelineModule) else []


def tag_pipeline_instructions(engine, in_phase: Callable[[str, Callable], Callable]) -> None:
    """Run the PipelineEngine's schedule instructions in the ledger's phases: it binds them from
    ``_INSTRUCTION_MAP`` per instruction (runtime/pipe/engine.py ``_exec_schedule``), so the
    engine gets a map of its own with each wrapped by ``in_phase(phase, fn)``. DeepSpeed's
    all-reduce of tied weights' gradients over the stages holding them (``ReduceTiedGrads``) gets
    a phase of its own, ``tied_grads``, so that ``step`` holds the data-parallel step alone."""
    from deepspeed.runtime.pipe import schedule

    phases = {
        schedule.ForwardPass: "forward",
        schedule.BackwardPass: "backward",
        schedule.ReduceTiedGrads: "tied_grads",
        schedule.ReduceGrads: "step",
        schedule.OptimizerStep: "step",
    }
    table = dict(engine._INSTRUCTION_MAP)  # the engine's own, if a plugin already wrapped one
    for cmd, phase in phases.items():
        table[cmd] = in_phase(phase, table[cmd])
    engine._INSTRUCTION_MAP = table


def refuse_pipeline_module(model, owner: str, layout: str) -> None:
    """Refuse a ``deepspeed.pipe.PipelineModule`` in one line for a plugin whose ``layout`` spans the
    whole world with no pipeline axis (TED, 3D-PMM), before any collective."""
    if pipeline_grid(model) is not None:
        raise DsExtConfigError(
            f"{owner} with a deepspeed.pipe.PipelineModule: {layout} spans the whole world and has no pipeline "
            "axis; allowed: a plain nn.Module (Megatron-DeepSpeed: --no-pipeline-parallel; GPT-NeoX: "
            "pipe_parallel_size 0)"
        )


def is_pipeline_engine(engine) -> bool:
    from deepspeed.runtime.pipe.engine import PipelineEngine

    return isinstance(engine, PipelineEngine)


def replace_optimizer(engine, optimizer) -> None:
    """Make ``engine.step()`` call ``optimizer`` and stop DeepSpeed's own gradient all-reduce.

    Stage-0 engines keep the client optimizer in ``engine.optimizer`` and all-reduce grads
    in ``_backward_epilogue`` / at the boundary while ``enable_backward_allreduce`` is set
    (runtime/engine.py:3163, 3602); ``_take_model_step`` reads ``optimizer.overflow``.
    """
    engine.optimizer = optimizer
    engine.enable_backward_allreduce = False
    engine.pipeline_enable_backward_allreduce = False  # PipelineEngine's ReduceGrads (pipe/engine.py:289)


def training_dtype(ds_config: dict[str, Any]):
    """The dtype a ds_config trains in, as DeepSpeed reads it: ``fp16`` / ``bf16`` ``enabled``
    (both is refused in one line), else fp32. For the plugins that take mixed precision over."""
    import torch

    bf16 = (ds_config.get("bf16") or {}).get("enabled", False)
    fp16 = (ds_config.get("fp16") or {}).get("enabled", False)
    if bf16 and fp16:
        raise DsExtConfigError("bf16.enabled and fp16.enabled are both true; allowed: at most one")
    return torch.float16 if fp16 else torch.bfloat16 if bf16 else torch.float32


def restore_on_destroy(engine, restore: Callable[[], None]) -> None:
    """Call ``restore`` when ``engine.destroy()`` runs (DeepSpeed's public teardown): a plugin's
    rebinding (PCCL's collectives, Goldfish's client loss site) undone with the engine."""
    destroy = engine.destroy

    def destroy_and_restore(*args, **kwargs):
        try:
            return destroy(*args, **kwargs)
        finally:
            restore()

    engine.destroy = destroy_and_restore


def before_destroy(engine, first: Callable[[], None]) -> None:
    """Call ``first`` when ``engine.destroy()`` is called, before DeepSpeed's teardown runs (a
    plugin's background work completed while the engine is whole)."""
    destroy = engine.destroy

    @functools.wraps(destroy)
    def first_then_destroy(*args, **kwargs):
        first()
        return destroy(*args, **kwargs)

    engine.destroy = first_then_destroy


def report_precision(engine, dtype) -> None:
    """Make ``engine.fp16_enabled()`` / ``bfloat16_enabled()`` report the dtype a plugin
    trains in after it took mixed precision over from DeepSpeed (engine.py:1724 and the
    step read them; the engine's optimizer then provides ``zero_grad`` and ``loss_scale``)."""
    import torch

    engine.fp16_enabled = lambda: dtype == torch.float16
    engine.bfloat16_enabled = lambda: dtype == torch.bfloat16


def report_gradient_clipping(engine, clip: float) -> None:
    """Make ``engine.gradient_clipping()`` report the clipping a plugin applies itself in its
    optimizer's step. DeepSpeed was handed 0; its own fp32 clipping at the step, the one
    reader of the value after initialize (``_take_model_step``, engine.py:3506), stays off."""
    engine.gradient_clipping = lambda: clip
    engine.clip_fp32_gradients = lambda: None


def scale_backward_loss(engine, scale) -> None:
    """Multiply the loss by ``scale()`` in ``engine.backward`` (fp16 loss scaling)."""
    backward = engine.backward

    @functools.wraps(backward)
    def scaled(loss, *args, **kwargs):
        return backward(loss * scale(), *args, **kwargs)

    engine.backward = scaled


def scale_pipeline_loss(engine, scale: Callable[[], float]) -> None:
    """Multiply the last stage's loss by ``scale()`` in a PipelineEngine's backward pass (fp16
    loss scaling in ZeRO-topo's pipeline form). The PipelineEngine runs that backward through
    ``DeepSpeedEngine.backward`` itself (runtime/pipe/engine.py:798, ``super().backward(self.loss)``),
    past ``engine.backward``; the stages before it receive the scaled gradients. Its schedule
    dispatches through ``_INSTRUCTION_MAP`` (engine.py:1360-1386), which this engine gets a copy
    of (of its own map, if it has one: :func:`tag_pipeline_instructions`) with the backward pass
    wrapped. ``train_batch``'s reported loss is summed in the forward pass (engine.py:781) and
    stays unscaled."""
    from deepspeed.runtime.pipe.schedule import BackwardPass

    original = engine._INSTRUCTION_MAP[BackwardPass]

    def backward_pass(self, buffer_id):
        if not self.is_last_stage():
            return original(self, buffer_id)
        loss = self.loss
        self.loss = loss * scale()
        try:
            return original(self, buffer_id)
        finally:
            self.loss = loss

    engine._INSTRUCTION_MAP = {**engine._INSTRUCTION_MAP, BackwardPass: backward_pass}


def wrap_checkpoint_methods(engine, **replacements) -> None:
    """Route engine methods through a plugin: ``replacements[name](original, **arguments)``
    is called with the original bound method and the call's arguments bound by name to
    DeepSpeed 0.19.8's signatures (engine.py): ``save_checkpoint(save_dir, tag,
    client_state, save_latest, exclude_frozen_parameters)``, ``load_checkpoint(load_dir,
    tag, load_module_strict, load_optimizer_states, load_lr_scheduler_states,
    load_module_only, custom_load_fn)``, ``save_16bit_model(save_dir, save_filename,
    exclude_frozen_parameters)``."""
    import inspect

    for name, replacement in replacements.items():
        original = getattr(engine, name)
        signature = inspect.signature(original)

        def wrapped(*args, _original=original, _sig=signature, _fn=replacement, **kwargs):
            bound = _sig.bind(*args, **kwargs)
            bound.apply_defaults()
            return _fn(_original, **bound.arguments)

        functools.update_wrapper(wrapped, original)
        setattr(engine, name, wrapped)
