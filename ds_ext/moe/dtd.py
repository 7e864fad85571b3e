"""Duplicate token dropping (DTD, 001 §7.3.1, Fig 7.6) around TED's all-to-alls.

After a tensor-parallel block every rank of a tensor group holds the same activations, so
a plain all-to-all ❹ / ❼ sends every token G_tensor times. DTD sends each once:

  drop (each tensor rank keeps its 1/G_tensor of the capacity) -> all-to-all over the expert
  group -> all-gather over the tensor group (reassemble the capacity)

The backward mirrors it (the paper: "the all-gather call is replaced by a drop operation and
the drop operation is replaced by an all-gather call"): the gradient is all-gathered where the
forward dropped and narrowed where the forward gathered.

Sharding contract of :func:`exchange` (E experts in dim 0, P = G_expert equal chunks of
E / P experts; C capacity slots in dim 1; H hidden; T = G_tensor, t = tensor rank):
``[E, C, H]`` replicated over the tensor group -> drop -> ``[E, C/T, H]`` holding slots
``[t C/T, (t+1) C/T)`` -> all-to-all -> ``[E, C/T, H]`` -> all-gather, slots in tensor-rank
order -> ``[E, C, H]`` replicated over the tensor group, the same tensor a plain all-to-all
of the undropped input delivers (so DTD on and off are bit-identical).

With G_expert = 1 there is no all-to-all to shrink: DTD would only add the all-gathers, so
:func:`exchange` is then the identity whatever ``ted.dtd`` says.
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange

from ds_ext.comm import Communicator
from ds_ext.moe.cac import Frame
from ds_ext.moe.collectives import all_to_all
from ds_ext.moe.context import TEDContext


def _narrow(x: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    chunk = x.shape[1] // size
    return x.narrow(1, rank * chunk, chunk).contiguous()


def _gather(comm: Communicator, x: torch.Tensor, group, size: int) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty((size, *x.shape), dtype=x.dtype, device=x.device)
    comm.all_gather(out, x, group=group)
    return rearrange(out, "t e c h -> e (t c) h")


class _DropTokens(torch.autograd.Function):
    """Forward: keep this tensor rank's capacity chunk. Backward: all-gather the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, group, rank: int, size: int) -> torch.Tensor:
        ctx.comm, ctx.group, ctx.size = comm, group, size
        return _narrow(x, rank, size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _gather(ctx.comm, grad, ctx.group, ctx.size), None, None, None, None


class _GatherTokens(torch.autograd.Function):
    """Forward: all-gather the capacity chunks of the tensor group. Backward: keep this
    rank's chunk of the (replicated) gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, group, rank: int, size: int,
                frame: Frame | None) -> torch.Tensor:
        ctx.rank, ctx.size = rank, size
        like = torch.Size((x.shape[0], x.shape[1] * size, *x.shape[2:]))
        gathered = lambda: _gather(comm, x, group, size)  # noqa: E731
        return gathered() if frame is None else frame.collective("all_gather", gathered, like)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _narrow(grad, ctx.rank, ctx.size), None, None, None, None, None


def drop_duplicates(x: torch.Tensor, ted: TEDContext) -> torch.Tensor:
    """``[E, C, H]`` replicated over the tensor group -> this tensor rank's ``[E, C/T, H]``."""
    T = ted.layout.tensor
    return x if T == 1 else _DropTokens.apply(x, ted.comm, ted.groups["tensor"], ted.tensor_rank, T)


def gather_duplicates(x: torch.Tensor, ted: TEDContext, frame: Frame | None) -> torch.Tensor:
    """The tensor group's ``[E, C/T, H]`` chunks -> ``[E, C, H]`` replicated over it."""
    T = ted.layout.tensor
    return x if T == 1 else _GatherTokens.apply(x, ted.comm, ted.groups["tensor"], ted.tensor_rank, T, frame)


def exchange(x: torch.Tensor, ted: TEDContext, frame: Frame | None) -> torch.Tensor:
    """All-to-all ``[E, C, H]`` over the expert group, with DTD when ``ted.dtd`` (see module)."""
    expert_group = ted.groups["expert"]
    if not ted.dtd or ted.layout.tensor == 1 or ted.layout.expert == 1:
        return all_to_all(x, ted.comm, expert_group, frame)
    x = all_to_all(drop_duplicates(x, ted), ted.comm, expert_group, frame, stash=not ted.cac_lean)
    return gather_duplicates(x, ted, frame)
