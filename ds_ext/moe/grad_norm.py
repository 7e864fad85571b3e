"""The global gradient norm of a TED model and clipping by it (001 §7.1; spec §1.10).

Under TED a parameter's gradient lives on several ranks of one data-parallel replica, the
T x P block of a tensor group times an expert group (T = G_tensor, P = G_expert), and is
replicated or split there according to its kind:

  kind (marks)                                   copies in the block   weight of its sum of squares
  non-expert, whole (attention bias, gate, ...)  T P                   1 / (T P)
  non-expert, tensor-parallel                    P (one per slice)     1 / P
  expert (``allreduce=False``), whole            T                     1 / T
  expert, tensor-parallel                        1                     1

Each rank sums weight x ||g||^2 over its parameters; an all-reduce over the tensor group, one
over the expert group and, on a PipelineEngine, one over the pipeline stages give every rank
||g||^2 of the whole model, each parameter counted once (after data-parallel averaging every
data replica holds the same gradients; a tied weight's copy on a later stage, DeepSpeed's
``ds_pipe_replicated``, is left out).
DeepSpeed's stage-0 clipping (``clip_grad_norm_`` with the mpu) cannot weigh expert
parameters this way, so the ``ted`` plugin clips with :func:`clip_` instead.
"""

from __future__ import annotations

from typing import Iterable

import torch
from deepspeed.moe.utils import is_moe_param

from ds_ext.moe.context import TEDContext


def _weight(p: torch.nn.Parameter, T: int, P: int) -> float:
    expert = is_moe_param(p)
    sliced = getattr(p, "tensor_model_parallel", False) and T > 1
    return (1.0 if sliced else 1.0 / T) * (1.0 if expert else 1.0 / P)


def global_grad_norm(params: Iterable[torch.nn.Parameter], ted: TEDContext) -> torch.Tensor:
    """||g||_2 over the whole model (module docstring); collective over the T x P block."""
    T, P = ted.layout.tensor, ted.layout.expert
    grads = [
        (p.grad.detach(), _weight(p, T, P))
        for p in params
        if p.grad is not None and not getattr(p, "ds_pipe_replicated", False)
    ]
    total = torch.zeros(1, dtype=torch.float32, device=grads[0][0].device if grads else None)
    for g, w in grads:
        total += w * g.float().pow(2).sum()
    for group in (ted.groups.tensor, ted.groups.expert, ted.groups.pipeline):
        if group is not None and ted.comm.size(group) > 1:
            ted.comm.all_reduce(total, group=group)
    return total.sqrt()[0]


def clip_(params: Iterable[torch.nn.Parameter], max_norm: float, ted: TEDContext) -> float:
    """Scale every gradient by min(1, max_norm / (norm + 1e-6)) (torch's and DeepSpeed's
    ``clip_grad_norm_`` rule) with the global norm; returns the norm."""
    params = [p for p in params if p.grad is not None]
    norm = float(global_grad_norm(params, ted))
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for p in params:
            p.grad.detach().mul_(coef)
    return norm
