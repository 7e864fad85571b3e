"""Whole experts beside tensor parallelism stay one replicated parameter through training.

Megatron-DeepSpeed's default experts (``ParallelMLP(moe=True)``, ``--enable-expert-tensor-parallelism``
off) are kept whole on every tensor rank, each copy drawn from that rank's own RNG. TED binds them
as one parameter: tensor rank 0's copy is broadcast over the tensor group
(``TEDMoE._replicate_whole``) and DeepSpeed's engine reduces their gradients over
``expert_replicas`` (tensor x expert-data ranks). The copies are made to start apart on tensor
rank 1 (+1 on every expert parameter: the client's per-rank draws coincide on CPU, not on GPU).
On 4 gloo ranks (TP 2, EP 2) through ``ds_ext.initialize`` with AdamW, every expert parameter,
all-gathered over the tensor group, is bit-identical on both tensor ranks after binding and after
each of several steps. DeepSpeed's engine also broadcasts them (``_broadcast_model``, over the
group TED registers as their expert data group, ``expert_replicas``); TEDMoE's broadcast alone
suffices. Without both (the control: DeepSpeed's own MoE broadcasts neither over the tensor
group) the copies start apart and stay apart, so the check can fail.
"""

from pathlib import Path

import pytest
from test_ted_reference import CLIENT, E, H, _megatron, _shard

WORLD_SIZE = 4
T, P, STEPS = 2, 2, 4


def _replicas(skip=()):
    """{step: [names of expert parameters whose copies differ over the tensor group]}, step -1 =
    right after ``ds_ext.initialize``; ``skip``: broadcasts left out, ``ds_ext`` (TEDMoE's
    ``_replicate_whole`` at binding) and ``engine`` (DeepSpeed's ``_broadcast_model``, which
    broadcasts expert parameters over the group registered as their expert data group)."""
    import contextlib
    import sys
    from unittest import mock

    import ted_support as ts
    import torch
    import torch.distributed as dist
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from torch import nn

    import ds_ext
    from ds_ext.moe import TEDMoE

    config = _megatron(T)
    from megatron.model.transformer import ParallelMLP

    assert Path(sys.modules[ParallelMLP.__module__].__file__).is_relative_to(CLIENT)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = TEDMoE(
                H,
                ParallelMLP(config, moe=True, enable_expert_tensor_parallelism=False),
                num_experts=E,
                ep_size=P,
                min_capacity=0,
                k=1,
                capacity_factor=1.0,
                use_rts=True,
                noisy_gate_policy="RSample",
                enable_expert_tensor_parallelism=False,
            )

        def forward(self, x, w):
            out, aux, _ = self.moe(x)
            return (out * w).sum() + aux

    model = Model()
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_rank() > 0:  # the copies start apart, as the client's
        with torch.no_grad():  # per-tensor-rank RNG draws them on GPU (on CPU its draws coincide)
            for p in model.moe.parameters():
                if getattr(p, "allreduce", True) is False:
                    p.add_(1.0)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "dense", "lr": 1e-2, "weight_decay": 0.01}
    )
    optimizer = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.01)
    from deepspeed.runtime.engine import DeepSpeedEngine

    with contextlib.ExitStack() as patches:
        if "ds_ext" in skip:
            patches.enter_context(mock.patch.object(TEDMoE, "_replicate_whole", lambda self, ted: None))
        if "engine" in skip:
            patches.enter_context(mock.patch.object(DeepSpeedEngine, "_broadcast_model", lambda self: None))
        engine, *_ = ds_ext.initialize(model=model, optimizer=optimizer, config=ts.ds_config(T, P))
    ted = next(p for p in engine.ds_ext.plugins if p.name == "ted").ted
    layer = engine.module.moe
    assert layer.expert_data_group_kind == "expert_replicas" and not layer.sliced(T)
    experts = {n: p for n, p in layer.named_parameters() if getattr(p, "allreduce", True) is False}
    assert len(experts) == 4 * E // P  # (weight, bias) x (dense_h_to_4h, dense_4h_to_h) per local expert

    def differing():
        out = []
        for name, p in experts.items():
            copies = [torch.empty_like(p.data) for _ in range(T)]
            dist.all_gather(copies, p.data.contiguous(), group=ted.groups["tensor"])
            if not all(torch.equal(c, copies[0]) for c in copies):
                out.append(name)
        return out

    result = {-1: differing()}
    for step in range(STEPS):
        before = {n: p.detach().clone() for n, p in experts.items()}
        x, w = _shard(ted.data_rank)
        g = torch.Generator().manual_seed(1000 * step + ted.data_rank)
        x = x + 0.1 * torch.randn(x.shape, generator=g)  # new tokens every step
        loss = engine(x, w)
        engine.backward(loss)
        engine.step()
        assert all(not torch.equal(before[n], p) for n, p in experts.items()), "the experts did not train"
        result[step] = differing()
    return result


@pytest.mark.skipif(not CLIENT.is_dir(), reason=f"Megatron-DeepSpeed client not found at {CLIENT}")
@pytest.mark.parametrize("skip", [(), ("engine",)], ids=["ted", "ted-without-engine-broadcast"])
def test_whole_expert_replicas_stay_identical_over_tensor_ranks(world, skip):
    """TED at TP 2, EP 2 with the client's whole ParallelMLP experts: every expert parameter is
    bit-identical over the tensor group after binding and after each of 4 AdamW steps, also with
    DeepSpeed's own model broadcast left out (TEDMoE's broadcast at binding suffices)."""
    for rank, result in enumerate(world.run(_replicas, skip, timeout=240)):
        assert result == {s: [] for s in range(-1, STEPS)}, (rank, result)


@pytest.mark.skipif(not CLIENT.is_dir(), reason=f"Megatron-DeepSpeed client not found at {CLIENT}")
def test_without_the_broadcasts_whole_expert_replicas_differ(world):
    """The control, DeepSpeed-MoE's situation (no broadcast across the tensor group): copies that
    start apart stay apart, every expert parameter differs over the tensor group after binding
    and after every step (their gradients are equal, so are the updates, not the weights)."""
    for rank, result in enumerate(world.run(_replicas, ("ds_ext", "engine"), timeout=240)):
        assert all(len(names) == 4 * E // P for names in result.values()), (rank, result)
