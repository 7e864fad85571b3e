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
* ``attach``: after DeepSpeed has broadcast rank 0's weights, shards the model into units,
  swaps the engine's optimizer for :class:`ZeroTopoOptimizer` around the user's torch
  optimizer, makes ``engine.fp16_enabled()`` / ``bfloat16_enabled()`` tell the truth, and
  adds loss scaling (fp16), ``gathered_parameters`` and sharded checkpoints
  (``ds_ext.zero_topo.checkpoint``; saved in the background with ``async_save``:
  ``ds_ext.zero_topo.async_save``; on node-local storage with a partner copy with
  ``checkpoint_tiers``: ``ds_ext.zero_topo.tiers``) to the engine.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import operator
import shutil
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from ds_ext import log
from ds_ext.comm import hops
from ds_ext.errors import DsExtConfigError
from ds_ext.models.hf import hf_record
from ds_ext.optim.offload import OffloadStore, copies_are_asynchronous
from ds_ext.parallel import member_group
from ds_ext.plugin import Plugin
from ds_ext.zero_topo import checkpoint as ckpt
from ds_ext.zero_topo import support
from ds_ext.zero_topo.agreement import UnitTrace
from ds_ext.zero_topo.async_save import BackgroundSave, agreement_group
from ds_ext.zero_topo.data_group import DataGroup
from ds_ext.zero_topo.engine import ShardedModel, ZeroTopoOptimizer
from ds_ext.zero_topo.layout import shard_count, shard_index
from ds_ext.zero_topo.perf import memory, traffic
from ds_ext.zero_topo.pipeline import PipelineStage
from ds_ext.zero_topo.plan import ZeroTopoConfig, resolve_plan
from ds_ext.zero_topo.tiers import Tiers, node_ranks
from ds_ext.zero_topo.units import ShardContext


def _state_value(master: torch.Tensor, key: str, value: Any, defaults: dict) -> Any:
    """A loaded optimizer state value placed as ``torch.optim.Optimizer.load_state_dict`` places
    it: floating tensors on the master's device and dtype, Adam's ``step`` counter left on the
    host unless the optimizer is fused or capturable (then on the master's device)."""
    if not isinstance(value, torch.Tensor):
        return value
    if key == "step":
        on_device = defaults.get("fused") or defaults.get("capturable")
        return value.to(dtype=torch.float32, device=master.device) if on_device else value.clone()
    if value.is_floating_point():
        return value.to(dtype=master.dtype, device=master.device, copy=True)
    return value.to(device=master.device, copy=True)


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
            self.sharded = PipelineStage(engine.module, context(self.plan, self.data), engine.stage_id)
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
        self.engine = engine
        self.background = None
        if self.config.async_save:  # collective: every rank makes the writer's group now
            self.background = BackgroundSave()
            self.agreement_group = agreement_group(rt.groups.timeout)
            ds_engine.before_destroy(engine, self.background.wait)
        self.tiers = None
        if self.config.checkpoint_tiers is not None:  # collective: the transfers' group
            group = agreement_group(rt.groups.timeout)
            self.tiers = Tiers(self.config.checkpoint_tiers, rt.topology, rt.rank, group)
        ds_engine.wrap_checkpoint_methods(
            engine,
            save_checkpoint=self._save_checkpoint,
            load_checkpoint=self._load_checkpoint,
            save_16bit_model=self._save_16bit_model,
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

    # ---- checkpoints (ds_ext.zero_topo.checkpoint) ---------------------------------------
    def _save_checkpoint(self, original, save_dir, tag, client_state, save_latest, exclude_frozen_parameters):
        """The atomic save (:mod:`ds_ext.zero_topo.checkpoint`) to ``save_dir`` and, with
        ``checkpoint_tiers``, to the node-local tier (:mod:`ds_ext.zero_topo.tiers`); with
        ``async_save`` every file is snapshot into host memory here and both are written in the
        background (:mod:`ds_ext.zero_topo.async_save`), the local tier first."""
        engine, background = self.engine, self.background
        if background is not None:
            background.wait()  # a second save waits for the first (and raises its failure)
        tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
        local, shared = self.tiers.next_save() if self.tiers is not None else (False, True)
        finish = []
        with self.runtime.ledger.phase("checkpoint"):
            if local:
                finish.append(self._save_local(original, tag, client_state, exclude_frozen_parameters))
            if shared:
                finish.append(
                    self._save_shared(
                        original, Path(save_dir), tag, client_state, save_latest, exclude_frozen_parameters
                    )
                )
            if background is None:
                for step in finish:
                    step()
        if background is not None:
            background.start(lambda: [step() for step in finish])

    def _save_shared(self, original, save_dir: Path, tag: str, client_state, save_latest, exclude_frozen_parameters):
        """The shared directory's save of ``tag``: what must run in step on the training thread now;
        returns what writes and publishes it (in the background with ``async_save``)."""
        from ds_ext.integration import ds_checkpoint  # DeepSpeed is imported on use

        engine, background = self.engine, self.background
        staged = ckpt.staging_dir(save_dir, tag)
        error = None
        if self.runtime.rank == 0:
            try:
                save_dir.mkdir(parents=True, exist_ok=True)
                if staged.exists():
                    shutil.rmtree(staged)  # left by a save that crashed
            except OSError as err:
                error = f"cannot prepare {staged}: {err}"
        ckpt.agree(error, f"saving checkpoint {save_dir / tag}")
        captured = ds_checkpoint.capture(engine) if background is not None else contextlib.nullcontext([])
        with self.sharded.held(self.sharded.all_units), captured as deepspeed_files:
            original(
                str(save_dir),
                staged.name,
                client_state=client_state,
                save_latest=False,
                exclude_frozen_parameters=exclude_frozen_parameters,
            )
        shards = self._shards(staged)  # one part's state at a time on the synchronous path
        if background is None:
            return lambda: self._write_and_publish(shards, save_dir, tag, save_latest, None)
        files = [(path, ds_checkpoint.host_copy(state, False)) for path, state in shards]  # cloned already
        files += [(Path(path), state) for path, state in deepspeed_files]
        group = self.agreement_group
        return lambda: self._write_and_publish(files, save_dir, tag, save_latest, group)

    def _shards(self, staged: Path) -> Iterator[tuple[Path, dict]]:
        """(path, state) of each of this rank's shard files of a save into ``staged``, one part's
        state made at a time (the save's id is agreed now: collective)."""
        engine, save_id = self.engine, ckpt.new_save_id()
        degrees = {axis: self.runtime.parallel.degree(axis) for axis in ("tensor", "pipeline")}
        hf = hf_record(engine.module)
        return (
            (
                folder / ckpt.SHARD_FILE.format(rank=group.rank),
                ckpt.shard_state(ctx, engine.global_steps, save_id, self.state_dict(units), degrees, hf),
            )
            for group, ctx, units, folder in self._stores(staged)
        )

    def _save_local(self, original, tag: str, client_state, exclude_frozen_parameters):
        """The local tier's save of ``tag`` (:mod:`ds_ext.zero_topo.tiers`): DeepSpeed's files and the
        shards snapshot now; returns what writes them into the node's directory, copies them to the
        partner node and publishes the save (in the background with ``async_save``)."""
        from ds_ext.integration import ds_checkpoint  # DeepSpeed is imported on use

        tiers, engine = self.tiers, self.engine
        staged = tiers.prepare(tag)
        with self.sharded.held(self.sharded.all_units), ds_checkpoint.capture(engine) as deepspeed_files:
            original(
                str(tiers.local_dir()),
                staged.name,
                client_state=client_state,
                save_latest=False,
                exclude_frozen_parameters=exclude_frozen_parameters,
            )
        root = staged.resolve()
        copy_state = (
            (lambda state: state) if self.background is None else (lambda state: ds_checkpoint.host_copy(state, False))
        )
        files = [(path.relative_to(staged).as_posix(), copy_state(state)) for path, state in self._shards(staged)]
        files += [(Path(p).resolve().relative_to(root).as_posix(), state) for p, state in deepspeed_files]
        step = engine.global_steps
        return lambda: tiers.save(tag, staged, files, step)

    def _write_and_publish(
        self, files: Iterable[tuple[Path, Any]], save_dir: Path, tag: str, save_latest: bool, group: object | None
    ) -> None:
        """Write ``files`` (each atomically), agree, publish (rank 0: the staging directory becomes
        ``tag``, then ``latest``), agree; ``group`` None: on the world, else the writer's group."""
        what, error = f"saving checkpoint {save_dir / tag}", None
        for path, state in files:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                ckpt.atomic_save(state, path)
            except OSError as err:
                error = error or f"cannot write {path}: {err}"
        ckpt.agree(error, what, group)
        if self.runtime.rank == 0:
            try:
                ckpt.publish(save_dir, tag, save_latest)
            except OSError as err:
                error = f"cannot publish {save_dir / tag}: {err}"
        ckpt.agree(error, what, group)

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
        if self.background is not None:
            self.background.wait()  # the save in flight first (it may be the one to load)
        optimizer_states = load_optimizer_states and not load_module_only
        restore = None
        if self.tiers is not None:
            restore, why = self.tiers.choose(tag)
            if restore is None:
                log.warn(f"{support.KEY}.checkpoint_tiers: {why}: loading the newest shared save from {load_dir}")
            else:
                self.tiers.fill_common(restore)
                load_dir, tag = self.tiers.local_dir(), restore.tag
        if tag is None and not ckpt.agree_present(Path(load_dir) / ckpt.LATEST, f"loading checkpoint from {load_dir}"):
            if self.runtime.rank == 0:
                from deepspeed.utils import logger

                logger.warning(
                    f"{support.KEY}: no '{ckpt.LATEST}' file in {load_dir}: nothing loaded "
                    "(returns (None, None), as DeepSpeed does)"
                )
            return None, None
        with self.runtime.ledger.phase("checkpoint"):
            for _ in range(len(restore.files) + 1 if restore is not None else 1):
                error, loaded, missing = None, None, None
                try:
                    tag_dir = ckpt.resolve_tag_dir(load_dir, tag)
                    loaded = self._read(tag_dir, optimizer_states)
                except ckpt.MissingShardError as err:
                    error, missing = str(err), err.path
                except ckpt.CheckpointError as err:
                    error = str(err)
                # the local tier: fetch the shards the ranks found missing, and read again
                if restore is None or not self.tiers.fill_missing(restore, missing):
                    break
            ckpt.agree(error, f"loading checkpoint from {load_dir}")
            with self.sharded.held(self.sharded.all_units):
                path, client_state = original(
                    load_dir,
                    tag_dir.name,
                    load_module_strict=load_module_strict,
                    load_optimizer_states=load_optimizer_states,
                    load_lr_scheduler_states=load_lr_scheduler_states,
                    load_module_only=load_module_only,
                    custom_load_fn=custom_load_fn,
                )
                with torch.no_grad():
                    self.load_state_dict(loaded, optimizer_states)
        return path, client_state

    def _read(self, tag_dir: Path, optimizer_states: bool) -> dict:
        """Everything this rank loads from the checkpoint in ``tag_dir``, checked, nothing changed."""
        ckpt.check_model_parallel(
            tag_dir, self.data.model_size, self.experts.model_size if self.experts is not None else 0
        )
        ckpt.check_zip(tag_dir / ckpt.DEEPSPEED_MODULE_FILE.format(rank=self.data.model_rank))
        parts = [
            self._read_shards(folder, group, ctx, units, optimizer_states)
            for group, ctx, units, folder in self._stores(tag_dir)
        ]
        return {  # the optimizer's param groups and the loss scaler: the dense part's
            **parts[0],
            "primaries": {k: v for part in parts for k, v in part["primaries"].items()},
            "segments": {k: v for part in parts for k, v in part["segments"].items()},
        }

    def _stores(self, tag_dir: Path) -> Iterator[tuple[DataGroup, ShardContext, list, Path]]:
        """(group, context, units, folder) of each part of a checkpoint: the dense parameters' shards
        in their data-parallel group's folder, the MoE experts' in their expert-data group's
        (``ds_ext.zero_topo.checkpoint``); each part is a checkpoint of one group."""
        for _, group, ctx in self._parts():
            units = [unit for unit in self.sharded.all_units if unit.ctx is ctx]
            dense = ctx is self.sharded.ctx
            folder = (
                ckpt.shard_dir(tag_dir, group.model_rank, group.model_size)
                if dense
                else ckpt.expert_dir(tag_dir, group.model_rank)
            )
            yield group, ctx, units, folder

    def _read_shards(
        self, tag_dir: Path, group: DataGroup, ctx: ShardContext, units: list, optimizer_states: bool
    ) -> dict:
        """Everything this rank takes from one part of the checkpoint (:meth:`_stores`), read and
        checked before any state changes: per unit the primary shard, per segment (by unit name and
        start) master and optimizer state."""
        saved = ckpt.SavedCheckpoint.open(tag_dir)
        # every saved shard is checked by some rank (then ckpt.agree refuses on all of them)
        saved.verify(range(group.rank, saved.meta["world_size"], ctx.topo.world_size))
        why = ckpt.compare_units(saved.meta["units"], ckpt.unit_table(units), tag_dir)
        if why:
            raise ckpt.CheckpointError(why)
        opt, plan, topo, rank = self.optimizer, ctx.plan, ctx.topo, group.rank
        inner = opt.inner
        saved_opt = saved.meta["optimizer"]
        if saved_opt["class"] != type(inner).__name__ or len(saved_opt["param_groups"]) != len(inner.param_groups):
            raise ckpt.CheckpointError(
                f"checkpoint {tag_dir} holds a {saved_opt['class']} with {len(saved_opt['param_groups'])} param "
                f"groups, this run a {type(inner).__name__} with {len(inner.param_groups)}"
            )
        primaries = {}
        n_w = shard_count(topo, plan.weights)
        for unit in units:
            size = unit.U // n_w
            start = shard_index(topo, rank, plan.weights) * size
            values = torch.zeros(size, dtype=unit.primary.dtype)
            for lo, hi, at in ckpt.saved_pieces(saved.units[unit.name]["params"], unit.offsets, start, start + size):
                values[lo - start : hi - start] = saved.weights(unit.name, at, at + hi - lo)
            primaries[unit.name] = values
        segments = {}
        if optimizer_states:
            keys = saved.state_keys()
            for unit, lo, hi, master in opt.segments:
                if unit.ctx is not ctx:
                    continue
                a, _ = opt.own_range(unit)
                ((_, _, at),) = ckpt.saved_pieces(saved.units[unit.name]["params"], unit.offsets, a + lo, a + hi)
                state = {k: saved.segment_values(unit.name, at, at + hi - lo, k) for k in keys}
                segments[unit.name, lo] = (saved.segment_values(unit.name, at, at + hi - lo, None), state)
        return {
            "primaries": primaries,
            "segments": segments,
            "groups": saved_opt["param_groups"],
            "scaler": saved.meta["loss_scaler"],
        }

    def state_dict(self, units: list | None = None) -> dict:
        """This rank's part of a checkpoint for ``units`` (None: all), which
        :func:`ds_ext.zero_topo.checkpoint.shard_state` writes with the save's metadata: the units'
        parameter table, the rank's optimizer slice of each unit's 16-bit weights, one segment per
        trainable piece of it (fp32 master and optimizer state), the optimizer's param groups and
        the loss scaler."""
        opt = self.optimizer
        units = self.sharded.all_units if units is None else units
        chosen = {id(unit) for unit in units}
        index = {id(m): i for i, g in enumerate(opt.inner.param_groups) for m in g["params"]}
        slices, segments = [], []
        for unit in units:
            start, stop = opt.own_range(unit)
            slices.append({"unit": unit.name, "start": start, "stop": stop, "weights": opt._own_slice(unit).clone()})
        for unit, lo, hi, master in opt.segments:
            if id(unit) not in chosen:
                continue
            start, _ = opt.own_range(unit)
            state = {
                k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.inner.state.get(master, {}).items()
            }
            segments.append(
                {
                    "unit": unit.name,
                    "start": start + lo,
                    "stop": start + hi,
                    "group": index[id(master)],
                    "master": master.clone(),
                    "state": state,
                }
            )
        groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.inner.param_groups]
        return {
            "units": ckpt.unit_table(units),
            "slices": slices,
            "segments": segments,
            "optimizer": {"class": type(opt.inner).__name__, "param_groups": groups},
            "loss_scaler": self.scaler_state(),
        }

    def load_state_dict(self, loaded: dict, optimizer_states: bool) -> None:
        """Install what :meth:`_read_shards` read for this rank (the checkpoint resharded onto this
        world; units are held: ``full`` is valid)."""
        from ds_ext.integration import ds_engine  # DeepSpeed is imported on use

        opt = self.optimizer
        for unit in self.sharded.all_units:
            unit.primary.copy_(loaded["primaries"][unit.name])
            unit.rebuild_secondary()
        if not optimizer_states:
            opt.reset_masters_from_weights()
            return
        for unit, lo, hi, master in opt.segments:
            values, state = loaded["segments"][unit.name, lo]
            master.copy_(values)
            opt.install_state(master, {k: _state_value(master, k, v, opt.inner.defaults) for k, v in state.items()})
        for group, saved in zip(opt.inner.param_groups, loaded["groups"]):
            group.update(saved)
        ds_engine.load_loss_scaler_state(self.scaler, loaded["scaler"])

    def _save_16bit_model(self, original, save_dir, save_filename, exclude_frozen_parameters):
        with self.runtime.ledger.phase("checkpoint"), self.sharded.held(self.sharded.all_units):
            return original(save_dir, save_filename, exclude_frozen_parameters=exclude_frozen_parameters)
