"""DeepSpeed's ``FusedAdam`` (``deepspeed.ops.adam.FusedAdam``) run one tile at a time (001 §7.2).

Touch points (DeepSpeed 0.19.8, ``deepspeed/ops/adam/fused_adam.py``): the kernel handle
``optimizer.multi_tensor_adam`` with ``_dummy_overflow_buf`` and ``adam_w_mode``, called through
``multi_tensor_applier`` exactly as ``FusedAdam.step`` calls it; the per-parameter state it
creates (``step`` an int, ``exp_avg``, ``exp_avg_sq``); and its step rule: ``FusedAdam.step``
raises the ``step`` of the group's *last* parameter with a gradient and uses that value for
every parameter of the group. The kernel is elementwise (CUDA: one thread per element; CPU:
the AVX loop of ``cpu_adam_impl.cpp`` with a scalar tail), so tiles of whole 64-byte lines
give the bits of the whole tensor (``tests/test_tiled_optimizer.py``).
"""

from __future__ import annotations

from typing import Any

import torch

FUSED_ADAM = "deepspeed.ops.adam.fused_adam.FusedAdam"


def is_fused_adam(optimizer: Any) -> bool:
    """Whether ``optimizer`` is DeepSpeed's FusedAdam (or a subclass); imports nothing."""
    return any(f"{c.__module__}.{c.__qualname__}" == FUSED_ADAM for c in type(optimizer).__mro__)


def state(optimizer: Any, p: torch.Tensor, group: dict) -> dict:
    """``p``'s state, created as ``FusedAdam.step`` creates it."""
    st = optimizer.state[p]
    if len(st) == 0:
        st["step"] = group.get("step", 0)
        st["exp_avg"] = torch.zeros_like(p.data)
        st["exp_avg_sq"] = torch.zeros_like(p.data)
    return st


def apply(
    optimizer: Any, group: dict, step: int, grad: torch.Tensor, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor
) -> None:
    """One FusedAdam kernel call on a tile (fp32 ``grad``, ``p``, ``m``, ``v`` of equal length)."""
    from deepspeed.ops.adam.fused_adam import multi_tensor_applier

    beta1, beta2 = group["betas"]
    multi_tensor_applier(
        optimizer.multi_tensor_adam,
        optimizer._dummy_overflow_buf,
        [[grad], [p], [m], [v]],
        group["lr"],
        beta1,
        beta2,
        group["eps"],
        step,
        optimizer.adam_w_mode,
        1 if group["bias_correction"] else 0,
        group["weight_decay"],
    )
