"""``ds-ext plan --sparsity``: SAMO's layouts (001 ch. 4) against hand-written numbers of Eq. 4.1 and
a hand-worked §4.2.2 case, through the planner's public entry (``plan`` and the CLI)."""

import json

import pytest

from ds_ext.planner import models, samo_plans
from ds_ext.planner.machine import MACHINES
from ds_ext.planner.plan import make_job, plan

FRONTIER = MACHINES["frontier"]
GB = 1e9

# gpt3-1.3b by hand (001 Table 4.1; L 24, h 2048, V 50304, s 2048, learned positions, tied head): a
# block is 12 h^2 + 13 h, the table V h, the positions s h, the final norm 2 h.
H, L = 2048, 24
BLOCK = 12 * H * H + 13 * H  # 50,358,272
TABLE, POSITIONS = 50304 * H, 2048 * H
PHI = L * BLOCK + TABLE + POSITIONS + 2 * H  # 1,315,819,520
STAGE = {pp: L // pp * BLOCK + TABLE + POSITIONS for pp in (2, 4)}  # the first stage (table + positions)


def test_eq_4_1_by_hand():
    """M^SAMO = 24 (1 - p) φ + 2 φ at DP 1 against the 20 φ of dense training (001 §4.1.4)."""
    phi = 10**9
    for p, want in ((0.9, 4.4e9), (0.8, 6.8e9), (0.5, 14e9)):
        s = samo_plans.states(phi, p, 2, 1)
        assert sum(s.values()) == want
        assert s["weights"] == 2e9 and s["gradients"] == pytest.approx(2 * (1 - p) * phi)  # θ16 dense, ∇θ16 not
    assert 4.4e9 / 20e9 == pytest.approx(1 - 0.78, abs=0.01)  # Fig. 4.2: 78 % saved at p = 0.9
    # ZeRO-1 over 8 ranks: θ16 2 φ, the flat ∇θ16 2 k, the rank's chunk k / 8 as 16-bit copy, fp32
    # gradient, θ32 and moments (2 + 4 + 12), the index 4 k
    k = 10**8
    assert sum(samo_plans.states(phi, 0.9, 2, 8).values()) == 2 * phi + 2 * k + 18 * k // 8 + 4 * k
    assert samo_plans.step_traffic(phi, 0.9, 2, 8, "node").bytes == {"node": 2 * 2 * k * 7 / 8}


def test_dense_needs_four_stages_samo_one():
    """§4.2.2 by hand on 8 GCDs of 4.9 GB: dense ZeRO-1 state (2 + 2 + 12 / DP) n is 5.5 φ = 7.24 GB at PP 1
    and 7 n_2 = 4.98 GB at PP 2, over the device before any activation, so dense needs PP 4 (10 n_4 = 4.09 GB);
    SAMO at p = 0.9 fits PP 1 (2.825 φ = 3.72 GB: 2 φ + 2 k + 18 k / 8 + 4 k, k = φ / 10), and ranks first:
    no bubble, and its all-reduce carries (1 - p) of the dense one's bytes."""
    arch = models.lookup("gpt3-1.3b")
    assert arch.params == PHI
    machine = FRONTIER.model_copy(update={"device_memory": 4.9 * GB})
    result = plan(make_job(arch, machine, 1, global_batch=512, sparsity=0.9), ["megatron"])
    by = {e.name: e for e in result.estimates}
    assert sum(by["megatron tp1 pp1 dp8 mb1"].memory[s] for s in ("weights", "gradients", "optimizer")) == 5.5 * PHI
    assert 5.5 * PHI > 4.9 * GB and 7 * STAGE[2] > 4.9 * GB and 10 * STAGE[4] < 4.9 * GB
    dense_fit = {
        int(e.name.split()[2][2:]) for e in result.ranked if e.name.startswith("megatron tp1 ") and "samo" not in e.name
    }
    samo_fit = {int(e.name.split()[2][2:]) for e in result.ranked if e.name.endswith("+ samo p0.9")}
    assert min(dense_fit, default=None) == 4 and min(samo_fit, default=None) == 1

    ours = by["megatron tp1 pp1 dp8 mb1 + samo p0.9"]
    k = PHI / 10
    assert ours.fits and ours.total_memory - ours.memory["activations"] == pytest.approx(2.825 * PHI, rel=1e-7)
    assert ours.memory["weights"] == 2 * PHI and ours.memory["gradients"] == pytest.approx(2 * k, rel=1e-7)
    (level,) = ours.traffic.bytes
    assert ours.traffic.bytes[level] == pytest.approx(0.1 * 2 * 2 * PHI * 7 / 8, rel=1e-7)  # (1 - p) of 2 S (d - 1) / d
    assert by["megatron tp1 pp1 dp8 mb1"].traffic.bytes[level] == 3 * 2 * PHI * 7 / 8  # dense ZeRO-1: + the all-gather
    assert ours.config["ds_ext"] == {"samo": {"enabled": True, "mask": "prune"}}
    assert ours.config["zero_optimization"] == {"stage": 1}
    assert ours.config["megatron"] == {"tensor-model-parallel-size": 1, "pipeline-model-parallel-size": 1}
    assert result.best.name == "megatron tp1 pp1 dp8 mb1 + samo p0.9"


def test_no_samo_layout_the_plugin_refuses_and_none_dropped_silently():
    """SAMO's form of a TP > 1 layout is listed dropped with the plugin's reason, and refused if asked
    for; every TP-1 layout has one; SAMO beside ZeRO-topo is refused, not one silently replaced."""
    from ds_ext.planner import PlannerError, megatron_plans

    job = make_job(models.lookup("gpt3-1.3b"), FRONTIER, 1, global_batch=512, sparsity=0.8)
    result = plan(job, ["megatron"])
    samo = [e for e in result.estimates if e.name.endswith(" + samo p0.8")]
    assert samo and all(e.name.startswith("megatron tp1 ") for e in samo)
    # gpt3-1.3b ties its embedding to the head: the plugin refuses a PipelineModule's tied layers
    assert {e.name.split(" mb")[0] for e in samo} == {"megatron tp1 pp1 dp8"}
    refused = {d.name: d.reason for d in result.dropped if "samo" in d.name}
    assert set(refused) == {
        f"megatron tp{t} pp{p} dp{8 // (t * p)} + samo p0.8" for t in (1, 2, 4, 8) for p in (1, 2, 4, 8) if t * p <= 8
    } - {"megatron tp1 pp1 dp8 + samo p0.8"}
    assert refused["megatron tp1 pp2 dp4 + samo p0.8"].startswith("SAMO at PP 2 with the embedding tied to the head")
    assert refused["megatron tp2 pp1 dp4 + samo p0.8"].startswith(
        "SAMO at TP 2: the plugin runs tensor parallel 1 only"
    )
    assert not [
        e for e in plan(make_job(job.arch, FRONTIER, 1, global_batch=512), ["megatron"]).estimates if "samo" in e.name
    ]
    with pytest.raises(PlannerError, match=r"megatron tp2 pp1 dp4 mb1 \+ samo p0.8: SAMO at TP 2"):
        megatron_plans.candidate(job, 2, 1, 4, samo=0.8)
    with pytest.raises(PlannerError, match="SAMO runs beside no other ds_ext plugin"):
        megatron_plans.candidate(job, 1, 1, 8, zero_topo={"preset": "zero_topo", "form": "pipeline"}, samo=0.8)


def test_plan_cli_says_samo_and_p_in_table_and_json(tmp_path, capsys):
    from ds_ext.cli import main

    out = tmp_path / "plan.json"
    args = ["plan", "--model", "gpt3-1.3b", "--nodes", "1", "--memory-GB", "4.9", "--global-batch", "512"]
    assert main([*args, "--families", "megatron", "--sparsity", "0.9", "--top-k", "3", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "pruned at sparsity p = 0.9 (--sparsity)" in text
    assert "best: megatron tp1 pp1 dp8 mb1 + samo p0.9 (" in text
    payload = json.loads(out.read_text())
    assert payload["job"]["sparsity"] == 0.9 and payload["best"] == "megatron tp1 pp1 dp8 mb1 + samo p0.9"
    record = next(r for r in payload["plans"] if r["name"] == payload["best"])
    assert record["config"]["ds_ext"]["samo"]["enabled"] is True
    assert any(n.startswith("SAMO at p = 0.9 (001 ch. 4)") for n in record["notes"])


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--sparsity", "1"], "--sparsity: 1 is not a pruned fraction; allowed: --sparsity in [0, 1)"),
        (["--sparsity", "-0.1"], "--sparsity: -0.1 is not a pruned fraction; allowed: --sparsity in [0, 1)"),
        (["--sparsity", "nan"], "--sparsity: nan is not a pruned fraction"),
        (
            ["--sparsity", "0.9", "--experts", "8"],
            "--sparsity 0.9: gpt3-1.3b-moe8 is an MoE, which SAMO does not train",
        ),
        (["--sparsity", "0.9", "--families", "zero", "pmm3d"], "--sparsity 0.9: --families zero pmm3d has no megatron"),
    ],
)
def test_bad_sparsity_fails_in_one_line(extra, message, capsys):
    from ds_ext.cli import main

    assert main(["plan", "--model", "gpt3-1.3b", "--nodes", "1", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"ds-ext: error: {message}"), err
