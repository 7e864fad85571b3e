"""``"ds_ext": {"pmm3d": {...}}``: registers 3D-PMM with ``ds_ext.initialize`` (001 ch. 5).

* ``prepare``: resolves the grid (given, or ``"auto"``: the first choice of
  :mod:`ds_ext.perf.pmm` among factorizations that divide the model and fit memory),
  builds its process groups, converts the model in place (:func:`ds_ext.pmm.parallelize`)
  and flags parameters for DeepSpeed's gradient norm;
* ``mpu``: DeepSpeed's data-parallel group is the ``data`` axis (gradient averaging, ZeRO-1
  partitions), its model-parallel group the tensor grid X x Y x Z;
* ``attach``: checks that DeepSpeed's optimizer holds exactly the converted parameters, and
  routes ``save_checkpoint`` / ``load_checkpoint`` through :mod:`ds_ext.pmm.checkpoint`: a
  save also records the grid and layouts; a load on the same tensor grid is DeepSpeed's, on
  another one the shards (and a torch optimizer's state) are resharded.

The optimizer must be built on the converted parameters: pass it as a callable
(``optimizer=lambda params: torch.optim.AdamW(params, ...)``) or as a ds_config
``"optimizer"`` section; an optimizer instance built on the serial model is refused.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from ds_ext.errors import DsExtConfigError
from ds_ext.groups import build_process_groups
from ds_ext.mpu import MegatronMPU
from ds_ext.parallel import Grid, GridError, JobLayout
from ds_ext.plugin import Plugin
from ds_ext.pmm.config import KEY, Pmm3dConfig
from ds_ext.pmm.engine import PMMEngine
from ds_ext.pmm.grid import grid_axes
from ds_ext.pmm.norm import owns
from ds_ext.pmm.parallelize import parallelize
from ds_ext.pmm.plans import ConversionError, plan_for

ALLOWED_STAGES = (0, 1, 2)


class Pmm3dPlugin(Plugin):
    """AxoNN's 4D hybrid parallelism as a ds_ext plugin."""

    name = "pmm3d"
    Config = Pmm3dConfig
    builds_model_parallel = True  # the tensor grid X x Y x Z and the data axis (mpu)
    _mpu: MegatronMPU | None = None

    def check(self, model: Any) -> None:
        """Refuse a PipelineModule (no pipeline axis in the grid), TED (each builds the job's
        model-parallel groups; DeepSpeed takes one mpu), a caller's mpu with tensor or pipeline
        parallelism, and DeepSpeed-MoE layers (3D-PMM partitions dense layers only)."""
        from ds_ext.integration import ds_engine, ds_moe
        from ds_ext.mpu import model_parallel_sizes

        rt = self.runtime
        ds_engine.refuse_pipeline_module(model, KEY, "3D-PMM's grid (x, y, z, data)")
        mpu = rt.initialize_kwargs.get("mpu")
        sizes = {} if mpu is None else model_parallel_sizes(mpu)
        if any(size != 1 for size in sizes.values()):
            shown = ", ".join(f"{k} {v}" for k, v in sizes.items())
            raise DsExtConfigError(
                f"{KEY} with the caller's mpu= argument ({shown}): 3D-PMM builds its own tensor "
                "grid and hands DeepSpeed its mpu; allowed: no mpu, or one of tensor and pipeline "
                "parallel 1"
            )
        moe = next((name for name, m in model.named_modules() if isinstance(m, ds_moe.MoEBase)), None)
        if moe is not None:
            raise DsExtConfigError(
                f"{KEY}: {moe or 'the model'} is a DeepSpeed-MoE layer (deepspeed.moe.layer.MoE), whose experts "
                "3D-PMM does not partition; allowed: dense models (MoE: ds_ext.ted without pmm3d)"
            )

    def prepare(self, model: Any, optimizer: Any, ds_config: dict) -> tuple[Any, Any, dict]:
        """Choose the grid (given, or ranked by the analytic model), build its groups and convert the model's
        layers to 3D-PMM's (000 §V)."""
        from ds_ext.integration import ds_pmm

        if isinstance(optimizer, torch.optim.Optimizer):
            raise DsExtConfigError(
                f"{KEY} converts the model's layers, so the optimizer must be built on the converted parameters: "
                "pass optimizer=lambda params: torch.optim.AdamW(params, ...) or a ds_config 'optimizer' section, "
                "not an optimizer instance"
            )
        stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
        if stage not in ALLOWED_STAGES:
            raise DsExtConfigError(
                f"{KEY}: zero_optimization.stage {stage} is not supported; allowed: "
                f"{', '.join(map(str, ALLOWED_STAGES))} (3D-PMM's Z axis shards like ZeRO-3)"
            )
        rt = self.runtime
        self.sharder = rt.parameter_sharder()
        for key in ("reduce_scatter", "all_gather") if self.sharder is not None else ():
            if getattr(self.config.overlap, key):
                raise DsExtConfigError(
                    f"{KEY}.overlap.{key} with ds_ext.{self.sharder.name}: not supported (it gathers the weights unit "
                    f"by unit inside the forward, {'ORS gates' if key == 'reduce_scatter' else 'OAG prefetches'} them "
                    "across units); allowed: false"
                )
        plan = plan_for(model)
        self.grid = self._grid(model, plan, ds_config)  # checked against the world
        self.groups = build_process_groups(rt.groups, self.grid, rt.rank)
        self.axes = grid_axes(self.groups)
        micro = ds_config.get("train_micro_batch_size_per_gpu")
        if micro is not None and micro % self.grid.z:
            raise DsExtConfigError(
                f"{KEY}.grid.z={self.grid.z} does not divide train_micro_batch_size_per_gpu="
                f"{micro}: every Z rank takes an equal share of the micro-batch"
            )
        cfg = self.config
        self.engine = PMMEngine(self.axes, rt.comm, cfg.overlap, cfg.tune_matmul, cfg.ledger_by_layer)
        try:
            parallelize(model, self.engine, plan, vocab_parallel=cfg.tables == "vocab_parallel")
        except ConversionError as err:
            raise DsExtConfigError(str(err)) from None
        ds_pmm.mark_parameters(model, functools.partial(owns, axes=self.axes))
        self.model = model
        return model, optimizer, ds_config

    def _grid(self, model: Any, plan, ds_config: dict) -> Grid:
        world = self.runtime.topology.world_size
        if self.config.grid != "auto":
            g = self.config.grid
            grid = Grid(g.x, g.y, g.z, g.data)
            try:
                grid.check_world(world)
            except GridError as err:
                raise DsExtConfigError(str(err)) from None
            return grid
        from ds_ext.perf import pmm as perf
        from ds_ext.pmm.spec import model_spec

        ranked = perf.rank_grids(
            model_spec(model, plan, vocab_parallel=self.config.tables == "vocab_parallel"),
            world,
            self.runtime.topology,
            micro_batch=ds_config.get("train_micro_batch_size_per_gpu", 1),
            seq_len=perf_seq_len(model),
            elem_bytes=_elem_bytes(ds_config),
            grad_accum=ds_config.get("gradient_accumulation_steps", 1),
            zero_stage=self._zero_stage(ds_config),
            memory_limit=None if self.config.memory_per_rank_GB is None else self.config.memory_per_rank_GB * 1e9,
        )
        if not ranked:
            raise DsExtConfigError(
                f"{KEY}.grid 'auto': no factorization of {world} ranks divides the model and "
                "fits memory_per_rank_GB; give the grid explicitly or raise the limit"
            )
        return ranked[0].grid

    def _zero_stage(self, ds_config: dict) -> int:
        """The ZeRO stage the auto grid's memory estimate assumes (``ds_ext.perf.pmm.memory``: the
        optimizer state divided over the data axis from stage 1): DeepSpeed's, unless a plugin
        replaces DeepSpeed's step (ZeRO-topo, whose every preset shards the optimizer state over the
        data axis: mics over a node's data ranks only, which this counts as the whole axis)."""
        if self.runtime.step_owner() is not None:
            return 1
        return (ds_config.get("zero_optimization") or {}).get("stage", 0)

    def describe(self) -> str:
        return f"grid {self.grid} (x, y, z, data)"

    def job_layout(self) -> JobLayout:
        """The job's parallel view of the grid."""
        return JobLayout.of(self.grid, "ds_ext.pmm3d")

    def mpu(self) -> MegatronMPU:
        """Model parallel = the tensor grid X x Y x Z (DeepSpeed sums gradient norms over it,
        parameters counted per ``ds_ext.integration.ds_pmm.mark_parameters``); data parallel =
        the ``data`` axis (it averages gradients and shards ZeRO-1 optimizer states)."""
        if self._mpu is None:
            self._mpu = MegatronMPU.over(self.groups)
        return self._mpu

    def attach(self, engine: Any) -> None:
        """Check that the optimizer holds the converted parameters; checkpoints per tensor-grid rank unless a
        plugin shards the parameters."""
        from ds_ext.integration import ds_pmm

        mine = {id(p) for p in self.model.parameters() if p.requires_grad}
        if {id(p) for p in ds_pmm.optimized_parameters(engine)} != mine:
            raise DsExtConfigError(
                f"{KEY}: the optimizer does not hold the converted model's parameters (model_parameters from the "
                "serial model?); pass model_parameters=None and build the optimizer from the params it is given"
            )
        from ds_ext.integration import ds_engine

        self.ds_engine = engine
        if self.sharder is None:  # else the sharder's checkpoints (ZeRO-topo: one folder per tensor-grid rank)
            ds_engine.wrap_checkpoint_methods(
                engine, save_checkpoint=self._save_checkpoint, load_checkpoint=self._load_checkpoint
            )

    def parameters_sharded(self, units: list[list[Any]]) -> None:
        """ZeRO-topo over the ``data`` axis (000 §V-B: AxoNN's ZeRO sharding lives on its data
        axis): the converted parameters exist only while their unit is gathered."""
        self.engine.bucket_by_unit(units)

    # ---- checkpoints (ds_ext.pmm.checkpoint) -------------------------------------------
    def _save_checkpoint(self, original, save_dir, tag, client_state, save_latest, exclude_frozen_parameters):
        import torch.distributed as dist

        from ds_ext.integration import ds_pmm
        from ds_ext.pmm import checkpoint

        engine = self.ds_engine
        tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
        out = original(
            save_dir,
            tag,
            client_state=client_state,
            save_latest=save_latest,
            exclude_frozen_parameters=exclude_frozen_parameters,
        )
        checkpoint.save(
            Path(save_dir) / tag,
            self.model,
            ds_pmm.torch_optimizer(engine),
            self.axes,
            self.grid,
            ds_pmm.step_counters(engine),
        )
        dist.barrier()
        return out

    def _load_checkpoint(
        self,
        original,
        load_dir,
        tag,
        load_module_strict,
        load_optimizer_states,
        load_lr_scheduler_states,
        load_module_only,
        custom_load_fn,
    ):
        from ds_ext.integration import ds_pmm
        from ds_ext.pmm import checkpoint

        engine = self.ds_engine
        if tag is None:
            latest = Path(load_dir) / "latest"
            if not latest.is_file():
                raise DsExtConfigError(f"{KEY}: checkpoint directory {load_dir} has no 'latest' file; pass tag=...")
            tag = latest.read_text().strip()
        tag_dir = Path(load_dir) / str(tag)
        try:
            record = checkpoint.read_record(tag_dir)
            saved = tuple(record["grid"][a] for a in ("x", "y", "z"))
            if saved == (self.grid.x, self.grid.y, self.grid.z):
                return original(
                    load_dir,
                    tag,
                    load_module_strict=load_module_strict,
                    load_optimizer_states=load_optimizer_states,
                    load_lr_scheduler_states=load_lr_scheduler_states,
                    load_module_only=load_module_only,
                    custom_load_fn=custom_load_fn,
                )
            with_optimizer = load_optimizer_states and not load_module_only
            optimizer = ds_pmm.torch_optimizer(engine) if with_optimizer else None
            if with_optimizer and optimizer is None:
                raise checkpoint.CheckpointError(
                    f"{KEY}: loading checkpoint {tag_dir} (grid {record['grid']}) onto grid {self.grid} reshards the "
                    "optimizer state of fp32 zero_optimization.stage 0 only; load on the saved grid, or pass "
                    "load_optimizer_states=False"
                )
            checkpoint.load_resharded(tag_dir, self.model, optimizer)
        except checkpoint.CheckpointError as err:
            raise DsExtConfigError(str(err)) from None
        if not load_module_only:
            ds_pmm.set_step_counters(engine, record["counters"])
        return str(tag_dir), {}


def perf_seq_len(model: Any) -> int:
    """Tokens per sample for the performance model: the model config's sequence length."""
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    for attr in ("seq_len", "max_position_embeddings"):
        if getattr(cfg, attr, None):
            return int(getattr(cfg, attr))
    raise DsExtConfigError(f"{KEY}.grid 'auto': cannot read the sequence length from {type(model).__name__}'s config")


def _elem_bytes(ds_config: dict) -> int:
    half = ds_config.get("bf16", {}).get("enabled") or ds_config.get("fp16", {}).get("enabled")
    return 2 if half else 4
