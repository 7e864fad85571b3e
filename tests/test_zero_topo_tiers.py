"""Two checkpoint tiers (``zero_topo.checkpoint_tiers``, :mod:`ds_ext.zero_topo.tiers`).

The reference is the uninterrupted run: saves into node-local directories (every save, each rank's
files also copied to its partner rank on the other node) and into the shared directory (every
second save), training on past the last save. Then node 1 is lost: its engines are gone (the job's
engines destroyed, as a restarted job starts new ones in the same world) and its local directory
deleted. The restarted job loads from the shared directory's path: the newest save is the local
tier's, node 1's shards come from node 0's partner copies, and the two steps after it give the
uninterrupted run's losses and every rank's state bit for bit. Each node keeps its two newest local
saves (``keep_local``'s default). With node 1 lost again and node 0's copy of rank 2's newest shard
gone, the older local save is loaded, bit-exact, saying why in one line; with that save's copy gone
too, the load falls back to the newest shared save and says so in one line.

World: 4 gloo ranks (2 nodes x 1 GPU x 2 GCDs), ZeRO-topo's default quantized preset, bf16; the
saves synchronous, and with ``async_save`` (the last save written while training goes on). And as
a job loses a node: a job of bare rank processes saves, trains on, and node 1's ranks die with
SIGKILL (the rest killed by the parent, as the scheduler ends the job); node 1's directory deleted,
a new job (the module's world: every rank a fresh process) restores bit-exact from the partner copies.
"""

import os
import shutil
import signal
import time
import warnings
from pathlib import Path

import pytest
import torch
from job_support import free_ports, rank_environment

from ds_ext.local_world import mp_context

WORLD_SIZE = 4
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 0},
    "steps_per_print": 10**9,
    "ds_ext": {
        "topology": {"preset": "frontier", "sizes": {"gpu": 1}, "emulate": True},
        "comm": {"timeout_s": 60},
        "zero_topo": {"enabled": True, "preset": "zero_topo", "compile_quantizer": False},
    },
}


def _engine(tiers, seed=1234, topology=None, async_save=False):
    import ds_ext
    from ds_ext.models import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig(seq_len=32, d_model=64, n_layers=2, n_heads=4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    block = {**CONFIG["ds_ext"], "topology": topology or CONFIG["ds_ext"]["topology"]}
    block["zero_topo"] = {**block["zero_topo"], "checkpoint_tiers": tiers, "async_save": async_save}
    engine, *_ = ds_ext.initialize(model=model, optimizer=opt, config={**CONFIG, "ds_ext": block})
    return engine


def _steps(engine, steps, start):
    import torch.distributed as dist

    from ds_ext.data import ByteCorpus

    corpus = ByteCorpus(max_bytes=200_000)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(start, start + steps):
        for micro in range(2):
            loss = engine(corpus.micro_batch(step, micro, rank, world, 2, 2, 32))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def _state(engine):
    """The rank's ZeRO-topo shard (weights, fp32 masters, optimizer state) and the full module."""
    shard = engine.ds_ext.plugin("zero_topo").optimizer.shard_state()
    with engine.ds_ext.gathered_parameters():
        module = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return {"slices": shard["slices"], "segments": shard["segments"], "module": module, "step": engine.global_steps}


def _tiers(tmp: Path) -> dict:
    """The tiers of every job here: local every save, shared every second, under ``tmp``."""
    return {"local_dir": str(tmp / "local" / "node{node}"), "local_every": 1, "shared_every": 2}


def _lose(path: Path) -> None:
    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    dist.barrier()


def _lost_node_restore(tmp, async_save):
    tmp = Path(tmp)
    shared, local, tiers = tmp / "shared", tmp / "local", _tiers(tmp)

    engine = _engine(tiers, async_save=async_save)
    for start in (0, 2, 3):  # saves after global steps 2 (local), 3 (local and shared) and 4 (local)
        _steps(engine, 2 if start == 0 else 1, start)
        engine.save_checkpoint(shared)
        if start == 2:
            at_step3 = _state(engine)
    reference = _steps(engine, 2, 4), _state(engine)  # the last save is written beside these steps
    if async_save:
        engine.ds_ext.plugin("zero_topo").checkpoints.background.wait()
    layout = {
        n: sorted(
            p.relative_to(local / n / "global_step4").as_posix() for p in (local / n / "global_step4").rglob("*.pt")
        )
        for n in ("node0", "node1")
    }
    tiers_seen = (sorted(p.name for p in shared.iterdir()), sorted(p.name for p in (local / "node0").iterdir()))
    engine.destroy()

    _lose(local / "node1")
    engine = _engine(tiers, seed=99, async_save=async_save)
    engine.load_checkpoint(shared)
    restored_step = engine.global_steps
    restored = _steps(engine, 2, 4), _state(engine)
    refetched = sorted(p.name for p in (local / "node1" / "global_step4").rglob("*.pt"))
    engine.destroy()

    fallbacks = []
    for tag in ("global_step4", "global_step3"):  # node 1 lost again, and node 0's copy of rank 2's shard of tag
        _lose(local / "node1")
        _lose(local / "node0" / tag / "ds_ext_zero_topo_rank00002.pt")
        engine = _engine(tiers, seed=99, async_save=async_save)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.load_checkpoint(shared)
        state = _state(engine)
        engine.destroy()
        said = [str(w.message) for w in caught if "checkpoint_tiers" in str(w.message)]
        fallbacks.append((state, said))
    return layout, tiers_seen, reference, restored_step, restored, refetched, at_step3, fallbacks


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_lost_node_restores_from_its_partners_copies_bit_exact(world, tmp_path, async_save):
    from test_zero_topo_async_save import _equal

    results = world.run(_lost_node_restore, str(tmp_path), async_save)
    shards = [f"ds_ext_zero_topo_rank{r:05d}.pt" for r in range(4)]
    for rank, (layout, seen, reference, step, restored, refetched, at_step3, fallbacks) in enumerate(results):
        # each node holds its own ranks' files and its partner node's (DeepSpeed's file is rank 0's)
        assert layout["node0"] == sorted(["mp_rank_00_model_states.pt", *shards])
        assert layout["node1"] == sorted(["mp_rank_00_model_states.pt", *shards])
        # keep_local 2 (the default): the save after step 2 was removed when step 4's was published
        assert seen == (["global_step3", "latest"], ["global_step3", "global_step4", "latest"])
        assert step == 4  # the local tier's save, newer than the shared one
        _equal(reference, restored, f"rank {rank}")
        assert "ds_ext_zero_topo_rank00002.pt" in refetched and "ds_ext_zero_topo_rank00003.pt" in refetched
        (older, said_older), (shared, said_shared) = fallbacks
        lost4 = "the local save global_step4 has no copy of ds_ext_zero_topo_rank00002.pt on any node"
        # step 4's rank-2 shard lost everywhere: the older local save, node 1's files from node 0's copies
        _equal(at_step3, older, f"rank {rank}, the older local save")
        assert said_older == (
            [] if rank else [f"ds_ext.zero_topo.checkpoint_tiers: {lost4}: loading the older local save global_step3"]
        )
        # step 3's lost too: no local save is whole, the newest shared save (step 3) is loaded
        _equal(at_step3, shared, f"rank {rank}, the shared save")
        assert said_shared == (
            []
            if rank
            else [
                f"ds_ext.zero_topo.checkpoint_tiers: {lost4}, nor has an older local save every file: loading the "
                f"newest shared save from {tmp_path}/shared"
            ]
        )


# ---- a node's ranks killed, the job restarted ----------------------------------------------------
LOST = (2, 3)  # node 1's ranks


def _killed_job(rank, port, tmp):
    """One rank of the job that loses node 1: the saves of ``_lost_node_restore``, two more steps
    (the reference, written to ``tmp``), then node 1's ranks SIGKILL themselves."""
    rank_environment(rank, port, WORLD_SIZE)
    tmp = Path(tmp)
    try:
        warnings.filterwarnings("ignore")
        torch.set_num_threads(1)
        engine = _engine(_tiers(tmp))
        for start in (0, 2, 3):
            _steps(engine, 2 if start == 0 else 1, start)
            engine.save_checkpoint(tmp / "shared")
        torch.save((_steps(engine, 2, 4), _state(engine)), tmp / f"reference.{rank}.pt")
        (tmp / f"job.{rank}.done").write_text("")
        if rank in LOST:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)  # the parent kills the job
    except BaseException:
        import traceback

        (tmp / f"job.{rank}.error").write_text(traceback.format_exc())
        os._exit(1)


def _restart(tmp):
    import torch.distributed as dist

    tmp = Path(tmp)
    _lose(tmp / "local" / "node1")
    engine = _engine(_tiers(tmp), seed=7)
    engine.load_checkpoint(tmp / "shared")
    step = engine.global_steps
    restored = _steps(engine, 2, 4), _state(engine)
    engine.destroy()
    return step, restored, torch.load(tmp / f"reference.{dist.get_rank()}.pt", weights_only=True)


def test_a_job_that_loses_a_node_restarts_from_the_partner_copies(world, tmp_path):
    from test_zero_topo_async_save import _equal

    port = free_ports(1)[0]
    procs = [mp_context().Process(target=_killed_job, args=(r, port, str(tmp_path))) for r in range(WORLD_SIZE)]
    for p in procs:
        p.start()
    deadline = time.time() + 240
    errors = lambda: [p.read_text() for p in tmp_path.glob("job.*.error")]  # noqa: E731
    while not all(procs[r].exitcode == -signal.SIGKILL for r in LOST) and not errors() and time.time() < deadline:
        time.sleep(0.1)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    assert not errors(), errors()[0]
    assert all((tmp_path / f"job.{r}.done").exists() for r in range(WORLD_SIZE))
    assert [procs[r].exitcode for r in LOST] == [-signal.SIGKILL] * len(LOST)
    for rank, (step, restored, reference) in enumerate(world.run(_restart, str(tmp_path))):
        assert step == 4  # the local tier's newest save, node 1's shards from node 0's copies
        _equal(reference, restored, f"rank {rank}")


def _refusal():
    from ds_ext.errors import DsExtConfigError

    try:
        _engine(
            {"local_dir": "/nonexistent/{node}"}, topology={"preset": "frontier", "sizes": {"gpu": 2}, "emulate": True}
        )
    except DsExtConfigError as err:
        return str(err)


def test_tiers_refuse_one_node(world):
    assert world.run(_refusal)[0] == (
        "ds_ext.zero_topo.checkpoint_tiers on one node: the partner copy needs another node; allowed: 2 or more "
        "nodes, or no checkpoint_tiers"
    )


def test_shared_every_is_a_multiple_of_local_every():
    from ds_ext import config as cfgmod

    block = {"zero_topo": {"checkpoint_tiers": {"local_dir": "/x", "local_every": 2, "shared_every": 3}}}
    with pytest.raises(cfgmod.DsExtConfigError, match="shared_every 3 is not a multiple of local_every 2"):
        cfgmod.parse(block)
