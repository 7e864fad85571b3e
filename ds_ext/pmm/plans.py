"""Conversion plans: which linear layers of a model family are normal and which transposed.

A plan names each ``nn.Linear`` by the last component of its qualified name and gives its
style (001 §5.1.1: a layer reading the residual stream is normal, one writing it back is
transposed), the untied LM head if any, and the attention-head counts that X must divide
(heads are split over X, with the out-features of the projections that produce them).
Built in: ds_ext's GPT, Hugging Face ``GPTNeoXForCausalLM`` and ``LlamaForCausalLM``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from ds_ext.pmm.layout import ConversionError


@dataclass(frozen=True)
class LinearStyle:
    transposed: bool = False
    out_chunks: int = 1  # stacked out blocks split one by one (fused q|k|v, t-major)


NORMAL = LinearStyle()
TRANSPOSED = LinearStyle(transposed=True)


@dataclass(frozen=True)
class Plan:
    """How :func:`ds_ext.pmm.parallelize` converts one model family."""

    family: str
    linears: dict[str, LinearStyle]
    head: str | None = None  # qualified name of the LM head nn.Linear
    tied_head: str | None = None  # or: the embedding whose table is the head (ds_ext GPT)
    positions: tuple[str, ...] = ()  # embeddings looked up by position ids [s], not per token (ds_ext GPT's pos)
    heads: dict[str, int] = field(default_factory=dict)  # what X must divide, e.g. {"n_heads": 8}
    dropout: dict[str, float] = field(default_factory=dict)  # must all be 0 (replicas share no RNG)
    adapt: Callable[[nn.Module, Any], None] | None = None  # family-specific finish (after conversion)


def _gpt_plan(model: nn.Module) -> Plan:
    from ds_ext.pmm.gpt import adapt_gpt

    cfg = model.cfg
    return Plan(
        family="ds_ext GPT",
        linears={"qkv": LinearStyle(out_chunks=3), "proj": TRANSPOSED, "fc1": NORMAL, "fc2": TRANSPOSED},
        tied_head="embed",
        positions=("pos",),
        heads={"GPTConfig.n_heads": cfg.n_heads},
        dropout={"GPTConfig.dropout": cfg.dropout},
        adapt=adapt_gpt,
    )


def _neox_plan(model: nn.Module) -> Plan:
    cfg = model.config
    return Plan(
        family="GPTNeoXForCausalLM",
        linears={"query_key_value": NORMAL, "dense": TRANSPOSED, "dense_h_to_4h": NORMAL, "dense_4h_to_h": TRANSPOSED},
        head="lm_head",
        heads={"num_attention_heads": cfg.num_attention_heads},
        dropout={"attention_dropout": cfg.attention_dropout, "hidden_dropout": cfg.hidden_dropout},
    )


def _llama_plan(model: nn.Module) -> Plan:
    cfg = model.config
    return Plan(
        family="LlamaForCausalLM",
        linears={
            "q_proj": NORMAL,
            "k_proj": NORMAL,
            "v_proj": NORMAL,
            "o_proj": TRANSPOSED,
            "gate_proj": NORMAL,
            "up_proj": NORMAL,
            "down_proj": TRANSPOSED,
        },
        head="lm_head",
        heads={"num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads},
        dropout={"attention_dropout": cfg.attention_dropout},
    )


_PLANS: dict[str, Callable[[nn.Module], Plan]] = {
    "GPT": _gpt_plan,
    "GPTNeoXForCausalLM": _neox_plan,
    "LlamaForCausalLM": _llama_plan,
}


def plan_for(model: nn.Module) -> Plan:
    """The built-in plan of ``model``'s class; one line naming the supported ones otherwise."""
    builder = _PLANS.get(type(model).__name__)
    if builder is None:
        raise ConversionError(
            f"ds_ext.pmm.parallelize: no plan for {type(model).__name__}; built-in plans: "
            f"{', '.join(_PLANS)} (or pass plan=ds_ext.pmm.Plan(...))"
        )
    return builder(model)
