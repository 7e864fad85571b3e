"""``"ds_ext": {"ted": {...}}``: TED MoE (001 ch. 7) through ``ds_ext.initialize``.

* ``prepare``: checks the block against the world (Eq 7.1), the topology (tensor groups
  inside a node), the ds_config (ZeRO stage 0 / 1 / 2; stage-0 clipping in fp16 / bf16 is
  refused: DeepSpeed's half-precision optimizers clip by a norm that does not count expert
  parameters once) and every TED layer of the model, all before any collective; then creates
  the TED process groups and binds the layers (slicing their weights for this tensor rank);
* ``attach``, ZeRO stage 0 with clipping (Megatron-DeepSpeed's MoE example, fp32): DeepSpeed's
  stage-0 clipping averages per-rank norms, not the global norm once experts differ per rank,
  so the engine clips by the true global norm of :mod:`ds_ext.moe.grad_norm` instead;
* on a ``deepspeed.pipe.PipelineModule`` (DeepSpeed's PipelineEngine, Megatron-DeepSpeed's
  ``GPTModelPipe`` with ``--num-experts``): the layout gains the stages as its outermost axis (Eq 7.1
  per stage), the grid's tensor degree must be the block's, pipe / grad partitioning at tensor
  parallel > 1 is refused as the client refuses it, the gates are indexed model-wide, the global
  norm sums over the stages and the CAC tapes are cleared at each ``train_batch`` / ``eval_batch``;
  the grid stays DeepSpeed's mpu (its groups are TED's tensor and data groups);
* ``mpu``: the tensor group as DeepSpeed's model-parallel group, the non-expert data group as
  its data group; ``TEDMoE.set_deepspeed_parallelism`` registers the expert / expert-data
  groups, so DeepSpeed reduces non-expert gradients over G_data^nonexp and expert gradients
  over G_data^exp;
* ``attach``: clears the layers' CAC tapes at every ``engine.forward``; ``engine.destroy()``
  also removes TED's groups and mpu from DeepSpeed's process-wide group registry;
  ``engine.save_checkpoint`` / ``load_checkpoint`` carry the gates' draw counters (equal on
  every rank) in DeepSpeed's ``client_state`` under ``ds_ext_ted_gate_draws``, so a resumed run
  draws the noise and random token selections the uninterrupted run would have drawn.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from deepspeed.moe.utils import is_moe_param

from ds_ext.comm import backend_device
from ds_ext.errors import DsExtConfigError
from ds_ext.moe.config import TEDConfig
from ds_ext.moe.context import TEDContext
from ds_ext.mpu import MegatronMPU
from ds_ext.parallel import GroupError, JobLayout, TEDLayout, member_group
from ds_ext.plugin import Plugin

KEY = "ds_ext.ted"
_GRID_GROUPS = ("tensor", "data", "pipeline")  # what a PipelineModule's grid and TED's layout share
DRAWS_KEY = "ds_ext_ted_gate_draws"
NO_LAYER = "is enabled but the model has no ds_ext.moe.TEDMoE layer"


def _refuse(msg: str) -> None:
    raise DsExtConfigError(f"{KEY}: {msg}")


def _check_ds_config(ds_config: dict, step_owner: Plugin | None) -> None:
    """DeepSpeed's ZeRO stage and, where DeepSpeed's optimizer steps (no ``step_owner`` plugin
    replaces it), its half-precision clipping."""
    stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    if stage not in (0, 1, 2):
        _refuse(
            f"zero_optimization.stage {stage} is not supported (DeepSpeed's MoE parameter groups need "
            "ZeRO <= 2; 001 §7.1 uses ZeRO-1); allowed: 0, 1, 2"
        )
    if step_owner is not None:  # its own norm counts every expert once (e.g. ds_ext.zero_topo.data_group)
        return
    from ds_ext.integration.ds_engine import gradient_clipping

    clip = gradient_clipping(ds_config)  # DeepSpeed's default is 1.0, not 0
    half = [k for k in ("fp16", "bf16") if (ds_config.get(k) or {}).get("enabled")]
    if stage == 0 and clip > 0 and half:
        _refuse(
            f"gradient_clipping {clip} with zero_optimization.stage 0 and {half[0]}: DeepSpeed's {half[0]} optimizer "
            "clips with its own norm, which does not count expert parameters once (DeepSpeed clips at 1.0 when the "
            "key is absent); allowed: stage 0 in fp32, stage 1 or 2, ds_ext.zero_topo, or gradient_clipping 0"
        )


def _check_param_groups(optimizer: Any, ds_config: dict) -> None:
    """ZeRO-1/2 reduce expert gradients per param group: experts need their own groups."""
    stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    if stage == 0 or not isinstance(optimizer, torch.optim.Optimizer):
        return
    for group in optimizer.param_groups:
        experts = [p for p in group["params"] if is_moe_param(p)]
        if experts and (not group.get("moe") or len(experts) != len(group["params"])):
            _refuse(
                "ZeRO-1/2 need the expert parameters in their own param groups: build the optimizer from "
                "deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer(...)"
            )


def _whole_experts(layout: TEDLayout, layers: list[tuple[str, Any]], beside_zero_topo: bool) -> bool:
    """Whether the TED layers keep their experts whole on every tensor rank beside tensor
    parallelism (their gradients then reduce over ``expert_replicas``: the job's expert-data
    group). Beside ZeRO-topo, which shards every expert over that one group, the layers must
    agree; a group of one rank (expert-data 1, experts split) keeps each rank's experts unsharded,
    as DeepSpeed-MoE's ZeRO does over an expert-data group of size 1."""
    from ds_ext.moe.layer import TEDMoE  # imports DeepSpeed: kept out of ``ds-ext schema``

    whole = {
        name: layout.tensor > 1 and not m.enable_expert_tensor_parallelism
        for name, m in layers
        if isinstance(m, TEDMoE)
    }
    if not beside_zero_topo:
        return any(whole.values())
    if len(set(whole.values())) > 1:
        first = next(n for n, w in whole.items() if w)
        other = next(n for n, w in whole.items() if not w)
        _refuse(
            f"{first} keeps its experts whole on every tensor rank and {other} splits them "
            "(enable_expert_tensor_parallelism) with ds_ext.zero_topo, which shards every expert over one "
            "expert-data group; allowed: the same enable_expert_tensor_parallelism in every layer"
        )
    return any(whole.values())


def _check_pipeline(job: JobLayout, tensor: int, ds_config: dict) -> int:
    """A PipelineModule's stages for TED's layout: its tensor degree must be the block's, and at
    tensor parallel > 1 its pipe / grad partitioning off (Megatron-DeepSpeed's GPTModelPipe refuses
    them for MoE at PP > 1 with TP > 1: two tensors that need gradients cross each stage boundary;
    DeepSpeed's default is on)."""
    stages, grid_tensor = job.degree("pipeline"), job.degree("tensor")
    if grid_tensor != tensor:
        _refuse(
            f"tensor_parallel is {tensor} but the PipelineModule's topology has tensor (model) parallel "
            f"{grid_tensor}; allowed: {grid_tensor}"
        )
    pipeline = ds_config.get("pipeline") or {}
    on = [k for k in ("pipe_partitioned", "grad_partitioned") if pipeline.get(k, True)]
    if stages > 1 and tensor > 1 and on:
        default = "" if on[0] in pipeline else " (DeepSpeed's default)"
        _refuse(
            f"pipeline.{on[0]} true{default} with {stages} pipeline stages and tensor_parallel "
            f"{tensor}: Megatron-DeepSpeed refuses pipe / grad partitioning for MoE models there; allowed: "
            '"pipeline": {"pipe_partitioned": false, "grad_partitioned": false}'
        )
    return stages


class TEDPlugin(Plugin):
    """TED as a ds_ext plugin (see module docstring)."""

    name = "ted"
    Config = TEDConfig
    builds_model_parallel = True  # G_tensor, G_expert and the data groups (mpu)

    ted: TEDContext
    pipelined: bool  # the model is a PipelineModule (DeepSpeed's PipelineEngine)
    whole_experts: bool  # experts whole on every tensor rank beside tensor parallelism (see _whole_experts)

    def prepare(self, model: Any, optimizer: Any, ds_config: dict) -> tuple[Any, Any, dict]:
        """Build TED's layout (tensor x expert x expert-data, 001 §7.1; on a PipelineModule per
        stage, the stages outermost) and its context, check every ``TEDMoE`` layer against the block
        and bind the layers to it."""
        from ds_ext.integration import ds_engine  # DeepSpeed is imported on use
        from ds_ext.moe.layer import TEDMoE

        cfg, rt = self.config, self.runtime
        _check_ds_config(ds_config, rt.step_owner())
        self.pipelined = ds_engine.pipeline_grid(model) is not None
        stages = _check_pipeline(rt.parallel, cfg.tensor_parallel, ds_config) if self.pipelined else 1
        try:
            layout = TEDLayout.build(
                rt.topology.world_size, cfg.tensor_parallel, cfg.expert_parallel, cfg.expert_data_parallel, stages
            )
            layout.check_placement(rt.topology)
            if self.pipelined:  # the grid stays DeepSpeed's mpu: its groups must be TED's
                rt.parallel.check_groups(
                    rt.rank, {g: member_group(layout.partition(g), rt.rank) for g in layout.GROUPS if g in _GRID_GROUPS}
                )
        except GroupError as err:
            raise DsExtConfigError(str(err)) from None
        layers = self._layers(model, layout)
        self.whole_experts = _whole_experts(layout, layers, rt.parameter_sharder() is not None)
        _check_param_groups(optimizer, ds_config)
        self.ted = TEDContext.create(
            layout,
            rt.comm,
            cfg.duplicate_token_dropping,
            cfg.comm_aware_checkpointing,
            cfg.seed,
            cfg.cac_stash == "lean",
        )
        zero_partitions = (ds_config.get("zero_optimization") or {}).get("stage", 0) > 0
        first, total = self._first_layer_index(sum(isinstance(m, TEDMoE) for _, m in layers), len(layers))
        if total == 0:
            _refuse(NO_LAYER)
        for index, (_, module) in enumerate(layers, start=first):
            module.ted_bind(self.ted, index)
            if zero_partitions and hasattr(module, "count_zero_partitions"):
                module.count_zero_partitions()
        self.layers = [m for _, m in layers]
        return model, optimizer, ds_config

    def _layers(self, model: Any, layout: TEDLayout) -> list[tuple[str, Any]]:
        """The model's layers to bind, after validating every TED-aware module against the layout
        and the block."""
        from ds_ext.integration import ds_moe  # imports DeepSpeed: kept out of ``ds-ext schema``
        from ds_ext.moe.layer import TEDMoE

        cfg = self.config
        modules = list(model.named_modules())
        for name, module in modules:  # first: a DeepSpeed-MoE model gets the line that says what to change
            if isinstance(module, ds_moe.MoEBase) and not isinstance(module, TEDMoE):
                _refuse(f"{name} is a deepspeed.moe.layer.MoE; replace it by ds_ext.moe.TEDMoE (same arguments)")
        if not self.pipelined and not any(isinstance(m, TEDMoE) for _, m in modules):
            _refuse(NO_LAYER)  # on a PipelineEngine a stage may have none: counted over the stages (prepare)
        for name, module in modules:
            if hasattr(module, "ted_validate"):
                try:
                    module.ted_validate(layout, name)
                except ValueError as err:
                    raise DsExtConfigError(str(err)) from None
            if not isinstance(module, TEDMoE):
                continue
            try:
                module.check_token_dropping(layout.tensor, cfg.duplicate_token_dropping, name)
            except ValueError as err:
                raise DsExtConfigError(str(err)) from None
            gate = module.gate
            for key, want, got in (
                ("num_experts", cfg.num_experts, module.num_experts),
                ("top_k", cfg.top_k, gate.k),
                ("capacity_factor", cfg.capacity_factor, gate.capacity_factor),
            ):
                if want is not None and want != got:
                    _refuse(f"{key} is {want} but layer {name} has {got}")
        return [(n, m) for n, m in modules if hasattr(m, "ted_bind")]

    def _first_layer_index(self, experts: int, bound: int) -> tuple[int, int]:
        """(the model-wide index of this rank's first of its ``bound`` TED-bound layers, the
        model's ``TEDMoE`` layers, of which this stage holds ``experts``): on a PipelineEngine the
        layers of the earlier stages come first (each layer's gate seeds from its index, as in the
        unpipelined model); collective over the pipeline group."""
        group = self.ted.groups.pipeline
        if group is None:
            return 0, experts
        counts = torch.zeros(2, self.ted.layout.pipeline, dtype=torch.int64, device=backend_device(group))
        stage = self.ted.layout.coords(self.ted.rank)["pipeline"]
        counts[:, stage] = torch.tensor([bound, experts], device=counts.device)
        self.ted.comm.all_reduce(counts, group=group)
        return int(counts[0, :stage].sum()), int(counts[1].sum())

    def mpu(self) -> MegatronMPU | None:
        """The Megatron-style mpu over TED's tensor and data groups; None on a PipelineEngine, whose
        mpu is the PipelineModule's grid (the same groups, checked in ``prepare``)."""
        return None if self.pipelined else self.ted.mpu()

    def job_layout(self) -> JobLayout:
        """The job's parallel view of TED's layout."""
        return JobLayout.of(self.ted.layout, "ds_ext.ted", whole_experts=self.whole_experts)

    def _clip_with_global_norm(self, engine: Any) -> None:
        from ds_ext.integration.ds_engine import replace_fp32_clipping
        from ds_ext.moe.grad_norm import clip_

        max_norm = engine.gradient_clipping()
        if self.runtime.step_owner() is None and engine.zero_optimization_stage() == 0 and max_norm > 0:
            replace_fp32_clipping(engine, lambda: clip_(engine.module.parameters(), max_norm, self.ted))

    def attach(self, engine: Any) -> None:
        """Fresh CAC tapes at each forward, the expert groups released on destroy, clipping by the global
        norm, the gates' draws saved and loaded with checkpoints."""
        from ds_ext.integration import ds_moe
        from ds_ext.moe.cac import clear_tapes
        from ds_ext.moe.layer import TEDMoE

        forward = engine.forward
        layers = self.layers

        @functools.wraps(forward)
        def forward_with_fresh_tapes(*args, **kwargs):
            clear_tapes(layers)
            return forward(*args, **kwargs)

        engine.forward = forward_with_fresh_tapes
        if self.pipelined:  # a PipelineEngine runs its forwards inside train_batch / eval_batch
            for name in ("train_batch", "eval_batch"):
                run = getattr(engine, name)

                @functools.wraps(run)
                def batch_with_fresh_tapes(*args, _run=run, **kwargs):
                    clear_tapes(layers)
                    return _run(*args, **kwargs)

                setattr(engine, name, batch_with_fresh_tapes)
        destroy = engine.destroy
        names = {m.expert_group_name for m in layers if isinstance(m, TEDMoE)}

        @functools.wraps(destroy)
        def destroy_and_unregister(*args, **kwargs):
            out = destroy(*args, **kwargs)
            ds_moe.release_groups(names, self.ted.groups.expert)
            return out

        engine.destroy = destroy_and_unregister
        self._clip_with_global_norm(engine)
        gates = [m.gate for m in layers if isinstance(m, TEDMoE)]
        save, load = engine.save_checkpoint, engine.load_checkpoint

        @functools.wraps(save)
        def save_with_gate_draws(save_dir, tag=None, client_state=None, *args, **kwargs):
            state = {**(client_state or {}), DRAWS_KEY: [g.draws for g in gates]}
            return save(save_dir, tag, state, *args, **kwargs)

        @functools.wraps(load)
        def load_with_gate_draws(*args, **kwargs):
            path, client_state = load(*args, **kwargs)
            draws = (client_state or {}).pop(DRAWS_KEY, None)
            if draws is not None:
                if len(draws) != len(gates):
                    _refuse(f"the checkpoint has {len(draws)} TED gates, the model {len(gates)}")
                for g, n in zip(gates, draws):
                    g.draws = n
            return path, client_state

        engine.save_checkpoint, engine.load_checkpoint = save_with_gate_draws, load_with_gate_draws
