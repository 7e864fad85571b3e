"""TED training through ``ds_ext.initialize`` on 8 gloo ranks (2 emulated nodes x 2 GPUs x 2 GCDs).

References: a serial model trained with torch's AdamW and ``clip_grad_norm_`` on the same
global batches (ZeRO-1/2 with clipping, convergence); DeepSpeed's own MoE at G_tensor = 1;
the untiled step (tiled optimizer); the run without a checkpoint round trip; Eq 7.4 (memory);
megatron-core's tensor-parallel layers (interoperability).
"""

import pytest

from ted_support import MICRO, SEQ

WORLD_SIZE = 8
LR, WD = 1e-2, 0.01


def _optimizer(model, lr=LR):
    import torch
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "dense", "lr": lr, "weight_decay": WD})
    return torch.optim.AdamW(groups, lr=lr, weight_decay=WD)


def _engine(cfg, serial_state, T, P, stage, plugins=None, **ds_extra):
    import torch.distributed as dist

    import ds_ext
    import ted_support as ts
    from ds_ext.groups import TEDLayout

    layout = TEDLayout.build(dist.get_world_size(), T, P)
    model = ts.ted_model(cfg, serial_state, layout, dist.get_rank())
    engine, *_ = ds_ext.initialize(model=model, optimizer=_optimizer(model), config=ts.ds_config(T, P, stage, plugins=plugins, **ds_extra))
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


# ---- ZeRO-1/2 with gradient clipping against the serial model ------------------------------
def _zero_vs_serial(stage, clip, steps=5):
    import torch
    import torch.distributed as dist

    import ted_support as ts

    cfg = ts.config(drop_tokens=False)
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
    n = ts.assert_close_to_serial(named, ts.serial_view(engine.module, dict(serial.named_parameters()),
                                                       ted.layout, dist.get_rank()), rtol=5e-4)
    replicated = {name: p.detach() for name, p in engine.module.named_parameters()
                  if not getattr(p, "tensor_model_parallel", False)}
    differ = [name for name, p in replicated.items() if not _equal_over(ted.groups["tensor"], p)]
    engine.destroy()
    return out, n, differ, sum("gate.wg" in name for name in replicated)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_with_clipping_matches_serial(world, stage):
    """One global norm over expert and non-expert parameters, each counted once; the gate and
    every replicated parameter stay bit-identical over the tensor group."""
    for out, n, differ, gates in world.run(_zero_vs_serial, stage, 0.05):
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
    engine, ted = _engine(cfg, ts.serial_model(cfg).state_dict(), 2, 4, 2, plugins=plugins,
                          bf16={"enabled": True}, gradient_clipping=1.0)
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
        assert p0 == ["ted"] and p1 == ["tiled_optimizer", "ted"] and w0[0].dtype == torch.bfloat16
        assert l0 == l1
        assert all(torch.equal(a, b) for a, b in zip(m0, m1)) and all(torch.equal(a, b) for a, b in zip(w0, w1))


def _checkpoint(path):
    import ted_support as ts

    cfg = ts.config(drop_tokens=False)
    state = ts.serial_model(cfg).state_dict()
    engine, ted = _engine(cfg, state, 2, 4, 1)
    for s in range(3):
        _step(engine, ted, s)
    engine.save_checkpoint(path, tag="ted")
    after = [_step(engine, ted, s) for s in range(3, 5)]
    engine.destroy()
    engine, ted = _engine(cfg, ts.serial_model(cfg, seed=1).state_dict(), 2, 4, 1)
    engine.load_checkpoint(path, tag="ted")
    resumed = [_step(engine, ted, s) for s in range(3, 5)]
    engine.destroy()
    return after, resumed


def test_checkpoint_round_trip(world, tmp_path):
    for after, resumed in world.run(_checkpoint, str(tmp_path)):
        assert after == resumed


# ---- DeepSpeed-MoE at G_tensor = 1 -----------------------------------------------------------
def _vs_deepspeed(k, steps=20):
    """20 ZeRO-1 steps of the same GPT-MoE, same initialization and data: DeepSpeed's MoE layer
    (its own groups and all-to-alls) and TEDMoE (TP 1, EP 4, expert data 2)."""
    import dataclasses

    import torch.distributed as dist

    import ds_ext
    import ted_support as ts
    from ds_ext.groups import TEDLayout
    from ds_ext.moe.reference import local_expert_state

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
    import torch

    import ted_support as ts
    from ds_ext.perf.ted import eq_7_4

    cfg = ts.config(d_model=64, drop_tokens=False)
    engine, ted = _engine(cfg, ts.serial_model(cfg).state_dict(), 2, 4, 1, bf16={"enabled": True},
                          gradient_accumulation_steps=2)
    params = list(engine.module.parameters())
    for micro in range(2):
        engine.backward(engine(ts.shards(ted.layout, 0)[ted.data_rank]))
        if micro == 0:
            grads = sum(p.grad.numel() * p.grad.element_size() for p in params)
        engine.step()
    zero = engine.optimizer
    optim = sum(t.numel() * t.element_size() for t in zero.single_partition_of_fp32_groups) + sum(
        v.numel() * v.element_size() for s in zero.optimizer.state.values() for v in s.values()
        if torch.is_tensor(v) and v.dim() > 0)
    measured = (sum(p.numel() * p.element_size() for p in params), grads, optim)
    n_exp = sum(p.numel() for p in params if getattr(p, "allreduce", True) is False)
    model = eq_7_4(sum(p.numel() for p in params) - n_exp, n_exp, ted.layout)
    engine.destroy()
    return measured, (model.params, model.grads, model.optimizer), n_exp


def test_state_memory_equals_eq_7_4(world):
    for measured, model, n_exp in world.run(_state_bytes):
        assert measured == model and n_exp > 0
