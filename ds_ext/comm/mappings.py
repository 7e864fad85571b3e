"""Differentiable collectives between parallel regions (Megatron's *mappings*, 001 §5.1.1, §7.1).

Every op takes the ds_ext :class:`~ds_ext.comm.Communicator` and the process group it runs
over, so the ledger counts it and the alpha-beta emulator holds it. A group of one rank, or
``None`` (the group of a parallel axis of degree one, :class:`ds_ext.pmm.grid.Axis`), makes
every op the identity without touching the communicator.

Sharding contracts (d = ranks of the group, r = this rank's place in it):

* :func:`copy_to_region` (Megatron's *f*; 3D-PMM's parameters replicated over Z): forward
  identity on a tensor replicated over the group; backward sums the partial gradients.
* :func:`reduce_from_region` (Megatron's *g*, 001 Fig 7.3 ❷ ❻): forward sums partial results
  into a replicated tensor; backward identity.
* :func:`reduce_both` (3D-PMM's norm statistics): partial sums -> their sum, used by every
  rank for its own slice; backward sums the slices' gradients.
* :func:`mean_over` (3D-PMM's loss over Z): each rank's mean over its rows -> the mean over
  all rows, replicated; backward scales by 1 / d.
* :func:`copy_to_region_bucketed`: :func:`copy_to_region` of many tensors whose backward
  flattens their gradients (one buffer per dtype) into one all-reduce each.
* :func:`all_to_all` (001 Fig 7.3 ❹ ❼): dim 0 holds d equal chunks, chunk j goes to rank j;
  backward is the same exchange of the gradient.
* :func:`split_to_region` / :func:`gather_from_region` (001 §7.3.1, duplicate token
  dropping): dim 1 replicated -> rank r keeps chunk r of d; and back, chunks concatenated in
  group-rank order. Each one's backward is the other.

CAC (001 §7.3.2): the ops whose forward communicates (g, all-to-all, gather) take an optional
:class:`Recorder` (a layer's :class:`ds_ext.moe.cac.Frame`): an activation-checkpoint
recompute then reads the first forward's output from it instead of communicating.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
from einops import rearrange

from ds_ext.comm.collectives import Communicator


class Recorder(Protocol):
    """Where a forward collective's output is recorded and replayed (CAC)."""

    def collective(
        self, kind: str, run: Callable[[], torch.Tensor], like: torch.Size, stash: bool = True
    ) -> torch.Tensor: ...


def _alone(comm: Communicator, group: object | None) -> bool:
    return group is None or comm.size(group) == 1


def _recorded(
    recorder: Recorder | None, kind: str, run: Callable[[], torch.Tensor], like: torch.Size, stash: bool = True
) -> torch.Tensor:
    return run() if recorder is None else recorder.collective(kind, run, like, stash)


def _summed(comm: Communicator, t: torch.Tensor, group: object) -> torch.Tensor:
    out = t.contiguous().clone()
    comm.all_reduce(out, group=group)
    return out


def _exchanged(comm: Communicator, t: torch.Tensor, group: object) -> torch.Tensor:
    t = t.contiguous()
    out = torch.empty_like(t)
    comm.all_to_all(out, t, group=group)
    return out


def _chunk(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    chunk = t.shape[1] // size
    return t.narrow(1, rank * chunk, chunk).contiguous()


def _gathered(comm: Communicator, t: torch.Tensor, group: object, size: int) -> torch.Tensor:
    t = t.contiguous()
    out = torch.empty((size, *t.shape), dtype=t.dtype, device=t.device)
    comm.all_gather(out, t, group=group)
    return rearrange(out, "r a c ... -> a (r c) ...")


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, group: object) -> torch.Tensor:
        ctx.comm, ctx.group = comm, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _summed(ctx.comm, grad, ctx.group), None, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, comm: Communicator, group: object, recorder: Recorder | None
    ) -> torch.Tensor:
        return _recorded(recorder, "all_reduce", lambda: _summed(comm, x, group), x.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return grad, None, None, None


class _ReduceBoth(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, group: object) -> torch.Tensor:
        ctx.comm, ctx.group = comm, group
        return _summed(comm, x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _summed(ctx.comm, grad, ctx.group), None, None


class _MeanOver(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, group: object) -> torch.Tensor:
        ctx.size = comm.size(group)
        out = x.detach().clone().contiguous()
        comm.all_reduce(out, group=group)
        return out / ctx.size

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return grad / ctx.size, None, None


class _CopyToRegionBucketed(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, comm: Communicator, group: object, *xs: torch.Tensor):
        ctx.comm, ctx.group = comm, group
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor):
        out: list[torch.Tensor | None] = list(grads)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, g in enumerate(grads):
            by_dtype.setdefault(g.dtype, []).append(i)
        for members in by_dtype.values():
            flat = torch.cat([grads[i].reshape(-1) for i in members])
            ctx.comm.all_reduce(flat, group=ctx.group)
            for i, part in zip(members, flat.split([grads[i].numel() for i in members])):
                out[i] = part.view_as(grads[i])
        return (None, None, *out)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, comm: Communicator, group: object, recorder: Recorder | None, stash: bool
    ) -> torch.Tensor:
        ctx.comm, ctx.group = comm, group
        return _recorded(recorder, "all_to_all", lambda: _exchanged(comm, x, group), x.shape, stash)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _exchanged(ctx.comm, grad, ctx.group), None, None, None, None


class _SplitToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, group: object) -> torch.Tensor:
        ctx.comm, ctx.group, ctx.size = comm, group, comm.size(group)
        return _chunk(x, comm.registry.group_rank(group), ctx.size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _gathered(ctx.comm, grad, ctx.group, ctx.size), None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, comm: Communicator, group: object, recorder: Recorder | None
    ) -> torch.Tensor:
        ctx.rank, ctx.size = comm.registry.group_rank(group), comm.size(group)
        like = torch.Size((x.shape[0], x.shape[1] * ctx.size, *x.shape[2:]))
        return _recorded(recorder, "all_gather", lambda: _gathered(comm, x, group, ctx.size), like)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _chunk(grad, ctx.rank, ctx.size), None, None, None


def copy_to_region(x: torch.Tensor, comm: Communicator, group: object | None) -> torch.Tensor:
    return x if _alone(comm, group) else _CopyToRegion.apply(x, comm, group)


def reduce_from_region(
    x: torch.Tensor, comm: Communicator, group: object | None, recorder: Recorder | None = None
) -> torch.Tensor:
    return x if _alone(comm, group) else _ReduceFromRegion.apply(x, comm, group, recorder)


def reduce_both(x: torch.Tensor, comm: Communicator, group: object | None) -> torch.Tensor:
    return x if _alone(comm, group) else _ReduceBoth.apply(x, comm, group)


def mean_over(x: torch.Tensor, comm: Communicator, group: object | None) -> torch.Tensor:
    return x if _alone(comm, group) else _MeanOver.apply(x, comm, group)


def copy_to_region_bucketed(
    xs: list[torch.Tensor], comm: Communicator, group: object | None
) -> tuple[torch.Tensor, ...]:
    return tuple(xs) if _alone(comm, group) else _CopyToRegionBucketed.apply(comm, group, *xs)


def all_to_all(
    x: torch.Tensor, comm: Communicator, group: object | None, recorder: Recorder | None = None, stash: bool = True
) -> torch.Tensor:
    """``stash=False``: a CAC recorder need not keep the output (it only feeds a recorded
    gather: :mod:`ds_ext.moe.cac`'s lean stash)."""
    return x if _alone(comm, group) else _AllToAll.apply(x, comm, group, recorder, stash)


def split_to_region(x: torch.Tensor, comm: Communicator, group: object | None) -> torch.Tensor:
    """``[A, C, ...]`` replicated over the group -> this rank's ``[A, C/d, ...]``."""
    return x if _alone(comm, group) else _SplitToRegion.apply(x, comm, group)


def gather_from_region(
    x: torch.Tensor, comm: Communicator, group: object | None, recorder: Recorder | None = None
) -> torch.Tensor:
    """The group's ``[A, C/d, ...]`` chunks -> ``[A, C, ...]`` replicated over it."""
    return x if _alone(comm, group) else _GatherFromRegion.apply(x, comm, group, recorder)
