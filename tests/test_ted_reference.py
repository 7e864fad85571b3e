"""TEDMoE on 4 gloo ranks against the independent reference (tests/moe_reference.py: GShard's
dense einsum layer, written apart from ds_ext.moe), with different token counts on every data
shard.

For every (G_tensor, G_expert, G_data^exp) with product 4 and four gate modes (top-1 dropping
with random token selection and RSample noise, top-1 dropless with jitter, top-2 dropping with
second-expert sampling and jitter, top-3 dropping by probability), each with DTD off, DTD on,
and DTD on under activation checkpointing with CAC:

* no rank hangs although the shards hold 20, 26, 32, 38 tokens (the capacity is agreed over
  the expert group and the buffer padded to a multiple of G_tensor);
* every rank's output, l_aux and expert counts equal the reference on its shard, with the
  capacity the reference computes for the shards of that expert group;
* every gradient, after DeepSpeed's data-parallel averaging, equals the reference gradient of
  the mean shard loss (expert weights sliced by hand for the tensor rank);
* the routing (expert and slot of every route) is identical on the ranks of a tensor group,
  and the gates of different data shards draw different noise.

The same with the experts kept whole on every tensor rank (DeepSpeed's
``enable_expert_tensor_parallelism=False``) at G_tensor 2 and 4, each tensor rank's copy built
different (binding must replicate tensor rank 0's).
"""

import os
from pathlib import Path

import pytest

WORLD_SIZE = 4
CLIENT = Path(
    os.environ.get("DS_EXT_CLIENTS") or Path(__file__).resolve().parents[1].parent / "shared" / "clients",
    "megatron-deepspeed",
)
LAYOUTS = [(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)]
H, FFN, E = 16, 32, 4
MODES = {
    "top1-drop-rts-rsample": dict(k=1, capacity_factor=1.0, use_rts=True, noisy_gate_policy="RSample"),
    "top1-dropless-jitter": dict(k=1, drop_tokens=False, noisy_gate_policy="Jitter"),
    "top2-drop-sampling-jitter": dict(
        k=2, capacity_factor=1.0, top2_2nd_expert_sampling=True, noisy_gate_policy="Jitter"
    ),
    "top3-drop-probs": dict(k=3, capacity_factor=0.8),
}


def tokens(d):
    return 20 + 6 * d


def _weights():
    import torch

    g = torch.Generator().manual_seed(5)
    w = lambda *s: 0.3 * torch.randn(*s, generator=g)  # noqa: E731
    return {"wg": w(E, H), "w1": w(E, FFN, H), "b1": w(E, FFN), "w2": w(E, H, FFN), "b2": w(E, H)}


def _shard(d):
    import torch

    g = torch.Generator().manual_seed(100 + d)
    return torch.randn(tokens(d), H, generator=g), torch.randn(tokens(d), H, generator=g)


def _reference(mode, W, seeds, P):
    """Outputs, l_aux, counts of every shard and the gradients of the mean shard loss."""
    import moe_reference as ref

    spec = ref.GateSpec(num_experts=E, min_capacity=0, **MODES[mode])
    D = len(seeds)
    leaves = {k: v.clone().requires_grad_() for k, v in W.items()}
    experts = [ref.Expert(leaves["w1"][e], leaves["b1"][e], leaves["w2"][e], leaves["b2"][e]) for e in range(E)]
    local = [ref.gate(_shard(d)[0], W["wg"], spec, ref.generator(*seeds[d])).local_capacity for d in range(D)]
    outs, total = [], 0
    for d in range(D):
        group = [d - d % P + j for j in range(P)]  # the shards of d's expert group
        x, w = _shard(d)
        agreed = max(local[j] for j in group)
        out, routing = ref.moe(x, leaves["wg"], experts, spec, ref.generator(*seeds[d]), lambda c: agreed)
        total = total + ((out * w).sum() + routing.l_aux) / D
        outs.append((out.detach(), routing.l_aux.detach(), routing.exp_counts))
    total.backward()
    return outs, {k: v.grad for k, v in leaves.items()}


def _fc(expert):
    """(fc1, fc2) of an ``nn.Sequential`` expert or of Megatron-DeepSpeed's ``ParallelMLP``."""
    return (
        (expert[0], expert[2])
        if isinstance(expert, __import__("torch").nn.Sequential)
        else (expert.dense_h_to_4h, expert.dense_4h_to_h)
    )


def _ted_layer(mode, W, ted, P, etp=True, megatron=None):
    """The layer with the weights ``W``; ``megatron``: the client's ParallelMLP experts, built
    from this config (already split over Megatron's tensor group when ``etp``)."""
    import ted_support as ts
    import torch
    from torch import nn

    from ds_ext.moe import TEDMoE

    if megatron is None:
        expert, T = nn.Sequential(nn.Linear(H, FFN), nn.GELU(), nn.Linear(FFN, H)), 1  # TED slices it
    else:
        from megatron.model.transformer import ParallelMLP

        expert, T = ParallelMLP(megatron, moe=True, enable_expert_tensor_parallelism=etp), ted.layout.tensor
    layer = TEDMoE(
        H, expert, num_experts=E, ep_size=P, min_capacity=0, enable_expert_tensor_parallelism=etp, **MODES[mode]
    )
    k, t = E // P, ted.tensor_rank
    F = FFN // T if etp else FFN
    t = t if etp and T > 1 else 0
    with torch.no_grad():
        layer.gate.wg.weight.copy_(W["wg"])
        for i, expert in enumerate(layer.local_experts):
            e = ted.expert_rank * k + i
            fc1, fc2 = _fc(expert)
            fc1.weight.copy_(W["w1"][e][t * F : (t + 1) * F])
            fc1.bias.copy_(W["b1"][e][t * F : (t + 1) * F])
            fc2.weight.copy_(W["w2"][e][:, t * F : (t + 1) * F])
            fc2.bias.copy_(W["b2"][e])
            if not etp and ted.tensor_rank > 0:  # whole copies start apart, as Megatron-DeepSpeed initializes them
                for p in expert.parameters():
                    p.add_(1.0)
    return ts.bind(layer, ted)  # binding replicates tensor rank 0's whole copies


def _average_gradients(layer, ted):
    """DeepSpeed's data-parallel averaging: gradients summed over the non-expert data group, or
    for experts over the group the layer registers as DeepSpeed's expert data group, then
    divided by G_data^nonexp."""
    import torch.distributed as dist

    for p in layer.parameters():
        expert = getattr(p, "allreduce", True) is False
        dist.all_reduce(p.grad, group=ted.groups[layer.expert_data_group_kind if expert else "data"])
        p.grad /= ted.layout.nonexp_data


def _run(T, P, etp=True, modes=tuple(MODES), megatron=False):
    import dataclasses

    import ted_support as ts
    import torch
    import torch.utils.checkpoint as ckpt

    _, base = ts.context(T, P)
    config = _megatron(T) if megatron else None
    D = base.layout.nonexp_data
    d, t = base.data_rank, base.tensor_rank
    W = _weights()
    x, w = _shard(d)
    F = FFN // T if etp else FFN
    t = t if etp else 0
    checked = 0
    for mode in modes:
        runs = {}
        variants = [("plain", False, False)] * etp + [
            ("dtd", True, False),
            ("dtd+cac", True, True),
        ]  # whole: DTD needed
        for name, dtd, checkpointed in variants:
            ted = dataclasses.replace(base, dtd=dtd, cac=True)
            layer = _ted_layer(mode, W, ted, P, etp, config)
            seen = []
            layer.gate.register_forward_hook(lambda m, i, o: seen.append(o.decision) and None)
            seeds = [None] * D
            for dd, seed, draws in _all_objects((d, layer.gate.seed, layer.gate.draws)):
                seeds[dd] = (seed, draws)
            if checkpointed:
                out, aux, counts = ckpt.checkpoint(layer, x, use_reentrant=False)
            else:
                out, aux, counts = layer(x)
            ((out * w).sum() + aux).backward()
            _average_gradients(layer, ted)
            want, grads = _reference(mode, W, seeds, P)
            torch.testing.assert_close(out, want[d][0], rtol=1e-5, atol=1e-5, msg=f"{mode} {name} output")
            torch.testing.assert_close(aux, want[d][1], rtol=1e-5, atol=1e-7, msg=f"{mode} {name} l_aux")
            assert torch.equal(counts, want[d][2]), (mode, name, counts, want[d][2])
            got = {"wg": layer.gate.wg.weight.grad}
            views = {"wg": grads["wg"]}
            for i, expert in enumerate(layer.local_experts):
                e = ted.expert_rank * (E // P) + i
                fc1, fc2 = _fc(expert)
                got |= {
                    f"w1.{i}": fc1.weight.grad,
                    f"b1.{i}": fc1.bias.grad,
                    f"w2.{i}": fc2.weight.grad,
                    f"b2.{i}": fc2.bias.grad,
                }
                views |= {
                    f"w1.{i}": grads["w1"][e][t * F : (t + 1) * F],
                    f"b1.{i}": grads["b1"][e][t * F : (t + 1) * F],
                    f"w2.{i}": grads["w2"][e][:, t * F : (t + 1) * F],
                    f"b2.{i}": grads["b2"][e],
                }
            ts.assert_close_to_serial(got, views)
            decision = seen[0]
            route = torch.stack([decision.indices, decision.locations])
            assert _equal_over(ted.groups["tensor"], route), (mode, name, "routing differs across the tensor group")
            assert decision.capacity % T == 0
            assert len({s for s, _ in seeds}) == D  # every data shard draws its own noise
            runs[name] = (out.detach(), {k: v.clone() for k, v in got.items()})
            checked += len(got)
        first = variants[0][0]
        for name, _, _ in variants[1:]:  # DTD and CAC change communication, not one bit of the result
            assert torch.equal(runs[name][0], runs[first][0]), (mode, name)
            assert all(torch.equal(runs[name][1][k], v) for k, v in runs[first][1].items()), (mode, name)
    return checked


def _all_objects(obj):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _equal_over(group, tensor):
    import torch
    import torch.distributed as dist

    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return all(torch.equal(o, out[0]) for o in out)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: "TP{}xEP{}xDP{}".format(*lay))
def test_uneven_tokens_match_independent_reference(world, layout):
    T, P, _ = layout
    for n in world.run(_run, T, P, timeout=240):
        assert n >= 3 * len(MODES) * (1 + 4 * E // P)


@pytest.mark.parametrize("layout", [(2, 2, 1), (4, 1, 1)], ids=lambda lay: "TP{}xEP{}xDP{}".format(*lay))
def test_whole_experts_beside_tensor_parallelism(world, layout):
    """``enable_expert_tensor_parallelism=False`` (Megatron-DeepSpeed's default): experts whole on
    every tensor rank, each running its share of the slots, gradients reduced over the tensor x
    expert-data ranks; the old code refused this mode at tensor_parallel > 1."""
    T, P, _ = layout
    for n in world.run(_run, T, P, False, timeout=240):
        assert n >= 2 * len(MODES) * (1 + 4 * E // P)


# ---- Megatron-DeepSpeed's own recompute with CAC ------------------------------------------------
def _megatron_recompute(T, P, etp):
    """One TED layer (top-2, jittered, tokens dropped) checkpointed by Megatron-DeepSpeed's
    ``tensor_parallel.checkpoint`` (its CheckpointFunction, the recompute of --checkpoint-activations):
    gradients bit-identical to the run without checkpointing; CAC saves the recompute's collectives."""
    import dataclasses
    import sys

    import ted_support as ts
    import torch

    sys.path.insert(0, str(CLIENT))
    from megatron.core.tensor_parallel.random import CheckpointFunction, checkpoint

    assert Path(sys.modules[CheckpointFunction.__module__].__file__).is_relative_to(CLIENT)
    runtime, base = ts.context(T, P)
    x, w = _shard(base.data_rank)
    runs = {}
    for name, cac, checkpointed in (("none", True, False), ("megatron", False, True), ("megatron+cac", True, True)):
        layer = _ted_layer("top2-drop-sampling-jitter", _weights(), dataclasses.replace(base, cac=cac), P, etp)
        xx = x.clone().requires_grad_()
        run = lambda t: layer(t)[:2]  # noqa: E731 - (output, l_aux), what a transformer layer passes on
        runtime.ledger.reset()
        out, aux = checkpoint(run, False, xx) if checkpointed else run(xx)
        ((out * w).sum() + aux).backward()
        calls = {}
        for (_, op, _), n in runtime.ledger.current.calls.items():
            calls[op] = calls.get(op, 0) + n
        runs[name] = ([xx.grad] + [p.grad for p in layer.parameters()], calls)
    for name in ("megatron", "megatron+cac"):
        assert all(torch.equal(a, b) for a, b in zip(runs[name][0], runs["none"][0], strict=True)), name
    return {name: calls for name, (_, calls) in runs.items()}


@pytest.mark.skipif(not CLIENT.is_dir(), reason=f"Megatron-DeepSpeed client not found at {CLIENT}")
@pytest.mark.parametrize("etp", [True, False], ids=["experts-split", "experts-whole"])
def test_megatron_checkpoint_function_with_cac(world, etp):
    """The old code refused Megatron's recompute ('its first forward did not run inside
    torch.utils.checkpoint / deepspeed.checkpointing')."""
    calls = world.run(_megatron_recompute, 2, 2, etp)[0]
    agree = 1  # the capacity agreement (never recomputed)
    reduce = 2 if etp else 0  # split experts: ❻ (forward g) and its f in backward; whole experts: none
    gather = 2 if etp else 1  # DTD around both all-to-alls; whole experts: after the second only
    assert calls["none"] == {"all_to_all": 4, "all_gather": 2 * gather, "all_reduce": reduce + agree}
    assert calls["megatron"] == {"all_to_all": 6, "all_gather": 3 * gather, "all_reduce": reduce + reduce // 2 + agree}
    assert calls["megatron+cac"] == calls["none"]


# ---- Megatron-DeepSpeed's ParallelMLP experts -------------------------------------------------
def _megatron(T):
    """The client's argument namespace and tensor-parallel groups (its parallel_state, whose tensor
    groups of T consecutive ranks are TED's), and the TransformerConfig its ParallelMLP reads."""
    import sys
    from unittest import mock

    sys.path.insert(0, str(CLIENT))
    from megatron import global_vars
    from megatron.arguments import parse_args
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    with mock.patch.object(sys, "argv", ["pretrain_gpt.py"]):
        args = parse_args()  # the client's own defaults (GeLU MLP with biases, no fusion on CPU)
    args.bias_gelu_fusion = False
    global_vars.set_args(args)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(T)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)  # what pretrain_gpt.py's initialize_megatron does
    return TransformerConfig(
        num_layers=1, hidden_size=H, ffn_hidden_size=FFN, num_attention_heads=1, add_bias_linear=True
    )


@pytest.mark.skipif(not CLIENT.is_dir(), reason=f"Megatron-DeepSpeed client not found at {CLIENT}")
@pytest.mark.parametrize("etp", [True, False], ids=["expert-tensor-parallel", "experts-whole"])
def test_megatron_parallel_mlp_experts_at_tp2(world, etp):
    """Megatron-DeepSpeed's experts (``ParallelMLP(config, moe=True, enable_expert_tensor_parallelism=...)``)
    at TP 2, EP 2 in both of its modes against the independent reference, uneven tokens; the old
    code refused both ('the expert must be nn.Sequential(...)' / 'enable_expert_tensor_parallelism=False')."""
    for n in world.run(_run, 2, 2, etp, ("top1-drop-rts-rsample", "top2-drop-sampling-jitter"), True, timeout=240):
        assert n >= 2 * 2 * (1 + 4 * E // 2)
