"""What ZeRO-topo combines with, checked before DeepSpeed or any collective runs.

ZeRO-topo (003 §V) is data parallelism over the whole world with its own sharding,
mixed precision and step; DeepSpeed runs underneath as a plain stage-0 engine. Every
setting it would otherwise ignore is refused here in one line that names the key and
the allowed values; the settings it implements are read by :func:`precision` and
:func:`optimizer_offload` (DeepSpeed's ``offload_optimizer`` section, 001 §3.3.2).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from deepspeed.moe.utils import is_moe_param
from torch import nn

from ds_ext.errors import DsExtConfigError
from ds_ext.integration import ds_fused_adam, ds_offload
from ds_ext.optim.tiled import TILEABLE

KEY = "ds_ext.zero_topo"
OFFLOAD_KEY = "zero_optimization.offload_optimizer"
# offload_optimizer fields whose only values here are DeepSpeed's defaults: NVMe (ZeRO-Infinity's
# swapper) and ZeRO-3-only settings, with why
_OFFLOAD_FIXED = {
    "nvme_path": "NVMe only",
    "buffer_count": "NVMe only",
    "pipeline_read": "NVMe only (ZeRO-Infinity's swap pipeline); the host step always overlaps its copies",
    "pipeline_write": "NVMe only (ZeRO-Infinity's swap pipeline); the host step always overlaps its copies",
    "fast_init": "NVMe only",
    "super_offload": "ZeRO-3 only in DeepSpeed",
    "cpuadam_cores_perc": "ZeRO-3 super_offload only; the host step runs on torch's intra-op threads",
}
_DTYPE_NAMES = {
    torch.float32: ("fp32", "float32"),
    torch.float16: ("fp16", "float16"),
    torch.bfloat16: ("bf16", "bfloat16"),
}


def _refuse(key: str, why: str, allowed: str, got: Any) -> None:
    raise DsExtConfigError(f"{key}: not supported with {KEY} ({why}); allowed: {allowed} (got {got!r})")


def _off(section: Mapping[str, Any], prefix: str, keys: tuple[str, ...], why: str) -> None:
    for k in keys:
        if section.get(k):
            _refuse(f"{prefix}.{k}" if prefix else k, why, "false", section[k])


def check_ds_config(ds_config: Mapping[str, Any], dtype: torch.dtype) -> None:
    """Refuse the DeepSpeed settings ZeRO-topo does not implement."""
    zero = ds_config.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    if stage != 0:
        _refuse("zero_optimization.stage", "it replaces DeepSpeed's ZeRO", "0", stage)
    optimizer_offload(ds_config)
    _off(
        ds_config.get("fp16") or {},
        "fp16",
        ("auto_cast", "fp16_master_weights_and_grads"),
        "it casts the model itself and keeps fp32 masters",
    )
    _off(
        ds_config.get("bf16") or {},
        "bf16",
        ("immediate_grad_update", "bf16_master_weights_and_grads", "bf16_optimizer_states"),
        "it keeps fp32 masters and moments and updates them at the step",
    )
    for k in ("amp", "torch_autocast"):
        if (ds_config.get(k) or {}).get("enabled"):
            _refuse(f"{k}.enabled", "it runs the model in the dtype of the fp16 / bf16 section", "false", True)
    _off(
        ds_config,
        "",
        ("prescale_gradients", "sparse_gradients"),
        "it divides dense gradients by the world size before reducing them",
    )
    predivide = ds_config.get("gradient_predivide_factor", 1.0)
    if predivide != 1.0:
        _refuse(
            "gradient_predivide_factor", "it divides gradients by the world size before reducing them", "1.0", predivide
        )
    if ds_config.get("communication_data_type") is not None:
        _refuse(
            "communication_data_type",
            "its wire formats are ds_ext.zero_topo weights.gather_bits and gradients.bits",
            "unset",
            ds_config["communication_data_type"],
        )
    accum = (ds_config.get("data_types") or {}).get("grad_accum_dtype")
    if accum is not None and accum not in _DTYPE_NAMES[dtype]:
        _refuse(
            "data_types.grad_accum_dtype",
            "it accumulates gradient shards in the training dtype",
            f"unset or {_DTYPE_NAMES[dtype][0]!r}",
            accum,
        )


def optimizer_offload(ds_config: Mapping[str, Any]) -> bool | None:
    """``pin_memory`` of the optimizer offload the ds_config asks for, None without (the
    ``zero_optimization`` section read by DeepSpeed's own model, ``ds_ext.integration.ds_offload``:
    the deprecated ``cpu_offload`` too). Refuses parameter offload and what the host step does
    not implement, in one line naming the key."""
    sections = ds_offload.read(ds_config.get("zero_optimization") or {})
    param = sections.param["device"]
    if param != "none":
        _refuse(
            "zero_optimization.offload_param.device",
            "it keeps the weight shards on the device; only the optimizer state is offloaded",
            "'none'",
            param,
        )
    opt = sections.optimizer
    if opt["device"] == "none":
        return None
    if opt["device"] != "cpu":
        _refuse(f"{OFFLOAD_KEY}.device", "it offloads the optimizer to host memory", "'none' or 'cpu'", opt["device"])
    for key, why in _OFFLOAD_FIXED.items():
        if key in sections.optimizer_set and opt[key] != sections.optimizer_defaults[key]:
            _refuse(f"{OFFLOAD_KEY}.{key}", why, repr(sections.optimizer_defaults[key]), opt[key])
    return bool(opt["pin_memory"])


def check_offload_optimizer(optimizer: Any, ds_config: Mapping[str, Any]) -> None:
    """With optimizer offload, the optimizer the host step can run: torch's Adam / AdamW (its
    arithmetic, tiled by ``ds_ext.optim.tiled``), as the client's instance or as the ds_config
    section with ``"torch_adam": true`` (without it DeepSpeed builds FusedAdam, a device kernel).
    A callable is checked on what it built (``attach``)."""
    allowed = 'torch.optim.Adam / AdamW, or a ds_config optimizer of type Adam / AdamW with "torch_adam": true'
    why = "its host step runs torch's Adam/AdamW arithmetic in tiles"
    if isinstance(optimizer, torch.optim.Optimizer):
        if not isinstance(optimizer, TILEABLE) or ds_fused_adam.is_fused_adam(optimizer):
            _refuse(OFFLOAD_KEY, why, allowed, type(optimizer).__name__)
    elif optimizer is None:
        section = ds_config.get("optimizer") or {}
        kind = str(section.get("type", "")).lower()
        if kind not in ("adam", "adamw") or not (section.get("params") or {}).get("torch_adam", False):
            _refuse(OFFLOAD_KEY, why, allowed, f"optimizer type {section.get('type')!r}")


def check_model(model: nn.Module, experts: bool, pipeline: bool) -> None:
    """Refuse Megatron's sequence-parallel parameters, and MoE expert parameters unless the job's
    layout has an expert-data group to shard them over (``experts``: TED) and the form is not the
    pipeline one."""
    parallel = [n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)]
    if parallel:
        _refuse(
            "model",
            f"sequence parallelism: parameters such as {parallel[0]!r} are marked sequence_parallel, "
            "their gradients partial sums over the tensor group that Megatron all-reduces outside DeepSpeed",
            "tensor parallelism without --sequence-parallel",
            f"{len(parallel)} such parameters",
        )
    found = [n for n, p in model.named_parameters() if is_moe_param(p)]
    if found and pipeline:
        _refuse(
            "model",
            f"MoE expert parameters such as {found[0]!r} in a pipeline stage",
            "dense PipelineModules in the pipeline form",
            f"{len(found)} expert parameters",
        )
    if found and not experts:
        _refuse(
            "model",
            f"DeepSpeed-MoE expert parameters (allreduce=False) such as {found[0]!r}: the job's layout "
            "names no expert-data group to shard them over",
            "dense models, or MoE through ds_ext.ted",
            f"{len(found)} expert parameters",
        )


def check_optimizer(optimizer: Any, ds_config: Mapping[str, Any]) -> str | None:
    """Where the optimizer comes from, as DeepSpeed decides it (engine.py
    ``_configure_optimizer``): the client's instance or callable wins over a ds_config
    ``optimizer`` section (returned: a line saying so), else DeepSpeed builds it from the
    section (Adam / AdamW / ``torch_adam`` / ``adam_w_mode``; FusedAdam where the
    accelerator has it). ZeRO-topo shards the state of whichever it is; with neither,
    there is nothing to shard and it refuses."""
    section = ds_config.get("optimizer")
    if optimizer is None and section is None:
        _refuse(
            "optimizer",
            "it shards an optimizer's state and got none",
            "a torch.optim.Optimizer (or a "
            "callable building one) passed as optimizer=..., or a ds_config 'optimizer' section",
            None,
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer) and not callable(optimizer):
        _refuse(
            "optimizer",
            "it shards the state of a torch optimizer",
            "a torch.optim.Optimizer, a callable building one, or a ds_config 'optimizer' section",
            type(optimizer).__name__,
        )
    if optimizer is not None and section is not None:
        return (
            f"{KEY}: the client optimizer ({type(optimizer).__name__}) is used and the ds_config 'optimizer' "
            f"section (type {section.get('type')!r}) is not, as in DeepSpeed"
        )
    return None
