"""ZeRO-topo's optimizer: the sharded step at the step boundary (003 §V-C, 001 §7.2, §3.3.2).

Per optimizer step (:class:`ZeroTopoOptimizer`), for every unit of the sharded model
(:mod:`ds_ext.zero_topo.sharded_model`), with the collectives of ``ds_ext.zero_topo.schedule``:
  reduce    gradient shard -> optimizer shard across the levels between them:
            ``hierarchical`` = reduce-scatter level by level (inner first), then all-reduce
            over replicas; ``allreduce`` = 003: all-reduce over every outer level, select;
  step      global grad norm (each element once), clipping, fp16 overflow skip, the
            wrapped torch optimizer on fp32 master segments;
  gather    16-bit weights back up to the primary shard: ``hierarchical`` = all-gather
            level by level (outer first), only what the primary shard needs;
            ``allreduce`` = 003's all-gather over the world; then rebuild the secondary.
With ``overlap_step`` (the default) each unit's ``reduce`` is issued in the last micro-batch's
backward as soon as its gradient shard is complete (booked as phase ``step``) and ``gather`` runs
pipelined unit by unit: the same collectives and bits, off the critical path. With
``gather_across_step`` too (the default) ``gather`` is only issued in the step: each unit waits
for its own at its first use after the step (its next forward), so the gathers across nodes run
while the forward computes the units before it (003 §V-A's overlap carried over the boundary).
With ``step.bits: 8`` the cross-node reduce-scatter and all-gather of the boundary carry
int8 blocks with fp32 scales: the fp32 masters stay exact on their owners, and every rank,
owners included, continues from the dequantized 16-bit weights, so replicas agree bit for bit.
With ``ds_ext.tiled_optimizer`` (001 §7.2) the step keeps the reduced gradients in 16 bits,
updates each unit tile by tile through one fp32 buffer, and issues the unit's weight
all-gather asynchronously so that it runs while the next unit is updated (same collectives,
bytes and calls as above, only overlapped).
With ``zero_optimization.offload_optimizer`` (001 §3.3.2, :mod:`ds_ext.optim.offload`) the fp32
master segments and the optimizer state live in host memory and that tiled step runs on the host:
each tile's reduced gradient is copied to the host while the previous tile is updated, and its
updated 16-bit weights are copied back into the unit's device slice while the next one is; the
norm, overflow decision and every collective are the on-device step's, on the device.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Generator, Iterable, Iterator

import torch

from ds_ext import log
from ds_ext.comm.collectives import InFlight
from ds_ext.comm.quantized import all_gather_int, all_to_all_reduce_async
from ds_ext.errors import DsExtConfigError
from ds_ext.optim.config import DEFAULT_TILE_SIZE
from ds_ext.optim.offload import HostStep, OffloadPlacementError, OffloadStore
from ds_ext.optim.tiled import TiledAdam
from ds_ext.zero_topo import checkpoint as ckpt
from ds_ext.zero_topo import schedule
from ds_ext.zero_topo.layout import chunk, shard_count, shard_index, sub_chunk, to_shard_order
from ds_ext.zero_topo.sharded_model import ShardedModel
from ds_ext.zero_topo.units import FlatUnit


def _state_value(master: torch.Tensor, key: str, value: Any, defaults: dict) -> Any:
    """A loaded optimizer state value placed as ``torch.optim.Optimizer.load_state_dict`` places
    it: floating tensors on the master's device and dtype, Adam's ``step`` counter left on the
    host unless the optimizer is fused or capturable (then on the master's device)."""
    if not isinstance(value, torch.Tensor):
        return value
    if key == "step":
        on_device = defaults.get("fused") or defaults.get("capturable")
        return value.to(dtype=torch.float32, device=master.device) if on_device else value.clone()
    if value.is_floating_point():
        return value.to(dtype=master.dtype, device=master.device, copy=True)
    return value.to(device=master.device, copy=True)


class _Chain:
    """Collectives that depend on each other, issued one at a time: ``steps`` yields each
    collective's handle (None when synchronous) right after issuing it and returns the
    chain's result. Every rank advances its chains in the same order, so each group sees its
    collectives in the same order everywhere."""

    def __init__(self, steps: Generator[InFlight | None, None, Any]) -> None:
        self._steps = steps
        self._handle: InFlight | None = None
        self.done = False
        self.value: Any = None
        self.advance()

    def advance(self) -> None:
        """Wait for the collective in flight, then issue the next one."""
        if self._handle is not None:
            self._handle.wait()
        try:
            self._handle = next(self._steps)
        except StopIteration as stop:
            self._handle, self.done, self.value = None, True, stop.value

    def finish(self) -> Any:
        while not self.done:
            self.advance()
        return self.value


class _Pipeline:
    """Chains started one after another, each earlier chain advancing one collective when a
    new one starts: the second collective of unit i (e.g. its all-gather inside the node)
    runs while the first of unit i+1 (across nodes) does, on other links."""

    def __init__(self) -> None:
        self._pending: list[_Chain] = []

    def advance(self) -> None:
        for chain in self._pending:
            chain.advance()
        self._pending = [c for c in self._pending if not c.done]

    def start(self, steps: Generator[InFlight | None, None, Any]) -> None:
        self.advance()
        self._pending.append(_Chain(steps))

    def finish(self) -> None:
        while self._pending:
            self.advance()


class _StepGathers:
    """The step's weight all-gather chains left in flight past ``step()`` (``gather_across_step``).

    Each chain's first collective (across nodes) is issued in the step, in unit order. A unit's
    first use after the step (:meth:`FlatUnit.settle`) finishes the chains up to its own, in
    unit order, then advances the next unit's chain one collective, so that unit's gather inside
    the node runs while this unit computes. The ranks use the units in the same order, so every
    group sees its collectives in the same order everywhere; the collectives are booked as phase
    ``step`` wherever they are issued (in the next optimizer step's ledger record when that is
    where the forward issues them), and the timed span of one issued in the step runs until the
    forward waits for it (``ds_ext.comm.ledger``: an async collective's span ends at its wait).
    """

    def __init__(self) -> None:
        self._chains: list[tuple[FlatUnit, _Chain]] = []

    def add(self, unit: FlatUnit, steps: Generator[InFlight, None, None]) -> None:
        with unit.ctx.comm.ledger.phase("step"):
            self._chains.append((unit, _Chain(steps)))
        unit.await_update(lambda: self.settle(unit))

    def settle(self, unit: FlatUnit) -> None:
        """Finish the chains up to ``unit``'s (its own included; each ends in
        :meth:`FlatUnit.install_primary`), then advance the next one by one collective."""
        while self._chains:
            first, chain = self._chains.pop(0)
            with first.ctx.comm.ledger.phase("step"):
                chain.finish()
            if first is unit:
                break
        if self._chains and not self._chains[0][1].done:
            nxt, chain = self._chains[0]
            with nxt.ctx.comm.ledger.phase("step"):
                chain.advance()

    def settle_all(self) -> None:
        if self._chains:
            self.settle(self._chains[-1][0])


class ZeroTopoOptimizer(torch.optim.Optimizer):
    """The sharded step around a torch optimizer whose params become fp32 master segments.

    ``inner`` keeps its class, hyper-parameters and param groups (so LR schedulers built
    on it keep working); each group's params are replaced by this rank's fp32 segments of
    the optimizer shard. ``scaler`` is DeepSpeed's own loss scaler
    (``ds_engine.loss_scaler``): fp16 overflow skips and scale updates are DeepSpeed's.
    """

    def __init__(
        self,
        sharded: ShardedModel,
        inner: torch.optim.Optimizer,
        clip: float,
        scaler: Any,
        at_boundary: Callable[[], bool] | None = None,
        gather_across_step: bool = False,
        offload: OffloadStore | None = None,
    ):
        """``at_boundary``: the engine's "is this micro-batch the last before the step?"; given,
        the step boundary overlaps (:meth:`start_reduction`, and the weight all-gathers pipelined
        unit by unit); None: every boundary collective runs in the step, one after another.
        ``gather_across_step`` (with ``at_boundary``): the weight all-gathers of the units that
        are gathered per forward are left in flight past the step (:class:`_StepGathers`).
        ``offload``: the host store of optimizer offload (001 §3.3.2): the fp32 masters and the
        optimizer state live there and the step runs tiled on the host, in tiles of
        ``ds_ext.tiled_optimizer.tile_size`` where that plugin is on (:meth:`use_tiles`), else of
        its default (001 §7.2's 1.8M)."""
        self.sharded = sharded
        self.at_boundary = at_boundary
        self._in_flight = _StepGathers() if at_boundary is not None and gather_across_step else None
        self._early: dict[int, _Chain] = {}  # by unit id: its boundary reduction, started in backward
        self.inner = inner
        self.offload = offload
        self.tiled: TiledAdam | None = None  # use_tiles: ds_ext.tiled_optimizer (001 §7.2), or offload
        self.clip = clip
        self.scaler = scaler
        self.overflow = False
        self._global_grad_norm = 0.0
        group_of = {id(p): i for i, g in enumerate(inner.param_groups) for p in g["params"]}
        self.segments: list[tuple[FlatUnit, int, int, torch.Tensor]] = []  # unit, lo, hi, master
        self._counted: list[bool] = []  # per segment: in this rank's share of the global norm
        per_group: list[list[torch.Tensor]] = [[] for _ in inner.param_groups]
        for unit in sharded.all_units:
            ctx = unit.ctx
            size = unit.U // shard_count(ctx.topo, ctx.plan.optimizer)
            a = shard_index(ctx.topo, ctx.rank, ctx.plan.optimizer) * size
            own = self._own_slice(unit)
            for p, o, shape in zip(unit.params, unit.offsets, unit.shapes):
                lo, hi = max(a, o), min(a + size, o + shape.numel())
                if lo >= hi or not p.requires_grad:
                    continue
                if id(p) not in group_of:
                    raise DsExtConfigError(
                        f"ds_ext.zero_topo: a parameter of unit {unit.name} is in none of the "
                        "optimizer's param groups; allowed: an optimizer over the model's parameters"
                    )
                piece = own[lo - a : hi - a]
                master = offload.master(piece) if offload is not None else piece.float().clone()
                self.segments.append((unit, lo - a, hi - a, master))
                self._counted.append(ctx.data is None or ctx.data.counted(p))
                per_group[group_of[id(p)]].append(master)
        for g, params in zip(inner.param_groups, per_group):
            g["params"] = params
        inner.state.clear()
        self.param_groups = inner.param_groups
        self.defaults = inner.defaults
        self.state = inner.state
        if offload is not None:
            self.use_tiles(DEFAULT_TILE_SIZE)

    def use_tiles(self, tile_size: int) -> TiledAdam:
        """Run the step tiled (001 §7.2) in tiles of ``tile_size`` (``ds_ext.tiled_optimizer``);
        with offload, the host step's tiles, whose new optimizer state the host store keeps."""
        self.tiled = TiledAdam(self.inner, tile_size, self.offload.keep if self.offload is not None else None)
        return self.tiled

    def install_state(self, master: torch.Tensor, state: dict) -> None:
        """``master``'s optimizer state (a checkpoint's), kept by the host store with offload."""
        keep = self.offload.keep if self.offload is not None else None
        self.inner.state[master] = {
            k: keep(v) if keep is not None and isinstance(v, torch.Tensor) else v for k, v in state.items()
        }

    def offload_placement(self) -> int:
        """Check where every fp32 master and optimizer state tensor lives
        (:meth:`ds_ext.optim.offload.OffloadStore.check_placement`: on the host, held by the store,
        sharing no storage with the model's device buffers); returns how many were checked."""
        if self.offload is None:
            raise OffloadPlacementError("the optimizer is not offloaded (zero_optimization.offload_optimizer)")
        states: list[tuple[str, torch.Tensor]] = []
        for unit, lo, hi, master in self.segments:
            where = f"{unit.name}[{lo}:{hi}]"
            states.append((f"master {where}", master))
            for key, value in self.inner.state.get(master, {}).items():
                if isinstance(value, torch.Tensor):
                    states.append((f"{key} {where}", value))
        buffers = [b for unit in self.sharded.all_units for b in unit.device_buffers()]
        buffers += [p.data for p in self.sharded.model.parameters()]
        return self.offload.check_placement(states, buffers)

    def own_range(self, unit: FlatUnit) -> tuple[int, int]:
        """[start, stop) of this rank's optimizer slice in the unit's flat index."""
        ctx = unit.ctx
        size = unit.U // shard_count(ctx.topo, ctx.plan.optimizer)
        start = shard_index(ctx.topo, ctx.rank, ctx.plan.optimizer) * size
        return start, start + size

    def adopt_weights(self, unit: FlatUnit) -> None:
        """Take the unit's (held, possibly modified) full weights as its new shards; every
        fp32 master element whose 16-bit weight changed takes the new value."""
        old = self._own_slice(unit).clone()
        unit.adopt_full()
        new = self._own_slice(unit)
        for u, lo, hi, master in self.segments:
            if u is unit:
                changed = (new[lo:hi] != old[lo:hi]).to(master.device)
                master[changed] = new[lo:hi].to(master.device)[changed].float()

    def reset_masters_from_weights(self) -> None:
        """fp32 masters from the 16-bit weights and empty optimizer state (a load without
        optimizer states, as DeepSpeed does it)."""
        for unit, lo, hi, master in self.segments:
            master.copy_(self._own_slice(unit)[lo:hi])
        self.inner.state.clear()

    def _own_slice(self, unit: FlatUnit) -> torch.Tensor:
        """This rank's optimizer slice of the unit's primary shard (a view)."""
        ctx = unit.ctx
        return sub_chunk(unit.primary, ctx.topo, ctx.rank, unit.U, ctx.plan.weights, ctx.plan.optimizer)

    # ---- step boundary ------------------------------------------------------------------
    def _optimizer_grad(self, unit: FlatUnit) -> torch.Tensor:
        """Reduce the unit's gradient shard across levels into its fp32 optimizer slice."""
        return self._optimizer_grad_reduced(unit).float()

    def _optimizer_grad_reduced(self, unit: FlatUnit) -> torch.Tensor:
        """Reduce the unit's gradient shard across levels into its optimizer slice, in the
        training dtype (the tiled step up-casts it one tile at a time)."""
        chain = self._early.pop(id(unit), None)
        return (chain or _Chain(self._reduce_chain(unit))).finish()

    def start_reduction(self, unit: FlatUnit) -> None:
        """In the last micro-batch's backward, once ``unit``'s gradient shard is complete:
        issue its step-boundary reduction now (ledger phase ``step``), so that it crosses the
        nodes while backward computes the units before it; :meth:`step` waits for it. Same
        collectives, bytes and bits as in the step."""
        if self.at_boundary is None or unit.whole or not self.at_boundary():
            return
        stale = self._early.pop(id(unit), None)
        if stale is not None:  # reduced twice in one backward: the shard changed, reduce it again
            stale.finish()
            log.warn(f"ds_ext.zero_topo: unit {unit.name} reduced its gradients twice in one backward")
        with unit.ctx.comm.ledger.phase("step"):
            self._early[id(unit)] = _Chain(self._reduce_chain(unit))

    def _reduce_chain(self, unit: FlatUnit) -> Generator[InFlight | None, None, torch.Tensor]:
        """The collectives of :meth:`_optimizer_grad_reduced` (``schedule.step_reductions``) as a
        :class:`_Chain`."""
        ctx, plan = unit.ctx, unit.ctx.plan
        x = unit.grad_shard
        for c in schedule.step_reductions(plan):
            group = ctx.group(c.levels)
            if c.op == schedule.ALL_REDUCE:
                yield ctx.comm.all_reduce(x, group=group, async_op=True)
            elif c.op == schedule.ALL_TO_ALL_REDUCE:  # int8 blocks across nodes; fp32 partial sums out
                pending = all_to_all_reduce_async(ctx.comm, x, ctx.weight_quantizer, group)
                yield pending
                x = pending.wait()
            else:
                out = torch.empty(x.numel() // ctx.topo.levels[c.level].size, dtype=x.dtype, device=x.device)
                yield ctx.comm.reduce_scatter(out, x, group=group, async_op=True)
                x = out
        if plan.step == "allreduce":  # every rank of the gradient shard holds its sum: cut the slice
            return sub_chunk(x, ctx.topo, ctx.rank, unit.U, plan.gradients, plan.optimizer)
        return x

    def _gather_weights_chain(self, unit: FlatUnit, slice16: torch.Tensor) -> Generator[InFlight, None, None]:
        """All-gather the updated 16-bit optimizer slices back into the primary shard
        (``schedule.step_gathers``), as a :class:`_Chain`; its end writes the primary shard and
        rebuilds the secondary."""
        ctx, plan = unit.ctx, unit.ctx.plan
        x = slice16
        for c in schedule.step_gathers(plan):
            if len(c.levels) > 1:  # one gather of the whole unit over the optimizer group: cut the primary
                out = torch.empty(unit.U, dtype=x.dtype, device=x.device)
                yield ctx.comm.all_gather(out, x, group=ctx.span(c.level), async_op=True)
                x = chunk(to_shard_order(out, ctx.topo, list(c.levels)), ctx.topo, ctx.rank, plan.weights)
                continue
            out = torch.empty(x.numel() * ctx.topo.levels[c.level].size, dtype=x.dtype, device=x.device)
            if c.bits == 8:  # every rank, the owner too, takes the dequantized values
                yield all_gather_int(ctx.comm, x, ctx.weight_quantizer, out, ctx.group(c.levels), True)
            else:
                yield ctx.comm.all_gather(out, x, group=ctx.group(c.levels), async_op=True)
            x = out
        unit.install_primary(x)

    def _gather_all_weights(self, slices: Iterable[tuple[FlatUnit, torch.Tensor]]) -> None:
        """The weight all-gathers of every (unit, updated slice), pipelined unit by unit when
        the boundary overlaps (:class:`_Pipeline`), else each unit's in full before the next."""
        if self.at_boundary is None:
            for unit, slice16 in slices:
                _Chain(self._gather_weights_chain(unit, slice16)).finish()
            return
        pipeline = _Pipeline()
        for unit, slice16 in slices:  # a generator: the tiled step updates each unit on demand
            if self._in_flight is not None and not unit.whole:
                self._in_flight.add(unit, self._gather_weights_chain(unit, slice16))
            else:
                pipeline.start(self._gather_weights_chain(unit, slice16))
        pipeline.finish()

    def _decide_step(self, grads: Iterable[torch.Tensor], scale: float) -> float | None:
        """Global norm of the unscaled gradient (``grads``: one per segment; every element
        once, over the model-parallel group too: ``ds_ext.zero_topo.data_group``), overflow and
        loss-scale update, before any parameter changes. On overflow the secondaries built
        from stale weights are dropped. Returns the clip coefficient, if clipping."""
        contexts = {id(u.ctx): u.ctx for u in self.sharded.all_units}  # the same order on every rank
        sums = {key: torch.zeros(1, dtype=torch.float64, device=ctx.device) for key, ctx in contexts.items()}
        for g, counted, (unit, *_) in zip(grads, self._counted, self.segments, strict=True):
            if not counted:
                continue
            g = g.float()
            if scale != 1.0:
                g = g / scale
            sums[id(unit.ctx)] += g.double().pow_(2).sum()
        sumsq = 0.0
        for key, ctx in contexts.items():  # dense parameters, then experts over their own groups
            ctx.comm.all_reduce(sums[key], group=ctx.span(ctx.plan.optimizer))
            if ctx.model_group is not None:
                ctx.comm.all_reduce(sums[key], group=ctx.model_group)
            sumsq += sums[key].item()
        norm = math.sqrt(sumsq) if math.isfinite(sumsq) else float("inf")
        self._global_grad_norm = norm
        self.overflow = not math.isfinite(norm)
        self.scaler.update_scale(self.overflow)
        if self.overflow:
            for unit in self.sharded.all_units:
                if not unit.ctx.plan.secondary_from_primary:
                    unit.secondary = None
        return self.clip / (norm + 1e-6) if self.clip > 0 and norm > self.clip else None

    def _tiled_step(self, tiled: "TiledAdam") -> None:
        """The tiled, overlapped step (001 §7.2), bit-identical to the untiled one.

        The global norm and overflow are decided from the reduced 16-bit gradients before
        any tile is updated. Each unit's segments are then updated tile by tile through
        ``tiled``'s one fp32 buffer; its weight all-gather chain starts as soon as the unit
        is done, and every pending chain advances one collective after each later unit's
        update, so the gather of unit i runs during the update of unit i+1 (with
        ``overlap_step`` false, each unit's gather completes before the next update). The
        schedule depends only on unit order, so every rank issues each group's collectives in
        the same order.
        """
        units = self.sharded.all_units
        grads = {id(unit): self._optimizer_grad_reduced(unit) for unit in units}
        scale = self.scaler.loss_scale
        coef = self._decide_step((grads[id(u)][lo:hi] for u, lo, hi, _ in self.segments), scale)
        if self.overflow:
            return
        group_of = {id(p): g for g in self.inner.param_groups for p in g["params"]}

        def unscale_and_clip(buf: torch.Tensor) -> None:
            if scale != 1.0:
                buf.div_(scale)
            if coef is not None:
                buf.mul_(coef)

        host = None
        slices: dict[int, torch.Tensor] = {}
        if self.offload is not None:  # every slice exists before the copies into it start
            slices = {id(unit): self._own_slice(unit).clone() for unit in units}
            sources = [grads[id(u)][lo:hi] for u, lo, hi, _ in self.segments]
            host = HostStep(self.offload, sources, tiled.tile_size, unscale_and_clip)

        def updated() -> Iterator[tuple[FlatUnit, torch.Tensor]]:
            for unit in units:
                slice16 = slices.pop(id(unit)) if host is not None else self._own_slice(unit).clone()
                reduced = grads[id(unit)]
                for k, (u, lo, hi, master) in enumerate(self.segments):
                    if u is not unit:
                        continue
                    if host is not None:
                        load, store = host.load(k), host.store(master, slice16[lo:hi])
                    else:
                        src = reduced[lo:hi]

                        def load(buf: torch.Tensor, s: int, src: torch.Tensor = src) -> None:
                            buf.copy_(src[s : s + buf.numel()])
                            unscale_and_clip(buf)

                        def store(s: int, e: int, lo: int = lo, master: torch.Tensor = master) -> None:
                            slice16[lo + s : lo + e].copy_(master[s:e])

                    tiled.update(master, group_of[id(master)], load, store)
                if host is not None:
                    host.weights_ready()
                yield unit, slice16
            if host is not None:
                host.finish()
            tiled.end_step()

        self._gather_all_weights(updated())

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise DsExtConfigError("ds_ext.zero_topo: step(closure) is not supported; call step() after backward")
        self.settle()
        whole = [unit for unit in self.sharded.all_units if unit.whole]  # the pipeline form
        for unit in whole:  # the gradients autograd accumulated over the micro-batches, reduced once
            unit.reduce_gradients()
        if self.tiled is not None:
            self._tiled_step(self.tiled)
        else:
            self._untiled_step()
        for unit in self.sharded.all_units:
            unit.grad_shard.zero_()
        for unit in whole if not self.overflow else ():
            unit.regather()

    def settle(self) -> None:
        """Complete the previous step's weight gathers still in flight (collective)."""
        if self._in_flight is not None:
            self._in_flight.settle_all()

    def _untiled_step(self) -> None:
        """Up-cast every reduced gradient, run the inner optimizer, gather the weights."""
        grads = {id(unit): self._optimizer_grad(unit) for unit in self.sharded.all_units}
        for unit, lo, hi, master in self.segments:
            g = grads[id(unit)][lo:hi]
            scale = self.scaler.loss_scale
            master.grad = g / scale if scale != 1.0 else g
        coef = self._decide_step((m.grad for *_, m in self.segments), 1.0)
        if not self.overflow:
            if coef is not None:
                for *_, master in self.segments:
                    master.grad.mul_(coef)
            self.inner.step()
            self._gather_all_weights((unit, self._updated_slice(unit)) for unit in self.sharded.all_units)
        for *_, master in self.segments:
            master.grad = None

    def _updated_slice(self, unit: FlatUnit) -> torch.Tensor:
        """The unit's optimizer slice in 16 bits from its updated fp32 masters."""
        slice16 = self._own_slice(unit).clone()
        for u, lo, hi, master in self.segments:
            if u is unit:
                slice16[lo:hi].copy_(master)
        return slice16

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1 without fp16), as DeepSpeed's optimizers report it."""
        return self.scaler.loss_scale

    cur_scale = loss_scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        for unit in self.sharded.all_units:
            for p in unit.params:
                p.grad = None

    def state_bytes(self) -> int:
        n = sum(m.numel() * m.element_size() for *_, m in self.segments)
        for st in self.inner.state.values():
            n += sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor) and v.dim())
        return n

    def shard_state(self, units: list | None = None) -> dict:
        """This rank's part of a checkpoint for ``units`` (None: all), which
        :func:`ds_ext.zero_topo.checkpoint.shard_state` writes with the save's metadata: the units'
        parameter table, the rank's optimizer slice of each unit's 16-bit weights, one segment per
        trainable piece of it (fp32 master and optimizer state), the optimizer's param groups and
        the loss scaler."""
        from ds_ext.integration import ds_engine  # DeepSpeed is imported on use

        opt = self
        units = self.sharded.all_units if units is None else units
        chosen = {id(unit) for unit in units}
        index = {id(m): i for i, g in enumerate(opt.inner.param_groups) for m in g["params"]}
        slices, segments = [], []
        for unit in units:
            start, stop = opt.own_range(unit)
            slices.append({"unit": unit.name, "start": start, "stop": stop, "weights": opt._own_slice(unit).clone()})
        for unit, lo, hi, master in opt.segments:
            if id(unit) not in chosen:
                continue
            start, _ = opt.own_range(unit)
            state = {
                k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.inner.state.get(master, {}).items()
            }
            segments.append(
                {
                    "unit": unit.name,
                    "start": start + lo,
                    "stop": start + hi,
                    "group": index[id(master)],
                    "master": master.clone(),
                    "state": state,
                }
            )
        groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.inner.param_groups]
        return {
            "units": ckpt.unit_table(units),
            "slices": slices,
            "segments": segments,
            "optimizer": {"class": type(opt.inner).__name__, "param_groups": groups},
            "loss_scaler": ds_engine.loss_scaler_state(self.scaler),
        }

    def load_shard_state(self, loaded: dict, optimizer_states: bool) -> None:
        """Install what ``CheckpointIO`` read for this rank (the checkpoint resharded onto this
        world; units are held: ``full`` is valid)."""
        from ds_ext.integration import ds_engine  # DeepSpeed is imported on use

        opt = self
        for unit in self.sharded.all_units:
            unit.primary.copy_(loaded["primaries"][unit.name])
            unit.rebuild_secondary()
        if not optimizer_states:
            opt.reset_masters_from_weights()
            return
        for unit, lo, hi, master in opt.segments:
            values, state = loaded["segments"][unit.name, lo]
            master.copy_(values)
            opt.install_state(master, {k: _state_value(master, k, v, opt.inner.defaults) for k, v in state.items()})
        for group, saved in zip(opt.inner.param_groups, loaded["groups"]):
            group.update(saved)
        ds_engine.load_loss_scaler_state(self.scaler, loaded["scaler"])

    def state_dict(self):
        """DeepSpeed stores this from rank 0 only; the real state goes to per-rank shard files."""
        return {"ds_ext_zero_topo": "optimizer state is in the per-rank ds_ext_zero_topo_rank*.pt files"}

    def load_state_dict(self, state_dict, load_optimizer_states: bool = True):
        """DeepSpeed's part of a load; the state comes from the shard files
        (``ds_ext.zero_topo.checkpoint``)."""
        if "ds_ext_zero_topo" not in state_dict:
            raise DsExtConfigError(
                "ds_ext.zero_topo: this checkpoint was not written by ds_ext.zero_topo; allowed: "
                "a checkpoint saved with ds_ext.zero_topo enabled"
            )
