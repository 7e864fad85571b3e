"""Tiled optimizer (001 §7.2) on 4 gloo ranks.

Reference everywhere: the same run without the plugin, i.e. torch's own Adam/AdamW step
inside DeepSpeed's (or ZeRO-topo's) untiled mixed-precision step. Tiled must give the
same bits: losses, 16-bit weights and fp32 master weights after 20 steps.
"""

import pytest
import torch

from ds_ext.config import DsExtConfigError

WORLD_SIZE = 4
STEPS = 20
OVERFLOW_STEP = 9
HIDDEN, FFN = 32, 64


# ---- single process: the tile arithmetic against torch.optim ----------------------------
@pytest.mark.parametrize(
    "cls,kw",
    [
        (torch.optim.AdamW, {"weight_decay": 0.1}),
        (torch.optim.Adam, {"weight_decay": 0.1}),
        (torch.optim.Adam, {"amsgrad": True, "maximize": True}),
        (torch.optim.AdamW, {"foreach": True}),
        (torch.optim.AdamW, {"foreach": False}),
    ],
)
@pytest.mark.parametrize("tile", [7, 4099, 10**6])  # 7: tiles cross every piece and tensor boundary
def test_tiles_match_torch_step_bit_for_bit(cls, kw, tile):
    _tiles_match(cls, kw, tile)


@pytest.mark.parametrize(
    "cls,kw",
    [
        (torch.optim.AdamW, {"weight_decay": 0.1, "fused": True}),
        (torch.optim.Adam, {"weight_decay": 0.1, "fused": True}),
        (torch.optim.Adam, {"amsgrad": True, "maximize": True, "fused": True}),
    ],
)
@pytest.mark.parametrize("tile", [16, 4096, 10**6])
def test_fused_tiles_match_torch_fused_step_bit_for_bit(cls, kw, tile):
    """torch's fused=True Adam/AdamW (its own kernel arithmetic) tile by tile: same bits."""
    _tiles_match(cls, kw, tile)


@pytest.mark.parametrize("adam_w_mode,bias_correction", [(True, True), (False, False)])
@pytest.mark.parametrize("tile", [16, 4096, 10**6])
def test_deepspeed_fused_adam_tiles_match_its_step_bit_for_bit(adam_w_mode, bias_correction, tile):
    fused_adam_tiles_match(adam_w_mode, bias_correction, tile, device="cpu")


def fused_adam_tiles_match(adam_w_mode, bias_correction, tile, device):
    """DeepSpeed's FusedAdam (its CPU kernel here, the CUDA one in tests/test_gpu.py) tile by
    tile: same bits as ``FusedAdam.step``, including its group step rule (the counter of the
    group's last parameter with a gradient; in step 3 the last parameter has none)."""
    from deepspeed.ops.adam import FusedAdam

    from ds_ext.optim.tiled import TiledAdam

    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(n).to(device)) for n in (3000, 1, 5003, 40)]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    kw = dict(lr=1e-2, weight_decay=0.1, adam_w_mode=adam_w_mode, bias_correction=bias_correction)
    ref_opt = FusedAdam([{"params": ref[:2]}, {"params": ref[2:]}], **kw)
    our_opt = FusedAdam([{"params": ours[:2]}, {"params": ours[2:]}], **kw)
    tiled = TiledAdam(our_opt, tile)
    grads = [
        [None if (step == 2 and i == 3) else torch.randn(p.numel()).to(device) for i, p in enumerate(ref)]
        for step in range(5)
    ]
    # one run after the other: the CPU kernel keeps beta^t of its last call in a process-wide
    # static (cpu_adam.h IncrementStep), so interleaving two optimizers changes their bits
    for params, step in ((ref, ref_opt.step), (ours, tiled.step_fp32_params)):
        for g in grads:
            for p, gi in zip(params, g):
                p.grad = None if gi is None else gi.clone()
            step()
    for r, o in zip(ref, ours):
        assert torch.equal(r, o)
        for k, v in ref_opt.state[r].items():
            assert torch.equal(v, our_opt.state[o][k]) if torch.is_tensor(v) else v == our_opt.state[o][k], k
    assert [our_opt.state[p]["step"] for p in ours] == [0, 5, 1, 4]  # FusedAdam's own counters
    assert tiled.buffer.nbytes == 0


def _tiles_match(cls, kw, tile):
    from ds_ext.optim.tiled import TiledAdam, piecewise_loader

    torch.manual_seed(0)
    sizes = [3000, 1, 5003]
    ref = [torch.randn(n) for n in sizes]
    ours = [p.clone() for p in ref]
    ref_opt = cls(ref, lr=1e-2, **kw)
    our_opt = cls(ours, lr=1e-2, **{k: v for k, v in kw.items() if k != "foreach"})
    tiled = TiledAdam(our_opt, tile)
    scale = 3.0
    for _ in range(5):
        for r, o in zip(ref, ours):
            g16 = torch.randn(r.numel()).bfloat16()
            r.grad = g16.float() / scale
            # pieces split at an odd offset: tiles cross piece boundaries
            tiled.update(
                o, our_opt.param_groups[0], piecewise_loader([g16[:11], g16[11:]], o.numel(), lambda b: b.div_(scale))
            )
        ref_opt.step()
    for r, o in zip(ref, ours):
        assert torch.equal(r, o)
        for k, v in ref_opt.state[r].items():
            assert torch.equal(v, our_opt.state[o][k]), k
    assert our_opt.state[ours[0]]["step"].item() == 5  # once per step, not per tile
    # one fp32 buffer of tile_size elements, allocated once per step
    assert tiled.buffer.nbytes == 4 * tile and tiled.buffer.allocations == 1
    tiled.end_step()
    assert tiled.buffer.nbytes == 0


def test_tiled_step_runs_the_optimizers_step_hooks():
    """The tiled step replaces ``optimizer.step``: the hooks registered on the optimizer
    (and global ones) run once per applied step, pre before the first tile, post after."""
    from ds_ext.optim.tiled import TiledAdam

    p = torch.nn.Parameter(torch.randn(1000))
    opt = torch.optim.AdamW([p], lr=1e-2)
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append(("pre", o is opt, p.detach().clone())))
    opt.register_step_post_hook(lambda o, a, k: calls.append(("post", o is opt, p.detach().clone())))
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    handle = register_optimizer_step_pre_hook(lambda o, a, k: calls.append(("global", o is opt, None)))
    try:
        tiled = TiledAdam(opt, 300)
        before = p.detach().clone()
        for _ in range(2):
            p.grad = torch.randn(1000)
            tiled.step_fp32_params()
        tiled.end_step()  # a step that updated nothing (skipped) runs no hooks
    finally:
        handle.remove()
    assert [(k, same) for k, same, _ in calls] == [("global", True), ("pre", True), ("post", True)] * 2
    assert torch.equal(calls[1][2], before) and not torch.equal(calls[2][2], before)


def test_forked_steps_refuse_a_deepspeed_whose_step_source_differs():
    """The installed 0.19.8 is recognized by its step sources; a source of no tested release is
    refused with the list of tested releases (0.19.6: tests/test_tiled_optimizer_releases.py)."""
    import deepspeed
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from ds_ext.integration import ds_zero12_step
    from ds_ext.integration.ds_version import DeepSpeedVersionError, forked_release

    assert deepspeed.__version__ == "0.19.8"
    assert forked_release(DeepSpeedZeroOptimizer.step, ds_zero12_step.ZERO12_STEP_SHA256, "x") == "0.19.8"
    assert forked_release(FP16_UnfusedOptimizer.step, ds_zero12_step.UNFUSED_STEP_SHA256, "x") == "0.19.8"
    with pytest.raises(
        DeepSpeedVersionError,
        match=r"^ds_ext.tiled_optimizer: deepspeed .*'s "
        r"ZeROOptimizer.backward matches none of .*tested releases: deepspeed==0.19.8, "
        r"deepspeed==0.19.6; ",
    ):
        forked_release(DeepSpeedZeroOptimizer.backward, ds_zero12_step.ZERO12_STEP_SHA256, "ds_ext.tiled_optimizer")


def test_piecewise_loader_pads_with_zeros():
    from ds_ext.optim.tiled import piecewise_loader

    load = piecewise_loader([torch.arange(5, dtype=torch.bfloat16)], 8)
    buf = torch.full((4,), 9.0)
    load(buf, 4)
    assert buf.tolist() == [4.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("bad", [0, -3, 1.5, "3", True])
def test_bad_tile_size_names_the_key(bad):
    from ds_ext import config

    with pytest.raises(DsExtConfigError, match=r"^ds_ext\.tiled_optimizer\.tile_size: "):
        config.parse({"tiled_optimizer": {"enabled": True, "tile_size": bad}})


def test_untiled_optimizer_types_are_refused():
    from ds_ext.optim.plugin import _check_ds_config
    from ds_ext.optim.tiled import check_tileable

    p = [torch.nn.Parameter(torch.zeros(3))]
    for opt in (torch.optim.SGD(p, lr=0.1), torch.optim.Adagrad(p)):
        with pytest.raises(
            DsExtConfigError,
            match=r"ds_ext\.tiled_optimizer: .*allowed types: torch\.optim\.Adam, torch\.optim\.AdamW, "
            r"deepspeed\.ops\.adam\.FusedAdam",
        ):
            check_tileable(opt)
    with pytest.raises(
        DsExtConfigError,
        match=r"^ds_ext\.tiled_optimizer\.tile_size: param group 0 is fused \(.*"
        r"allowed: a multiple of 16 \(got 100\)",
    ):
        check_tileable(torch.optim.AdamW(p, fused=True), 100)
    with pytest.raises(DsExtConfigError, match="capturable=True"):
        check_tileable(torch.optim.AdamW(p, capturable=True))
    with pytest.raises(DsExtConfigError, match=r"zero_optimization\.zenflow"):
        _check_ds_config({"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.1}}}, torch.optim.AdamW(p))
    with pytest.raises(DsExtConfigError, match=r"tile_size: a fused optimizer \(FusedAdam or fused=True\).*got 100"):
        _check_ds_config({"optimizer": {"type": "Adam", "params": {}}}, None, 100)
    with pytest.raises(
        DsExtConfigError,
        match=r"^ds_ext\.tiled_optimizer: DeepSpeed wraps FusedAdam in its fused "
        r"FP16_Optimizer at zero_optimization\.stage 0 with fp16/bf16, which is not tiled; allowed: ",
    ):
        _check_ds_config({"optimizer": {"type": "AdamW", "params": {}}, "bf16": {"enabled": True}}, None)
    # beside a plugin that owns the step (ZeRO-topo) DeepSpeed wraps nothing: its fused FP16_Optimizer never runs
    _check_ds_config({"optimizer": {"type": "AdamW", "params": {}}, "bf16": {"enabled": True}}, None, owner_steps=True)
    _check_ds_config(
        {"optimizer": {"type": "Adam", "params": {}}, "zero_optimization": {"stage": 1}, "fp16": {"enabled": True}},
        None,
    )  # DeepSpeed's FusedAdam under ZeRO-1: tiled
    with pytest.raises(DsExtConfigError, match="allowed types"):
        _check_ds_config({"optimizer": {"type": "Lamb", "params": {"torch_adam": True}}}, None)
    with pytest.raises(DsExtConfigError, match=r"zero_optimization\.stage 3 .*allowed: 0, 1, 2"):
        _check_ds_config({"zero_optimization": {"stage": 3}}, torch.optim.AdamW(p))
    with pytest.raises(DsExtConfigError, match="offload_optimizer"):
        _check_ds_config(
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, torch.optim.AdamW(p)
        )
    _check_ds_config({"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}, None)


# ---- on the ranks -------------------------------------------------------------------------
def _allow_fp16_on_cpu():
    """DeepSpeed's CPU accelerator reports fp16 only where oneDNN has fp16 kernels (not on
    this machine's CPUs); torch's fp16 CPU arithmetic is enough for a tiny model, so the
    fp16 paths (loss scaling, overflow skip) are tested by overriding that probe."""
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True


def _train(stage, precision, tile, overflow=False, clip=0.05, experts=4, optimizer="torch"):
    """20 steps of the DeepSpeed-MoE model; returns losses and every weight's bits."""
    import torch.distributed as dist

    from ds_ext.bench.tiled import batch, moe_engine

    if precision == "fp16":
        _allow_fp16_on_cpu()
    engine = moe_engine(
        experts,
        "tiled" if tile else "untiled",
        tile,
        HIDDEN,
        FFN,
        stage=stage,
        precision=precision,
        clip=clip,
        lr=3e-2,
        optimizer=optimizer,
    )
    dtype = next(engine.module.parameters()).dtype
    losses, skipped = [], []
    for step in range(STEPS):
        x, y = batch(step, HIDDEN, 8, dtype)
        loss = engine(x, y)
        if overflow and step == OVERFLOW_STEP and dist.get_rank() == 1:
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        skipped.append(bool(getattr(engine.optimizer, "overflow", False)))
    out = {
        "losses": losses,
        "skipped": skipped,
        "kind": type(engine.optimizer).__name__,
        "weights": [p.detach().clone() for p in engine.module.parameters()],
        "masters": [t.detach().clone() for t in _masters(engine.optimizer)],
        "tiles": engine.ds_ext.plugins[-1].tiled.buffer.tiles_processed if tile else 0,
    }
    engine.destroy()
    return out


def _masters(opt):
    if hasattr(opt, "single_partition_of_fp32_groups"):
        return opt.single_partition_of_fp32_groups
    if hasattr(opt, "fp32_groups"):
        return [p for g in opt.fp32_groups for p in g]
    if hasattr(opt, "segments"):
        return [m for *_, m in opt.segments]
    return [p for g in opt.param_groups for p in g["params"]]


def _assert_identical(ref, ours, kind):
    for r, o in zip(ref, ours):
        assert o["kind"] == r["kind"] == kind
        assert o["losses"] == r["losses"]
        assert len(o["weights"]) == len(r["weights"]) and len(o["masters"]) == len(r["masters"])
        for a, b in zip(r["weights"] + r["masters"], o["weights"] + o["masters"]):
            assert a.dtype == b.dtype and torch.equal(a, b)
        assert o["tiles"] > 0 and r["tiles"] == 0
    # the run trained and the comparison is not vacuous
    assert ref[0]["losses"][-1] != ref[0]["losses"][0]


@pytest.mark.parametrize(
    "stage,precision,overflow",
    [(1, "bf16", False), (2, "fp16", True), (1, "fp32", False)],
)
def test_deepspeed_zero_tiled_is_bit_identical(world, stage, precision, overflow):
    """(a) DeepSpeedZeroOptimizer with DeepSpeed-MoE expert groups (ep 4, no max_group_size),
    clipping on, tile 1000: tiles cross parameter and group boundaries."""
    ref = world.run(_train, stage, precision, None, overflow)
    ours = world.run(_train, stage, precision, 1000, overflow)
    _assert_identical(ref, ours, "DeepSpeedZeroOptimizer")
    if overflow:
        assert ref[0]["skipped"][OVERFLOW_STEP] and ours[0]["skipped"] == ref[0]["skipped"]
        assert sum(ref[0]["skipped"]) == 1


@pytest.mark.parametrize("stage,precision,kind", [(1, "bf16", "DeepSpeedZeroOptimizer"), (0, "fp32", "FusedAdam")])
def test_deepspeed_fused_adam_tiled_is_bit_identical(world, stage, precision, kind):
    """DeepSpeed's FusedAdam (what Megatron-DeepSpeed and GPT-NeoX use) in ZeRO-1 with MoE
    expert groups and clipping, and at stage 0: tiles of 1008 (whole cache lines) give the bits
    of its untiled step."""
    ref = world.run(_train, stage, precision, None, False, 0.05, 4, "ds_fused")
    ours = world.run(_train, stage, precision, 1008, False, 0.05, 4, "ds_fused")
    _assert_identical(ref, ours, kind)


@pytest.mark.parametrize(
    "precision,overflow,kind",
    [("fp32", False, "AdamW"), ("bf16", False, "FP16_UnfusedOptimizer"), ("fp16", True, "FP16_UnfusedOptimizer")],
)
def test_stage0_tiled_is_bit_identical(world, precision, overflow, kind):
    """(c) a plain stage-0 engine: the torch optimizer itself (fp32) or DeepSpeed's
    FP16_UnfusedOptimizer wrapper, which 0.19.8 builds for both fp16 and bf16."""
    ref = world.run(_train, 0, precision, None, overflow)
    ours = world.run(_train, 0, precision, 777, overflow)
    _assert_identical(ref, ours, kind)
    if overflow:
        assert ref[0]["skipped"][OVERFLOW_STEP] and ours[0]["skipped"] == ref[0]["skipped"]


def _zero_topo_engine(precision, tile, fused=False):
    import ds_ext
    from ds_ext.models import GPT, GPTConfig

    torch.manual_seed(1234)
    model = GPT(GPTConfig(seq_len=16, d_model=32, n_layers=2, n_heads=4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.01, fused=fused)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.3,
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9,
        "ds_ext": {
            "topology": {"preset": "frontier", "sizes": {"gpu": 2}, "emulate": True},
            "zero_topo": {
                "enabled": True,
                "preset": "zero_topo",
                "weights": {"gather_bits": 16},
                "gradients": {"bits": 16, "hops": 1},
                "secondary": {"bits": 16},
            },
        },
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 4}
    if tile:
        cfg["ds_ext"]["tiled_optimizer"] = {"enabled": True, "tile_size": tile}
    engine, *_ = ds_ext.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def _train_zero_topo(precision, tile, overflow=False, fused=False):
    import torch.distributed as dist

    engine = _zero_topo_engine(precision, tile, fused)
    g = torch.Generator().manual_seed(dist.get_rank())
    losses, skipped = [], []
    for step in range(STEPS):
        loss = engine(torch.randint(0, 256, (2, 17), generator=g))
        if overflow and step == OVERFLOW_STEP and dist.get_rank() == 2:
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        skipped.append(engine.optimizer.overflow)
    zt = engine.ds_ext.plugins[0]
    with engine.ds_ext.gathered_parameters():
        weights = [p.detach().clone() for p in engine.module.parameters()]
    out = {
        "losses": losses,
        "skipped": skipped,
        "kind": type(engine.optimizer).__name__,
        "weights": weights,
        "masters": [m.clone() for *_, m in zt.optimizer.segments],
        "tiles": engine.ds_ext.plugins[-1].tiled.buffer.tiles_processed if tile else 0,
        "bytes": engine.ds_ext.ledger.mean_by_level(),
        "calls": [s.by_phase() for s in engine.ds_ext.ledger.steps],
    }
    engine.destroy()
    return out


@pytest.mark.parametrize(
    "precision,overflow,fused",
    [("fp32", False, False), ("bf16", False, False), ("fp16", True, False), ("bf16", False, True)],
)
def test_zero_topo_tiled_is_bit_identical(world, precision, overflow, fused):
    """(b) inside ZeRO-topo's sharded step, with the overlapped weight all-gather: same bits,
    and the same bytes per level and phase as the untiled step; also with torch's fused
    AdamW kernel (fused=True), 20 steps."""
    ref = world.run(_train_zero_topo, precision, None, overflow, fused)
    ours = world.run(_train_zero_topo, precision, 336 if fused else 333, overflow, fused)
    _assert_identical(ref, ours, "ZeroTopoOptimizer")
    for r, o in zip(ref, ours):
        assert o["bytes"] == r["bytes"] and o["calls"] == r["calls"]
    if overflow:
        assert ref[0]["skipped"][OVERFLOW_STEP] and ours[0]["skipped"] == ref[0]["skipped"]


def _step_events(tile):
    """The order of weight all-gather issues / waits and tile updates inside one step."""
    engine = _zero_topo_engine("bf16", tile)
    engine.backward(engine(torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))))
    comm, events = engine.ds_ext.comm, []
    all_gather = comm.all_gather

    def logged_all_gather(out, inp, group=None, async_op=False):
        k = sum(e[0] == "issue" for e in events)
        handle = all_gather(out, inp, group=group, async_op=async_op)
        events.append(("issue", k, async_op))
        if handle is not None:
            wait = handle.wait
            handle.wait = lambda: (events.append(("wait", k)), wait())[1]
        return handle

    comm.all_gather = logged_all_gather
    if tile:
        tiled = engine.optimizer.tiled
        update = tiled.update
        tiled.update = lambda *a, **kw: (events.append(("update",)), update(*a, **kw))[1]
    engine.step()
    engine.optimizer.settle()  # the gathers the step left in flight (gather_across_step): their waits
    comm.all_gather = all_gather
    units = len(engine.optimizer.sharded.all_units)
    engine.destroy()
    return events, units


def test_zero_topo_weight_gather_overlaps_the_next_update(world):
    """(b) tiled: the same number of all-gathers as untiled, all async, and the gathers of every
    unit but the last are still in flight while a later unit's tiles are updated (untiled, every
    update is done before the first gather)."""
    ((ref, units),) = world.run(_step_events, None)[:1]
    ((ours, _),) = world.run(_step_events, 333)[:1]
    issues = [e for e in ours if e[0] == "issue"]
    assert len(issues) == sum(e[0] == "issue" for e in ref) >= units
    assert all(e[2] for e in issues) and ("update",) not in ref
    overlapped = set()
    for i, e in enumerate(ours):
        if e[0] == "issue":
            end = ours.index(("wait", e[1]))
            if ("update",) in ours[i:end]:
                overlapped.add(e[1])
    assert len(overlapped) >= units - 1, ours


def _initialize_with(optimizer_name):
    import ds_ext
    from ds_ext.bench.tiled import moe_model

    model = moe_model(HIDDEN, FFN, 4, 4)
    opt = {"sgd": torch.optim.SGD(model.parameters(), lr=0.1)}[optimizer_name]
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 1},
        "ds_ext": {"tiled_optimizer": {"enabled": True}},
    }
    try:
        ds_ext.initialize(model=model, optimizer=opt, config=cfg)
    except DsExtConfigError as err:
        return str(err)
    return None


def test_unsupported_optimizer_fails_on_every_rank_before_deepspeed(world):
    msgs = world.run(_initialize_with, "sgd")
    assert all(
        m is not None
        and m.startswith("ds_ext.tiled_optimizer: optimizer type torch.optim.sgd.SGD")
        and "allowed types: torch.optim.Adam, torch.optim.AdamW" in m
        for m in msgs
    ), msgs
