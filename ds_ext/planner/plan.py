"""``ds-ext plan``: every plan of every family for one model on one machine, ranked.

Families: the ZeRO-topo presets (``zero_plans``), the 3D-PMM grids (``pmm_grids``) and Megatron's
TP x PP x DP layouts (``megatron_plans``) for a dense model, the TED layouts (``ted_layouts``) for
an MoE; plus the plan a ds_config selects
(``dsconfig``). Each
candidate is evaluated at the fewest micro-steps whose memory fits
(:func:`ds_ext.planner.estimate.evaluate`); the fitting ones are ranked by predicted step
time, the best and the runner-up first. Nothing is dropped silently: every candidate
a family does not build (divisibility, model states over the device) and every one whose batch
cannot be split is in :attr:`PlanResult.dropped` with its reason; when no plan fits,
:func:`what_would_fit` finds the fewest nodes, or the smaller batch, at which one does. A job with a
``sparsity`` (``--sparsity``: the model pruned, trained with SAMO, 001 ch. 4) adds the Megatron
layouts' SAMO forms (``samo_plans``), checked by :func:`check_sparsity` before anything is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from ds_ext.planner import PlannerError, megatron_plans, pmm_grids, ted_layouts, zero_plans
from ds_ext.planner.estimate import Candidate, Dropped, Estimate, Job, evaluate, unsplittable
from ds_ext.planner.machine import Machine
from ds_ext.planner.models import Arch

FAMILIES: dict[str, Callable[[Job], tuple[list[Candidate], list[Dropped]]]] = {
    "zero": zero_plans.candidates,
    "pmm3d": pmm_grids.candidates,
    "ted": ted_layouts.candidates,
    "megatron": megatron_plans.candidates,
}


MOE_FAMILIES = ("ted",)  # the families that plan an MoE; the others plan a dense model


class PlanInputError(PlannerError):
    """Planner input that cannot be planned; the message names the argument."""


def check_families_apply(arch: Arch, families: list[str]) -> None:
    """Refuse ``--families`` none of which plans this kind of model (dense or MoE): an empty
    table is not an answer."""
    moe = arch.experts > 1
    if not any((f in MOE_FAMILIES) == moe for f in families):
        allowed = [f for f in FAMILIES if (f in MOE_FAMILIES) == moe]
        raise PlanInputError(
            f"--families {' '.join(families)}: none plans {arch.name} "
            f"({'an MoE' if moe else 'a dense model'}); allowed: {', '.join(allowed)}"
        )


def check_sparsity(job: Job, families: list[str]) -> None:
    """Refuse a ``--sparsity`` outside [0, 1), with an MoE, or without the megatron family, where
    SAMO's layouts are (``samo_plans``)."""
    p = job.sparsity
    if p is None:
        return
    allowed = "allowed: --sparsity in [0, 1) (the pruned fraction) with a dense model and the megatron family"
    if not 0 <= p < 1:
        raise PlanInputError(f"--sparsity: {p:g} is not a pruned fraction; {allowed}")
    if job.arch.experts > 1:
        raise PlanInputError(f"--sparsity {p:g}: {job.arch.name} is an MoE, which SAMO does not train; {allowed}")
    if "megatron" not in families:
        raise PlanInputError(
            f"--sparsity {p:g}: --families {' '.join(families)} has no megatron, the family of SAMO's layouts; {allowed}"
        )


def make_job(
    arch: Arch,
    machine: Machine,
    nodes: int,
    global_batch: int | None = None,
    grad_accum: int | None = None,
    elem_bytes: int = 2,
    batch_source: str = "--global-batch",
    sparsity: float | None = None,
) -> Job:
    """The job of ``arch`` on ``nodes`` nodes; the batch defaults to the model's recipe, and the
    job says where its batch comes from (``batch_source`` for a given one); ``sparsity``: pruned,
    trained with SAMO."""
    topology = machine.build_topology(nodes)
    batch = global_batch or arch.recipe.sequences(topology.world_size)
    accum = grad_accum if global_batch or grad_accum else arch.recipe.grad_accum
    if accum is not None and batch % accum:
        raise PlanInputError(f"--grad-accum: {accum} does not divide the global batch of {batch} sequences")
    return Job(
        arch,
        machine,
        topology,
        batch,
        accum,
        elem_bytes,
        batch_source=batch_source if global_batch else f"{arch.name}'s recipe: {arch.recipe.source}",
        recipe_accum=global_batch is None and grad_accum is None and accum is not None,
        sparsity=sparsity,
    )


@dataclass(frozen=True)
class PlanResult:
    job: Job
    estimates: tuple[Estimate, ...]  # every plan the batch can be split for, fastest first
    dropped: tuple[Dropped, ...] = ()  # every other candidate, with its reason

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
    """Evaluate every candidate of ``families`` and ``extra``; rank them; keep the rest with reasons."""
    families = list(families)
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise PlanInputError(f"--families: unknown {', '.join(unknown)}; allowed: {', '.join(FAMILIES)}")
    twice = sorted({f for f in families if families.count(f) > 1})
    if twice:
        raise PlanInputError(f"--families: {', '.join(twice)} given twice")
    check_sparsity(job, families)
    cands, dropped = list(extra), []
    if not cands:
        check_families_apply(job.arch, families)
    for f in families:
        built, skipped = FAMILIES[f](job)
        cands += built
        dropped += skipped
    estimates = []
    for c in cands:
        e = evaluate(job, c)
        if e is None:
            dropped.append(Dropped(c.family, c.name, unsplittable(job, c)))
        else:
            estimates.append(e)
    estimates.sort(key=lambda e: (not e.fits, e.step_s))
    return PlanResult(job, tuple(estimates), tuple(dropped))


SCAN = 64  # node counts tried one by one in what_would_fit


def what_would_fit(job: Job, families: Iterable[str], batch_given: bool) -> str:
    """For a job where no plan fits: the fewest nodes at which one does (the batch rule of
    ``make_job`` unchanged: a given batch stays, a recipe's per-rank batch scales), else, at
    these nodes, a global batch of one sequence per data-parallel rank. Node counts double until
    one fits; between the last miss and that fit every count is tried when there are at most
    :data:`SCAN` of them (fitting is not monotonic: a batch that divides over 8 nodes may not over
    6 or 7, while 5 may fit), else bisection finds a boundary (it assumes more nodes keep fitting)."""
    families = list(families)
    nodes = job.topology.levels[-1].size
    batch = job.global_batch if batch_given else None
    fit = lambda n: _best(job, n, batch, job.grad_accum, families)  # noqa: E731
    prev = n = nodes
    while n < job.machine.max_nodes:
        prev, n = n, min(2 * n, job.machine.max_nodes)
        if fit(n) is not None:
            lo, hi = prev, n  # the fewest between the last miss and the first fit
            if hi - lo <= SCAN:
                hi = next(m for m in range(lo + 1, hi + 1) if fit(m) is not None)
                return f"{hi} nodes would fit ({fit(hi)} there)"
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if fit(mid) is not None else (mid, hi)
            return f"{hi} nodes would fit ({fit(hi)} there)"
    best = _best(job, nodes, job.world, None, families)
    if best is not None:
        return f"--global-batch {job.world} (one sequence per rank) would fit ({best} here)"
    return f"nothing fits up to {job.machine.max_nodes} nodes, nor a batch of one sequence per rank"


def _best(job: Job, nodes: int, batch: int | None, accum: int | None, families: list[str]) -> str | None:
    """The best plan's name for ``job`` moved to ``nodes`` nodes and ``batch`` (None: none fits)."""
    try:
        other = make_job(job.arch, job.machine, nodes, batch, accum, job.elem_bytes, job.batch_source, job.sparsity)
    except PlannerError:
        return None
    best = plan(other, families).best
    return best.name if best else None
