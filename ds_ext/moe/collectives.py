"""Differentiable TED collectives, all through the ds_ext :class:`~ds_ext.comm.Communicator`.

Sharding contracts (T = G_tensor, P = G_expert):

* :func:`copy_to_tensor_region` (Megatron's *f*): forward identity on an activation that is
  replicated over the tensor group; backward all-reduces its gradient over the tensor group
  (the partial input gradients of a column-parallel layer);
* :func:`reduce_from_tensor_region` (Megatron's *g*, 001 Fig 7.3 ❷ and ❻): forward
  all-reduces partial sums over the tensor group into a replicated activation; backward
  identity;
* :func:`all_to_all` (❹, ❼): dim 0 holds P equal chunks, chunk j goes to expert rank j;
  the backward is the same exchange of the gradient.

Forward collectives (g, all-to-all, and the DTD all-gather in :mod:`ds_ext.moe.dtd`) read
their output from a CAC :class:`~ds_ext.moe.cac.Frame` in a recompute when CAC is on.
A group of one rank makes every op the identity without touching the communicator.
"""

from __future__ import annotations

from typing import Any

import torch

from ds_ext.comm import Communicator
from ds_ext.moe.cac import Frame


def _run(frame: Frame | None, kind: str, fn, like: torch.Size, stash: bool = True) -> torch.Tensor:
    return fn() if frame is None else frame.collective(kind, fn, like, stash)


def _all_reduce(comm: Communicator, x: torch.Tensor, group) -> torch.Tensor:
    out = x.contiguous().clone()
    comm.all_reduce(out, group=group)
    return out


def _exchange(comm: Communicator, x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    comm.all_to_all(out, x, group=group)
    return out


class _CopyToTensorRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, group) -> torch.Tensor:
        ctx.comm, ctx.group = comm, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _all_reduce(ctx.comm, grad, ctx.group), None, None


class _ReduceFromTensorRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, group, frame: Frame | None) -> torch.Tensor:
        return _run(frame, "all_reduce", lambda: _all_reduce(comm, x, group), x.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return grad, None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, group, frame: Frame | None,
                stash: bool) -> torch.Tensor:
        ctx.comm, ctx.group = comm, group
        return _run(frame, "all_to_all", lambda: _exchange(comm, x, group), x.shape, stash)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _exchange(ctx.comm, grad, ctx.group), None, None, None, None


def copy_to_tensor_region(x: torch.Tensor, comm: Communicator, group) -> torch.Tensor:
    if comm.size(group) == 1:
        return x
    return _CopyToTensorRegion.apply(x, comm, group)


def reduce_from_tensor_region(x: torch.Tensor, comm: Communicator, group, frame: Frame | None) -> torch.Tensor:
    if comm.size(group) == 1:
        return x
    return _ReduceFromTensorRegion.apply(x, comm, group, frame)


def all_to_all(x: torch.Tensor, comm: Communicator, group, frame: Frame | None, stash: bool = True) -> torch.Tensor:
    """``stash=False``: CAC need not keep the output (it only feeds DTD's gather, lean stash)."""
    if comm.size(group) == 1:
        return x
    return _AllToAll.apply(x, comm, group, frame, stash)
