"""The expert stage of a TED MoE layer (001 Fig 7.3 ❺ ❻): this rank's experts on their slots.

Sharding contract (P = G_expert, k local experts, C' slots, H hidden, T = G_tensor):
:meth:`Experts.forward` takes ``[P, k, C', H]`` (for each expert rank, the slots it sent to
each of my k experts) and returns their outputs in the same layout.

* experts split over the tensor group by TED (``Experts.tensor_parallel`` set): input replicated
  over the tensor group; column-parallel fc1, activation, row-parallel fc2 of each expert (its
  t-th shard), one *f* and one *g* for all k experts (❻ is one all-reduce per layer); output
  replicated over the tensor group;
* otherwise each expert runs whole on its slots (a client-built tensor-parallel expert runs its
  own collectives over Megatron's tensor group).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ds_ext.comm.mappings import copy_to_region, reduce_from_region
from ds_ext.integration import ds_moe
from ds_ext.moe.cac import Frame
from ds_ext.moe.context import TEDContext
from ds_ext.moe.tensor_parallel import mlp_partial


def run_mlp(mlp: nn.Module, x: torch.Tensor, tensor_parallel: TEDContext | None, frame: Frame) -> torch.Tensor:
    """One expert (or a residual MLP) on tokens replicated over the tensor group; replicated output.
    ``tensor_parallel``: the TED context when TED sliced ``mlp`` over its tensor group."""
    if tensor_parallel is None:
        out = mlp(x)
        return out[0] if isinstance(out, tuple) else out
    comm, group = tensor_parallel.comm, tensor_parallel.groups.tensor
    y = reduce_from_region(mlp_partial(mlp, copy_to_region(x, comm, group)), comm, group, frame)
    return y if mlp[2].bias is None else y + mlp[2].bias


class Experts(nn.Module):
    """This rank's experts, under DeepSpeed's attribute name and parameter marks (see module)."""

    def __init__(self, expert: nn.Module, num_local_experts: int, group_name: str) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(copy.deepcopy(expert) for _ in range(num_local_experts))
        ds_moe.mark_expert_params(self.deepspeed_experts.parameters(), group_name)
        self.tensor_parallel: TEDContext | None = None  # set when TED slices the experts

    def forward(self, x: torch.Tensor, frame: Frame) -> torch.Tensor:
        """``[P, k, C', H]`` slots of the k local experts -> their outputs, same shape."""
        experts, ted = self.deepspeed_experts, self.tensor_parallel
        if ted is None:
            # [P, C', H] contiguous: Megatron's linear layers view their input as [s, b, h]
            return torch.stack([run_mlp(e, x[:, i].contiguous(), None, frame) for i, e in enumerate(experts)], dim=1)
        comm, group = ted.comm, ted.groups.tensor
        x = copy_to_region(x, comm, group)
        partial = torch.stack([mlp_partial(e, x[:, i]) for i, e in enumerate(experts)], dim=1)
        y = reduce_from_region(partial, comm, group, frame)
        if experts[0][2].bias is None:
            return y
        return y + torch.stack([e[2].bias for e in experts])[None, :, None, :]
