"""TED training through ``ds_ext.initialize`` on 8 gloo ranks (2 emulated nodes x 2 GPUs x 2 GCDs).

References: a serial model trained with torch's AdamW and ``clip_grad_norm_`` on the same
global batches (ZeRO-1/2 with clipping, convergence); DeepSpeed's own MoE at G_tensor = 1;
the untiled step (tiled optimizer); the run without a checkpoint round trip; Eq 7.4 (memory);
megatron-core's tensor-parallel layers (interoperability).
"""

import pytest
from ledger_support import assert_links_equal

WORLD_SIZE = 8
LR, WD = 1e-2, 0.01


def _optimizer(model, lr=LR, sgd=False):
    """AdamW (or SGD with momentum) over DeepSpeed-MoE's param groups."""
    import torch
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "dense", "lr": lr, "weight_decay": WD}
    )
    if sgd:
        return torch.optim.SGD(groups, lr=0.5, momentum=0.9)
    return torch.optim.AdamW(groups, lr=lr, weight_decay=WD)


def _engine(cfg, serial_state, T, P, stage, plugins=None, sgd=False, **ds_extra):
    import ted_support as ts
    import torch.distributed as dist

    import ds_ext
    from ds_ext.parallel import TEDLayout

    layout = TEDLayout.build(dist.get_world_size(), T, P)
    model = ts.ted_model(cfg, serial_state, layout, dist.get_rank())
    engine, *_ = ds_ext.initialize(
        model=model, optimizer=_optimizer(model, sgd=sgd), config=ts.ds_config(T, P, stage, plugins=plugins, **ds_extra)
    )
    return engine, next(p for p in engine.ds_ext.plugins if p.name == "ted").ted


def _step(engine, ted, step):
    import ted_support as ts

    loss = engine(ts.shards(ted.layout, step)[ted.data_rank])
    engine.backward(loss)
    engine.step()
    return loss.item()


def _equal_over(group, tensor):
    """True if ``tensor`` is bit-identical on every rank of ``group``."""
    import torch
    import torch.distributed as dist

    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return all(torch.equal(o, out[0]) for o in out)


# ---- ZeRO-topo: the dense part over the data group, experts over the expert-data group ------
UNQUANTIZED = {"weights": {"gather_bits": 16}, "gradients": {"bits": 16, "hops": 1}, "secondary": {"bits": 16}}


def _serial_norm_at_start(cfg, serial_state, layout, bf16):
    """The hand-written global gradient norm of the serial model (plain torch, every expert and
    every dense parameter once by construction) at the run's initial weights (rounded to bf16
    when the run trains in bf16) on step 0's global batch."""
    import math

    import ted_support as ts
    import torch

    serial = ts.serial_model(cfg)
    with torch.no_grad():
        for name, p in serial.named_parameters():
            p.copy_(serial_state[name].bfloat16() if bf16 else serial_state[name])
    loss, _ = ts.serial_loss(serial, ts.shards(layout, 0))
    loss.backward()
    return math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in serial.parameters()))


def _zero_topo_run(zero_topo, whole, steps=4, P=2, bf16=False, clip=0.05):
    """TED at T 2 x P ``P`` (expert-data 8 / (2 P)) with clipping, experts split over the tensor
    group or ``whole`` on every tensor rank, in fp32 or ``bf16``: ``zero_topo`` (stage 0) or
    DeepSpeed ZeRO-1 (None). Losses, global norms, the serial model's hand-written norm at step 0
    and this rank's parameters after ``steps`` steps; with ZeRO-topo also its ledger's step phase
    and analytic model."""
    import ted_support as ts
    import torch
    import torch.distributed as dist

    cfg = ts.config(drop_tokens=False, expert_tensor_parallel=not whole)
    plugins = (
        {"comm": {"count_torch_collectives": False}, "zero_topo": {"enabled": True, **zero_topo}} if zero_topo else None
    )
    serial_state = ts.serial_model(cfg).state_dict()
    # SGD moves each parameter in proportion to its gradient, so a wrong scale shows in every one
    # (Adam normalises it away and turns rounding noise into full steps)
    engine, ted = _engine(
        cfg,
        serial_state,
        2,
        P,
        0 if zero_topo else 1,
        plugins=plugins,
        sgd=True,
        gradient_clipping=clip,
        zero_allow_untested_optimizer=True,
        **({"bf16": {"enabled": True}} if bf16 else {}),
    )
    losses, norms = [], []
    for step in range(steps):
        losses.append(_step(engine, ted, step))
        norms.append(float(engine.get_global_grad_norm()))
    with engine.ds_ext.gathered_parameters() if zero_topo else torch.no_grad():
        params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    out = {
        "losses": losses,
        "norms": norms,
        "params": params,
        "serial_norm": _serial_norm_at_start(cfg, serial_state, ted.layout, bf16),
    }
    if zero_topo:
        plugin = engine.ds_ext.plugin("zero_topo")
        out |= {
            "describe": plugin.describe(),
            "expert_group": plugin.experts.members,
            "analytic": plugin.analytic_traffic(1).bytes,
            "measured": {ph: dict(v) for ph, v in engine.ds_ext.ledger.steps[-1].by_phase().items()},
            "measured_links": engine.ds_ext.ledger.steps[-1].link_bytes_by_phase(),
            "analytic_links": plugin.analytic_traffic(1).links,
            "expert_shards": sorted(
                {u.U // u.primary.numel() for u in plugin.sharded.all_units if u.ctx is plugin.sharded.expert_ctx}
            ),
        }
    engine.destroy()
    dist.barrier()
    return out


# bf16 against DeepSpeed ZeRO-1 bf16: both keep fp32 masters and step the same SGD, but reduce bf16
# gradients in different orders (ZeRO-topo: a reduce-scatter per unit and level; DeepSpeed: its
# bucketed all-reduce), so each step's gradients differ by a few bf16 roundings (2^-8 relative)
# and the weights, rounded back to bf16, by about one bf16 ulp of each tensor's scale.
# Measured (T 2 x P 4, 4 SGD steps): losses within 1.5e-5, norms within 4.3e-4 of DeepSpeed's and
# 5.6e-4 of the serial fp32 norm at the bf16-rounded weights; every weight within 2 % of its value.
BF16 = {"rtol": 2e-2, "atol": 4e-3, "norm": 2e-3}
FP32 = {"rtol": 1e-6, "atol": 1e-6, "norm": 1e-6}


@pytest.mark.parametrize(
    "P,bf16,whole",
    # every pair of (expert parallel, dtype, expert mode) values once: 4 runs, not 8
    [(2, False, False), (2, True, True), (4, False, True), (4, True, False)],
    ids=["ep2-fp32-experts_split", "ep2-bf16-experts_whole", "ep4-fp32-experts_whole", "ep4-bf16-experts_split"],
)
def test_zero_topo_shards_dense_and_experts_equal_to_deepspeed_zero1(world, P, bf16, whole):
    """ZeRO-topo beside TED (unquantized): non-expert parameters over the data group, experts over
    their expert-data group (averaged as DeepSpeed-MoE does; whole experts over tensor x
    expert-data; at expert-data 1 split experts kept whole on their rank), the global norm over
    both: losses, norms (clipping active) and every parameter equal TED with DeepSpeed ZeRO-1 in the
    same dtype (fp32 within 1e-6; bf16 within ``BF16``); the step-0 norm equals the serial model's
    hand-written norm (every expert once) within the same tolerance, so the clip coefficient
    clip / norm does too; the step's collectives equal ZeRO-topo's analytic model of both groups."""
    import torch

    tol = BF16 if bf16 else FP32
    ref = world.run(_zero_topo_run, None, whole, 4, P, bf16)
    ours = world.run(_zero_topo_run, UNQUANTIZED, whole, 4, P, bf16)
    for r, o in zip(ref, ours):
        assert o["losses"] == pytest.approx(r["losses"], rel=tol["norm"], abs=0)
        assert o["norms"] == pytest.approx(r["norms"], rel=tol["norm"], abs=0)
        assert o["norms"][0] == pytest.approx(o["serial_norm"], rel=tol["norm"], abs=0)
        assert r["norms"][0] > 0.05  # the clip is active
        for name, p in r["params"].items():
            torch.testing.assert_close(o["params"][name], p, rtol=tol["rtol"], atol=tol["atol"], msg=name)
        assert o["measured"]["step"] == o["analytic"]["step"]
        assert_links_equal(o["measured_links"], o["analytic_links"], phases=("step",))
    assert "experts: " in ours[0]["describe"]
    # whole experts are sharded over tensor x expert-data, split ones over expert-data
    groups = {(2, True): (0, 1, 4, 5), (2, False): (0, 4), (4, True): (0, 1), (4, False): (0,)}
    assert ours[0]["expert_group"] == groups[P, whole]
    if len(groups[P, whole]) == 1:  # expert-data 1, split experts: whole on their rank
        assert ours[0]["expert_shards"] == [1] and "kept whole on each rank" in ours[0]["describe"]


# ---- the shipped configs combined: demo.json's ZeRO-topo block + ted_moe.json's TED block ------
def _shipped_block(name, key):
    import json
    from pathlib import Path

    return json.loads((Path(__file__).parents[1] / "configs" / name).read_text())["ds_ext"][key]


@pytest.mark.parametrize("whole", [False, True], ids=["experts_split", "experts_whole"])
def test_shipped_zero_topo_and_ted_blocks_train_in_bf16_with_clipping(world, whole):
    """configs/demo.json's ZeRO-topo block beside configs/ted_moe.json's TED layout (T 2 x P 4, so
    expert-data 1) in bf16 with gradient_clipping 1.0, the configuration a user combines from the
    shipped files: it trains; split experts are kept whole on their rank (one shard, 16-bit, as
    DeepSpeed-MoE's ZeRO keeps them over an expert-data group of one rank), whole experts are
    sharded over their tensor ranks; the step-0 norm equals the serial model's hand-written norm
    within 1 % (bf16 rounding plus the preset's int4 gradients and int8 weights: measured 0.3 %);
    ledger == analytic model."""
    zero_topo = {k: v for k, v in _shipped_block("demo.json", "zero_topo").items() if k != "enabled"}
    ted = _shipped_block("ted_moe.json", "ted")
    assert (ted["tensor_parallel"], ted["expert_parallel"]) == (2, 4)
    for o in world.run(_zero_topo_run, zero_topo, whole, 4, 4, True, 1.0):
        assert o["norms"][0] > 1.0  # the clip is active
        assert o["norms"][0] == pytest.approx(o["serial_norm"], rel=1e-2)
        assert o["losses"][-1] < o["losses"][0]
        assert o["expert_shards"] == ([2] if whole else [1])
        assert o["measured"]["step"] == o["analytic"]["step"]
        assert_links_equal(o["measured_links"], o["analytic_links"], phases=("step",))
    described = o["describe"]
    assert ("kept whole on each rank" in described) != whole


# ---- PCCL: ds_ext's and DeepSpeed's all-gathers / reduce-scatters by 001 §6.2's algorithm ----
def _pccl_run(pccl, steps=3):
    """TED at T 2 x P 2 with DTD under DeepSpeed ZeRO-1, with ``comm.algorithm`` pccl and the pccl
    plugin (DeepSpeed's partition all-gathers) or neither: losses, this rank's parameters, and
    the topology levels of the step's all-gathers."""
    import ted_support as ts
    import torch.distributed as dist

    cfg = ts.config()
    plugins = {"comm": {"algorithm": "pccl"}, "pccl": {"enabled": True}} if pccl else None
    engine, ted = _engine(cfg, ts.serial_model(cfg).state_dict(), 2, 2, 1, plugins=plugins)
    losses = [_step(engine, ted, step) for step in range(steps)]
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    levels = sorted({lv for (ph, op, lv) in engine.ds_ext.ledger.steps[-1].bytes if (ph, op) == ("step", "all_gather")})
    engine.destroy()
    dist.barrier()
    return losses, params, levels


def test_pccl_equals_native_collectives(world):
    """PCCL beside TED: DeepSpeed ZeRO-1's all-gathers over the data group (2 nodes x 2 ranks) run
    across nodes then inside each node, and the DTD gathers by ds_ext's pccl; losses and every
    parameter equal the native collectives' within float reordering."""
    import torch

    native = world.run(_pccl_run, False)
    pccl = world.run(_pccl_run, True)
    for (losses, params, levels), (p_losses, p_params, p_levels) in zip(native, pccl):
        assert p_losses == pytest.approx(losses, rel=1e-5, abs=0)
        for name, p in params.items():
            torch.testing.assert_close(p_params[name], p, rtol=1e-5, atol=1e-6, msg=name)
        assert levels == ["node"] and p_levels == ["gpu", "node"]  # the node phase, then the ring inside


# ---- ZeRO-1/2 with gradient clipping against the serial model ------------------------------
def _zero_vs_serial(stage, clip, whole=False, steps=5):
    import ted_support as ts
    import torch
    import torch.distributed as dist

    cfg = ts.config(drop_tokens=False, expert_tensor_parallel=not whole)
    serial = ts.serial_model(cfg)
    engine, ted = _engine(cfg, serial.state_dict(), 2, 4, stage, gradient_clipping=clip)
    sopt = torch.optim.AdamW(serial.parameters(), lr=LR, weight_decay=WD)
    out = []
    for step in range(steps):
        loss = _step(engine, ted, step)
        sopt.zero_grad()
        sloss, slosses = ts.serial_loss(serial, ts.shards(ted.layout, step))
        sloss.backward()
        norm = torch.nn.utils.clip_grad_norm_(serial.parameters(), clip)
        sopt.step()
        out.append((loss, slosses[ted.data_rank], float(engine.get_global_grad_norm()), norm.item()))
    named = {n: p.detach() for n, p in engine.module.named_parameters()}
    n = ts.assert_close_to_serial(
        named, ts.serial_view(engine.module, dict(serial.named_parameters()), ted.layout, dist.get_rank()), rtol=5e-4
    )
    replicated = {
        name: p.detach()
        for name, p in engine.module.named_parameters()
        if not getattr(p, "tensor_model_parallel", False)
    }
    differ = [name for name, p in replicated.items() if not _equal_over(ted.groups["tensor"], p)]
    engine.destroy()
    return out, n, differ, sum("gate.wg" in name for name in replicated)


@pytest.mark.parametrize("stage,whole", [(0, False), (1, False), (2, False), (1, True)])
def test_zero_with_clipping_matches_serial(world, stage, whole):
    """One global norm over expert and non-expert parameters, each counted once; the gate and
    every replicated parameter stay bit-identical over the tensor group. Stage 0 (Megatron-
    DeepSpeed's MoE example config) clips by ds_ext.moe.grad_norm; the old code refused it.
    Whole experts at ZeRO-1: DeepSpeed partitions them over tensor x expert-data and counts
    every rank's partition (without the model_parallel mark it missed tensor rank 1's)."""
    for out, n, differ, gates in world.run(_zero_vs_serial, stage, 0.05, whole):
        assert n >= 25 and gates == 1 and differ == []
        for loss, sloss, norm, snorm in out:
            assert abs(loss - sloss) <= 1e-5 * sloss
            assert abs(norm - snorm) <= 1e-5 * snorm and snorm > 0.05  # clipping active
    assert out[-1][0] < out[0][0]


# ---- tiled optimizer, checkpoints ----------------------------------------------------------
def _tiled(tile):
    import ted_support as ts

    cfg = ts.config(drop_tokens=False)
    plugins = {"tiled_optimizer": {"enabled": True, "tile_size": tile}} if tile else None
    engine, ted = _engine(
        cfg, ts.serial_model(cfg).state_dict(), 2, 4, 2, plugins=plugins, bf16={"enabled": True}, gradient_clipping=1.0
    )
    losses = [_step(engine, ted, s) for s in range(6)]
    masters = [t.detach().clone() for t in engine.optimizer.single_partition_of_fp32_groups]
    weights = [p.detach().clone() for p in engine.module.parameters()]
    tiled = [p.name for p in engine.ds_ext.plugins]
    engine.destroy()
    return losses, masters, weights, tiled


def test_tiled_optimizer_is_bit_identical(world):
    import torch

    ref = world.run(_tiled, None)
    tiled = world.run(_tiled, 1000)  # tiles smaller than every param group
    for (l0, m0, w0, p0), (l1, m1, w1, p1) in zip(ref, tiled):
        assert p0 == ["ted"] and p1 == ["ted", "tiled_optimizer"] and w0[0].dtype == torch.bfloat16  # hook order
        assert l0 == l1
        assert all(torch.equal(a, b) for a, b in zip(m0, m1)) and all(torch.equal(a, b) for a, b in zip(w0, w1))


def _checkpoint(path, zero_topo):
    """Random token selection and jittered gates on, capacity factor 0.5 (tokens are dropped):
    the resumed run draws what the uninterrupted run drew (the gates' draw counters travel in
    the checkpoint; without them the resumed run replays the first step's draws). ``zero_topo``:
    configs/demo.json's ZeRO-topo block in bf16 with clipping 1.0 (experts at expert-data 1 kept
    whole), else DeepSpeed ZeRO-1 in fp32."""
    import ted_support as ts

    cfg = ts.config(use_rts=True, noisy_gate_policy="Jitter", capacity_factor=0.5)
    ds_kw = (
        dict(
            plugins={"zero_topo": _shipped_block("demo.json", "zero_topo")},
            bf16={"enabled": True},
            gradient_clipping=1.0,
        )
        if zero_topo
        else {}
    )
    stage = 0 if zero_topo else 1
    engine, ted = _engine(cfg, ts.serial_model(cfg).state_dict(), 2, 4, stage, **ds_kw)
    for s in range(3):
        _step(engine, ted, s)
    engine.save_checkpoint(path, tag="ted")
    after = [_step(engine, ted, s) for s in range(3, 5)]
    engine.destroy()
    engine, ted = _engine(cfg, ts.serial_model(cfg, seed=1).state_dict(), 2, 4, stage, **ds_kw)
    engine.load_checkpoint(path, tag="ted")
    resumed = [_step(engine, ted, s) for s in range(3, 5)]
    engine.destroy()
    return after, resumed


@pytest.mark.parametrize("zero_topo", [False, True], ids=["zero1", "zero_topo_bf16"])
def test_checkpoint_round_trip(world, tmp_path, zero_topo):
    for after, resumed in world.run(_checkpoint, str(tmp_path), zero_topo):
        assert after == resumed


# ---- DeepSpeed-MoE at G_tensor = 1 -----------------------------------------------------------
def _vs_deepspeed(k, steps=10):
    """10 ZeRO-1 steps of the same GPT-MoE, same initialization and data: DeepSpeed's MoE layer
    (its own groups and all-to-alls) and TEDMoE (TP 1, EP 4, expert data 2)."""
    import dataclasses

    import ted_support as ts
    import torch.distributed as dist

    import ds_ext
    from ds_ext.moe.reference import local_expert_state
    from ds_ext.parallel import TEDLayout

    # top-1 dropless; top-2 with capacity factor 1: tokens are dropped (DeepSpeed's top-2 drops
    # by position, deterministically)
    cfg = ts.config(top_k=k, **(dict(drop_tokens=False) if k == 1 else dict(capacity_factor=1.0)))
    state = ts.serial_model(cfg).state_dict()
    layout = TEDLayout.build(dist.get_world_size(), 1, 4)
    ds_cfg = dataclasses.replace(cfg, moe_impl="deepspeed", ep_size=4)
    from ds_ext.models.gpt_moe import GPTMoE

    model = GPTMoE(ds_cfg)
    model.load_state_dict(local_expert_state(state, layout.coords(dist.get_rank())["expert"], 1))
    plain = ts.ds_config(1, 4, 1, gradient_clipping=1.0)
    del plain["ds_ext"]["ted"]
    engine, *_ = ds_ext.initialize(model=model, optimizer=_optimizer(model), config=plain)
    rank_d = dist.get_rank(engine.data_parallel_group)
    ds_losses = []
    for s in range(steps):
        loss = engine(ts.shards(layout, s)[rank_d])
        engine.backward(loss)
        engine.step()
        ds_losses.append(loss.item())
    engine.destroy()
    engine, ted = _engine(cfg, state, 1, 4, 1, gradient_clipping=1.0)
    assert ted.data_rank == rank_d
    ted_losses = [_step(engine, ted, s) for s in range(steps)]
    engine.destroy()
    return ds_losses, ted_losses


@pytest.mark.parametrize("k", [1, 2])
def test_losses_equal_deepspeed_moe_at_tp1(world, k):
    for ds_losses, ted_losses in world.run(_vs_deepspeed, k):
        for a, b in zip(ds_losses, ted_losses, strict=True):
            assert abs(a - b) <= 1e-5 * a, (a, b)
    assert ds_losses[-1] < ds_losses[0] - 0.5


# ---- memory: Eq 7.4 -------------------------------------------------------------------------
def _state_bytes():
    """16-bit parameter and gradient bytes (a non-boundary micro-step of ZeRO-1 keeps whole
    gradients) and optimizer bytes (fp32 partitions + Adam m, v) of this rank, bf16 ZeRO-1."""
    import ted_support as ts
    import torch

    from ds_ext.perf.ted import eq_7_4

    cfg = ts.config(d_model=64, drop_tokens=False)
    engine, ted = _engine(
        cfg, ts.serial_model(cfg).state_dict(), 2, 4, 1, bf16={"enabled": True}, gradient_accumulation_steps=2
    )
    params = list(engine.module.parameters())
    for micro in range(2):
        engine.backward(engine(ts.shards(ted.layout, 0)[ted.data_rank]))
        if micro == 0:
            grads = sum(p.grad.numel() * p.grad.element_size() for p in params)
        engine.step()
    zero = engine.optimizer
    optim = sum(t.numel() * t.element_size() for t in zero.single_partition_of_fp32_groups) + sum(
        v.numel() * v.element_size()
        for s in zero.optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.dim() > 0
    )
    measured = (sum(p.numel() * p.element_size() for p in params), grads, optim)
    n_exp = sum(p.numel() for p in params if getattr(p, "allreduce", True) is False)
    model = eq_7_4(sum(p.numel() for p in params) - n_exp, n_exp, ted.layout)
    engine.destroy()
    return measured, (model.params, model.grads, model.optimizer), n_exp


def test_state_memory_equals_eq_7_4(world):
    for measured, model, n_exp in world.run(_state_bytes):
        assert measured == model and n_exp > 0


# ---- bad input: one line, before any collective ---------------------------------------------
def _bad(case):
    import ted_support as ts
    import torch
    import torch.distributed.distributed_c10d as c10d
    from torch import nn

    import ds_ext
    from ds_ext.moe import ColumnParallelLinear, TEDMoE

    def moe(**kw):
        args = dict(
            hidden_size=32,
            expert=nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)),
            num_experts=4,
            ep_size=4,
            enable_expert_tensor_parallelism=True,
        )
        return nn.ModuleDict({"moe": TEDMoE(**{**args, **kw})})

    T, P, model, ds_kw = 2, 4, None, {}
    try:
        if case == "product":
            ds_kw = dict(ted={"expert_data_parallel": 2})
        elif case == "zero3":
            ds_kw = dict(stage=3)
        elif case == "clip_stage0_bf16":
            ds_kw = dict(gradient_clipping=1.0, bf16={"enabled": True})
        elif case == "heads":
            model = ts.ted_model(
                ts.config(n_heads=2), ts.serial_model(ts.config(n_heads=2)).state_dict(), *_layout(4, 2)
            )
            T, P = 4, 2
        elif case == "hidden":
            T, P, model = 4, 2, moe(ep_size=2)
            model["fc"] = ColumnParallelLinear(32, 30)
        elif case == "expert_hidden":
            T, P = 4, 2
            model = moe(ep_size=2, expert=nn.Sequential(nn.Linear(32, 30), nn.GELU(), nn.Linear(30, 32)))
        elif case == "mixed_experts_zero_topo":
            model = moe(enable_expert_tensor_parallelism=False, ep_size=2)
            model["split"] = moe(ep_size=2)["moe"]
            T, P, ds_kw = 2, 2, dict(plugins={"zero_topo": {"enabled": True}})
        elif case == "whole_experts_without_dtd":
            model = moe(enable_expert_tensor_parallelism=False)
            ds_kw = dict(ted={"duplicate_token_dropping": False})
        elif case == "ep_size":
            model = moe(ep_size=2)
        elif case == "config_experts":
            ds_kw = dict(ted={"num_experts": 8})
        elif case == "num_experts":
            model = moe(num_experts=6)
        elif case == "top_k":
            model = moe(k=5)
        elif case == "capacity_factor":
            model = moe(capacity_factor=-1.0)
        model = model if model is not None else moe()
        opt = torch.optim.AdamW(model.parameters())
        groups = c10d._world.group_count
        ds_ext.initialize(model=model, optimizer=opt, config=ts.ds_config(T, P, **ds_kw))
    except Exception as err:  # noqa: BLE001 - the test inspects the message
        return type(err).__name__, str(err), c10d._world.group_count - groups if model is not None else 0
    return None


def _layout(T, P):
    import torch.distributed as dist

    from ds_ext.parallel import TEDLayout

    return TEDLayout.build(dist.get_world_size(), T, P), dist.get_rank()


BAD = {
    "product": "ds_ext.ted: tensor_parallel=2 * expert_parallel=4 * expert_data_parallel=2 = 16 != world size 8 "
    "(Eq 7.1: G_tensor x G_expert x G_data^exp = G)",
    "zero3": "ds_ext.ted: zero_optimization.stage 3 is not supported (DeepSpeed's MoE parameter groups need ZeRO <= 2; "
    "001 §7.1 uses ZeRO-1); allowed: 0, 1, 2",
    "clip_stage0_bf16": "ds_ext.ted: gradient_clipping 1.0 with zero_optimization.stage 0 and bf16: DeepSpeed's bf16 "
    "optimizer clips with its own norm, which does not count expert parameters once (DeepSpeed "
    "clips at 1.0 when the key is absent); allowed: stage 0 in fp32, stage 1 or 2, ds_ext.zero_topo, or "
    "gradient_clipping 0",
    "heads": "ds_ext.ted: blocks.0.attn n_heads 2 is not divisible by tensor_parallel 4",
    "hidden": "ds_ext.ted: fc.out_features 30 is not divisible by tensor_parallel 4",
    "expert_hidden": "ds_ext.ted: moe expert hidden size 30 is not divisible by tensor_parallel 4",
    "mixed_experts_zero_topo": "ds_ext.ted: moe keeps its experts whole on every tensor rank and split splits them "
    "(enable_expert_tensor_parallelism) with ds_ext.zero_topo, which shards every expert over one expert-data "
    "group; allowed: the same enable_expert_tensor_parallelism in every layer",
    "whole_experts_without_dtd": "ds_ext.ted: moe keeps its experts whole on every tensor rank "
    "(enable_expert_tensor_parallelism=False) at tensor_parallel 2, so each tensor rank "
    "must run only its share of the tokens: duplicate_token_dropping must be true "
    "(DeepSpeed drops them too); allowed: true",
    "ep_size": "ds_ext.ted: moe has ep_size 2 but ds_ext.ted.expert_parallel is 4; allowed: ep_size == expert_parallel",
    "config_experts": "ds_ext.ted: num_experts is 8 but layer moe has 4",
    "num_experts": "ds_ext.ted: num_experts 6 must be a multiple of the expert-parallel size ep_size 4",
    "top_k": "ds_ext.ted: top_k (k) must be an integer in 1..num_experts (4), got 5",
    "capacity_factor": "ds_ext.ted: capacity_factor must be a finite number > 0, got -1.0",
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_one_line_before_any_collective(world, case):
    for kind, message, new_groups in world.run(_bad, case):
        assert message == BAD[case] and kind in ("DsExtConfigError", "TEDError")
        assert new_groups == 0  # no process group was created: no collective ran


# ---- convergence: 100 steps with DTD + CAC against the serial model ------------------------
HELD_OUT = range(10_000, 10_004)


def _held_out(loss_of, layout, data_rank):
    """Mean loss over the held-out global batches (this rank's shard of each)."""
    import ted_support as ts

    return sum(loss_of(ts.shards(layout, s)[data_rank]) for s in HELD_OUT) / len(HELD_OUT)


def _converge(steps):
    """ZeRO-0 fp32 (the cheapest engine: the 100 steps are the point), torch activation
    checkpointing so that CAC replays, RTS token dropping (capacity 10 < the 8 tokens a
    balanced expert gets x 1.25 when routing is skewed)."""
    import dataclasses

    import ted_support as ts
    import torch
    import torch.distributed as dist

    cfg = ts.config(capacity_factor=1.25, use_rts=True, checkpoint="torch")
    serial = ts.serial_model(dataclasses.replace(cfg, checkpoint="none"))
    engine, ted = _engine(
        cfg, serial.state_dict(), 2, 4, 0, ted={"duplicate_token_dropping": True, "comm_aware_checkpointing": True}
    )
    losses = [_step(engine, ted, s) for s in range(steps)]
    engine.eval()
    with torch.no_grad():
        mine = torch.tensor(_held_out(lambda b: engine(b).item(), ted.layout, ted.data_rank))
    dist.all_reduce(mine)  # every shard, counted G_tensor times
    ours = mine.item() / dist.get_world_size()
    engine.destroy()
    # the two serial runs side by side, rank 0 with the shards in order, rank 1 reversed (the same
    # objective); each is one process's own computation, so where it runs does not change it
    order = {0: 1, 1: -1}.get(dist.get_rank())
    if order is None:
        return losses, ours, None
    serial = ts.serial_model(dataclasses.replace(cfg, checkpoint="none"))
    sopt = torch.optim.AdamW(serial.parameters(), lr=LR, weight_decay=WD)
    for s in range(steps):
        sopt.zero_grad()
        ts.serial_loss(serial, ts.shards(ted.layout, s)[::order])[0].backward()
        sopt.step()
    serial.eval()
    with torch.no_grad():
        ref = (
            sum(_held_out(lambda b: serial(b).item(), ted.layout, d) for d in range(ted.layout.nonexp_data))
            / ted.layout.nonexp_data
        )
    return losses, ours, ref


# Held-out loss after STEPS steps of TED and of the two serial runs, per initialization seed of the
# serial model (tests/ted_support.py serial_model; the test uses 0), 8 gloo ranks: seed 0 2.789 in
# (2.733, 2.793), seed 1 2.744 in (2.713, 2.763), seed 2 2.679 against (2.682, 2.699), within 1 % of
# the span. At 60 steps TED landed outside 1 % of the span for two seeds of three (seed 0 3.077
# against (2.923, 2.982), seed 2 2.778 against (2.817, 2.835)): there the runs have not settled; at
# 100 they have, and the bound is the 200-step test's, unchanged. Dense gradients averaged over the
# tensor group instead of the data group (ds_ext.mpu) land at 2.943, 5 % above the span: it fails.
# MoE-only breakage moves this small model less (DTD combining the tensor ranks' slot chunks in
# reverse: 2.811, inside the bound); tests/test_ted_layer.py and test_ted_reference.py check DTD
# and CAC exactly.
STEPS = 100


def test_converges_like_serial_reference(world):
    """TED lands where the serial model does, within 1 % of the span of two serial runs that
    differ only in the order of the global batch's shards (summation order and random token
    selection's draws). Long runs amplify such differences: on one host the two serial runs
    ended 2.2 % apart after 200 steps (2.438, 2.493) with TED at 2.475 between them, so a fixed
    1 % around one of them failed there and passed on another host."""
    res = world.run(_converge, STEPS, timeout=900)
    losses, ours, _ = res[0]
    refs = [res[0][2], res[1][2]]
    lo, hi = min(refs), max(refs)
    assert 0.99 * lo <= ours <= 1.01 * hi, (ours, refs)
    assert hi < losses[0] - 1.5  # all actually learned
