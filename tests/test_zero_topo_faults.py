"""Faults (point 9): a rank killed with SIGKILL mid-step ends the job on every
other rank with an error naming ``ds_ext.comm.timeout_s``, within the timeout plus a
margin, and a restart from the last checkpoint reproduces the uninterrupted run's losses
bit for bit (deterministic CPU run, ZeRO-topo's default quantized preset with the tiled
optimizer).

These ranks are real processes started like a launcher starts them (RANK, WORLD_SIZE,
MASTER_ADDR/PORT), not the shared test world: the point is what happens to processes. They
are forked from the World's forkserver, which has imported torch, so a launch does not pay
torch's import per rank.
"""

import json
import os
import re
import signal
import time
import traceback

import pytest
from job_support import free_ports, rank_environment

from ds_ext.local_world import mp_context

RANKS = 4  # 2 nodes x 1 GPU x 2 GCDs
AGREEMENT_S = 2  # zero_topo.agreement_check_s of the branch test
TIMEOUT_S = 30  # generous: group creation under load must not hit it; a dead peer is seen in seconds
STEPS = 4
KILL = (2, 3)  # (step, rank): rank 3 dies in the forward of step 2, after the checkpoint at 2 steps
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 0},
    "steps_per_print": 10**9,
    "ds_ext": {
        "topology": {"preset": "frontier", "sizes": {"gpu": 1}, "emulate": True},
        "comm": {"timeout_s": TIMEOUT_S},
        "zero_topo": {"enabled": True, "preset": "zero_topo"},
        "tiled_optimizer": {"enabled": True, "tile_size": 20_000},
    },
}


def _job(rank, port, tmp, name, kill, resume_from, branch=None, pipeline=False):
    """One rank of a training job; writes its losses (or its error) to ``tmp``. ``pipeline``: a
    PipelineModule of 2 stages (tests/test_zero_topo_pipeline.py) under DeepSpeed's PipelineEngine
    (PP 2 x DP 2), ZeRO-topo's pipeline form, ``train_batch`` over the 2 micro-batches."""
    rank_environment(rank, port, RANKS)
    out = os.path.join(tmp, f"{name}.{rank}")
    try:
        import warnings

        warnings.filterwarnings("ignore")
        import torch

        torch.set_num_threads(1)
        import ds_ext
        from ds_ext.data import ByteCorpus
        from ds_ext.models import GPT, GPTConfig

        torch.manual_seed(1234)
        if pipeline:
            import test_zero_topo_pipeline as tp

            from ds_ext.integration import ds_engine

            ds_engine.init_distributed()  # as the clients do before building a PipelineModule
            model = tp._pipe(2)
        else:
            model = GPT(GPTConfig(seq_len=32, d_model=64, n_layers=2, n_heads=4))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        config = CONFIG
        if branch is not None:  # (step, rank): that rank skips block 1 in that step's first forward
            config = {
                **CONFIG,
                "ds_ext": {
                    **CONFIG["ds_ext"],
                    "zero_topo": {**CONFIG["ds_ext"]["zero_topo"], "agreement_check_s": AGREEMENT_S},
                },
            }
        engine, *_ = ds_ext.initialize(model=model, optimizer=opt, config=config)
        if resume_from:
            engine.load_checkpoint(os.path.join(tmp, resume_from))
        corpus = ByteCorpus(max_bytes=200_000)
        losses = {}
        if pipeline:

            def die(*_):  # in the forward of step KILL[0]'s first micro-batch on its stage
                if kill == (engine.global_steps, rank):
                    with open(out + ".killed", "w") as f:
                        f.write(repr(time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)

            model.register_forward_pre_hook(die)
            data_rank = engine.grid.get_data_parallel_rank()
            for step in range(engine.global_steps, STEPS):
                batches = iter(tp._batches(step, data_rank))
                losses[f"{step}"] = float(engine.train_batch(batches))
                if (step + 1) % 2 == 0:
                    engine.save_checkpoint(os.path.join(tmp, f"ckpt_{name}"))
        else:
            for step in range(engine.global_steps, STEPS):
                for micro in range(2):
                    blocks = model.blocks
                    if branch == (step, rank) and micro == 0:
                        model.blocks = torch.nn.ModuleList([blocks[0]])  # the hooks stay on the blocks
                        with open(out + ".branched", "w") as f:
                            f.write(repr(time.time()))
                    loss = engine(corpus.micro_batch(step, micro, rank, RANKS, 2, 2, 32))
                    model.blocks = blocks
                    if kill == (step, rank):
                        with open(out + ".killed", "w") as f:
                            f.write(repr(time.time()))
                        os.kill(os.getpid(), signal.SIGKILL)
                    engine.backward(loss)
                    engine.step()
                    losses[f"{step}.{micro}"] = loss.item()
                if (step + 1) % 2 == 0:
                    engine.save_checkpoint(os.path.join(tmp, f"ckpt_{name}"))
        with open(out, "w") as f:
            json.dump(losses, f)
        # a clean exit, as torch asks of every job; gloo's worker threads can still abort the
        # interpreter's teardown afterwards ("terminate called without an active exception",
        # pytorch#190489, seen in a full suite run), so the rank leaves without that teardown
        torch.distributed.destroy_process_group()
        os._exit(0)
    except BaseException:
        with open(out + ".error", "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)  # as above: no interpreter teardown (a collective's waiter thread may still be in gloo)


def _start(tmp, name, kill=None, resume_from=None, branch=None, port=None, pipeline=False):
    """Start RANKS processes of one job."""
    ctx = mp_context()  # World's forkserver: each rank starts with torch imported
    port = port or free_ports(1)[0]
    procs = [
        ctx.Process(target=_job, args=(r, port, tmp, name, kill, resume_from, branch, pipeline)) for r in range(RANKS)
    ]
    for p in procs:
        p.start()
    return procs


def _wait(*jobs, timeout=240):
    """Wait for every process of ``jobs`` to exit. Returns (exit codes, exit times) per job."""
    ended = [{} for _ in jobs]
    deadline = time.time() + timeout
    while sum(map(len, ended)) < RANKS * len(jobs) and time.time() < deadline:
        for procs, done in zip(jobs, ended):
            for r, p in enumerate(procs):
                if r not in done and not p.is_alive():
                    done[r] = time.time()
        time.sleep(0.05)
    for procs in jobs:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    return [([p.exitcode for p in procs], done) for procs, done in zip(jobs, ended)]


def _launch(tmp, name, kill=None, resume_from=None, timeout=240, branch=None, pipeline=False):
    """Start RANKS processes; wait for all to exit. Returns (exit codes, exit times)."""
    return _wait(_start(tmp, name, kill, resume_from, branch, pipeline=pipeline), timeout=timeout)[0]


def _read(tmp, name, rank, suffix=""):
    with open(os.path.join(tmp, f"{name}.{rank}{suffix}")) as f:
        return f.read()


def _failures(tmp, name, codes):
    """Exit code and error of every rank that did not exit 0 (for assertion messages)."""
    path = lambda r: os.path.join(tmp, f"{name}.{r}.error")  # noqa: E731
    return {
        r: (c, _read(tmp, name, r, ".error") if os.path.exists(path(r)) else "no .error file")
        for r, c in enumerate(codes)
        if c
    }


@pytest.mark.parametrize("pipeline", [False, True], ids=["sharded", "pipeline"])
def test_kill_9_ends_every_rank_with_a_timeout_error_and_restart_reproduces_the_run(tmp_path, pipeline):
    """Sharded form: every survivor names the timeout. Pipeline form (PP 2 x DP 2): a survivor
    blocked in the PipelineEngine's own send / recv sees gloo's closed or reset connection instead; every
    one fails within the timeout, and the restart reproduces the run bit for bit."""
    tmp = str(tmp_path)
    # the uninterrupted run and the one that loses a rank are independent jobs: side by side
    whole_port, killed_port = free_ports(2)
    (codes, _), (killed_codes, ended) = _wait(
        _start(tmp, "whole", port=whole_port, pipeline=pipeline),
        _start(tmp, "killed", kill=KILL, port=killed_port, pipeline=pipeline),
    )
    assert codes == [0] * RANKS, _failures(tmp, "whole", codes)
    whole = [json.loads(_read(tmp, "whole", r)) for r in range(RANKS)]

    codes = killed_codes
    victim = KILL[1]
    assert codes[victim] == -signal.SIGKILL
    killed_at = float(_read(tmp, "killed", victim, ".killed"))
    for r in range(RANKS):
        if r == victim:
            continue
        assert codes[r] == 1, (r, codes)
        assert ended[r] - killed_at < TIMEOUT_S + 10, (r, ended[r] - killed_at)
        error = _read(tmp, "killed", r, ".error").strip().splitlines()[-1]
        timed_out = f"ds_ext.comm.timeout_s = {TIMEOUT_S} s" in error and "a peer rank died or did not answer" in error
        assert timed_out or (pipeline and re.search(r"Connection (closed|reset) by peer", error)), error

    codes, _ = _launch(tmp, "resumed", resume_from="ckpt_killed", pipeline=pipeline)
    assert codes == [0] * RANKS, _failures(tmp, "resumed", codes)
    for r in range(RANKS):
        resumed = json.loads(_read(tmp, "resumed", r))
        assert sorted(resumed) == (["2", "3"] if pipeline else ["2.0", "2.1", "3.0", "3.1"])
        assert resumed == {k: whole[r][k] for k in resumed}  # bit for bit


def test_ranks_that_run_different_units_fail_in_one_line_naming_them(tmp_path):
    """Rank 0 skips block 1 in one forward (a branch the others do not take).
    Without the check every rank waits ``comm.timeout_s`` and reports a dead peer; with it, the
    ranks fail well before that, naming the units they disagree on."""
    tmp = str(tmp_path)
    codes, ended = _launch(tmp, "branch", branch=(1, 0))
    assert all(c == 1 for c in codes), (codes, _failures(tmp, "branch", codes))
    branched_at = float(_read(tmp, "branch", 0, ".branched"))
    lines = {r: _read(tmp, "branch", r, ".error").strip().splitlines()[-1] for r in range(RANKS)}
    for r, line in lines.items():
        found = re.search(r"rank \d+ (\w+) unit '([^']+)' while rank \d+ (\w+) unit '([^']+)'", line)
        assert "ranks run different units in one step" in line and found, (r, lines)
        assert found.group(1, 2) != found.group(3, 4), line
        assert ended[r] - branched_at < TIMEOUT_S - 10, (r, {q: ended[q] - branched_at for q in ended}, lines)
