"""Planner, pure logic: the planner's memory and bytes per level are the plugins'
ledger-checked models (``ds_ext.zero_topo.perf``, ``ds_ext.perf.pmm``, ``ds_ext.perf.ted``) on the configurations the
plugin tests measure; FLOPs, batch choice, step time, max model sizes, CLI and errors."""

import json
import math
from pathlib import Path

import pytest

from ds_ext.parallel import Grid, TEDLayout
from ds_ext.perf import pmm as perf_pmm
from ds_ext.perf.compute import ActivationSplit, activation_bytes, step_flops
from ds_ext.perf.ted import eq_7_5, moe_block_traffic
from ds_ext.planner import compute_rate, models, pmm_grids, ted_layouts, zero_plans
from ds_ext.planner.estimate import Candidate, Traffic, batch_options, comm_seconds, divisors, evaluate
from ds_ext.planner.machine import MACHINES, GiB
from ds_ext.planner.plan import PlanInputError, make_job, plan
from ds_ext.topology import Topology
from ds_ext.zero_topo import perf as perf_zero
from ds_ext.zero_topo.plan import PRESETS, ZeroTopoConfig, resolve_plan

REPO = Path(__file__).resolve().parents[1]
EMULATED = Topology.from_preset("frontier", 8, {"gpu": 2})  # the plugin tests' 2 nodes x 2 GPUs x 2 GCDs
FRONTIER = MACHINES["frontier"]
UNQUANTIZED = {"weights": {"gather_bits": 16}, "gradients": {"bits": 16, "hops": 1}, "secondary": {"bits": 16}}


def _arch(cfg) -> models.Arch:
    return models.Arch(
        name="gpt",
        layers=cfg.n_layers,
        hidden=cfg.d_model,
        heads=cfg.n_heads,
        vocab=cfg.vocab_size,
        seq=cfg.seq_len,
        ffn_mult=cfg.ffn_mult,
    )


def _zero_test_gpt(checkpoint=False):
    """tests/test_zero_topo.py's model."""
    from ds_ext.models import GPTConfig

    return GPTConfig(seq_len=32, d_model=64, n_layers=3, n_heads=4, checkpoint=checkpoint)


def _pmm_test_gpt(checkpoint=False):
    """tests/pmm_helpers.py's model."""
    from ds_ext.models import GPTConfig

    return GPTConfig(seq_len=16, d_model=64, n_layers=2, n_heads=8, checkpoint=checkpoint)


# ---- catalogue and FLOPs --------------------------------------------------------------------
def test_parameter_counts_equal_the_built_models_and_published_counts():
    from ds_ext.models import GPT

    for cfg in (_zero_test_gpt(), _pmm_test_gpt()):
        model, arch = GPT(cfg), _arch(cfg)
        assert arch.params == sum(p.numel() for p in model.parameters()) == cfg.num_parameters
        assert arch.block_params == sum(p.numel() for p in model.blocks[0].parameters())
    assert models.lookup("gpt-neox-20b").params == 20_554_567_680  # GPT-NeoX-20B (Black et al. 2022)
    assert models.lookup("gpt-175b").params == pytest.approx(175e9, rel=0.01)  # 004 Table I
    assert models.lookup("gpt-1t").params == pytest.approx(1e12, rel=0.01)
    moe = models.Arch(name="moe", layers=4, hidden=8, heads=2, vocab=10, seq=4, experts=4)
    assert moe.params == models.Arch(name="d", layers=4, hidden=8, heads=2, vocab=10, seq=4).params + 2 * (
        3 * moe.ffn_params + 8 * 4
    )
    assert moe.expert_params == 2 * 4 * moe.ffn_params


def test_flops_formula_and_activations():
    # spec A1: 24 c B s L h^2 (1 + s/6h + V/16Lh), c = 4 with checkpointing
    B, s, L, h, V = 4, 2048, 44, 6144, 50432
    assert step_flops(B, s, L, h, V) == 24 * 4 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    assert step_flops(B, s, L, h, V, checkpointing=False) / step_flops(B, s, L, h, V) == pytest.approx(0.75, rel=1e-15)
    t = 8 * s
    full = activation_bytes(t, L, h, 64, s, V, checkpointing=False, flash_attention=False)
    assert full == L * t * h * 34 + L * 5 * 64 * s * t + 4 * t * V  # Korthikanti Eq 1 + fp32 logits
    split = ActivationSplit(rows=2, residual=1, tensor=4, vocab=4)
    assert activation_bytes(t, L, h, 64, s, V, split) == (
        L * 2 * t / 2 * h + t / 2 * h * (10 + 24 / 4) + 4 * t / 2 * V / 4
    )


# ---- ZeRO-topo: the planner's units and numbers are zero_topo.perf's on the ledger-test runs ----------
def _engine_units(cfg, plan_):
    """Units as ZeroTopoEngine builds them from the model's own parameters: the root (those
    outside the ModuleList) first, then each block, laid out by ``zero_topo.perf.unit_spec``."""
    from ds_ext.models import GPT

    model = GPT(cfg)
    in_blocks = {id(p) for p in model.blocks.parameters()}
    root = [(p.numel(), p.dim()) for p in model.parameters() if id(p) not in in_blocks]
    return [perf_zero.unit_spec(plan_, root, True)] + [
        perf_zero.unit_spec(plan_, [(p.numel(), p.dim()) for p in b.parameters()]) for b in model.blocks
    ]


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("accum", [1, 3])
@pytest.mark.parametrize("quantized", [True, False])
def test_zero_planner_equals_perf_zero_on_the_ledger_test_runs(preset, accum, quantized):
    """tests/test_zero_topo.py::test_ledger_equals_analytic_model's configurations (bf16)."""
    cfg = _zero_test_gpt()
    plan_ = resolve_plan(ZeroTopoConfig(enabled=True, preset=preset, **({} if quantized else UNQUANTIZED)), EMULATED)
    units = _engine_units(cfg, plan_)
    assert zero_plans.units(_arch(cfg), plan_) == units
    t = perf_zero.traffic(plan_, units, accum, 2)
    assert zero_plans.traffic(plan_, _arch(cfg), accum, 2) == Traffic(t.by_level(), t.steps_by_level())
    m = perf_zero.memory(plan_, units, 0, 2)
    assert zero_plans.states(plan_, _arch(cfg), 2) == {
        "weights": m["primary"],
        "secondary": m["secondary"],
        "gradients": m["gradients"],
        "optimizer": m["optimizer"],
    }


def test_perf_zero_message_counts():
    """Traffic.steps: ring / pairwise messages, what the α term charges (zero3, 4 units, world 8)."""
    plan_ = resolve_plan(ZeroTopoConfig(enabled=True, preset="zero3"), EMULATED)
    t = perf_zero.traffic(plan_, _engine_units(_zero_test_gpt(), plan_), 1, 2)
    # forward 4 gathers + backward 3 (the root unit stays) + 4 reduce-scatters, 7 messages each;
    # the grad-norm all-reduce 2 x 7
    assert t.steps_by_level() == {"node": (4 + 3 + 4) * 7 + 14}
    zpp_plan = resolve_plan(ZeroTopoConfig(enabled=True, preset="zeropp"), EMULATED)
    zpp = perf_zero.traffic(zpp_plan, _engine_units(_zero_test_gpt(), zpp_plan), 2, 2)
    for level, calls in zpp.calls_by_level().items():
        assert zpp.steps_by_level()[level] >= calls  # every call is at least one message


def test_hpz_as_deepspeed_0_13_1_gathers_the_primary_every_micro_batch():
    """``secondary_serves_forward=False`` (003's DeepSpeed 0.13.1): every micro-batch's forward crosses
    nodes; today's rule crosses once per step and gathers inside the node after that."""
    plan_ = resolve_plan(ZeroTopoConfig(enabled=True, preset="zeropp"), EMULATED)
    units = _engine_units(_zero_test_gpt(), plan_)
    one = perf_zero.traffic(plan_, units, 1, 2)
    two = perf_zero.traffic(plan_, units, 2, 2).bytes["forward"]["gpu"]  # one secondary gather per unit
    for accum in (2, 5):
        old = perf_zero.traffic(plan_, units, accum, 2, secondary_serves_forward=False)
        new = perf_zero.traffic(plan_, units, accum, 2)
        assert old.bytes["forward"] == {lv: b * accum for lv, b in one.bytes["forward"].items()}
        assert old.bytes["backward"] == new.bytes["backward"] and old.bytes["step"] == new.bytes["step"]
        assert new.bytes["forward"]["node"] == one.bytes["forward"]["node"] > 0
        assert new.bytes["forward"]["gpu"] == (accum - 1) * two > 0 and "gpu" not in old.bytes["forward"]
    z3 = resolve_plan(ZeroTopoConfig(enabled=True, preset="zero3"), EMULATED)  # no secondary: no difference
    assert (
        perf_zero.traffic(z3, units, 3, 2, secondary_serves_forward=False).bytes
        == perf_zero.traffic(z3, units, 3, 2).bytes
    )


# ---- 3D-PMM: the planner's numbers are perf.pmm's on the ledger-test runs -------------------------
def _factorizations_of(topology):
    return perf_pmm.factorizations(topology.world_size)


@pytest.mark.parametrize(
    "topology",
    [
        EMULATED,
        Topology.from_preset("frontier", 16),
        Topology.from_preset("frontier", 48),
        Topology.from_preset("frontier", 96, {"gpu": 3}),
    ],
    ids=lambda t: str(t.world_size),
)
def test_fast_axis_spans_equal_the_groups_levels(topology):
    """ParallelDims.spans (O(levels) per axis) == the outermost level of any of the axis's groups."""
    for grid in _factorizations_of(topology):
        dims = grid.parallel_dims
        by_groups = {}
        for axis in dims.names:
            levels = {topology.level_of(g) for g in dims.groups([axis])} - {None}
            by_groups[axis] = max(levels, key=topology.index) if levels else None
        assert dims.spans(topology) == by_groups, grid


@pytest.mark.parametrize("checkpoint", [False, True])
def test_pmm_model_spec_equals_the_built_models(checkpoint):
    from ds_ext.models import GPT
    from ds_ext.pmm.plans import plan_for
    from ds_ext.pmm.spec import model_spec

    for cfg in (_pmm_test_gpt(checkpoint), _zero_test_gpt(checkpoint)):
        model = GPT(cfg)
        assert pmm_grids.model_spec(_arch(cfg), checkpoint) == model_spec(model, plan_for(model))


LEDGER_GRIDS = [
    (2, 2, 2, 1),
    (2, 1, 2, 2),
    (1, 2, 2, 2),
    (4, 2, 1, 1),
    (2, 2, 1, 2),
    (8, 1, 1, 1),
    (1, 1, 8, 1),
    (1, 1, 1, 8),
    (1, 8, 1, 1),
    (1, 2, 4, 1),
]  # tests/test_pmm_engine.py


@pytest.mark.parametrize("dims,accum,elem", [*[(g, 1, 2) for g in LEDGER_GRIDS], ((2, 2, 2, 1), 2, 4)], ids=str)
def test_pmm_planner_equals_perf_pmm_on_the_ledger_test_runs(dims, accum, elem):
    """tests/test_pmm_engine.py::test_ledger_equals_model_per_layer_and_level's runs (global batch 8)."""
    cfg, grid = _pmm_test_gpt(), Grid(*dims)
    spec = pmm_grids.model_spec(_arch(cfg), checkpointing=False)
    micro = 8 // (grid.data * accum)
    got = pmm_grids.traffic(spec, grid, EMULATED, micro, cfg.seq_len, elem, accum)
    want: dict[str, float] = {}
    for per in perf_pmm.ledger_bytes(spec, grid, EMULATED, micro, cfg.seq_len, elem, accum).values():
        for level, b in per.items():
            want[level] = want.get(level, 0.0) + b
    assert got.bytes == want
    seconds = sum(comm_seconds(got, EMULATED).values())
    assert seconds == pytest.approx(
        perf_pmm.comm_time(
            spec,
            grid,
            EMULATED,
            micro,
            cfg.seq_len,
            elem,
            accum,
            bw=perf_pmm.Bandwidths.per_rank_links(EMULATED),
            latency=True,
        ),
        rel=1e-12,
    )
    m = perf_pmm.memory(spec, grid, elem, zero_stage=1)
    assert pmm_grids.states(spec, grid, elem) == {
        "weights": m["layer_params"] + m["replicated_params"],
        "secondary": m["gathered_weights"],
        "gradients": m["layer_grads"] + m["replicated_grads"],
        "optimizer": m["optimizer"],
    }


# ---- estimate: batch choice, fit, time ------------------------------------------------------------
def test_divisors_and_batch_options():
    assert divisors(12) == [1, 2, 3, 4, 6, 12] and divisors(16) == [1, 2, 4, 8, 16] and divisors(1) == [1]
    job = make_job(models.lookup("gpt-5b"), FRONTIER, 2, global_batch=48)
    assert batch_options(job, 16) == [(3, 1), (1, 3)]
    assert batch_options(job, 5) == []
    fixed = make_job(models.lookup("gpt-5b"), FRONTIER, 2, global_batch=48, grad_accum=3)
    assert batch_options(fixed, 16) == [(1, 3)] and batch_options(fixed, 8) == [(2, 3)]


def _toy(job, states_gb, act_gb_per_seq, data=16):
    return Candidate(
        "zero",
        "toy",
        {},
        data,
        {"weights": states_gb * 1e9, "secondary": 0.0, "gradients": 0.0, "optimizer": 0.0},
        lambda b: b * act_gb_per_seq * 1e9,
        lambda b, g: Traffic({"node": 1e9 * g, "gpu": 2e9}, {"node": 10.0 * g}),
    )


def test_evaluate_fewest_micro_steps_that_fit_and_the_time_model():
    job = make_job(models.lookup("gpt-5b"), FRONTIER, 2, global_batch=64)  # 4 sequences per rank
    e = evaluate(job, _toy(job, 50, 5))  # 68.7 GB: 50 + 5 b fits b <= 3 -> b = 2, GA = 2
    assert (e.micro_batch, e.grad_accum, e.fits) == (2, 2, True)
    node, gpu = job.topology.level("node"), job.topology.level("gpu")
    assert e.comm_s == {"node": 2e9 / node.bandwidth + 20 * node.latency, "gpu": 2e9 / gpu.bandwidth}
    assert e.compute_s == pytest.approx(job.flops / 16 / compute_rate.rate(), rel=1e-15)  # 000's step rate
    assert e.tflops == job.flops / (e.step_s * 16)
    assert e.max_params == 64 * GiB * job.arch.params / 50e9
    big = evaluate(job, _toy(job, 70, 1))
    assert not big.fits and big.grad_accum == 4 and big.reason == "needs 71.0 GB per rank > 68.7 GB"


# ---- acceptance: 003's largest models (model states only, 64 GiB per GCD) --------------------------
def _estimates(nodes):
    arch = models.lookup("gpt-neox-20b")
    return {e.name: e for e in plan(make_job(arch, FRONTIER, nodes), ["zero"]).estimates}


def test_003_max_model_sizes():
    small, large = _estimates(2), _estimates(48)
    assert small["zero3"].max_params == pytest.approx(68e9, rel=0.05)  # 003 §II-A
    assert small["zeropp"].max_params == pytest.approx(55e9, rel=0.05)
    # 003 §VII-B's 36B needs decimal 64e9 bytes; with the 64 GiB that reproduces the two above
    # the model gives 1.75 psi + 12 psi / 384 + int8 block scales: 38.5B, a 7 % miss (README).
    per_param = 1.75 + 12 / 384 + 4 / 512 / 2
    assert large["zero_topo_paper"].max_params == pytest.approx(64 * GiB / per_param, rel=0.005)
    assert large["zero_topo_paper"].max_params / 36e9 - 1 == pytest.approx(0.07, abs=0.01)


# ---- CLI: outputs and one-line errors ------------------------------------------------------------
def test_plan_cli_writes_table_json_png(tmp_path, capsys):
    from ds_ext.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt-5b", "--nodes", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "best: " in text and "runner-up: " in text and "zero_topo_paper" in text
    data = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 10_000
    names = [p["name"] for p in data["plans"]]
    assert data["best"] == names[0] and data["runner_up"] == names[1]
    first = data["plans"][0]
    assert set(first["memory_bytes"]) == {"weights", "secondary", "gradients", "optimizer", "activations"}
    assert math.isclose(first["step_s"], first["compute_s"] + sum(first["comm_s_per_level"].values()))


def test_plan_reads_a_ds_config(tmp_path, capsys):
    from ds_ext.cli import main

    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "bf16": {"enabled": True},
        "ds_ext": {"zero_topo": {"enabled": True, "preset": "zero_topo_paper", "secondary": {"level": "gpu"}}},
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    out = tmp_path / "plan.json"
    assert (
        main(
            [
                "plan",
                "--model",
                "gpt-5b",
                "--nodes",
                "2",
                "--ds-config",
                str(path),
                "--families",
                "zero",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    assert data["job"]["global_batch"] == 2 * 4 * 16 and data["job"]["grad_accum"] == 4
    configured = next(p for p in data["plans"] if p["name"] == "configured zero_topo_paper")
    paper = next(p for p in data["plans"] if p["name"] == "zero_topo_paper")
    assert configured["memory_bytes"]["secondary"] < paper["memory_bytes"]["secondary"]  # Sec-Degree 8 < 2
    assert "configured zero_topo_paper" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "gpt-7b", "--nodes", "2"], "--model: unknown model 'gpt-7b'; allowed: gpt-neox-20b, "),
        (["--model", "gpt-5b", "--nodes", "0"], "--nodes: 0 does not fit frontier; allowed: 1 to 9408"),
        (["--model", "gpt-5b", "--nodes", "9409"], "--nodes: 9409 does not fit frontier; allowed: 1 to 9408"),
        (
            ["--model", "gpt-5b", "--nodes", "2", "--machine", "summit"],
            "--machine: unknown machine 'summit'; allowed: frontier",
        ),
        (
            ["--layers", "2", "--hidden", "64", "--nodes", "2"],
            "give --model NAME or the shape; missing --heads --vocab --seq",
        ),
        (
            ["--layers", "2", "--hidden", "64", "--heads", "3", "--vocab", "9", "--seq", "8", "--nodes", "2"],
            "--hidden 64 must be divisible by --heads 3",
        ),
        (["--model", "gpt-5b", "--layers", "2", "--nodes", "2"], "--model gpt-5b takes no --layers"),
        (
            ["--model", "gpt-5b", "--nodes", "2", "--bandwidth", "rack=3"],
            "--bandwidth: frontier has no level 'rack'; allowed: gcd, gpu, node",
        ),
        (["--model", "gpt-5b", "--nodes", "2", "--families", "fsdp"], "--families: unknown fsdp; allowed: zero, pmm3d"),
        (["--model", "gpt-5b", "--nodes", "2", "--families", "zero", "zero"], "--families: zero given twice"),
        (
            ["--model", "gpt-5b", "--nodes", "2", "--ds-config", "/nonexistent/ds.json"],
            "--ds-config /nonexistent/ds.json: ds_config file '/nonexistent/ds.json' does not exist",
        ),
        (
            ["--model", "gpt-5b", "--nodes", "2", "--global-batch", "48", "--grad-accum", "5"],
            "--grad-accum: 5 does not divide the global batch of 48 sequences",
        ),
        (["--model", "gpt-5b", "--nodes", "2", "--efficiency", "1.5"], "--efficiency: 1.5 must be in (0, 1]"),
        (["--model", "gpt-5b", "--nodes", "2", "--global-batch", "0"], "--global-batch: 0 must be a positive integer"),
        (["--model", "gpt-5b", "--nodes", "2", "--grad-accum", "-2"], "--grad-accum: -2 must be a positive integer"),
        (["--model", "gpt-5b", "--nodes", "2", "--memory-GB", "-1"], "--memory-GB: -1 must be a positive number"),
        (["--model", "gpt-5b", "--nodes", "2", "--peak-TFLOPS", "0"], "--peak-TFLOPS: 0 must be a positive number"),
        (["--model", "gpt-5b", "--nodes", "2", "--top-k", "0"], "--top-k: 0 must be a positive integer"),
        (["--model", "gpt-5b", "--nodes", "2", "--latency", "node=-1"], "--latency: node=-1.0 must be >= 0"),
        (
            ["--model", "gpt-5b", "--nodes", "2", "--bandwidth", "node=x"],
            "--bandwidth expects LEVEL=NUMBER, got 'node=x'",
        ),
        (
            ["--model", "gpt-5b", "--nodes", "2", "--bandwidth", "node=1", "--bandwidth", "node=2"],
            "--bandwidth: level 'node' given twice",
        ),
    ],
)
def test_bad_input_fails_in_one_line(args, message, capsys):
    from ds_ext.cli import main

    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"ds-ext: error: {message}"), err


def test_bad_ds_config_block_fails_in_one_line(tmp_path, capsys):
    from ds_ext.cli import main

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"ds_ext": {"zero_topo": {"enabled": True, "preset": "zero4"}}}))
    assert main(["plan", "--model", "gpt-5b", "--nodes", "2", "--ds-config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"ds-ext: error: --ds-config {path}: ds_ext.zero_topo.preset"), err
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 0}))
    assert main(["plan", "--model", "gpt-5b", "--nodes", "2", "--ds-config", str(path)]) == 2
    assert "train_micro_batch_size_per_gpu must be a positive integer, got 0" in capsys.readouterr().err


def test_simulate_sweep_efficiency_and_outputs(tmp_path, capsys):
    from ds_ext.cli import main
    from ds_ext.planner import simulate

    records = simulate.sweep([models.lookup("gpt-neox-20b")], [2, 4], FRONTIER, ["zero"])
    assert len(records) == 2 * len(PRESETS)
    for r in records:
        if r["nodes"] == 2:
            assert r["scaling_efficiency"] == 1.0
    z3 = {r["nodes"]: r for r in records if r["plan"] == "zero3"}
    assert z3[4]["scaling_efficiency"] == z3[4]["tflops_per_gcd"] / z3[2]["tflops_per_gcd"] < 1
    out = tmp_path / "sim.json"
    assert main(["simulate", "--nodes", "2", "4", "--families", "zero", "--out", str(out)]) == 0
    assert "sweep: 12 points" in capsys.readouterr().out
    assert len(json.loads(out.read_text())["records"]) == 12 and out.with_suffix(".png").exists()


def test_validation_rows_and_table():
    from ds_ext.planner import validate

    row = validate.Row("ratio", "003", 1.405, 1.5, 0.15)
    assert row.rel_error == pytest.approx(1.5 / 1.405 - 1) and row.holds is True
    assert validate.Row("ratio", "003", 1.707, 1.06, 0.15).holds is False
    assert validate.Row("x", "000", 1.0, 0.9).holds is None
    rows = validate.zero_rows(FRONTIER)
    by = {r.claim.split(" (batch")[0]: r for r in rows}
    s384 = validate._zero(FRONTIER, 48)
    assert by["TFLOPS per GCD ZeRO++ / ZeRO-3, 384 GCDs"].predicted == s384["zeropp"].tflops / s384["zero3"].tflops
    today = validate._zero(FRONTIER, 48, deepspeed="0.19.8")
    assert s384["zeropp"].traffic.bytes["node"] > today["zeropp"].traffic.bytes["node"]
    assert s384["zeropp"].memory == today["zeropp"].memory
    for claim in ("largest model, ZeRO-3, 16 GCDs (B params)", "TFLOPS per GCD ZeRO++ / ZeRO-3, 384 GCDs"):
        assert by[claim].holds is True
    pmm = validate.pmm_rows(FRONTIER, ((16, "gpt-5b", 1.6), (32, "gpt-5b", 3.0)))
    assert [r.published for r in pmm] == [100.0, 93.75, 0.9375]
    assert pmm[2].predicted == pytest.approx(pmm[1].predicted / pmm[0].predicted)
    text = validate.markdown(rows)
    assert text.count("\n") == len(rows) + 1 and "| yes |" in text


def test_validation_on_a_machine_the_papers_do_not_fit_is_one_line():
    """``simulate --validate --memory-GB 0.01``: a PlanInputError naming the comparison,
    not an assertion or a RuntimeError."""
    from ds_ext.planner import validate

    small = FRONTIER.model_copy(update={"device_memory": 1e7})
    with pytest.raises(PlanInputError, match=r"^--validate: gpt-5b 3D-PMM on 16 GCDs fits no plan on this machine"):
        validate.pmm_rows(small, ((16, "gpt-5b", 1.6),))
    with pytest.raises(PlanInputError, match=r"^--validate: gpt-22b Megatron on 8 nodes fits no plan"):
        validate.megatron_rows(small, sensitivity=False)


def test_compute_rate_is_000s_measured_step_and_the_machines():
    """The Frontier preset computes at 000's measured step rate: GPT-320B's 13.19 s of computation
    per batch of 8,192 sequences on 32,768 GCDs (000 §V-C, Tables I-III), FLOPs as Narayanan et al.
    count them with the checkpoint recompute (c = 4)."""
    f = step_flops(8192, 2048, 96, 16384, 50304, checkpointing=True)
    assert compute_rate.rate() == f / 32768 / 13.19
    assert 98e12 < compute_rate.rate() < 98.5e12 < compute_rate.GEMM_FLOPS  # below the single-GEMM bound
    assert FRONTIER.flops == pytest.approx(compute_rate.rate(), rel=1e-15)
    assert compute_rate.rate(30.1) == f / 32768 / 30.1  # untuned (PyTorch's TN matmul): the sensitivity row


# The acceptance rows 004 Table V (±20 %) and 001 Fig 6.12 (±15 %), and whether each holds, as the
# README states it: a row that leaves its band, starts holding or disappears fails here.
# Between MI250X at 004 §III-A's 100 GB/s: the 175B recipe's TP 4 all-reduces get faster and the row
# leaves its band (+25 %; at 003 Table II's 50 GB/s it held at +19 %, the sensitivity row); so does 6.7B at 512 GCDs.
TABLE_V_ROWS = {
    "gpt-175b Table V recipe": (False, 0.20, 0.30),
    "gpt-1t Table V recipe": (False, 0.30, 0.40),
    "gpt-22b planner's Megatron layout": (True, 0.10, 0.20),
}
FIG_6_12_ROWS = {
    "gpt3-6.7b ZeRO-3 on 512 GCDs": (False, 0.15, 0.25),
    "gpt3-13b ZeRO-3 on 512 GCDs": (False, 0.5, 1.0),
    "gpt3-6.7b ZeRO-3 on 1024 GCDs": (True, 0.0, 0.15),
    "gpt3-13b ZeRO-3 on 1024 GCDs": (False, 0.3, 0.6),
}


def _acceptance(rows, expected, tolerance):
    found = {key: [r for r in rows if r.claim.startswith(key)] for key in expected}
    for key, (holds, lo, hi) in expected.items():
        assert len(found[key]) == 1, key
        row = found[key][0]
        assert row.tolerance == tolerance and row.holds is holds, (key, row.predicted, row.rel_error)
        assert lo <= row.rel_error <= hi, (key, row.rel_error)  # the error the README reports


def test_004_table_v_rows():
    """004 Table V's recipes (TP 4 x PP 16, TP 8 x PP 64, MBS 1, GBS 640 / 1,600) planned by the
    Megatron family: 175B within 20 % of 69.2 on one replica; 1T on 000 §II's 1,024 GCDs at 004
    §V-C1's GBS 3,200 (two replicas of 1,600 micro-batches), 24 % above 61.2 (README: the compute rate)."""
    from ds_ext.planner import validate

    rows = validate.megatron_rows(FRONTIER, sensitivity=False)
    _acceptance(rows, TABLE_V_ROWS, 0.20)
    assert [r.published for r in rows if r.tolerance] == [69.2, 61.2, 73.5]
    assert (
        "megatron tp4 pp16 dp1 mb1, 1 x 640" in rows[0].claim and "megatron tp8 pp64 dp2 mb1, 1 x 1600" in rows[2].claim
    )
    # the setups 004 leaves unstated are labelled so, with the reading used
    assert all(r.unstated for r in rows if r.tolerance) and "GCD count" in rows[0].unstated


def test_004_1t_readings_differ_by_the_bubble():
    """1T on 1,024 GCDs = 2 replicas of TP 8 x PP 64 (8 x 64 x 2). GBS 3,200 gives m = 3,200 / 2 = 1,600
    micro-batches per replica, Table V's literal 1,600 gives m = 800: the compute slots are stretched
    by (m + 63) / m = 1,663 / 1,600 and 863 / 800, so the compute per step of the literal reading is
    1,600 / 3,200 x (863 / 800) / (1,663 / 1,600) of the other (hand arithmetic: 0.51894...)."""
    from ds_ext.planner import validate

    _, wide = validate._megatron(FRONTIER, "gpt-1t", 128, 3200)
    _, literal = validate._megatron(FRONTIER, "gpt-1t", 128, 1600)
    assert wide.name == literal.name == "megatron tp8 pp64 dp2 mb1"
    assert (wide.grad_accum, literal.grad_accum) == (1600, 800)
    assert literal.compute_s / wide.compute_s == pytest.approx(0.5 * (863 / 800) / (1663 / 1600), rel=1e-12)
    assert 0.5 * (863 / 800) / (1663 / 1600) == pytest.approx(0.518941, abs=1e-6)
    rows = validate.megatron_rows(FRONTIER)
    row = next(r for r in rows if "Table V's GBS 1,600 on the 1,024 GCDs" in r.claim)
    assert row.tolerance is None and row.predicted == literal.tflops / 1e12 and "800 micro-batches" in row.claim


def test_fig_6_12_rows():
    """001 Fig 6.12 (ZeRO-3, RCCL vs PCCL) at 000 Table I's batch: the 6.7B rows hold, 13B's gains come
    out above the published 16 % / 39 % (README: the figure's batch is not stated)."""
    from ds_ext.planner import validate

    rows = validate.pccl_rows(FRONTIER, sensitivity=False)
    _acceptance(rows, FIG_6_12_ROWS, 0.15)
    assert [r.published for r in rows if r.tolerance] == [0.30, 0.16, 0.60, 0.39]
    assert all("less batch time" in r.claim for r in rows)
    assert all("no batch" in r.unstated for r in rows if r.tolerance)  # 001 states none: labelled, readings named
    assert "setup unstated" in validate.markdown(rows[:1])
    # every row's value is 1 - t_PCCL / t_RCCL of the two ZeRO-3 plans the planner builds
    job = make_job(models.lookup("gpt3-6.7b"), FRONTIER, 64, validate.FIG_6_12_BATCH)
    r, p = (
        evaluate(job, zero_plans.candidate(job, {"preset": "zero3"}, deepspeed="0.19.8", collectives=c))
        for c in ("rccl", "pccl")
    )
    assert rows[0].predicted == 1 - p.step_s / r.step_s and (r.micro_batch, r.grad_accum) == (16, 1)


@pytest.mark.parametrize("model,gcds,published", [("gpt3-6.7b", 512, 0.30), ("gpt3-13b", 1024, 0.39)])
def test_fig_6_12_implied_compute_multiple(model, gcds, published):
    """The diagnostic k: with the compute k times slower (the machine's efficiency / k) and the
    communication unchanged, the planner's own less-batch-time equals the published value."""
    from ds_ext.planner import validate

    k = validate.implied_compute_multiple(FRONTIER, model, gcds, published)
    slower = FRONTIER.model_copy(update={"efficiency": FRONTIER.efficiency / k})
    assert validate.less_batch_time(slower, model, gcds) == pytest.approx(published, rel=1e-9)


def test_fig_6_12_implied_compute_multiple_by_hand():
    """k = ((R - P) / published - R) / C with R, P and C read off the two plans: for 13B on 512 GCDs
    (C = 36.34 s, R = 16.99 s, P = 1.63 s with the node's ring at 100 GB/s), ((16.99 - 1.63) / 0.16 - 16.99) / 36.34 = 2.174."""
    from ds_ext.planner import validate

    assert ((16.99 - 1.63) / 0.16 - 16.99) / 36.34 == pytest.approx(2.174, abs=1e-3)
    assert validate.implied_compute_multiple(FRONTIER, "gpt3-13b", 512, 0.16) == pytest.approx(2.174, abs=0.005)
    rows = [r for r in validate.pccl_rows(FRONTIER) if r.claim.strip().startswith("diagnostic")]
    assert len(rows) == 4 and all(r.published is None and r.tolerance is None for r in rows)


# ---- TED layouts (001 ch. 7) ------------------------------------------------------------------
def _moe(**kw):
    from ted_support import config

    c = config(**kw)
    return models.Arch(
        name="moe",
        layers=c.n_layers,
        hidden=c.d_model,
        heads=c.n_heads,
        vocab=c.vocab_size,
        seq=c.seq_len,
        experts=c.num_experts,
    ), c


@pytest.mark.parametrize("T,P", [(1, 1), (2, 4), (2, 2), (1, 8), (4, 2)])
def test_ted_rank_params_equal_the_built_model(T, P):
    """Non-expert and expert parameters per rank equal the GPTMoE's, sliced as ``ted_bind`` slices it
    (Megatron: column weight and bias split, row weight split; experts E / G_expert per rank)."""
    from ds_ext.models.gpt_moe import GPTMoE

    arch, cfg = _moe(num_experts=8)
    model = GPTMoE(cfg)
    n_exp = n_nonexp = 0
    for name, p in model.named_parameters():
        n = p.numel()
        expert = "deepspeed_experts" in name
        column = any(f".{k}." in name for k in ("qkv", "fc1")) or (expert and name.split(".")[-2] == "0")
        row = name.endswith(("proj.weight", "fc2.weight")) or (expert and name.endswith(".2.weight"))
        n = n // T if column or row else n
        if expert:
            n_exp += n
        else:
            n_nonexp += n
    n_exp //= P  # the serial model holds all E experts, a rank E / G_expert of them
    assert ted_layouts.rank_params(arch, T, P) == (n_nonexp, n_exp)
    assert arch.params == sum(p.numel() for p in model.parameters())


def test_ted_states_are_eq_7_4_and_eq_7_5():
    """Eq 7.4 per state; for the 001 §7.1.1 family (G_expert = E) the total is Eq 7.5 plus the
    tables ds_ext's GPT-MoE keeps whole on every tensor rank."""
    arch = models.with_experts(models.lookup("gpt3-6.7b"), 16)
    G, T, E = 256, 4, 16
    lay = TEDLayout.build(G, T, E)
    s = ted_layouts.states(arch, lay)
    nonexp, exp = ted_layouts.rank_params(arch, T, E)
    assert s["weights"] == s["gradients"] == 2 * (nonexp + exp)
    assert s["optimizer"] == 12 * nonexp / lay.nonexp_data + 12 * exp / lay.expert_data
    base = models.lookup("gpt3-6.7b")
    replicated_root = 4 * base.root_params * (1 - 1 / T)  # Eq 7.5 splits every non-expert parameter over T
    assert sum(s.values()) == pytest.approx(eq_7_5(base.params, E, G, T) + replicated_root, rel=0.005)


def test_ted_traffic_is_perf_ted_per_block_plus_dense_and_zero1():
    arch = models.with_experts(models.lookup("gpt3-1.3b"), 8)
    topo = Topology.from_preset("frontier", 64)
    lay = TEDLayout.build(64, 2, 8)
    shape = ted_layouts.block_shape(arch, 4, 2)
    assert shape.capacity == 4 * arch.seq // 8
    block = moe_block_traffic(lay, topo, 0, shape, dtd=True, cac=True, checkpointing=True)
    levels = lay.levels(topo, 0)
    micro = ted_layouts.micro_traffic(arch, lay, topo, 4, 2)
    dense = (arch.layers - arch.moe_layers) * 4 * 2 * (4 * arch.seq * arch.hidden * 2) / 2
    per_level = {lv: 0.0 for lv in micro.bytes}
    for (_, _, lv), b in block.bytes.items():
        per_level[lv] += b * arch.moe_layers
    per_level[levels["tensor"]] += dense
    assert micro.bytes == pytest.approx(per_level)
    step = ted_layouts.step_traffic(arch, lay, topo, 2)
    nonexp, exp = ted_layouts.rank_params(arch, 2, 8)
    assert sum(step.bytes.values()) == pytest.approx(3 * 2 * (nonexp * 31 / 32 + exp * 3 / 4))
    total = ted_layouts.traffic(arch, lay, topo, 4, 3, 2)
    assert total.bytes == pytest.approx({lv: 3 * micro.bytes.get(lv, 0) + step.bytes.get(lv, 0) for lv in total.bytes})


def test_ted_plan_for_an_moe_only_and_layout_constraints():
    job = make_job(models.with_experts(models.lookup("gpt3-6.7b"), 32), FRONTIER, 16)
    result = plan(job)
    assert {e.family for e in result.estimates} == {"ted"} and result.best is not None
    for e in result.estimates:
        t = e.config["ds_ext"]["ted"]
        assert 8 % t["tensor_parallel"] == 0 and 32 % t["expert_parallel"] == 0
    assert all("(an MoE)" in d.reason for d in result.dropped if d.family in ("zero", "pmm3d"))  # listed, not silent
    assert {d.family for d in result.dropped} >= {"zero", "pmm3d"}
    built, dropped = ted_layouts.candidates(make_job(models.lookup("gpt3-6.7b"), FRONTIER, 16))
    assert built == [] and [d.reason for d in dropped] == [
        "a dense model (no experts): the zero and pmm3d families plan it"
    ]
    _, dropped = ted_layouts.layouts(
        models.with_experts(models.lookup("gpt3-2.7b"), 32), Topology.from_preset("frontier", 16)
    )
    assert {d.name: d.reason for d in dropped}["ted 8x32"] == "G_tensor x G_expert = 256 does not divide 16 ranks"


def test_no_candidate_is_dropped_silently(capsys):
    """Every grid and preset is ranked or listed with its reason, in the
    result, the table and the JSON."""
    from ds_ext.cli import main
    from ds_ext.planner import report

    job = make_job(models.lookup("gpt-5b"), FRONTIER, 2, global_batch=24)  # 24 sequences: no 16 replicas
    result = plan(job)
    everything = {f"pmm3d {g.x}x{g.y}x{g.z}x{g.data}" for g in perf_pmm.factorizations(16)} | set(PRESETS) | {"ted"}
    layouts = {f"megatron tp{t} pp{p} dp{16 // (t * p)}" for t in divisors(16) for p in divisors(16 // t)}
    ranked = {e.name for e in result.estimates}
    dropped = {d.name: d.reason for d in result.dropped}
    built = {n for n in layouts if f"{n} mb1" in ranked | set(dropped)}  # a layout's rules passed: one per micro-batch
    everything |= (layouts - built) | {f"{n} mb{b}" for n in built for b in (1, 2, 4, 8)}
    assert ranked | set(dropped) == everything and not ranked & set(dropped)
    assert dropped["zero3"] == "the global batch of 24 sequences does not divide over 16 replicas"
    assert dropped["pmm3d 1x1x16x1"] == "z=16 does not divide the micro-batch 24, nor any of its 7 smaller splits"
    hidden = report.not_shown(result, 2)
    assert len(hidden) == len(everything) - len(report.shown(result, 2))
    text = report.table(result, 2)
    assert f"not shown ({len(hidden)}), by reason:" in text and "fit, slower than the --top-k 2 shown" in text
    assert main(["plan", "--model", "gpt-5b", "--nodes", "2", "--global-batch", "24", "--top-k", "2"]) == 0
    assert f"not shown ({len(hidden)})" in capsys.readouterr().out


def test_no_plan_fits_says_what_would(capsys):
    from ds_ext.cli import main
    from ds_ext.planner.plan import what_would_fit

    arch = models.lookup("gpt-175b")  # 004 Table V: a fixed batch of 640 sequences
    job = make_job(arch, FRONTIER, 1)
    assert plan(job, ["zero"]).best is None
    assert what_would_fit(job, ["zero"], False).startswith("8 nodes would fit")  # 5: memory; 6, 7: 640 over 48, 56
    assert plan(make_job(arch, FRONTIER, 8), ["zero"]).best is not None
    assert all(plan(make_job(arch, FRONTIER, n), ["zero"]).best is None for n in (5, 6, 7))
    seven = make_job(models.lookup("gpt-5b"), FRONTIER, 1, global_batch=7)  # never divides over 8k ranks
    assert what_would_fit(seven, ["zero"], True).startswith("--global-batch 8 (one sequence per rank) would fit")
    assert main(["plan", "--model", "gpt-175b", "--nodes", "1", "--families", "zero"]) == 0
    assert "no plan fits: 8 nodes would fit" in capsys.readouterr().out


def test_what_would_fit_finds_the_fewest_nodes_when_fitting_is_not_monotonic(monkeypatch):
    """Doubling 1 -> 2 -> 4 -> 8 finds a fit at 8; 5 fits and 6, 7 do not (a batch dividing over 5
    and 8 nodes, not 6 or 7): bisection between 4 and 8 would try 6, 7 and answer 8."""
    from ds_ext.planner import plan as planmod

    tried = []

    def best(job, nodes, batch, accum, families):
        tried.append(nodes)
        return "p" if nodes == 5 or nodes >= 8 else None

    monkeypatch.setattr(planmod, "_best", best)
    job = make_job(models.lookup("gpt-5b"), FRONTIER, 1)
    assert planmod.what_would_fit(job, ["zero"], False) == "5 nodes would fit (p there)"
    assert tried[:3] == [2, 4, 8]


def test_fig_7_9_ted_fits_larger_moes():
    from ds_ext.planner import validate

    for gpus in (32, 512):
        ted, ds = validate.largest_moe(gpus, validate.FIG_7_9_TENSOR), validate.largest_moe(gpus, (1,))
        assert ted.params > ds.params
        lay = TEDLayout.build(gpus, 1, ds.experts)
        assert sum(ted_layouts.states(ds, lay).values()) <= validate.SUMMIT_GPU_BYTES


NO_TORCH_COMMANDS = (
    ["plan", "--model", "gpt-5b", "--nodes", "2"],
    ["simulate", "--nodes", "2", "--families", "zero"],
    ["tune", "--world", "8", "--size", "gpu=2"],
    ["schema"],
)


def test_planner_commands_import_no_torch_and_help_is_cheap():
    """Plan, simulate, tune (no --measure) and schema are arithmetic: a fresh
    interpreter runs them without importing torch; ``ds-ext plan --help`` costs under 0.5 s of CPU."""
    import os
    import resource
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    script = (
        "import sys, contextlib, io\nfrom ds_ext.cli import main\n"
        f"for argv in {list(NO_TORCH_COMMANDS)!r}:\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        assert main(argv) == 0, argv\n"
        "    assert 'torch' not in sys.modules, f'{argv} imported torch'\n"
    )
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]

    def cpu(*argv: str) -> float:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([sys.executable, *argv], env=env, check=True, capture_output=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime

    help_cpu = min(cpu("-m", "ds_ext.cli", "plan", "--help") for _ in range(2))
    assert help_cpu < 0.5, f"ds-ext plan --help took {help_cpu:.2f} s of CPU"


def test_builtin_config_sections_are_the_plugins_own():
    """``ds-ext schema`` reads the built-ins' sections from torch-free modules (``ds_ext.config``'s
    list): the same classes the plugins validate with, one for each built-in plugin of the runtime's
    list and no other."""
    from ds_ext.config import BUILTIN_SECTIONS
    from ds_ext.runtime import builtin_plugins

    plugins = {p.name: p for p in builtin_plugins()}
    assert set(BUILTIN_SECTIONS) == set(plugins)
    assert all(BUILTIN_SECTIONS[name] is plugins[name].Config for name in plugins)


def test_simulate_honours_bandwidth_and_latency(tmp_path, capsys):
    """Simulate's machine flags reach the sweep (they were accepted and ignored);
    --validate refuses the sweep's flags it has no use for."""
    from ds_ext.cli import main

    def zero3(*flags):
        """zero3's TFLOPS per GCD in the printed sweep."""
        capsys.readouterr()
        assert main(["simulate", "--nodes", "2", "--families", "zero", *flags]) == 0
        row = next(line for line in capsys.readouterr().out.splitlines() if line.split()[1:2] == ["zero3"])
        return float(row.split()[2])

    base, slow, late = zero3(), zero3("--bandwidth", "node=1.25"), zero3("--latency", "node=1500")
    assert slow < base / 3 and late < base
    capsys.readouterr()
    assert main(["simulate", "--validate", "--nodes", "2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "ds-ext: error: --validate: takes no --nodes (the comparisons fix their "
        "own models, nodes and batches); the machine flags apply"
    )
    assert main(["simulate", "--nodes", "2", "0"]) == 2
    assert "--nodes: 0 does not fit frontier" in capsys.readouterr().err


def test_rccl_alpha_reproduces_001s_speedups_and_is_the_machines():
    """Α per inter-node ring step from 001 §6.3.1 (``planner.rccl``): with the
    derived ring bandwidth B and α, the RCCL ring time over the PCCL time gives back every
    published speedup, at 2,048 GCDs and at 32; the Frontier preset charges their mean."""
    from ds_ext.planner import rccl

    for pt in rccl.DERIVED:
        ring = lambda p, size: (p - 1) / p * size / pt.ring_bandwidth + (p - 1) * pt.alpha_s  # noqa: E731
        assert ring(2048, pt.size) / rccl.pccl_seconds(2048, pt.size) == pytest.approx(pt.speedup)
        assert ring(32, 2**30) / rccl.pccl_seconds(32, 2**30) == pytest.approx(pt.speedup_32)
    lo, hi = rccl.ALPHA_BAND_S
    assert 50e-6 < lo <= rccl.RING_STEP_ALPHA_S <= hi < 70e-6
    assert 75e-6 < rccl.mean_alpha(rccl.TABLE_II) < 90e-6
    node = FRONTIER.build_topology(2).level("node")
    assert node.latency == pytest.approx(rccl.RING_STEP_ALPHA_S)


def test_deepspeed_gathers_per_submodule_two_collectives_when_quantized():
    """DeepSpeed's ZeRO-3 fetches per submodule above the persistence
    threshold (4 per GPT-NeoX-20B block, its 2 tables), two all-gathers per quantized fetch;
    bytes are the per-block model's."""
    arch = models.lookup("gpt-neox-20b")
    assert zero_plans.deepspeed_fetches(arch) == (2, 4)
    tiny = models.Arch(name="t", layers=2, hidden=64, heads=4, vocab=256, seq=32)
    with pytest.raises(ValueError, match="resident"):
        zero_plans.deepspeed_fetches(tiny)
    topo = FRONTIER.build_topology(48)
    for preset, per_gather in (("zero3", 1), ("zeropp", 2)):
        plan_ = resolve_plan(ZeroTopoConfig(enabled=True, preset=preset), topo)
        ours = perf_zero.traffic(plan_, zero_plans.units(arch, plan_), 1, 2)
        ds = perf_zero.traffic(plan_, zero_plans.units(arch, plan_, True), 1, 2)
        assert ds.bytes == ours.bytes
        fwd = ds.steps["forward"]["node"]
        assert fwd == per_gather * (2 + 4 * arch.layers) * (topo.world_size - 1)
        assert ours.steps["forward"]["node"] == per_gather * (1 + arch.layers) * (topo.world_size - 1)


def test_batch_default_is_stated_and_printed(capsys):
    """GPT-NeoX-20B's default batch is 20B.yml's per-GPU keys (micro-batch 4 x 32
    accumulation steps) on every GCD, 49,152 sequences at 384 GCDs; every plan says where its batch
    comes from."""
    from ds_ext.cli import main

    job = make_job(models.lookup("gpt-neox-20b"), FRONTIER, 48)
    assert (job.global_batch, job.grad_accum) == (49_152, 32) and "1,536" in job.batch_source
    best = plan(job, ["zero"]).best
    assert (best.micro_batch, best.grad_accum) == (4, 32)
    assert make_job(models.lookup("gpt-5b"), FRONTIER, 2, global_batch=64).batch_source == "--global-batch"
    assert main(["plan", "--model", "gpt-neox-20b", "--nodes", "48", "--families", "zero"]) == 0
    assert "batch 49152 sequences per step (gpt-neox-20b's recipe: GPT-NeoX configs/20B.yml" in capsys.readouterr().out
    assert main(["plan", "--model", "gpt-5b", "--nodes", "2", "--global-batch", "64", "--families", "zero"]) == 0
    assert "batch 64 sequences per step (--global-batch)" in capsys.readouterr().out


def test_tune_and_plan_pmm3d_are_one_ranker(tmp_path, capsys):
    """``ds-ext tune`` and ``ds-ext plan --families pmm3d`` answer the same
    question with the same plans, batch and memory; --measure refuses the ranking flags."""
    from ds_ext.cli import main
    from ds_ext.planner import report

    tune_out = tmp_path / "tune.json"
    assert main(["tune", "--model", "gpt-10b", "--world", "32", "--top-k", "3", "--out", str(tune_out)]) == 0
    tuned = json.loads(tune_out.read_text())
    planned = plan(make_job(models.lookup("gpt-10b"), FRONTIER, 4), ["pmm3d"])  # what plan --nodes 4 runs
    assert tuned["top"] == json.loads(json.dumps([report.record(e) for e in planned.ranked[:3]]))
    assert tuned["global_batch"] == planned.job.global_batch == 8192
    capsys.readouterr()
    assert main(["tune", "--world", "8", "--measure", "--top-k", "3"]) == 2
    assert "--measure: takes no --top-k" in capsys.readouterr().err
    assert main(["tune", "--world", "12"]) == 2
    assert "--world: 12 is not a positive multiple of 8 ranks per node" in capsys.readouterr().err


def test_megatron_layouts_bubble_memory_and_the_published_recipe(capsys):
    """TP x PP x DP with the 1F1B bubble (p - 1) / m, per-stage memory with and
    without activation checkpointing, ZeRO-1 over DP; 004 Table V's recipe is always shown."""
    from ds_ext.cli import main
    from ds_ext.planner import megatron_plans as mp

    arch = models.lookup("gpt-5b")
    assert mp.stage_params(arch, 1, 1) == arch.params  # one stage, no TP: the whole model
    job = make_job(arch, FRONTIER, 4, global_batch=64)  # 32 GCDs
    e = evaluate(job, mp.candidate(job, 2, 4, 4))  # m = 64 / 4 = 16 micro-batches of 1
    assert (e.micro_batch, e.grad_accum) == (1, 16)
    imbalance = mp.stage_imbalance(arch, 4)  # the last stage's 6 layers + head over the mean stage
    layer, head = 1 + 2048 / (6 * 4096), 50304 / (16 * 4096)  # F per layer and of the head, in 24 c s h^2
    assert imbalance == pytest.approx((6 * layer + head) / ((24 * layer + head) / 4))
    assert mp.stage_imbalance(arch, 1) == 1
    assert e.compute_s == pytest.approx(job.flops / 32 / FRONTIER.flops * (16 + 4 - 1) / 16 * imbalance)
    t = 2048 * 4096 * 2  # bytes of one micro-batch's activation
    tp_level = job.topology.level_of([0, 1])
    # 6 all-reduces x 6 layers per stage, d = 2: 2S/2; plus the received activation's and gradient's
    # all-gather of the two TP halves (DeepSpeed's pipe_partitioned): 2 x 16 x t/2 x (2 - 1)
    assert e.traffic.bytes[tp_level] == pytest.approx(16 * 6 * 6 * t + 2 * 16 * t / 2)
    pp_level = job.topology.level_of([0, 8])  # stage boundary: TP 2 x DP 4 = 8 ranks per stage
    assert pp_level != tp_level and e.traffic.bytes[pp_level] == pytest.approx(2 * 16 * t / 2)  # each rank its half
    stage = 24 // 4
    ckpt = mp.activations(arch, 2, 4, 1, 16, True)
    working = 2048 * 4096 * (10 + 24 / 2)
    assert ckpt == pytest.approx(
        max(4 * stage * 2 * 2048 * 4096 + working, stage * 2 * 2048 * 4096 + working + 4 * 2048 * 50304 / 2)
    )
    assert mp.activations(arch, 2, 4, 1, 16, False) == pytest.approx(4 * stage * working)
    n = mp.stage_params(arch, 2, 4)
    assert e.memory["optimizer"] == 12 * n / 4 and e.memory["weights"] == 2 * n
    assert main(["plan", "--model", "gpt-175b", "--nodes", "8", "--families", "megatron", "--top-k", "1"]) == 0
    out = capsys.readouterr().out
    assert "megatron tp4 pp16 dp1 mb1  1 x 640" in out  # the published recipe, shown although not the fastest


def test_megatron_micro_batch_is_swept_and_20b_yml_layout_is_shown(capsys):
    """004 §IV (Fig 9) found the micro-batch the most impactful setting, so every Megatron
    layout is planned at micro-batches 1, 2, 4, 8 (and the recipe's); GPT-NeoX 20B.yml's own layout
    (TP 2 x PP 4, micro-batch 4) is planned at 384 GCDs, not dropped, and shown as the published recipe.
    The recipe's 32 accumulation steps are pure data parallelism's and do not bind it (m = 1,024 / 4)."""
    from ds_ext.cli import main
    from ds_ext.planner import megatron_plans as mp
    from ds_ext.planner import report

    job = make_job(models.lookup("gpt-neox-20b"), FRONTIER, 48)
    result = plan(job, ["megatron"])
    yml = [e for e in result.estimates if report.published(result, e)]
    assert [(e.name, e.micro_batch, e.grad_accum, e.fits) for e in yml] == [("megatron tp2 pp4 dp48 mb4", 4, 256, True)]
    assert {e.micro_batch for e in result.estimates} == {1, 2, 4, 8}
    # the micro-batch moves the step: more micro-batches per replica shrink the 1F1B bubble (p - 1) / m
    small = plan(make_job(models.lookup("gpt-175b"), FRONTIER, 8), ["megatron"])
    by_mb = {e.micro_batch: e for e in small.estimates if e.name.startswith("megatron tp4 pp16 dp1 ")}
    assert by_mb[1].compute_s < by_mb[8].compute_s and by_mb[8].grad_accum == 80
    # a given --grad-accum binds: only the micro-batches that split the replica's batch into it
    given = make_job(models.lookup("gpt-175b"), FRONTIER, 8, global_batch=640, grad_accum=160)
    assert [e.micro_batch for e in plan(given, ["megatron"]).estimates if "tp4 pp16" in e.name] == [4]
    assert main(["plan", "--model", "gpt-neox-20b", "--nodes", "48", "--families", "megatron", "--top-k", "1"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "megatron tp2 pp4 dp48 mb4 " in x)
    assert "4 x 256" in line
    assert mp.MICRO_BATCHES == (1, 2, 4, 8)


def test_hardware_figures_have_sources_and_the_machine_uses_them():
    """Every hardware figure the planner uses is in one table with its source; between MI250X
    the planner uses 004 §III-A's 100 GB/s (003 Table II's 50 only in a sensitivity row), and the
    runtime's frontier preset the planner's figures at every level."""
    from ds_ext.planner import hardware, rccl, validate

    assert all(f.source and f.what for f in hardware.FIGURES)
    assert hardware.value("gpu_bandwidth") == 100 and "004 §III-A" in hardware._BY_KEY["gpu_bandwidth"].source
    levels = {lv.name: lv for lv in FRONTIER.build_topology(2).levels}
    assert {k: lv.bandwidth / 1e9 for k, lv in levels.items()} == {"gcd": 200, "gpu": 100, "node": 12.5}
    preset = {lv.name: lv.bandwidth / 1e9 for lv in Topology.from_preset("frontier", 16).levels}
    assert preset == {
        k: hardware.value(f"{k}_bandwidth") for k in ("gcd", "gpu", "node")
    }  # the runtime's = the planner's
    assert rccl.NODE_RING_BANDWIDTH == 100e9 and FRONTIER.device_memory == hardware.value("device_memory")
    table = validate.hardware_table()
    assert all(f"`{f.key}`" in table for f in hardware.FIGURES) and "RCCL latency per inter-node ring step" in table
    rows = validate.megatron_rows(FRONTIER)
    row = next(r for r in rows if "Table II's 50 GB/s" in r.claim and "gpt-175b" in r.claim)
    assert row.tolerance is None and 0.15 < row.rel_error < 0.20  # held at 50 GB/s; the prediction does not


def test_plan_and_validate_share_the_batch_defaults():
    """The batch each Table V row uses is what ``plan --model M --nodes N`` uses by default."""
    from ds_ext.planner import validate

    for model, nodes, batch, _ in validate.TABLE_V:
        assert batch is None
    assert make_job(models.lookup("gpt-1t"), FRONTIER, 128).global_batch == 3200  # 004 §V-C1: 1,600 per 512 GCDs
    assert make_job(models.lookup("gpt-1t"), FRONTIER, 64).global_batch == 1600
    assert make_job(models.lookup("gpt-22b"), FRONTIER, 8).global_batch == 640
    assert validate.MEGATRON_22B[1] is None


def test_activation_checkpointing_is_read_from_the_ds_config(tmp_path, capsys):
    import json

    from ds_ext.cli import main

    base = {"train_batch_size": 64, "bf16": {"enabled": True}}
    for name, cfg, word in (("with", {**base, "activation_checkpointing": {}}, "on"), ("without", base, "off")):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(cfg))
        out = tmp_path / f"{name}_plan.json"
        assert (
            main(
                [
                    "plan",
                    "--model",
                    "gpt-5b",
                    "--nodes",
                    "2",
                    "--ds-config",
                    str(path),
                    "--families",
                    "zero",
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
        assert f"activation checkpointing {word} (--ds-config {path}" in capsys.readouterr().out
        job = json.loads(out.read_text())["job"]
        assert job["checkpointing"] is (word == "on")
    flops = [
        json.loads((tmp_path / f"{n}_plan.json").read_text())["job"]["flops_per_step"] for n in ("with", "without")
    ]
    assert flops[0] == pytest.approx(flops[1] * 4 / 3)  # the recompute's forward: c = 4 against 3


def test_pccl_costing_of_zero3_world_collectives():
    """PCCL (001 §6.2) for ZeRO-3's world all-gathers / reduce-scatters: per collective of S bytes,
    (N-1)/N S/8 bytes in log2 N messages across nodes and 7/8 S in 7 inside the node."""
    topo = FRONTIER.build_topology(64)
    arch = models.lookup("gpt3-6.7b")
    plan_ = resolve_plan(ZeroTopoConfig(enabled=True, preset="zero3"), topo)
    t = perf_zero.traffic(plan_, zero_plans.units(arch, plan_, True), 1, 2, False)
    p = zero_plans.pccl(t, plan_)
    calls = sum(t.calls[ph]["node"] for ph in ("forward", "backward"))
    full = sum(t.bytes[ph]["node"] for ph in ("forward", "backward")) * 512 / 511
    step_b, step_m = t.bytes["step"]["node"], t.steps["step"]["node"]
    assert p.bytes["node"] == pytest.approx(full * 63 / 64 / 8 + step_b)
    assert p.messages["node"] == pytest.approx(calls * 6 + step_m)  # log2 64
    assert p.bytes["gpu"] == pytest.approx(full * 7 / 8) and p.messages["gpu"] == calls * 7
    with pytest.raises(ValueError, match="zero3"):
        zero_plans.pccl(t, resolve_plan(ZeroTopoConfig(enabled=True, preset="zeropp"), topo))


def test_nic_bytes_are_the_node_crossing_hops_of_each_ring():
    """The planner's NIC column by the rings' structure, written apart from the link model.
    ZeRO-3's node-level collectives are rings over the world in rank order: of a node's P ranks only
    the last sends across the node, its whole volume, so the mean over the node is the volume / P.
    ZeRO-topo's node-level groups hold one rank of each node: every hop crosses, NIC = volume.
    ZeRO++ sits between; PCCL's phases book no links (None)."""
    job = make_job(models.lookup("gpt3-1.3b"), MACHINES["frontier"], 4)
    p = job.topology.ranks_per_node
    top = job.topology.levels[-1].name
    result = {e.name: e for e in plan(job, ["zero"]).estimates}
    zero3, topo, zpp = result["zero3"], result["zero_topo"], result["zeropp"]
    assert zero3.nic_bytes == pytest.approx(zero3.traffic.bytes[top] / p, rel=1e-9)
    # but for the step's few bytes of norms over the world (a ring: 1 / P of them cross)
    assert topo.nic_bytes == pytest.approx(topo.traffic.bytes[top], abs=64)
    assert zpp.traffic.bytes[top] / p < zpp.nic_bytes < zpp.traffic.bytes[top]
    e = evaluate(job, zero_plans.candidate(job, {"preset": "zero3"}, collectives="pccl"))
    assert e is not None and e.nic_bytes is None


# 004's Frontier recipes (configs/frontier/*.recipe): model, nodes, (TP, PP, DP)
FRONTIER_RECIPES = {
    "gpt_22b_004": ("gpt-22b", 8, (2, 2, 16)),
    "gpt_175b_004": ("gpt-175b", 128, (4, 16, 16)),
    "gpt_1t_004": ("gpt-1t", 128, (8, 64, 2)),
}


@pytest.mark.parametrize("recipe", sorted(FRONTIER_RECIPES))
def test_plan_predicts_each_frontier_recipe_with_ds_ext_and_plain(tmp_path, recipe):
    """``ds-ext plan --ds-config configs/frontier/<recipe>_zero_topo.json`` (ZeRO-topo's pipeline form)
    plans the recipe's Megatron layout both ways: the configured row differs from the published ZeRO-1
    row only in the step (the same compute, the same 16-bit weights and gradients
    and fp32 optimizer state per GCD up to ZeRO-topo's block padding) and sends fewer bytes across
    nodes (its int4 gradient reduction)."""
    from ds_ext.cli import main

    model, nodes, (tp, pp, dp) = FRONTIER_RECIPES[recipe]
    out = tmp_path / "plan.json"
    config = f"configs/frontier/{recipe}_zero_topo.json"
    args = ["plan", "--model", model, "--nodes", str(nodes), "--ds-config", config, "--top-k", "1", "--out", str(out)]
    assert main(args) == 0
    plans = {p["name"]: p for p in json.loads(out.read_text())["plans"]}
    plain = plans[f"megatron tp{tp} pp{pp} dp{dp} mb1"]
    ours = plans[f"configured megatron tp{tp} pp{pp} dp{dp} mb1 + zero_topo zero_topo"]
    assert (
        ours["config"]["ds_ext"]["zero_topo"]["form"] == "pipeline"
        and ours["config"]["zero_optimization"]["stage"] == 0
    )
    assert ours["compute_s"] == plain["compute_s"]
    for state in ("weights", "gradients", "optimizer"):
        assert 1 <= ours["memory_bytes"][state] / plain["memory_bytes"][state] < 1.001, state
    assert ours["memory_bytes"]["activations"] == plain["memory_bytes"]["activations"]
    assert ours["bytes_per_level"]["node"] < plain["bytes_per_level"]["node"]
    # the tiled optimizer's note: fp16 (the recipes' loss scale), so at most 12 bytes of step buffers per
    # optimizer element, the optimizer state's own 12 (fp32 master + 2 moments); the gradient reduction of
    # the largest unit (at most reduce_bucket_size = DeepSpeed's 5e8 elements, and at least 85 % of it at
    # these widths) with the fused quantizer's buffers, 11 bytes per element (raw blocks of the biases and
    # norms: the int4 codes sent and received, the fp32 rows of every chunk and the decoded blocks, and the
    # int16 codes); the peak fits without tiling
    (note,) = [n for n in ours["notes"] if n.startswith("ds_ext.tiled_optimizer")]
    mem = ours["memory_bytes"]
    untiled = mem["optimizer"]
    reduction = float(note.split("gradient reduction ")[1].split(" GB")[0]) * 1e9
    assert 0.85 * 11 * 5e8 - 5e6 <= reduction <= 11 * 5e8 + 5e6, note
    peak = sum(mem.values()) - mem["activations"] + max(mem["activations"], untiled, reduction)
    assert note.startswith("ds_ext.tiled_optimizer does not pay: ")
    assert f"at most {untiled / 1e9:.2f} GB untiled" in note and f"peak {peak / 1e9:.1f} GB untiled" in note
    assert "tiled_optimizer" not in ours["config"]["ds_ext"]
    assert ours["config"]["zero_optimization"] == {"stage": 0, "reduce_bucket_size": 500_000_000}


def _configured_plan(tmp_path, args, config, **zero):
    from ds_ext.cli import main

    cfg = json.loads((REPO / config).read_text())
    cfg["zero_optimization"].update(zero)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    out = tmp_path / "plan.json"
    assert main(["plan", *args, "--ds-config", str(path), "--out", str(out)]) == 0
    (ours,) = [p for p in json.loads(out.read_text())["plans"] if p["name"].startswith("configured")]
    (note,) = [n for n in ours["notes"] if n.startswith("ds_ext.tiled_optimizer")]
    return ours, note


def test_plan_says_what_sets_the_pipeline_forms_step_peak(tmp_path):
    """On a device of 29 GB the 22B recipe's untiled step does not fit (states 26.6 GB + the optimizer
    phase's 4.2 GB); with DeepSpeed's default bucket its gradient reduction (5.2 GB) keeps it from
    fitting tiled too, and the note says so and switches nothing on; with ``reduce_bucket_size`` 1e8
    (a fifth of the reduction) tiling makes it fit: the note says it pays and the configured row
    switches ``ds_ext.tiled_optimizer`` on at its default tile, the bucket kept."""
    args = ["--model", "gpt-22b", "--nodes", "8", "--memory-GB", "29"]
    config = "configs/frontier/gpt_22b_004_zero_topo.json"
    ours, note = _configured_plan(tmp_path, args, config)
    assert note.startswith("ds_ext.tiled_optimizer does not make it fit, the gradient reduction sets the peak ")
    assert "zero_optimization.reduce_bucket_size" in note and "of 29.0 GB" in note
    assert "tiled_optimizer" not in ours["config"]["ds_ext"]
    ours, note = _configured_plan(tmp_path, args, config, reduce_bucket_size=1e8)
    mem = ours["memory_bytes"]
    states = sum(mem.values()) - mem["activations"]
    assert note.startswith("ds_ext.tiled_optimizer pays, switched on: ")
    assert f"peak {(states + mem['optimizer']) / 1e9:.1f} GB untiled" in note  # the optimizer phase: 12 B / element
    assert ours["config"]["ds_ext"]["tiled_optimizer"] == {"enabled": True, "tile_size": 1_800_000}
    assert ours["config"]["zero_optimization"]["reduce_bucket_size"] == 100_000_000


def test_plan_reads_reduce_bucket_size_as_deepspeed_does(tmp_path, capsys):
    """DeepSpeed's default is the planner's, and a value DeepSpeed refuses is refused in one line."""
    from deepspeed.runtime.zero.config import get_zero_config

    from ds_ext.cli import main
    from ds_ext.planner import megatron_plans

    assert get_zero_config({}).reduce_bucket_size == megatron_plans.REDUCE_BUCKET_SIZE
    cfg = json.loads((REPO / "configs/frontier/gpt_22b_004_zero_topo.json").read_text())
    cfg["zero_optimization"]["reduce_bucket_size"] = 1.5
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    assert main(["plan", "--model", "gpt-22b", "--nodes", "8", "--ds-config", str(path)]) == 2
    assert "zero_optimization.reduce_bucket_size must be a positive whole number of elements" in capsys.readouterr().err


def test_plan_refuses_the_pipeline_form_without_a_megatron_recipe(tmp_path, capsys):
    from ds_ext.cli import main

    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps({"train_batch_size": 64, "ds_ext": {"zero_topo": {"enabled": True, "form": "pipeline"}}})
    )
    assert main(["plan", "--model", "gpt-5b", "--nodes", "2", "--ds-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ds_ext.zero_topo.form 'pipeline' is planned on the model's Megatron recipe" in err


def test_pipeline_form_step_equals_the_ledger_of_the_shrunk_recipe_run():
    """The planner's ZeRO-topo pipeline-form step for the 22B recipe shrunk to 8 CPU ranks
    (examples/frontier_recipe_cpu.sh: the real pretrain_gpt.py, TP 2 x PP 2 x DP 2, hidden 64, 4 layers,
    Megatron's vocabulary padded to 768, fp16) equals the bytes rank 0's ledger recorded in that run's
    last step (tests/test_megatron_deepspeed_zero_topo.py checks it on every opt-in run)."""
    from ds_ext.planner import megatron_plans
    from ds_ext.planner.estimate import Job
    from ds_ext.planner.machine import lookup
    from ds_ext.planner.models import Arch
    from ds_ext.topology import Topology

    arch = Arch(name="shrunk", layers=4, hidden=64, heads=4, vocab=768, seq=64)
    job = Job(
        arch=arch, machine=lookup("frontier"), topology=Topology.from_preset("frontier", 8, {"gpu": 2}), global_batch=8
    )
    step = megatron_plans.zero_topo_step_traffic(job, 2, 2, 2, {"preset": "zero_topo", "form": "pipeline"})
    assert step.bytes == {"gpu": 115504.0, "node": 12.0}
