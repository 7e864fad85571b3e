"""``ds_ext.ted``'s section (001 §7.1, §7.3), apart from the plugin so that the config schema
(``ds-ext schema``) imports no torch."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ds_ext.plugin import PluginConfig


class TEDConfig(PluginConfig):
    """``ds_ext.ted`` (001 §7.1, §7.3)."""

    tensor_parallel: int = Field(
        1,
        ge=1,
        description="G_tensor: tensor-parallel degree of expert and non-expert blocks (at most the ranks of a node).",
    )
    expert_parallel: int = Field(
        1,
        ge=1,
        description="G_expert: ranks an MoE layer's experts are spread "
        "over (TED: = num_experts; any divisor of num_experts works).",
    )
    expert_data_parallel: int | None = Field(
        None, ge=1, description="G_data^exp; omit to infer it from the world size (Eq 7.1)."
    )
    num_experts: int | None = Field(
        None, ge=1, description="Experts per MoE layer; every TEDMoE must have it (omit to take the layers' own)."
    )
    top_k: int | None = Field(None, ge=1, description="Routes per token; every TEDMoE must have it.")
    capacity_factor: float | None = Field(
        None, gt=0, description="Training capacity factor; every TEDMoE must have it."
    )
    duplicate_token_dropping: bool = Field(
        True, description="DTD (001 §7.3.1): drop the tensor group's duplicate tokens around each all-to-all."
    )
    comm_aware_checkpointing: bool = Field(
        True,
        description="CAC (001 §7.3.2): activation-checkpoint recomputes reuse the first forward's collective outputs.",
    )
    cac_stash: Literal["full", "lean"] = Field(
        "lean",
        description="What CAC (001 §7.3.2) keeps for the "
        "recompute: lean (default) = every forward collective's output "
        "except the all-to-all outputs that only feed DTD's all-gather "
        "(the recompute replays the gathered tensor); full = every "
        "output. Same calls, same bits; lean holds less.",
    )
    seed: int = Field(
        1234,
        ge=0,
        lt=2**32,
        description="Seed of the gates' noise and random token selection "
        "(0 <= seed < 2^32: the gates seed torch generators modulo 2^32, so a larger seed would "
        "repeat a smaller one's draws).",
    )

    @model_validator(mode="after")
    def _experts_divisible(self) -> "TEDConfig":
        if self.num_experts is not None and self.num_experts % self.expert_parallel:
            raise ValueError(
                f"num_experts {self.num_experts} is not a multiple of expert_parallel "
                f"{self.expert_parallel} (E = k x G_expert)"
            )
        return self

    @model_validator(mode="after")
    def _top_k_within_experts(self) -> "TEDConfig":
        if self.top_k is not None and self.num_experts is not None and self.top_k > self.num_experts:
            raise ValueError(
                f"top_k {self.top_k} exceeds num_experts {self.num_experts} (each route picks a distinct "
                f"expert); allowed top_k: 1..{self.num_experts}"
            )
        return self
