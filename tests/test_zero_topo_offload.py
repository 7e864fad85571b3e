"""Optimizer offload (001 §3.3.2; ``ds_ext.optim.offload``) on 4 gloo ranks.

Reference everywhere: the same run without offload, the step on the device (ZeRO-topo's untiled
step around torch's AdamW, or its tiled step with ``ds_ext.tiled_optimizer``). Offload must give the
same bits per parameter: losses, every 16-bit weight, every fp32 master and every Adam state tensor
(``exp_avg``, ``exp_avg_sq``, ``step``), in the sharded form, the pipeline form and with the tiled
optimizer, in fp32, bf16 and fp16 (an overflow step skipped alike). The config shapes are checked
against DeepSpeed's own reading of ``zero_optimization`` (``get_zero_config``).

Placement: every master and state tensor is a host tensor held by the offload store and shares no
storage with the model's device buffers (``ZeroTopoOptimizer.offload_placement``); the check is shown
to fail on a state tensor outside the store and on one aliasing a device buffer. On this CPU-only
host the device is the host, so the device test cannot tell them apart: custody and storage do. On a
GPU the device test (``tests/test_gpu.py``) fails any state left on the accelerator.
"""

import pytest
import torch

from ds_ext.errors import DsExtConfigError

WORLD_SIZE = 4
STEPS = 6
OVERFLOW_STEP = 3
TOPOLOGY = {"preset": "frontier", "sizes": {"gpu": 2}, "emulate": True}
UNQUANTIZED = {
    "preset": "zero_topo",
    "weights": {"gather_bits": 16},
    "gradients": {"bits": 16, "hops": 1},
    "secondary": {"bits": 16},
}
CPU = {"device": "cpu", "pin_memory": True}


# ---- config shapes, as DeepSpeed reads them ------------------------------------------------------
def _deepspeed_reads(zero):
    """DeepSpeed's own reading of the section (what ``DeepSpeedConfig`` calls): (device, pin_memory)
    of ``offload_optimizer``, or the exception it raises."""
    from deepspeed.runtime.zero.config import get_zero_config

    try:
        section = get_zero_config({"zero_optimization": zero}).offload_optimizer
    except Exception as err:  # noqa: BLE001 - any rejection
        return type(err).__name__
    device = "none" if section is None else str(getattr(section.device, "value", section.device))
    return (device, None) if device == "none" else (device, section.pin_memory)


@pytest.mark.parametrize(
    "zero,pin",
    [
        ({"stage": 0}, None),
        ({"stage": 0, "offload_optimizer": None}, None),
        ({"stage": 0, "offload_optimizer": {"device": "none"}}, None),
        ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, True),  # DeepSpeed's default pin_memory
        ({"stage": 0, "offload_optimizer": {"device": "cpu", "pin_memory": False}}, False),
        ({"stage": 0, "offload_optimizer": {"device": "cpu", "pin_memory": "auto"}}, True),  # "auto" dropped
        ({"stage": 0, "offload_optimizer": {"device": "cpu", "ratio": 1.0, "buffer_count": 4}}, True),
        ({"stage": 0, "cpu_offload": True}, True),  # DeepSpeed's deprecated switch
        ({"stage": 0, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "none"}}, True),
    ],
)
def test_offload_shapes_deepspeed_accepts_are_read_as_it_reads_them(zero, pin):
    from ds_ext.zero_topo import support

    ds = _deepspeed_reads(zero)
    assert ds == (("none", None) if pin is None else ("cpu", pin))
    assert support.optimizer_offload({"zero_optimization": zero}) == pin


@pytest.mark.parametrize(
    "offload,key",
    [
        ({"device": "gpu"}, "zero_optimization.offload_optimizer.device"),  # DeepSpeed rejects it
        ({"device": "cpu", "pin_memroy": True}, "zero_optimization.offload_optimizer.pin_memroy"),  # typo
        ({"device": "cpu", "ratio": 0.5}, "zero_optimization"),  # DeepSpeed: partial offload at stage 3 only
        ({"device": "cpu", "pin_memory": "yes please"}, "zero_optimization.offload_optimizer.pin_memory"),
    ],
)
def test_offload_shapes_deepspeed_rejects_are_refused_in_one_line(offload, key):
    from ds_ext.zero_topo import support

    zero = {"stage": 0, "offload_optimizer": offload}
    assert isinstance(_deepspeed_reads(zero), str)  # DeepSpeed rejects it too
    with pytest.raises(DsExtConfigError) as err:
        support.check_ds_config({"zero_optimization": zero}, torch.float32)
    msg = str(err.value)
    assert msg.startswith(f"{key}: DeepSpeed rejects it") and "allowed: " in msg and "\n" not in msg


@pytest.mark.parametrize(
    "zero,key,allowed",
    [
        ({"offload_param": {"device": "cpu"}}, "zero_optimization.offload_param.device", "'none'"),
        ({"cpu_offload_param": True}, "zero_optimization.offload_param.device", "'none'"),
        (
            {"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}},
            "zero_optimization.offload_optimizer.device",
            "'none' or 'cpu'",
        ),
        (
            {"offload_optimizer": {"device": "cpu", "pipeline_read": True}},
            "zero_optimization.offload_optimizer.pipeline_read",
            "False",
        ),
        (
            {"offload_optimizer": {"device": "cpu", "nvme_path": "/tmp"}},
            "zero_optimization.offload_optimizer.nvme_path",
            "None",
        ),
        (
            {"offload_optimizer": {"device": "cpu", "super_offload": True}},
            "zero_optimization.offload_optimizer.super_offload",
            "False",
        ),
    ],
)
def test_what_offload_does_not_implement_is_refused_naming_the_key(zero, key, allowed):
    from ds_ext.zero_topo import support

    assert not isinstance(_deepspeed_reads({"stage": 0, **zero}), str)  # DeepSpeed takes the shape
    with pytest.raises(DsExtConfigError) as err:
        support.check_ds_config({"zero_optimization": {"stage": 0, **zero}}, torch.float32)
    msg = str(err.value)
    assert msg.startswith(f"{key}: not supported with ds_ext.zero_topo") and f"allowed: {allowed}" in msg
    assert "\n" not in msg


def test_offload_takes_torch_adam_only():
    from ds_ext.zero_topo import support

    p = [torch.nn.Parameter(torch.zeros(3))]
    support.check_offload_optimizer(torch.optim.AdamW(p), {})
    support.check_offload_optimizer(None, {"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}})
    for opt, cfg, got in [
        (torch.optim.SGD(p, lr=0.1), {}, "SGD"),
        (None, {"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}, "optimizer type 'Adam'"),  # FusedAdam
        (None, {"optimizer": {"type": "Lamb", "params": {"torch_adam": True}}}, "optimizer type 'Lamb'"),
    ]:
        with pytest.raises(DsExtConfigError) as err:
            support.check_offload_optimizer(opt, cfg)
        msg = str(err.value)
        assert msg.startswith("zero_optimization.offload_optimizer: not supported with ds_ext.zero_topo")
        assert "allowed: torch.optim.Adam / AdamW" in msg and got in msg and "\n" not in msg


def test_tiled_optimizer_on_deepspeed_zero_refuses_offload_naming_zero_topo():
    from ds_ext.optim.plugin import _check_ds_config

    p = [torch.nn.Parameter(torch.zeros(3))]
    for zero in ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, {"stage": 1, "cpu_offload": True}):
        with pytest.raises(
            DsExtConfigError, match=r"offload_optimizer\.device 'cpu' .* allowed: 'none', or .*zero_topo"
        ):
            _check_ds_config({"zero_optimization": zero}, torch.optim.AdamW(p))
    with pytest.raises(DsExtConfigError, match=r"offload_param\.device 'cpu'"):
        _check_ds_config({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, torch.optim.AdamW(p))
    # under ZeRO-topo (the step owner) offload is ZeRO-topo's own
    _check_ds_config({"zero_optimization": {"stage": 0, "offload_optimizer": CPU}}, torch.optim.AdamW(p), 64, True)


# ---- the host step's copies, one process ---------------------------------------------------------
@pytest.mark.parametrize("tile", [1, 5, 7, 64, 10**4])
def test_host_step_tiles_cross_segments_in_the_tiled_steps_order(tile):
    """Segments of 13, 1 and 30 elements through tiles of ``tile``: each tile's gradient reaches the
    host buffer unscaled, each updated tile lands in its own place of the device target."""
    from ds_ext.optim.offload import HostStep, OffloadStore
    from ds_ext.optim.tiled import TiledAdam

    g = torch.Generator().manual_seed(tile)
    sizes = (13, 1, 30)
    grads = [torch.randn(n, generator=g).to(torch.bfloat16) for n in sizes]
    ref_p = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in sizes]
    ours_p = [torch.nn.Parameter(p.detach().clone()) for p in ref_p]
    ref, ours = torch.optim.AdamW(ref_p, lr=0.1), torch.optim.AdamW(ours_p, lr=0.1)
    for p, grad in zip(ref_p, grads):
        p.grad = grad.float() / 4.0
    ref.step()
    store = OffloadStore(pin_memory=True)
    targets = [torch.zeros(n, dtype=torch.bfloat16) for n in sizes]
    host = HostStep(store, grads, tile, lambda buf: buf.div_(4.0))
    tiled = TiledAdam(ours, tile, store.keep)
    for k, p in enumerate(ours_p):
        tiled.update(p, ours.param_groups[0], host.load(k), host.store(p, targets[k]))
    host.finish()
    tiled.end_step()
    for p, q, target in zip(ref_p, ours_p, targets):
        assert torch.equal(p, q) and torch.equal(target, p.detach().to(torch.bfloat16))
        assert all(store.holds(t) for t in ours.state[q].values())


def test_host_step_issues_the_next_gradient_before_and_the_weights_after_each_update():
    """The overlap schedule of 001 §3.3.2 as issue order: tile i+1's device-to-host gradient copy is
    issued before tile i is updated, and tile i's host-to-device weight copy before tile i+1 is
    (on an asynchronous accelerator each then runs on the side stream during that update)."""
    from ds_ext.optim.offload import HostStep, OffloadStore
    from ds_ext.optim.tiled import TiledAdam

    store, events = OffloadStore(pin_memory=True), []
    copy = store.copies.copy

    def logged(dst, src):
        events.append("to_host" if dst.data_ptr() in staged else "to_device")
        return copy(dst, src)

    store.copies.copy = logged
    sizes, tile = (10, 3), 4
    staged = {t.data_ptr() for t in store.staging(tile, torch.float32)[:2]}  # the gradients' staging tiles
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    opt = torch.optim.AdamW(params, lr=0.1)
    host = HostStep(store, [torch.ones(n) for n in sizes], tile, lambda buf: events.append("update"))
    tiled = TiledAdam(opt, tile)
    for k, p in enumerate(params):
        tiled.update(p, opt.param_groups[0], host.load(k), host.store(p, torch.zeros(sizes[k])))
    host.finish()
    # 4 tiles: (0, 0-4), (0, 4-8), (0, 8-10), (1, 0-3)
    assert events == [
        "to_host", "to_host", "update", "to_device",
        "to_host", "update", "to_device",
        "to_host", "update", "to_device",
        "update", "to_device",
    ]  # fmt: skip


def test_host_step_refuses_a_tile_out_of_order():
    from ds_ext.optim.offload import HostStep, OffloadOrderError, OffloadStore

    host = HostStep(OffloadStore(False), [torch.zeros(10), torch.zeros(10)], 4, lambda buf: None)
    with pytest.raises(OffloadOrderError, match=r"tile \(1, 0\) asked for"):
        host.load(1)(torch.empty(4), 0)
    with pytest.raises(OffloadOrderError, match="0 of 6 tiles updated"):
        host.finish()


# ---- on the ranks: the sharded form, with and without the tiled optimizer -----------------------
def _allow_fp16_on_cpu():
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True  # as in test_tiled_optimizer.py


def _state(opt):
    """Every fp32 master and Adam state tensor of a ZeroTopoOptimizer, in segment order."""
    out = []
    for *_, master in opt.segments:
        out.append(master.detach().clone())
        for key, value in sorted(opt.inner.state.get(master, {}).items()):
            out.append(value.detach().clone() if isinstance(value, torch.Tensor) else torch.tensor(value))
    return out


def _sharded(precision, offload, tile=None, plan=None, overflow=False, sabotage=None):
    """STEPS steps of a 2-block GPT under ZeRO-topo's sharded form (gradient accumulation 2,
    clipping on); returns losses, skipped steps, the gathered weights, masters and Adam state."""
    import torch.distributed as dist

    import ds_ext
    from ds_ext.models import GPT, GPTConfig

    if precision == "fp16":
        _allow_fp16_on_cpu()
    if sabotage is not None:
        sabotage()
    torch.manual_seed(1234)
    model = GPT(GPTConfig(seq_len=16, d_model=32, n_layers=2, n_heads=4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.01)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.3,
        "zero_optimization": {"stage": 0, **({"offload_optimizer": offload} if offload else {})},
        "steps_per_print": 10**9,
        "ds_ext": {"topology": TOPOLOGY, "zero_topo": {"enabled": True, **(plan or UNQUANTIZED)}},
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 4}
    if tile:
        cfg["ds_ext"]["tiled_optimizer"] = {"enabled": True, "tile_size": tile}
    engine, *_ = ds_ext.initialize(model=model, optimizer=opt, config=cfg)
    g = torch.Generator().manual_seed(dist.get_rank())
    losses, skipped = [], []
    for step in range(STEPS):
        for _ in range(2):
            loss = engine(torch.randint(0, 256, (2, 17), generator=g))
            if overflow and step == OVERFLOW_STEP and dist.get_rank() == 2:
                loss = loss * float("inf")
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        skipped.append(engine.optimizer.overflow)
    zt = engine.ds_ext.plugin("zero_topo")
    out = _result(engine, zt, losses, skipped)
    with engine.ds_ext.gathered_parameters():
        out["weights"] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return out


def _result(engine, zt, losses, skipped):
    from ds_ext.optim.offload import OffloadPlacementError

    try:
        placed = zt.optimizer.offload_placement()
    except OffloadPlacementError as err:
        placed = str(err)
    return {
        "losses": losses,
        "skipped": skipped,
        "state": _state(zt.optimizer),
        "placed": placed,
        "segments": len(zt.optimizer.segments),
        "describe": zt.describe(),
        "memory": zt.state_bytes(),
        "tiles": engine.ds_ext.plugin("tiled_optimizer").tiled.buffer.tiles_processed
        if "tiled_optimizer" in [p.name for p in engine.ds_ext.plugins]
        else None,
        "calls": [s.by_phase() for s in engine.ds_ext.ledger.steps],
    }


def _assert_identical(ref, ours, weights="weights"):
    for r, o in zip(ref, ours, strict=True):
        assert o["losses"] == r["losses"] and o["skipped"] == r["skipped"]
        assert r[weights].keys() == o[weights].keys()
        for name, w in r[weights].items():
            assert o[weights][name].dtype == w.dtype and torch.equal(o[weights][name], w), name
        assert len(o["state"]) == len(r["state"]) > 0
        for a, b in zip(r["state"], o["state"]):
            assert a.dtype == b.dtype and torch.equal(a, b)
        assert o["calls"] == r["calls"]  # the same collectives, bytes per level and phase
    assert ref[0]["losses"][-1] != ref[0]["losses"][0]  # it trained: the comparison is not vacuous


def _assert_offloaded(ours, ref):
    for r, o in zip(ref, ours):
        # each segment: master, exp_avg, exp_avg_sq, step -- all on the host, held by the store
        assert o["placed"] == 4 * o["segments"], o["placed"]
        assert r["placed"].startswith("the optimizer is not offloaded")
        assert o["memory"]["optimizer"] == 0 and o["memory"]["optimizer_host"] == r["memory"]["optimizer"] > 0
        assert "optimizer offloaded to host memory" in o["describe"]


@pytest.mark.parametrize(
    "precision,plan,overflow",
    [("fp32", None, False), ("bf16", {"preset": "zero_topo"}, False), ("fp16", None, True)],
    ids=["fp32", "bf16-quantized-default", "fp16-overflow"],
)
def test_sharded_form_offload_is_bit_identical_to_the_on_device_step(world, precision, plan, overflow):
    """The on-device reference is ZeRO-topo's untiled step (torch's AdamW on every master at once);
    offload runs the host step in tiles of the default 1.8M (one tile per segment here). bf16 runs
    the default quantized preset (int4 gradients, int8 secondary); fp16 skips an overflow step."""
    ref = world.run(_sharded, precision, None, None, plan, overflow)
    ours = world.run(_sharded, precision, CPU, None, plan, overflow)
    _assert_identical(ref, ours)
    _assert_offloaded(ours, ref)
    if overflow:
        assert ref[0]["skipped"][OVERFLOW_STEP] and sum(ref[0]["skipped"]) == 1
    assert "pin_memory true, a no-op" in ours[0]["describe"]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_tiled_optimizer_offload_is_bit_identical_to_its_on_device_step(world, precision):
    """ZeRO-topo + ds_ext.tiled_optimizer (tiles of 100: tiles cross parameter and unit boundaries)
    with its step on the device against the same with offload (``pin_memory`` false): the host step
    runs the tiled optimizer's tiles."""
    ref = world.run(_sharded, precision, None, 100, None, precision == "fp16")
    ours = world.run(_sharded, precision, {"device": "cpu", "pin_memory": False}, 100, None, precision == "fp16")
    _assert_identical(ref, ours)
    _assert_offloaded(ours, ref)
    assert ours[0]["tiles"] == ref[0]["tiles"] > 0


_ORIGINAL: dict = {}  # the HostStep methods a deliberate bug replaced, in this rank


def _skip_copy_back_of_one_tile():
    """A deliberate bug: the host step's third tile is updated but its weights are not copied back."""
    from ds_ext.optim import offload

    store = _ORIGINAL["store"] = offload.HostStep.store
    calls = [0]

    def sabotaged(self, master, target):
        inner = store(self, master, target)

        def maybe(s, e):
            calls[0] += 1
            if calls[0] != 3:
                inner(s, e)

        return maybe

    offload.HostStep.store = sabotaged


def _wrong_tile_of_gradients():
    """A deliberate bug: every tile gets the gradient of the tile after it (the prefetched one)."""
    from ds_ext.optim import offload

    _ORIGINAL["_fetch"] = offload.HostStep._fetch

    def fetch(self, i):
        if i < len(self._tiles):
            k, s, e = self._tiles[i]
            src = self._sources[k]
            lo = min(s + 1, src.numel() - (e - s))
            self._to_host[i % 2] = self._copies.copy(self._grads[i % 2][: e - s], src[lo : lo + e - s])

    offload.HostStep._fetch = fetch


def _restore_offload():
    from ds_ext.optim import offload

    for name, method in _ORIGINAL.items():
        setattr(offload.HostStep, name, method)
    _ORIGINAL.clear()


@pytest.mark.parametrize("bug", [_skip_copy_back_of_one_tile, _wrong_tile_of_gradients])
def test_the_comparison_catches_a_broken_host_step(world, bug):
    """Mutation check of the test above: a host step that drops one tile's copy-back, or loads the
    wrong tile's gradients, no longer matches the on-device step."""
    ref = world.run(_sharded, "bf16", None, 100)
    try:
        broken = world.run(_sharded, "bf16", CPU, 100, None, False, bug)
    finally:
        world.run(_restore_offload)
    differs = any(not torch.equal(r["weights"][n], b["weights"][n]) for r, b in zip(ref, broken) for n in r["weights"])
    assert differs


# ---- placement: the check fails where it should ------------------------------------------------
def _placement_faults(tmp):
    """An offloaded run's check passes, also on the state a checkpoint load installs; a state tensor
    replaced by a copy outside the store, or by a view of a device buffer (the unit's gradient
    shard), fails it by name."""
    import ds_ext
    from ds_ext.models import GPT, GPTConfig
    from ds_ext.optim.offload import OffloadPlacementError

    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 0, "offload_optimizer": CPU},
        "bf16": {"enabled": True},
        "ds_ext": {"topology": TOPOLOGY, "zero_topo": {"enabled": True}},
    }

    def engine_for(seed):
        torch.manual_seed(seed)
        model = GPT(GPTConfig(seq_len=16, d_model=32, n_layers=2, n_heads=4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return ds_ext.initialize(model=model, optimizer=opt, config=cfg)[0]

    engine = engine_for(0)
    engine.backward(engine(torch.randint(0, 256, (2, 17))))
    engine.step()
    engine.save_checkpoint(tmp, tag="offload")
    opt = engine.optimizer
    out = [opt.offload_placement()]
    resumed = engine_for(1)
    resumed.load_checkpoint(tmp, tag="offload")
    out.append(resumed.optimizer.offload_placement())
    saved, loaded = _state(opt), _state(resumed.optimizer)
    out.append(len(saved) == len(loaded) > 0 and all(torch.equal(a, b) for a, b in zip(saved, loaded)))
    resumed.destroy()
    unit, _, _, master = opt.segments[-1]
    state = opt.inner.state[master]
    kept = state["exp_avg"]
    for fake in (kept.clone(), unit.grad_shard[: kept.numel()]):
        state["exp_avg"] = fake
        try:
            opt.offload_placement()
            out.append(None)
        except OffloadPlacementError as err:
            out.append(str(err))
    state["exp_avg"] = opt.offload.keep(unit.grad_shard[: kept.numel()])  # custody, yet device storage
    try:
        opt.offload_placement()
        out.append(None)
    except OffloadPlacementError as err:
        out.append(str(err))
    engine.destroy()
    return out


def test_placement_check_fails_on_state_outside_the_store_or_in_device_memory(world, tmp_path):
    for passed, loaded, same, clone, device_view, alias in world.run(_placement_faults, str(tmp_path)):
        assert passed == loaded > 0 and same
        assert clone.endswith("is not held by the offload store") and "exp_avg" in clone
        assert device_view.endswith("is not held by the offload store")
        assert alias.endswith("shares storage with a device buffer"), alias


# ---- on the ranks: the pipeline form ------------------------------------------------------------
def _pipeline(precision, offload):
    """The pipeline form (2 stages x data 2, tied embedding / head, 2 micro-batches, clipping on)
    with AdamW; returns losses, this rank's stage parameters, masters and Adam state."""
    import torch.distributed as dist
    from test_zero_topo_pipeline import FP16, MICRO, UNQUANTIZED, _batches, _pipe

    import ds_ext
    from ds_ext.integration import ds_engine

    ds_engine.init_distributed()
    if precision == "fp16":
        _allow_fp16_on_cpu()
    model = _pipe(2)
    cfg = {
        "train_batch_size": MICRO * 2 * 2,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.05,
        "zero_optimization": {"stage": 0, **({"offload_optimizer": offload} if offload else {})},
        "steps_per_print": 10**6,
        "ds_ext": {
            "topology": TOPOLOGY,
            "comm": {"count_torch_collectives": False},
            "zero_topo": {"enabled": True, **UNQUANTIZED},
        },
        **({"bf16": {"enabled": True}} if precision == "bf16" else {}),
        **({"fp16": {"enabled": True, **FP16}} if precision == "fp16" else {}),
    }
    engine, *_ = ds_ext.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), config=cfg)
    data_rank = engine.grid.get_data_parallel_rank()
    losses, skipped = [], []
    for step in range(STEPS):
        losses.append(float(engine.train_batch(iter(_batches(step, data_rank)))))
        skipped.append(engine.skipped_steps)
    zt = engine.ds_ext.plugin("zero_topo")
    out = _result(engine, zt, losses, skipped)
    out["params"] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    dist.barrier()
    return out


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_pipeline_form_offload_is_bit_identical_to_the_on_device_step(world, precision):
    """On DeepSpeed's PipelineEngine: every stage's parameters, masters and Adam state, the losses
    and (fp16, initial scale 2^16) the skipped steps equal the on-device step's."""
    ref = world.run(_pipeline, precision, None)
    ours = world.run(_pipeline, precision, CPU)
    _assert_identical(ref, ours, "params")
    _assert_offloaded(ours, ref)
    if precision == "fp16":
        assert ref[0]["skipped"][-1] > 0  # the scaler skipped steps, alike
