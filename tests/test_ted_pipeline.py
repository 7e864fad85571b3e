"""TED on DeepSpeed's PipelineEngine (``ds_ext.ted`` with a ``deepspeed.pipe.PipelineModule``).

8 gloo ranks as Frontier in miniature (2 nodes x 2 MI250X x 2 GCDs), 2 pipeline stages of 4 ranks,
expert parallel 2 and expert-data 2 in each stage. The model is a GPT-like PipelineModule whose
blocks are MoE layers (4 experts, top-1, dropless) passing ``(hidden, aggregated aux loss)`` across
the stage boundary, as Megatron-DeepSpeed's ``GPTModelPipe`` with ``--num-experts`` does. The
reference is DeepSpeed's own MoE on the same PipelineEngine, initial weights and batches (its own
expert groups and all-to-alls; it shares no code with TED): the losses and every parameter after
the last step equal it to fp32 rounding, at ZeRO 0 and at ZeRO 1 with gradient clipping active (the
global norm over both stages), and TED's own stage-0 clipping norm equals DeepSpeed's ZeRO-1 norm.
"""

import pytest

WORLD_SIZE = 8
TOPOLOGY = {"preset": "frontier", "sizes": {"gpu": 2}, "emulate": True}
VOCAB, HIDDEN, SEQ, MICRO, ACCUM, STEPS, EXPERTS, EP = 64, 32, 8, 2, 2, 4, 4, 2
AUX = 0.01


def _pipe(impl, tensor=1):
    """Embedding, 4 MoE blocks, norm + head over 2 stages; ``impl`` 'ted' (TEDMoE) or 'deepspeed';
    ``tensor`` > 1: DeepSpeed's pipe x data x model topology of that model degree."""
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule
    from torch import nn

    from ds_ext.moe import TEDMoE

    def moe():
        from deepspeed.moe.layer import MoE

        expert = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))
        cls = TEDMoE if impl == "ted" else MoE
        return cls(HIDDEN, expert, num_experts=EXPERTS, ep_size=EP, k=1, drop_tokens=False, use_rts=False)

    class Block(nn.Module):
        def __init__(self, first):
            super().__init__()
            self.first, self.norm, self.moe = first, nn.LayerNorm(HIDDEN), moe()

        def forward(self, inputs):
            x, aux = (inputs, None) if self.first else inputs
            y, l_aux, _ = self.moe(self.norm(x))
            l_aux = l_aux.reshape(1)
            return x + y, l_aux if aux is None else aux + l_aux

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.out = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB)

        def forward(self, inputs):
            x, aux = inputs
            return self.out(self.norm(x)), aux

    def loss_fn(outputs, labels):
        logits, aux = outputs
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)) + AUX * aux.sum()

    torch.manual_seed(1234)
    layers = [
        LayerSpec(nn.Embedding, VOCAB, HIDDEN),
        LayerSpec(Block, True),
        *[LayerSpec(Block, False) for _ in range(3)],
        LayerSpec(Head),
    ]
    if tensor == 1:
        return PipelineModule(layers, num_stages=2, loss_fn=loss_fn, partition_method="uniform")
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    topology = PipeModelDataParallelTopology(num_pp=2, num_mp=tensor, num_dp=WORLD_SIZE // (2 * tensor))
    return PipelineModule(layers, topology=topology, loss_fn=loss_fn, partition_method="uniform")


def _batches(step, data_rank):
    import torch

    for m in range(ACCUM):
        g = torch.Generator().manual_seed(1000 * step + 10 * data_rank + m)
        tokens = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g)
        yield tokens[:, :-1], tokens[:, 1:]


def _config(ted, stage, clip):
    block = {"topology": TOPOLOGY}
    if ted:
        block["ted"] = {"enabled": True, "tensor_parallel": 1, "expert_parallel": EP}
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "steps_per_print": 10**6,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": clip,
        "zero_allow_untested_optimizer": True,  # SGD
        "ds_ext": block,
    }


def _train(impl, stage, clip, state=None):
    import torch
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    import ds_ext

    model = _pipe(impl)
    if state is not None:
        model.load_state_dict(state)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "dense", "lr": 3e-3, "weight_decay": 0.01}
    )
    # clipped: SGD, whose step scales with the clip coefficient (Adam's would all but cancel it)
    optimizer = torch.optim.SGD(groups, lr=0.5, momentum=0.9) if clip else torch.optim.AdamW(groups)
    engine, *_ = ds_ext.initialize(model=model, optimizer=optimizer, config=_config(impl == "ted", stage, clip))
    data_rank = engine.grid.get_data_parallel_rank()
    losses = [float(engine.train_batch(iter(list(_batches(s, data_rank))))) for s in range(STEPS)]
    norm = engine.get_global_grad_norm()
    final = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    engine.destroy()
    return initial, losses, None if norm is None else float(norm), final


def _ted_vs_deepspeed(ds_stage, ted_stage, clip):
    from ds_ext.integration import ds_engine

    ds_engine.init_distributed()
    initial, ds_losses, ds_norm, ds_final = _train("deepspeed", ds_stage, clip)
    _, ted_losses, ted_norm, ted_final = _train("ted", ted_stage, clip, initial)
    return initial, (ds_losses, ds_norm, ds_final), (ted_losses, ted_norm, ted_final)


@pytest.mark.parametrize(
    "ds_stage,ted_stage,clip",
    [(0, 0, 0.0), (1, 1, 0.05), (1, 0, 0.05)],
    ids=["zero0", "zero1-clipped", "zero0-clipped-by-ted"],
)
def test_ted_equals_deepspeed_moe_on_the_pipeline_engine(world, ds_stage, ted_stage, clip):
    """ZeRO 0 and ZeRO 1 with clipping against DeepSpeed-MoE at the same stage; TED at ZeRO 0 with
    clipping (TED's own global norm: DeepSpeed's stage-0 norm averages per-rank norms once experts
    differ per rank) against DeepSpeed-MoE at ZeRO 1, whose norm counts every expert once."""
    import torch

    for rank, (initial, (ds_losses, ds_norm, ds_final), (ted_losses, ted_norm, ted_final)) in enumerate(
        world.run(_ted_vs_deepspeed, ds_stage, ted_stage, clip)
    ):
        assert len(ds_losses) == STEPS
        for a, b in zip(ds_losses, ted_losses, strict=True):
            assert abs(a - b) <= 1e-6 * abs(a), (rank, ds_losses, ted_losses)
        if clip:
            assert ds_norm > clip and abs(ds_norm - ted_norm) <= 1e-5 * ds_norm, (rank, ds_norm, ted_norm)
        assert set(ds_final) == set(ted_final)
        for name, want in ds_final.items():
            # every parameter trained (experts, gates, norms of both stages) and equal to DeepSpeed-MoE's
            assert not torch.equal(want, initial[name]), (rank, name)
            torch.testing.assert_close(ted_final[name], want, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {name}")


def _refused(pipeline):
    import torch

    import ds_ext
    from ds_ext.errors import DsExtError
    from ds_ext.integration import ds_engine

    ds_engine.init_distributed()
    model = _pipe("ted", tensor=2)
    config = _config(True, 0, 0.0)
    config["ds_ext"]["ted"]["tensor_parallel"] = 2
    if pipeline is not None:
        config["pipeline"] = pipeline
    try:
        ds_ext.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    except DsExtError as err:
        return str(err)


@pytest.mark.parametrize(
    "pipeline,key,default",
    [
        (None, "pipe_partitioned", " (DeepSpeed's default)"),
        ({"pipe_partitioned": False, "grad_partitioned": True}, "grad_partitioned", ""),
    ],
)
def test_pipe_and_grad_partitioning_refused_at_tensor_parallel_2_as_the_client_refuses(world, pipeline, key, default):
    """Megatron-DeepSpeed's GPTModelPipe refuses pipe / grad partitioning for MoE at PP > 1 with TP > 1
    (megatron/model/gpt_model.py); TED refuses them in one line on every rank, before its groups."""
    for msg in world.run(_refused, pipeline):
        assert msg == (
            f"ds_ext.ted: pipeline.{key} true{default} with 2 pipeline stages and tensor_parallel 2: "
            "Megatron-DeepSpeed refuses pipe / grad partitioning for MoE models there; allowed: "
            '"pipeline": {"pipe_partitioned": false, "grad_partitioned": false}'
        )
