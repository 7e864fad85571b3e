"""Sharding plan: which topology level each model state is sharded over (003 §V-A, Table IV).

A state *sharded at level L* is split across the ranks of one domain of L: on Frontier
``gcd`` = the 2 GCDs of one MI250X, ``gpu`` = the 8 GCDs of a node, ``node`` = every
rank. Notation (003 Table III): N nodes, P ranks per node; N_w/P_w, N_g/P_g, N_os/P_os
the nodes / ranks-per-node that share weights, gradients and optimizer states.

Dependency rule (003 §V-A, from AMSP): each rank holds only gradients and optimizer
states of parameters it owns, so ``N_os >= N_g >= N_w`` and ``P_os >= P_g >= P_w``: the
optimizer level is at or above the gradient level, which is at or above the weight
level. The secondary weight copy (hpZ / 003's Sec-Degree) may sit at any level.

Presets: ``zero3``, ``zeropp`` (qwZ + hpZ + qgZ as DeepSpeed does them),
``mics``, ``zero_topo_paper`` (003 exactly), ``zero_topo`` (003's partitioning with a
hierarchical step boundary) and ``zero_topo_int8`` (``zero_topo`` with int8 blocks on the
cross-node collectives of the step boundary: below the 16-bit floor). Presets name levels relative to the topology (innermost,
node, world) so they work on any hierarchy; explicit fields override them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from pydantic import Field, field_validator, model_validator

from ds_ext.config_base import ConfigSection
from ds_ext.errors import DsExtError
from ds_ext.plugin import PluginConfig
from ds_ext.topology import Topology

Bits = Literal[4, 8, 16]
StepKind = Literal["hierarchical", "allreduce"]
PresetName = Literal["zero3", "zeropp", "mics", "zero_topo_paper", "zero_topo", "zero_topo_int8"]
PRESETS: tuple[str, ...] = PresetName.__args__  # type: ignore[attr-defined]

# Relative level names used by presets: resolved against the topology.
INNER, NODE, WORLD = "@inner", "@node", "@world"


class PlanError(DsExtError, ValueError):
    """A plan that breaks the dependency rule or does not fit the topology."""


class WeightsConfig(ConfigSection):
    level: str | None = Field(None, description="Level the 16-bit primary weights are sharded over.")
    gather_bits: Bits | None = Field(
        None, description="Wire format of weight all-gathers: 8 = int8 (qwZ), 16 = unquantized."
    )


class SecondaryConfig(ConfigSection):
    level: str | None = Field(
        None, description="Level of the secondary weight partition (hpZ / Sec-Degree); 'none' for no secondary."
    )
    bits: Bits | None = Field(
        None, description="Stored format: 8 = block-quantized int8 (003), 16 = model dtype (DeepSpeed hpZ)."
    )


class GradientsConfig(ConfigSection):
    level: str | None = Field(None, description="Level the gradient shard is sharded over.")
    bits: Bits | None = Field(
        None, description="Wire format of the gradient reduce-scatter: 4 = int4 all-to-all (qgZ), 16 = unquantized."
    )
    hops: Literal[1, 2] | None = Field(
        None, description="1 = one all-to-all over the gradient group; 2 = intra-node then inter-node (ZeRO++ qgZ)."
    )


class OptimizerConfig(ConfigSection):
    level: str | None = Field(None, description="Level the fp32 master weights and optimizer moments are sharded over.")


class StepConfig(ConfigSection):
    kind: StepKind | None = Field(
        None,
        description="'allreduce' = 003: cross-node all-reduce of the gradient shard and a world all-gather "
        "of the weights; 'hierarchical' = reduce-scatter / all-gather level by level.",
    )
    bits: Literal[8, 16] | None = Field(
        None,
        description="Wire format of the cross-node gradient reduce-scatter and weight all-gather of the step "
        "boundary: 8 = int8 blocks with fp32 scales (every rank, the owner too, then uses the dequantized "
        "weights; fp32 masters stay exact), 16 = the training dtype.",
    )


class CheckpointTiersConfig(ConfigSection):
    """``zero_topo.checkpoint_tiers``: node-local saves with a partner copy, the shared directory
    every few saves (:mod:`ds_ext.zero_topo.tiers`)."""

    local_dir: str = Field(
        description="Each node's local checkpoint directory (on Frontier its NVMe, e.g. /mnt/bb/$USER/ckpt); "
        "'{node}' is replaced by the node's index (emulated nodes on one host)."
    )
    local_every: int = Field(1, ge=1, description="Every this many saves go to the local tier (with a partner copy).")
    shared_every: int = Field(
        10,
        ge=1,
        description="Every this many saves go to the shared directory (save_checkpoint's save_dir); a multiple of "
        "local_every, so a shared save is a local one too and the local tier holds the newest save.",
    )

    keep_local: int | None = Field(
        2,
        ge=1,
        description="Each node keeps its newest this many local saves and removes older ones after a save (never "
        "the one 'latest' names); null keeps every save. Default 2: node-local NVMe is small, and the save before "
        "the newest is what a restore loads when a file of the newest has no copy left on any node.",
    )

    @model_validator(mode="after")
    def _shared_is_local(self) -> "CheckpointTiersConfig":
        if self.shared_every % self.local_every:
            raise ValueError(
                f"shared_every {self.shared_every} is not a multiple of local_every {self.local_every}; allowed: "
                "a multiple, so that every shared save is also a local one"
            )
        return self


class ZeroTopoConfig(PluginConfig):
    """``"ds_ext": {"zero_topo": {...}}``."""

    preset: PresetName = Field("zero_topo", description=f"Base plan: one of {', '.join(PRESETS)}.")  # type: ignore[valid-type]
    form: Literal["auto", "sharded", "pipeline"] = Field(
        "auto",
        description="'sharded': every model state sharded, weights gathered unit by unit (003 §V); 'pipeline': inside "
        "DeepSpeed's PipelineEngine (deepspeed.pipe.PipelineModule) weights stay whole, gradients are reduced once "
        "per train_batch and the optimizer state is sharded (ds_ext.zero_topo.pipeline); 'auto': 'pipeline' for a "
        "PipelineModule, else 'sharded'.",
    )
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    secondary: SecondaryConfig = Field(default_factory=SecondaryConfig)
    gradients: GradientsConfig = Field(default_factory=GradientsConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    step: StepConfig = Field(
        default_factory=StepConfig,
        description="The step boundary: {'kind': 'hierarchical' | 'allreduce', 'bits': 8 | 16}; a bare kind "
        "string is accepted too.",
    )

    @field_validator("step", mode="before")
    @classmethod
    def _step_kind_string(cls, value):
        return {"kind": value} if isinstance(value, str) else value

    quant_block_size: int = Field(512, ge=2, description="Elements per quantization block (even).")
    compile_quantizer: bool = Field(
        True,
        description="Fuse the quantizer's encode / decode (the default): one Triton kernel per call on an "
        "accelerator (no host wait on the gradient path); on the CPU torch.compile fuses them into one pass per "
        "block, at a few seconds of compilation per process once (tensors under 65,536 elements use the eager "
        "kernels). Same bits on every path. false = eager kernels, no compiler needed.",
    )
    units: list[str] | Literal["auto"] = Field(
        "auto",
        description="Module class names gathered and released as one unit; 'auto' = the entries of every "
        "nn.ModuleList (transformer blocks).",
    )
    prefetch: bool = Field(True, description="Start the next unit's all-gather while the current one computes.")
    overlap_step: bool = Field(
        True,
        description="Overlap the step boundary (003 §V-A): each unit's cross-level gradient reduction starts in the "
        "last micro-batch's backward as soon as its gradient shard is complete, and the step's weight all-gathers "
        "run pipelined unit by unit (a unit's gather inside the node beside the next unit's across nodes). The same "
        "collectives, bytes and results; false = every boundary collective in the step, one after another.",
    )
    gather_across_step: bool = Field(
        True,
        description="With overlap_step: the step's weight all-gathers are issued in the step and completed at "
        "each unit's first use after it (its next forward; a checkpoint, gathered_parameters or state_dict "
        "completes them all), so those across nodes run while the next forward computes the units before them. "
        "The same collectives, bytes and results; each unit keeps one buffer of its primary shard's size until "
        "then. false = they complete inside step(). Only with overlap_step (true given beside overlap_step false is "
        "refused).",
    )
    agreement_check_s: float = Field(
        60.0,
        ge=0,
        description="Seconds a ZeRO-topo collective waits before the ranks compare the units they ran "
        "(ds_ext.zero_topo.agreement): ranks that ran different units fail in one line naming them instead of "
        "waiting for ds_ext.comm.timeout_s; equal units keep waiting. On gloo (timed waits); "
        "0 = off. On NCCL torch's TORCH_NCCL_DESYNC_DEBUG=1 reports such mismatches.",
    )
    async_save: bool = Field(
        False,
        description="engine.save_checkpoint copies the rank's checkpoint (its ZeRO-topo shard with TED experts, "
        "3D-PMM slices and the tiled optimizer's state, and DeepSpeed's own files) into host memory and returns; a "
        "background thread writes it and completes the atomic save (staging directory, agreement of the ranks on "
        "a gloo group of its own, 'latest' last). A later save, load_checkpoint or engine.destroy() first waits "
        "for it and raises its failure. Default false: the snapshot holds a second copy of the rank's state in "
        "host memory until written, and a failed write is reported at that later call instead of by "
        "save_checkpoint itself (ds_ext.zero_topo.plugin).",
    )
    checkpoint_tiers: CheckpointTiersConfig | None = Field(
        None,
        description="Two checkpoint tiers: save k goes to each node's local_dir (every local_every saves; each "
        "rank's files also copied to the rank at its place on the next node) and to save_dir (every shared_every "
        "saves); load_checkpoint(save_dir) loads the newest local save the nodes hold whole (a lost node's files "
        "from its partner's copies; an older local one, saying so, when the newest lost a file), else the newest "
        "shared save, saying so. Needs 2 or more nodes; with "
        "async_save both are written in the background. Default none: every save to save_dir.",
    )
    quantization_groups: Literal["per_parameter", "packed"] = Field(
        "per_parameter",
        description="'per_parameter': every parameter starts on a block boundary of its unit and 1-D parameters' "
        "gradients travel in the training dtype, as DeepSpeed's qgZ; 'packed': quantization blocks run over a "
        "unit's packed parameters (fewer bytes, but a block may hold two parameters, so a LayerNorm sharing a "
        "block with a bias of ~100x larger gradients can round to zero and not train).",
    )

    @model_validator(mode="after")
    def _gather_across_step_needs_overlap(self) -> "ZeroTopoConfig":
        if "gather_across_step" in self.model_fields_set and self.gather_across_step and not self.overlap_step:
            raise ValueError(
                "gather_across_step true needs overlap_step true (the step's gathers are carried past it only "
                "when the step boundary is overlapped); allowed: overlap_step true, or gather_across_step false"
            )
        return self


_PRESET_FIELDS: dict[str, dict] = {
    "zero3": dict(w=WORLD, wb=16, s=None, sb=16, g=WORLD, gb=16, hops=1, o=WORLD, step="hierarchical", stb=16),
    "zeropp": dict(w=WORLD, wb=8, s=NODE, sb=16, g=WORLD, gb=4, hops=2, o=WORLD, step="hierarchical", stb=16),
    "mics": dict(w=NODE, wb=16, s=None, sb=16, g=NODE, gb=16, hops=1, o=NODE, step="hierarchical", stb=16),
    "zero_topo_paper": dict(w=INNER, wb=8, s=INNER, sb=8, g=NODE, gb=4, hops=1, o=WORLD, step="allreduce", stb=16),
    "zero_topo": dict(w=INNER, wb=8, s=INNER, sb=8, g=NODE, gb=4, hops=1, o=WORLD, step="hierarchical", stb=16),
    "zero_topo_int8": dict(w=INNER, wb=8, s=INNER, sb=8, g=NODE, gb=4, hops=1, o=WORLD, step="hierarchical", stb=8),
}


@dataclass(frozen=True)
class ShardingPlan:
    """A plan resolved against a topology: level indices into ``topology.levels``."""

    topology: Topology
    weights: int
    gather_bits: int
    secondary: int | None
    secondary_bits: int
    gradients: int
    gradient_bits: int
    gradient_hops: int
    optimizer: int
    step: str
    block_size: int
    step_bits: int = 16  # wire format of the step boundary's cross-node collectives
    per_parameter_groups: bool = False  # quantization_groups == "per_parameter"
    weights_whole: bool = False  # the pipeline form: weights gathered back whole at the step

    def pipeline_form(self) -> "ShardingPlan":
        """This plan inside DeepSpeed's PipelineEngine (``ds_ext.zero_topo.pipeline``): weights whole
        (the step's gather ends at the innermost level, then 16-bit over it), no secondary."""
        return dataclasses.replace(self, weights=0, gather_bits=16, secondary=None, weights_whole=True)

    def unshared(self) -> "ShardingPlan":
        """This plan over a group of one rank (MoE experts at expert-data 1, kept whole as
        DeepSpeed-MoE's ZeRO keeps them over an expert-data group of size 1): nothing travels, so
        no format is quantized and no secondary copy is kept."""
        return dataclasses.replace(
            self, gather_bits=16, secondary=None, secondary_bits=16, gradient_bits=16, gradient_hops=1, step_bits=16
        )

    def name(self, index: int | None) -> str:
        return "none" if index is None else self.topology.levels[index].name

    def shards(self, index: int | None) -> int:
        """Number of shards of a state sharded at level ``index`` (1 if replicated)."""
        return 1 if index is None else self.topology.domain_size(self.topology.levels[index].name)

    @property
    def secondary_from_primary(self) -> bool:
        """The secondary lies inside the primary shard, so it is rebuilt locally after a step."""
        return self.secondary is not None and self.secondary >= self.weights

    def describe(self) -> str:
        sec = (
            "none"
            if self.secondary is None
            else f"{self.name(self.secondary)} int{self.secondary_bits}"
            if self.secondary_bits < 16
            else f"{self.name(self.secondary)} 16-bit"
        )
        step = f"step {self.step}" + (f" ({self.step_bits}-bit across nodes)" if self.step_bits < 16 else "")
        weights = (
            "weights whole"
            if self.weights_whole
            else f"weights {self.name(self.weights)} (gather {self.gather_bits}-bit), secondary {sec}"
        )
        return (
            f"{weights}, "
            f"gradients {self.name(self.gradients)} ({self.gradient_bits}-bit, {self.gradient_hops}-hop), "
            f"optimizer {self.name(self.optimizer)}, {step}"
        )

    @property
    def aligned(self) -> bool:
        """Every parameter starts on a block boundary of its unit (no quantization block crosses
        two parameters): per-parameter groups where any wire or stored format is quantized."""
        quantizes = self.gather_bits < 16 or self.secondary_bits < 16 or self.gradient_bits < 16 or self.step_bits < 16
        return self.per_parameter_groups and quantizes

    @property
    def raw_1d_gradients(self) -> bool:
        """1-D parameters' gradient blocks travel unquantized in the quantized reduction."""
        return self.per_parameter_groups and self.gradient_bits < 16

    def step_level_bits(self, level: int) -> int:
        """Wire bits of a step-boundary collective over ``level``: quantized only across nodes."""
        return self.step_bits if level == len(self.topology.levels) - 1 else 16


def _level_index(topo: Topology, value: str, key: str) -> int:
    relative = {INNER: 0, NODE: max(len(topo.levels) - 2, 0), WORLD: len(topo.levels) - 1}
    if value in relative:
        return relative[value]
    if value not in topo.level_names:
        raise PlanError(
            f"ds_ext.zero_topo.{key}: topology {topo.name!r} has no level {value!r}; "
            f"allowed: {', '.join(topo.level_names)}"
        )
    return topo.index(value)


def resolve_plan(cfg: ZeroTopoConfig, topo: Topology) -> ShardingPlan:
    """Apply the preset, the explicit overrides and the dependency rule."""
    p = dict(_PRESET_FIELDS[cfg.preset])
    for key, value in (
        ("w", cfg.weights.level),
        ("wb", cfg.weights.gather_bits),
        ("s", cfg.secondary.level),
        ("sb", cfg.secondary.bits),
        ("g", cfg.gradients.level),
        ("gb", cfg.gradients.bits),
        ("hops", cfg.gradients.hops),
        ("o", cfg.optimizer.level),
        ("step", cfg.step.kind),
        ("stb", cfg.step.bits),
    ):
        if value is not None:
            p[key] = None if (key == "s" and value == "none") else value
    w = _level_index(topo, p["w"], "weights.level")
    g = _level_index(topo, p["g"], "gradients.level")
    o = _level_index(topo, p["o"], "optimizer.level")
    s = None if p["s"] is None else _level_index(topo, p["s"], "secondary.level")
    if not o >= g >= w:
        raise PlanError(
            "ds_ext.zero_topo: 003's dependency rule needs optimizer level >= gradients level >= "
            "weights level (N_os >= N_g >= N_w, P_os >= P_g >= P_w); got "
            f"weights={topo.levels[w].name}, gradients={topo.levels[g].name}, optimizer={topo.levels[o].name}"
        )
    if p["wb"] == 4:
        raise PlanError("ds_ext.zero_topo.weights.gather_bits: allowed values are 8 and 16 (got 4)")
    if p["sb"] == 4:
        raise PlanError("ds_ext.zero_topo.secondary.bits: allowed values are 8 and 16 (got 4)")
    if p["hops"] == 2 and (g == 0 or p["gb"] == 16):
        raise PlanError(
            "ds_ext.zero_topo.gradients.hops: 2 needs a quantized gradient reduction (bits 4 or 8) "
            f"over more than one level; got level {topo.levels[g].name!r}, bits {p['gb']}"
        )
    if p["stb"] == 8 and (p["step"] != "hierarchical" or o != len(topo.levels) - 1):
        raise PlanError(
            "ds_ext.zero_topo.step.bits: 8 needs step.kind 'hierarchical' with the optimizer sharded over the world "
            f"(a cross-node reduce-scatter and all-gather); got kind {p['step']!r}, optimizer "
            f"{topo.levels[o].name!r}; allowed: 16 otherwise"
        )
    if cfg.quant_block_size % 2:
        raise PlanError(f"ds_ext.zero_topo.quant_block_size: must be even (got {cfg.quant_block_size})")
    return ShardingPlan(
        topology=topo,
        weights=w,
        gather_bits=p["wb"],
        secondary=s,
        secondary_bits=p["sb"],
        gradients=g,
        gradient_bits=p["gb"],
        gradient_hops=p["hops"],
        optimizer=o,
        step=p["step"],
        block_size=cfg.quant_block_size,
        step_bits=p["stb"],
        per_parameter_groups=cfg.quantization_groups == "per_parameter",
    )
