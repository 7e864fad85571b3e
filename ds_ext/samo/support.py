"""What SAMO combines with, checked before DeepSpeed or any collective runs (001 ch. 4).

SAMO takes over DeepSpeed's mixed precision, gradient all-reduce, clipping and optimizer step,
so DeepSpeed runs underneath as a plain stage-0 engine (or PipelineEngine). It runs in data
parallelism (ZeRO stage 0) and on DeepSpeed's PipelineEngine (001 §4.2.2's inter-layer
parallelism), with ZeRO stage 1 (compressed optimizer shards, also on the PipelineEngine) and
ZeRO stage 2 (the compressed gradients sharded too, reduced in ``reduce_bucket_size`` buckets
during backward, :mod:`ds_ext.samo.zero2`; like DeepSpeed, not with a PipelineModule, and with
``overlap_comm`` off), with torch's Adam / AdamW or DeepSpeed's FusedAdam, fp32, fp16
(DeepSpeed's loss scaler) or bf16, gradient accumulation and clipping, and beside the tiled
optimizer (001 §7.2: SAMO's step runs in its tiles, :mod:`ds_ext.samo.tiled`, at every stage SAMO
runs; its own refusals apply). Everything else is refused here in one line naming both settings
and what is allowed.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from ds_ext.errors import DsExtConfigError
from ds_ext.integration import ds_engine, ds_fused_adam
from ds_ext.samo.config import KEY

COMPOSES = ("tiled_optimizer",)  # the ds_ext plugins SAMO runs beside
ALLOWED_OPTIMIZERS = "torch.optim.Adam, torch.optim.AdamW, deepspeed.ops.adam.FusedAdam"


def _refuse(key: str, why: str, allowed: str, got: Any) -> None:
    raise DsExtConfigError(f"{KEY} with {key} {got!r}: {why}; allowed: {allowed}")


def check_plugins(plugins: list[Any]) -> None:
    """Every other ds_ext plugin but ``COMPOSES`` is refused (README's matrix)."""
    for plugin in plugins:
        if plugin.name != "samo" and plugin.name not in COMPOSES:
            _refuse(
                f"ds_ext.{plugin.name}.enabled",
                "SAMO owns the gradient all-reduce and the optimizer step and runs beside no other ds_ext plugin but "
                "ds_ext.tiled_optimizer",
                f"ds_ext.{plugin.name}.enabled false",
                True,
            )


def check_layout(tensor: int, source: str) -> None:
    """Tensor parallelism (a caller's Megatron mpu) is refused: its norm and replicated parameters
    are not handled."""
    if tensor > 1:
        _refuse(
            f"tensor parallel size (from {source})",
            "the compressed step counts every parameter once over data and pipeline ranks only",
            "tensor parallel 1 (data parallelism, a deepspeed.pipe.PipelineModule)",
            tensor,
        )


def check_ds_config(ds_config: Mapping[str, Any], dtype: torch.dtype) -> int:
    """Refuse the DeepSpeed settings SAMO does not implement; the ZeRO stage SAMO runs (0; 1: the
    compressed optimizer state sharded over the data-parallel ranks; 2: the compressed gradients too)."""
    zero = ds_config.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2):
        _refuse(
            "zero_optimization.stage",
            "SAMO shards the compressed optimizer state (stage 1) and the compressed gradients (stage 2) but keeps "
            "the dense 16-bit weights whole on every data-parallel rank",
            "0, 1, 2",
            stage,
        )
    if stage == 2 and zero.get("overlap_comm"):
        _refuse(
            "zero_optimization.overlap_comm",
            "SAMO's ZeRO-2 reduces each bucket of compressed gradients in the backward hook, on the compute stream",
            "false",
            True,
        )
    if stage in (1, 2) and zero.get("reduce_scatter", True) is False:
        _refuse(
            "zero_optimization.reduce_scatter",
            "SAMO reduce-scatters the compressed gradients into the data-parallel shards",
            "true (DeepSpeed's default)",
            False,
        )
    for key in ("amp", "torch_autocast"):
        if (ds_config.get(key) or {}).get("enabled"):
            _refuse(f"{key}.enabled", "SAMO runs the model in the dtype of the fp16 / bf16 section", "false", True)
    for section, keys in (
        ("fp16", ("auto_cast", "fp16_master_weights_and_grads")),
        ("bf16", ("immediate_grad_update", "bf16_master_weights_and_grads", "bf16_optimizer_states")),
    ):
        for k in keys:
            if (ds_config.get(section) or {}).get(k):
                _refuse(f"{section}.{k}", "SAMO keeps compressed fp32 masters and moments", "false", True)
    for k in ("prescale_gradients", "sparse_gradients"):
        if ds_config.get(k):
            _refuse(k, "SAMO all-reduces the compressed gradients and averages after the sum", "false", True)
    predivide = ds_config.get("gradient_predivide_factor", 1.0)
    if predivide != 1.0:
        _refuse("gradient_predivide_factor", "SAMO averages after the all-reduce", "1.0", predivide)
    if ds_config.get("communication_data_type") is not None:
        _refuse(
            "communication_data_type",
            "SAMO all-reduces the compressed gradients in the training dtype",
            "unset",
            ds_config["communication_data_type"],
        )
    accum = (ds_config.get("data_types") or {}).get("grad_accum_dtype")
    if (
        accum is not None
        and accum not in {torch.float32: ("fp32",), torch.float16: ("fp16",), torch.bfloat16: ("bf16",)}[dtype]
    ):
        _refuse(
            "data_types.grad_accum_dtype", "SAMO accumulates compressed gradients in the training dtype", "unset", accum
        )
    return stage


def check_pipeline_stage(model: nn.Module, stage: int) -> None:
    """ZeRO-2 beside a ``deepspeed.pipe.PipelineModule`` is refused as DeepSpeed's PipelineEngine
    refuses it (0.19.8 runtime/pipe/engine.py: "ZeRO-2 and ZeRO-3 are incompatible with pipeline
    parallelism")."""
    if stage >= 2 and ds_engine.pipeline_grid(model) is not None:
        _refuse(
            "zero_optimization.stage",
            "with a deepspeed.pipe.PipelineModule, ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism "
            "(DeepSpeed's PipelineEngine)",
            "0, 1 with a PipelineModule",
            stage,
        )


def check_optimizer(optimizer: Any, ds_config: Mapping[str, Any]) -> None:
    """A client torch Adam / AdamW / FusedAdam, or a ds_config ``optimizer`` section of type Adam /
    AdamW (DeepSpeed builds it: FusedAdam, or torch's with ``torch_adam``)."""
    if optimizer is None:
        section = ds_config.get("optimizer")
        if section is None:
            _refuse("optimizer", "SAMO compresses an optimizer's state and got none", ALLOWED_OPTIMIZERS, None)
        if str(section.get("type", "")).lower() not in ("adam", "adamw"):
            _refuse(
                "ds_config optimizer.type",
                "SAMO's compressed step is run for Adam",
                "'Adam', 'AdamW'",
                section.get("type"),
            )
        return
    if not (isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) or ds_fused_adam.is_fused_adam(optimizer)):
        _refuse(
            "optimizer",
            "SAMO's compressed step is run for Adam (001 §4.1.4)",
            ALLOWED_OPTIMIZERS,
            type(optimizer).__name__,
        )


def check_model(model: nn.Module) -> None:
    """Refuse DeepSpeed-MoE experts and a PipelineModule's tied weights (DeepSpeed all-reduces
    their dense gradients over the stages holding them, which SAMO has already compressed)."""
    from deepspeed.moe.utils import is_moe_param

    experts = [n for n, p in model.named_parameters() if is_moe_param(p)]
    if experts:
        _refuse(
            "a deepspeed.moe expert parameter",
            "expert parameters are reduced over their expert-data group, which SAMO does not do",
            "dense models",
            experts[0],
        )
    tied = ds_engine.pipeline_tied_keys(model)
    if tied:
        _refuse(
            "deepspeed.pipe.TiedLayerSpec",
            "DeepSpeed reduces the dense gradients of tied weights over their stages",
            "a PipelineModule without tied layers",
            tied[0],
        )
