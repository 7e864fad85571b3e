"""``ds-ext plan --ds-config``: the batch, precision and plan a ds_config selects.

Read as DeepSpeed reads it (``ds_ext.config.load_ds_config``: JSON, hjson or base64) and the
``"ds_ext"`` block validated by its schema. The batch is ``train_batch_size``, or
``train_micro_batch_size_per_gpu x gradient_accumulation_steps x`` the ranks (each rank its own
replica, as under ZeRO); ``bf16`` / ``fp16`` mean 2-byte elements, neither 4; activation
checkpointing is on when the ds_config has DeepSpeed's ``activation_checkpointing`` section (the one
Megatron-DeepSpeed's and GPT-NeoX's ``--checkpoint-activations`` runs configure), off without it. An enabled
``zero_topo`` section, or ``pmm3d`` with an explicit grid, becomes one more candidate, named ``configured <plan>``;
a ``zero_topo`` section with ``form: pipeline`` (004's Frontier recipes, ``configs/frontier/*_zero_topo.json``)
is planned on the model's Megatron recipe layout, ZeRO-topo's pipeline form in place of ZeRO-1, with
a note on whether the tiled optimizer pays (``megatron_plans.tiled_optimizer``; an fp16 section's loss
scale counted in the step's buffers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from ds_ext import config as cfgmod
from ds_ext.optim.config import DEFAULT_TILE_SIZE
from ds_ext.parallel import Grid
from ds_ext.planner import PlannerError, megatron_plans, pmm_grids, zero_plans
from ds_ext.planner.estimate import Candidate, Job

CONFIGURED = "configured"


class DsConfigError(PlannerError):
    """A ds_config the planner cannot use; the message starts with ``--ds-config``."""


@dataclass(frozen=True)
class DsConfig:
    path: str
    global_batch: int | None
    micro_batch: int | None
    grad_accum: int | None
    elem_bytes: int
    checkpointing: bool
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)  # enabled plugin sections
    fp16: bool = False  # an fp16 section: DeepSpeed's loss scale divides the gradients
    bucket_size: int = megatron_plans.REDUCE_BUCKET_SIZE  # zero_optimization.reduce_bucket_size

    def batch(self, world: int) -> int | None:
        if self.global_batch is not None:
            return self.global_batch
        if self.micro_batch is not None:
            return self.micro_batch * (self.grad_accum or 1) * world
        return None

    def candidates(self, job: Job) -> list[Candidate]:
        out = []
        if "zero_topo" in self.sections:
            section = {k: v for k, v in self.sections["zero_topo"].items() if k != "enabled"}
            if section.get("form") == "pipeline":
                out.append(self._pipeline_form(job, section))
            else:
                out.append(zero_plans.candidate(job, section))
        grid = self.sections.get("pmm3d", {}).get("grid", "auto")
        if grid != "auto":
            g = Grid(**grid)
            if g.world_size != job.world:
                raise DsConfigError(
                    f"--ds-config {self.path}: ds_ext.pmm3d.grid {g} has product {g.world_size}, "
                    f"but --nodes gives {job.world} ranks"
                )
            out.append(pmm_grids.candidate(job, g))
        return [replace(c, name=f"{CONFIGURED} {c.name}") for c in out]

    def _pipeline_form(self, job: Job, section: dict[str, Any]) -> Candidate:
        """ZeRO-topo's pipeline form on the model's Megatron recipe layout (004 Table V), ZeRO-1's
        plan beside it (``megatron_plans``); a model without one is refused."""
        recipe = job.arch.recipe
        if recipe.megatron is None:
            raise DsConfigError(
                f"--ds-config {self.path}: ds_ext.zero_topo.form 'pipeline' is planned on the model's Megatron "
                f"recipe (TP, PP); {job.arch.name} has none (allowed: a model with one, e.g. gpt-22b, gpt-175b, gpt-1t)"
            )
        tp, pp = recipe.megatron
        if job.world % (tp * pp):
            raise DsConfigError(
                f"--ds-config {self.path}: {job.arch.name}'s recipe TP {tp} x PP {pp} does not divide {job.world} ranks"
            )
        tiled = self.sections.get("tiled_optimizer")
        return megatron_plans.candidate(
            job,
            tp,
            pp,
            job.world // (tp * pp),
            recipe.micro_batch or 1,
            section,
            loss_scaled=self.fp16,
            tile_size=None if tiled is None else tiled.get("tile_size", DEFAULT_TILE_SIZE),
            bucket_size=self.bucket_size,
        )


def _positive(cfg: dict[str, Any], key: str, path: str) -> int | None:
    value = cfg.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise DsConfigError(f"--ds-config {path}: {key} must be a positive integer, got {value!r}")
    return value


def _bucket_size(cfg: dict[str, Any], path: str) -> int:
    """``zero_optimization.reduce_bucket_size`` in elements, as DeepSpeed takes it (a positive whole
    number, 5e8 written as a float too), DeepSpeed's 5e8 where absent."""
    zero = cfg.get("zero_optimization")
    value = zero.get("reduce_bucket_size") if isinstance(zero, dict) else None
    if value is None:
        return megatron_plans.REDUCE_BUCKET_SIZE
    whole = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not whole or value != int(value) or value < 1:
        raise DsConfigError(
            f"--ds-config {path}: zero_optimization.reduce_bucket_size must be a positive whole number of elements "
            f"(as DeepSpeed takes it), got {value!r}"
        )
    return int(value)


def read(path: str) -> DsConfig:
    try:
        cfg = cfgmod.load_ds_config(path)
        block = cfgmod.parse(cfg.get(cfgmod.BLOCK))
    except cfgmod.DsExtConfigError as err:
        raise DsConfigError(f"--ds-config {path}: {err}") from None
    half = any(isinstance(cfg.get(k), dict) and cfg[k].get("enabled") for k in ("bf16", "fp16"))
    sections = {
        name: sec.model_dump(exclude_unset=True) for name, sec in cfgmod.plugin_configs(block).items() if sec.enabled
    }
    return DsConfig(
        path,
        _positive(cfg, "train_batch_size", path),
        _positive(cfg, "train_micro_batch_size_per_gpu", path),
        _positive(cfg, "gradient_accumulation_steps", path),
        2 if half else 4,
        isinstance(cfg.get("activation_checkpointing"), dict),
        sections,
        isinstance(cfg.get("fp16"), dict) and bool(cfg["fp16"].get("enabled")),
        _bucket_size(cfg, path),
    )
