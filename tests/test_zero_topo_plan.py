"""Pure-logic tests: plan presets and errors, nested layout, analytic model vs 003's tables."""

import pytest
import torch

from ds_ext.topology import Topology
from ds_ext.zero_topo import schedule
from ds_ext.zero_topo.layout import (
    from_shard_order,
    level_partition,
    shard_count,
    shard_index,
    sub_chunk,
    to_shard_order,
)
from ds_ext.zero_topo.perf import UnitSpec, memory, traffic
from ds_ext.zero_topo.plan import PlanError, ZeroTopoConfig, resolve_plan

FRONTIER_48 = Topology.from_preset("frontier", 384)
EMULATED = Topology.from_preset("frontier", 8, {"gpu": 2})


def plan(preset, topo=FRONTIER_48, **kw):
    return resolve_plan(ZeroTopoConfig(enabled=True, preset=preset, **kw), topo)


def test_presets_resolve_to_003_levels():
    p = plan("zero_topo_paper")
    names = (p.name(p.weights), p.name(p.secondary), p.name(p.gradients), p.name(p.optimizer))
    assert names == ("gcd", "gcd", "gpu", "node") and p.step == "allreduce"
    assert (p.gather_bits, p.secondary_bits, p.gradient_bits, p.gradient_hops) == (8, 8, 4, 1)
    assert plan("zero_topo").step == "hierarchical"
    zpp = plan("zeropp")
    assert (zpp.name(zpp.weights), zpp.name(zpp.secondary), zpp.secondary_bits, zpp.gradient_hops) == (
        "node",
        "gpu",
        16,
        2,
    )
    z3 = plan("zero3")
    assert z3.secondary is None and z3.gather_bits == 16 and z3.gradient_bits == 16
    sec8 = plan("zero_topo_paper", secondary={"level": "gpu"})
    assert sec8.secondary_from_primary and sec8.name(sec8.secondary) == "gpu"
    assert plan("zero3", secondary={"level": "none"}).secondary is None


@pytest.mark.parametrize(
    "kw, message",
    [
        (
            dict(weights={"level": "node"}, gradients={"level": "gpu"}),
            "dependency rule needs optimizer level >= gradients level >= weights level",
        ),
        (dict(optimizer={"level": "gcd"}), "got weights=gcd, gradients=gpu, optimizer=gcd"),
        (
            dict(weights={"level": "rack"}),
            "ds_ext.zero_topo.weights.level: topology 'frontier' has no level 'rack'; allowed: gcd, gpu, node",
        ),
        (dict(secondary={"bits": 4}), "ds_ext.zero_topo.secondary.bits: allowed values are 8 and 16"),
        (dict(gradients={"level": "gcd", "hops": 2}), "gradients.hops: 2 needs a quantized gradient reduction"),
        (dict(quant_block_size=511), "quant_block_size: must be even"),
    ],
)
def test_plan_errors(kw, message):
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan("zero_topo", **kw)


def test_bits_other_than_4_8_16_rejected_by_schema():
    from ds_ext import config as cfgmod

    with pytest.raises(
        cfgmod.DsExtConfigError, match=r"ds_ext.zero_topo.gradients.bits: Input should be 4, 8 or 16 \(got 2\)"
    ):
        cfgmod.parse({"zero_topo": {"gradients": {"bits": 2}}})
    with pytest.raises(cfgmod.DsExtConfigError, match="ds_ext.zero_topo.preset: Input should be"):
        cfgmod.parse({"zero_topo": {"preset": "zero4"}})


@pytest.mark.parametrize("topo", [EMULATED, Topology.from_preset("frontier", 16), FRONTIER_48])
def test_nested_layout(topo):
    """opt shard within grad shard within weight shard; each level's shards cover U once."""
    W = topo.world_size
    for r in range(0, W, max(1, W // 64)):
        for a in range(3):
            for b in range(a, 3):
                ratio = shard_count(topo, b) // shard_count(topo, a)
                assert shard_index(topo, r, b) // ratio == shard_index(topo, r, a)
    for lv in range(3):
        idx = sorted({shard_index(topo, r, lv) for r in range(W)})
        assert idx == list(range(shard_count(topo, lv)))


def test_shard_order_round_trip_and_sub_chunk():
    topo = EMULATED
    U = 64
    flat = torch.arange(U, dtype=torch.float32)
    from ds_ext.zero_topo.layout import chunk

    gathered = torch.cat([chunk(flat, topo, r, 2) for r in range(8)])  # group-rank order
    assert torch.equal(to_shard_order(gathered, topo, [0, 1, 2]), flat)
    assert torch.equal(from_shard_order(flat, topo, [0, 1, 2]), gathered)
    for r in range(8):
        primary = chunk(flat, topo, r, 0)
        assert torch.equal(sub_chunk(primary, topo, r, U, 0, 2), chunk(flat, topo, r, 2))
    assert level_partition(topo, [2]) == ((0, 4), (1, 5), (2, 6), (3, 7))


# ---- analytic model vs 003 (psi parameters, M = 2 psi bytes, block scales negligible) -------
PSI = 384 * 2**20  # divisible by W x block
BIG_BLOCK = 2**20


def _traffic(preset, topo=FRONTIER_48, ga=1, **kw):
    p = plan(preset, topo, quant_block_size=BIG_BLOCK, **kw)
    return traffic(p, [UnitSpec(PSI, PSI)], ga, 2)


def test_table_vii_weight_allgather():
    M = 2 * PSI
    t = _traffic("zero_topo_paper").bytes
    # Sec-Degree 2: int8 over the GCD pair (d=2), forward and backward: (M/2)(d-1)/d = M/4
    assert t["forward"]["gcd"] == pytest.approx(M / 4, rel=1e-4)
    assert t["backward"]["gcd"] == pytest.approx(M / 4, rel=1e-4)
    sec8 = _traffic("zero_topo_paper", secondary={"level": "gpu"}).bytes
    assert sec8["backward"]["gpu"] == pytest.approx(M / 2 * 7 / 8 + M / 4 * 7 / 8, rel=1e-4)  # + int4 grads
    z3 = _traffic("zero3").bytes
    W = 384
    assert z3["forward"]["node"] == pytest.approx(M * (W - 1) / W)  # ZeRO-3: psi(d-1)/d in M units


def test_table_viii_gradient_reduce_scatter():
    M = 2 * PSI
    t = _traffic("zero_topo_paper").bytes
    grads = t["backward"]["gpu"]  # int4 1-hop all-to-all inside the node, d = 8
    assert grads == pytest.approx(M / 4 * 7 / 8, rel=1e-4)
    # step: all-reduce of the M/8 shard across 48 nodes, then the world all-gather of M
    assert t["step"]["node"] == pytest.approx(2 * (M / 8) * 47 / 48 + M * 383 / 384, rel=1e-4)
    topo = _traffic("zero_topo").bytes
    floor = 2 * (M / 8) * 47 / 48
    assert topo["step"]["node"] == pytest.approx(floor, rel=1e-4)
    assert "node" not in topo["forward"] and "node" not in topo["backward"]


def test_deepspeed_rows_on_the_emulated_machine():
    """spec/deepspeed_traffic_measured.md, 8 ranks = 2 nodes x 4: units of M per step."""
    M = 2 * PSI
    z3 = _traffic("zero3", EMULATED, ga=8).by_level()
    assert z3["node"] / M == pytest.approx(21.0, rel=1e-4)
    zpp1 = _traffic("zeropp", EMULATED, ga=1).by_level()
    assert zpp1["node"] / M == pytest.approx(0.469, abs=1e-3)
    assert zpp1["gpu"] / M == pytest.approx(0.5625, abs=1e-3)
    zpp8 = _traffic("zeropp", EMULATED, ga=8).by_level()
    assert zpp8["node"] / M == pytest.approx(0.6875, abs=1e-3)
    assert zpp8["gpu"] / M == pytest.approx(7.125, abs=1e-3)
    for ga in (1, 8):
        topo = _traffic("zero_topo", EMULATED, ga=ga).by_level()
        assert topo["node"] / M == pytest.approx(0.25, abs=1e-4)  # 2 (M/P)(N-1)/N, whatever GA
        paper = _traffic("zero_topo_paper", EMULATED, ga=ga).by_level()
        assert paper["node"] / M == pytest.approx(0.25 + 0.875, abs=1e-4)


def test_tables_v_vi_memory():
    """Per GCD, Frontier N=48: ZeRO-topo Sec=2 1.5 psi + psi/4 + 12 psi/384 (003 §V-C)."""
    p = plan("zero_topo_paper", quant_block_size=BIG_BLOCK)
    m = memory(p, [UnitSpec(PSI, PSI)], rank=5, elem_bytes=2)
    assert m["primary"] + m["secondary"] == pytest.approx(1.5 * PSI, rel=1e-4)
    assert m["gradients"] == pytest.approx(PSI / 4)
    assert m["optimizer"] == pytest.approx(12 * PSI / 384)
    sec8 = memory(
        plan("zero_topo_paper", quant_block_size=BIG_BLOCK, secondary={"level": "gpu"}), [UnitSpec(PSI, PSI)], 5, 2
    )
    assert sec8["primary"] + sec8["secondary"] == pytest.approx(1.125 * PSI, rel=1e-4)
    z3 = memory(plan("zero3"), [UnitSpec(PSI, PSI)], 5, 2)
    assert sum(z3.values()) == pytest.approx(16 * PSI / 384)
    zpp = memory(plan("zeropp"), [UnitSpec(PSI, PSI)], 5, 2)
    assert sum(zpp.values()) == pytest.approx(16 * PSI / 384 + 2 * PSI / 8)


# 003 §V-C (Fig. 6, Tables VII, VIII) and its ZeRO++ / ZeRO-3 rows on gcd (0) x gpu (1) x node (2),
# written from the paper, not from the plan: per collective (op, levels, bits).
# forward (step's first micro-batch), forward (later micro-batches), backward, gradient
# reduction, step reductions, step gathers.
SCHEDULES_003 = {
    "zero3": (
        ("all_gather", (0, 1, 2), 16),
        ("all_gather", (0, 1, 2), 16),
        ("all_gather", (0, 1, 2), 16),
        ("reduce_scatter", (0, 1, 2), 16),
        [],
        [],
    ),
    # qwZ over the world, hpZ's secondary inside the node (16-bit), qgZ int4 in two hops
    "zeropp": (
        ("all_gather", (0, 1, 2), 8),
        ("all_gather", (0, 1), 8),
        ("all_gather", (0, 1), 8),
        ("all_to_all_reduce", (0, 1, 2), 4),
        [],
        [],
    ),
    # the paper's: int8 primary and secondary over the GCD pair, int4 1-hop inside the node,
    # all-reduce among nodes, all-gather over the world
    "zero_topo_paper": (
        ("all_gather", (0,), 8),
        ("all_gather", (0,), 8),
        ("all_gather", (0,), 8),
        ("all_to_all_reduce", (0, 1), 4),
        [("all_reduce", (2,), 16)],
        [("all_gather", (0, 1, 2), 16)],
    ),
    # ds_ext's default: the boundary reduce-scatters across nodes and gathers back level by level
    "zero_topo": (
        ("all_gather", (0,), 8),
        ("all_gather", (0,), 8),
        ("all_gather", (0,), 8),
        ("all_to_all_reduce", (0, 1), 4),
        [("reduce_scatter", (2,), 16)],
        [("all_gather", (2,), 16), ("all_gather", (1,), 16)],
    ),
    "zero_topo_int8": (
        ("all_gather", (0,), 8),
        ("all_gather", (0,), 8),
        ("all_gather", (0,), 8),
        ("all_to_all_reduce", (0, 1), 4),
        [("all_to_all_reduce", (2,), 8)],
        [("all_gather", (2,), 8), ("all_gather", (1,), 16)],
    ),
}


@pytest.mark.parametrize("preset", sorted(SCHEDULES_003))
def test_schedule_issues_003s_collectives(preset):
    """The one description the executor and the analytic model read (``ds_ext.zero_topo.schedule``)
    holds 003's collectives for each preset."""
    p = plan(preset, EMULATED)
    held = p.secondary is not None

    def row(c):
        return (c.op, c.levels, c.bits)

    got = (
        row(schedule.weight_gather(p, backward=False, secondary_held=False)),
        row(schedule.weight_gather(p, backward=False, secondary_held=held)),
        row(schedule.weight_gather(p, backward=True, secondary_held=held)),
        row(schedule.gradient_reduce(p)),
        [row(c) for c in schedule.step_reductions(p)],
        [row(c) for c in schedule.step_gathers(p)],
    )
    assert got == SCHEDULES_003[preset]
    assert schedule.weight_gather(p, backward=True, secondary_held=held, exact=True).bits == 16  # checkpoints


def test_wire_formats_are_read_from_the_schedule_only():
    """The executor and the analytic model take every collective's wire format from the schedule:
    no module of ZeRO-topo but the plan and the schedule branches on the plan's wire fields."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "ds_ext" / "zero_topo"
    wire = re.compile(r"\bplan\.(gather_bits|gradient_hops|step_level_bits|step_bits)\b")
    found = [
        f"{path.name}: {m.group(0)}"
        for path in sorted(root.glob("*.py"))
        if path.name not in ("plan.py", "schedule.py")
        for m in wire.finditer(path.read_text())
    ]
    assert found == []
