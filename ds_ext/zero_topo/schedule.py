"""The collectives a ZeRO-topo plan issues for one unit (003 §V-C, Fig. 6), as data.

One description, read by both sides so that they cannot drift:

* the executor (:class:`ds_ext.zero_topo.units.FlatUnit` gathers and reduces,
  ``ds_ext.zero_topo.optimizer`` runs the step boundary) dispatches on each :class:`Collective`;
* the analytic model (:func:`ds_ext.zero_topo.perf.traffic`) prices each one.

A collective runs over the group of this rank's domain at the topology ``levels`` it names
(innermost first, consecutive); ``bits`` is its wire format: 16 for the training dtype, 8 for
int8 blocks with fp32 scales, 4 for int4 gradient blocks.

Per micro-batch and unit: a weight all-gather in forward (:func:`weight_gather`), one in
backward (not the root unit, kept from forward), the gradient reduction
(:func:`gradient_reduce`). Per optimizer step and unit: the step boundary's reductions from the
gradient level to the optimizer level (:func:`step_reductions`), then the all-gathers of the
updated slices back to the primary weight shard (:func:`step_gathers`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ds_ext.zero_topo.plan import ShardingPlan

ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, ALL_TO_ALL_REDUCE = (
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "all_to_all_reduce",
)


@dataclass(frozen=True)
class Collective:
    """One collective of a unit: ``op`` over the group at topology ``levels`` in ``bits``.

    ``op``: ``all_gather``, ``reduce_scatter``, ``all_reduce``, or ``all_to_all_reduce`` (qgZ's
    quantized reduce-scatter: an all-to-all of quantized chunks, each rank summing what it
    receives; ``hops`` 2: over the inner levels, then over ``levels[-1]``). ``source``: for a
    weight gather, the shard gathered (``primary`` / ``secondary``).
    """

    op: str
    levels: tuple[int, ...]
    bits: int
    hops: int = 1
    source: str | None = None

    @property
    def level(self) -> int:
        """The outermost level the group spans."""
        return self.levels[-1]


def _upto(level: int) -> tuple[int, ...]:
    return tuple(range(level + 1))


def weight_gather(plan: ShardingPlan, backward: bool, secondary_held: bool, exact: bool = False) -> Collective:
    """The all-gather of a unit's weights: from the secondary shard when one is held and this is
    backward or the secondary is narrower than the primary (hpZ), else from the primary. int8 when
    the secondary is stored int8 or the plan gathers int8; ``exact``: the 16-bit primary
    (checkpoints, the pipeline form's whole weights)."""
    if not exact and secondary_held and (backward or plan.secondary < plan.weights):  # type: ignore[operator]
        bits = 8 if plan.secondary_bits == 8 or plan.gather_bits == 8 else 16
        return Collective(ALL_GATHER, _upto(plan.secondary), bits, source="secondary")  # type: ignore[arg-type]
    bits = 8 if plan.gather_bits == 8 and not exact else 16
    return Collective(ALL_GATHER, _upto(plan.weights), bits, source="primary")


def gradient_reduce(plan: ShardingPlan) -> Collective:
    """The reduction of a unit's gradients into the gradient shard: a 16-bit reduce-scatter over
    the gradient group, or qgZ's quantized all-to-all in one hop or two (inner levels, then the
    gradient level)."""
    levels = _upto(plan.gradients)
    if plan.gradient_bits == 16:
        return Collective(REDUCE_SCATTER, levels, 16)
    return Collective(ALL_TO_ALL_REDUCE, levels, plan.gradient_bits, hops=plan.gradient_hops)


def step_reductions(plan: ShardingPlan) -> list[Collective]:
    """The step boundary's reductions of a unit's gradient shard, in order: with ``step
    allreduce`` one all-reduce over the levels above the gradient level; else a reduce-scatter per
    level up to the optimizer level (int8 across nodes with ``step_bits`` 8: the quantized
    all-to-all), then an all-reduce over the levels above it."""
    top = len(plan.topology.levels) - 1
    if plan.step == "allreduce":
        above = tuple(range(plan.gradients + 1, top + 1))
        return [Collective(ALL_REDUCE, above, 16)] if above else []
    out = []
    for level in range(plan.gradients + 1, plan.optimizer + 1):
        bits = plan.step_level_bits(level)
        out.append(Collective(ALL_TO_ALL_REDUCE if bits == 8 else REDUCE_SCATTER, (level,), bits))
    above = tuple(range(plan.optimizer + 1, top + 1))
    return out + ([Collective(ALL_REDUCE, above, 16)] if above else [])


def step_gathers(plan: ShardingPlan) -> list[Collective]:
    """The all-gathers of a unit's updated optimizer slice back into its primary shard, in
    order: with ``step allreduce`` and the optimizer sharded wider than the weights, one 16-bit
    all-gather over the optimizer group (the primary shard cut from it); else one per level from
    the optimizer level down to just above the weight level (int8 across nodes with ``step_bits``
    8)."""
    o, w = plan.optimizer, plan.weights
    if plan.step == "allreduce" and o > w:
        return [Collective(ALL_GATHER, _upto(o), 16)]
    return [Collective(ALL_GATHER, (level,), plan.step_level_bits(level)) for level in range(o, w, -1)]
