"""ZeRO-topo's sharded model: the gather / release hooks of forward and backward and the
gradient reduction (003 §V-A, §V-B).

Per micro-batch (nothing crosses a node for the ``zero_topo`` plans):
  forward   gather each unit from its primary (or narrower secondary) shard, prefetching
            the next unit; release it after its forward;
  backward  re-gather from the secondary, prefetching the previous unit; when all of a
            unit's grads exist, reduce them over the gradient group into the grad shard
            (plain reduce-scatter, or int4 all-to-all with 1 or 2 hops) and release.
The collectives are ``ds_ext.zero_topo.schedule``'s, issued by each unit
(:class:`ds_ext.zero_topo.units.FlatUnit`); the optimizer step is
:mod:`ds_ext.zero_topo.optimizer`'s.

Sharding contract: each rank holds every unit's primary shard (and secondary, if any) and its
gradient shard; a unit's full 16-bit weights exist only while it is gathered (inside its
modules' forward and backward, or :meth:`ShardedModel.held`).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator

import torch
from deepspeed.moe.utils import is_moe_param
from torch import nn

from ds_ext import log
from ds_ext.errors import DsExtError
from ds_ext.zero_topo.layout import shard_count
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
