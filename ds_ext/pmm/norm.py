"""Global gradient norm of a converted model (each distinct shard counted once).

Linear shards (and the vocabulary-parallel tables, laid out as linear weights) are distinct
on every tensor rank; Y-split parameters (norms) are replicated over X and Z and count on
the ranks with x = z = 0; biases of a
normal (transposed) layer are replicated over Y (X) and Z. After the data-parallel
reduction gradients agree across ``data``, so the norm needs the tensor group only.
"""

from __future__ import annotations

import torch
from torch import nn

from ds_ext.comm.collectives import backend_device
from ds_ext.pmm.grid import Axis


def replicated_over(param: nn.Parameter) -> tuple[str, ...]:
    """Tensor axes over which ``param`` holds the same values on every rank."""
    if getattr(param, "pmm_sharded", False):
        return ()
    return getattr(param, "pmm_replicated_over", ("x", "y", "z"))


def owns(param: nn.Parameter, axes: dict[str, Axis]) -> bool:
    """Whether this rank is the one that counts ``param``'s shard."""
    return all(axes[a].rank == 0 for a in replicated_over(param))


def global_grad_norm(model: nn.Module, axes: dict[str, Axis], comm) -> float:
    """L2 norm of all gradients of the (serial-equivalent) model."""
    params = [p for p in model.parameters() if p.grad is not None and owns(p, axes)]
    sq = torch.zeros((), dtype=torch.float64, device=backend_device(axes["tensor"].group))
    for p in params:
        sq += p.grad.detach().double().pow(2).sum().to(sq.device)
    if axes["tensor"].size > 1:
        comm.all_reduce(sq, group=axes["tensor"].group)
    return float(sq.sqrt())
