"""Autograd collectives between the converted layers (the f / g operators of 001 §5.1.1).

Each says what is replicated and what is split before and after it:

* :func:`reduce_both` (norm statistics): partial sums over an axis -> their sum, used by
  every rank for its own slice; backward sums the slices' gradients over the axis.
* :func:`reduce_grad` (parameters replicated over Z): identity forward; backward sums the
  gradient over Z, whose ranks hold different batch rows.
* :func:`reduce_grad_bucket` (all of them at once, issue 20 point 8): identity forward on a
  list of parameters; backward flattens their gradients (one buffer per dtype) and sums
  them over Z in one all-reduce instead of one per parameter.
* :func:`mean_over` (the loss): each Z rank's mean over its rows -> the mean over all rows,
  replicated; backward scales by 1 / G_z.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ds_ext.pmm.grid import Axis


class AxisReducer(Protocol):
    """What these operators use of the :class:`~ds_ext.pmm.engine.PMMEngine` that calls them."""

    def all_reduce(self, t: torch.Tensor, axis: Axis) -> Any: ...


class _ReduceBoth(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, engine: AxisReducer, axis: Axis) -> torch.Tensor:
        ctx.engine, ctx.axis = engine, axis
        out = t.contiguous().clone()
        engine.all_reduce(out, axis)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        ctx.engine.all_reduce(grad, ctx.axis)
        return grad, None, None


class _ReduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, engine: AxisReducer, axis: Axis) -> torch.Tensor:
        ctx.engine, ctx.axis = engine, axis
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        ctx.engine.all_reduce(grad, ctx.axis)
        return grad, None, None


class _ReduceGradBucket(torch.autograd.Function):
    @staticmethod
    def forward(ctx, engine: AxisReducer, axis: Axis, *params: torch.Tensor):
        ctx.engine, ctx.axis = engine, axis
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        out: list[torch.Tensor | None] = list(grads)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, g in enumerate(grads):
            by_dtype.setdefault(g.dtype, []).append(i)
        for members in by_dtype.values():
            flat = torch.cat([grads[i].reshape(-1) for i in members])
            ctx.engine.all_reduce(flat, ctx.axis)
            for i, part in zip(members, flat.split([grads[i].numel() for i in members])):
                out[i] = part.view_as(grads[i])
        return (None, None, *out)


class _MeanOver(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, engine: AxisReducer, axis: Axis) -> torch.Tensor:
        ctx.size = axis.size
        out = t.detach().clone().contiguous()
        engine.all_reduce(out, axis)
        return out / axis.size

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad / ctx.size, None, None


def reduce_both(t: torch.Tensor, engine: AxisReducer, axis: Axis) -> torch.Tensor:
    return t if axis.size == 1 else _ReduceBoth.apply(t, engine, axis)


def reduce_grad(t: torch.Tensor, engine: AxisReducer, axis: Axis) -> torch.Tensor:
    return t if axis.size == 1 else _ReduceGrad.apply(t, engine, axis)


def reduce_grad_bucket(params: list[torch.Tensor], engine: AxisReducer, axis: Axis) -> tuple[torch.Tensor, ...]:
    return _ReduceGradBucket.apply(engine, axis, *params)


def mean_over(t: torch.Tensor, engine: AxisReducer, axis: Axis) -> torch.Tensor:
    return t if axis.size == 1 else _MeanOver.apply(t, engine, axis)
