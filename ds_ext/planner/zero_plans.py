"""ZeRO-topo presets as planner candidates (003 §III-C, §V; ``ds_ext.zero_topo.perf``).

Every preset of ``ds_ext.zero_topo.plan`` (zero3, zeropp, mics, zero_topo_paper, zero_topo,
zero_topo_int8) is pure data parallelism over the W ranks: each rank runs its own micro-batch.
The units are the ones ZeRO-topo's engine builds for a GPT (``units="auto"``: the root unit
of tables, head and final norm first, then one unit per transformer block), laid out as the
engine lays them out (``ds_ext.zero_topo.perf.unit_spec``, per-parameter quantization groups
included); bytes, messages and memory are
``ds_ext.zero_topo.perf.traffic`` / ``memory`` of those units, the functions the ledger tests hold
the engine to. Memory is rank 0's, the rank whose optimizer shard holds no padding.

DeepSpeed's own ZeRO-3 / ZeRO++ (the baselines 003 measures, ``deepspeed=VERSION``) move the same
bytes in more collectives: its pre-forward / pre-backward hooks fetch per submodule the
parameters above ``stage3_param_persistence_threshold`` (default 1e5 elements; biases and norms
stay resident), ``all_gather_coalesced`` issuing one all-gather per fetch, two when quantized
(payload and scales: ``partition_parameters.py``, ``_all_gather_coalesced``; DeepSpeed 0.19.8).
A GPT block is then its submodules holding a parameter above the threshold (QKV, attention
out, FC1, FC2: 4 fetches for GPT-NeoX-20B), the root its tables. Gradients are reduced in
buckets of ``reduce_bucket_size`` (GPT-NeoX 20B.yml: 1.26e9 elements, about one 20B block), so
the per-block reduction stays. DeepSpeed 0.13.1 (003's version) also served no gather with
grad enabled from hpZ's secondary (``ds_ext.zero_topo.perf``'s ``secondary_serves_forward``).
"""

from __future__ import annotations

import math
from typing import Any

from ds_ext.perf.compute import activation_bytes
from ds_ext.planner import PlannerError
from ds_ext.planner.estimate import Candidate, Dropped, Job, Traffic
from ds_ext.planner.models import Arch
from ds_ext.zero_topo import perf
from ds_ext.zero_topo.plan import PRESETS, ShardingPlan, ZeroTopoConfig, resolve_plan

PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed stage3_param_persistence_threshold default (runtime/zero/config.py)
DEEPSPEED_VERSIONS = ("0.13.1", "0.19.8")  # 003's (Table IX) and today's


def _fetches(largest: list[int]) -> int:
    """DeepSpeed's fetches of a unit: its submodules whose largest parameter is above the threshold."""
    n = sum(1 for numel in largest if numel > PERSISTENCE_THRESHOLD)
    if n == 0:
        raise PlannerError(
            "every parameter of a unit stays resident under DeepSpeed's persistence threshold; "
            "the planner does not model that"
        )
    return n


def deepspeed_fetches(arch: Arch) -> tuple[int, int]:
    """(root, block) fetches of ``arch`` under DeepSpeed ZeRO-3 (module docstring)."""
    h, f = arch.hidden, arch.ffn_mult * arch.hidden
    tables = [arch.vocab * h] * (1 if arch.tied_embeddings else 2) + ([arch.seq * h] if arch.learned_positions else [])
    block = [3 * h * h, h * h, f * h, f * h]  # QKV, attention out, FC1, FC2 weights (biases, norms: below)
    return _fetches(tables), _fetches(block)


def _params(arch: Arch) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(root, block) parameters as (numel, ndim), in ``ds_ext.models.GPT``'s order: tables, final
    LayerNorm; LayerNorm, QKV, attention out, LayerNorm, FC1, FC2 (weights then biases)."""
    h, f = arch.hidden, arch.ffn_mult * arch.hidden
    tables = [(arch.vocab * h, 2)] * (1 if arch.tied_embeddings else 2) + (
        [(arch.seq * h, 2)] if arch.learned_positions else []
    )
    root = tables + [(h, 1), (h, 1)]
    block = [
        (h, 1),
        (h, 1),
        (3 * h * h, 2),
        (3 * h, 1),
        (h * h, 2),
        (h, 1),
        (h, 1),
        (h, 1),
        (f * h, 2),
        (f, 1),
        (f * h, 2),
        (h, 1),
    ]
    return root, block


def units(arch: Arch, plan: ShardingPlan, deepspeed: bool = False) -> list[perf.UnitSpec]:
    """The engine's gather/release units of ``arch`` under ``plan`` (laid out as the engine lays
    them out); ``deepspeed``: each gathered in DeepSpeed's per-submodule fetches."""
    root_g, block_g = deepspeed_fetches(arch) if deepspeed else (1, 1)
    root, block = _params(arch)
    root_unit = perf.unit_spec(plan, root, True, root_g)
    block_unit = perf.unit_spec(plan, block, gathers=block_g)
    return [root_unit] + [block_unit] * arch.layers


COLLECTIVES = ("rccl", "pccl")


def pccl(t: perf.Traffic, plan: ShardingPlan) -> Traffic:
    """ZeRO-3's world all-gathers and reduce-scatters issued with PCCL (001 §6.2): each becomes an
    inter-node phase, recursive doubling over the N nodes on every GCD's NIC share, (N-1)/N S/P bytes in
    log2 N messages, and RCCL's ring inside the node, (P-1)/P S bytes in P - 1 messages (S the
    collective's full buffer, P ranks per node; the ring's S (W-1)/W becomes these two)."""
    topo = plan.topology
    top = len(topo.levels) - 1
    if (plan.weights, plan.gradients, plan.secondary) != (top, top, None):
        raise PlannerError("PCCL costing covers ZeRO-3's world collectives only (preset zero3)")
    w, p = topo.world_size, topo.ranks_per_node
    n = w // p
    node, inner = topo.levels[-1].name, topo.levels[-2].name
    out_b, out_m = t.by_level(), t.steps_by_level()
    world_calls = sum(t.calls[ph].get(node, 0.0) for ph in ("forward", "backward"))
    world_bytes = sum(t.bytes[ph].get(node, 0.0) for ph in ("forward", "backward"))
    full = world_bytes * w / (w - 1)  # Σ S over the world collectives
    out_b[node] += full * (n - 1) / n / p - world_bytes
    out_m[node] += world_calls * (math.log2(n) - (w - 1))
    out_b[inner] = out_b.get(inner, 0.0) + full * (p - 1) / p
    out_m[inner] = out_m.get(inner, 0.0) + world_calls * (p - 1)
    return Traffic(out_b, out_m)


def traffic(
    plan: ShardingPlan,
    arch: Arch,
    grad_accum: int,
    elem_bytes: int,
    deepspeed: str | None = None,
    collectives: str = "rccl",
    rank: int = 0,
) -> Traffic:
    """Bytes and ring messages per level of rank ``rank``; ``deepspeed``: as that DeepSpeed version
    gathers (module docstring); ``collectives="pccl"``: ZeRO-3's world collectives by PCCL (:func:`pccl`)."""
    t = perf.traffic(
        plan,
        units(arch, plan, deepspeed is not None),
        grad_accum,
        elem_bytes,
        secondary_serves_forward=deepspeed != "0.13.1",
        rank=rank,
    )
    return pccl(t, plan) if collectives == "pccl" else Traffic(t.by_level(), t.steps_by_level())


def nic_bytes(plan: ShardingPlan, arch: Arch, grad_accum: int, elem_bytes: int, deepspeed: str | None = None) -> float:
    """Bytes per rank and step over the links out of its node, the mean over the ranks of node 0
    (``Estimate.nic_bytes``): ``ds_ext.zero_topo.perf``'s link bytes at the outermost level. A ring
    over the world crosses a node's boundary on one hop of each node, so of its volume the NICs
    carry about 1 / P per rank (P ranks a node); a ring over one rank of each node crosses it on
    every hop."""
    top = plan.topology.levels[-1].name
    us = units(arch, plan, deepspeed is not None)
    total = 0.0
    for rank in range(plan.topology.ranks_per_node):
        t = perf.traffic(plan, us, grad_accum, elem_bytes, secondary_serves_forward=deepspeed != "0.13.1", rank=rank)
        total += sum(per.get(top, 0.0) for per in (t.links or {}).values())
    return total / plan.topology.ranks_per_node


def states(plan: ShardingPlan, arch: Arch, elem_bytes: int) -> dict[str, float]:
    m = perf.memory(plan, units(arch, plan), 0, elem_bytes)
    return {
        "weights": m["primary"],
        "secondary": m["secondary"],
        "gradients": m["gradients"],
        "optimizer": m["optimizer"],
    }


def candidate(
    job: Job, section: dict[str, Any], name: str | None = None, deepspeed: str | None = None, collectives: str = "rccl"
) -> Candidate:
    """The plan of one ``ds_ext.zero_topo`` section (a preset name and its overrides) in ds_ext's
    engine, or with ``deepspeed`` (one of ``DEEPSPEED_VERSIONS``) as that DeepSpeed runs it, its
    collectives by ``collectives`` (``COLLECTIVES``)."""
    if deepspeed is not None and deepspeed not in DEEPSPEED_VERSIONS:
        raise PlannerError(f"deepspeed {deepspeed!r}; allowed: {', '.join(DEEPSPEED_VERSIONS)}")
    if collectives not in COLLECTIVES:
        raise PlannerError(f"collectives {collectives!r}; allowed: {', '.join(COLLECTIVES)}")
    cfg = ZeroTopoConfig(enabled=True, **section)
    plan = resolve_plan(cfg, job.topology)
    a, e = job.arch, job.elem_bytes
    return Candidate(
        family="zero",
        name=name or cfg.preset,
        config={"zero_optimization": {"stage": 0}, "ds_ext": {"zero_topo": {"enabled": True, **section}}},
        data=job.world,
        states=states(plan, a, e),
        activations=lambda b: activation_bytes(
            b * a.seq, a.layers, a.hidden, a.heads, a.seq, a.vocab, checkpointing=job.checkpointing
        ),
        traffic=lambda b, g: traffic(plan, a, g, e, deepspeed, collectives),
        notes=(plan.describe(),),
        nic=None if collectives == "pccl" else lambda b, g: nic_bytes(plan, a, g, e, deepspeed),
    )


def candidates(job: Job) -> tuple[list[Candidate], list[Dropped]]:
    """Every preset; none for an MoE (ZeRO-topo refuses expert parameters)."""
    if job.arch.experts > 1:
        return [], [
            Dropped("zero", p, "ZeRO-topo refuses expert parameters (an MoE): the ted family plans it") for p in PRESETS
        ]
    return [candidate(job, {"preset": p}) for p in PRESETS], []
