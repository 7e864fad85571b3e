"""``ds-ext plan``: every plan of every family for one model on one machine, ranked.

Families: the ZeRO-topo presets (``zero_plans``) and the 3D-PMM grids (``pmm_grids``) for a
dense model, the TED layouts (``ted_layouts``) for an MoE; plus the plan a ds_config selects
(``dsconfig``). Each
candidate is evaluated at the fewest micro-steps whose memory fits
(:func:`ds_ext.planner.estimate.evaluate`); the fitting ones are ranked by predicted step
time, the best and the runner-up first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from ds_ext.planner import PlannerError, pmm_grids, ted_layouts, zero_plans
from ds_ext.planner.estimate import Candidate, Estimate, Job, evaluate
from ds_ext.planner.machine import Machine
from ds_ext.planner.models import Arch

FAMILIES: dict[str, Callable[[Job], list[Candidate]]] = {
    "zero": zero_plans.candidates,
    "pmm3d": pmm_grids.candidates,
    "ted": ted_layouts.candidates,
}


class PlanInputError(PlannerError):
    """Planner input that cannot be planned; the message names the argument."""


def make_job(arch: Arch, machine: Machine, nodes: int, global_batch: int | None = None, grad_accum: int | None = None,
             bandwidth_GBps: dict[str, float] | None = None, latency_us: dict[str, float] | None = None,
             elem_bytes: int = 2) -> Job:
    """The job of ``arch`` on ``nodes`` nodes; the batch defaults to the model's recipe."""
    topology = machine.build_topology(nodes, bandwidth_GBps, latency_us)
    batch = global_batch or arch.recipe.sequences(topology.world_size)
    accum = grad_accum if global_batch or grad_accum else arch.recipe.grad_accum
    if accum is not None and batch % accum:
        raise PlanInputError(f"--grad-accum: {accum} does not divide the global batch of {batch} sequences")
    return Job(arch, machine, topology, batch, accum, elem_bytes)


@dataclass(frozen=True)
class PlanResult:
    job: Job
    estimates: tuple[Estimate, ...]  # every plan the batch can be split for, fastest first

    @property
    def ranked(self) -> list[Estimate]:
        """Plans that fit, fastest predicted step first."""
        return [e for e in self.estimates if e.fits]

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None

    @property
    def runner_up(self) -> Estimate | None:
        return self.ranked[1] if len(self.ranked) > 1 else None


def plan(job: Job, families: Iterable[str] = tuple(FAMILIES), extra: Iterable[Candidate] = ()) -> PlanResult:
    """Evaluate every candidate of ``families`` and ``extra``; rank them."""
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise PlanInputError(f"--families: unknown {', '.join(unknown)}; allowed: {', '.join(FAMILIES)}")
    cands = [c for f in families for c in FAMILIES[f](job)] + list(extra)
    estimates = [e for e in (evaluate(job, c) for c in cands) if e is not None]
    estimates.sort(key=lambda e: (not e.fits, e.step_s))
    return PlanResult(job, tuple(estimates))
