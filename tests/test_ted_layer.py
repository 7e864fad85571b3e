"""TEDMoE on 8 gloo ranks (2 emulated nodes x 2 GPUs x 2 GCDs) against independent references.

* parity: a GPT-MoE trained through ``ds_ext.initialize`` equals a single-process serial
  model (all experts local, nothing sliced, same initialization, each data shard run in turn
  and the losses averaged) in the loss of every rank and every gradient, for the four
  (G_tensor, G_expert, G_data^exp) layouts of the issue, top-1 and top-2;
* DTD on / off and CAC on / off give bit-identical gradients under torch (reentrant and not)
  and DeepSpeed activation checkpointing, and the ledger of one MoE block equals
  ``ds_ext.perf.ted`` exactly (bytes and calls per op and level);
* noisy gates are replayed in the recompute; bad input fails in one line.
"""

import dataclasses

import pytest

WORLD_SIZE = 8
TOPOLOGY = {"preset": "frontier", "sizes": {"gpu": 2}, "emulate": True}
LAYOUTS = [(2, 2, 2), (2, 4, 1), (1, 4, 2), (4, 2, 1)]
MICRO, SEQ = 2, 16
_CORPUS = []


def _corpus():
    from ds_ext.data import ByteCorpus

    if not _CORPUS:
        _CORPUS.append(ByteCorpus(max_bytes=200_000))
    return _CORPUS[0]


def _config(**kw):
    from ds_ext.models.gpt_moe import GPTMoEConfig

    base = dict(seq_len=SEQ, d_model=32, n_layers=2, n_heads=4, num_experts=4, min_capacity=0, use_rts=False,
                top2_2nd_expert_sampling=False)
    return GPTMoEConfig(**{**base, **kw})


def _shards(layout, step=0):
    return [_corpus().micro_batch(step, 0, d, layout.nonexp_data, MICRO, 1, SEQ) for d in range(layout.nonexp_data)]


def _serial(cfg, batches, seed=0):
    """The serial reference: every shard through the whole model, losses averaged."""
    import torch

    from ds_ext.models.gpt_moe import GPTMoE

    torch.manual_seed(seed)
    model = GPTMoE(cfg)
    losses = [model(b) for b in batches]
    torch.stack(losses).mean().backward()
    return model, [x.item() for x in losses], {n: p.grad for n, p in model.named_parameters()}


def _ted_model(cfg, serial, layout, rank):
    """The same initialization, built for expert rank e (``ep_size = G_expert``)."""
    from ds_ext.models.gpt_moe import GPTMoE
    from ds_ext.moe.reference import local_expert_state

    model = GPTMoE(dataclasses.replace(cfg, ep_size=layout.expert))
    k = cfg.num_experts // layout.expert
    model.load_state_dict(local_expert_state(serial.state_dict(), layout.coords(rank)["expert"], k))
    return model


def _assert_matches_serial(model, serial_grads, layout, rank):
    import torch

    from ds_ext.moe.reference import serial_name, tensor_shard

    c = layout.coords(rank)
    k = next(m.num_local_experts for m in model.modules() if hasattr(m, "num_local_experts"))
    n = 0
    for name, p in model.named_parameters():
        ref = tensor_shard(serial_grads[serial_name(name, c["expert"], k)], p, c["tensor"], layout.tensor)
        torch.testing.assert_close(p.grad, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item(), msg=name)
        n += 1
    return n


# ---- parity with the serial reference, through ds_ext.initialize and DeepSpeed ---------------
def _parity(T, P, k):
    import torch
    import torch.distributed as dist

    import ds_ext
    from ds_ext.groups import TEDLayout

    rank = dist.get_rank()
    layout = TEDLayout.build(dist.get_world_size(), T, P)
    out = {}
    for top_k, kw in ((1, dict(drop_tokens=False)), (2, dict(capacity_factor=2.0))):
        if top_k != k:
            continue
        cfg = _config(top_k=top_k, n_layers=4, **kw)  # 2 MoE blocks; top-2 capacity 2 x 2 x S/E = S: no drops
        batches = _shards(layout)
        serial, losses, grads = _serial(cfg, batches)
        model = _ted_model(cfg, serial, layout, rank)
        ds_cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
                  "steps_per_print": 10**6, "zero_optimization": {"stage": 0},
                  "ds_ext": {"topology": TOPOLOGY,
                             "ted": {"enabled": True, "tensor_parallel": T, "expert_parallel": P}}}
        engine, *_ = ds_ext.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=ds_cfg)
        d = engine.ds_ext.plugins[0].ted.data_rank
        loss = engine(batches[d])
        engine.backward(loss)  # DeepSpeed averages non-expert grads over G_data^nonexp, experts over G_data^exp
        assert abs(loss.item() - losses[d]) <= 1e-6 * abs(losses[d]), (loss.item(), losses[d])
        out["params"] = _assert_matches_serial(engine.module, grads, layout, rank)
        out["expert_group"] = engine.ds_ext.plugins[0].ted.ranks("expert")
        engine.destroy()
    return out


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: "TP{}xEP{}xDP{}".format(*lay))
def test_parity_with_serial_reference(world, layout, k):
    T, P, _ = layout
    res = world.run(_parity, T, P, k)
    assert all(r["params"] >= 20 for r in res)
    assert res[0]["expert_group"] == tuple(range(0, T * P, T))


# ---- DTD / CAC: bit-identity, call counts, ledger == analytic model --------------------------
def _variants(T, P, modes, dropless=False):
    """Gradients and ledger traffic of one MoE block for every (checkpoint mode, DTD, CAC)."""
    import torch
    import torch.distributed as dist

    from ds_ext import config as cfgmod
    from ds_ext.groups import TEDLayout
    from ds_ext.moe import TEDContext, TEDMoE
    from ds_ext.perf.ted import MoEBlockShape, moe_block_traffic
    from ds_ext.runtime import Runtime

    rank = dist.get_rank()
    layout = TEDLayout.build(dist.get_world_size(), T, P)
    runtime = Runtime.create(cfgmod.parse({"topology": TOPOLOGY}))
    ted = TEDContext.create(layout, runtime.comm)
    kw = dict(drop_tokens=False) if dropless else dict(capacity_factor=1.0)
    cfg = _config(n_layers=1, moe_every=1, **kw)  # one MoE block
    batches = _shards(layout)
    serial, _, _ = _serial(cfg, batches)
    counts = []  # exp_counts of each shard, from the serial model
    hook = serial.blocks[0].ffn.register_forward_hook(lambda m, i, o: counts.append(o[2]) and None)
    for b in batches:
        serial(b)
    hook.remove()
    d, c = ted.data_rank, layout.coords(rank)
    expert_shards = [e + P * c["expert_data"] for e in range(P)]
    if dropless:  # agreed over the expert group, padded to G_tensor
        C = -(-max(int(counts[s].max()) for s in expert_shards) // T) * T
    else:
        C = MICRO * SEQ // cfg.num_experts
    shape = MoEBlockShape(tokens=MICRO * SEQ, hidden=cfg.d_model, num_experts=cfg.num_experts, capacity=C,
                          element_bytes=4)
    results = {}
    for mode in modes:
        for dtd in (False, True):
            for cac in (False, True):
                model = _ted_model(dataclasses.replace(cfg, checkpoint=mode), serial, layout, rank)
                bound = [m for m in model.modules() if hasattr(m, "ted_bind")]
                for i, m in enumerate(bound):
                    m.ted_bind(dataclasses.replace(ted, dtd=dtd, cac=cac), i)
                ledger = runtime.ledger
                ledger.reset()
                with ledger.phase("forward"):
                    loss = model(batches[d])
                with ledger.phase("backward"):
                    loss.backward()
                assert all(len(m.ted_tape) == 0 for m in model.modules() if isinstance(m, TEDMoE))
                want = moe_block_traffic(layout, runtime.topology, rank, shape, dtd=dtd, cac=cac,
                                         checkpointing=mode != "none", dropless=dropless)
                got = ledger.current
                assert dict(got.bytes) == dict(want.bytes), (mode, dtd, cac, dict(got.bytes), dict(want.bytes))
                assert dict(got.calls) == dict(want.calls), (mode, dtd, cac)
                calls = {}
                for (_, op, _), n in got.calls.items():
                    calls[op] = calls.get(op, 0) + n
                results[(mode, dtd, cac)] = ({n: p.grad.clone() for n, p in model.named_parameters()}, calls)
    base = results[(modes[0], False, False)][0]
    for key, (grads, _) in results.items():
        for n, g in grads.items():
            assert torch.equal(g, base[n]), (key, n)
    return {key: calls for key, (_, calls) in results.items()}


def test_dtd_cac_bit_identical_and_ledger_equals_model(world):
    modes = ["none", "torch", "torch-reentrant", "deepspeed"]
    res = world.run(_variants, 2, 4, modes)
    calls = res[0]
    assert calls[("none", False, False)] == {"all_reduce": 4, "all_to_all": 4}
    for mode in modes[1:]:
        assert calls[(mode, False, False)] == {"all_reduce": 6, "all_to_all": 6}  # 001 §7.3: six and six
        assert calls[(mode, False, True)] == {"all_reduce": 4, "all_to_all": 4}  # CAC: four and four
        assert calls[(mode, True, True)] == {"all_reduce": 4, "all_to_all": 4, "all_gather": 4}
        assert calls[(mode, True, False)] == {"all_reduce": 6, "all_to_all": 6, "all_gather": 6}


def test_dropless_capacity_agreed_over_expert_group(world):
    """Uneven routing, drop_tokens=False: the ledger bytes follow C = max count over the expert
    group padded to G_tensor (the analytic model takes C from the serial model's counts)."""
    world.run(_variants, 2, 2, ["none", "torch"], True)


# ---- noisy gates under checkpointing, bad input ---------------------------------------------
def _noisy_replay():
    import torch
    import torch.distributed as dist

    from ds_ext import config as cfgmod
    from ds_ext.groups import TEDLayout
    from ds_ext.moe import TEDContext
    from ds_ext.runtime import Runtime

    layout = TEDLayout.build(dist.get_world_size(), 2, 4)
    runtime = Runtime.create(cfgmod.parse({"topology": TOPOLOGY}))
    ted = TEDContext.create(layout, runtime.comm)
    grads = {}
    for mode in ("none", "torch", "torch-reentrant", "deepspeed"):
        cfg = _config(n_layers=1, moe_every=1, noisy_gate_policy="Jitter", use_rts=True, checkpoint=mode)
        torch.manual_seed(0)
        serial, _, _ = _serial(cfg, _shards(layout))
        model = _ted_model(cfg, serial, layout, dist.get_rank())
        for i, m in enumerate(m for m in model.modules() if hasattr(m, "ted_bind")):
            m.ted_bind(ted, i)
        model(_shards(layout)[ted.data_rank]).backward()
        grads[mode] = {n: p.grad for n, p in model.named_parameters()}
    for mode in ("torch", "torch-reentrant", "deepspeed"):
        for n, g in grads[mode].items():
            assert torch.equal(g, grads["none"][n]), (mode, n)


def test_noisy_gate_is_replayed_in_the_recompute(world):
    world.run(_noisy_replay)


def _capacity_error():
    import torch.distributed as dist

    from ds_ext import config as cfgmod
    from ds_ext.groups import TEDLayout
    from ds_ext.moe import TEDContext
    from ds_ext.runtime import Runtime

    layout = TEDLayout.build(dist.get_world_size(), 2, 4)
    runtime = Runtime.create(cfgmod.parse({"topology": TOPOLOGY}))
    ted = TEDContext.create(layout, runtime.comm)
    cfg = _config(n_layers=1, moe_every=1, capacity_factor=1.125)  # C = ceil(32 / 4 x 1.125) = 9
    serial, _, _ = _serial(cfg, _shards(layout)[:1])
    model = _ted_model(cfg, serial, layout, dist.get_rank())
    for i, m in enumerate(m for m in model.modules() if hasattr(m, "ted_bind")):
        m.ted_bind(ted, i)
    try:
        model(_shards(layout)[ted.data_rank])
    except ValueError as err:
        return str(err), runtime.ledger.current.by_level(op="all_to_all")
    return None


def test_capacity_not_divisible_by_tensor_parallel(world):
    for res in world.run(_capacity_error):
        msg, a2a = res
        assert msg == ("ds_ext.ted: expert capacity 9 = max(ceil(32 tokens / 4 experts x capacity_factor 1.125 x k 1), "
                       "min_capacity 0) is not divisible by tensor_parallel 2, which duplicate_token_dropping splits it "
                       "over; choose capacity_factor, min_capacity or the tokens per micro-batch so that it is, or "
                       "drop_tokens=False (dropless capacity is padded)")
        assert a2a == {}  # refused before the all-to-all
