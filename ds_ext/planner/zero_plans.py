"""ZeRO-topo presets as planner candidates (003 §III-C, §V; ``ds_ext.perf.zero``).

Every preset of ``ds_ext.zero_topo.plan`` (zero3, zeropp, mics, zero_topo_paper, zero_topo,
zero_topo_int8) is pure data parallelism over the W ranks: each rank runs its own micro-batch.
The units are the ones ZeRO-topo's engine builds for a GPT (``units="auto"``: the root unit
of tables, head and final norm first, then one unit per transformer block), padded by
``ds_ext.zero_topo.layout.padded_numel``; bytes, messages and memory are
``ds_ext.perf.zero.traffic`` / ``memory`` of those units, the functions the ledger tests hold
the engine to. Memory is rank 0's, the rank whose optimizer shard holds no padding.
"""

from __future__ import annotations

from typing import Any

from ds_ext.perf import zero as perf
from ds_ext.perf.compute import activation_bytes
from ds_ext.planner.estimate import Candidate, Dropped, Job, Traffic
from ds_ext.planner.models import Arch
from ds_ext.zero_topo.layout import padded_numel
from ds_ext.zero_topo.plan import PRESETS, ShardingPlan, ZeroTopoConfig, resolve_plan


def units(arch: Arch, world: int, block: int) -> list[perf.UnitSpec]:
    """The engine's gather/release units of ``arch`` on ``world`` ranks."""
    root = perf.UnitSpec(padded_numel(arch.root_params, world, block), arch.root_params, True)
    block_unit = perf.UnitSpec(padded_numel(arch.block_params, world, block), arch.block_params)
    return [root] + [block_unit] * arch.layers


def traffic(plan: ShardingPlan, arch: Arch, grad_accum: int, elem_bytes: int,
            secondary_serves_forward: bool = True) -> Traffic:
    t = perf.traffic(plan, units(arch, plan.topology.world_size, plan.block_size), grad_accum, elem_bytes,
                     secondary_serves_forward)
    return Traffic(t.by_level(), t.steps_by_level())


def states(plan: ShardingPlan, arch: Arch, elem_bytes: int) -> dict[str, float]:
    m = perf.memory(plan, units(arch, plan.topology.world_size, plan.block_size), 0, elem_bytes)
    return {"weights": m["primary"], "secondary": m["secondary"], "gradients": m["gradients"],
            "optimizer": m["optimizer"]}


def candidate(job: Job, section: dict[str, Any], name: str | None = None,
              secondary_serves_forward: bool = True) -> Candidate:
    """The plan of one ``ds_ext.zero_topo`` section (a preset name and its overrides);
    ``secondary_serves_forward=False``: hpZ as DeepSpeed 0.13.1 ran it (``ds_ext.perf.zero``)."""
    cfg = ZeroTopoConfig(enabled=True, **section)
    plan = resolve_plan(cfg, job.topology)
    a, e = job.arch, job.elem_bytes
    return Candidate(
        family="zero", name=name or cfg.preset, config={"zero_optimization": {"stage": 0}, "ds_ext": {"zero_topo": {"enabled": True, **section}}}, data=job.world,
        states=states(plan, a, e),
        activations=lambda b: activation_bytes(b * a.seq, a.layers, a.hidden, a.heads, a.seq, a.vocab,
                                               checkpointing=job.checkpointing),
        traffic=lambda b, g: traffic(plan, a, g, e, secondary_serves_forward),
        notes=(plan.describe(),),
    )


def candidates(job: Job) -> tuple[list[Candidate], list[Dropped]]:
    """Every preset; none for an MoE (ZeRO-topo refuses expert parameters)."""
    if job.arch.experts > 1:
        return [], [Dropped("zero", p, "ZeRO-topo refuses expert parameters (an MoE): the ted family plans it")
                    for p in PRESETS]
    return [candidate(job, {"preset": p}) for p in PRESETS], []
