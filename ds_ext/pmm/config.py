"""``"ds_ext": {"pmm3d": {...}}``: the 4D grid, overlap switches and matmul tuning (001 ch. 5)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ds_ext.config_base import ConfigSection
from ds_ext.plugin import PluginConfig

KEY = "ds_ext.pmm3d"


class GridConfig(ConfigSection):
    """Degrees of the 4D grid; their product is the world size (001 §5.1.1)."""

    x: int = Field(1, ge=1, description="G_x: innermost tensor axis (splits out-features of normal layers).")
    y: int = Field(1, ge=1, description="G_y: tensor axis splitting in-features of normal layers.")
    z: int = Field(1, ge=1, description="G_z: shards weights (all-gather) and splits the batch rows.")
    data: int = Field(1, ge=1, description="G_data: data parallelism, outermost, through DeepSpeed.")


class OverlapConfig(ConfigSection):
    """Non-blocking collectives overlapped with computation (001 §5.1.4)."""

    all_reduce: bool = Field(
        True,
        description="OAR: the backward all-reduce of dL/dI overlaps the weight-gradient matmul (on by default, "
        "as in AxoNN's optimize_communication and megatron-core's column-parallel backward; bit-identical results).",
    )
    reduce_scatter: bool = Field(
        False, description="ORS: weight-gradient reduce-scatters are waited once, after every layer's backward."
    )
    all_gather: bool = Field(
        False,
        description="OAG: each layer prefetches the next layer's weight all-gather, in the order "
        "recorded during the first step (activation-checkpoint recomputes included).",
    )


class Pmm3dConfig(PluginConfig):
    """``ds_ext.pmm3d``: AxoNN's 4D hybrid parallelism (001 ch. 5, 000 §V)."""

    grid: GridConfig | Literal["auto"] = Field(
        "auto",
        description="{'x','y','z','data'} degrees, or 'auto': the factorization ds_ext.perf.pmm ranks first "
        "(Eqs 5.1-5.7) among those that divide the model and fit memory_per_rank_GB.",
    )
    overlap: OverlapConfig = Field(default_factory=OverlapConfig)
    tables: Literal["vocab_parallel", "replicated"] = Field(
        "vocab_parallel",
        description="Embedding tables and the LM head: 'vocab_parallel' (rows over X, Megatron-LM's "
        "VocabParallelEmbedding: the lookup and the head's input gradient all-reduced over X, the loss "
        "reduced over X) or 'replicated' over X (every X rank holds all rows of its feature block: none "
        "of those reductions, G_x times the tables' memory and head matmul; cheaper when the vocabulary "
        "is small next to d_model, see ds_ext.perf.pmm).",
    )
    tune_matmul: bool = Field(
        False,
        description="Time every matmul call site in NN/NT/TN/transposed-product form during the first "
        "step and keep the fastest (001 §5.1.3).",
    )
    memory_per_rank_GB: float | None = Field(
        None,
        gt=0,
        description="With grid 'auto': drop factorizations whose model states exceed this per rank.",
    )
    ledger_by_layer: bool = Field(
        False,
        description="Record each converted layer's collectives under the ledger phase "
        "'<phase>/<layer name>' (compared per layer with ds_ext.perf.pmm).",
    )
