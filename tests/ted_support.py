"""Helpers shared by the TED test modules (run on the spawned ranks): a tiny GPT-MoE, its data
shards, the serial reference, and TED models built from the serial initialization."""

from __future__ import annotations

import dataclasses

TOPOLOGY = {"preset": "frontier", "sizes": {"gpu": 2}, "emulate": True}  # 2 nodes x 2 GPUs x 2 GCDs
MICRO, SEQ = 2, 16
_CORPUS = []


def corpus():
    from ds_ext.data import ByteCorpus

    if not _CORPUS:
        _CORPUS.append(ByteCorpus(max_bytes=300_000))
    return _CORPUS[0]


def config(**kw):
    from ds_ext.models.gpt_moe import GPTMoEConfig

    base = dict(seq_len=SEQ, d_model=32, n_layers=2, n_heads=4, num_experts=4, min_capacity=0, use_rts=False,
                top2_2nd_expert_sampling=False)
    return GPTMoEConfig(**{**base, **kw})


def shards(layout, step=0, micro=MICRO):
    """The global batch of ``step`` as one micro-batch per non-expert data rank."""
    return [corpus().micro_batch(step, 0, d, layout.nonexp_data, micro, 1, SEQ) for d in range(layout.nonexp_data)]


def serial_model(cfg, seed=0):
    import torch

    from ds_ext.models.gpt_moe import GPTMoE

    torch.manual_seed(seed)
    return GPTMoE(cfg)


def serial_loss(model, batches):
    """The data-parallel objective: every shard through the whole model, losses averaged."""
    import torch

    losses = [model(b) for b in batches]
    return torch.stack(losses).mean(), [x.item() for x in losses]


def serial(cfg, batches, seed=0):
    model = serial_model(cfg, seed)
    loss, losses = serial_loss(model, batches)
    loss.backward()
    return model, losses, {n: p.grad for n, p in model.named_parameters()}


def ted_model(cfg, serial_state, layout, rank):
    """The serial initialization, built for this rank's expert rank (``ep_size = G_expert``)."""
    from ds_ext.models.gpt_moe import GPTMoE
    from ds_ext.moe.reference import local_expert_state

    model = GPTMoE(dataclasses.replace(cfg, ep_size=layout.expert))
    k = cfg.num_experts // layout.expert
    model.load_state_dict(local_expert_state(serial_state, layout.coords(rank)["expert"], k))
    return model


def bind(model, ted):
    """Bind a model's TED layers to a context by hand (what the ted plugin does)."""
    for i, m in enumerate(m for m in model.modules() if hasattr(m, "ted_bind")):
        m.ted_bind(ted, i)
    return model


def context(T, P, **kw):
    """A runtime on the emulated topology and a TED context of (T, P)."""
    import torch.distributed as dist

    from ds_ext import config as cfgmod
    from ds_ext.parallel import TEDLayout
    from ds_ext.moe import TEDContext
    from ds_ext.runtime import Runtime

    runtime = Runtime.create(cfgmod.parse({"topology": TOPOLOGY}))
    return runtime, TEDContext.create(TEDLayout.build(dist.get_world_size(), T, P), runtime.comm, **kw)


def serial_view(model, serial_tensors, layout, rank):
    """{name: the part of the serial tensor this rank's parameter ``name`` holds}."""
    from ds_ext.moe.reference import serial_name, tensor_shard

    c = layout.coords(rank)
    k = next(m.num_local_experts for m in model.modules() if hasattr(m, "num_local_experts"))
    return {name: tensor_shard(serial_tensors[serial_name(name, c["expert"], k)], p, c["tensor"], layout.tensor)
            for name, p in model.named_parameters()}


def assert_close_to_serial(named, views, rtol=1e-5):
    """Every tensor within rtol of its serial view (atol rtol x the view's max); returns the count."""
    import torch

    for name, t in named.items():
        ref = views[name]
        torch.testing.assert_close(t, ref, rtol=rtol, atol=rtol * ref.abs().max().item(), msg=name)
    return len(named)


def ds_config(T, P, stage=0, ted=None, plugins=None, **extra):
    """A ds_config with ``ds_ext.ted`` (T, P) (+ ``ted`` keys), other ``plugins`` sections and
    top-level DeepSpeed keys ``extra`` (``gradient_clipping`` 0 unless given: DeepSpeed's default is 1.0)."""
    block = {"topology": TOPOLOGY, "ted": {"enabled": True, "tensor_parallel": T, "expert_parallel": P, **(ted or {})},
             **(plugins or {})}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
            "zero_optimization": {"stage": stage}, "gradient_clipping": 0.0, "ds_ext": block, **extra}


def average_gradients(model, ted):
    """DeepSpeed's data-parallel averaging done by hand: non-expert gradients summed over
    G_data^nonexp, expert gradients over G_data^exp, both divided by G_data^nonexp."""
    import torch.distributed as dist

    for p in model.parameters():
        expert = getattr(p, "allreduce", True) is False
        dist.all_reduce(p.grad, group=ted.groups["expert_data" if expert else "data"])
        p.grad /= ted.layout.nonexp_data
