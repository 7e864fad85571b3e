"""3D-PMM engine on 8 gloo ranks: overlap, DeepSpeed integration, ledger vs model, memory, tuning.

References: the serial model (tests/pmm_helpers.py), the blocking run for the overlap
switches, and ``ds_ext.perf.pmm`` (Eqs 5.1-5.5 plus the terms ds_ext adds) for the ledger.
"""

import pytest
from ledger_support import assert_links_equal
from pmm_helpers import GLOBAL_BATCH, SEQ, ds_config, engine_for, parity, tokens, train_and_compare

WORLD_SIZE = 8
ALL_ON = {"all_reduce": True, "reduce_scatter": True, "all_gather": True}
ALL_OFF = {"all_reduce": False, "reduce_scatter": False, "all_gather": False}


def _overlap_pair(grid):
    import torch

    off = train_and_compare("gpt_ckpt", grid, overlap=ALL_OFF)
    on = train_and_compare("gpt_ckpt", grid, overlap=ALL_ON)
    identical = all(torch.equal(on["params"][n], p) for n, p in off["params"].items())
    return identical, on["losses"] == off["losses"], on["telemetry"]


def test_overlap_bit_identical_to_blocking(world):
    # activation checkpointing on: OAG must prefetch inside the recomputes of backward too
    for identical, same_losses, tel in world.run(_overlap_pair, (2, 2, 2, 1)):
        assert identical and same_losses
        order = tel["recorded_order"]
        # forward: embed, pos, 8 layers, embed (the tied head); the recompute: the 8 layers again
        assert len(order) == 11 + 8 and order[:2] == ["embed", "pos"] and order[10] == "embed"
        assert order[11:] == order[6:10] + order[2:6]  # the recompute runs the last block first
        assert tel["prefetch_hits"] >= (5 - 1) * (len(order) - 1)  # every later call after the first step
        # deferred per step: the 8 layers' and pos's weight reduce-scatters (biases: the Z bucket;
        # the tied embed table: reduced at once, autograd adds its two gradients)
        assert tel["deferred_waited"] == 5 * (8 + 1)


def test_prefetch_after_a_no_grad_forward_equals_serial(world):
    # an evaluation pass before training recorded the order twice, and each
    # step then used blocks.0.qkv gathered from the weights before the previous optimizer step
    for out in world.run(train_and_compare, "gpt", (2, 2, 2, 1), overlap=ALL_ON, no_grad_first=True):
        assert len(out["telemetry"]["recorded_order"]) == 11  # embed, pos, 8 layers, embed


def test_zero1_fp32_tiled_optimizer_with_clipping(world):
    # data axis through DeepSpeed's ZeRO-1 (optimizer states sharded over 'data'); DeepSpeed's
    # clipping norm must be the serial model's (ds_pmm.mark_parameters), so clip at 1.0 here
    world.run(parity, "gpt", (2, 1, 2, 2), stage=1, clip=1.0, tiled=True)


def test_zero1_bf16_tiled_optimizer(world):
    world.run(parity, "gpt", (2, 2, 1, 2), stage=1, clip=1.0, tiled=True, bf16=True)


def test_zero2_fp32(world):
    world.run(parity, "gpt", (1, 2, 2, 2), stage=2)


def test_matmul_tuning_same_results(world):
    results = world.run(train_and_compare, "gpt", (2, 2, 2, 1), tune=True)
    tel = results[0]["telemetry"]
    layers = [f"blocks.{b}.{n}" for b in range(2) for n in ("qkv", "proj", "fc1", "fc2")] + ["embed"]  # + tied head
    assert tel["tuned_sites"] == sorted(f"{lay}/{s}" for lay in layers for s in ("fwd", "dgrad", "wgrad"))
    assert all(r["telemetry"]["tuned_modes"] == tel["tuned_modes"] for r in results)  # agreed by all ranks


def _uneven_lengths(tune):
    """(2,1,2,2): the two data groups see different sequence lengths: in the tuning window
    (step 0: group 1 short), then shapes new to one group only (step 1: both full; step 2:
    group 0 short, a shape only group 1 timed)."""
    engine = engine_for("gpt", ds_config((2, 1, 2, 2), tune=tune))
    data = engine.ds_ext.plugin("pmm3d").axes["data"]
    micro = GLOBAL_BATCH // data.size
    losses = []
    for step in range(3):
        rows = tokens(step)[data.rank * micro : (data.rank + 1) * micro]
        if (step, data.rank) in ((0, 1), (2, 0)):
            rows = rows[:, : SEQ // 2 + 1]
        loss = engine(rows)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    tuner = engine.ds_ext.plugin("pmm3d").engine.tuner
    modes = dict(tuner.choice) if tune else {}
    engine.destroy()
    return losses, modes


def test_matmul_tuning_with_uneven_sequence_lengths(world):
    # a collective per new shape paired up differently on the two data groups
    tuned, plain = world.run(_uneven_lengths, True), world.run(_uneven_lengths, False)
    for (losses, modes), (want, _) in zip(tuned, plain):
        assert losses == pytest.approx(want, rel=1e-5)
        assert (
            modes == tuned[0][1] and len(modes) == 2 * 27
        )  # both lengths (8 layers + the head, 3 sites each), agreed by every rank


def _train_steps(engine, family, steps):
    """Per step the global batch's loss (the mean over data groups)."""
    from pmm_helpers import _data_mean, _rows, call

    data_rows, _ = _rows(engine)
    data = engine.ds_ext.plugin("pmm3d").axes["data"]
    losses = []
    for step in steps:
        loss, _ = call(engine, family, tokens(step)[data_rows])
        engine.backward(loss)
        engine.step()
        losses.append(_data_mean(loss.detach(), data))
    return losses


def _checkpoint_continuation(tmp):
    """Save on (2,2,2,1) before training and after 2 of 5 steps; continue on (1,2,4,1) and
    (1,1,1,8); consolidate the first checkpoint (acceptance)."""
    import os

    import torch
    import torch.distributed as dist
    from pmm_helpers import MODELS

    from ds_ext.config import DsExtConfigError
    from ds_ext.pmm import checkpoint

    engine = engine_for("gpt", ds_config((2, 2, 2, 1)))
    engine.save_checkpoint(tmp, tag="init")
    whole = _train_steps(engine, "gpt", range(2))
    engine.save_checkpoint(tmp, tag="step2")
    whole += _train_steps(engine, "gpt", range(2, 5))
    engine.destroy()
    continued = {}
    for grid in ((1, 2, 4, 1), (1, 1, 1, 8)):
        engine = engine_for("gpt", ds_config(grid))
        engine.load_checkpoint(tmp, tag="step2")
        assert engine.global_steps == 2
        continued[grid] = _train_steps(engine, "gpt", range(2, 5))
        engine.destroy()
    full = checkpoint.consolidate(f"{tmp}/init")
    serial = dict(MODELS["gpt"]().named_parameters())
    consolidated = set(full) == set(serial) and all(torch.equal(full[n], p.detach()) for n, p in serial.items())
    dist.barrier()
    if dist.get_rank() == 0:
        os.remove(f"{tmp}/init/pmm3d/layout.json")
    dist.barrier()
    engine = engine_for("gpt", ds_config((1, 2, 4, 1)))
    try:
        engine.load_checkpoint(tmp, tag="init")
        refusal = None
    except DsExtConfigError as err:
        refusal = str(err)
    engine.destroy()
    return whole, continued, consolidated, refusal


def test_checkpoint_continues_on_other_grids(world, tmp_path):
    for whole, continued, consolidated, refusal in world.run(_checkpoint_continuation, str(tmp_path)):
        for grid, losses in continued.items():
            assert losses == pytest.approx(whole[2:], rel=1e-6, abs=0), grid
        assert consolidated  # ds-ext checkpoint consolidate's state dict = the serial initialization
        assert refusal and "has no 3D-PMM layout record" in refusal and "\n" not in refusal


def _replicated_tables_checkpoint(tmp):
    """Tables replicated over X on (2,2,2,1): save before training and after 2 steps; the first
    consolidates to the serial initialization, the second continues vocabulary-parallel on (2,1,4,1)."""
    import torch
    from pmm_helpers import MODELS

    from ds_ext.pmm import checkpoint

    engine = engine_for("gpt", ds_config((2, 2, 2, 1), tables="replicated"))
    engine.save_checkpoint(tmp, tag="init")
    _train_steps(engine, "gpt", range(2))
    engine.save_checkpoint(tmp, tag="step2")
    whole = _train_steps(engine, "gpt", range(2, 4))
    engine.destroy()
    engine = engine_for("gpt", ds_config((2, 1, 4, 1)))
    engine.load_checkpoint(tmp, tag="step2")
    continued = _train_steps(engine, "gpt", range(2, 4))
    engine.destroy()
    full = checkpoint.consolidate(f"{tmp}/init")
    serial = dict(MODELS["gpt"]().named_parameters())
    return whole, continued, all(torch.equal(full[n], p.detach()) for n, p in serial.items())


def test_replicated_tables_checkpoint_consolidates_and_reshards(world, tmp_path):
    for whole, continued, consolidated in world.run(_replicated_tables_checkpoint, str(tmp_path)):
        assert consolidated and continued == pytest.approx(whole, rel=1e-6, abs=0)


def _hf_checkpoint(tmp):
    """Llama: save on (2,2,2,1) after one step; ``ds-ext checkpoint consolidate --hf-dir``;
    Hugging Face's own from_pretrained and ds_ext.pmm.checkpoint.load_full on (1,2,4,1) give
    the loss the parallel model computed at step 1."""
    import torch
    import torch.distributed as dist
    from pmm_helpers import call
    from transformers import LlamaForCausalLM

    from ds_ext.cli import main
    from ds_ext.pmm.checkpoint import load_full

    engine = engine_for("llama", ds_config((2, 2, 2, 1)))
    _train_steps(engine, "llama", range(1))
    engine.save_checkpoint(tmp, tag="hf")
    want = _train_steps(engine, "llama", range(1, 2))[0]
    engine.destroy()
    rc = (
        main(["checkpoint", "consolidate", tmp, f"{tmp}/full.pt", "--tag", "hf", "--hf-dir", f"{tmp}/hf"])
        if dist.get_rank() == 0
        else 0
    )
    dist.barrier()
    with torch.no_grad():
        hf_loss = call(LlamaForCausalLM.from_pretrained(f"{tmp}/hf"), "llama", tokens(1))[0].item()
    engine = engine_for("llama", ds_config((1, 2, 4, 1)))
    load_full(engine.module, f"{tmp}/hf")
    with torch.no_grad():
        loaded_loss = call(engine, "llama", tokens(1))[0].item()
    engine.destroy()
    return rc, want, hf_loss, loaded_loss


def test_hf_checkpoint_consolidates_and_loads_shard_by_shard(world, tmp_path):
    for rc, want, hf_loss, loaded_loss in world.run(_hf_checkpoint, str(tmp_path)):
        assert rc == 0 and hf_loss == pytest.approx(want, rel=1e-5) and loaded_loss == pytest.approx(want, rel=1e-5)


def _ledger_vs_model(grid, accum=1, bf16=True, overlap=None, tables=None):
    import torch.distributed as dist
    from pmm_helpers import gpt

    from ds_ext.perf.pmm import items, ledger_bytes, ledger_links
    from ds_ext.pmm.plans import plan_for
    from ds_ext.pmm.spec import model_spec

    engine = engine_for("gpt", ds_config(grid, bf16=bf16, accum=accum, by_layer=True, overlap=overlap, tables=tables))
    axes = engine.ds_ext.plugin("pmm3d").axes
    micro = GLOBAL_BATCH // (axes["data"].size * accum)
    for step in range(1):
        for m in range(accum):
            start = (axes["data"].rank * accum + m) * micro
            engine.backward(engine(tokens(step)[start : start + micro]))
            engine.step()
    last = engine.ds_ext.ledger.steps[-1]
    measured = {ph: lv for ph, lv in last.by_phase().items() if ph != "step"}
    measured_links = {ph: lv for ph, lv in last.link_bytes_by_phase().items() if ph != "step"}
    serial = gpt()
    spec, pmm_grid, topology = (
        model_spec(serial, plan_for(serial), vocab_parallel=tables != "replicated"),
        engine.ds_ext.plugin("pmm3d").grid,
        engine.ds_ext.topology,
    )
    model = ledger_bytes(spec, pmm_grid, topology, micro, SEQ, 2 if bf16 else 4, accum)
    links = (
        measured_links,
        ledger_links(spec, pmm_grid, topology, dist.get_rank(), micro, SEQ, 2 if bf16 else 4, accum, gloo=True),
    )
    # all-reduces in backward at Z's level (the gradients of Z-replicated parameters): ledger and model
    z_level = pmm_grid.parallel_dims.spans(topology)["z"]
    calls = engine.ds_ext.ledger.steps[-1].calls.get(("backward", "all_reduce", z_level), 0)
    model_calls = sum(
        i.calls
        for i in items(spec, pmm_grid, micro, SEQ, 2 if bf16 else 4, accum)
        if (i.phase, i.op, i.axis) == ("backward", "all_reduce", "z")
    )
    engine.destroy()
    return measured, model, (calls, model_calls), links


def test_replicated_tables_send_what_megatron_tp8_sends(world):
    # on (8,1,1,1) pmm3d sent 37.18 MB per rank and step where megatron-core TP8
    # sends 29.36 MB: its vocabulary-parallel tables add the token and position lookups' and the
    # head's input-gradient all-reduces over X (and the loss's). Tables replicated over X (the
    # anchor's placement) send exactly Megatron's activation all-reduces, in the ledger and the model.
    from pmm_helpers import gpt

    from ds_ext.perf.pmm import megatron_bytes
    from ds_ext.pmm.plans import plan_for
    from ds_ext.pmm.spec import model_spec

    serial = gpt()
    megatron = megatron_bytes(list(model_spec(serial, plan_for(serial)).layers), GLOBAL_BATCH * SEQ, 8, 4)
    for measured, model, _, _ in world.run(_ledger_vs_model, (8, 1, 1, 1), 1, False, None, "replicated"):
        assert measured == model
        assert sum(b for per in measured.values() for b in per.values()) == megatron


LEDGER_GRIDS = [
    (2, 2, 2, 1),
    (2, 1, 2, 2),
    (1, 2, 2, 2),
    (4, 2, 1, 1),
    (2, 2, 1, 2),
    (8, 1, 1, 1),
    (1, 1, 8, 1),
    (1, 1, 1, 8),
    (1, 8, 1, 1),
    (1, 2, 4, 1),
]  # ds-ext bench pmm checks all 20 factorizations


@pytest.mark.parametrize(
    "grid,accum,bf16,overlap,tables",
    [
        *[(g, 1, True, None, None) for g in LEDGER_GRIDS],
        ((2, 2, 2, 1), 2, False, None, None),
        ((1, 2, 2, 2), 2, True, ALL_ON, None),
        ((2, 2, 2, 1), 1, True, None, "replicated"),
    ],
    ids=str,
)
def test_ledger_equals_model_per_layer_and_level(world, grid, accum, bf16, overlap, tables):
    for measured, model, (calls, model_calls), links in world.run(_ledger_vs_model, grid, accum, bf16, overlap, tables):
        assert measured == model  # exact: {"forward/<layer>": {level: bytes}, ..., "backward": {...}}
        assert_links_equal(*links)  # each byte at the level of the link it crosses (ds_ext.comm.hops)
        if grid[2] > 1 and grid[3] == 1:  # Z's level carries no other backward all-reduce
            # 8 biases + 10 norm vectors in ONE all-reduce per micro-step (was 18)
            assert calls == model_calls == accum, (calls, model_calls)


def _memory(stage):
    import torch
    from pmm_helpers import gpt

    from ds_ext.integration.ds_pmm import optimizer_state_bytes
    from ds_ext.perf.pmm import memory
    from ds_ext.pmm import Linear
    from ds_ext.pmm.plans import plan_for
    from ds_ext.pmm.spec import model_spec

    grid = (2, 1, 2, 2)
    engine = engine_for("gpt", ds_config(grid, stage=stage, bf16=True))
    micro = GLOBAL_BATCH // grid[3]
    start = engine.ds_ext.plugin("pmm3d").axes["data"].rank * micro
    engine.backward(engine(tokens(0)[start : start + micro]))
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    linear = [m for m in engine.module.modules() if isinstance(m, Linear)]
    weights = {id(m.weight) for m in linear}
    others = [p for p in engine.module.parameters() if id(p) not in weights]
    measured = {
        "layer_params": sum(nbytes(m.weight) for m in linear),
        "layer_grads": sum(nbytes(m.weight.grad) for m in linear) if stage == 0 else None,
        "replicated_params": sum(nbytes(p) for p in others),
        "replicated_names": sorted(n for n, p in engine.module.named_parameters() if id(p) not in weights),
    }
    engine.step()
    measured["optimizer"] = optimizer_state_bytes(engine)
    engine.destroy()
    serial = gpt()
    tables = (torch.nn.Linear, torch.nn.Embedding)  # vocabulary-parallel tables are sharded like weights
    serial_sharded = sum(m.weight.numel() * 2 for m in serial.modules() if isinstance(m, tables))
    return measured, memory(model_spec(serial, plan_for(serial)), _grid(grid), 2, stage), serial_sharded


def _grid(dims):
    from ds_ext.pmm import Grid

    return Grid(*dims)


def test_memory_per_rank(world):
    tensor = 2 * 1 * 2
    for (m0, model0, serial_sharded), (m1, model1, _) in zip(world.run(_memory, 0), world.run(_memory, 1)):
        # layer weights and the (vocabulary-parallel) embedding tables: serial / (G_x G_y G_z)
        assert m0["layer_params"] == m0["layer_grads"] == serial_sharded // tensor == model0["layer_params"]
        assert m1["layer_params"] == model1["layer_params"]
        # replicated: norms (split over Y only) and layer biases, listed and counted
        assert m0["replicated_params"] == model0["replicated_params"]
        assert all(n.endswith("bias") or ".ln" in n or n == "ln_f.weight" for n in m0["replicated_names"])
        assert m0["optimizer"] == model0["optimizer"]  # fp32 master + Adam m, v: 12 bytes per local parameter
        assert m1["optimizer"] == model1["optimizer"] == model0["optimizer"] / 2  # ZeRO-1: further / data


def _trainer_step_gradients(grid):
    """Gradients after one Hugging Face Trainer step of 2 accumulated micro-batches: Trainer's
    own get_batch_samples counts the step's label tokens (num_items_in_batch) and its
    training_step passes them to the model; the serial Llama, through the same Trainer, is
    the reference."""
    import tempfile

    import torch
    from pmm_helpers import FP32, MODELS, _close
    from transformers import Trainer, TrainingArguments

    from ds_ext.pmm import local_shards

    ids = tokens(0)[:, :-1]
    labels = ids.clone()
    for row in range(GLOBAL_BATCH):
        labels[row, : 2 * row] = -100  # uneven item counts over rows, Z shares and micro-batches
    half = GLOBAL_BATCH // 2
    batches = [{"input_ids": ids[:half], "labels": labels[:half]}, {"input_ids": ids[half:], "labels": labels[half:]}]

    def step(model):
        with tempfile.TemporaryDirectory() as tmp:
            args = TrainingArguments(
                output_dir=tmp,
                gradient_accumulation_steps=2,
                per_device_train_batch_size=half,
                use_cpu=True,
                report_to=[],
                average_tokens_across_devices=False,
            )
            trainer = Trainer(model=model, args=args)
            samples, items = trainer.get_batch_samples(iter(batches), 2, torch.device("cpu"))
            assert items is not None  # the model accepts loss kwargs: Trainer counts the items
            losses = [float(trainer.training_step(model, dict(inputs), items)) for inputs in samples]
        return losses

    serial = MODELS["llama"]()
    serial_losses = step(serial)
    engine = engine_for("llama", ds_config(grid, accum=2))
    losses = step(engine.module)
    want = local_shards(engine.module, {n: p.grad for n, p in serial.named_parameters()})
    for name, p in engine.module.named_parameters():
        _close(p.grad, want[name], FP32, f"grad {name}")
    engine.destroy()
    return losses, serial_losses


def test_hf_trainer_gradient_accumulation_num_items_in_batch(world):
    import pytest

    for losses, serial_losses in world.run(_trainer_step_gradients, (2, 2, 2, 1)):
        assert losses == pytest.approx(serial_losses, rel=1e-5)


def _initialize_error(grid, micro=None, instance=False, family="gpt", beside=None):
    """The one-line refusal, and whether a process group was created first; ``beside``: 'ted'
    (the ds_ext.ted plugin too) or 'moe' (a DeepSpeed-MoE layer in the model)."""
    import torch
    import torch.distributed.distributed_c10d as c10d
    from pmm_helpers import MODELS

    import ds_ext
    from ds_ext.config import DsExtConfigError

    cfg = ds_config(grid)
    if micro is not None:
        cfg["train_micro_batch_size_per_gpu"] = micro
    model = MODELS[family]()
    if beside == "ted":
        cfg["ds_ext"]["ted"] = {"enabled": True, "tensor_parallel": 2, "expert_parallel": 2}
    elif beside == "moe":
        from deepspeed.moe.layer import MoE

        model.blocks[1].moe = MoE(hidden_size=64, expert=torch.nn.Linear(64, 64), num_experts=2, ep_size=2)
    opt = torch.optim.AdamW(model.parameters()) if instance else (lambda p: torch.optim.AdamW(p))
    groups = c10d._world.group_count
    try:
        ds_ext.initialize(model=model, optimizer=opt, config=cfg)
    except DsExtConfigError as err:
        return str(err) if c10d._world.group_count == groups else f"after a collective: {err}"
    return None


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"grid": (2, 2, 2, 2)}, r"ds_ext.pmm3d.grid: x=2 \* y=2 \* z=2 \* data=2 = 16 != world size 8"),
        (
            {"grid": (8, 1, 1, 1), "family": "gpt_4heads"},
            r"ds_ext.pmm3d.grid.x=8 does not divide the 4 attention heads",
        ),
        ({"grid": (1, 1, 8, 1), "micro": 4}, r"ds_ext.pmm3d.grid.z=8 does not divide train_micro_batch_size_per_gpu=4"),
        ({"grid": (2, 2, 2, 1), "instance": True}, r"pass optimizer=lambda params: .* not an optimizer instance"),
        (
            {"grid": (2, 1, 2, 2), "beside": "ted"},
            r"^ds_ext.pmm3d with ds_ext.ted: each builds the job's model-parallel "
            r"groups and hands DeepSpeed its mpu; allowed: one of the two$",
        ),
        (
            {"grid": (2, 1, 2, 2), "beside": "moe"},
            r"^ds_ext.pmm3d: blocks.1.moe is a DeepSpeed-MoE layer "
            r"\(deepspeed.moe.layer.MoE\), whose experts 3D-PMM does not partition",
        ),
    ],
    ids=["product", "heads", "micro-batch", "optimizer", "ted", "deepspeed-moe"],
)
def test_bad_input_one_line_before_training(world, kwargs, message):
    import re

    for err in world.run(_initialize_error, **kwargs):
        assert err is not None and re.search(message, err) and "\n" not in err, err


def test_tune_measure_database_reads_the_emulated_machine(world):
    from ds_ext.cli import tune_measure_on_rank as measure_on_rank
    from ds_ext.topology import Topology

    scale, message = 3000.0, 2 << 20  # emulated link time >> gloo's own time on this host
    dbs = world.run(measure_on_rank, {"preset": "frontier", "sizes": {"gpu": 2}, "emulate": True}, message, True, scale)
    db = dbs[0]
    assert all(d == db for d in dbs) and db["ranks_per_node"] == 4
    topo = Topology.from_preset("frontier", 8, {"gpu": 2})

    def achieved(level, d):  # what a ring all-reduce achieves on the emulated level (alpha-beta)
        lv = topo.level(level)
        sent = 2 * message * (d - 1) / d
        return sent / (sent / lv.bandwidth + 2 * (d - 1) * lv.latency)

    # (G_0, G_1) = (1,2): GCD pairs; (2,2) and (1,4): across the GPUs of a node; beta_inter: one ring over nodes
    expected = {"1,2": achieved("gcd", 2), "2,2": achieved("gpu", 2), "1,4": achieved("gpu", 4)}
    assert set(db["intra"]) == set(expected)
    for key, bw in expected.items():
        assert 0.5 * bw < db["intra"][key] <= 1.01 * bw, (key, db["intra"][key], bw)
    assert 0.5 * achieved("node", 2) < db["beta_inter"] <= 1.01 * achieved("node", 2)


def _auto_grid():
    from pmm_helpers import gpt

    from ds_ext.perf.pmm import rank_grids
    from ds_ext.pmm.plans import plan_for
    from ds_ext.pmm.spec import model_spec

    cfg = ds_config((1, 1, 1, 1))
    cfg["ds_ext"]["pmm3d"]["grid"] = "auto"
    cfg["train_micro_batch_size_per_gpu"] = 4
    engine = engine_for("gpt", cfg)
    chosen = engine.ds_ext.plugin("pmm3d").grid.dims
    serial = gpt()
    expected = rank_grids(model_spec(serial, plan_for(serial)), WORLD_SIZE, engine.ds_ext.topology, 4, SEQ, 4)
    engine.destroy()
    return chosen, expected[0].grid.dims


def test_auto_grid_is_the_models_first_choice(world):
    for chosen, expected in world.run(_auto_grid):
        assert chosen == expected


# ---- vocabulary-parallel tables against a serial reference written apart -----
VOCAB_GRIDS = [(2, 2, 2, 1), (8, 1, 1, 1), (1, 2, 4, 1), (2, 1, 4, 1), (1, 8, 1, 1), (2, 1, 1, 4)]


def _vocab_vs_serial(grids):
    """Per grid, placement (vocabulary-parallel / replicated over X) and tied / untied head: embedding lookup -> LM head -> summed cross-entropy
    (ignore_index -100) of a plain-torch model (nn.Embedding, nn.Linear, F.cross_entropy) and
    of ds_ext.pmm.vocab's tables on this rank's Z rows; returns the largest differences of
    loss, logits and table-gradient shards (cut here by hand from the serial tensors) and the
    bytes of this rank's tables."""
    import itertools

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from ds_ext.comm.collectives import Communicator
    from ds_ext.groups import GroupRegistry
    from ds_ext.pmm import Grid, Linear, PMMEngine, build_axes
    from ds_ext.pmm.vocab import Embedding, tied_head, vocab_cross_entropy
    from ds_ext.topology import Topology

    V, d, B, S = 64, 16, 8, 6
    comm = Communicator(GroupRegistry(Topology.from_preset("frontier", 8, {"gpu": 2})))
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, V, (B, S), generator=gen)
    targets = torch.randint(0, V, (B, S), generator=gen)
    targets[torch.rand(B, S, generator=gen) < 0.2] = -100
    out = []
    for dims in grids:
        axes = build_axes(Grid(*dims), comm.registry, dist.get_rank())
        eng = PMMEngine(axes, comm)
        gy, gz = dims[1:3]
        cy, cz = axes["y"].rank, axes["z"].rank
        for vocab_parallel, tied in itertools.product((True, False), (False, True)):
            # replicated over X: every X rank holds all V rows (one vocabulary block)
            gx, cx = (dims[0], axes["x"].rank) if vocab_parallel else (1, 0)
            torch.manual_seed(11)
            table, head = torch.nn.Embedding(V, d), torch.nn.Linear(d, V, bias=False)
            if tied:
                head.weight = table.weight
            # serial reference: plain torch, the whole batch
            logits = head(table(ids))
            loss = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), ignore_index=-100, reduction="sum")
            loss.backward()
            # 3D-PMM: this rank's Z share of the rows, its tables' shards
            emb = Embedding.from_embedding(table, eng, name="embed", vocab_parallel=vocab_parallel)
            par_head = (
                tied_head(emb, "head") if tied else Linear.from_serial(head, eng, name="head", split_out=vocab_parallel)
            )
            rows = slice(cz * B // gz, (cz + 1) * B // gz)
            par_logits = par_head(emb(ids[rows]))
            par_loss = vocab_cross_entropy(par_logits, targets[rows], eng, axis=par_head.out_axis).sum()
            par_loss.backward()
            total = par_loss.detach().clone()
            if gz > 1:  # the serial sum over all rows: the Z shares' sums added
                dist.all_reduce(total, group=axes["z"].group)

            def shard(full):  # block (vocab x, features y) of a [V, d] tensor, flattened, Z chunk z
                block = full[cx * V // gx : (cx + 1) * V // gx, cy * d // gy : (cy + 1) * d // gy].reshape(-1)
                n = block.numel() // gz
                return block[cz * n : (cz + 1) * n]

            vocab = slice(cx * V // gx, (cx + 1) * V // gx)
            diffs = {
                "loss": abs(total.item() - loss.item()) / loss.item(),
                "logits": float((par_logits - logits[rows][..., vocab]).detach().abs().max()),
                "embed_grad": float((emb.weight.grad - shard(table.weight.grad)).abs().max()),
            }
            if not tied:
                diffs["head_grad"] = float((par_head.weight.grad - shard(head.weight.grad)).abs().max())
            params = {id(p): p for p in (*emb.parameters(), *par_head.parameters())}.values()
            nbytes = sum(p.numel() * p.element_size() for p in params)
            out.append((dims, vocab_parallel, tied, diffs, nbytes))
    return out


def test_vocab_parallel_tables_equal_a_serial_reference_and_hold_a_tensor_share(world):
    V, d = 64, 16
    for result in world.run(_vocab_vs_serial, VOCAB_GRIDS):
        for dims, vocab_parallel, tied, diffs, nbytes in result:
            assert diffs["loss"] < 1e-6 and max(diffs.values()) < 1e-5, (dims, vocab_parallel, tied, diffs)
            tables = 1 if tied else 2
            # a rank holds 1 / (G_x G_y G_z) of every table (not 1 / G_y: replicated over X and Z);
            # replicated over X: 1 / (G_y G_z)
            x_parts = dims[0] if vocab_parallel else 1
            assert nbytes == tables * V * d * 4 // (x_parts * dims[1] * dims[2]), (dims, tied, nbytes)
