"""ZeRO-topo where other code meets it: the Hugging Face documented ZeRO template
under the Trainer, state dicts that hold the weights, loading where nothing was saved, what
the engine reports, and checkpoints whose shards come from different saves.

4 gloo ranks as 2 nodes x 2 GCDs. References: plain DeepSpeed (stage 0) running the same
template through the same Trainer, Hugging Face's own ``from_pretrained`` of what the
Trainer saved, DeepSpeed's ``load_checkpoint`` return value.
"""

import pytest

WORLD_SIZE = 4
TOPOLOGY = {"preset": "frontier", "sizes": {"gpu": 1}, "emulate": True}
UNQUANTIZED = {"weights": {"gather_bits": 16}, "gradients": {"bits": 16, "hops": 1}, "secondary": {"bits": 16}}
# The Hugging Face documentation's DeepSpeed template (optimizer and scheduler sections,
# "auto" values filled in by the Trainer), with ZeRO stage 0: ZeRO-topo replaces DeepSpeed's ZeRO.
HF_TEMPLATE = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "zero_optimization": {"stage": 0},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def _hf_template_trainer(zero_topo, tmp):
    """The Trainer with the documented template: DeepSpeed builds the optimizer (FusedAdam)
    and WarmupLR from the sections; then ``save_model`` and ``from_pretrained``."""
    import torch
    import torch.distributed as dist
    from hf_support import ByteWindows
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    import ds_ext
    from ds_ext.models.hf import tiny_causal_lm

    cfg = {**HF_TEMPLATE, "ds_ext": {"topology": TOPOLOGY}}
    if zero_topo:
        cfg["ds_ext"]["zero_topo"] = {
            "enabled": True,
            "preset": "zero_topo",
            "units": ["LlamaDecoderLayer"],
            **UNQUANTIZED,
        }
    torch.manual_seed(1234)
    out = f"{tmp}/{'zt' if zero_topo else 'plain'}"
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=6,
        deepspeed=cfg,
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        max_grad_norm=0.0,
        learning_rate=3e-3,
        warmup_steps=2,
        weight_decay=0.01,
        seed=1234,
        data_seed=1234,
    )
    ds_ext.patch_deepspeed()
    try:
        trainer = Trainer(model=tiny_causal_lm("llama"), args=args, train_dataset=ByteWindows())
        trainer.train()
        engine = trainer.model_wrapped
        trainer.save_model(f"{out}/saved")
    finally:
        ds_ext.unpatch_deepspeed()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    lrs = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    with engine.ds_ext.gathered_parameters():
        weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    inner = engine.optimizer.inner if zero_topo else engine.optimizer
    info = {
        "plugins": [p.name for p in engine.ds_ext.plugins],
        "optimizer": type(inner).__name__,
        "scheduler": type(engine.lr_scheduler).__name__,
    }
    engine.destroy()
    dist.barrier()
    loaded = AutoModelForCausalLM.from_pretrained(f"{out}/saved")
    same = {n: torch.equal(p, weights[n]) for n, p in loaded.named_parameters()}
    return losses, lrs, info, same


def test_hugging_face_template_trains_and_save_model_round_trips(world, tmp_path):
    """Defects 1 and 3: the template's optimizer and scheduler sections are honoured (DeepSpeed
    builds FusedAdam and WarmupLR, ZeRO-topo shards FusedAdam's state), losses and learning
    rates equal plain DeepSpeed's, and ``save_model`` writes full weights that
    ``from_pretrained`` loads equal, bit for bit, to the trained ones."""
    plain = world.run(_hf_template_trainer, False, str(tmp_path))
    ours = world.run(_hf_template_trainer, True, str(tmp_path))
    for (a, lr_a, info, same), (b, lr_b, plain_info, plain_same) in zip(ours, plain):
        assert info == {"plugins": ["zero_topo"], "optimizer": "FusedAdam", "scheduler": "WarmupLR"}
        assert plain_info["optimizer"] == "FusedAdam" and all(plain_same.values())
        assert len(a) == 6 and a == pytest.approx(b, rel=1e-5, abs=0)
        assert lr_a == lr_b and lr_a[0] < lr_a[-1]  # the warm-up ran
        assert same and all(same.values()), [n for n, ok in same.items() if not ok]


def _gpt_engine(zero_topo=None, **cfg_extra):
    import torch

    import ds_ext
    from ds_ext.models import GPT, GPTConfig

    torch.manual_seed(1234)
    model = GPT(GPTConfig(seq_len=32, d_model=64, n_layers=2, n_heads=4))
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 0},
        "ds_ext": {"topology": TOPOLOGY},
        **cfg_extra,
    }
    if zero_topo is not None:
        cfg["ds_ext"]["zero_topo"] = {"enabled": True, **zero_topo}
    engine, *_ = ds_ext.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), config=cfg)
    return engine, model


def _state_dicts(tmp):
    """state_dict() on every rank: full weights, valid after the units are released; on one
    rank alone: one line after the wait, no hang, and the others carry on."""
    import torch
    import torch.distributed as dist

    from ds_ext.zero_topo import sharded_model as zt_engine

    engine, model = _gpt_engine({"preset": "zero_topo"})
    x = torch.randint(0, 256, (2, 32))
    engine.backward(engine(x))
    engine.step()
    full = engine.module.state_dict()
    block = engine.module.blocks[1].state_dict()
    with engine.ds_ext.gathered_parameters():
        ref = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    whole = all(torch.equal(full[n], p) for n, p in ref.items())
    block_ok = all(torch.equal(v, ref[f"blocks.1.{k}"]) for k, v in block.items())
    counted = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    error = None
    if dist.get_rank() == 0:
        try:
            zt_engine.STATE_DICT_WAIT_S = 2.0
            engine.module.state_dict()
        except RuntimeError as err:
            error = str(err)
    dist.barrier()
    clip = engine.gradient_clipping()
    engine.destroy()
    _, plain = _gpt_engine()
    return whole, block_ok, counted == sum(p.numel() for p in plain.parameters()), error, clip


def test_state_dict_holds_full_weights_and_a_lone_call_fails_in_one_line(world, tmp_path):
    results = world.run(_state_dicts, str(tmp_path))
    for rank, (whole, block_ok, counted, error, clip) in enumerate(results):
        assert whole and block_ok and counted
        assert clip == 1.0  # DeepSpeed's default, which ZeRO-topo applies (DeepSpeed is handed 0)
        if rank == 0:
            assert error is not None and "\n" not in error
            assert "rank(s) [1, 2, 3] did not call it within 2 s" in error
        else:
            assert error is None


def _load_nothing(tmp):
    from pathlib import Path

    engine, _ = _gpt_engine({"preset": "zero_topo"})
    empty = Path(tmp) / "empty"
    empty.mkdir(exist_ok=True)
    out = [engine.load_checkpoint(str(empty)), engine.load_checkpoint(str(Path(tmp) / "missing"))]
    engine.destroy()
    return out


def test_load_checkpoint_where_nothing_was_saved_returns_none_like_deepspeed(world, tmp_path):
    """GPT-NeoX's first launch with ``load`` == ``save`` relies on this (defect 4)."""
    for out in world.run(_load_nothing, str(tmp_path)):
        assert out == [(None, None), (None, None)]


def _mixed_shards(tmp):
    import shutil
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from ds_ext.zero_topo.checkpoint import SHARD_FILE, CheckpointError

    engine, _ = _gpt_engine({"preset": "zero_topo"})
    x = torch.randint(0, 256, (2, 32))
    for tag in ("a", "b"):
        engine.backward(engine(x))
        engine.step()
        engine.save_checkpoint(tmp, tag=tag)
    if dist.get_rank() == 0:  # one shard of save "b" replaced by the same rank's shard of save "a"
        shutil.copy(Path(tmp) / "a" / SHARD_FILE.format(rank=2), Path(tmp) / "b" / SHARD_FILE.format(rank=2))
    dist.barrier()
    try:
        engine.load_checkpoint(tmp, tag="b")
        error = None
    except CheckpointError as err:
        error = str(err)
    engine.destroy()
    return error


def test_a_shard_of_another_save_is_refused_on_every_rank_and_by_inspect(world, tmp_path):
    """Defect 5: every shard carries its save's id and step; a load with one shard copied
    from another save fails on every rank in one line, and ``ds-ext checkpoint inspect``
    verifies every shard instead of reading rank 0's metadata alone."""
    import os
    import subprocess
    import sys

    for error in world.run(_mixed_shards, str(tmp_path)):
        assert error is not None and "\n" not in error
        assert "ds_ext_zero_topo_rank00002.pt belongs to another save" in error and "step 1" in error
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    inspect = [sys.executable, "-m", "ds_ext.cli", "checkpoint", "inspect"]
    good = subprocess.run([*inspect, str(tmp_path / "a")], capture_output=True, text=True, env=env, timeout=300)
    assert good.returncode == 0 and "every one verified" in good.stdout, good.stderr
    bad = subprocess.run([*inspect, str(tmp_path / "b")], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and "belongs to another save" in bad.stderr.strip().splitlines()[-1]


def _compiled_losses(form, steps=3):
    """Losses of ZeRO-topo (unquantized, fp32) with the model compiled in one of the three
    ways users do it, or eager."""
    import torch

    import ds_ext
    from ds_ext.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=16, d_model=32, n_layers=2, n_heads=2))
    if form == "blocks":
        for block in model.blocks:
            block.compile()
    elif form == "model":
        model = torch.compile(model)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9,
        "ds_ext": {"topology": TOPOLOGY, "zero_topo": {"enabled": True, "preset": "zero_topo", **UNQUANTIZED}},
    }
    engine, *_ = ds_ext.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    if form == "engine":
        engine.compile()
    losses = []
    for step in range(steps):
        x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(step))
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return losses


def test_compiled_training_equals_eager(world):
    """Defect 7: ``engine.compile()``, ``torch.compile(model)`` and compiled blocks train under
    ZeRO-topo (the gather / release hooks run outside the compiled graphs) and equal eager."""
    eager = world.run(_compiled_losses, "eager")
    for form in ("blocks", "model", "engine"):
        for a, b in zip(world.run(_compiled_losses, form), eager):
            assert a == pytest.approx(b, rel=1e-6, abs=0), form
