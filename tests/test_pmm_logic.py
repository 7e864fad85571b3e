"""3D-PMM pure logic, no processes: grid layout, shard indices, config and conversion errors,
the performance model (Eqs 5.1-5.7, Fig 5.3, degenerate grids), matmul modes."""

import dataclasses

import pytest
import torch
from torch import nn

from ds_ext.models import GPT, GPTConfig
from ds_ext.perf import pmm as perf
from ds_ext.pmm import ConversionError, Grid, GridError, PMMEngine, parallelize
from ds_ext.pmm.grid import Axis
from ds_ext.pmm.layout import LinearLayout, chunked_index
from ds_ext.pmm.plans import plan_for
from ds_ext.pmm.spec import model_spec
from ds_ext.pmm.tuning import MODES, MatmulTuner, merge, run_mode
from ds_ext.topology import GB, US, Level, Topology


# ---- grid -----------------------------------------------------------------------------
def test_grid_layout_x_innermost_as_in_001_5_1_2():
    axes = Grid(2, 2, 2, 1).parallel_dims
    assert axes.groups(["x"]) == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert axes.groups(["y"]) == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert axes.groups(["z"]) == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert Grid(1, 1, 1, 8).partition("data") == (tuple(range(8)),)


def test_axis_levels_on_frontier_fastest_links_carry_x():
    topo = Topology.from_preset("frontier", 16)  # 2 GCD x 4 GPU x 2 nodes
    assert Grid(2, 4, 1, 2).parallel_dims.spans(topo) == {"x": "gcd", "y": "gpu", "z": None, "data": "node"}
    assert Grid(1, 1, 16, 1).parallel_dims.spans(topo) == {"x": None, "y": None, "z": "node", "data": None}


def test_grid_product_must_equal_world_one_line():
    with pytest.raises(
        GridError, match=r"^ds_ext\.pmm3d\.grid: x=2 \* y=2 \* z=2 \* data=2 = 16 != world size 8$"
    ) as err:
        Grid(2, 2, 2, 2).check_world(8)
    assert "\n" not in str(err.value)


def test_config_section_rejects_unknown_keys_and_bad_degrees():
    from ds_ext.config import DsExtConfigError, parse

    assert parse({"pmm3d": {"enabled": True, "grid": {"x": 2, "y": 2}}}).pmm3d.grid.x == 2
    assert parse({"pmm3d": {"enabled": True}}).pmm3d.grid == "auto"
    with pytest.raises(
        DsExtConfigError,
        match=r"ds_ext.pmm3d.overlap.all_gathers: unknown key; allowed keys: "
        r"all_gather, all_reduce, reduce_scatter",
    ):
        parse({"pmm3d": {"overlap": {"all_gathers": True}}})
    with pytest.raises(DsExtConfigError, match=r"ds_ext.pmm3d.grid.*x"):
        parse({"pmm3d": {"grid": {"x": 0}}})


def test_defaults_overlap_the_backward_all_reduce_and_keep_vocab_parallel_tables():
    # megatron-core overlaps its column-parallel dL/dI all-reduce with the
    # weight-gradient matmul, and AxoNN's optimize_communication has OAR on by default; pmm3d
    # (8,1,1,1) ran it blocking unless asked. ORS / OAG stay opt-in; tables stay vocab-parallel.
    from ds_ext.config import parse

    cfg = parse({"pmm3d": {"enabled": True}}).pmm3d
    assert cfg.overlap.all_reduce and not cfg.overlap.reduce_scatter and not cfg.overlap.all_gather
    assert cfg.tables == "vocab_parallel"
    assert parse({"pmm3d": {"tables": "replicated"}}).pmm3d.tables == "replicated"


# ---- shard layout ---------------------------------------------------------------------
def test_linear_layout_blocks_and_z_chunks_tile_the_weight():
    w = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)  # [n, k]
    pieces = []
    for xo in range(2):
        for yi in range(3):
            for z in range(2):
                pieces.append(LinearLayout(8, 6, 2, xo, 3, yi, 2, z).shard(w))
    assert torch.equal(torch.cat(pieces).sort().values, w.flatten())
    lay = LinearLayout(8, 6, 2, 1, 3, 2, 2, 0)
    assert torch.equal(lay.block(w), w[4:8, 4:6]) and torch.equal(lay.shard(w), w[4:6, 4:6].flatten())


def test_fused_qkv_split_head_blocks_per_chunk():
    # out = [q | k | v] of 4 features each, 2 ranks: rank 1 keeps the second half of q, k and v
    assert chunked_index(12, 2, 1, 3).tolist() == [2, 3, 6, 7, 10, 11]


# ---- conversion errors (fake axes: no process group is needed to validate) -------------
def _engine(x=1, y=1, z=1, data=1):
    sizes = {"x": x, "y": y, "z": z, "data": data, "tensor": x * y * z}
    return PMMEngine({n: Axis(n, None, s, 0) for n, s in sizes.items()}, comm=None)


def _gpt(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(seq_len=8, d_model=48, n_layers=1, n_heads=4, **kw))


def test_heads_not_divisible_one_line():
    with pytest.raises(
        ConversionError,
        match=r"ds_ext.pmm3d.grid.x=3 does not divide the 4 attention heads .*"
        r"allowed x: 1, 2, 4",
    ) as err:
        parallelize(_gpt(), _engine(x=3))
    assert "\n" not in str(err.value)


def test_hidden_not_divisible_one_line():
    with pytest.raises(
        ConversionError,
        match=r"ds_ext.pmm3d.grid \(x=1, y=5, z=1\) does not fit the "
        r"vocabulary-parallel table embed .* \[256, 48\] weight does not split "
        r"into 1 x 5 blocks",
    ) as err:
        parallelize(_gpt(), _engine(y=5))
    assert "\n" not in str(err.value)


def test_z_must_divide_weight_blocks():
    with pytest.raises(ConversionError, match=r"does not fit the vocabulary-parallel table embed .* 7 Z chunks"):
        parallelize(_gpt(), _engine(z=7))


def test_unconvertible_layer_type_one_line_and_nothing_converted():
    model = _gpt()
    model.blocks[0].extra = nn.Conv1d(4, 4, 1)
    with pytest.raises(
        ConversionError,
        match=r"cannot convert blocks.0.extra \(Conv1d\); convertible: nn.Linear "
        r"named qkv, proj, fc1, fc2",
    ) as err:
        parallelize(model, _engine(x=2))
    assert "\n" not in str(err.value)
    assert type(model.blocks[0].qkv) is nn.Linear  # checked before anything was converted


def test_unknown_model_and_unplanned_linear():
    with pytest.raises(ConversionError, match=r"no plan for Sequential; built-in plans: GPT, GPTNeoXForCausalLM"):
        parallelize(nn.Sequential(nn.Linear(4, 4)), _engine())
    model = _gpt()
    model.blocks[0].gate = nn.Linear(48, 48)
    with pytest.raises(ConversionError, match=r"cannot convert blocks.0.gate \(Linear\)"):
        parallelize(model, _engine())


def test_dropout_refused():
    with pytest.raises(ConversionError, match=r"GPTConfig.dropout=0.1; 3D-PMM needs 0"):
        parallelize(_gpt(dropout=0.1), _engine())


# ---- performance model ------------------------------------------------------------------
TWO_NODES_OF_4 = Topology.build([Level("gpu", 4, 100 * GB, 1 * US), Level("node", None, 10 * GB, 5 * US)], 8)


def test_eq_5_7_fig_5_3_examples():
    beta_inter = 10 * GB * 4  # one node's injection bandwidth
    # left: one ring over 8 GPUs on 2 nodes gets all of beta_inter
    assert perf.axis_bandwidths(Grid(1, 1, 1, 8), TWO_NODES_OF_4) == {"data": beta_inter}
    # right: rings (0,4,6,2) and (1,5,7,3) (Z of 4 behind X of 2) share it: beta_inter / 2
    assert Grid(2, 1, 4, 1).partition("z") == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert perf.axis_bandwidths(Grid(2, 1, 4, 1), TWO_NODES_OF_4)["z"] == beta_inter / 2
    # the sharing is capped by G_node; inside a node Case 1 (the level's bandwidth or a database)
    assert perf.axis_bandwidths(Grid(4, 1, 1, 2), TWO_NODES_OF_4) == {"x": 100 * GB, "data": beta_inter / 4}
    db = perf.Bandwidths({(1, 4): 77 * GB}, beta_inter)
    assert perf.axis_bandwidths(Grid(4, 1, 1, 2), TWO_NODES_OF_4, db)["x"] == 77 * GB


def _block_spec():
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=16, d_model=64, n_layers=2, n_heads=8))
    return model_spec(model, plan_for(model))


def _layer_bytes(spec, grid, e=2):
    return sum(
        i.nbytes * i.calls for i in perf.items(spec, grid, 8, 16, e) if i.equation[:3] in ("5.1", "5.2", "5.3", "5.4")
    )


def test_eqs_5_1_to_5_5_by_hand_for_one_layer():
    layer = perf.LayerSpec("fc", k=64, n=256)
    spec = perf.ModelSpec((layer,))
    g, m, e = Grid(2, 2, 2, 1), 8 * 16, 2
    got = {i.equation: i.nbytes for i in perf.items(spec, g, 8, 16, e) if i.equation.startswith("5.")}
    k, n = 64, 256
    assert got == {
        "5.1": (2 - 1) * k * n / (2 * 2 * 2) * e,
        "5.3": 2 * (2 - 1) / 2 * m * n / (2 * 2) * e,
        "5.4": 2 * (2 - 1) / 2 * m * k / (2 * 2) * e,
        "5.2": (2 - 1) / 2 * k * n / (2 * 2) * e,
    }
    assert perf.items(spec, Grid(1, 1, 1, 8), 8, 16, e)[0].nbytes == 2 * 7 / 8 * k * n * e  # Eq 5.5


def test_transposed_layer_swaps_x_and_y():
    normal, transposed = perf.LayerSpec("a", 64, 256), perf.LayerSpec("a", 64, 256, transposed=True)
    strip = lambda its: sorted((i.op, i.nbytes, {"x": "y", "y": "x"}.get(i.axis, i.axis)) for i in its)  # noqa: E731
    for grid, swapped in [(Grid(4, 2, 1, 1), Grid(2, 4, 1, 1)), (Grid(2, 1, 2, 2), Grid(1, 2, 2, 2))]:
        a = perf.items(perf.ModelSpec((normal,)), grid, 8, 16, 2)
        b = perf.items(perf.ModelSpec((transposed,)), swapped, 8, 16, 2)
        assert strip(a) == sorted((i.op, i.nbytes, i.axis) for i in b)


def test_degenerate_grids_reduce_to_megatron_fsdp_ddp():
    spec, e, rows = _block_spec(), 2, 8 * 16
    spec = dataclasses.replace(spec, tables=(), head=None)  # the blocks' layers: what the baselines have
    layers = list(spec.layers)
    assert _layer_bytes(spec, Grid(8, 1, 1, 1)) == perf.megatron_bytes(layers, rows, 8, e)
    assert _layer_bytes(spec, Grid(1, 1, 8, 1)) == perf.fsdp_bytes(layers, 8, e)
    ddp = [i for i in perf.items(spec, Grid(1, 1, 1, 8), 8, 16, e) if i.equation.startswith("5.")]
    assert [i.axis for i in ddp] == ["data"] and ddp[0].nbytes == perf.ddp_bytes(layers, 8, e)


def test_ranking_filters_by_divisibility_and_memory():
    spec = _block_spec()
    topo = Topology.from_preset("frontier", 8, {"gpu": 2})
    ranked = perf.rank_grids(spec, 8, topo, micro_batch=4, seq_len=16, elem_bytes=2)
    assert {c.grid.dims for c in ranked} == {g.dims for g in perf.factorizations(8) if g.z <= 4}
    assert [c.time for c in ranked] == sorted(c.time for c in ranked)
    limit = sorted(c.memory for c in ranked)[3]
    assert all(c.memory <= limit for c in perf.rank_grids(spec, 8, topo, 4, 16, 2, memory_limit=limit))


@pytest.mark.parametrize("kind", ["llama", "neox"])
def test_tied_hugging_face_head_stays_tied(kind):
    # lm_head comes before the embedding in named_modules() order
    from pmm_helpers import MODELS

    model = MODELS[f"{kind}_tied"]()
    serial_count = sum(p.numel() for p in model.parameters())
    parallelize(model, _engine())
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert sum(p.numel() for p in model.parameters()) == serial_count


@pytest.mark.parametrize("transposed,chunks", [(False, 1), (True, 1), (False, 3)])
def test_checkpoint_full_tensor_inverts_every_ranks_shard(transposed, chunks):
    from ds_ext.pmm.checkpoint import full_tensor

    grid = {"x": 2, "y": 3, "z": 2}
    n, k = 12, 6
    w, b = torch.randn(n, k), torch.randn(n)
    weights, biases = {}, {}
    for x in range(2):
        for y in range(3):
            for z in range(2):
                c = {"x": x, "y": y}
                out_ax, in_ax = ("y", "x") if transposed else ("x", "y")
                if n % (chunks * grid[out_ax]) or k % grid[in_ax]:
                    pytest.skip("grid does not divide")
                lay = LinearLayout(n, k, grid[out_ax], c[out_ax], grid[in_ax], c[in_ax], 2, z, chunks)
                weights[(x, y, z)], biases[(x, y, z)] = lay.shard(w), lay.bias(b)
    rec = {"n": n, "k": k, "transposed": transposed, "out_chunks": chunks}
    assert torch.equal(full_tensor({"kind": "linear_weight", **rec}, grid, weights), w)
    assert torch.equal(full_tensor({"kind": "linear_bias", **rec}, grid, biases), b)


# ---- OAG prefetch (001 §5.1.4) -----------------------------------------
def _oag_gpt():
    from ds_ext.pmm.config import OverlapConfig

    sizes = {"x": 1, "y": 1, "z": 1, "data": 1, "tensor": 1}
    engine = PMMEngine(
        {n: Axis(n, None, s, 0) for n, s in sizes.items()}, comm=None, overlap=OverlapConfig(all_gather=True)
    )
    return parallelize(_gpt(), engine), engine.prefetcher


def test_prefetch_order_records_only_grad_enabled_passes():
    model, prefetcher = _oag_gpt()
    tokens = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        model(tokens)  # an evaluation pass before training is not a training step's order
    model(tokens).backward()
    # the vocabulary-parallel tables gather their blocks too; the tied head gathers embed again
    assert [layer.name for layer in prefetcher.order] == [
        "embed",
        "pos",
        "blocks.0.qkv",
        "blocks.0.proj",
        "blocks.0.fc1",
        "blocks.0.fc2",
        "embed",
    ]


def test_prefetch_of_a_weight_changed_since_is_not_used():
    model, prefetcher = _oag_gpt()
    model(torch.randint(0, 256, (2, 9))).backward()
    qkv, proj, fc1 = model.blocks[0].qkv, model.blocks[0].proj, model.blocks[0].fc1
    prefetcher.weight(qkv, qkv.weight, True)  # in order: prefetches proj's weight as it is now
    assert id(proj) in prefetcher._inflight
    with torch.no_grad():
        proj.weight.add_(1.0)  # an optimizer step between the prefetch and its use
    assert torch.equal(prefetcher.weight(proj, proj.weight, True).reshape(-1), proj.weight)
    assert prefetcher.hits == 0
    prefetcher.weight(fc1, fc1.weight, True)
    assert prefetcher.hits == 1  # an unchanged weight's prefetch is used


def test_every_forward_drops_prefetches_in_flight():
    model, prefetcher = _oag_gpt()
    model(torch.randint(0, 256, (2, 9))).backward()
    prefetcher.weight(model.blocks[0].qkv, model.blocks[0].qkv.weight, True)
    assert prefetcher._inflight
    model.pmm_engine.begin_forward([])
    assert not prefetcher._inflight


# ---- matmul modes (001 §5.1.3) ------------------------------------------------------------
def test_every_matmul_mode_gives_identical_results():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-8, 8, (24, 40), generator=g).float()  # integer values: every summation order is exact
    b = torch.randint(-8, 8, (40, 16), generator=g).float()
    for lhs, rhs in [(a, b), (a, b.t().contiguous().t()), (b.t().contiguous().t().t(), a.t())]:
        want = lhs @ rhs
        for mode in MODES:
            got = run_mode(mode, lhs, rhs)
            assert torch.equal(got, want) and got.is_contiguous(), mode


def test_tuner_times_in_the_window_and_agrees_once():
    gathers = []

    def gather(t):  # a one-rank world that counts the collectives
        gathers.append(t.numel())
        return t.clone()

    tuner = MatmulTuner(gather)
    a, b = torch.randn(32, 16), torch.randn(16, 8)
    tuner.matmul("site", a, b)  # before the first grad-enabled forward: nothing timed
    assert not tuner.local
    tuner.begin_forward(False)  # an evaluation pass does not open the window
    tuner.begin_forward(True)
    tuner.matmul("site", a, b)
    tuner.matmul("site", a, b)
    assert len(tuner.local) == 1 and len(next(iter(tuner.local.values()))) == len(MODES) == 8
    tuner.matmul("site", a, b.t().contiguous().t())  # other strides: another signature
    assert len(tuner.local) == 2 and gathers == []  # timing issues no collective
    tuner.begin_forward(True)  # the agreed point: two all-gathers (sizes, then timings)
    assert len(gathers) == 2 and len(tuner.choice) == 2 and set(tuner.site_choice) == {"site"}
    tuner.matmul("site", torch.randn(7, 16), b)  # a new shape later: the site's mode, no collective
    tuner.begin_forward(True)
    assert len(gathers) == 2 and not tuner.local


def test_tuning_merge_keeps_the_slowest_rank_per_mode():
    assert merge([{"s": [1.0, 5.0]}, {"s": [3.0, 2.0], "t": [1.0, 1.0]}]) == {"s": [3.0, 5.0], "t": [1.0, 1.0]}


def test_gpt_spec_matches_the_built_model():
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=16, d_model=64, n_layers=2, n_heads=8))
    assert perf.gpt_spec(64, 2, 8, 256, 16) == model_spec(model, plan_for(model))


# ---- command line -------------------------------------------------------------------------
def test_cli_detect_shows_the_level_each_axis_spans(capsys):
    from ds_ext.cli import main

    assert main(["detect", "--preset", "frontier", "--world-size", "16", "--grid", "2,4,1,2"]) == 0
    assert (
        "pmm3d grid (x=2, y=4, z=1, data=2): x=2 spans gcd, y=4 spans gpu, z=1 spans -, data=2 spans node"
        in capsys.readouterr().out
    )


def test_cli_tune_prints_and_writes_the_top_k(tmp_path, capsys):
    """``ds-ext tune`` is the planner's 3D-PMM family: per-rank α-β per level by default,
    Eq 5.7 with ``--links shared``, no α with ``--no-latency``; the planner's batch and memory."""
    import json

    from ds_ext.cli import main
    from ds_ext.planner import pmm_grids
    from ds_ext.planner.models import lookup

    out = tmp_path / "tune.json"
    assert (
        main(
            [
                "tune",
                "--model",
                "gpt-20b",
                "--world",
                "32",
                "--memory-GB",
                "40",
                "--top-k",
                "4",
                "--global-batch",
                "1024",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    top = json.loads(out.read_text())["top"]
    assert len(top) == 4 and [r["step_s"] for r in top] == sorted(r["step_s"] for r in top)
    assert all(r["total_memory_bytes"] <= 40e9 and r["fits"] for r in top)
    assert "gpt-20b: 20.11B parameters (32 layers, hidden 7168, 56 heads" in capsys.readouterr().out
    from ds_ext.planner.machine import MACHINES

    spec = pmm_grids.model_spec(lookup("gpt-20b"))
    topo = MACHINES["frontier"].build_topology(4)  # the planner's Frontier: RCCL's α per inter-node ring step
    for links, flags, bw, latency in (
        ("shared", ["--links", "shared"], perf.Bandwidths.from_topology(topo), True),
        ("shared", ["--links", "shared", "--no-latency"], perf.Bandwidths.from_topology(topo), False),
        ("per-rank", [], perf.Bandwidths.per_rank_links(topo), True),
    ):
        assert (
            main(
                [
                    "tune",
                    "--model",
                    "gpt-20b",
                    "--world",
                    "32",
                    "--memory-GB",
                    "40",
                    "--top-k",
                    "4",
                    "--global-batch",
                    "1024",
                    "--out",
                    str(out),
                    *flags,
                ]
            )
            == 0
        )
        got = json.loads(out.read_text())
        assert (got["links"], got["latency"]) == (links, latency)
        r = got["top"][0]
        best = Grid(*(int(v) for v in r["name"].split()[1].split("x")))
        expected = perf.comm_time(spec, best, topo, r["micro_batch"], 2048, 2, r["grad_accum"], bw=bw, latency=latency)
        assert sum(r["comm_s_per_level"].values()) == pytest.approx(expected)


def test_tune_bandwidths_links_and_database():
    from ds_ext.pmm import tune

    topo = Topology.from_preset("frontier", 16)
    assert tune.bandwidths(topo, None, "shared") is None  # comm_time's default: Eq 5.7 from the topology
    assert tune.bandwidths(topo, None, "per-rank") == perf.Bandwidths.per_rank_links(topo)
    db = {"intra": {"1,2": 1e11, "2,4": 4e10}, "beta_inter": 9e10}
    shared, own = tune.bandwidths(topo, db, "shared"), tune.bandwidths(topo, db, "per-rank")
    assert shared.intra == own.intra == {(1, 2): 1e11, (2, 4): 4e10} and shared.beta_inter == own.beta_inter == 9e10
    assert shared.ring_sharing and not own.ring_sharing
    no_inter = tune.bandwidths(topo, {"intra": {}, "beta_inter": None}, "per-rank")
    assert no_inter.beta_inter == perf.Bandwidths.per_rank_links(topo).beta_inter
    with pytest.raises(ValueError, match="--links: 'both'; allowed: shared, per-rank"):
        tune.bandwidths(topo, None, "both")


def test_bench_pmm_checks_rank_with_the_emulated_machines_model():
    """``ds-ext bench pmm``'s acceptance numbers from its records: Spearman and the first choice's
    measured rank per predictor; ``ranking_holds`` from the α-β per-rank-links model."""
    from ds_ext.bench.pmm import PREDICTORS, RANKING_MODEL, checks

    def rec(grid, measured, alpha_beta, eq57, node_bytes):
        r = {"variant": "pmm3d", "grid": list(grid), "ledger_equals_model": True, "step_time_emulated_s": measured}
        r["bytes_per_step"] = {"gcd": 0.0, "gpu": 0.0, "node": node_bytes}
        return {**r, **{k: eq57 for k in PREDICTORS}, RANKING_MODEL: alpha_beta}

    records = [
        rec((1, 1, 1, 8), 4.0, 4e-3, 1e-3, 4e6),
        rec((4, 1, 1, 2), 1.0, 1e-3, 3e-3, 2e6),
        rec((1, 8, 1, 1), 9.0, 9e-3, 2e-3, 9e6),
        rec((2, 2, 1, 2), 2.0, 3e-3, 4e-3, 5e6),
    ]
    out = checks(records)
    assert out["ranking_model"] == RANKING_MODEL and out["fastest_measured_grid"] == [4, 1, 1, 2]
    assert out[f"spearman[{RANKING_MODEL}]"] == pytest.approx(1.0)  # same order as measured
    # the baseline ranking by inter-node bytes alone, from the same records
    assert out["spearman[inter_node_bytes]"] == pytest.approx(0.8)  # bytes rank 2,1,4,3; measured 3,1,4,2
    assert out["model_ranks_better_than_bytes_only"] is True
    assert out[f"model_first_choice_measured_rank[{RANKING_MODEL}]"] == 1.0 and out["ranking_holds"] is True
    assert out["spearman[predicted_comm_s]"] == pytest.approx(-0.6)  # ranks 1,3,2,4 vs 3,1,4,2
    assert out["model_first_choice_measured_rank[predicted_comm_s]"] == 3.0
    records[1][RANKING_MODEL], records[3][RANKING_MODEL] = 10e-3, 5e-3  # picks (1,1,1,8), measured 3rd
    out = checks(records)
    assert out[f"model_first_choice_measured_rank[{RANKING_MODEL}]"] == 3.0
    assert out[f"spearman[{RANKING_MODEL}]"] == pytest.approx(-0.4) and out["ranking_holds"] is False
    assert out["model_ranks_better_than_bytes_only"] is False
    # every pmm3d variant on megatron's grid over megatron-core TP8's step
    records += [
        {**rec((8, 1, 1, 1), 2.1, 1, 1, 7e6), "variant": "pmm3d+vocab_parallel"},
        {"variant": "megatron_tp8", "grid": [8, 1, 1, 1], "step_time_emulated_s": 2.0},
    ]
    out = checks(records)
    assert out["pmm3d+vocab_parallel_x8y1z1d1_over_megatron_tp8_emulated"] == pytest.approx(1.05)
    assert out["best_pmm3d_over_megatron_tp8_emulated"] == pytest.approx(0.5)


# ---- examples/train.py chooses the model and the optimizer from the config -----
def test_example_model_and_optimizer_follow_the_config():
    import importlib.util
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("example_train", root / "examples" / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    config = {
        name: json.loads((root / "configs" / name).read_text())
        for name in ("demo.json", "ted_moe.json", "pmm3d.json", "pmm3d_cpu8.json")
    }
    assert train.model_kind(config["ted_moe.json"]) == "gpt-moe" and train.model_kind(config["demo.json"]) == "gpt"
    params = [nn.Parameter(torch.zeros(2))]
    assert isinstance(train.optimizer_for(config["demo.json"], params, 1e-3), torch.optim.AdamW)  # ZeRO-topo
    assert train.optimizer_for(config["pmm3d.json"], params, 1e-3) is None  # its 'optimizer' section
    no_section = {k: v for k, v in config["pmm3d_cpu8.json"].items() if k != "optimizer"}
    build = train.optimizer_for(no_section, params, 1e-3)
    assert callable(build) and isinstance(build(params), torch.optim.AdamW)  # built on the converted params


@pytest.mark.parametrize("family", ["llama3-8b", "neox-20b"])
def test_real_size_tables_shard_over_the_tensor_grid(family):
    """Per-rank parameters of Llama-3-8B and NeoX-20B on (8,1,8,1), read by
    ds_ext.perf.pmm from meta-device models, within 1.1x of serial / (G_x G_y G_z) + the
    Z-replicated vectors (biases, norms); the serial count is the built model's own."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        if family == "llama3-8b":
            model = LlamaForCausalLM(
                LlamaConfig(
                    vocab_size=128256,
                    hidden_size=4096,
                    intermediate_size=14336,
                    num_hidden_layers=32,
                    num_attention_heads=32,
                    num_key_value_heads=8,
                    tie_word_embeddings=False,
                )
            )
        else:
            model = GPTNeoXForCausalLM(
                GPTNeoXConfig(
                    vocab_size=50432,
                    hidden_size=6144,
                    intermediate_size=24576,
                    num_hidden_layers=44,
                    num_attention_heads=64,
                    tie_word_embeddings=False,
                )
            )
    grid = Grid(8, 1, 8, 1)
    spec = model_spec(model, plan_for(model))
    serial = sum(p.numel() for p in model.parameters())
    vectors = sum(perf.replicated_numels(spec, grid))
    assert perf.local_numel(spec, grid) <= 1.1 * (serial / grid.tensor + vectors)
    # every matrix (tables and head included) is split over the whole tensor grid; the 1-D
    # parameters (biases, norm weights) are the rest
    matrices = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    assert perf.sharded_numel(spec, grid) * grid.tensor == matrices


def test_auto_grid_counts_the_optimizer_state_zero_topo_shards():
    """Beside ZeRO-topo (a plugin that owns the step) the auto grid's memory estimate shards the
    optimizer state over the data axis, whatever DeepSpeed's stage (0, as ZeRO-topo needs): under a
    limit that the fastest grid (data 4) meets only with the sharded state, DeepSpeed's stage 0
    alone picks a slower grid, and beside ZeRO-topo the fastest."""
    from types import SimpleNamespace

    from ds_ext.pmm.config import Pmm3dConfig
    from ds_ext.pmm.plugin import Pmm3dPlugin

    model = GPT(GPTConfig(seq_len=16, d_model=32, n_layers=2, n_heads=4))
    topo = Topology.from_preset("frontier", 8, {"gpu": 2})
    spec = model_spec(model, plan_for(model))
    fastest = perf.rank_grids(spec, 8, topo, 4, 16, 4, zero_stage=1)[0]
    at_stage0 = perf.model_state_bytes(spec, fastest.grid, 4, zero_stage=0)
    assert fastest.grid.data > 1 and fastest.memory < at_stage0
    cfg = Pmm3dConfig(enabled=True, grid="auto", memory_per_rank_GB=(fastest.memory + at_stage0) / 2 / 1e9)
    ds_config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 0}}
    chosen = {}
    for owner in (None, object()):
        plugin = Pmm3dPlugin(cfg, SimpleNamespace(topology=topo, step_owner=lambda owner=owner: owner))
        chosen[owner is None] = plugin._grid(model, plan_for(model), ds_config).dims
    assert chosen[False] == fastest.grid.dims and chosen[True] != fastest.grid.dims
