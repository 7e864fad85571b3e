"""Megatron 1-D tensor parallelism over TED's tensor group (001 §7.1, Megatron-LM [39]).

Layers are built whole (``nn.Linear``: same initialization and state-dict keys as a serial
model) and sliced in place when ``ds_ext.initialize`` binds them to a TED layout, the way
Megatron's CPU initialization slices one master weight (``_initialize_affine_weight_cpu``).
Unbound, they are ordinary ``nn.Linear`` layers.

Sharding contracts (T = G_tensor, t = tensor rank):

* :class:`ColumnParallelLinear` ``[out, in]``: rank t keeps output rows
  ``[t out/T, (t+1) out/T)`` of the weight and bias. Input replicated over the tensor group
  (*f*: its gradient is all-reduced in backward); output split along the last dim.
* :class:`RowParallelLinear` ``[out, in]``: rank t keeps input columns ``[t in/T, (t+1) in/T)``;
  the bias stays whole. Input split along the last dim; the partial products are
  all-reduced (*g*, 001 Fig 7.3 ❷) and the bias added: output replicated.

Sliced parameters carry Megatron's ``tensor_model_parallel`` / ``partition_dim`` marks, which
DeepSpeed reads to count each of them once in the global gradient norm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ds_ext.comm.mappings import copy_to_region, reduce_from_region
from ds_ext.moe import TEDError
from ds_ext.moe.cac import Tape

if TYPE_CHECKING:
    from ds_ext.moe.context import TEDContext
    from ds_ext.parallel import TEDLayout

# Parameter-free elementwise activations: applying them to a column shard is exact.
ELEMENTWISE_ACTIVATIONS = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Identity, nn.LeakyReLU, nn.Mish, nn.ELU)


def check_divisible(what: str, size: int, tensor: int) -> None:
    if size % tensor:
        raise TEDError(f"ds_ext.ted: {what} {size} is not divisible by tensor_parallel {tensor}")


def shard_(param: nn.Parameter, dim: int, rank: int, size: int) -> None:
    """Keep chunk ``rank`` of ``size`` along ``dim`` of ``param`` (same Parameter object, so an
    optimizer built before ``ds_ext.initialize`` still holds it) and mark it tensor-parallel."""
    chunk = param.shape[dim] // size
    param.data = param.data.narrow(dim, rank * chunk, chunk).clone()
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = 1


def shard_column_(linear: nn.Linear, rank: int, size: int) -> None:
    shard_(linear.weight, 0, rank, size)
    if linear.bias is not None:
        shard_(linear.bias, 0, rank, size)


def shard_row_(linear: nn.Linear, rank: int, size: int) -> None:
    shard_(linear.weight, 1, rank, size)


class ColumnParallelLinear(nn.Linear):
    """``nn.Linear`` whose output features are split over the tensor group (see module)."""

    ted: "TEDContext | None" = None

    def ted_validate(self, layout: "TEDLayout", name: str) -> None:
        check_divisible(f"{name}.out_features", self.out_features, layout.tensor)

    def ted_bind(self, ted: "TEDContext", index: int) -> None:
        if ted.layout.tensor > 1:
            shard_column_(self, ted.tensor_rank, ted.layout.tensor)
        self.ted = ted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ted is not None:
            x = copy_to_region(x, self.ted.comm, self.ted.groups.tensor)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Linear):
    """``nn.Linear`` whose input features are split over the tensor group (see module)."""

    ted: "TEDContext | None" = None

    def ted_validate(self, layout: "TEDLayout", name: str) -> None:
        check_divisible(f"{name}.in_features", self.in_features, layout.tensor)

    def ted_bind(self, ted: "TEDContext", index: int) -> None:
        if ted.layout.tensor > 1:
            shard_row_(self, ted.tensor_rank, ted.layout.tensor)
        self.ted = ted
        self.ted_tape = Tape(f"RowParallelLinear[{index}]")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ted is None:
            return F.linear(x, self.weight, self.bias)
        frame = self.ted_tape.frame(self.ted.cac)
        out = reduce_from_region(F.linear(x, self.weight), self.ted.comm, self.ted.groups.tensor, frame)
        return out if self.bias is None else out + self.bias


def check_tensor_parallel_mlp(expert: nn.Module, name: str) -> None:
    """Refuse an expert TED cannot split column- then row-wise."""
    ok = (
        isinstance(expert, nn.Sequential)
        and len(expert) == 3
        and isinstance(expert[0], nn.Linear)
        and isinstance(expert[1], ELEMENTWISE_ACTIVATIONS)
        and isinstance(expert[2], nn.Linear)
    )
    if not ok:
        raise TEDError(
            f"ds_ext.ted: with tensor_parallel > 1 the expert {name} must be nn.Sequential(nn.Linear, "
            f"<elementwise activation: {', '.join(a.__name__ for a in ELEMENTWISE_ACTIVATIONS)}>, nn.Linear) "
            f"so it can be split column- then row-wise; got {type(expert).__name__}"
        )


def mlp_partial(mlp: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """A (column-sharded) Linear -> activation -> (row-sharded) Linear without its output bias:
    the partial sum rank t contributes before the tensor all-reduce (001 Fig 7.3 ❺)."""
    fc1, act, fc2 = mlp
    return F.linear(act(fc1(x)), fc2.weight)
