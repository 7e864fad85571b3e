"""ZeRO-topo checkpoints (points 5-8): self-describing shards, atomic saves,
refusal of bad checkpoints on every rank, resharding to another plan / world size /
topology, consolidation to one fp32 state dict, inspection, partial loads.

Worlds: 8 gloo ranks (2 nodes x 2 GPUs x 2 GCDs), and a 4-rank world for the load into a
smaller job. The reference for resharding is the original run continued without a
checkpoint; for consolidation, the fp32 masters gathered in the running job.
"""

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds_ext.local_world import World

WORLD_SIZE = 8
UNQUANTIZED = {"weights": {"gather_bits": 16}, "gradients": {"bits": 16, "hops": 1}, "secondary": {"bits": 16}}


@pytest.fixture(scope="module")
def world4():
    w = World(4)
    yield w
    w.close()


def _cfg(zero_topo, micro=2, accum=2, sizes=None):
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9,
        "ds_ext": {
            "topology": {"preset": "frontier", "sizes": sizes or {"gpu": 2}, "emulate": True},
            "zero_topo": {"enabled": True, **zero_topo},
        },
    }


def _engine(cfg, seed=1234, layers=3):
    import ds_ext
    from ds_ext.models import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig(seq_len=32, d_model=64, n_layers=layers, n_heads=4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    engine, *_ = ds_ext.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def _steps(engine, steps, start=0):
    """Train; per step the loss averaged over every rank and micro-batch (the global batch)."""
    import torch.distributed as dist

    from ds_ext.data import ByteCorpus

    if not hasattr(_steps, "corpus"):
        _steps.corpus = ByteCorpus(max_bytes=300_000)
    accum, micro = engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for step in range(start, start + steps):
        total = torch.zeros(1, dtype=torch.float64)
        for m in range(accum):
            loss = engine(_steps.corpus.micro_batch(step, m, rank, world, micro, accum, 32))
            engine.backward(loss)
            engine.step()
            total += loss.item()
        dist.all_reduce(total)
        out.append(total.item() / (accum * world))
    return out


def _catch(fn, *args, **kwargs):
    from ds_ext.zero_topo.checkpoint import CheckpointError

    try:
        fn(*args, **kwargs)
        return None
    except CheckpointError as err:
        return str(err)


@contextlib.contextmanager
def no_space_on_rank(rank: int):
    """Inside: every checkpoint file ``rank`` writes fails with ENOSPC (tests/test_zero_topo_async_save.py
    too, for a write that fails in the background)."""
    import torch.distributed as dist

    from ds_ext.zero_topo import checkpoint as ckpt

    save = ckpt.atomic_save

    def broken(obj, path):
        if dist.get_rank() == rank:
            raise OSError(28, "No space left on device")
        save(obj, path)

    ckpt.atomic_save = broken
    try:
        yield
    finally:
        ckpt.atomic_save = save


# ---- atomic saves ------------------------------------------------------------------------------
def _failing_save(tmp):
    import torch.distributed as dist

    engine = _engine(_cfg({"preset": "zero_topo"}))
    _steps(engine, 2)
    engine.save_checkpoint(tmp, tag="a")
    _steps(engine, 1, start=2)
    with no_space_on_rank(3):
        error = _catch(engine.save_checkpoint, tmp, tag="b")
    dist.barrier()
    listing = sorted(os.listdir(tmp))
    latest = Path(tmp, "latest").read_text()
    fresh = _engine(_cfg({"preset": "zero_topo"}), seed=7)
    path, _ = fresh.load_checkpoint(tmp)  # the previous checkpoint is intact
    loaded = fresh.global_steps
    fresh.save_checkpoint(tmp, tag="b")  # a later save cleans up after the failed one
    dist.barrier()
    after = sorted(os.listdir(tmp)), Path(tmp, "latest").read_text()
    fresh.destroy()
    engine.destroy()
    return error, listing, latest, path, loaded, after


def test_a_failed_save_leaves_the_previous_checkpoint_and_latest_untouched(world, tmp_path):
    results = world.run(_failing_save, str(tmp_path))
    errors = {r[0] for r in results}
    assert len(errors) == 1  # the same line on every rank
    (error,) = errors
    assert error.startswith(f"ds_ext.zero_topo: saving checkpoint {tmp_path}/b failed on rank 3: cannot write ")
    assert "ds_ext_zero_topo_rank00003.pt" in error and "No space left on device" in error
    error, listing, latest, path, loaded, after = results[0]
    assert latest == "a" and "b" not in listing and ".b.partial" in listing
    assert "/a/" in path and loaded == 2
    assert after == (["a", "b", "latest"], "b")
    shards = sorted(p.name for p in (tmp_path / "b").iterdir())
    assert shards == sorted(["mp_rank_00_model_states.pt"] + [f"ds_ext_zero_topo_rank{r:05d}.pt" for r in range(8)])


def test_publish_keeps_a_replaced_checkpoint_until_the_new_one_is_in_place(tmp_path, monkeypatch):
    """A crash between the two renames of an overwriting save: the old directory, kept as
    '.<tag>.old', is what loading finds."""
    from ds_ext.zero_topo import checkpoint as ckpt

    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "old").write_text("previous")
    (tmp_path / ".t.partial").mkdir()
    (tmp_path / "latest").write_text("t")
    real = os.replace
    calls = []

    def crash_on_second(a, b):
        calls.append((a, b))
        if len(calls) == 2:
            raise OSError("killed")
        real(a, b)

    monkeypatch.setattr(ckpt.os, "replace", crash_on_second)
    with pytest.raises(OSError):
        ckpt.publish(tmp_path, "t", save_latest=True)
    monkeypatch.setattr(ckpt.os, "replace", real)
    found = ckpt.resolve_tag_dir(tmp_path, None)
    assert found.name == ".t.old" and (found / "old").read_text() == "previous"
    assert (tmp_path / "latest").read_text() == "t"


# ---- refusal on every rank -------------------------------------------------------------------
def _load_broken(tmp, what):
    import torch.distributed as dist

    engine = _engine(_cfg({"preset": "zero_topo"}))
    _steps(engine, 1)
    engine.save_checkpoint(tmp, tag="t")
    dist.barrier()
    shard = Path(tmp, "t", "ds_ext_zero_topo_rank00005.pt")
    if dist.get_rank() == 0:
        if what == "truncated":
            data = shard.read_bytes()
            shard.write_bytes(data[: len(data) // 2])
        elif what == "corrupt":
            data = bytearray(shard.read_bytes())
            data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
            shard.write_bytes(bytes(data))
    dist.barrier()
    layers = 2 if what == "other_model" else 3
    fresh = _engine(_cfg({"preset": "zero_topo"}), seed=7, layers=layers)
    error = _catch(fresh.load_checkpoint, tmp)
    alive = _steps(fresh, 1)  # nobody hangs, nothing was modified: training goes on
    fresh.destroy()
    engine.destroy()
    return error, alive


@pytest.mark.parametrize(
    "what,expected",
    [
        ("truncated", "checkpoint shard {dir}/t/ds_ext_zero_topo_rank00005.pt is unreadable (truncated or corrupt)"),
        ("corrupt", "checkpoint shard {dir}/t/ds_ext_zero_topo_rank00005.pt is unreadable (truncated or corrupt)"),
        (
            "other_model",
            "checkpoint {dir}/t has units ['<root>', 'blocks.0', 'blocks.1', 'blocks.2']..., this model "
            "['<root>', 'blocks.0', 'blocks.1']...",
        ),
    ],
)
def test_a_bad_checkpoint_is_refused_on_every_rank_with_one_line(world, tmp_path, what, expected):
    results = world.run(_load_broken, str(tmp_path), what)
    errors = {e for e, _ in results}
    assert len(errors) == 1
    (error,) = errors
    assert error.startswith(f"ds_ext.zero_topo: loading checkpoint from {tmp_path} failed on rank ")
    assert expected.format(dir=tmp_path) in error and "\n" not in error


# ---- resharding ---------------------------------------------------------------------------
def _original(tmp, zero_topo, sizes=None):
    engine = _engine(_cfg(zero_topo, sizes=sizes))
    _steps(engine, 3)
    engine.save_checkpoint(tmp, tag="s3")
    cont = _steps(engine, 3, start=3)
    engine.destroy()
    return cont


def _resumed(tmp, zero_topo, micro, accum, sizes=None):
    engine = _engine(_cfg(zero_topo, micro=micro, accum=accum, sizes=sizes), seed=99)
    engine.load_checkpoint(tmp, tag="s3")
    cont = _steps(engine, 3, start=3)
    plan = engine.ds_ext.plugins[0].plan.describe()
    engine.destroy()
    return cont, plan


def test_zero_topo_on_8_ranks_continues_as_zero3_on_4_ranks(world, world4, tmp_path):
    """Same global batch (8 x 2 x GA 2 = 4 x 4 x GA 2): the continued losses equal those
    of the original run continued, in fp32 to 1e-6."""
    original = world.run(_original, str(tmp_path), {"preset": "zero_topo", **UNQUANTIZED})[0]
    resumed, plan = world4.run(_resumed, str(tmp_path), {"preset": "zero3", **UNQUANTIZED}, 4, 2)[0]
    assert "weights node" in plan  # zero3 over a 4-rank world: really another plan and world
    for a, b in zip(resumed, original):
        assert a == pytest.approx(b, rel=1e-6)
    assert original[-1] < original[0]


def test_zero_topo_continues_on_another_topology(world, tmp_path):
    """gpu: 2 (2 nodes of 4) -> gpu: 4 (one node of 8): other shard owners, same run."""
    original = world.run(_original, str(tmp_path), {"preset": "zero_topo", **UNQUANTIZED}, {"gpu": 2})[0]
    resumed, _ = world.run(_resumed, str(tmp_path), {"preset": "zero_topo", **UNQUANTIZED}, 2, 2, {"gpu": 4})[0]
    for a, b in zip(resumed, original):
        assert a == pytest.approx(b, rel=1e-6)


def _pipeline(tmp, save):
    """ZeRO-topo's pipeline form, PP 2, unquantized, AdamW, global batch 16 (8 micro-batches of 2
    split over the data ranks): with ``save``, 2 steps, save, 2 more; else a perturbed engine loads
    the save and runs the 2 more. Returns the losses of steps 2 and 3."""
    import test_zero_topo_pipeline as tp
    import torch.distributed as dist

    import ds_ext
    from ds_ext.integration import ds_engine

    ds_engine.init_distributed()
    model = tp._pipe(2)
    if not save:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
    dp = dist.get_world_size() // 2
    cfg = {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**6,
        "ds_ext": {
            "topology": tp.TOPOLOGY if dp == 4 else {"preset": "frontier", "sizes": {"gpu": 1}, "emulate": True},
            "zero_topo": {"enabled": True, **tp.UNQUANTIZED},
        },
    }
    engine, *_ = ds_ext.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), config=cfg)
    accum, d = 8 // dp, engine.grid.get_data_parallel_rank()

    def batch(step):
        tokens = torch.randint(0, tp.VOCAB, (16, tp.SEQ + 1), generator=torch.Generator().manual_seed(step))
        for m in range(accum):
            k = d * accum + m
            yield tokens[2 * k : 2 * k + 2, :-1], tokens[2 * k : 2 * k + 2, 1:]

    if save:
        for step in range(2):
            engine.train_batch(batch(step))
        engine.save_checkpoint(tmp, tag="p2")
    else:
        engine.load_checkpoint(tmp, tag="p2")
    out = [float(engine.train_batch(batch(step))) for step in (2, 3)]
    engine.destroy()
    dist.barrier()
    return out


def test_pipeline_form_continues_on_another_data_parallel_size(world, world4, tmp_path):
    """PP 2 x DP 4 (8 ranks) saves; PP 2 x DP 2 (4 ranks, the same global batch) loads each stage's
    optimizer shards resharded over its smaller data-parallel group: the continued losses equal the
    uninterrupted run's in fp32 to 1e-6."""
    original = world.run(_pipeline, str(tmp_path), True)[0]
    resumed = world4.run(_pipeline, str(tmp_path), False)[0]
    assert resumed == pytest.approx(original, rel=1e-6)


# ---- consolidation, inspection, partial loads ------------------------------------------------
def _masters_in_job(tmp):
    """Train, save, and gather the fp32 masters of every parameter from the running job."""
    import torch.distributed as dist

    engine = _engine(_cfg({"preset": "zero_topo"}))
    _steps(engine, 3)
    engine.save_checkpoint(tmp)
    plugin = engine.ds_ext.plugins[0]
    mine = []
    for unit, lo, hi, master in plugin.optimizer.segments:
        start, _ = plugin.optimizer.own_range(unit)
        mine.append((unit.name, start + lo, master.clone()))
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, mine)
    full = {}
    for unit in plugin.sharded.all_units:
        flat = torch.full((unit.U,), float("nan"))  # parameters sit at their (block-aligned) offsets
        for rank_pieces in pieces:
            for name, start, values in rank_pieces:
                if name == unit.name:
                    flat[start : start + values.numel()] = values
        for names, shape, off in zip(unit.param_names, unit.shapes, unit.offsets):
            for n in names:
                full[n] = flat[off : off + shape.numel()].view(shape).clone()
    steps = engine.global_steps
    engine.destroy()
    return full, steps


def test_consolidate_equals_the_masters_of_the_running_job_and_loads_into_the_plain_model(world, tmp_path, capsys):
    full, steps = world.run(_masters_in_job, str(tmp_path))[0]
    out = tmp_path / "fp32.pt"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    run = subprocess.run(
        [sys.executable, "-m", "ds_ext.cli", "checkpoint", "consolidate", str(tmp_path), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    state = torch.load(out, weights_only=True)
    assert set(state) == set(full)
    for name, value in full.items():
        assert not torch.isnan(value).any() and torch.equal(state[name], value), name
    from ds_ext.models import GPT, GPTConfig

    model = GPT(GPTConfig(seq_len=32, d_model=64, n_layers=3, n_heads=4))
    model.load_state_dict(state)
    # the command a user runs is the subprocess above; inspect in-process (its CLI: tests/test_cli.py)
    from ds_ext.cli import main

    capsys.readouterr()
    assert main(["checkpoint", "inspect", str(tmp_path)]) == 0
    info = capsys.readouterr().out
    for line in (
        f"step {steps}",
        "world       8 ranks, topology frontier: gcd=2 x gpu=2 x node=2",
        "plan        weights gcd (gather 8-bit), secondary gcd int8",
        "optimizer   AdamW, 1 param groups",
        "8 x ds_ext_zero_topo_rankNNNNN.pt",
    ):
        assert line in info, info
    assert main(["checkpoint", "inspect", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("ds-ext: error: checkpoint directory")


def _partial_loads(tmp):
    engine = _engine(_cfg({"preset": "zero_topo"}))
    _steps(engine, 3)
    engine.save_checkpoint(tmp, tag="t")
    engine.destroy()
    out = {}
    for kind, kwargs in {
        "no_optimizer": {"load_optimizer_states": False},
        "module_only": {"load_module_only": True},
        "full": {},
    }.items():
        fresh = _engine(_cfg({"preset": "zero_topo"}), seed=99)
        fresh.load_checkpoint(tmp, tag="t", **kwargs)
        opt = fresh.ds_ext.plugins[0].optimizer
        masters_are_weights = all(torch.equal(m, opt._own_slice(u)[lo:hi].float()) for u, lo, hi, m in opt.segments)
        out[kind] = {
            "state": len(opt.inner.state),
            "masters_are_weights": masters_are_weights,
            "steps": fresh.global_steps,
            "loss": _steps(fresh, 1, start=3)[0],
        }
        fresh.destroy()
    return out


def test_load_module_only_and_load_optimizer_states_false_are_honoured(world, tmp_path):
    out = world.run(_partial_loads, str(tmp_path))[0]
    assert out["full"]["state"] > 0 and out["full"]["steps"] == 3
    assert out["no_optimizer"] == {**out["no_optimizer"], "state": 0, "masters_are_weights": True, "steps": 3}
    assert out["module_only"] == {**out["module_only"], "state": 0, "masters_are_weights": True, "steps": 0}
    # the same weights: the next loss (before any update) is the same; the Adam state differs later
    assert out["no_optimizer"]["loss"] == out["full"]["loss"] == out["module_only"]["loss"]
