"""``local_world.World`` notices a rank whose process dies (item 8) instead of waiting
for its timeout."""

import functools
import time

import pytest

from ds_ext.cluster.netns import enter_namespace
from ds_ext.local_world import RankError, World


def _nothing():
    return None


def test_a_rank_that_dies_during_start_up_fails_the_start_at_once():
    # rank 1 exits before joining the process group (its network namespace does not exist);
    # rank 0 waits in the rendezvous for it
    world = World(
        2, timeout=300, rank_setup=[None, functools.partial(enter_namespace, "ds_ext_test_no_such_namespace")]
    )
    start = time.monotonic()
    with pytest.raises(
        RankError,
        match=r"start failed on ranks \[1\]; ranks \[0\] did not answer(.|\n)*"
        r"process exited with code 1 without answering",
    ):
        world.run(_nothing)
    assert time.monotonic() - start < 60  # the full timeout is 300 s
    assert world._procs == []


def _imported(names):
    import sys

    return {n: n in sys.modules for n in names}


def test_a_rank_starts_with_torch_and_deepspeed_only_where_preloaded():
    """The forkserver that World forks ranks from has imported torch (ds_ext._world_preload);
    DeepSpeed only where asked (conftest.py: unless DS0196 makes ranks choose their DeepSpeed or
    a CUDA device is visible)."""
    import os

    import torch

    preloaded = not os.environ.get("DS0196") and not torch.cuda.is_available()
    with World(2) as world:
        for found in world.run(_imported, ["torch", "torch._dynamo", "ds_ext.zero_topo.plugin", "deepspeed"]):
            assert found == {
                "torch": True,
                "torch._dynamo": True,
                "ds_ext.zero_topo.plugin": True,
                "deepspeed": preloaded,
            }


def _shared_memory_named_after_the_rendezvous():
    import os

    path = f"/dev/shm/ds_ext_test_buffer_{os.environ['MASTER_ADDR']}_{os.environ['MASTER_PORT']}_{os.environ['RANK']}"
    with open(path, "wb") as f:  # as DeepSpeed's CPU all-reduce names its buffers; os._exit leaves them
        f.write(b"x")
    return path


def test_closing_a_world_removes_the_shared_memory_its_ranks_left():
    import os

    with World(2) as world:
        paths = world.run(_shared_memory_named_after_the_rendezvous)
        assert all(os.path.exists(p) for p in paths)
    assert not any(os.path.exists(p) for p in paths)


def _pid_after_groups(n):
    import os

    import torch.distributed as dist

    for _ in range(n):
        dist.new_group([0, 1])
    return os.getpid()


def test_ranks_that_created_more_than_max_groups_are_replaced_before_the_next_run():
    """Each gloo group's event loop keeps waking its rank, and a finished engine's groups are
    never freed: past MAX_GROUPS the next run gets fresh ranks, below it the same ones."""
    from ds_ext.local_world import MAX_GROUPS

    with World(2) as world:
        first = world.run(_pid_after_groups, 2)
        assert world.run(_pid_after_groups, MAX_GROUPS - 3) == first  # 1 + 2 + 29 = MAX_GROUPS: kept
        kept = world.run(_pid_after_groups, 1)
        assert kept == first and world._procs == []  # that run passed MAX_GROUPS: replaced after it
        fresh = world.run(_pid_after_groups, 0)
        assert set(fresh).isdisjoint(first)


def _linear_name(patch):
    import torch

    name = torch.nn.functional.linear.__name__
    if patch:  # as DeepSpeed ZeRO-3's zero.Init leaves it for the rest of the process
        torch.nn.functional.linear = lambda x, w, b=None: x @ w.t()
    return name


def test_a_task_does_not_see_the_linear_an_earlier_task_installed():
    with World(2) as world:
        assert world.run(_linear_name, True) == ["linear"] * 2
        assert world.run(_linear_name, False) == ["linear"] * 2


OWNER = """
import os, signal
from ds_ext.local_world import World
w = World(2)
print(*w.run(os.getpid), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_ranks_exit_when_the_process_that_owns_the_world_is_killed():
    """A killed owner (a test run stopped with kill) leaves no rank waiting for tasks for good, also
    while the owner is a zombie: ``subprocess.run`` reaps it only after its output ends, which the
    ranks hold open (they inherited it)."""
    import subprocess
    import sys

    from ds_ext.local_world import OWNER_POLL_S

    owner = subprocess.run([sys.executable, "-c", OWNER], capture_output=True, text=True, timeout=120)
    pids = [int(v) for v in owner.stdout.splitlines()[-1].split()]
    assert owner.returncode == -9 and len(pids) == 2, owner.stderr[-2000:]

    def alive(pid: int) -> bool:  # a zombie has exited; its parent (not this process) has not reaped it yet
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split()[2] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 5 * OWNER_POLL_S
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids)
