"""A :class:`ds_ext.local_world.World` whose ranks live on an emulated cluster.

``with cluster_world(spec) as world: world.run(fn, ...)``: the cluster is built, each spawned
rank enters its node's (or GPU's) network namespace before it imports torch and gets the
variables :func:`ds_ext.cluster.launch.rank_env` gives a launched rank, so gloo talks over the
shaped links; benchmarks and tests then use the world as they use a local one. Leaving the
block closes the ranks and removes the cluster (also on an exception or Ctrl-C).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from ds_ext.cluster import launch
from ds_ext.cluster.command import require_capability, signals_unwind
from ds_ext.cluster.netns import NetnsCluster
from ds_ext.cluster.spec import ClusterSpec
from ds_ext.local_world import World


@contextmanager
def cluster_world(spec: ClusterSpec, env: dict[str, str] | None = None, timeout: float = 300) -> Iterator[World]:
    """A started-on-demand gloo world of ``spec.world_size`` ranks placed on ``spec``'s cluster."""
    require_capability()
    with signals_unwind(), NetnsCluster(spec) as cluster:
        ranks = range(spec.world_size)
        with World(spec.world_size, env, timeout, rank_env=[launch.rank_env(cluster, r, {}) for r in ranks],
                   rank_netns=[cluster.leaves[spec.leaf_of(r)].namespace for r in ranks]) as world:
            yield world
