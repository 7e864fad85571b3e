"""Start the ranks of a job inside the namespaces of a :class:`~ds_ext.cluster.netns.NetnsCluster`.

Each rank is one process ``ip netns exec <its namespace> <command>`` (``ip netns exec``
execs, so the process is the rank itself) with the variables torchrun and the ``deepspeed``
launcher give a rank: ``RANK``, ``LOCAL_RANK``, ``LOCAL_SIZE`` / ``LOCAL_WORLD_SIZE``,
``WORLD_SIZE``, ``NODE_RANK`` / ``GROUP_RANK``, ``MASTER_ADDR`` (node 0's address) and
``MASTER_PORT``, plus ``GLOO_SOCKET_IFNAME`` (the namespace's link, so gloo uses the shaped
network), ``DS_ACCELERATOR=cpu`` and ``OMP_NUM_THREADS=1`` unless the caller set them. With
``local_rank_arg`` the command also gets ``--local_rank=N`` as the ``deepspeed`` launcher
passes it. ``DS_EXT_CLUSTER`` holds the cluster's shape as JSON for tools that measure it.

Ranks are ordered node-major: rank = node * ranks_per_node + local_rank. Every rank gets
the parent-death signal SIGKILL, so a runner killed with SIGKILL takes its ranks with it; a
rank that fails stops the others (SIGTERM, then SIGKILL), as torchrun does.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from typing import Sequence

from ds_ext.cluster.netns import NetnsCluster, die_with_parent
from ds_ext.cluster.spec import ClusterError

MASTER_PORT = 29500  # the namespaces are private: no other job can hold it
_TERM_GRACE_S = 5.0
_POLL_S = 0.05


def rank_env(cluster: NetnsCluster, rank: int, base: dict[str, str]) -> dict[str, str]:
    """The environment of ``rank`` (see module docstring)."""
    spec = cluster.spec
    node, local = divmod(rank, spec.ranks_per_node)
    leaf = cluster.leaves[spec.leaf_of(rank)]
    env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **base}
    env.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(local),
            "WORLD_SIZE": str(spec.world_size),
            "LOCAL_SIZE": str(spec.ranks_per_node),
            "LOCAL_WORLD_SIZE": str(spec.ranks_per_node),
            "NODE_RANK": str(node),
            "GROUP_RANK": str(node),
            "CROSS_RANK": str(node),
            "CROSS_SIZE": str(spec.nodes),
            "MASTER_ADDR": cluster.leaves[0].address,
            "MASTER_PORT": str(MASTER_PORT),
            "GLOO_SOCKET_IFNAME": leaf.ifname,
            "DS_EXT_CLUSTER": json.dumps({**spec.to_json(), "run_id": cluster.rid}),
        }
    )
    return env


def start_ranks(
    cluster: NetnsCluster, command: Sequence[str], local_rank_arg: bool = False, env: dict[str, str] | None = None
) -> list[subprocess.Popen]:
    """Start every rank of ``command``; the processes in rank order."""
    base = dict(os.environ if env is None else env)
    procs = []
    try:
        for rank in range(cluster.spec.world_size):
            argv = list(command)
            if local_rank_arg:
                argv.append(f"--local_rank={rank % cluster.spec.ranks_per_node}")
            ns = cluster.leaves[cluster.spec.leaf_of(rank)].namespace
            procs.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", ns, *argv],
                    env=rank_env(cluster, rank, base),
                    preexec_fn=die_with_parent,
                    start_new_session=True,
                )
            )
    except BaseException:
        stop(procs)
        raise
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every live rank, SIGKILL what is left after a grace period."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        p.terminate()
    deadline = time.monotonic() + _TERM_GRACE_S
    for p in live:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def wait_ranks(procs: list[subprocess.Popen], timeout: float | None = None) -> int:
    """Wait for every rank; 0 when all succeed, else the first failing rank's exit code (the
    others are stopped). A job still running after ``timeout`` seconds is stopped and raises."""
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                return failed[0][1] or 1
            if all(c == 0 for c in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                running = [r for r, c in enumerate(codes) if c is None]
                raise ClusterError(f"ranks {running} still running after {timeout:g} s; stopped")
            time.sleep(_POLL_S)
    finally:
        stop(procs)


def run_job(
    cluster: NetnsCluster,
    command: Sequence[str],
    timeout: float | None = None,
    local_rank_arg: bool = False,
    env: dict[str, str] | None = None,
) -> int:
    """Start ``command`` on every rank of ``cluster`` and wait (:func:`wait_ranks`)."""
    return wait_ranks(start_ranks(cluster, command, local_rank_arg, env), timeout)
