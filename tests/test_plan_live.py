"""Planner against the ledger on 8 gloo ranks (2 emulated nodes x 2 GPUs x 2 GCDs): one small run
per plugin; the bytes each rank sent per topology level in the last step, and the state bytes,
equal the planner's numbers for the same model, plan and batch (``ds_ext.planner``)."""

WORLD_SIZE = 8
TOPOLOGY = {"preset": "frontier", "sizes": {"gpu": 2}, "emulate": True}


def _by_level(by_phase, skip=()):
    out = {}
    for phase, per in by_phase.items():
        if phase not in skip:
            for level, b in per.items():
                out[level] = out.get(level, 0.0) + b
    return out


def _zero_topo_run(preset, accum):
    import torch
    import torch.distributed as dist

    import ds_ext
    from ds_ext.data import ByteCorpus
    from ds_ext.models import GPT, GPTConfig

    cfg = GPTConfig(seq_len=32, d_model=64, n_layers=3, n_heads=4)
    torch.manual_seed(0)
    model = GPT(cfg)
    engine, *_ = ds_ext.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": accum,
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 0},
            "steps_per_print": 10**9,
            "ds_ext": {"topology": TOPOLOGY, "zero_topo": {"enabled": True, "preset": preset}},
        },
    )
    corpus = ByteCorpus(max_bytes=100_000)
    for step in range(2):
        for micro in range(accum):
            engine.backward(engine(corpus.micro_batch(step, micro, dist.get_rank(), 8, 2, accum, cfg.seq_len)))
            engine.step()
    out = {
        "bytes": _by_level(engine.ds_ext.ledger.steps[-1].by_phase(), skip=("other",)),
        "state": engine.ds_ext.plugins[0].state_bytes(),
        "rank": dist.get_rank(),
        "cfg": cfg,
    }
    engine.destroy()
    return out


def test_zero_topo_ledger_equals_the_planner(world):
    from ds_ext.planner import zero_plans
    from ds_ext.planner.models import Arch
    from ds_ext.topology import Topology
    from ds_ext.zero_topo.plan import ZeroTopoConfig, resolve_plan

    topo = Topology.from_preset("frontier", 8, {"gpu": 2})
    for preset, accum in (("zero_topo_paper", 2), ("zeropp", 1)):
        plan = resolve_plan(ZeroTopoConfig(enabled=True, preset=preset), topo)
        for r in world.run(_zero_topo_run, preset, accum):
            c = r["cfg"]
            arch = Arch(
                name="gpt", layers=c.n_layers, hidden=c.d_model, heads=c.n_heads, vocab=c.vocab_size, seq=c.seq_len
            )
            assert r["bytes"] == zero_plans.traffic(plan, arch, accum, 2, rank=r["rank"]).bytes, (preset, r["rank"])
            if r["rank"] == 0:  # the planner reports rank 0, whose optimizer shard has no padding
                states = zero_plans.states(plan, arch, 2)
                assert r["state"] == {
                    "primary": states["weights"],
                    "secondary": states["secondary"],
                    "gradients": states["gradients"],
                    "optimizer": states["optimizer"],
                }


def _pmm_run(dims):
    from pmm_helpers import GLOBAL_BATCH, ds_config, engine_for, tokens

    from ds_ext.pmm import Linear

    engine = engine_for("gpt", ds_config(dims, bf16=True))
    axes = engine.ds_ext.plugin("pmm3d").axes
    micro = GLOBAL_BATCH // axes["data"].size
    start = axes["data"].rank * micro
    engine.backward(engine(tokens(0)[start : start + micro]))
    engine.step()
    weights = sum(p.numel() * p.element_size() for p in engine.module.parameters())
    linear = sum(m.weight.numel() * m.weight.element_size() for m in engine.module.modules() if isinstance(m, Linear))
    out = {
        "bytes": _by_level(engine.ds_ext.ledger.steps[-1].by_phase(), skip=("step",)),
        "weights": weights,
        "linear": linear,
    }
    engine.destroy()
    return out


def test_pmm3d_ledger_equals_the_planner(world):
    from pmm_helpers import GLOBAL_BATCH, SEQ

    from ds_ext.models import GPTConfig
    from ds_ext.parallel import Grid
    from ds_ext.perf.pmm import memory
    from ds_ext.planner import pmm_grids
    from ds_ext.planner.models import Arch
    from ds_ext.topology import Topology

    topo = Topology.from_preset("frontier", 8, {"gpu": 2})
    c = GPTConfig(seq_len=SEQ, d_model=64, n_layers=2, n_heads=8)
    arch = Arch(name="gpt", layers=c.n_layers, hidden=c.d_model, heads=c.n_heads, vocab=c.vocab_size, seq=c.seq_len)
    spec = pmm_grids.model_spec(arch, checkpointing=False)
    for dims in ((2, 2, 2, 1), (2, 1, 2, 2)):
        grid = Grid(*dims)
        planned = pmm_grids.traffic(spec, grid, topo, GLOBAL_BATCH // grid.data, SEQ, 2, 1)
        states = pmm_grids.states(spec, grid, 2)
        for r in world.run(_pmm_run, dims):
            assert r["bytes"] == planned.bytes, dims
            assert r["weights"] == states["weights"] and r["linear"] == memory(spec, grid, 2)["layer_params"]


def _ted_run(T, P, checkpoint):
    import dataclasses

    import ted_support as ts
    import torch
    import torch.distributed as dist
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    import ds_ext
    from ds_ext.parallel import TEDLayout

    cfg = dataclasses.replace(ts.config(), checkpoint=checkpoint)
    layout = TEDLayout.build(dist.get_world_size(), T, P)
    model = ts.ted_model(cfg, ts.serial_model(cfg).state_dict(), layout, dist.get_rank())
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "dense", "lr": 1e-3}
    )
    engine, *_ = ds_ext.initialize(
        model=model,
        optimizer=torch.optim.AdamW(groups, lr=1e-3),
        config=ts.ds_config(T, P, 1, bf16={"enabled": True}, gradient_accumulation_steps=2),
    )
    ted = next(p for p in engine.ds_ext.plugins if p.name == "ted").ted
    for micro in range(2):  # one optimizer step; ZeRO-1 keeps whole 16-bit gradients between its micro-steps
        engine.backward(engine(ts.shards(ted.layout, micro)[ted.data_rank]))
        if micro == 0:
            grads = sum(p.grad.numel() * p.grad.element_size() for p in engine.module.parameters())
        engine.step()
    zero = engine.optimizer
    optimizer = sum(t.numel() * t.element_size() for t in zero.single_partition_of_fp32_groups) + sum(
        v.numel() * v.element_size()
        for s in zero.optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.dim() > 0
    )
    out = {
        "phases": engine.ds_ext.ledger.steps[-1].by_phase(),
        "rank": dist.get_rank(),
        "cfg": cfg,
        "weights": sum(p.numel() * p.element_size() for p in engine.module.parameters()),
        "gradients": grads,
        "optimizer": optimizer,
    }
    engine.destroy()
    return out


def test_ted_ledger_and_memory_equal_the_planner(world):
    """One optimizer step of 2 micro-steps (TED blocks checkpointed, DTD + CAC, ZeRO-1): the bytes
    per level equal ``planner.ted_layouts.traffic`` to within DeepSpeed's gradient-norm and
    overflow scalars (a few bytes, not modelled), the weight, gradient and optimizer bytes per
    rank equal its Eq 7.4 states exactly."""
    from ds_ext.parallel import TEDLayout
    from ds_ext.planner import ted_layouts
    from ds_ext.planner.models import Arch
    from ds_ext.topology import Topology

    topo = Topology.from_preset("frontier", 8, {"gpu": 2})
    layout = TEDLayout.build(8, 2, 4)
    for r in world.run(_ted_run, 2, 4, "torch"):
        c = r["cfg"]
        arch = Arch(
            name="moe",
            layers=c.n_layers,
            hidden=c.d_model,
            heads=c.n_heads,
            vocab=c.vocab_size,
            seq=c.seq_len,
            experts=c.num_experts,
        )
        planned = ted_layouts.traffic(arch, layout, topo, 2, 2, 2).bytes
        measured = _by_level(r["phases"], skip=("other",))
        assert measured.keys() == planned.keys() and all(0 <= measured[k] - planned[k] <= 16 for k in planned), (
            r["rank"],
            measured,
            planned,
        )
        states = ted_layouts.states(arch, layout)
        assert (r["weights"], r["gradients"], r["optimizer"]) == (
            states["weights"],
            states["gradients"],
            states["optimizer"],
        ), r["rank"]
