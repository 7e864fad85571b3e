"""ZeRO-topo's pipeline form inside DeepSpeed's PipelineEngine (``ds_ext.zero_topo.pipeline``).

8 gloo ranks as Frontier in miniature (2 nodes x 2 MI250X x 2 GCDs). The model is a
``deepspeed.pipe.PipelineModule`` with tied embedding / LM head (``TiedLayerSpec``), trained with
``train_batch`` over 2 micro-batches. The reference is DeepSpeed's own ZeRO-1 on the same
PipelineEngine, model and batches (shares no code with ZeRO-topo): the unquantized pipeline form
must equal it to fp32 rounding with gradient clipping active (so the global norm over stages,
tied weights counted once, is checked too).
"""

import pytest
from ledger_support import assert_links_equal

WORLD_SIZE = 8
TOPOLOGY = {"preset": "frontier", "sizes": {"gpu": 2}, "emulate": True}
VOCAB, HIDDEN, SEQ, MICRO, ACCUM, STEPS = 64, 32, 8, 2, 2, 4
# hierarchical and unquantized: gradients reduce-scattered level by level from the innermost level
UNQUANTIZED = {"preset": "zero_topo", "gradients": {"level": "gcd", "bits": 16, "hops": 1}}


def _pipe(stages):
    """A 6-layer GPT-like PipelineModule over ``stages`` stages, the embedding tied to the head."""
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.fc = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, HIDDEN)

        def forward(self, x):
            return x + torch.tanh(self.fc(self.norm(x)))

    def head(embed, x):
        return x @ embed.weight.t()

    def loss_fn(logits, labels):
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))

    torch.manual_seed(1234)
    layers = [
        TiedLayerSpec("embed", nn.Embedding, VOCAB, HIDDEN),
        *[LayerSpec(Block) for _ in range(4)],
        LayerSpec(nn.LayerNorm, HIDDEN),
        TiedLayerSpec("embed", nn.Embedding, VOCAB, HIDDEN, forward_fn=head),
    ]
    return PipelineModule(layers, num_stages=stages, loss_fn=loss_fn, partition_method="uniform")


def _batches(step, data_rank, seed=0):
    import torch

    for m in range(ACCUM):
        g = torch.Generator().manual_seed(100_000 * seed + 1000 * step + 10 * data_rank + m)
        tokens = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g)
        yield tokens[:, :-1], tokens[:, 1:]


def _run(stages, zero_topo, extra=None, seed=0, adam=False, bf16=False, fp16=None, steps=STEPS, bucket=None):
    """Losses, global norms, loss scales, skipped steps and this rank's stage parameters after
    ``steps`` train_batch calls on a PipelineEngine of ``stages`` stages: ZeRO-topo (``zero_topo``)
    or DeepSpeed ZeRO-1 (None); ``extra``: more of the ``"ds_ext"`` block; ``seed``: another data
    order; ``adam``: AdamW, not SGD; ``bf16``: the ds_config's bf16 section on; ``fp16``: its fp16
    section (else fp32); ``bucket``: ``zero_optimization.reduce_bucket_size``."""
    import torch
    import torch.distributed as dist

    import ds_ext
    from ds_ext.integration import ds_engine

    ds_engine.init_distributed()  # as the clients do before building a PipelineModule (its groups)
    if fp16 is not None:
        from deepspeed.accelerator import get_accelerator

        # DeepSpeed's CPU accelerator reports fp16 only where oneDNN has fp16 kernels; torch's fp16
        # CPU arithmetic is enough for this tiny model (as in test_zero_topo_hardening.py)
        get_accelerator().is_fp16_supported = lambda: True
    model = _pipe(stages)
    dp = dist.get_world_size() // stages
    cfg = {
        "train_batch_size": MICRO * ACCUM * dp,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.05,
        "zero_optimization": {"stage": 0 if zero_topo else 1, **({"reduce_bucket_size": bucket} if bucket else {})},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
        "ds_ext": {"topology": TOPOLOGY, "comm": {"count_torch_collectives": False}},
        **({"bf16": {"enabled": True}} if bf16 else {}),
        **({"fp16": {"enabled": True, **fp16}} if fp16 is not None else {}),
    }
    for key, value in (extra or {}).items():
        cfg["ds_ext"][key] = {**cfg["ds_ext"].get(key, {}), **value}
    if zero_topo:
        cfg["ds_ext"]["zero_topo"] = {"enabled": True, **zero_topo}
    # SGD moves each parameter in proportion to its gradient, so a wrong scale shows in every one
    opt = (
        torch.optim.AdamW(model.parameters(), lr=1e-3)
        if adam
        else torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    )
    engine, *_ = ds_ext.initialize(model=model, optimizer=opt, config=cfg)
    init = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    losses, norms, scales, skipped = [], [], [], []
    data_rank = engine.grid.get_data_parallel_rank()
    for step in range(steps):
        losses.append(float(engine.train_batch(iter(_batches(step, data_rank, seed)))))
        norms.append(float(engine.get_global_grad_norm()))
        scales.append(float(engine.optimizer.loss_scale) if fp16 is not None else None)
        skipped.append(engine.skipped_steps)
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    steps = engine.ds_ext.ledger.steps
    out = {
        "losses": losses,
        "norms": norms,
        "scales": scales,
        "skipped": skipped,
        "params": params,
        "rank": dist.get_rank(),
        "still": [n for n, p in params.items() if torch.equal(p, init[n])],
        "ledger_bytes": sum(sum(v.values()) for v in steps[-1].by_phase().values()) if steps else 0,
    }
    if zero_topo:
        plugin = engine.ds_ext.plugin("zero_topo")
        out |= {
            "describe": plugin.describe(),
            "banner": engine.ds_ext.banner(),
            "analytic": plugin.analytic_traffic(ACCUM).bytes,
            "measured": {ph: dict(v) for ph, v in engine.ds_ext.ledger.steps[-1].by_phase().items()},
            "measured_links": engine.ds_ext.ledger.steps[-1].link_bytes_by_phase(),
            "analytic_links": plugin.analytic_traffic(ACCUM).links,
            "padded_bytes": sum(u.U for u in plugin.sharded.all_units) * 4,
            "units": [(u.name, u.numel) for u in plugin.sharded.all_units],
        }
    engine.destroy()
    dist.barrier()
    return out


# bf16 against DeepSpeed ZeRO-1 bf16 on the same PipelineEngine: both keep fp32 masters, but reduce
# the bf16 gradients in different orders (ZeRO-topo: reduce-scatter per level, DeepSpeed: bucketed
# all-reduce), so gradients differ by a few bf16 roundings (2^-8 relative) and the weights, rounded
# back to bf16, by about one bf16 ulp of their scale. The losses are bf16 numbers, so they may land
# one bf16 ulp apart ("loss": bf16's epsilon 2^-7, relative, is at least one ulp of any value; the
# loss of step 4 was 21.5 against 21.625 on another CPU, one ulp at 16-32).
BF16 = {"rtol": 2e-2, "atol": 4e-3, "norm": 2e-3, "loss": 2**-7}
FP32 = {"rtol": 1e-6, "atol": 1e-6, "norm": 1e-6, "loss": 1e-6}


BUCKET = 1500  # reduce_bucket_size: a Block is 1,120 elements, the embedding 2,048 (a unit of its own)


@pytest.mark.parametrize(
    "stages,bf16,bucket",
    [(1, False, None), (2, False, None), (2, True, None), (1, False, BUCKET), (2, True, BUCKET)],
    ids=["pp1", "pp2", "pp2-bf16", "pp1-buckets", "pp2-bf16-buckets"],
)
def test_unquantized_pipeline_form_equals_deepspeed_zero1_on_the_pipeline_engine(world, stages, bf16, bucket):
    """PP 1 (data 8, across nodes) and PP 2 (data 4 inside a node), fp32 and bf16: losses, global
    norms (clipping active, tied weights once) and every parameter equal DeepSpeed ZeRO-1 in the
    same dtype on the same PipelineEngine (fp32 within 1e-6, bf16 within ``BF16``); the ledger
    equals the analytic model; with PP 1 the inter-node bytes of the gradient synchronisation are
    the floor 2 (M_stage / P)(N - 1)/N (P = 4 of the group's ranks per node). With a
    ``reduce_bucket_size`` of 1,500 elements each stage is cut into units of whole parameters of at
    most that many elements (a larger one alone), in model order, reduced one at a time."""
    import torch

    tol = BF16 if bf16 else FP32
    ref = world.run(_run, stages, None, bf16=bf16, bucket=bucket)
    ours = world.run(_run, stages, UNQUANTIZED, bf16=bf16, bucket=bucket)
    for o in ours:
        if bucket is None:
            assert len(o["units"]) == 1 and o["units"][0][0] == f"stage{o['rank'] * stages // 8}"
            continue
        sizes = [n for _, n in o["units"]]
        assert len(sizes) >= 2 and sum(sizes) == sum(p.numel() for p in o["params"].values())
        assert all(n <= bucket or n == VOCAB * HIDDEN for n in sizes), sizes
        assert all(a + b > bucket for a, b in zip(sizes, sizes[1:])), sizes  # runs as long as they fit
    for r, o in zip(ref, ours):
        assert o["losses"] == pytest.approx(r["losses"], rel=tol["loss"], abs=0)
        assert o["norms"] == pytest.approx(r["norms"], rel=tol["norm"], abs=0)
        assert r["norms"][0] > 0.05  # the clip is active
        assert o["still"] == [] and r["still"] == []
        for name, p in r["params"].items():
            assert o["params"][name].dtype == (torch.bfloat16 if bf16 else torch.float32)
            torch.testing.assert_close(o["params"][name], p, rtol=tol["rtol"], atol=tol["atol"], msg=name)
        assert set(o["measured"]) == {"step"}  # nothing gathered in forward or backward
        assert o["measured"] == o["analytic"]
        assert_links_equal(o["measured_links"], o["analytic_links"])
        if stages == 1:
            norm = 2 * 8 * (8 - 1) / 8  # the grad-norm all-reduce over the data group
            assert o["measured"]["step"]["node"] == 2 * (o["padded_bytes"] / 4) * (2 - 1) / 2 + norm
    assert "pipeline form" in ours[0]["describe"]
    assert f"pipeline {stages}" in ours[0]["banner"] or stages == 1


# fp16 against DeepSpeed ZeRO-1 fp16: an initial scale of 2^16 overflows the scaled loss (about 4.2
# x 2^16 > 65,504), so the first steps are skipped and the scale halves until it fits; after 2 good
# steps it doubles again (window 2) and overflows again
FP16 = {"initial_scale_power": 16, "loss_scale_window": 2, "hysteresis": 1, "min_loss_scale": 1}
FP16_STEPS = 10


@pytest.mark.parametrize("plan", ["unquantized", "default"])
def test_fp16_pipeline_form_skips_and_scales_as_deepspeed_zero1(world, plan):
    """fp16 in the pipeline form (DeepSpeed's dynamic loss scaler on the last stage's loss, over
    every stage and the data group): the same skipped steps and loss scales, step by step, as
    DeepSpeed ZeRO-1 fp16 on the same PipelineEngine, with overflows at the start and scale growth
    after; the unquantized plan also its losses, norms and parameters (fp16 rounding); the default
    plan (int4 gradients inside the node) trains every parameter with finite losses, a non-finite
    block never quantized."""
    import math

    import torch

    zero_topo = UNQUANTIZED if plan == "unquantized" else {"preset": "zero_topo"}
    ref = world.run(_run, 2, None, fp16=FP16, steps=FP16_STEPS)
    ours = world.run(_run, 2, zero_topo, fp16=FP16, steps=FP16_STEPS)
    skipped = ref[0]["skipped"]
    assert skipped[0] == 1 and 0 < skipped[-1] < FP16_STEPS  # overflows at the start, then steps
    assert any(b > a for a, b in zip(ref[0]["scales"], ref[0]["scales"][1:]))  # the scale grew again
    for r, o in zip(ref, ours):
        assert o["skipped"] == r["skipped"]
        assert o["scales"] == r["scales"]
        assert o["still"] == []
        assert all(math.isfinite(x) for x in o["losses"])
        if plan == "unquantized":
            assert o["losses"] == pytest.approx(r["losses"], rel=1e-3, abs=0)
            for name, p in r["params"].items():
                assert o["params"][name].dtype == torch.float16
                torch.testing.assert_close(o["params"][name], p, rtol=2e-2, atol=4e-3, msg=name)


def test_quantized_default_trains_every_parameter_within_the_seed_spread(world):
    """The default plan (int4 gradients, node-level optimizer) in the pipeline form, PP 2: every
    parameter moves; each step's loss is within the spread of ZeRO-1 runs on two data orders; the
    same with the stage in units of ``BUCKET`` elements, whose int4 blocks are those of one unit
    (every parameter starts a block), so its losses are the one-unit run's; the ledger = the model."""
    a, b = world.run(_run, 2, None), world.run(_run, 2, None, None, 1)
    ours = world.run(_run, 2, {"preset": "zero_topo"})
    bucketed = world.run(_run, 2, {"preset": "zero_topo"}, bucket=BUCKET)
    for r0, r1, o, q in zip(a, b, ours, bucketed):
        spread = max(abs(x - y) for x, y in zip(r0["losses"], r1["losses"]))
        assert o["still"] == [] and q["still"] == []
        assert max(abs(x - y) for x, y in zip(o["losses"], r0["losses"])) <= spread
        assert len(q["units"]) >= 2 and q["losses"] == pytest.approx(o["losses"], rel=1e-6, abs=0)
        assert o["measured"] == o["analytic"] and q["measured"] == q["analytic"]


def test_tiled_optimizer_and_pccl_under_the_pipeline_engine(world):
    """PP 2 on DeepSpeed's PipelineEngine, with and without the pipeline form: the tiled optimizer
    (001 §7.2) is bit-identical to the untiled step; PCCL (001 ch. 6: ZeRO-topo's collectives by
    ``comm.algorithm``, DeepSpeed's all-gathers / reduce-scatters by the ``pccl`` plugin) equals the
    native collectives within float reordering."""
    import torch

    tiled = {"tiled_optimizer": {"enabled": True, "tile_size": 256}}
    for zero_topo, pccl in ((UNQUANTIZED, {"comm": {"algorithm": "pccl"}}), (None, {"pccl": {"enabled": True}})):
        base = world.run(_run, 2, zero_topo, None, 0, True)
        for extra, exact in ((tiled, True), (pccl, False)):
            for (losses, params), other in zip(
                ((r["losses"], r["params"]) for r in base), world.run(_run, 2, zero_topo, extra, 0, True)
            ):
                if exact:
                    assert other["losses"] == losses, (zero_topo, extra)
                    assert all(torch.equal(other["params"][n], p) for n, p in params.items()), (zero_topo, extra)
                else:
                    assert other["ledger_bytes"] > 0  # the collectives went through ds_ext.comm
                    assert other["losses"] == pytest.approx(losses, rel=1e-6, abs=0), (zero_topo, extra)
                    for n, p in params.items():
                        torch.testing.assert_close(other["params"][n], p, rtol=1e-5, atol=1e-6, msg=n)


def _engine(stages, zero_topo, perturb=False):
    import torch

    import ds_ext
    from ds_ext.integration import ds_engine

    ds_engine.init_distributed()
    model = _pipe(stages)
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
    dp = 8 // stages
    cfg = {
        "train_batch_size": MICRO * ACCUM * dp,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.05,
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**6,
        "ds_ext": {"topology": TOPOLOGY, "zero_topo": {"enabled": True, **zero_topo}},
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = ds_ext.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def _train(engine, steps):
    rank = engine.grid.get_data_parallel_rank()
    return [float(engine.train_batch(iter(_batches(s, rank)))) for s in steps]


def _checkpoint(tmp):
    """PP 2, default plan, AdamW: save after 2 steps and train 2 more; a fresh engine from other
    weights loads the save and trains the same 2 steps; a PP 1 engine refuses the save in one line."""
    import torch.distributed as dist

    from ds_ext.errors import DsExtError

    engine = _engine(2, {"preset": "zero_topo"})
    _train(engine, range(2))
    engine.save_checkpoint(tmp, tag="t2")
    masters = _masters(engine.ds_ext.plugin("zero_topo"))
    after = _train(engine, range(2, 4))
    engine.destroy()
    fresh = _engine(2, {"preset": "zero_topo"}, perturb=True)
    fresh.load_checkpoint(tmp, tag="t2")
    resumed = _train(fresh, range(2, 4))
    fresh.destroy()
    other = _engine(1, {"preset": "zero_topo"})
    try:
        other.load_checkpoint(tmp, tag="t2")
        refused = None
    except DsExtError as err:
        refused = str(err)
    other.destroy()
    dist.barrier()
    return after, resumed, refused, masters


def _masters(plugin):
    """The fp32 masters of this rank's stage, gathered from its data-parallel group's optimizer
    slices (by name; a tied weight under each of its names)."""
    import torch
    import torch.distributed as dist

    mine = [(u.name, plugin.optimizer.own_range(u)[0] + lo, m.clone()) for u, lo, _, m in plugin.optimizer.segments]
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, mine)
    full = {}
    for unit in plugin.sharded.all_units:
        flat = torch.full((unit.U,), float("nan"))
        for name, start, values in (piece for rank_pieces in pieces for piece in rank_pieces):
            if name == unit.name:
                flat[start : start + values.numel()] = values
        for names, shape, off in zip(unit.param_names, unit.shapes, unit.offsets):
            full |= {n: flat[off : off + shape.numel()].view(shape).clone() for n in names}
    return full


def test_checkpoint_round_trip_in_the_pipeline_form(world, tmp_path):
    """DeepSpeed's per-layer files with ZeRO-topo's optimizer shards beside them, one folder per
    stage: resuming repeats the losses bit for bit; another pipeline size is refused in one line;
    ``consolidate`` joins the stages into the masters of the running job (the tied weight once)."""
    import torch

    from ds_ext.zero_topo.checkpoint import consolidate

    full = {}
    for after, resumed, refused, masters in world.run(_checkpoint, str(tmp_path)):
        assert resumed == after
        assert refused is not None and "was saved with model-parallel size 2, this run has 1" in refused, refused
        full |= masters
    state = consolidate(tmp_path / "t2")
    assert set(state) == set(full) and "tied_modules.embed.weight" in state
    for name, value in full.items():
        assert not torch.isnan(value).any() and torch.equal(state[name], value), name
    parts = sorted(p.name for p in (tmp_path / "t2").iterdir() if p.is_dir())
    assert parts == ["ds_ext_zero_topo_mp00", "ds_ext_zero_topo_mp01"]
    assert any(p.name.startswith("layer_") for p in (tmp_path / "t2").iterdir())


def _refused(case):
    """The one-line refusal of ``case`` (before any ZeRO-topo collective)."""
    import torch
    import torch.distributed as dist

    import ds_ext
    from ds_ext.errors import DsExtError
    from ds_ext.integration import ds_engine

    ds_engine.init_distributed()
    model = _pipe(2) if case != "pipeline_form_plain_model" else torch.nn.Linear(4, 4)
    block = {
        "weights_set": {"zero_topo": {"enabled": True, "weights": {"level": "gcd"}}},
        "pipeline_form_plain_model": {"zero_topo": {"enabled": True, "form": "pipeline"}},
        "ted": {"ted": {"enabled": True, "tensor_parallel": 2, "expert_parallel": 2}},
        "pmm3d": {"pmm3d": {"enabled": True, "grid": {"x": 2, "y": 1, "z": 1, "data": 4}}},
    }[case]
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1, "ds_ext": {"topology": TOPOLOGY, **block}}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if case == "pmm3d":  # 3D-PMM builds its optimizer on the converted parameters
        optimizer = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    try:
        ds_ext.initialize(model=model, optimizer=optimizer, config=cfg)
        msg = None
    except DsExtError as err:
        msg = str(err)
    dist.barrier()
    return msg


@pytest.mark.parametrize(
    "case,expected",
    [
        (
            "weights_set",
            "ds_ext.zero_topo.weights.level: the pipeline form keeps weights whole on every rank; allowed: "
            "gradients, optimizer and step settings only",
        ),
        (
            "pipeline_form_plain_model",
            "ds_ext.zero_topo.form 'pipeline' needs a deepspeed.pipe.PipelineModule (got "
            "Linear); allowed: 'sharded' or 'auto'",
        ),
        (
            "ted",
            "ds_ext.ted: tensor_parallel is 2 but the PipelineModule's topology has tensor (model) parallel 1; "
            "allowed: 1",
        ),
        (
            "pmm3d",
            "ds_ext.pmm3d with a deepspeed.pipe.PipelineModule: 3D-PMM's grid (x, y, z, data) spans the whole world "
            "and has no pipeline axis; allowed: a plain nn.Module (Megatron-DeepSpeed: --no-pipeline-parallel; "
            "GPT-NeoX: pipe_parallel_size 0)",
        ),
    ],
)
def test_settings_refused_in_one_line_on_the_pipeline_engine(world, case, expected):
    """Pipeline-form settings it has no use for, the form asked for without a PipelineModule, TED
    with a tensor degree the PipelineModule's topology does not have, and 3D-PMM (no pipeline axis in
    its grid) with one: one line on every rank."""
    for msg in world.run(_refused, case):
        assert msg == expected
