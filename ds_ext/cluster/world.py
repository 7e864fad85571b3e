"""A :class:`ds_ext.local_world.World` whose ranks live on an emulated cluster.

``with cluster_world(spec) as world: world.run(fn, ...)``: the cluster is built, each spawned
rank enters its node's (or GPU's) network namespace before it imports torch and gets the
variables :func:`ds_ext.cluster.launch.rank_env` gives a launched rank, so gloo talks over the
shaped links; benchmarks and tests then use the world as they use a local one. Leaving the
block closes the ranks and removes the cluster (also on an exception or Ctrl-C).

``add_network_arguments`` / ``bench_world`` give a benchmark its ``--network emulate|netns``.
"""

from __future__ import annotations

import argparse
import functools
from contextlib import contextmanager
from typing import Iterator

from ds_ext.cluster import launch
from ds_ext.cluster.command import add_cluster_arguments, require_capability, signals_unwind, spec_from_args
from ds_ext.cluster.netns import NetnsCluster, enter_namespace
from ds_ext.cluster.spec import ClusterError, ClusterSpec
from ds_ext.local_world import World


@contextmanager
def cluster_world(spec: ClusterSpec, env: dict[str, str] | None = None, timeout: float = 300) -> Iterator[World]:
    """A started-on-demand gloo world of ``spec.world_size`` ranks placed on ``spec``'s cluster."""
    require_capability()
    with signals_unwind(), NetnsCluster(spec) as cluster:
        ranks = range(spec.world_size)
        with World(
            spec.world_size,
            env,
            timeout,
            rank_env=[launch.rank_env(cluster, r, {}) for r in ranks],
            rank_setup=[functools.partial(enter_namespace, cluster.leaves[spec.leaf_of(r)].namespace) for r in ranks],
        ) as world:
            yield world


# ---- the benchmarks' --network flag -----------------------------------------------------------
BENCH_NODES, BENCH_GPUS_PER_NODE = 2, 2  # the benchmarks' topology: Frontier shrunk to 2 x 2 x 2
BENCH_MESSAGE_BYTES = 2**20  # the benchmarks' network measurement message: 0.1 s on a 100 Mbit/s link


def add_network_arguments(p: argparse.ArgumentParser) -> None:
    """``--network emulate|netns`` and the cluster flags, for a benchmark."""
    p.add_argument(
        "--network",
        choices=("emulate", "netns"),
        default="emulate",
        help="emulate: alpha-beta sleeps on local ranks; netns: no emulation, ranks on an emulated "
        f"cluster of {BENCH_NODES} nodes x {BENCH_GPUS_PER_NODE} GPUs with shaped links "
        f"(--node-rate, --gpus-per-node {BENCH_GPUS_PER_NODE} --gpu-rate; --nic per-gpu: a link "
        "out of the node per GPU, Frontier's shape)",
    )
    add_cluster_arguments(p, ranks_per_node=False)


def bench_cluster_spec(args: argparse.Namespace, world_size: int, nodes: int = BENCH_NODES) -> ClusterSpec:
    """The cluster of ``--network netns`` for ``world_size`` ranks on ``nodes`` nodes of
    :data:`BENCH_GPUS_PER_NODE` GPUs (the benchmarks' topology; ``ds-ext bench zero`` takes ``--nodes``)."""
    spec = spec_from_args(args, world_size // nodes)
    if (spec.nodes, spec.gpus_per_node) != (nodes, BENCH_GPUS_PER_NODE):
        raise ClusterError(
            f"--network netns runs this benchmark's {nodes} nodes x {BENCH_GPUS_PER_NODE} "
            f"GPUs: --nodes {nodes} --gpus-per-node {BENCH_GPUS_PER_NODE} --gpu-rate RATE"
        )
    return spec


LINK_FLAGS = (
    "node_rate",
    "node_burst",
    "gpu_rate",
    "gpu_burst",
    "gcd_rate",
    "gcd_burst",
    "config",
    "nic",
)  # what only --network netns reads


def refuse_link_flags_when_emulating(args: argparse.Namespace) -> None:
    """``--network emulate`` with a flag that shapes the cluster's links: one line, not a
    setting silently replaced by the emulated topology."""
    given = ["--" + f.replace("_", "-") for f in LINK_FLAGS if getattr(args, f, None) is not None]
    if args.network == "emulate" and given:
        raise ClusterError(
            f"{' and '.join(given)} only apply to --network netns (its shaped links); "
            "--network emulate runs the emulated topology's links"
        )


def bench_world(args: argparse.Namespace, world_size: int, env: dict[str, str], nodes: int = BENCH_NODES):
    """The world a benchmark runs its variants in: local ranks with ``env`` (``--network
    emulate``), or ranks on the emulated cluster of ``nodes`` nodes, whose variables say the truth
    about it. ``--nodes`` other than ``nodes`` is refused in one line, in both modes."""
    refuse_link_flags_when_emulating(args)
    if args.nodes != nodes:
        raise ClusterError(
            f"--nodes {args.nodes}: this benchmark runs {nodes} nodes (ds-ext bench zero takes other counts); "
            f"allowed: --nodes {nodes}"
        )
    if args.network == "netns":
        return cluster_world(bench_cluster_spec(args, world_size, nodes), timeout=args.timeout)
    return World(world_size, env, timeout=args.timeout)
