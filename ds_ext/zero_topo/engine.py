"""ZeRO-topo sharded data parallelism: gather/release hooks and the sharded step (003 §V).

Per micro-batch (nothing crosses a node for the ``zero_topo`` plans):
  forward   gather each unit from its primary (or narrower secondary) shard, prefetching
            the next unit; release it after its forward;
  backward  re-gather from the secondary, prefetching the previous unit; when all of a
            unit's grads exist, reduce them over the gradient group into the grad shard
            (plain reduce-scatter, or int4 all-to-all with 1 or 2 hops) and release.
Per optimizer step (:class:`ZeroTopoOptimizer`):
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

import contextlib
import math
from typing import Any, Callable, Generator, Iterable, Iterator

import torch
from deepspeed.moe.utils import is_moe_param
from torch import nn

from ds_ext import log
from ds_ext.comm.collectives import InFlight
from ds_ext.comm.quantized import all_gather_int, all_to_all_reduce_async
from ds_ext.errors import DsExtConfigError, DsExtError
from ds_ext.optim.config import DEFAULT_TILE_SIZE
from ds_ext.optim.offload import HostStep, OffloadPlacementError, OffloadStore
from ds_ext.optim.tiled import TiledAdam
from ds_ext.zero_topo.layout import chunk, shard_count, shard_index, sub_chunk, to_shard_order
from ds_ext.zero_topo.perf import UnitSpec
from ds_ext.zero_topo.units import FlatUnit, ShardContext


def _eager(hook):
    """``hook`` run eagerly where ``torch.compile`` traces the module: gathers, releases and
    collectives stay outside the compiled graphs (which see the gathered parameters)."""
    return torch.compiler.disable(hook, recursive=True)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class UnitError(DsExtError, ValueError):
    """A model ZeRO-topo cannot cut into gather/release units."""


class ReleasedError(DsExtError, RuntimeError):
    """Sharded weights asked for where ZeRO-topo cannot gather them: a module called outside its
    unit's forward, a ``state_dict()`` that not every rank calls."""


def find_units(model: nn.Module, names: list[str] | str) -> list[tuple[str, nn.Module]]:
    """Modules wrapped as units: entries of every ModuleList ('auto') or by class name.

    Class names of which none matches a module are an error (some of several not matching,
    as in one config shared by model families, a warning); finding no unit with 'auto' is
    a warning (the whole model becomes one unit, gathered whole for every forward).
    """
    found = []
    for qual, mod in model.named_modules():
        if mod is model:
            continue
        if names == "auto":
            parent = qual.rsplit(".", 1)[0] if "." in qual else ""
            if isinstance(model.get_submodule(parent) if parent else model, nn.ModuleList):
                found.append((qual, mod))
        elif type(mod).__name__ in names:
            found.append((qual, mod))
    if names != "auto":
        present = {type(m).__name__ for m in model.modules()}
        missing = [n for n in names if n not in present]
        if len(missing) == len(names):
            raise UnitError(
                f"ds_ext.zero_topo.units: no module of class {', '.join(map(repr, missing))} in the model; "
                f"allowed: 'auto' or class names present, e.g. {', '.join(sorted(present)[:12])}"
            )
        if missing:
            log.warn(
                f"ds_ext.zero_topo.units: no module of class {', '.join(map(repr, missing))} in this "
                "model (the other class names match)"
            )
    if not found and names == "auto":
        log.warn(
            "ds_ext.zero_topo: the model has no nn.ModuleList, so units='auto' found no unit: the whole model "
            "becomes one unit, gathered whole for every forward; set ds_ext.zero_topo.units to the class names "
            "of its blocks to shard layer by layer",
        )
    # drop units nested inside another unit
    return [(q, m) for q, m in found if not any(q.startswith(o + ".") for o, _ in found if o != q)]


def assign_parameters(
    model: nn.Module, units: list[tuple[str, nn.Module]]
) -> list[list[tuple[nn.Parameter, tuple[str, ...]]]]:
    """(parameter, its qualified names) of each unit; the last list holds the root's
    (the parameters outside every unit).

    A parameter shared by two units is refused by name: only one unit is gathered at a time.
    One shared by a unit and the root belongs to the root, which stays gathered through
    forward and backward.
    """
    owners: dict[int, list[tuple[str, int | None]]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        unit = next((i for i, (q, _) in enumerate(units) if name.startswith(q + ".")), None)
        owners.setdefault(id(p), []).append((name, unit))
        params[id(p)] = p
    out: list[list[tuple[nn.Parameter, tuple[str, ...]]]] = [[] for _ in range(len(units) + 1)]
    for pid, names in owners.items():
        in_units = {u for _, u in names if u is not None}
        if len(in_units) > 1:
            shown = " and ".join(repr(n) for n, _ in names)
            raise UnitError(
                f"ds_ext.zero_topo: parameter {shown} is shared by units "
                f"{', '.join(units[u][0] for u in sorted(in_units))}; ZeRO-topo gathers one unit at a time: "
                "untie it, or set ds_ext.zero_topo.units so one unit holds every module that uses it"
            )
        root = any(u is None for _, u in names) or not in_units
        out[-1 if root else in_units.pop()].append((params[pid], tuple(n for n, _ in names)))
    return out


def _split_experts(params: list[tuple[nn.Parameter, tuple[str, ...]]]) -> tuple[list, list]:
    return [e for e in params if not is_moe_param(e[0])], [e for e in params if is_moe_param(e[0])]


STATE_DICT_WAIT_S = 120.0  # how long a state_dict() waits for the other ranks to ask too
_arrivals: dict[str, int] = {}


def every_rank_arrives(what: str, rank: int, wait_s: float | None = None) -> None:
    """Wait until every rank has reached its n-th call of ``what`` (n counted per process),
    through the job's rendezvous store, for at most ``wait_s`` (default
    :data:`STATE_DICT_WAIT_S`); then raise one line naming the ranks missing, so a call made
    on some ranks only fails instead of hanging in the collective that follows."""
    import time

    import torch.distributed as dist

    n = _arrivals[what] = _arrivals.get(what, 0) + 1
    store = dist.distributed_c10d._get_default_store()
    world = dist.get_world_size()
    key = f"ds_ext/zero_topo/{what}/{n}"
    store.set(f"{key}/{rank}", b"1")
    wait_s = STATE_DICT_WAIT_S if wait_s is None else wait_s
    deadline = time.monotonic() + wait_s
    arrived = store.add(key, 1)
    while arrived < world:
        if time.monotonic() > deadline:
            missing = [r for r in range(world) if not store.check([f"{key}/{r}"])]
            raise ReleasedError(
                f"ds_ext.zero_topo: {what}() gathers the sharded weights and needs every rank, but rank(s) "
                f"{missing} did not call it within {wait_s:.0f} s; call it on every rank (Hugging Face's "
                "save_model does), or inside `with engine.ds_ext.gathered_parameters():`"
            )
        time.sleep(0.01)
        arrived = store.add(key, 0)


class ShardedModel:
    """Installs the unit hooks on ``model`` and owns its :class:`FlatUnit` s."""

    def __init__(
        self, model: nn.Module, ctx: ShardContext, unit_names, prefetch: bool, expert_ctx: ShardContext | None = None
    ) -> None:
        """``expert_ctx``: the context of MoE expert parameters (``allreduce=False``, DeepSpeed's
        mark), sharded over their expert-data-parallel group: each unit's experts become a unit
        of their own, gathered and released with it."""
        self.model = model
        self.ctx = ctx
        self.expert_ctx = expert_ctx
        self.prefetch = prefetch
        wrapped = find_units(model, unit_names)
        *unit_params, rest = assign_parameters(model, wrapped)
        self.units: list[FlatUnit] = []
        for (qual, mod), params in zip(wrapped, unit_params):
            dense, experts = _split_experts(params)
            for name, part, part_ctx in ((qual, dense, ctx), (f"{qual}<experts>", experts, expert_ctx)):
                if part:
                    unit = FlatUnit(name, [p for p, _ in part], part_ctx, [n for _, n in part])
                    self.units.append(unit)
                    mod.register_forward_pre_hook(_eager(self._pre_forward(unit)))
                    mod.register_forward_hook(_eager(self._post_forward(unit)))
        rest, root_experts = _split_experts(rest)
        if root_experts:
            raise UnitError(
                f"ds_ext.zero_topo.units: expert parameter {root_experts[0][1][0]!r} is outside every "
                "unit; allowed: units that hold each MoE layer (e.g. the transformer block's class)"
            )
        self.root = FlatUnit("<root>", [p for p, _ in rest], ctx, [n for _, n in rest]) if rest else None
        self.all_units = ([self.root] if self.root else []) + self.units
        for unit in self.all_units:
            for p in unit.params:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(_eager(self._grad_ready(unit)))
        model.register_forward_pre_hook(_eager(self._model_pre_forward))
        model.register_forward_hook(_eager(self._model_post_forward))
        self._guard_released_calls(model)  # after the gathering hooks: they run first
        self._gather_for_state_dict(model)
        self._order: list[FlatUnit] = []
        self._callback_queued = False
        self.peak_state_bytes: dict[str, int] = {}
        self.reduced: Callable[[FlatUnit], None] | None = None  # called with each unit whose gradients were reduced

    def _guard_released_calls(self, model: nn.Module) -> None:
        """A module called while its parameters are released (outside its unit's forward,
        e.g. ``engine.module.blocks[0].fc1(x)``) raises one clear line instead of computing
        with empty tensors."""
        unit_of = {id(p): u for u in self.all_units for p in u.params}
        for qual, mod in model.named_modules():
            owners = {id(unit_of[id(p)]): unit_of[id(p)] for p in mod.parameters(recurse=False) if id(p) in unit_of}
            if not owners:
                continue

            def check(module, args, qual=qual, owners=tuple(owners.values())):
                released = [u.name for u in owners if not u.gathered]
                if released:
                    raise ReleasedError(
                        f"ds_ext.zero_topo: module {qual or type(module).__name__!r} is called while the parameters "
                        f"of unit {released[0]!r} are released (outside its forward); call it inside "
                        "`with engine.ds_ext.gathered_parameters():`"
                    )

            mod.register_forward_pre_hook(_eager(check))

    def _gather_for_state_dict(self, model: nn.Module) -> None:
        """``state_dict()`` of the model or any submodule returns full weights: the units it
        needs are held for the call (a collective, like DeepSpeed's
        ``stage3_gather_16bit_weights_on_model_save``; Hugging Face's ``save_model`` calls it
        on every rank). The returned tensors stay valid after the units are released. A rank
        that asks alone gets one line after :data:`STATE_DICT_WAIT_S` instead of a hang."""
        unit_of = {id(p): u for u in self.all_units for p in u.params}
        active: list[list[FlatUnit]] = []

        def pre(module, prefix, keep_vars):
            if active:  # inside an outer state_dict(): its units are held
                active.append([])
                return
            units = {id(unit_of[id(p)]): unit_of[id(p)] for p in module.parameters() if id(p) in unit_of}
            needed = [u for u in units.values() if not u.held]
            if any(not u.gathered for u in needed):
                every_rank_arrives("state_dict", self.ctx.global_rank)
            else:
                needed = []
            for unit in needed:
                unit.hold()
            active.append(needed)

        def post(module, state_dict, prefix, local_metadata):
            for unit in active.pop():
                unit.unhold()

        for mod in model.modules():
            mod.register_state_dict_pre_hook(pre)
            mod.register_state_dict_post_hook(post)

    # ---- forward ------------------------------------------------------------------------
    def _model_pre_forward(self, module, args):
        if not _in_backward():
            self._order = []
        if self.root is not None:
            self.root.wait_gather()

    def _model_post_forward(self, module, args, output):
        if self.root is not None and not torch.is_grad_enabled():
            self.root.release()

    def _pre_forward(self, unit: FlatUnit):
        def hook(module, args):
            backward = _in_backward()
            unit.start_gather(backward)
            unit.wait_gather()
            if not backward:
                self._order.append(unit)
                nxt = self._neighbour(unit, +1)
                if self.prefetch and nxt is not None:
                    nxt.start_gather(backward=False)

        return hook

    def _post_forward(self, unit: FlatUnit):
        def hook(module, args, output):
            if _in_backward():
                return output  # recomputation for activation checkpointing: keep for backward
            unit.release()
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(_eager(self._pre_backward(unit)))
                        break
            return output

        return hook

    def _neighbour(self, unit: FlatUnit, step: int) -> FlatUnit | None:
        order = self._order if step < 0 else self.units
        if unit not in order:
            return None
        i = order.index(unit) + step
        return order[i] if 0 <= i < len(order) else None

    # ---- backward -----------------------------------------------------------------------
    def _pre_backward(self, unit: FlatUnit):
        def hook(grad):
            self._queue_final_callback()
            unit.start_gather(backward=True)
            unit.wait_gather()
            prev = self._neighbour(unit, -1)
            if self.prefetch and prev is not None:
                prev.start_gather(backward=True)
            return grad

        return hook

    def _grad_ready(self, unit: FlatUnit):
        n = sum(p.requires_grad for p in unit.params)

        def hook(param):
            self._queue_final_callback()
            unit.grads_ready += 1
            if unit.grads_ready == n:
                self._reduce(unit)
                unit.release()

        return hook

    def _reduce(self, unit: FlatUnit) -> None:
        unit.reduce_gradients()
        if self.reduced is not None:
            self.reduced(unit)

    def _queue_final_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        """Reduce units whose parameters got no gradient in this backward (unused ones)."""
        self._callback_queued = False
        self.peak_state_bytes = {k: max(v, self.peak_state_bytes.get(k, 0)) for k, v in self.state_bytes().items()}
        for unit in self.all_units:
            if unit.grads_ready:
                self._reduce(unit)
            if unit.gathered and not unit.held:
                unit.release()

    def unit_specs(self, ctx: ShardContext | None = None):
        """The units of ``ctx`` (default: the dense parameters') as the analytic model sees them
        (ds_ext.zero_topo.perf.UnitSpec)."""
        ctx = ctx or self.ctx
        n_g = shard_count(ctx.topo, ctx.plan.gradients)
        return [
            UnitSpec(
                u.U,
                u.numel,
                u is self.root,
                spans=tuple(
                    (o, o + shape.numel()) for p, o, shape in zip(u.params, u.offsets, u.shapes) if p.requires_grad
                ),
                raw_per_shard=tuple(u.raw_blocks.view(n_g, -1).sum(1).tolist()),
            )
            for u in self.all_units
            if u.ctx is ctx
        ]

    def units_of(self, params: Iterable[torch.Tensor] | None) -> list[FlatUnit]:
        """The units holding ``params`` (every unit for None), in model order."""
        if params is None:
            return list(self.all_units)
        wanted = {id(p) for p in params}
        return [u for u in self.all_units if any(id(p) in wanted for p in u.params)]

    @contextlib.contextmanager
    def held(self, units: list[FlatUnit]) -> Iterator[None]:
        """Keep ``units``' exact 16-bit weights gathered in buffers of their own (collective)."""
        done = []
        try:
            for unit in units:
                unit.hold()
                done.append(unit)
            yield
        finally:
            for unit in done:
                unit.unhold()

    def state_bytes(self) -> dict[str, int]:
        out = {"primary": 0, "secondary": 0, "gradients": 0}
        for unit in self.all_units:
            for k, v in unit.state_bytes().items():
                out[k] += v
        return out


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


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
        """The collectives of :meth:`_optimizer_grad_reduced` as a :class:`_Chain`."""
        ctx, plan = unit.ctx, unit.ctx.plan
        top = len(ctx.topo.levels) - 1
        x = unit.grad_shard
        if plan.step == "allreduce":
            if plan.gradients < top:
                yield ctx.comm.all_reduce(x, group=ctx.group(range(plan.gradients + 1, top + 1)), async_op=True)
            return sub_chunk(x, ctx.topo, ctx.rank, unit.U, plan.gradients, plan.optimizer)
        for level in range(plan.gradients + 1, plan.optimizer + 1):
            if plan.step_level_bits(level) == 8:  # int8 blocks across nodes; fp32 partial sums out
                pending = all_to_all_reduce_async(ctx.comm, x, ctx.weight_quantizer, ctx.group([level]))
                yield pending
                x = pending.wait()
                continue
            out = torch.empty(x.numel() // ctx.topo.levels[level].size, dtype=x.dtype, device=x.device)
            yield ctx.comm.reduce_scatter(out, x, group=ctx.group([level]), async_op=True)
            x = out
        if plan.optimizer < top:
            yield ctx.comm.all_reduce(x, group=ctx.group(range(plan.optimizer + 1, top + 1)), async_op=True)
        return x

    def _gather_weights_chain(self, unit: FlatUnit, slice16: torch.Tensor) -> Generator[InFlight, None, None]:
        """All-gather the updated 16-bit optimizer slices back into the primary shard, as a
        :class:`_Chain`; its end writes the primary shard and rebuilds the secondary."""
        ctx, plan = unit.ctx, unit.ctx.plan
        x = slice16
        if plan.step == "allreduce" and plan.optimizer > plan.weights:
            levels = list(range(plan.optimizer + 1))
            out = torch.empty(unit.U, dtype=x.dtype, device=x.device)
            yield ctx.comm.all_gather(out, x, group=ctx.span(plan.optimizer), async_op=True)
            x = chunk(to_shard_order(out, ctx.topo, levels), ctx.topo, ctx.rank, plan.weights)
        else:
            for level in range(plan.optimizer, plan.weights, -1):
                out = torch.empty(x.numel() * ctx.topo.levels[level].size, dtype=x.dtype, device=x.device)
                if plan.step_level_bits(level) == 8:  # every rank, the owner too, takes the dequantized values
                    yield all_gather_int(ctx.comm, x, ctx.weight_quantizer, out, ctx.group([level]), True)
                else:
                    yield ctx.comm.all_gather(out, x, group=ctx.group([level]), async_op=True)
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
