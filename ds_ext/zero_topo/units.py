"""Flat gather/release units of ZeRO-topo (003 §V-A, Fig. 6).

A unit is a set of parameters (a transformer block, or the remaining "root"
parameters) flattened into one buffer of U elements (padded so every shard at every
level is whole quantization blocks). With ``quantization_groups: per_parameter`` (the
default) and a quantizing plan, every parameter starts on a block boundary, so a quantization block never
mixes two parameters (a LayerNorm's small gradients never share a scale with a bias's large
ones), and the blocks of 1-D parameters (biases, norms) travel in the training dtype in the
quantized gradient reduction, as DeepSpeed's qgZ leaves 1-D tensors unquantized. Per rank it
holds:

* the **primary** shard: U / shards(w) elements of the model dtype at the weight level w;
* optionally the **secondary** shard at level s: int8 block-quantized (003) or model
  dtype (DeepSpeed hpZ), gathered for backward and, where s is narrower than w, for
  later forwards;
* the **gradient** shard: U / shards(g) elements accumulated over micro-batches.

Sharding contract: while the unit is *gathered* the module's parameters are views into
``full`` (U elements); while it is *released* they are valid empty tensors (as in FSDP:
``p.norm()`` is 0, shapes are ``(0,)``) and the storage of ``full`` is resized to 0
bytes. Gathering resizes it back, writes the gathered values in place and points the
parameters at it again, so tensors autograd saved in forward (views of ``full``) see
valid data again in backward (the FSDP flat-parameter technique). A *held* unit
(:meth:`FlatUnit.hold`, for ``gathered_parameters``) lives in a buffer of its own that
the hooks neither overwrite nor release, so whatever the caller keeps of it stays valid.
After an optimizer step with ``gather_across_step`` the unit's new shards may still be in
flight (:meth:`FlatUnit.await_update`): gathering, holding or reading :attr:`FlatUnit.primary`
completes them first, so those are collective until then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from ds_ext.comm import Communicator
from ds_ext.comm.quant import BlockQuantizer, QuantizedTensor
from ds_ext.comm.quantized import all_gather_int, all_gather_quantized, all_to_all_reduce, all_to_all_reduce_2hop
from ds_ext.zero_topo import schedule
from ds_ext.zero_topo.agreement import UnitTrace
from ds_ext.zero_topo.data_group import DataGroup
from ds_ext.zero_topo.layout import (
    chunk,
    from_shard_order,
    level_partition,
    padded_numel,
    param_offsets,
    raw_block_mask,
    shard_count,
    sub_chunk,
    to_shard_order,
)
from ds_ext.zero_topo.plan import ShardingPlan


@dataclass
class ShardContext:
    """What every unit of one model shares."""

    plan: ShardingPlan
    comm: Communicator
    rank: int
    dtype: torch.dtype
    compile_quantizer: bool = False
    device: torch.device = torch.device("cpu")  # where the engine put the module
    trace: UnitTrace | None = None  # the units of this rank's collectives (agreement check)
    data: DataGroup | None = None  # the data-parallel group sharded over (None: the world)
    model_group: object | None = None  # the model-parallel group gradient norms are summed over
    # the gradient sum's divisor (None: the ranks sharded over). MoE experts: the dense data-parallel
    # size, as DeepSpeed-MoE averages (a sum over the expert-data group / G_data^nonexp, 001 §7.1)
    average_over: int | None = None

    def __post_init__(self) -> None:
        b, c = self.plan.block_size, self.compile_quantizer
        self.weight_quantizer = BlockQuantizer(8, b, c)  # also the int8 step boundary's
        self.grad_quantizer = BlockQuantizer(self.plan.gradient_bits, b, c) if self.plan.gradient_bits < 16 else None
        self._groups: dict[tuple[int, ...], object] = {}  # by levels: collectives ask every time

    @property
    def topo(self):
        return self.plan.topology

    @property
    def global_rank(self) -> int:
        return self.rank if self.data is None else self.data.members[self.rank]

    def group(self, levels: Sequence[int]):
        """Process group of the ranks that differ only on ``levels`` (looked up once per
        levels: building the partition costs more than many small collectives' bookkeeping)."""
        key = tuple(levels)
        pg = self._groups.get(key)
        if pg is None:
            partition = level_partition(self.topo, list(key))
            if self.data is not None:
                partition = self.data.to_world(partition)
            pg = self._groups[key] = self.comm.registry.group(partition)
        return pg

    def span(self, level: int):
        return self.group(range(level + 1))


class FlatUnit:
    """One unit's parameters, shards and collectives (see module docstring)."""

    def __init__(
        self,
        name: str,
        params: list[nn.Parameter],
        ctx: ShardContext,
        names: list[tuple[str, ...]],
        whole: bool = False,
    ) -> None:
        """``whole``: the pipeline form (``ds_ext.zero_topo.pipeline``): the weights stay gathered;
        only gradients and optimizer state are sharded, the step re-gathers the weights."""
        self.name = name
        self.whole = whole
        self.ctx = ctx
        self.params = params
        self.param_names = names  # qualified names of each parameter (several if tied)
        B = ctx.plan.block_size
        self.offsets, end = param_offsets([p.numel() for p in params], B, ctx.plan.aligned)
        self.numel = sum(p.numel() for p in params)  # parameter elements (padding excluded)
        self.U = padded_numel(end, ctx.topo.world_size, B)
        # blocks sent unquantized by the quantized gradient reduction: those of 1-D parameters
        raw = raw_block_mask([(p.numel(), p.dim()) for p in params], self.offsets, self.U, B)
        self.raw_blocks = torch.tensor(raw, dtype=torch.bool, device=ctx.device) & ctx.plan.raw_1d_gradients
        self.shapes = [p.shape for p in params]
        for p in params:  # DeepSpeed ZeRO-3's convention for the full size of a sharded parameter
            p.ds_numel, p.ds_shape = p.numel(), p.shape
        self.full = torch.zeros(self.U, dtype=ctx.dtype, device=ctx.device)
        with torch.no_grad():
            for p, o in zip(params, self.offsets):
                self.full[o : o + p.numel()].copy_(p.data.reshape(-1))
        self._empty = torch.empty(0, dtype=ctx.dtype, device=ctx.device)
        self.held = False
        self._point_params()
        plan = ctx.plan
        self._primary = chunk(self.full, ctx.topo, ctx.rank, plan.weights).clone()
        self._update: Callable[[], None] | None = None  # completes the step's weight gathers left in flight
        self.secondary: torch.Tensor | QuantizedTensor | None = None
        self.grad_shard = torch.zeros(
            self.U // shard_count(ctx.topo, plan.gradients), dtype=ctx.dtype, device=ctx.device
        )
        self.gathered = True
        self._pending = None
        self.grads_ready = 0
        self.rebuild_secondary()
        if not whole:
            self.release()

    # ---- weights ------------------------------------------------------------------------
    @property
    def primary(self) -> torch.Tensor:
        """The primary shard; reading it first completes an update the step left in flight
        (:meth:`await_update`), so while one is pending the read is collective."""
        self.settle()
        return self._primary

    def await_update(self, complete: Callable[[], None]) -> None:
        """The optimizer's step left the all-gathers of this unit's new shards in flight
        (``zero_topo.gather_across_step``); ``complete`` finishes them (collective, in unit order
        on every rank) and writes :attr:`primary` and the secondary."""
        self._update = complete

    def settle(self) -> None:
        """Complete the step's update of this unit's shards, if one is in flight."""
        if self._update is not None:
            self._update()

    def install_primary(self, values: torch.Tensor) -> None:
        """The step's new primary shard (and the secondary derived from it): the update is done."""
        self._update = None
        self._primary.copy_(values)
        self.rebuild_secondary()

    def _point_params(self, released: bool = False) -> None:
        """Parameters become views of ``full`` (or empty tensors while released)."""
        for p, o, shape in zip(self.params, self.offsets, self.shapes):
            p.data = self._empty if released else self.full[o : o + shape.numel()].view(shape)

    def hold(self) -> None:
        """Gather the exact 16-bit weights into a buffer of the unit's own and keep them
        (collective over the weight group); :meth:`unhold` lets the hooks manage it again."""
        self.settle()
        if self._pending is not None:
            self.wait_gather()
        if self.gathered:
            self.held = True
            return
        resizable = self.full
        self.full = torch.empty(self.U, dtype=self.ctx.dtype, device=self.ctx.device)
        self._resizable = resizable
        self.start_gather(backward=False, exact=True, resize=False)
        self.wait_gather()
        self.held = True

    def unhold(self) -> None:
        self.held = False
        resizable = getattr(self, "_resizable", None)
        if resizable is not None:
            self.full = resizable
            self._resizable = None
            self.gathered = False
            self._point_params(released=True)

    def rebuild_secondary(self) -> None:
        """Derive the secondary from the primary when it lies inside it, else drop it."""
        plan = self.ctx.plan
        if not plan.secondary_from_primary:
            self.secondary = None
            return
        sub = sub_chunk(self._primary, self.ctx.topo, self.ctx.rank, self.U, plan.weights, plan.secondary)  # type: ignore[arg-type]
        self.secondary = self._store_secondary(sub)

    def _store_secondary(self, values: torch.Tensor):
        if self.ctx.plan.secondary_bits == 8:
            return self.ctx.weight_quantizer.quantize(values)
        return values.clone()

    def start_gather(self, backward: bool, exact: bool = False, resize: bool = True) -> None:
        """Begin gathering ``full`` (async); :meth:`wait_gather` completes it.

        ``exact`` gathers the unquantized primary shards (checkpoints).
        """
        self.settle()
        if self.gathered or self._pending is not None:
            return
        if resize:
            self.full.untyped_storage().resize_(self.U * self.full.element_size())
        ctx = self.ctx
        c = schedule.weight_gather(ctx.plan, backward, self.secondary is not None, exact)
        data = self.secondary if c.source == "secondary" else self.primary
        level, levels = c.level, list(c.levels)
        group = ctx.span(level)
        reorder = len(levels) > 1
        out = torch.empty_like(self.full) if reorder else self.full
        if ctx.trace is not None:
            ctx.trace.record("gather", self.name)
        if isinstance(data, QuantizedTensor):  # the secondary, stored int8
            pending = all_gather_quantized(ctx.comm, data, ctx.weight_quantizer, out, group, async_op=True)
        elif c.bits == 8:
            pending = all_gather_int(ctx.comm, data, ctx.weight_quantizer, out, group, async_op=True)
        else:
            pending = ctx.comm.all_gather(out, data, group=group, async_op=True)
        self._pending = (pending, out if reorder else None, levels, level)

    def adopt_full(self) -> None:
        """Take new primary (and secondary) shards from ``full`` after it was overwritten."""
        self.primary.copy_(chunk(self.full, self.ctx.topo, self.ctx.rank, self.ctx.plan.weights))
        self.rebuild_secondary()

    def wait_gather(self) -> None:
        if self.gathered:
            return
        if self._pending is None:
            self.start_gather(backward=torch._C._current_graph_task_id() != -1)
        pending, out, levels, level = self._pending  # type: ignore[misc]
        pending.wait()
        if out is not None:
            self.full.copy_(to_shard_order(out, self.ctx.topo, levels))
        plan = self.ctx.plan
        if (
            plan.secondary is not None
            and not plan.secondary_from_primary
            and self.secondary is None
            and level >= plan.secondary
        ):
            self.secondary = self._store_secondary(chunk(self.full, self.ctx.topo, self.ctx.rank, plan.secondary))
        self._pending = None
        self.gathered = True
        self._point_params()

    def regather(self) -> None:
        """Whole mode: the weights from the updated primary shards (collective over the weight group)."""
        self.gathered = False
        self.start_gather(backward=False, exact=True, resize=False)
        self.wait_gather()

    def release(self) -> None:
        if self.held or self.whole:
            return
        if self._pending is not None:
            self.wait_gather()
        self.full.untyped_storage().resize_(0)
        self.gathered = False
        self._point_params(released=True)

    # ---- gradients ----------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        """Flatten the parameters' grads, reduce them over the gradient group into the shard."""
        ctx, plan = self.ctx, self.ctx.plan
        flat = torch.zeros(self.U, dtype=ctx.dtype, device=ctx.device)
        for p, o in zip(self.params, self.offsets):
            if p.grad is not None:
                flat[o : o + p.grad.numel()].copy_(p.grad.reshape(-1))
                p.grad = None
        flat.div_(ctx.average_over or ctx.topo.world_size)
        if ctx.trace is not None:
            ctx.trace.record("reduce", self.name)
        c = schedule.gradient_reduce(plan)
        g = c.level
        if c.hops == 1:
            ordered = from_shard_order(flat, ctx.topo, c.levels)
        if c.op == schedule.REDUCE_SCATTER:
            out = torch.empty_like(self.grad_shard)
            ctx.comm.reduce_scatter(out, ordered, group=ctx.span(g))
            self.grad_shard.add_(out)
        elif c.hops == 1:
            raw = from_shard_order(self.raw_blocks, ctx.topo, c.levels)
            self.grad_shard.add_(all_to_all_reduce(ctx.comm, ordered, ctx.grad_quantizer, ctx.span(g), raw, ctx.dtype))
        else:
            # [p, n, c]: shard order puts the outermost level's digit last, so the chunks
            # for one intra-node peer on every node are contiguous (the qgZ slice reorder).
            by_peer = from_shard_order(flat, ctx.topo, range(g))
            raw = from_shard_order(self.raw_blocks, ctx.topo, range(g))
            self.grad_shard.add_(
                all_to_all_reduce_2hop(
                    ctx.comm, by_peer, ctx.grad_quantizer, ctx.span(g - 1), ctx.group([g]), raw, ctx.dtype
                )
            )
        self.grads_ready = 0

    # ---- accounting ---------------------------------------------------------------------
    def device_buffers(self) -> list[torch.Tensor]:
        """Every tensor of model state the unit keeps on the device (gathered weights, primary and
        secondary shards, gradient shard), without completing an update in flight; what an
        offloaded optimizer's state must not share storage with."""
        sec = self.secondary
        secondary = [sec.payload, sec.scales] if isinstance(sec, QuantizedTensor) else [] if sec is None else [sec]
        return [self.full, self._primary, self.grad_shard, *secondary]

    def state_bytes(self) -> dict[str, int]:
        sec = self.secondary
        if isinstance(sec, QuantizedTensor):
            sec_bytes = sec.wire_bytes
        else:
            sec_bytes = 0 if sec is None else sec.numel() * sec.element_size()
        es = self._primary.element_size()  # no settle: sizes only, and not collective
        return {
            "primary": self._primary.numel() * es,
            "secondary": sec_bytes,
            "gradients": self.grad_shard.numel() * es,
        }
