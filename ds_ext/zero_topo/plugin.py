"""``"ds_ext": {"zero_topo": {...}}``: registers ZeRO-topo with ``ds_ext.initialize``.

ZeRO-topo replaces DeepSpeed's ZeRO and mixed-precision wrappers, so DeepSpeed runs as a
plain (stage 0, fp32-looking) engine around a model whose parameters ds_ext shards:

* ``prepare``: resolves the plan against the topology (errors before any collective),
  reads ``bf16`` / ``fp16`` / ``gradient_clipping`` from the ds_config and hands DeepSpeed a
  copy with those switched off; casts the model to the training dtype;
* ``attach``: after DeepSpeed has broadcast rank 0's weights, shards the model into units,
  swaps the engine's optimizer for :class:`ZeroTopoOptimizer` around the user's torch
  optimizer, and adds loss scaling (fp16) and sharded checkpoints to the engine.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch

from ds_ext.config import DsExtConfigError
from ds_ext.integration import ds_engine
from ds_ext.plugin import Plugin, register_plugin
from ds_ext.zero_topo.engine import LossScaler, ShardedModel, ZeroTopoOptimizer
from ds_ext.zero_topo.plan import ZeroTopoConfig, resolve_plan
from ds_ext.zero_topo.units import ShardContext

SHARD_FILE = "ds_ext_zero_topo_rank{rank:05d}.pt"


def _precision(ds_config: dict) -> tuple[torch.dtype, LossScaler]:
    bf16 = ds_config.get("bf16", {}).get("enabled", False)
    fp16_cfg = ds_config.get("fp16", {})
    fp16 = fp16_cfg.get("enabled", False)
    if bf16 and fp16:
        raise DsExtConfigError("bf16.enabled and fp16.enabled are both true; choose one")
    if not fp16:
        return (torch.bfloat16 if bf16 else torch.float32), LossScaler()
    static = fp16_cfg.get("loss_scale", 0)
    return torch.float16, LossScaler(
        scale=float(static) if static else 2.0 ** fp16_cfg.get("initial_scale_power", 16),
        dynamic=not static,
        window=fp16_cfg.get("loss_scale_window", 1000),
        min_scale=fp16_cfg.get("min_loss_scale", 1),
    )


@register_plugin
class ZeroTopoPlugin(Plugin):
    """3-level hierarchical partitioning (003) as a ds_ext plugin."""

    name = "zero_topo"
    Config = ZeroTopoConfig

    def prepare(self, model: Any, optimizer: Any, ds_config: dict) -> tuple[Any, Any, dict]:
        self.plan = resolve_plan(self.config, self.runtime.topology)
        stage = ds_config.get("zero_optimization", {}).get("stage", 0)
        if stage != 0:
            raise DsExtConfigError(
                f"ds_ext.zero_topo replaces DeepSpeed's ZeRO: set zero_optimization.stage to 0 (got {stage})"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise DsExtConfigError(
                "ds_ext.zero_topo needs a torch optimizer instance passed as optimizer=... "
                "(it shards that optimizer's state); a ds_config 'optimizer' section is not supported"
            )
        self.dtype, self.scaler = _precision(ds_config)
        self.clip = float(ds_config.get("gradient_clipping", 0.0))
        cfg = copy.deepcopy(ds_config)
        for key in ("bf16", "fp16"):
            cfg.setdefault(key, {})["enabled"] = False
        cfg["gradient_clipping"] = 0.0
        return model.to(self.dtype), optimizer, cfg

    def attach(self, engine: Any) -> None:
        rt = self.runtime
        ctx = ShardContext(self.plan, rt.comm, rank=rt.rank, dtype=self.dtype,
                           compile_quantizer=self.config.compile_quantizer,
                           device=next(engine.module.parameters()).device)
        self.sharded = ShardedModel(engine.module, ctx, self.config.units, self.config.prefetch)
        self.optimizer = ZeroTopoOptimizer(self.sharded, engine.optimizer, self.clip, self.scaler)
        ds_engine.replace_optimizer(engine, self.optimizer)
        if self.dtype == torch.float16:
            ds_engine.scale_backward_loss(engine, lambda: self.scaler.scale)
        ds_engine.wrap_checkpointing(engine, self._save_shard, self._load_shard, self.sharded)

    def state_bytes(self) -> dict[str, int]:
        """Peak bytes this rank held per model state (primary and secondary weights,
        gradient shard; sampled at the end of each backward) and optimizer state."""
        out = dict(self.sharded.peak_state_bytes or self.sharded.state_bytes())
        out["optimizer"] = self.optimizer.state_bytes()
        return out

    def analytic_traffic(self, grad_accum: int):
        """The analytic model (ds_ext.perf.zero) of this run's bytes per step."""
        from ds_ext.perf.zero import traffic

        return traffic(self.plan, self.sharded.unit_specs(), grad_accum, self.sharded.ctx.dtype.itemsize)

    def analytic_memory(self):
        from ds_ext.perf.zero import memory

        return memory(self.plan, self.sharded.unit_specs(), self.runtime.rank, self.sharded.ctx.dtype.itemsize)

    # ---- checkpoints: DeepSpeed saves the gathered 16-bit module; each rank adds its shard --
    def _save_shard(self, directory: str) -> None:
        opt = self.optimizer
        torch.save(
            {
                "plan": self.plan.describe(),
                "masters": [m for *_, m in opt.segments],
                "inner": opt.inner.state_dict(),
                "loss_scale": self.scaler.scale,
            },
            os.path.join(directory, SHARD_FILE.format(rank=self.runtime.rank)),
        )

    def _load_shard(self, directory: str) -> None:
        path = os.path.join(directory, SHARD_FILE.format(rank=self.runtime.rank))
        if not os.path.isfile(path):
            raise FileNotFoundError(f"ds_ext.zero_topo: checkpoint shard {path} is missing")
        state = torch.load(path, weights_only=True)
        if state["plan"] != self.plan.describe():
            raise ValueError(
                f"ds_ext.zero_topo: checkpoint {path} was written with plan '{state['plan']}', "
                f"this run uses '{self.plan.describe()}'"
            )
        opt = self.optimizer
        if len(state["masters"]) != len(opt.segments):
            raise ValueError(f"ds_ext.zero_topo: checkpoint {path} does not match this model's shards")
        for (*_, master), saved in zip(opt.segments, state["masters"]):
            master.copy_(saved)
        opt.inner.load_state_dict(state["inner"])
        self.scaler.scale = state["loss_scale"]
