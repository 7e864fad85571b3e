"""Hugging Face models under ZeRO-topo (issue 11, item 4): tiny ``GPTNeoXForCausalLM`` and
``LlamaForCausalLM`` (random init from configs, no download) train with ZeRO-topo (units
found by the decoder-layer class) and the tiled optimizer; fp32, no clipping, 10 steps:
the losses equal plain data parallelism (DeepSpeed stage 0) on the same data.
"""

import pytest

WORLD_SIZE = 4
UNQUANTIZED = {"weights": {"gather_bits": 16}, "gradients": {"bits": 16, "hops": 1}, "secondary": {"bits": 16}}
UNITS = {"gpt-neox": "GPTNeoXLayer", "llama": "LlamaDecoderLayer"}


def _train(kind, zero_topo, steps=10):
    import torch
    import torch.distributed as dist

    import ds_ext
    from ds_ext.data import ByteCorpus
    from ds_ext.models.hf import tiny_causal_lm

    torch.manual_seed(1234)
    model = tiny_causal_lm(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9,
        "ds_ext": {"topology": {"preset": "frontier", "sizes": {"gpu": 1}, "emulate": True}},
    }
    if zero_topo:
        cfg["ds_ext"]["zero_topo"] = {"enabled": True, "preset": "zero_topo", "units": [UNITS[kind]], **UNQUANTIZED}
        cfg["ds_ext"]["tiled_optimizer"] = {"enabled": True, "tile_size": 5000}
    engine, *_ = ds_ext.initialize(model=model, optimizer=opt, config=cfg)
    corpus = ByteCorpus(max_bytes=200_000)
    losses = []
    for step in range(steps):
        for m in range(2):
            x = corpus.micro_batch(step, m, dist.get_rank(), dist.get_world_size(), 2, 2, 32)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    units = [u.name for u in engine.ds_ext.plugins[0].sharded.units] if zero_topo else []
    tiles = engine.ds_ext.plugins[1].tiled.buffer.tiles_processed if zero_topo else 0
    engine.destroy()
    return losses, units, tiles


@pytest.mark.parametrize("kind", ["gpt-neox", "llama"])
def test_hf_model_under_zero_topo_equals_plain_data_parallel(world, kind):
    ref = world.run(_train, kind, False)
    ours = world.run(_train, kind, True)
    for (a, units, tiles), (b, *_) in zip(ours, ref):
        assert a == pytest.approx(b, rel=1e-5, abs=0)
        assert units == [f"{'gpt_neox' if kind == 'gpt-neox' else 'model'}.layers.{i}" for i in range(2)]
        assert tiles > 0
    assert ref[0][0][-1] < ref[0][0][0] - 0.3
