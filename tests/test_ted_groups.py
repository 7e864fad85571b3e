"""TED groups (001 §7.1, Eq 7.1 / 7.7), config, analytic models: pure logic, no processes."""

import math

import pytest

from ds_ext.config import DsExtConfigError
from ds_ext.parallel import GroupError, TEDLayout, member_group
from ds_ext.topology import Topology


def _rank(t: int, e: int, d: int, T: int, P: int) -> int:
    """001 §7.1 / spec §1.3 rank formula, written independently of ParallelDims."""
    return t + T * (e + P * d)


@pytest.mark.parametrize("world,T,P", [(8, 2, 4), (8, 1, 4), (8, 4, 2), (16, 2, 4), (24, 2, 3), (384, 2, 8)])
def test_rank_formula_and_group_products(world, T, P):
    lay = TEDLayout.build(world, T, P)
    D = world // (T * P)
    assert (lay.tensor, lay.expert, lay.expert_data, lay.nonexp_data) == (T, P, D, P * D)
    assert lay.expert_data == lay.nonexp_data // P  # Eq 7.7
    assert lay.tensor * lay.expert * lay.expert_data == lay.tensor * lay.nonexp_data == world  # Eq 7.1
    for r in range(world):
        c = lay.coords(r)
        assert _rank(c["tensor"], c["expert"], c["expert_data"], T, P) == r
        assert member_group(lay.partition("tensor"), r) == tuple(
            _rank(t, c["expert"], c["expert_data"], T, P) for t in range(T)
        )
        assert member_group(lay.partition("expert"), r) == tuple(
            _rank(c["tensor"], e, c["expert_data"], T, P) for e in range(P)
        )
        assert member_group(lay.partition("expert_data"), r) == tuple(
            _rank(c["tensor"], c["expert"], d, T, P) for d in range(D)
        )
        assert member_group(lay.partition("data"), r) == tuple(
            sorted(_rank(c["tensor"], e, d, T, P) for e in range(P) for d in range(D))
        )
    for kind, size in (("tensor", T), ("expert", P), ("expert_data", D), ("data", P * D)):
        part = lay.partition(kind)
        assert len(part) == world // size and all(len(g) == size for g in part)
        assert sorted(r for g in part for r in g) == list(range(world))


def test_deepspeed_16_rank_docstring_example():
    """deepspeed/utils/groups.py _get_expert_parallel_ranks: world 16, model 2, expert 4."""
    lay = TEDLayout.build(16, 2, 4)
    assert lay.partition("tensor") == tuple((i, i + 1) for i in range(0, 16, 2))
    assert set(lay.partition("data")) == {tuple(range(0, 16, 2)), tuple(range(1, 16, 2))}
    assert set(lay.partition("expert")) == {(0, 2, 4, 6), (8, 10, 12, 14), (1, 3, 5, 7), (9, 11, 13, 15)}
    assert set(lay.partition("expert_data")) == {(0, 8), (2, 10), (4, 12), (6, 14), (1, 9), (3, 11), (5, 13), (7, 15)}


def test_fig_7_3_four_ranks():
    """001 Fig 7.3: G_tensor = G_data^nonexp = G_expert = 2, G_data^exp = 1."""
    lay = TEDLayout.build(4, 2, 2)
    assert lay.partition("tensor") == ((0, 1), (2, 3))
    assert lay.partition("data") == ((0, 2), (1, 3))
    assert lay.partition("expert") == ((0, 2), (1, 3))
    assert lay.partition("expert_data") == ((0,), (1,), (2,), (3,))
    # each tensor group hosts one whole expert: GPU0 expert 1 / shard 1, GPU1 expert 1 / shard 2, ...
    assert [(lay.coords(r)["expert"], lay.coords(r)["tensor"]) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_frontier_384_ranks_placement():
    topo = Topology.from_preset("frontier", 384)  # 48 nodes x 4 MI250X x 2 GCDs
    lay = TEDLayout.build(384, 2, 8)
    lay.check_placement(topo)
    assert lay.expert_data == 24 and lay.nonexp_data == 192
    for r in (0, 201, 383):
        levels = lay.levels(topo, r)
        # tensor group = the GCD pair; the expert all-to-all spans 16 consecutive ranks = 2 nodes
        assert levels["tensor"] == "gcd"
        assert levels["expert"] == "node" and levels["data"] == "node" and levels["expert_data"] == "node"
    assert member_group(lay.partition("tensor"), 201) == (200, 201)
    assert member_group(lay.partition("expert"), 201) == tuple(range(193, 208, 2))
    # with 4 experts per rank-group the all-to-all stays inside a node
    lay4 = TEDLayout.build(384, 2, 4)
    assert lay4.levels(topo, 201)["expert"] == "gpu" and lay4.levels(topo, 201)["tensor"] == "gcd"
    # tensor 8 = one node: the expert group then crosses nodes
    lay8 = TEDLayout.build(384, 8, 4)
    assert lay8.levels(topo, 5) == {"tensor": "gpu", "expert": "node", "expert_data": "node", "data": "node"}


def test_local_experts_beyond_ted():
    """E = k x G_expert: 16 experts on 4 expert ranks (k = 4); the config checks divisibility."""
    from ds_ext import config

    parsed = config.parse({"ted": {"enabled": True, "tensor_parallel": 2, "expert_parallel": 4, "num_experts": 16}})
    assert parsed.ted.num_experts == 16
    with pytest.raises(DsExtConfigError, match=r"^ds_ext\.ted: .*num_experts 6 is not a multiple of expert_parallel 4"):
        config.parse({"ted": {"enabled": True, "expert_parallel": 4, "num_experts": 6}})


def test_bad_degrees_one_line_each():
    with pytest.raises(
        GroupError,
        match=r"^ds_ext\.ted: tensor_parallel=2 \* expert_parallel=4 \* expert_data_parallel=2 "
        r"= 16 != world size 8 \(Eq 7\.1: G_tensor x G_expert x G_data\^exp = G\)$",
    ):
        TEDLayout.build(8, 2, 4, 2)
    with pytest.raises(
        GroupError,
        match=r"^ds_ext\.ted: world size 12 is not divisible by tensor_parallel=4 \* "
        r"expert_parallel=2",
    ):
        TEDLayout.build(12, 4, 2)
    with pytest.raises(
        GroupError,
        match=r"^ds_ext\.ted\.tensor_parallel=16 would split tensor groups across nodes "
        r"of 8 ranks \(frontier\); allowed: a divisor of 8$",
    ):
        TEDLayout.build(32, 16, 2).check_placement(Topology.from_preset("frontier", 32))
    from ds_ext import config

    for block, msg in [
        ({"tensor_parallel": 0}, r"ds_ext\.ted\.tensor_parallel: Input should be greater than or equal to 1"),
        ({"top_k": 0}, r"ds_ext\.ted\.top_k: Input should be greater than or equal to 1"),
        ({"dtd": True}, r"ds_ext\.ted\.dtd: unknown key; allowed keys: .*duplicate_token_dropping"),
    ]:
        with pytest.raises(DsExtConfigError, match=msg):
            config.parse({"ted": {"enabled": True, **block}})


@pytest.mark.parametrize(
    "block, msg",
    [
        ({"seed": -5}, r"^ds_ext\.ted\.seed: Input should be greater than or equal to 0 \(got -5\)$"),
        ({"seed": 2**70}, r"^ds_ext\.ted\.seed: Input should be less than 4294967296 \(got 1180591620717411303424\)$"),
        ({"seed": 2**32}, r"^ds_ext\.ted\.seed: Input should be less than 4294967296"),
        (
            {"top_k": 9, "num_experts": 4},
            r"^ds_ext\.ted: top_k 9 exceeds num_experts 4 \(each route picks a distinct expert\); allowed top_k: 1\.\.4$",
        ),
    ],
)
def test_seed_and_top_k_out_of_range_refused_in_one_line(block, msg):
    from ds_ext import config

    with pytest.raises(DsExtConfigError, match=msg) as err:
        config.parse({"ted": {"enabled": True, **block}})
    assert "\n" not in str(err.value)


def test_seed_and_top_k_bounds_are_inclusive():
    from ds_ext import config

    for block in ({"seed": 0}, {"seed": 2**32 - 1}, {"top_k": 4, "num_experts": 4}, {"top_k": 9}):
        parsed = config.parse({"ted": {"enabled": True, **block}})
        assert all(getattr(parsed.ted, key) == value for key, value in block.items())


def test_cli_detect_shows_ted_groups_and_levels():
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ds_ext.cli",
            "detect",
            "--preset",
            "frontier",
            "--world-size",
            "16",
            "--rank",
            "9",
            "--ted",
            "2,4",
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "TED G_tensor=2 x G_expert=4 x G_data^exp=2 (G_data^nonexp=8)" in lines
    assert "  tensor       [8, 9]  gcd" in lines
    assert "  expert       [9, 11, 13, 15]  gpu" in lines
    assert "  expert_data  [1, 9]  node" in lines
    assert "  data         [1, 3, 5, 7, 9, 11, 13, 15]  node" in lines
    bad = subprocess.run(
        [sys.executable, "-m", "ds_ext.cli", "detect", "--preset", "frontier", "--world-size", "16", "--ted", "2,3"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "ds-ext: error: ds_ext.ted: world size 16 is not divisible by tensor_parallel=2 * expert_parallel=3 "
        "(Eq 7.1: G_tensor x G_expert x G_data^exp = G)"
    ]


# ---- analytic models (ds_ext/perf/ted.py) --------------------------------------------------
def _counts(traffic):
    out = {}
    for (_, op, _), c in traffic.calls.items():
        out[op] = out.get(op, 0) + c
    return out


def test_per_layer_call_counts_6_plus_6_and_4_plus_4():
    from ds_ext.perf.ted import MoEBlockShape, moe_block_traffic

    topo = Topology.from_preset("frontier", 8, {"gpu": 2})
    lay = TEDLayout.build(8, 2, 4)
    shape = MoEBlockShape(tokens=64, hidden=32, num_experts=4, capacity=16, element_bytes=4)
    base = dict(dtd=False, cac=False)
    agree = 1  # the capacity agreement over the expert group
    assert _counts(moe_block_traffic(lay, topo, 0, shape, checkpointing=False, **base)) == {
        "all_to_all": 4,
        "all_reduce": 4 + agree,
    }
    assert _counts(moe_block_traffic(lay, topo, 0, shape, checkpointing=True, **base)) == {
        "all_to_all": 6,
        "all_reduce": 6 + agree,
    }
    assert _counts(moe_block_traffic(lay, topo, 0, shape, checkpointing=True, dtd=False, cac=True)) == {
        "all_to_all": 4,
        "all_reduce": 4 + agree,
    }
    on = moe_block_traffic(lay, topo, 0, shape, checkpointing=True, dtd=True, cac=True)
    off = moe_block_traffic(lay, topo, 0, shape, checkpointing=True, dtd=False, cac=True)
    assert _counts(on) == {"all_to_all": 4, "all_reduce": 4 + agree, "all_gather": 4}
    a2a = lambda t: sum(b for (_, op, _), b in t.bytes.items() if op == "all_to_all")  # noqa: E731
    assert a2a(on) * 2 == a2a(off)  # DTD divides the all-to-all bytes by G_tensor
    V = 4 * 16 * 32 * 4
    assert a2a(off) == 4 * V * 3 / 4
    gathers = {ph: b for (ph, op, _), b in on.bytes.items() if op == "all_gather"}
    assert gathers == {"forward": 2 * V / 2, "backward": 2 * V / 2}  # spec §1.7: each receives V (T-1) / T


def test_memory_model_eq_7_4_to_7_6():
    from ds_ext.perf.ted import eq_7_4, eq_7_5, eq_7_6, max_base_params

    lay = TEDLayout.build(32, 2, 4)  # G_data^nonexp 16, G_data^exp 4
    s = eq_7_4(1_000, 400, lay)
    assert (s.params, s.grads) == (2_800, 2_800)
    assert s.optimizer == 12 * 1_000 / 16 + 12 * 400 / 4
    # Eq 7.5 is Eq 7.4 with NP_exp = E/3 NP_base, NP_nonexp = 2/3 NP_base and G_expert = E
    G, E, T, base = 64, 8, 2, 3_000_000
    lay = TEDLayout.build(G, T, E)
    direct = eq_7_4(round(2 / 3 * base / T), round(E / 3 * base / (T * E)), lay).total
    assert math.isclose(direct, eq_7_5(base, E, G, T), rel_tol=1e-9)
    M = 64e9
    assert math.isclose(eq_7_5(max_base_params(M, E, G, T), E, G, T), M)
    assert max_base_params(M, E, 10**9, T) == pytest.approx(eq_7_6(M, T))
    assert eq_7_6(M, 8) / eq_7_6(M, 1) == 8  # TED fits G_tensor x larger base models


def test_base_model_table_and_parameter_count():
    from ds_ext.models.gpt_moe import GPTMoE, GPTMoEConfig
    from ds_ext.perf.ted import base_model_table, eq_7_5

    rows = {(r["G"], r["E"]): r for r in base_model_table()}
    assert rows[64, 16]["tensor_8"] is None and rows[64, 16]["tensor_4"] is not None  # 8 x 16 > 64
    r = rows[4096, 128]
    assert eq_7_5(r["tensor_8"], 128, 4096, 8) == pytest.approx(64e9)
    assert r["tensor_8"] / r["tensor_1"] > 6  # Eq 7.6: -> G_tensor x as G grows
    for cfg in (GPTMoEConfig(), GPTMoEConfig(n_layers=3, num_experts=8, d_model=32, ffn_mult=2)):
        assert cfg.num_parameters == sum(p.numel() for p in GPTMoE(cfg).parameters())


def test_cac_stash_defaults_to_lean():
    """CAC (001 §7.3.2) stashes the lean set unless the config asks for the full one; a context
    built by hand does the same."""
    import dataclasses

    from ds_ext.config import parse
    from ds_ext.moe.context import TEDContext

    assert parse({"ted": {"enabled": True}}).ted.cac_stash == "lean"
    assert parse({"ted": {"enabled": True, "cac_stash": "full"}}).ted.cac_stash == "full"
    assert next(f.default for f in dataclasses.fields(TEDContext) if f.name == "cac_lean") is True


def test_ted_refuses_a_model_without_tedmoe_and_deepspeed_moe_layers_in_one_line():
    """Two composition-matrix cells: ted on a dense model, and ted on a model built with
    ``deepspeed.moe.layer.MoE`` (it must be ``ds_ext.moe.TEDMoE``), refused before any group exists."""
    from types import SimpleNamespace

    import torch
    from deepspeed.moe.layer import MoE
    from torch import nn

    from ds_ext.moe.config import TEDConfig
    from ds_ext.moe.plugin import TEDPlugin

    runtime = SimpleNamespace(
        topology=Topology.from_preset("frontier", 8, {"gpu": 2}), plugins=[], rank=0, step_owner=lambda: None
    )
    cfg = TEDConfig(enabled=True, tensor_parallel=1, expert_parallel=2)
    dense = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(DsExtConfigError, match=r"^ds_ext.ted: is enabled but the model has no ds_ext.moe.TEDMoE layer"):
        TEDPlugin(cfg, runtime).prepare(dense, torch.optim.SGD(dense.parameters(), lr=0.1), {})
    moe = nn.Sequential(MoE(8, nn.Linear(8, 8), num_experts=2, ep_size=1))
    with pytest.raises(
        DsExtConfigError,
        match=r"^ds_ext.ted: 0 is a deepspeed.moe.layer.MoE; replace it by "
        r"ds_ext.moe.TEDMoE \(same arguments\)",
    ):
        TEDPlugin(cfg, runtime).prepare(moe, torch.optim.SGD(moe.parameters(), lr=0.1), {})
