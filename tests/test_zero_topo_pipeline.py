"""ZeRO-topo's pipeline form inside DeepSpeed's PipelineEngine (issue 37; ``ds_ext.zero_topo.pipeline``).

8 gloo ranks as Frontier in miniature (2 nodes x 2 MI250X x 2 GCDs). The model is a
``deepspeed.pipe.PipelineModule`` with tied embedding / LM head (``TiedLayerSpec``), trained with
``train_batch`` over 2 micro-batches. The reference is DeepSpeed's own ZeRO-1 on the same
PipelineEngine, model and batches (shares no code with ZeRO-topo): the unquantized pipeline form
must equal it to fp32 rounding with gradient clipping active (so the global norm over stages,
tied weights counted once, is checked too).
"""

import pytest

WORLD_SIZE = 8
TOPOLOGY = {"preset": "frontier", "sizes": {"gpu": 2}, "emulate": True}
VOCAB, HIDDEN, SEQ, MICRO, ACCUM, STEPS = 64, 32, 8, 2, 2, 4
# hierarchical and unquantized: gradients reduce-scattered level by level from the innermost level
UNQUANTIZED = {"preset": "zero_topo", "gradients": {"level": "gcd", "bits": 16, "hops": 1}}


def _pipe(stages):
    """A 6-layer GPT-like PipelineModule over ``stages`` stages, the embedding tied to the head."""
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.fc = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, HIDDEN)

        def forward(self, x):
            return x + torch.tanh(self.fc(self.norm(x)))

    def head(embed, x):
        return x @ embed.weight.t()

    def loss_fn(logits, labels):
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))

    torch.manual_seed(1234)
    layers = [TiedLayerSpec("embed", nn.Embedding, VOCAB, HIDDEN), *[LayerSpec(Block) for _ in range(4)],
              LayerSpec(nn.LayerNorm, HIDDEN), TiedLayerSpec("embed", nn.Embedding, VOCAB, HIDDEN, forward_fn=head)]
    return PipelineModule(layers, num_stages=stages, loss_fn=loss_fn, partition_method="uniform")


def _batches(step, data_rank):
    import torch

    for m in range(ACCUM):
        g = torch.Generator().manual_seed(1000 * step + 10 * data_rank + m)
        tokens = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g)
        yield tokens[:, :-1], tokens[:, 1:]


def _run(stages, zero_topo, extra=None):
    """Losses, global norms and this rank's stage parameters after ``STEPS`` train_batch calls on a
    PipelineEngine of ``stages`` stages: ZeRO-topo (``zero_topo``) or DeepSpeed ZeRO-1 (None)."""
    import torch
    import torch.distributed as dist

    import ds_ext
    from ds_ext.integration import ds_engine

    ds_engine.init_distributed()  # as the clients do before building a PipelineModule (its groups)
    model = _pipe(stages)
    dp = dist.get_world_size() // stages
    cfg = {"train_batch_size": MICRO * ACCUM * dp, "train_micro_batch_size_per_gpu": MICRO,
           "gradient_clipping": 0.05, "zero_optimization": {"stage": 0 if zero_topo else 1},
           "zero_allow_untested_optimizer": True, "steps_per_print": 10**6,
           "ds_ext": {"topology": TOPOLOGY, "comm": {"count_torch_collectives": False}, **(extra or {})}}
    if zero_topo:
        cfg["ds_ext"]["zero_topo"] = {"enabled": True, **zero_topo}
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    engine, *_ = ds_ext.initialize(model=model, optimizer=opt, config=cfg)
    init = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    losses, norms = [], []
    data_rank = engine.grid.get_data_parallel_rank()
    for step in range(STEPS):
        losses.append(float(engine.train_batch(iter(_batches(step, data_rank)))))
        norms.append(float(engine.get_global_grad_norm()))
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    out = {"losses": losses, "norms": norms, "params": params, "rank": dist.get_rank(),
           "still": [n for n, p in params.items() if torch.equal(p, init[n])]}
    if zero_topo:
        plugin = engine.ds_ext.plugin("zero_topo")
        out |= {"describe": plugin.describe(), "banner": engine.ds_ext.banner(),
                "analytic": plugin.analytic_traffic(ACCUM).bytes,
                "measured": {ph: dict(v) for ph, v in engine.ds_ext.ledger.steps[-1].by_phase().items()},
                "padded_bytes": sum(u.U for u in plugin.sharded.all_units) * 4}
    engine.destroy()
    dist.barrier()
    return out


@pytest.mark.parametrize("stages", [1, 2])
def test_unquantized_pipeline_form_equals_deepspeed_zero1_on_the_pipeline_engine(world, stages):
    """PP 1 (data 8, across nodes) and PP 2 (data 4 inside a node): losses, global norms (clipping
    active, tied weights once) and every parameter equal DeepSpeed ZeRO-1 on the same PipelineEngine;
    the ledger equals the analytic model; with PP 1 the inter-node bytes of the gradient
    synchronisation are the floor 2 (M_stage / P)(N - 1)/N (P = 4 of the group's ranks per node)."""
    import torch

    ref = world.run(_run, stages, None)
    ours = world.run(_run, stages, UNQUANTIZED)
    for r, o in zip(ref, ours):
        assert o["losses"] == pytest.approx(r["losses"], rel=1e-6, abs=0)
        assert o["norms"] == pytest.approx(r["norms"], rel=1e-6, abs=0)
        assert r["norms"][0] > 0.05  # the clip is active
        assert o["still"] == [] and r["still"] == []
        for name, p in r["params"].items():
            torch.testing.assert_close(o["params"][name], p, rtol=1e-6, atol=1e-6, msg=name)
        assert set(o["measured"]) == {"step"}  # nothing gathered in forward or backward
        assert o["measured"] == o["analytic"]
        if stages == 1:
            norm = 2 * 8 * (8 - 1) / 8  # the grad-norm all-reduce over the data group
            assert o["measured"]["step"]["node"] == 2 * (o["padded_bytes"] / 4) * (2 - 1) / 2 + norm
    assert "pipeline form" in ours[0]["describe"]
    assert f"pipeline {stages}" in ours[0]["banner"] or stages == 1
