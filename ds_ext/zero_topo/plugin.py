"""``"ds_ext": {"zero_topo": {...}}``: registers ZeRO-topo with ``ds_ext.initialize``.

ZeRO-topo replaces DeepSpeed's ZeRO and mixed-precision wrappers, so DeepSpeed runs as a
plain (stage 0, fp32-looking) engine around a model whose parameters ds_ext shards:

* ``prepare``: resolves the plan against the topology and refuses every setting it does
  not implement; the optimizer is the client's or the one DeepSpeed builds from the
  ds_config ``optimizer`` section (and its ``scheduler`` section drives it), as in DeepSpeed (``ds_ext.zero_topo.support``; errors before any collective), reads
  ``bf16`` / ``fp16`` (DeepSpeed's own loss scaler) / ``gradient_clipping`` and
  ``zero_optimization.offload_optimizer`` (001 §3.3.2: fp32 masters and optimizer state in host
  memory, the step on the host, ``ds_ext.optim.offload``) from the ds_config and hands DeepSpeed a
  copy with those switched off; casts the model to the training dtype;
* ``attach``: after DeepSpeed has broadcast rank 0's weights, shards the model into units
  (:mod:`ds_ext.zero_topo.sharded_model`; the pipeline form: :mod:`ds_ext.zero_topo.pipeline`, in
  units of at most ``zero_optimization.reduce_bucket_size`` elements),
  swaps the engine's optimizer for the sharded step around the user's torch optimizer
  (:mod:`ds_ext.zero_topo.optimizer`), makes ``engine.fp16_enabled()`` / ``bfloat16_enabled()``
  tell the truth, and adds loss scaling (fp16), ``gathered_parameters`` and sharded checkpoints
  (:mod:`ds_ext.zero_topo.checkpoint_io`) to the engine.

The collectives each unit issues are described once, in :mod:`ds_ext.zero_topo.schedule`, which
both the executor and the analytic model (:mod:`ds_ext.zero_topo.perf`) read.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import operator
from typing import Any, Iterable, Iterator

import torch

from ds_ext import log
from ds_ext.comm import hops
from ds_ext.errors import DsExtConfigError
from ds_ext.optim.offload import OffloadStore, copies_are_asynchronous
from ds_ext.parallel import member_group
from ds_ext.plugin import Plugin
from ds_ext.zero_topo import support
from ds_ext.zero_topo.agreement import UnitTrace
from ds_ext.zero_topo.async_save import BackgroundSave, agreement_group
from ds_ext.zero_topo.checkpoint_io import CheckpointIO
from ds_ext.zero_topo.data_group import DataGroup
from ds_ext.zero_topo.optimizer import ZeroTopoOptimizer
from ds_ext.zero_topo.perf import memory, traffic
from ds_ext.zero_topo.pipeline import PipelineStage
from ds_ext.zero_topo.plan import ZeroTopoConfig, resolve_plan
from ds_ext.zero_topo.sharded_model import ShardedModel
from ds_ext.zero_topo.tiers import Tiers, node_ranks
from ds_ext.zero_topo.units import ShardContext


def _place_optimizer(out: dict, optimizer_bytes: Any, offloaded: bool) -> dict:
    """``out`` with the optimizer state's bytes under ``optimizer`` (on the device); offloaded,
    ``optimizer`` is 0 and ``optimizer_host`` holds them (in host memory)."""
    out["optimizer"] = 0 if offloaded else optimizer_bytes
    if offloaded:
        out["optimizer_host"] = optimizer_bytes
    return out


class ZeroTopoPlugin(Plugin):
    """3-level hierarchical partitioning (003) as a ds_ext plugin."""

    name = "zero_topo"
    Config = ZeroTopoConfig
    owns_step = True  # its sharded step: norm over every shard, clipping, DeepSpeed's loss scaler
    shards_parameters = True

    def check(self, model: Any) -> None:
        """Before any collective: refuse a form that cannot run (see :meth:`_form`)."""
        self._form(model)

    def prepare(self, model: Any, optimizer: Any, ds_config: dict) -> tuple[Any, Any, dict]:
        """Resolve the plan (003 §IV) over the data group (and the expert-data group), check dtype, offload,
        optimizer and checkpoint settings, and hand DeepSpeed an fp32, unclipped, offload-free config
        (ZeRO-topo owns the step)."""
        from ds_ext.integration import ds_checkpoint, ds_engine, ds_offload  # DeepSpeed is imported on use

        self.pipeline = self._form(model) == "pipeline"
        self.data = self._data_group()
        self.plan = resolve_plan(self.config, self.data.topology)
        if self.pipeline:
            self.plan = self.plan.pipeline_form()
        self.experts = self._expert_group()
        self.expert_plan = resolve_plan(self.config, self.experts.topology) if self.experts else None
        if self.experts is not None and len(self.experts.members) == 1:
            self.expert_plan = self.expert_plan.unshared()  # experts kept whole on this rank
        self.dtype = ds_engine.training_dtype(ds_config)
        support.check_ds_config(ds_config, self.dtype)
        self.bucket_size = int(ds_engine.zero_config(ds_config).reduce_bucket_size)  # the pipeline form's units
        self.offload = support.optimizer_offload(ds_config)  # pin_memory, None without offload
        if self.offload is not None:
            support.check_offload_optimizer(optimizer, ds_config)
        support.check_model(model, experts=self.experts is not None, pipeline=self.pipeline)
        note = support.check_optimizer(optimizer, ds_config)
        if note is not None:
            log.warn(note)  # DeepSpeed logs below WARNING by default: a user must see this
        self.scaler = ds_engine.loss_scaler(ds_config)
        self.clip = ds_engine.gradient_clipping(ds_config)
        if self.config.async_save and ds_checkpoint.writer_section(ds_config) is not None:
            raise DsExtConfigError(
                f"{support.KEY}.async_save with DeepSpeed's checkpoint.writer: both write checkpoints in the "
                "background; allowed: one of them (async_save false, or no checkpoint.writer section)"
            )
        self._check_tiers()
        cfg = copy.deepcopy(ds_config)
        for key in ("bf16", "fp16"):
            cfg.setdefault(key, {})["enabled"] = False
        cfg["gradient_clipping"] = 0.0
        (cfg.get("data_types") or {}).pop("grad_accum_dtype", None)
        for key in ds_offload.OPTIMIZER_OFFLOAD_KEYS:  # offload is ZeRO-topo's, not DeepSpeed's CPU Adam
            (cfg.get("zero_optimization") or {}).pop(key, None)
        return model.to(self.dtype), optimizer, cfg

    def _check_tiers(self) -> None:
        """``checkpoint_tiers`` needs a partner node."""
        if self.config.checkpoint_tiers is None:
            return
        if len(node_ranks(self.runtime.topology)) < 2:
            raise DsExtConfigError(
                f"{support.KEY}.checkpoint_tiers on one node: the partner copy needs another node; allowed: 2 or more "
                "nodes, or no checkpoint_tiers"
            )

    def _data_group(self) -> DataGroup:
        """The data-parallel group to shard over, from the job layout (before any collective of
        its own): the world, or the caller's mpu's data-parallel group (Megatron tensor parallelism)."""
        rt = self.runtime
        layout = rt.parallel
        if layout.degree("pipeline") > 1 and not self.pipeline:
            raise DsExtConfigError(
                f"{support.KEY}: pipeline parallel size {layout.degree('pipeline')} (from {layout.source}) with a "
                "model that is no deepspeed.pipe.PipelineModule; allowed: 1, or a PipelineModule (the pipeline form)"
            )
        return DataGroup.of(layout, rt.topology, rt.rank)

    def _form(self, model: Any) -> str:
        """The form that runs (``form``; 'auto' follows the model), refusing a mismatch and settings
        the pipeline form has no use for, in one line each."""
        from ds_ext.integration import ds_engine  # DeepSpeed is imported on use

        is_pipe = ds_engine.pipeline_grid(model) is not None
        form = self.config.form if self.config.form != "auto" else ("pipeline" if is_pipe else "sharded")
        if form == "sharded" and is_pipe:
            raise DsExtConfigError(
                f"{support.KEY}.form 'sharded' with a deepspeed.pipe.PipelineModule: DeepSpeed's PipelineEngine keeps "
                "every stage's weights whole (ZeRO-2 and ZeRO-3 are incompatible with it); allowed: 'pipeline' or 'auto'"
            )
        if form == "pipeline" and not is_pipe:
            raise DsExtConfigError(
                f"{support.KEY}.form 'pipeline' needs a deepspeed.pipe.PipelineModule (got "
                f"{type(model).__name__}); allowed: 'sharded' or 'auto'"
            )
        if form == "pipeline":
            set_ = self.config.model_dump(exclude_unset=True)
            given = [f"{k}.{f}" for k in ("weights", "secondary") for f in set_.get(k, {})]
            if given:
                raise DsExtConfigError(
                    f"{support.KEY}.{given[0]}: the pipeline form keeps weights whole on every "
                    "rank; allowed: gradients, optimizer and step settings only"
                )
        return form

    def _expert_group(self) -> DataGroup | None:
        """MoE experts' expert-data-parallel group (TED's layout), None without experts."""
        rt = self.runtime
        if "expert_data" not in rt.parallel.GROUPS:
            return None
        return DataGroup.of(rt.parallel, rt.topology, rt.rank, "expert_data")

    def describe(self) -> str:
        where = (
            ""
            if len(self.data.members) == self.runtime.topology.world_size
            else f" over the data-parallel group ({self.data.topology.describe()})"
        )
        if self.pipeline:
            where += "; pipeline form: gradients reduced once per train_batch"
        if self.experts is None:
            experts = ""
        elif len(self.experts.members) == 1:
            experts = "; experts: kept whole on each rank (an expert-data-parallel group of one rank), 16-bit"
        else:
            experts = (
                f"; experts: {self.expert_plan.describe()} over the expert-data-parallel group "
                f"({self.experts.topology.describe()})"
            )
        offload = ""
        if self.offload is not None:
            pinning = "" if copies_are_asynchronous() else ", a no-op: the accelerator's device is the host"
            offload = f"; optimizer offloaded to host memory (pin_memory {str(self.offload).lower()}{pinning})"
        return self.plan.describe() + where + experts + offload

    def attach(self, engine: Any) -> None:
        """Shard the model into gather units (the pipeline form: the stage), put ZeRO-topo's sharded step in
        place of DeepSpeed's optimizer, scale fp16 losses, and wrap the checkpoint methods (background writer,
        tiers)."""
        from ds_ext.integration import ds_engine  # DeepSpeed is imported on use

        rt = self.runtime
        ds_engine.torch_optimizer(engine, support.KEY)
        trace = None
        if self.config.agreement_check_s > 0:
            peers = self.data.members if self.pipeline else None  # each stage runs a unit of its own
            trace = UnitTrace(rt.rank, rt.topology.world_size, self.config.agreement_check_s, peers)
            rt.comm.watch = trace
        device = next(engine.module.parameters()).device

        def context(plan, data: DataGroup) -> ShardContext:
            model_group = rt.groups.group(rt.parallel.partition(data.model_role)) if data.model_size > 1 else None
            return ShardContext(
                plan,
                rt.comm,
                rank=data.rank,
                dtype=self.dtype,
                compile_quantizer=self.config.compile_quantizer,
                device=device,
                trace=trace,
                data=data,
                model_group=model_group,
                average_over=len(self.data.members),
            )

        expert_ctx = context(self.expert_plan, self.experts) if self.experts else None
        if self.pipeline:
            self.sharded = PipelineStage(
                engine.module, context(self.plan, self.data), engine.stage_id, self.bucket_size
            )
        else:
            self.sharded = ShardedModel(
                engine.module, context(self.plan, self.data), self.config.units, self.config.prefetch, expert_ctx
            )
        for plugin in rt.plugins:
            plugin.parameters_sharded([unit.params for unit in self.sharded.all_units])
        at_boundary = engine.is_gradient_accumulation_boundary if self.config.overlap_step else None
        store = None
        if self.offload is not None:
            support.check_offload_optimizer(engine.optimizer, {})  # what a callable built
            store = OffloadStore(self.offload)
        self.optimizer = ZeroTopoOptimizer(
            self.sharded, engine.optimizer, self.clip, self.scaler, at_boundary, self.config.gather_across_step, store
        )
        if at_boundary is not None:  # the pipeline form's whole units reduce in the step (start_reduction skips them)
            self.sharded.reduced = self.optimizer.start_reduction
        ds_engine.replace_optimizer(engine, self.optimizer)
        if self.dtype == torch.float16 and self.pipeline:
            ds_engine.scale_pipeline_loss(engine, lambda: self.scaler.loss_scale)
        elif self.dtype == torch.float16:
            ds_engine.scale_backward_loss(engine, lambda: self.scaler.loss_scale)
        ds_engine.report_precision(engine, self.dtype)
        ds_engine.report_gradient_clipping(engine, self.clip)
        background = group = tiers = None
        if self.config.async_save:  # collective: every rank makes the writer's group now
            background, group = BackgroundSave(), agreement_group(rt.groups.timeout)
            ds_engine.before_destroy(engine, background.wait)
        if self.config.checkpoint_tiers is not None:  # collective: the transfers' group
            tiers = Tiers(self.config.checkpoint_tiers, rt.topology, rt.rank, agreement_group(rt.groups.timeout))
        parts = [(data, ctx) for _, data, ctx in self._parts()]
        self.checkpoints = CheckpointIO(
            rt, engine, self.sharded, self.optimizer, parts, self.data, self.experts, background, group, tiers
        )
        ds_engine.wrap_checkpoint_methods(
            engine,
            save_checkpoint=self.checkpoints.save,
            load_checkpoint=self.checkpoints.load,
            save_16bit_model=self.checkpoints.save_16bit_model,
        )

    def state_bytes(self) -> dict[str, int]:
        """Peak bytes this rank held per model state (primary and secondary weights,
        gradient shard; sampled at the end of each backward) and optimizer state (fp32 masters and
        moments; ``optimizer_host`` instead of ``optimizer`` with offload: in host memory)."""
        out = dict(self.sharded.peak_state_bytes or self.sharded.state_bytes())
        return _place_optimizer(out, self.optimizer.state_bytes(), self.offload is not None)

    def _parts(self):
        """(plan, group, context) of the dense parameters, then of the experts (if any)."""
        yield self.plan, self.data, self.sharded.ctx
        if self.experts is not None:
            yield self.expert_plan, self.experts, self.sharded.expert_ctx

    def analytic_traffic(self, grad_accum: int):
        """The analytic model (ds_ext.zero_topo.perf) of this run's bytes per step, its link bytes
        under this job's backend."""
        rt = self.runtime
        gloo = rt.comm.is_gloo()

        def model_links(group: DataGroup) -> dict[str, float]:
            """The grad-norm all-reduce (8 bytes) over the model-parallel group, on its links."""
            members = member_group(rt.parallel.partition(group.model_role), rt.rank)
            return hops.by_level(rt.topology, rt.rank, hops.sends("all_reduce", members, rt.rank, 8.0, gloo))

        return functools.reduce(
            operator.add,
            (
                traffic(
                    plan,
                    self.sharded.unit_specs(ctx),
                    grad_accum,
                    self.dtype.itemsize,
                    algorithm=rt.comm.algorithm,
                    rank=group.rank,
                    model_parallel=(group.model_level, group.model_size),
                    pipeline=self.pipeline,
                    gloo=gloo,
                    model_links=model_links(group),
                )
                for plan, group, ctx in self._parts()
            ),
        )

    def analytic_memory(self):
        parts = [
            memory(plan, self.sharded.unit_specs(ctx), group.rank, self.dtype.itemsize)
            for plan, group, ctx in self._parts()
        ]
        out = {k: sum(part[k] for part in parts) for k in parts[0]}
        return _place_optimizer(out, out.pop("optimizer"), self.offload is not None)

    def scaler_state(self) -> dict:
        from ds_ext.integration import ds_engine  # DeepSpeed is imported on use

        return ds_engine.loss_scaler_state(self.scaler)

    def use_tiles(self, tile_size: int) -> Any:
        """The sharded step in tiles of ``tile_size`` (the ``tiled_optimizer`` plugin; on the host
        with optimizer offload)."""
        return self.optimizer.use_tiles(tile_size)

    def settle(self) -> None:
        """Complete the step's weight all-gathers left in flight (``gather_across_step``)."""
        self.optimizer.settle()

    # ---- full parameters on demand -----------------------------------------------------
    @contextlib.contextmanager
    def gathered_parameters(
        self, params: Iterable[torch.Tensor] | None = None, modify: bool = False, modifier_rank: int | None = 0
    ) -> Iterator[None]:
        """Full 16-bit parameters inside the block (collective; like DeepSpeed's
        ``zero.GatheredParameters``). ``params``: the parameters wanted (their units are
        gathered), None = all. With ``modify``, changes are written back on exit into the
        shards and, for every element that changed, into the fp32 masters; with
        ``modifier_rank`` r (default 0, as DeepSpeed) rank r's values are broadcast first,
        None = every rank made the same change."""
        sharded, comm = self.sharded, self.runtime.comm
        units = sharded.units_of(params)
        with self.runtime.ledger.phase("gather_parameters"), sharded.held(units):
            with self.runtime.ledger.paused():
                yield
            if modify:
                with torch.no_grad():
                    for unit in units:
                        if modifier_rank is not None:
                            comm.broadcast(unit.full, src=modifier_rank)
                        self.optimizer.adopt_weights(unit)
