"""DeepSpeed touch points of 3D-PMM (attribute names read in DeepSpeed 0.19.8).

Behind the version gate of :mod:`ds_ext.integration.ds_version`.

DeepSpeed sums squared gradient norms over the mpu's model-parallel group, counting a
parameter on every rank if ``deepspeed.runtime.utils.is_model_parallel_parameter`` holds
(attribute ``model_parallel``) and otherwise only on model-parallel rank 0. 3D-PMM has
three kinds of parameters: Linear shards (distinct on every tensor rank; the vocabulary-parallel
tables too), Y-split ones (norms: distinct over Y, replicated over X and Z) and, with G_y = 1,
replicas. :func:`mark_parameters` flags each distinct shard on exactly one rank, so the
norm DeepSpeed computes (and clips with) is the serial model's (the rule, ``ds_ext.pmm.norm.owns``,
comes from the plugin above).
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from ds_ext.integration.ds_version import check_version

check_version()


def mark_parameters(model: nn.Module, owns: Callable[[nn.Parameter], bool]) -> None:
    """Set DeepSpeed's ``model_parallel`` flag on the ranks that own each distinct shard (``owns``)."""
    for p in model.parameters():
        p.model_parallel = owns(p)


def optimizer_state_bytes(engine) -> int:
    """Bytes of optimizer state one rank holds: fp32 master copies (ZeRO-1/2:
    ``single_partition_of_fp32_groups``; 16-bit stage 0: ``fp32_groups``) plus the torch
    optimizer's state tensors."""
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    state = sum(nbytes(v) for st in inner.state.values() for v in st.values() if getattr(v, "dim", lambda: 0)())
    masters = getattr(opt, "single_partition_of_fp32_groups", None)
    if masters is None:
        masters = [t for group in getattr(opt, "fp32_groups", []) for t in group]
    return state + sum(nbytes(t) for t in masters)


def optimized_parameters(engine) -> list:
    """The model parameters DeepSpeed's optimizer updates (ZeRO-1/2: ``bit16_groups``;
    16-bit stage 0: ``fp16_groups``; otherwise the torch optimizer's param groups)."""
    opt = engine.optimizer
    for attr in ("bit16_groups", "fp16_groups"):
        groups = getattr(opt, attr, None)
        if groups is not None:
            return [p for g in groups for p in g]
    return [p for g in opt.param_groups for p in g["params"]]


def torch_optimizer(engine):
    """The torch optimizer holding the model's parameters themselves (fp32, no ZeRO: DeepSpeed
    uses the client optimizer as ``engine.optimizer``), or None (ZeRO / 16-bit wrappers keep
    flat partitions of their own)."""
    import torch

    opt = engine.optimizer
    return opt if isinstance(opt, torch.optim.Optimizer) else None


def step_counters(engine) -> dict[str, int]:
    """DeepSpeed's ``global_steps`` and ``global_samples`` (engine.py)."""
    return {"global_steps": int(engine.global_steps), "global_samples": int(engine.global_samples)}


def set_step_counters(engine, counters: dict[str, int]) -> None:
    engine.global_steps = counters["global_steps"]
    engine.global_samples = counters["global_samples"]
