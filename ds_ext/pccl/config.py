"""``"ds_ext": {"pccl": {...}}``: the PCCL plugin's section (no torch: ``ds-ext schema``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ds_ext.plugin import PluginConfig


class PCCLConfig(PluginConfig):
    """``"ds_ext": {"pccl": {...}}``."""

    algorithm: Literal["pccl", "ring", "auto"] = Field(
        "pccl",
        description="Algorithm for DeepSpeed's all-gathers / reduce-scatters: 'pccl' (001 §6.2), 'ring', or 'auto' "
        "(pccl where ds_ext.perf.collectives predicts it faster than a ring, per call, else DeepSpeed's own).",
    )
