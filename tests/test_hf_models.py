"""Hugging Face models under ZeRO-topo (item 4): tiny ``GPTNeoXForCausalLM`` and
``LlamaForCausalLM`` (random init from configs, no download) train with ZeRO-topo (units
found by the decoder-layer class) and the tiled optimizer; fp32, no clipping, 5 steps:
the losses equal plain data parallelism (DeepSpeed stage 0) on the same data.
"""

import pytest

WORLD_SIZE = 4
UNQUANTIZED = {"weights": {"gather_bits": 16}, "gradients": {"bits": 16, "hops": 1}, "secondary": {"bits": 16}}
UNITS = {"gpt-neox": "GPTNeoXLayer", "llama": "LlamaDecoderLayer"}


def _train(kind, zero_topo, steps=5):
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


def _trainer(zero_topo, tmp):
    """The Hugging Face Trainer (TrainingArguments(deepspeed=...)) with ds_ext active."""
    import torch
    import torch.distributed as dist
    from hf_support import ByteWindows
    from transformers import Trainer, TrainingArguments

    import ds_ext
    from ds_ext.models.hf import tiny_causal_lm

    cfg = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9,
        "ds_ext": {"topology": {"preset": "frontier", "sizes": {"gpu": 1}, "emulate": True}},
    }
    if zero_topo:
        cfg["ds_ext"]["zero_topo"] = {
            "enabled": True,
            "preset": "zero_topo",
            "units": ["LlamaDecoderLayer"],
            **UNQUANTIZED,
        }
        cfg["ds_ext"]["tiled_optimizer"] = {"enabled": True, "tile_size": 4096}
    torch.manual_seed(1234)
    args = TrainingArguments(
        output_dir=f"{tmp}/out{dist.get_rank()}",
        per_device_train_batch_size=2,
        max_steps=6,
        deepspeed=cfg,
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        max_grad_norm=0.0,
        learning_rate=3e-3,
        seed=1234,
        data_seed=1234,
    )
    ds_ext.patch_deepspeed()
    try:
        trainer = Trainer(model=tiny_causal_lm("llama"), args=args, train_dataset=ByteWindows())
        trainer.train()
    finally:
        ds_ext.unpatch_deepspeed()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    plugins = [p.name for p in trainer.model_wrapped.ds_ext.plugins]
    trainer.model_wrapped.destroy()
    return losses, plugins


def test_hugging_face_trainer_runs_zero_topo_like_plain_deepspeed(world, tmp_path):
    """TrainingArguments(deepspeed=cfg) with ds_ext active: the Trainer's DeepSpeed engine is
    ds_ext's, and with ZeRO-topo + tiled optimizer its losses equal the plain run's."""
    plain = world.run(_trainer, False, str(tmp_path))
    ours = world.run(_trainer, True, str(tmp_path))
    for (a, plugins), (b, _) in zip(ours, plain):
        assert plugins == ["zero_topo", "tiled_optimizer"] and len(a) == 6
        assert a == pytest.approx(b, rel=1e-5, abs=0)
