"""Asynchronous checkpoint save (deliverable 1; ``zero_topo.async_save``).

The reference is the synchronous save of the same run, loaded back: an asynchronous save (its
writer held back while training runs on, so the snapshot must not see later steps) loads into
exactly the state the synchronous one loads into: every ZeRO-topo shard's weights, fp32 masters
and tiled-optimizer moments, DeepSpeed's step counters, LR scheduler and client state. A save
returns before anything is written, a second save waits for the first, and a job killed with
SIGKILL while its ranks write leaves ``latest`` at the previous save, which loads and which
``ds-ext checkpoint inspect`` reads cleanly.

World: 4 gloo ranks (2 nodes x 1 GPU x 2 GCDs), ZeRO-topo's default quantized preset with the
tiled optimizer, bf16 and DeepSpeed's WarmupLR scheduler; the killed job's ranks are processes of
their own (tests/test_zero_topo_faults.py's launch).
"""

import os
import signal
import threading
import time
from pathlib import Path

import torch
from job_support import free_ports, rank_environment

from ds_ext.local_world import mp_context

WORLD_SIZE = 4
STEPS = 2  # before the first save
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 0},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3, "warmup_num_steps": 5}},
    "steps_per_print": 10**9,
    "ds_ext": {
        "topology": {"preset": "frontier", "sizes": {"gpu": 1}, "emulate": True},
        "comm": {"timeout_s": 60},
        "zero_topo": {"enabled": True, "preset": "zero_topo", "compile_quantizer": False},
        "tiled_optimizer": {"enabled": True, "tile_size": 20_000},
    },
}


def _config(async_save):
    cfg = {**CONFIG, "ds_ext": {**CONFIG["ds_ext"]}}
    cfg["ds_ext"]["zero_topo"] = {**CONFIG["ds_ext"]["zero_topo"], "async_save": async_save}
    return cfg


def _engine(async_save, seed=1234, writer=None):
    import ds_ext
    from ds_ext.models import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig(seq_len=32, d_model=64, n_layers=2, n_heads=4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    cfg = {**_config(async_save), **({"checkpoint": {"writer": writer}} if writer else {})}
    engine, *_ = ds_ext.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def _steps(engine, steps, start):
    import torch.distributed as dist

    from ds_ext.data import ByteCorpus

    corpus = ByteCorpus(max_bytes=200_000)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(start, start + steps):
        for micro in range(2):
            loss = engine(corpus.micro_batch(step, micro, rank, world, 2, 2, 32))
            engine.backward(loss)
            engine.step()


def _cloned(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _cloned(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cloned(v) for v in obj)
    return obj


def _state(engine, client_state=None):
    """What a load installed: the rank's ZeRO-topo shard state (weights, fp32 masters, optimizer
    state), the module's full weights and buffers, and DeepSpeed's own state."""
    shard = _cloned(engine.ds_ext.plugin("zero_topo").optimizer.shard_state())  # independent of state_dict's own copies
    with engine.ds_ext.gathered_parameters():
        module = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return {
        "shard": {k: shard[k] for k in ("slices", "segments", "optimizer", "loss_scaler")},
        "module": module,
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "client": {k: v for k, v in (client_state or {}).items() if k == "note"},
    }


def _gate():
    """Hold every checkpoint file write of this rank until the returned event is set."""
    from ds_ext.zero_topo import checkpoint as ckpt

    gate, save = threading.Event(), ckpt.atomic_save

    def held(obj, path):
        assert gate.wait(120), "the test never opened the gate"
        save(obj, path)

    ckpt.atomic_save = held
    return gate, lambda: setattr(ckpt, "atomic_save", save)


def _async_and_sync(tmp):
    import torch.distributed as dist

    tmp = Path(tmp)
    sync = _engine(False)
    _steps(sync, STEPS, 0)
    sync.save_checkpoint(tmp / "sync", tag="s2", client_state={"note": 2})
    _steps(sync, 1, STEPS)
    sync.save_checkpoint(tmp / "sync", tag="s3", client_state={"note": 3})

    engine = _engine(True)
    _steps(engine, STEPS, 0)
    gate, ungate = _gate()
    try:
        began = time.monotonic()
        engine.save_checkpoint(tmp / "async", tag="s2", client_state={"note": 2})
        returned = time.monotonic() - began
        # nothing is written yet: the save returned with its files in host memory
        unwritten = (not (tmp / "async" / "s2").exists(), not (tmp / "async" / "latest").exists())
        staged = sorted(p.name for p in (tmp / "async" / ".s2.partial").rglob("*.pt"))
        _steps(engine, 1, STEPS)  # training changes every shard while the snapshot waits
        dist.barrier()
        threading.Timer(1.0, gate.set).start()
        began = time.monotonic()
        engine.save_checkpoint(tmp / "async", tag="s3", client_state={"note": 3})  # waits for s2
        waited = time.monotonic() - began
        first_published = (tmp / "async" / "s2").is_dir()
    finally:
        ungate()
    _steps(engine, 1, STEPS + 1)  # s3's agreement runs beside these steps' collectives
    engine.ds_ext.plugin("zero_topo").checkpoints.background.wait()
    failure = _failed_write(engine, tmp / "async")
    engine.destroy()
    latest = (tmp / "async" / "latest").read_text()

    states = {}  # loaded into the synchronous run's engine, which has trained past both saves
    for kind in ("sync", "async"):
        for tag in ("s2", "s3"):
            _, client = sync.load_checkpoint(tmp / kind, tag=tag)
            states[kind, tag] = _state(sync, client)
    sync.destroy()
    return returned, unwritten, staged, waited, first_published, latest, states, failure, _refused()


def _failed_write(engine, where):
    """A write that fails on rank 3 in the background: save_checkpoint returns, the next save raises."""
    from test_zero_topo_checkpoint import no_space_on_rank

    from ds_ext.zero_topo import checkpoint as ckpt

    with no_space_on_rank(3):
        try:
            engine.save_checkpoint(where, tag="s4")
            engine.save_checkpoint(where, tag="s5")
        except ckpt.CheckpointError as err:
            return str(err)


def _refused():
    """async_save beside DeepSpeed's own background writer, before any training."""
    from ds_ext.errors import DsExtConfigError

    try:
        _engine(True, writer={"type": "python", "decoupled": True})
    except DsExtConfigError as err:
        return str(err)


def _equal(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def test_async_save_loads_into_the_state_the_sync_save_loads_into(world, tmp_path):
    results = world.run(_async_and_sync, str(tmp_path))
    for rank, (returned, unwritten, staged, waited, first_published, latest, states, failure, refused) in enumerate(
        results
    ):
        assert unwritten == (True, True) and staged == [], (rank, unwritten, staged)
        assert waited >= 0.9 and first_published, (rank, waited)  # the second save waited for the first
        assert latest == "s3"  # s4 failed in the background: the next save raised it, on every rank
        assert failure.startswith(f"ds_ext.zero_topo: saving checkpoint {tmp_path}/async/s4 failed on rank 3: cannot ")
        assert "No space left on device" in failure
        assert refused == (
            "ds_ext.zero_topo.async_save with DeepSpeed's checkpoint.writer: both write checkpoints in the background; "
            "allowed: one of them (async_save false, or no checkpoint.writer section)"
        )
        for tag, step in (("s2", 2), ("s3", 3)):
            assert states["async", tag]["global_steps"] == step
            assert states["async", tag]["client"] == {"note": step}
            _equal(states["sync", tag], states["async", tag], f"rank {rank} {tag}")
        assert not torch.equal(  # the two saves hold different states (the test can tell them apart)
            states["async", "s2"]["shard"]["segments"][0]["master"],
            states["async", "s3"]["shard"]["segments"][0]["master"],
        )
    assert sorted(p.name for p in (tmp_path / "async").iterdir()) == [".s4.partial", "latest", "s2", "s3"]
    shards = sorted(p.name for p in (tmp_path / "async" / "s2").iterdir())
    assert shards == sorted(["mp_rank_00_model_states.pt"] + [f"ds_ext_zero_topo_rank{r:05d}.pt" for r in range(4)])


# ---- the other layouts ZeRO-topo shards -----------------------------------------------------------
TOPOLOGY = CONFIG["ds_ext"]["topology"]
ZERO_TOPO = {"preset": "zero_topo", "compile_quantizer": False}


def _layout_engine(layout, async_save):
    """(engine, step function) of ZeRO-topo in ``layout``: 'pipeline' (its pipeline form, PP 2 x
    DP 2 on DeepSpeed's PipelineEngine), 'ted' (TED MoE, TP 2 x EP 2: experts sharded in their own
    folder) or 'pmm3d' (3D-PMM grid 2 x 1 x 1 x data 2: one folder per tensor-grid rank)."""
    import torch.distributed as dist

    import ds_ext
    from ds_ext.integration import ds_engine

    zero_topo = {"enabled": True, **ZERO_TOPO, "async_save": async_save}
    torch.manual_seed(1234)
    if layout == "pipeline":
        import test_zero_topo_pipeline as tp

        ds_engine.init_distributed()  # as the clients do before building a PipelineModule
        model = tp._pipe(2)
        cfg = {
            "train_batch_size": tp.MICRO * tp.ACCUM * 2,
            "train_micro_batch_size_per_gpu": tp.MICRO,
            "zero_optimization": {"stage": 0},
            "steps_per_print": 10**6,
            "ds_ext": {"topology": TOPOLOGY, "zero_topo": zero_topo},
        }
        engine, *_ = ds_ext.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=cfg)
        return engine, lambda s: engine.train_batch(iter(tp._batches(s, engine.grid.get_data_parallel_rank())))
    if layout == "ted":
        import ted_support as ts

        from ds_ext.parallel import TEDLayout

        moe = ts.config()
        model = ts.ted_model(moe, ts.serial_model(moe).state_dict(), TEDLayout.build(WORLD_SIZE, 2, 2), dist.get_rank())
        cfg = ts.ds_config(2, 2, 0, plugins={"zero_topo": zero_topo}, bf16={"enabled": True})
        cfg["ds_ext"]["topology"] = TOPOLOGY
        engine, *_ = ds_ext.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=cfg)
        ted = engine.ds_ext.plugin("ted").ted
        return engine, lambda s: _one_step(engine, ts.shards(ted.layout, s)[ted.data_rank])
    from ds_ext.data import ByteCorpus
    from ds_ext.models import GPT, GPTConfig

    model = GPT(GPTConfig(seq_len=32, d_model=64, n_layers=2, n_heads=4))
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**6,
        "ds_ext": {
            "topology": TOPOLOGY,
            "pmm3d": {"enabled": True, "grid": {"x": 2, "y": 1, "z": 1, "data": 2}},
            "zero_topo": zero_topo,
        },
    }
    engine, *_ = ds_ext.initialize(model=model, optimizer=lambda params: torch.optim.AdamW(params), config=cfg)
    corpus = ByteCorpus(max_bytes=200_000)
    return engine, lambda s: _one_step(engine, corpus.micro_batch(s, 0, 0, 1, 2, 1, 32))


def _one_step(engine, batch):
    engine.backward(engine(batch))
    engine.step()


def _layouts(tmp):
    out = {}
    for layout in ("pipeline", "ted", "pmm3d"):
        where = Path(tmp, layout)
        engine, step = _layout_engine(layout, True)
        step(0)
        gate, ungate = _gate()
        try:
            engine.save_checkpoint(where / "async", tag="t", client_state={"note": layout})
            step(1)  # the snapshot must not see this step
            gate.set()
        finally:
            ungate()
        engine.destroy()  # waits for the save
        engine, step = _layout_engine(layout, False)
        step(0)
        engine.save_checkpoint(where / "sync", tag="t", client_state={"note": layout})
        step(1)  # away from the saved state: each load must restore it
        states = {}
        for kind in ("sync", "async"):
            _, client = engine.load_checkpoint(where / kind, tag="t")
            states[kind] = _state(engine, client)
        engine.destroy()
        out[layout] = (
            states,
            sorted(str(p.relative_to(where / "async" / "t")) for p in (where / "async" / "t").rglob("*.pt")),
        )
    return out


def test_async_save_equals_sync_save_in_the_pipeline_form_with_ted_and_with_3d_pmm(world, tmp_path):
    for rank, result in enumerate(world.run(_layouts, str(tmp_path))):
        for layout, (states, files) in result.items():
            assert states["async"]["client"] == {"note": layout} and states["async"]["global_steps"] == 1
            _equal(states["sync"], states["async"], f"rank {rank} {layout}")
            sync_files = sorted(
                str(p.relative_to(tmp_path / layout / "sync" / "t"))
                for p in (tmp_path / layout / "sync" / "t").rglob("*.pt")
            )
            assert files == sync_files, (layout, files, sync_files)
        folders = {layout: {f.split("/")[0] for f in files if "/" in f} for layout, (_, files) in result.items()}
        assert folders["ted"] >= {"ds_ext_zero_topo_experts_mp00", "ds_ext_zero_topo_experts_mp01"}, folders
        assert folders["pmm3d"] >= {"ds_ext_zero_topo_mp00", "ds_ext_zero_topo_mp01"}, folders
        assert any(f.startswith("layer_") for f in result["pipeline"][1]), result["pipeline"][1]  # DeepSpeed's


# ---- kill -9 during the background write -------------------------------------------------------
VICTIM = 1  # dies with SIGKILL in its writer thread, after writing one file of the second save


def _job(rank, port, tmp):
    rank_environment(rank, port, WORLD_SIZE)
    out = Path(tmp, f"job.{rank}")
    try:
        import warnings

        warnings.filterwarnings("ignore")
        torch.set_num_threads(1)
        from ds_ext.zero_topo import checkpoint as ckpt

        engine = _engine(True)
        _steps(engine, STEPS, 0)
        engine.save_checkpoint(Path(tmp, "ckpt"), tag="a")
        engine.ds_ext.plugin("zero_topo").checkpoints.background.wait()  # a is complete
        torch.save(_state(engine), Path(tmp, f"reference.{rank}.pt"))
        save = ckpt.atomic_save

        def write_one_then_stall(obj, path):
            while not Path(f"{out}.returned").exists():  # the save returns before its first write
                time.sleep(0.01)
            save(obj, path)
            Path(f"{out}.writing").write_text(str(path))
            if rank == VICTIM:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(600)  # the parent kills the job

        ckpt.atomic_save = write_one_then_stall
        _steps(engine, 1, STEPS)
        engine.save_checkpoint(Path(tmp, "ckpt"), tag="b")
        Path(f"{out}.returned").write_text("")
        time.sleep(600)  # the parent kills the job (training on would fail once the victim is gone)
    except BaseException:
        import traceback

        Path(f"{out}.error").write_text(traceback.format_exc())
        os._exit(1)


def _load_after_kill(tmp):
    import torch.distributed as dist

    engine = _engine(False, seed=7)
    path, _ = engine.load_checkpoint(Path(tmp, "ckpt"))
    state = _state(engine)
    engine.destroy()
    reference = torch.load(Path(tmp, f"reference.{dist.get_rank()}.pt"), weights_only=True)
    _equal(reference, state, f"rank {dist.get_rank()}")
    return path


def test_kill_9_during_the_background_write_leaves_the_previous_save(world, tmp_path, capsys):
    from ds_ext.cli import main

    ctx, port = mp_context(), free_ports(1)[0]
    procs = [ctx.Process(target=_job, args=(r, port, str(tmp_path))) for r in range(WORLD_SIZE)]
    for p in procs:
        p.start()
    deadline = time.time() + 180
    markers = [tmp_path / f"job.{r}.{what}" for r in range(WORLD_SIZE) for what in ("writing", "returned")]
    errors = lambda: [p.read_text() for p in tmp_path.glob("job.*.error")]  # noqa: E731
    while not all(m.exists() for m in markers) and not errors() and time.time() < deadline:
        time.sleep(0.1)
    for p in procs:
        if p.is_alive():
            p.kill()  # SIGKILL: the job dies while its writers hold the second save half written
        p.join()
    assert not errors(), errors()[0]
    assert all(m.exists() for m in markers), [m.name for m in markers if not m.exists()]
    assert procs[VICTIM].exitcode == -signal.SIGKILL
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest").read_text() == "a"
    assert sorted(p.name for p in ckpt.iterdir()) == [".b.partial", "a", "latest"]
    assert any((ckpt / ".b.partial").rglob("*.pt"))  # killed mid-write: some of b's files are there
    capsys.readouterr()
    assert main(["checkpoint", "inspect", str(ckpt)]) == 0
    shown = capsys.readouterr().out
    assert f"checkpoint {ckpt}/a" in shown and "step 2," in shown and "every one verified" in shown
    paths = world.run(_load_after_kill, str(tmp_path))
    assert all("/a/" in path for path in paths), paths
