"""ZeRO-topo on 8 gloo ranks emulating 2 nodes x 2 GPUs x 2 GCDs.

References: plain data-parallel training (DeepSpeed stage 0, same model, data and seed)
for every unquantized preset, and DeepSpeed's own ZeRO-3 for the ``zero3`` preset.
"""

import math

import pytest
from ledger_support import assert_links_equal

WORLD_SIZE = 8
TOPOLOGY = {"preset": "frontier", "sizes": {"gpu": 2}, "emulate": True}
UNQUANTIZED = {"weights": {"gather_bits": 16}, "gradients": {"bits": 16, "hops": 1}, "secondary": {"bits": 16}}
_CORPUS = []


def _corpus():
    from ds_ext.data import ByteCorpus

    if not _CORPUS:
        _CORPUS.append(ByteCorpus(max_bytes=300_000))
    return _CORPUS[0]


def _ds_config(zero_stage=0, precision="fp32", accum=2, zero_topo=None):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": zero_stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10_000,
        "ds_ext": {"topology": TOPOLOGY},
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 4}
    if zero_topo is not None:
        cfg["ds_ext"]["zero_topo"] = {"enabled": True, **zero_topo}
    return cfg


def _engine(ds_cfg, checkpoint=False, seed=1234):
    import torch

    import ds_ext
    from ds_ext.models import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig(seq_len=32, d_model=64, n_layers=3, n_heads=4, checkpoint=checkpoint))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    engine, *_ = ds_ext.initialize(model=model, optimizer=opt, config=ds_cfg)
    return engine


def _run_steps(engine, steps, start=0):
    import torch.distributed as dist

    accum = engine.gradient_accumulation_steps()
    losses = []
    for step in range(start, start + steps):
        for micro in range(accum):
            tokens = _corpus().micro_batch(step, micro, dist.get_rank(), dist.get_world_size(), 2, accum, 32)
            loss = engine(tokens)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def _train(ds_cfg, steps=10, checkpoint=False):
    engine = _engine(ds_cfg, checkpoint)
    losses = _run_steps(engine, steps)
    plugin = engine.ds_ext.plugins[0] if engine.ds_ext.plugins else None
    out = {
        "losses": losses,
        "bytes": engine.ds_ext.ledger.mean_by_level(),
        "phases": [s.by_phase() for s in engine.ds_ext.ledger.steps],
        "state": plugin.state_bytes() if plugin else None,
        "reduce_scatter": [
            (s.by_level(op="reduce_scatter"), s.link_bytes_by_level(op="reduce_scatter"))
            for s in engine.ds_ext.ledger.steps
        ],
    }
    engine.destroy()
    return out


_REFERENCE = {}


def _reference(world, precision="fp32", checkpoint=False, steps=10):
    key = (precision, checkpoint, steps)
    if key not in _REFERENCE:
        _REFERENCE[key] = world.run(_train, _ds_config(0, precision), steps, checkpoint)
    return _REFERENCE[key]


def _assert_close(a, b, rel):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert math.isclose(x, y, rel_tol=rel), (x, y)


# with Adam and clipping on, 1-level and 2-level reduction; every preset's norms and parameters
# equal plain data parallelism's exactly is tests/test_zero_topo_hardening.py's (SGD, no clipping)
@pytest.mark.parametrize("preset", ["zero_topo", "zeropp"])
def test_unquantized_presets_match_plain_data_parallel(world, preset):
    ref = _reference(world)
    ours = world.run(_train, _ds_config(0, zero_topo={"preset": preset, **UNQUANTIZED}))
    for r, o in zip(ref, ours):
        _assert_close(o["losses"], r["losses"], 1e-5)
    assert ref[0]["losses"][-1] < ref[0]["losses"][0] - 0.5


def test_activation_checkpointing_matches(world):
    ref = _reference(world, checkpoint=True)
    ours = world.run(_train, _ds_config(0, zero_topo={"preset": "zero_topo", **UNQUANTIZED}), 10, True)
    _assert_close(ours[0]["losses"], ref[0]["losses"], 1e-5)


def test_zero3_preset_matches_deepspeed_zero3(world):
    ds = world.run(_train, _ds_config(3), 4)
    ours = world.run(_train, _ds_config(0, zero_topo={"preset": "zero3"}), 4)
    _assert_close(ours[0]["losses"], ds[0]["losses"], 1e-5)
    # DeepSpeed's own reduce-scatters on gloo sent as ds_ext's are (comm.torch_gloo_reduce_scatter, the
    # bench's fair baseline): the same training, the same volume booked, half of gloo's all-reduce on the links
    fair = _ds_config(3)
    fair["ds_ext"]["comm"] = {"torch_gloo_reduce_scatter": "all_to_all"}
    rerouted = world.run(_train, fair, 4)
    for r, n in zip(rerouted, ds):
        _assert_close(r["losses"], n["losses"], 1e-5)
        assert len(r["reduce_scatter"]) == len(n["reduce_scatter"]) == 4
        for (volume, links), (native_volume, native_links) in zip(r["reduce_scatter"], n["reduce_scatter"]):
            assert volume == native_volume and volume["node"] > 0
            assert sum(links.values()) == pytest.approx(sum(native_links.values()) / 2, rel=1e-9)


def _no_node_bytes_in_micro_batches(phases):
    assert phases["forward"].get("node", 0) == 0 and phases["backward"].get("node", 0) == 0
    assert phases["step"]["node"] > 0


def test_zero_topo_no_inter_node_traffic_in_micro_batches(world):
    """zero_topo_paper here; zero_topo in test_step_boundary_overlaps_backward_and_the_next_forward_with_the_same_bits_and_bytes."""
    out = world.run(_train, _ds_config(0, accum=4, zero_topo={"preset": "zero_topo_paper"}), 3)
    for phases in out[0]["phases"]:
        _no_node_bytes_in_micro_batches(phases)


def _first_block_twice_engine(ds_cfg):
    """The test model with its first block applied twice, each under reentrant activation
    checkpointing: each application's backward is a backward of its own, so that unit's
    gradients are reduced twice in one ``engine.backward`` (one graph would accumulate once)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    import ds_ext
    from ds_ext.models import GPT, GPTConfig

    class FirstBlockTwice(GPT):
        def logits(self, tokens):
            x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
            for _ in range(2):
                x = checkpoint(self.blocks[0], x, use_reentrant=True)
            for block in self.blocks[1:]:
                x = block(x)
            return self.head(self.ln_f(x))

    torch.manual_seed(1234)
    model = FirstBlockTwice(GPTConfig(seq_len=32, d_model=64, n_layers=3, n_heads=4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    return ds_ext.initialize(model=model, optimizer=opt, config=ds_cfg)[0]


SCHEDULES = {  # the step boundary's schedules: every one gives the same bits and bytes
    "serial": {"overlap_step": False},
    "overlapped": {"gather_across_step": False},
    "across": {},  # the default: overlapped, the weight gathers completed in the next forward
}


def _summed(records):
    """Bytes per (phase, level) and calls per level over ledger records."""
    phases, calls = {}, {}
    for r in records:
        for ph, levels in r.by_phase().items():
            for level, n in levels.items():
                phases[ph, level] = phases.get((ph, level), 0) + n
        for level, n in r.calls_by_level().items():
            calls[level] = calls.get(level, 0) + n
    return phases, calls


def _overlapped_or_not(preset, accum, schedule, first_block_twice=False):
    """Three steps under one of :data:`SCHEDULES`; after each micro-batch's forward the GPU-level
    bytes of phase ``step`` the open ledger record holds (the weight gathers inside the node: the
    boundary reduces across nodes only), after its backward the node bytes of phase ``step``, and
    the warnings of a unit reduced twice in it; losses, every primary shard and fp32 master (read
    after the last step: reading completes what is in flight), the first step's ledger and every
    record's sum."""
    import warnings

    import torch.distributed as dist

    cfg = _ds_config(0, "bf16", accum=accum, zero_topo={"preset": preset, **SCHEDULES[schedule]})
    engine = _first_block_twice_engine(cfg) if first_block_twice else _engine(cfg)
    ledger, in_forward, issued, warned, losses = engine.ds_ext.ledger, [], [], [], []
    for step in range(3):
        for micro in range(accum):
            tokens = _corpus().micro_batch(step, micro, dist.get_rank(), dist.get_world_size(), 2, accum, 32)
            loss = engine(tokens)
            in_forward.append(ledger.current.by_phase().get("step", {}).get("gpu", 0))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.backward(loss)
            warned.append(sum("reduced its gradients twice in one backward" in str(w.message) for w in caught))
            issued.append(ledger.current.by_phase().get("step", {}).get("node", 0))
            engine.step()
            losses.append(loss.item())
    held = ledger.current.by_phase().get("step", {}).get("gpu", 0)
    engine.ds_ext.settle()  # the last step's gathers, completed now (booked in the open record)
    settled = ledger.current.by_phase().get("step", {}).get("gpu", 0) - held
    plugin = engine.ds_ext.plugins[0]
    out = {
        "settled": settled,
        "in_forward": in_forward,
        "issued": issued,
        "warned": warned,
        "losses": losses,
        "primaries": [u.primary.clone() for u in plugin.sharded.all_units],
        "masters": [m.clone() for *_, m in plugin.optimizer.segments],
        "steps": [s.by_phase() for s in ledger.steps],
        "summed": _summed([*ledger.steps, ledger.current]),
    }
    engine.destroy()
    return out


@pytest.mark.parametrize("preset,accum", [("zero_topo", 2), ("zero_topo_int8", 1)])
def test_step_boundary_overlaps_backward_and_the_next_forward_with_the_same_bits_and_bytes(world, preset, accum):
    """``overlap_step`` (the default): the boundary's cross-node gradient reduction (16-bit
    reduce-scatter; int8 all-to-all) is issued inside the last micro-batch's backward (booked as
    phase ``step``), never in an earlier one; with it off nothing is issued before the step. With
    ``gather_across_step`` (the default) the weight gathers inside the node are issued in the next
    step's first forward (still phase ``step``), else inside the step; ``engine.ds_ext.settle()``
    completes them after the last step (nothing left to settle otherwise). All three schedules give
    the same bits and, summed over the run, the same ledger."""
    import torch

    runs = {name: world.run(_overlapped_or_not, preset, accum, name) for name in SCHEDULES}
    boundary = [micro == accum - 1 for _ in range(3) for micro in range(accum)]
    for rank, serial in enumerate(runs["serial"]):
        gathered_in_step = serial["steps"][0]["step"]["gpu"]
        assert gathered_in_step > 0
        assert serial["issued"] == [0] * len(boundary)
        for name, out in runs.items():
            a = out[rank]
            if name != "serial":
                assert all((x > 0) == last for x, last in zip(a["issued"], boundary)), a["issued"]
                assert len({x for x in a["issued"] if x}) == 1  # the whole reduction, every step
            after_a_step = [0] * accum + [gathered_in_step] * (2 * accum)
            assert a["in_forward"] == (after_a_step if name == "across" else [0] * len(boundary)), (name, a)
            assert a["settled"] == (gathered_in_step if name == "across" else 0), (name, a["settled"])
            assert a["losses"] == serial["losses"]
            assert all(torch.equal(x, y) for x, y in zip(a["primaries"], serial["primaries"]))
            assert all(torch.equal(x, y) for x, y in zip(a["masters"], serial["masters"]))
            assert a["summed"] == serial["summed"], name
            for phases in a["steps"]:
                _no_node_bytes_in_micro_batches(phases)


def test_a_unit_reduced_twice_in_one_backward_is_reduced_again_with_the_same_bits(world):
    """A unit applied twice, each time under reentrant checkpointing, completes its gradient
    shard twice in the last backward: the overlapped boundary reduces it again once the shard is
    whole (warning once on rank 0), and training has the serial schedule's bits."""
    import torch

    on = world.run(_overlapped_or_not, "zero_topo", 1, "across", True)
    off = world.run(_overlapped_or_not, "zero_topo", 1, "serial", True)
    assert on[0]["warned"] == [1, 1, 1] and off[0]["warned"] == [0, 0, 0]
    for a, b in zip(on, off):
        assert a["losses"] == b["losses"]
        assert all(torch.equal(x, y) for x, y in zip(a["primaries"], b["primaries"]))
        assert all(torch.equal(x, y) for x, y in zip(a["masters"], b["masters"]))


def test_bf16_and_fp16(world):
    ref = _reference(world, "bf16", steps=6)
    ours = world.run(_train, _ds_config(0, "bf16", zero_topo={"preset": "zero_topo", **UNQUANTIZED}), 6)
    _assert_close(ours[0]["losses"], ref[0]["losses"], 2e-2)
    fp16 = world.run(_train, _ds_config(0, "fp16", zero_topo={"preset": "zero_topo", **UNQUANTIZED}), 6)
    assert fp16[0]["losses"][-1] < fp16[0]["losses"][0] - 0.5


def _checkpoint_round_trip(tmp):
    import torch.distributed as dist

    cfg = _ds_config(0, zero_topo={"preset": "zero_topo"})
    engine = _engine(cfg)
    _run_steps(engine, 3)
    engine.save_checkpoint(tmp, tag="t3")
    after = _run_steps(engine, 2, start=3)
    engine.destroy()
    fresh = _engine(cfg, seed=99)  # different init: everything must come from the checkpoint
    fresh.load_checkpoint(tmp, tag="t3")
    resumed = _run_steps(fresh, 2, start=3)
    fresh.destroy()
    dist.barrier()
    return after, resumed


def test_checkpoint_round_trip(world, tmp_path):
    for after, resumed in world.run(_checkpoint_round_trip, str(tmp_path)):
        assert resumed == after


def _measured_vs_analytic(preset, accum, overrides):
    cfg = _ds_config(0, "bf16", accum=accum, zero_topo={"preset": preset, **overrides})
    engine = _engine(cfg)
    _run_steps(engine, 2)  # the second step is a steady one (the first builds buffers)
    plugin = engine.ds_ext.plugins[0]
    ledger = engine.ds_ext.ledger
    last = ledger.steps[-1]
    model = plugin.analytic_traffic(accum)
    out = {
        "measured": {ph: dict(v) for ph, v in last.by_phase().items() if ph != "other"},
        "analytic": model.bytes,
        "measured_links": last.link_bytes_by_phase(),
        "analytic_links": model.links,
        "calls": dict(last.calls_by_level()),
        "analytic_calls": model.calls_by_level(),
        "state": plugin.state_bytes(),
        "analytic_state": plugin.analytic_memory(),
        "compiled": (plugin.sharded.ctx.weight_quantizer.compile, plugin.sharded.ctx.compile_quantizer),
    }
    engine.destroy()
    return out


LEDGER_CASES = [  # every preset at GA 3 (gathers per micro-batch, reduction at the boundary); GA 1 for two;
    # quantized and not, except zero3 and mics, which are 16-bit everywhere already
    (preset, accum, quantized)
    for preset in ("zero_topo", "zero_topo_paper", "zero3", "zeropp", "mics", "zero_topo_int8")
    for accum in ((1, 3) if preset in ("zero_topo", "zero3") else (3,))
    for quantized in ((True,) if preset in ("zero3", "mics") else (True, False))
]


@pytest.mark.parametrize("preset,accum,quantized", LEDGER_CASES)
def test_ledger_equals_analytic_model(world, preset, accum, quantized):
    _ledger_equals_model(world.run(_measured_vs_analytic, preset, accum, {} if quantized else UNQUANTIZED))


@pytest.mark.parametrize("preset", ["zero_topo", "zeropp"])
def test_ledger_equals_analytic_model_with_packed_groups(world, preset):
    """The opt-in packed layout (blocks over a unit's packed parameters, 1 and 2 hops): each rank's
    bytes (the default, per-parameter groups, is test_ledger_equals_analytic_model's)."""
    _ledger_equals_model(world.run(_measured_vs_analytic, preset, 1, {"quantization_groups": "packed"}))


def _ledger_equals_model(results):
    for r in results:
        measured, analytic = r["measured"], r["analytic"]
        assert set(measured) == set(analytic), (measured, analytic)
        for phase in analytic:
            assert set(measured[phase]) == set(analytic[phase]), (phase, measured, analytic)
            for level, b in analytic[phase].items():
                assert measured[phase][level] == b, (phase, level)  # exact: int8 scales alone are 0.8 %
        # link bytes (ds_ext.comm.hops): each byte at the level of the link to its peer
        assert_links_equal(r["measured_links"], r["analytic_links"])
        for level, c in r["analytic_calls"].items():
            assert r["calls"][level] == c, level
        for state, b in r["analytic_state"].items():
            assert r["state"][state] == b, state
        assert r["compiled"] == (True, True)  # the default: fused quantizer kernels (tests/test_quant.py)


def _int8_boundary(accum):
    """zero_topo_int8: primary shards of every rank, masters, and inter-node bytes per step."""

    from ds_ext.zero_topo.layout import shard_index

    engine = _engine(_ds_config(0, "bf16", accum=accum, zero_topo={"preset": "zero_topo_int8"}))
    _run_steps(engine, 3)
    plugin = engine.ds_ext.plugins[0]
    ctx = plugin.sharded.ctx
    opt = plugin.optimizer
    primaries = {u.name: u.primary.clone() for u in plugin.sharded.all_units}
    own = [(u.name, lo, hi, m.clone(), opt._own_slice(u)[lo:hi].clone()) for u, lo, hi, m in opt.segments]
    node = engine.ds_ext.ledger.mean_by_level(skip=1)["node"]
    m_bytes = sum(u.numel for u in plugin.sharded.all_units) * 2
    out = {
        "shard": shard_index(ctx.topo, ctx.rank, plan_level := plugin.plan.weights),
        "level": plan_level,
        "primaries": primaries,
        "own": own,
        "node_over_M": node / m_bytes,
        "describe": plugin.plan.describe(),
    }
    engine.destroy()
    return out


@pytest.mark.parametrize("accum", [1, 2])
def test_int8_step_boundary_replicas_identical_and_below_the_16_bit_floor(world, accum):
    """Below the 16-bit floor: across nodes the boundary carries int8 blocks; every
    rank, owners included, continues from the dequantized weights, so all replicas of a
    weight shard are bit-identical, while the fp32 masters keep what the optimizer computed.
    With and without accumulation (micro-batches carry nothing across nodes:
    test_zero_topo_no_inter_node_traffic_in_micro_batches, so the bytes per step do not depend
    on how many there are; configs/zero_topo/zero_topo_int8.json's 8 would only repeat them)."""
    import torch

    results = world.run(_int8_boundary, accum)
    by_shard = {}
    for r in results:
        by_shard.setdefault(r["shard"], []).append(r["primaries"])
    assert all(len(v) == 4 for v in by_shard.values())  # 8 ranks, shards over GCD pairs: 4 replicas each
    for replicas in by_shard.values():
        for other in replicas[1:]:
            assert all(torch.equal(other[k], replicas[0][k]) for k in replicas[0])
    quantized = sum(int((m.to(w.dtype) != w).sum()) for r in results for *_, m, w in r["own"])
    assert quantized > 0  # the weights are the dequantized ones, not the masters rounded
    for r in results:
        assert "8-bit across nodes" in r["describe"]
        assert r["node_over_M"] <= 0.135, r["node_over_M"]  # the 16-bit floor is 0.25 M here
