"""Per-rank state the converted layers share: grid axes, collectives, overlap, tuning.

Every collective of 3D-PMM passes through :class:`PMMEngine`, which calls the ds_ext
:class:`~ds_ext.comm.Communicator` (so the ledger counts bytes per topology level and the
alpha-beta emulator holds each one for its cost), skips axes of size one, and, with
``ledger_by_layer``, records a layer's collectives under the phase ``<phase>/<layer>``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from ds_ext.comm import Communicator, Handle, backend_device
from ds_ext.comm.mappings import copy_to_region, copy_to_region_bucketed
from ds_ext.pmm.config import OverlapConfig
from ds_ext.pmm.grid import Axis
from ds_ext.pmm.overlap import AllGatherPrefetcher, DeferredGradients
from ds_ext.pmm.tuning import MatmulTuner

_DONE = Handle(None, 0.0)


class PMMEngine:
    """Axes x, y, z, data of this rank and the machinery of 001 §5.1.3-5.1.4."""

    def __init__(
        self,
        axes: dict[str, Axis],
        comm: Communicator,
        overlap: OverlapConfig | None = None,
        tune_matmul: bool = False,
        ledger_by_layer: bool = False,
    ) -> None:
        self.x, self.y, self.z, self.data = axes["x"], axes["y"], axes["z"], axes["data"]
        self.comm = comm
        self.overlap = overlap or OverlapConfig()
        self.ledger_by_layer = ledger_by_layer
        self.tuner = MatmulTuner(self._world_gather()) if tune_matmul else None
        self.prefetcher = AllGatherPrefetcher() if self.overlap.all_gather else None
        self.deferred = DeferredGradients() if self.overlap.reduce_scatter else None
        # per forward pass: one gradient-reducing view per replicated parameter
        self._replicated_views: dict[int, torch.Tensor] = {}
        self._pass_replicated: set[int] = set()  # ids of this pass's replicated parameters
        # ZeRO-topo's gather units (:meth:`bucket_by_unit`): each parameter's unit
        self._unit_of: dict[int, list[torch.nn.Parameter]] | None = None

    def _world_gather(self):
        multi = dist.is_initialized() and dist.get_world_size() > 1
        return self.all_gather_world if multi else None

    # ---- ledger tags ---------------------------------------------------------------------
    @contextlib.contextmanager
    def tag(self, layer: str | None) -> Iterator[None]:
        if not (self.ledger_by_layer and layer):
            yield
            return
        ledger = self.comm.ledger
        with ledger.phase(f"{ledger.current_phase}/{layer}"):
            yield

    # ---- collectives (no call for an axis of size one) -------------------------------------
    def all_reduce(
        self,
        t: torch.Tensor,
        axis: Axis,
        layer: str | None = None,
        async_op: bool = False,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    ) -> Handle:
        if axis.size == 1:
            return _DONE
        with self.tag(layer):
            h = self.comm.all_reduce(t, op=op, group=axis.group, async_op=async_op)
        return h or _DONE

    def all_gather(
        self, out: torch.Tensor, inp: torch.Tensor, axis: Axis, layer: str | None = None, async_op: bool = False
    ) -> Handle:
        if axis.size == 1:
            out.copy_(inp.view_as(out))
            return _DONE
        with self.tag(layer):
            h = self.comm.all_gather(out, inp, group=axis.group, async_op=async_op)
        return h or _DONE

    def reduce_scatter(
        self, out: torch.Tensor, inp: torch.Tensor, axis: Axis, layer: str | None = None, async_op: bool = False
    ) -> Handle:
        if axis.size == 1:
            out.copy_(inp.view_as(out))
            return _DONE
        with self.tag(layer):
            h = self.comm.reduce_scatter(out, inp, group=axis.group, async_op=async_op)
        return h or _DONE

    def all_gather_world(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's host tensor ``t`` (equal sizes) concatenated in rank order, on the host
        (matmul tuning's agreed point); it travels on the device the backend takes."""
        dev = backend_device()
        out = torch.empty(dist.get_world_size() * t.numel(), dtype=t.dtype, device=dev)
        self.comm.all_gather(out, t.to(dev))
        return out.cpu()

    # ---- matmuls ---------------------------------------------------------------------------
    def matmul(self, site: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a @ b``, in the fastest mode found for this call site when tuning is on."""
        if self.tuner is None:
            return a @ b
        return self.tuner.matmul(site, a, b)

    # ---- per forward pass ------------------------------------------------------------------
    def begin_forward(
        self, weights: list[torch.nn.Parameter], replicated: list[torch.nn.Parameter] | None = None
    ) -> None:
        """Called at the model's forward start: ``replicated`` (the parameters held replicated
        over Z: biases, norm vectors) pass through one gradient bucket, summed over Z in one
        all-reduce per backward (one bucket per gather unit under :meth:`bucket_by_unit`); ORS
        gate over ``weights``; no prefetch issued before (an optimizer step may have run since)
        survives into the pass; matmul tuning's window opens or its agreed point is reached
        (every rank in step)."""
        self._replicated_views.clear()
        params = [p for p in replicated or () if p.requires_grad]
        self._pass_replicated = set()
        if self.z.size > 1 and torch.is_grad_enabled() and params:
            if self._unit_of is None:
                self._bucket(params)
            else:  # each unit's bucket when its first parameter is used (the unit is gathered then)
                self._pass_replicated = {id(p) for p in params}
        if self.prefetcher is not None:
            self.prefetcher.drop()
        if self.tuner is not None:
            self.tuner.begin_forward(torch.is_grad_enabled())
        if self.deferred is not None:
            self.deferred.open(weights)

    def _bucket(self, params: list[torch.nn.Parameter]) -> None:
        views = copy_to_region_bucketed(params, self.comm, self.z.group)
        self._replicated_views.update({id(p): v for p, v in zip(params, views)})

    def bucket_by_unit(self, units: list[list[torch.nn.Parameter]]) -> None:
        """Parameters valid only while their gather unit is (ZeRO-topo over the ``data`` axis):
        the Z bucket of a forward pass is built per unit, at the first use of one of its
        parameters, instead of over every replicated parameter at the forward's start."""
        self._unit_of = {id(p): unit for unit in units for p in unit}

    def end_forward(self) -> None:
        self._replicated_views.clear()
        self._pass_replicated = set()
        if self.deferred is not None:
            self.deferred.close()

    def replicated(self, param: torch.nn.Parameter) -> torch.Tensor:
        """``param`` for a module that holds it replicated over Z (and X or Y).

        Z splits the batch rows, so the gradients of such a parameter are partial sums
        over Z: the returned view sums its gradient over Z in backward, once per forward pass
        however often the parameter is used: in the forward's bucket (:meth:`begin_forward`),
        or, for a parameter outside it (a layer called on its own, an activation-checkpoint
        recompute after the forward), in an all-reduce of its own.
        """
        if self.z.size == 1 or not torch.is_grad_enabled() or not param.requires_grad:
            return param
        view = self._replicated_views.get(id(param))
        if view is None and id(param) in self._pass_replicated:
            unit = self._unit_of.get(id(param), [param])
            self._bucket([p for p in unit if id(p) in self._pass_replicated])
            self._pass_replicated.difference_update(id(p) for p in unit)
            view = self._replicated_views[id(param)]
        if view is None:
            view = copy_to_region(param, self.comm, self.z.group)
            self._replicated_views[id(param)] = view
        return view

    def weight_input(self, param: torch.nn.Parameter) -> torch.Tensor:
        """What a PMM layer feeds its autograd function: the ORS-gated view, if any."""
        if self.deferred is not None:
            return self.deferred.view(param)
        return param

    def input_with_gate(self, x: torch.Tensor) -> torch.Tensor:
        """The first PMM layer of a forward pass ties the ORS gate into its input."""
        if self.deferred is not None:
            return self.deferred.tie(x)
        return x
