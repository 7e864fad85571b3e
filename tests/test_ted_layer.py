"""TEDMoE on 8 gloo ranks (2 emulated nodes x 2 GPUs x 2 GCDs) against independent references.

* parity: a GPT-MoE trained through ``ds_ext.initialize`` equals the plain-torch serial
  reference (tests/ted_support.py: all experts whole, no ds_ext.moe code, same initialization,
  each data shard run in turn and the losses averaged) in the loss of every rank and every
  gradient, for the four
  (G_tensor, G_expert, G_data^exp) layouts of the issue, top-1 and top-2;
* DTD on / off and CAC on / off give bit-identical gradients under torch (reentrant and not)
  and DeepSpeed activation checkpointing, and the ledger of one MoE block equals
  ``ds_ext.perf.ted`` exactly (bytes and calls per op and level);
* noisy gates are replayed in the recompute; bad input fails in one line.
"""

import dataclasses

import pytest
from ledger_support import assert_links_equal
from ted_support import MICRO, SEQ

WORLD_SIZE = 8
LAYOUTS = [(2, 2, 2), (2, 4, 1), (1, 4, 2), (4, 2, 1)]


# ---- parity with the serial reference, through ds_ext.initialize and DeepSpeed ---------------
def _parity(T, P):
    import ted_support as ts
    import torch
    import torch.distributed as dist

    import ds_ext
    from ds_ext.parallel import TEDLayout

    rank = dist.get_rank()
    layout = TEDLayout.build(dist.get_world_size(), T, P)
    out = []
    # 2 MoE blocks; top-1 dropless, top-2 with capacity 2 x 2 x S / E = S: no token dropped
    for cfg in (ts.config(top_k=1, n_layers=4, drop_tokens=False), ts.config(top_k=2, n_layers=4, capacity_factor=2.0)):
        batches = ts.shards(layout)
        serial, losses, grads = ts.serial(cfg, batches)
        model = ts.ted_model(cfg, serial.state_dict(), layout, rank)
        opt = torch.optim.AdamW(model.parameters())
        engine, *_ = ds_ext.initialize(model=model, optimizer=opt, config=ts.ds_config(T, P))
        ted = engine.ds_ext.plugins[0].ted
        loss = engine(batches[ted.data_rank])
        engine.backward(loss)  # DeepSpeed averages non-expert grads over G_data^nonexp, experts over G_data^exp
        want = losses[ted.data_rank]
        assert abs(loss.item() - want) <= 1e-6 * abs(want), (loss.item(), want)
        named = {n: p.grad for n, p in engine.module.named_parameters()}
        out.append(
            (ts.assert_close_to_serial(named, ts.serial_view(engine.module, grads, layout, rank)), ted.ranks("expert"))
        )
        engine.destroy()
    return out


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: "TP{}xEP{}xDP{}".format(*lay))
def test_parity_with_serial_reference_top1_top2(world, layout):
    T, P, _ = layout
    res = world.run(_parity, T, P)
    for per_rank in res:
        assert [n for n, _ in per_rank] == [per_rank[0][0]] * 2 and per_rank[0][0] >= 30
    assert res[0][0][1] == tuple(range(0, T * P, T))


# ---- DTD / CAC: bit-identity, call counts, ledger == analytic model --------------------------
def _variants(T, P, modes, dropless=False, capacity_factor=1.0, capacity=None):
    """Gradients and ledger traffic of one MoE block for every (checkpoint mode, DTD, CAC);
    ``capacity``: the buffer slots per expert the caller computed by hand (else C = S / E,
    or the dropless C from the serial model's counts)."""
    import ted_support as ts
    import torch
    import torch.distributed as dist

    from ds_ext.moe import TEDMoE
    from ds_ext.perf.ted import MoEBlockShape, moe_block_traffic

    rank = dist.get_rank()
    runtime, ted = ts.context(T, P)
    layout = ted.layout
    cfg = ts.config(
        n_layers=1, moe_every=1, capacity_factor=capacity_factor, **(dict(drop_tokens=False) if dropless else {})
    )  # one MoE block
    batches = ts.shards(layout)
    serial, _, _ = ts.serial(cfg, batches)
    counts = serial.exp_counts  # exp_counts of each shard (one MoE block), from the serial model
    d, c = ted.data_rank, layout.coords(rank)
    if capacity is not None:
        C = capacity
    elif dropless:  # agreed over the expert group, padded to G_tensor
        C = -(-max(int(counts[e + P * c["expert_data"]].max()) for e in range(P)) // T) * T
    else:
        C = MICRO * SEQ // cfg.num_experts
    shape = MoEBlockShape(
        tokens=MICRO * SEQ, hidden=cfg.d_model, num_experts=cfg.num_experts, capacity=C, element_bytes=4
    )
    results, stash = {}, {}
    for mode in modes:
        for dtd, cac, lean in (
            (False, False, False),
            (False, True, False),
            (True, False, False),
            (True, True, False),
            (True, True, True),
        ):
            if lean and mode == "none":
                continue
            model = ts.ted_model(dataclasses.replace(cfg, checkpoint=mode), serial.state_dict(), layout, rank)
            ts.bind(model, dataclasses.replace(ted, dtd=dtd, cac=cac, cac_lean=lean))
            ledger = runtime.ledger
            ledger.reset()
            with ledger.phase("forward"):
                loss = model(batches[d])
            stash[(mode, dtd, "lean" if lean else cac)] = sum(
                m.ted_tape.stash_bytes() for m in model.modules() if hasattr(m, "ted_tape")
            )
            with ledger.phase("backward"):
                loss.backward()
            assert all(len(m.ted_tape) == 0 for m in model.modules() if isinstance(m, TEDMoE))
            want = moe_block_traffic(
                layout, runtime.topology, rank, shape, dtd=dtd, cac=cac, checkpointing=mode != "none", gloo=True
            )
            got = ledger.current
            assert dict(got.bytes) == dict(want.bytes), (mode, dtd, cac, dict(got.bytes), dict(want.bytes))
            assert_links_equal(got.link_bytes_by_phase(), want.link_bytes_by_phase())
            assert dict(got.calls) == dict(want.calls), (mode, dtd, cac)
            calls = {}
            for (_, op, _), n in got.calls.items():
                calls[op] = calls.get(op, 0) + n
            results[(mode, dtd, "lean" if lean else cac)] = (
                {n: p.grad.clone() for n, p in model.named_parameters()},
                calls,
            )
    base = results[(modes[0], False, False)][0]
    for key, (grads, _) in results.items():
        for n, g in grads.items():
            assert torch.equal(g, base[n]), (key, n)
    return {key: calls for key, (_, calls) in results.items()}, stash, (cfg.num_experts, C, cfg.d_model)


def test_dtd_cac_bit_identical_and_ledger_equals_model(world):
    """Also CAC's stash (what it keeps between the first forward and the recompute) and the lean
    stash: the same calls and bits, without the two all-to-all outputs that only feed DTD's
    all-gathers (2 x [E, C/T, H] fp32 per MoE block)."""
    modes = ["none", "torch", "torch-reentrant", "deepspeed"]
    calls, stash, (E, C, H) = world.run(_variants, 2, 4, modes)[0]
    agree = 1  # the 8-byte capacity agreement over the expert group (never recomputed)
    assert calls[("none", False, False)] == {"all_reduce": 4 + agree, "all_to_all": 4}
    for mode in modes[1:]:
        assert calls[(mode, False, False)] == {"all_reduce": 6 + agree, "all_to_all": 6}  # 001 §7.3: six and six
        assert calls[(mode, False, True)] == {"all_reduce": 4 + agree, "all_to_all": 4}  # CAC: four and four
        assert calls[(mode, True, True)] == {"all_reduce": 4 + agree, "all_to_all": 4, "all_gather": 4}
        assert calls[(mode, True, False)] == {"all_reduce": 6 + agree, "all_to_all": 6, "all_gather": 6}
        assert calls[(mode, True, "lean")] == calls[(mode, True, True)]
        assert stash[(mode, True, False)] == stash[(mode, False, False)] == 0 < stash[(mode, False, True)]
        assert stash[(mode, True, True)] - stash[(mode, True, "lean")] == 2 * E * (C // 2) * H * 4


def _default_stash(T, P):
    """One step through ``ds_ext.initialize`` under torch checkpointing with CAC and DTD, the ted
    block without ``cac_stash`` (the default) and with ``cac_stash: full``."""
    import ted_support as ts
    import torch
    import torch.distributed as dist

    import ds_ext
    from ds_ext.parallel import TEDLayout

    rank = dist.get_rank()
    layout = TEDLayout.build(dist.get_world_size(), T, P)
    cfg = ts.config(checkpoint="torch")  # tokens dropped (C = S / E)
    state = ts.serial_model(dataclasses.replace(cfg, checkpoint="none")).state_dict()
    runs = {}
    for stash in (None, "full"):
        model = ts.ted_model(cfg, state, layout, rank)
        engine, *_ = ds_ext.initialize(
            model=model,
            optimizer=torch.optim.AdamW(model.parameters()),
            config=ts.ds_config(T, P, ted={} if stash is None else {"cac_stash": stash}),
        )
        ted = engine.ds_ext.plugins[0].ted
        loss = engine(ts.shards(layout)[ted.data_rank])
        held = sum(m.ted_tape.stash_bytes() for m in engine.module.modules() if hasattr(m, "ted_tape"))
        engine.backward(loss)
        runs[stash] = (
            ted.cac_lean,
            held,
            loss.item(),
            {n: p.grad.clone() for n, p in engine.module.named_parameters()},
        )
        engine.destroy()
    (lean, held, loss, grads), (full_lean, full_held, full_loss, full_grads) = runs[None], runs["full"]
    assert lean and not full_lean and 0 < held < full_held
    assert loss == full_loss and all(torch.equal(g, full_grads[n]) for n, g in grads.items())
    return held, full_held


def test_default_stash_is_lean_and_bit_identical_to_full(world):
    """``cac_stash`` defaults to the lean stash (001 §7.3.2): less held between the forward and
    the recompute, the same loss and gradients bit for bit as the full stash."""
    for held, full in world.run(_default_stash, 2, 4):
        assert held < full


def test_dropless_capacity_agreed_over_expert_group(world):
    """Uneven routing, drop_tokens=False: the ledger bytes follow C = max count over the expert
    group padded to G_tensor (the analytic model takes C from the serial model's counts)."""
    world.run(_variants, 2, 2, ["none", "torch"], True)


# ---- noisy gates under checkpointing, bad input ---------------------------------------------
def _noisy_replay():
    import ted_support as ts
    import torch
    import torch.distributed as dist

    _, ted = ts.context(2, 4)
    grads = {}
    for mode in ("none", "torch", "torch-reentrant", "deepspeed"):
        cfg = ts.config(n_layers=1, moe_every=1, noisy_gate_policy="Jitter", use_rts=True, checkpoint=mode)
        model = ts.bind(ts.ted_model(cfg, ts.serial_model(cfg).state_dict(), ted.layout, dist.get_rank()), ted)
        model(ts.shards(ted.layout)[ted.data_rank]).backward()
        grads[mode] = {n: p.grad for n, p in model.named_parameters()}
    for mode in ("torch", "torch-reentrant", "deepspeed"):
        for n, g in grads[mode].items():
            assert torch.equal(g, grads["none"][n]), (mode, n)


def test_noisy_gate_is_replayed_in_the_recompute(world):
    world.run(_noisy_replay)


def test_capacity_padded_to_tensor_parallel(world):
    """C = ceil(32 tokens / 4 experts x 1.125) = 9 is not divisible by G_tensor 2: the buffer is
    padded to 10 slots (the tenth stays empty), DTD splits it, DTD on / off stay bit-identical and
    the ledger carries 10 slots per expert (the old code refused this capacity)."""
    world.run(_variants, 2, 4, ["none", "torch"], False, 1.125, 10)


# ---- megatron-core's tensor-parallel attention next to TEDMoE -------------------------------
def _megatron_attention(T, P):
    """Attention QKV / output projection are megatron-core ``ColumnParallelLinear`` /
    ``RowParallelLinear`` (CPU initialization, then the serial weights' shards) on ds_ext's
    tensor group; the MoE blocks are TEDMoE on the same groups. Data-parallel gradient
    averaging as DeepSpeed does it (non-expert over G_data^nonexp, experts over G_data^exp,
    both divided by G_data^nonexp). Loss and every gradient match the serial model."""
    import ted_support as ts
    import torch
    import torch.distributed as dist
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from ds_ext.moe.reference import tensor_shard

    class Megatron(torch.nn.Module):
        """megatron-core layers return (output, bias); the attention wants the output."""

        def __init__(self, layer):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            return self.layer(x)[0]

    rank = dist.get_rank()
    _, ted = ts.context(T, P)
    layout, tp = ted.layout, ted.groups["tensor"]
    cfg = ts.config(n_layers=2, drop_tokens=False)
    batches = ts.shards(layout)
    serial, losses, grads = ts.serial(cfg, batches)
    model = ts.ted_model(cfg, serial.state_dict(), layout, rank)
    mp = ModelParallelConfig(tensor_model_parallel_size=T, use_cpu_initialization=True)
    init = torch.nn.init.zeros_
    d = cfg.d_model
    for i, block in enumerate(model.blocks):
        block.attn.qkv = Megatron(
            ColumnParallelLinear(d, 3 * d, config=mp, init_method=init, bias=True, gather_output=False, tp_group=tp)
        )
        block.attn.proj = Megatron(
            RowParallelLinear(
                d, d, config=mp, init_method=init, bias=True, input_is_parallel=True, skip_bias_add=False, tp_group=tp
            )
        )
        with torch.no_grad():
            for part in ("qkv", "proj"):
                for kind, p in getattr(block.attn, part).layer.named_parameters():
                    p.copy_(tensor_shard(serial.state_dict()[f"blocks.{i}.attn.{part}.{kind}"], p, ted.tensor_rank, T))
    ts.bind(model, ted)
    loss = model(batches[ted.data_rank])
    loss.backward()
    ts.average_gradients(model, ted)
    assert abs(loss.item() - losses[ted.data_rank]) <= 1e-6 * losses[ted.data_rank]
    names = {n: n.replace(".layer.", ".") for n, _ in model.named_parameters()}  # megatron -> serial names
    views = ts.serial_view(model, grads | {n: grads[s] for n, s in names.items() if n != s}, layout, rank)
    named = {n: p.grad for n, p in model.named_parameters()}
    return ts.assert_close_to_serial(named, views), sum(n != s for n, s in names.items())


def test_megatron_core_attention_next_to_tedmoe(world):
    for n, megatron_params in world.run(_megatron_attention, 2, 2):
        assert megatron_params == 8 and n >= 25


# ---- the layer alone, with DeepSpeed's residual MoE --------------------------------------------
def _residual_reference(W, x, gen):
    """DeepSpeed's residual MoE (``MoE(use_residual=True)``) in plain torch on ``x`` [S, H]: the
    MoE output (tests/moe_reference.py, every expert whole) and the MLP mixed by
    softmax(coefficient(x))."""
    import moe_reference as ref
    import torch
    import torch.nn.functional as F

    pre = "deepspeed_moe.experts.deepspeed_experts"
    experts = [
        ref.Expert(W[f"{pre}.{e}.0.weight"], W[f"{pre}.{e}.0.bias"], W[f"{pre}.{e}.2.weight"], W[f"{pre}.{e}.2.bias"])
        for e in range(4)
    ]
    spec = ref.GateSpec(num_experts=4, k=2, capacity_factor=2.0, min_capacity=0)
    out, routing = ref.moe(x, W["deepspeed_moe.gate.wg.weight"], experts, spec, gen)
    mlp = ref.Expert(W["mlp.0.weight"], W["mlp.0.bias"], W["mlp.2.weight"], W["mlp.2.bias"])
    coef = torch.softmax(F.linear(x, W["coefficient.weight"], W["coefficient.bias"]), dim=-1)
    return out * coef[..., 0:1] + mlp(x) * coef[..., 1:], routing.l_aux, routing.exp_counts


def _residual_layer(T, P):
    """TEDMoE(use_residual=True, k=2) as a drop-in layer: output and every gradient equal the
    plain-torch residual MoE holding all experts (serial), each data shard run in turn."""
    import moe_reference as ref
    import ted_support as ts
    import torch
    import torch.distributed as dist
    from torch import nn

    from ds_ext.moe import TEDMoE
    from ds_ext.moe.reference import local_expert_state

    shapes = {
        "deepspeed_moe.gate.wg.weight": (4, 16),
        "mlp.0.weight": (32, 16),
        "mlp.0.bias": (32,),
        "mlp.2.weight": (16, 32),
        "mlp.2.bias": (16,),
        "coefficient.weight": (2, 16),
        "coefficient.bias": (2,),
    }
    for e in range(4):
        shapes |= {
            f"deepspeed_moe.experts.deepspeed_experts.{e}.{k}": shapes[f"mlp.{k}"]
            for k in ("0.weight", "0.bias", "2.weight", "2.bias")
        }
    g = torch.Generator().manual_seed(0)
    W = {n: (0.3 * torch.randn(shape, generator=g)).requires_grad_() for n, shape in shapes.items()}  # distinct experts
    _, ted = ts.context(T, P)
    D = ted.layout.nonexp_data
    xs = torch.randn(D, 24, 16, generator=torch.Generator().manual_seed(1))
    outs = [_residual_reference(W, x, ref.generator(0, d)) for d, x in enumerate(xs)]
    torch.stack([o.sum() + aux for o, aux, _ in outs]).mean().backward()
    model = TEDMoE(
        16,
        nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)),
        num_experts=4,
        ep_size=P,
        k=2,
        capacity_factor=2.0,
        min_capacity=0,
        use_residual=True,
        top2_2nd_expert_sampling=False,
        enable_expert_tensor_parallelism=True,
    )
    model.load_state_dict(local_expert_state({n: w.detach() for n, w in W.items()}, ted.expert_rank, 4 // P))
    ts.bind(model, ted)
    out, aux, counts = model(xs[ted.data_rank])
    (out.sum() + aux).backward()
    ts.average_gradients(model, ted)
    torch.testing.assert_close(out, outs[ted.data_rank][0], rtol=1e-5, atol=1e-5)
    assert torch.equal(counts, outs[ted.data_rank][2])
    named = {n: p.grad for n, p in model.named_parameters()}
    grads = {n: w.grad for n, w in W.items()}
    return ts.assert_close_to_serial(named, ts.serial_view(model, grads, ted.layout, dist.get_rank()))


def test_residual_moe_layer_matches_serial(world):
    assert all(n == 15 for n in world.run(_residual_layer, 2, 2))  # gate, 2 experts x 4, mlp x 4, coefficient x 2
