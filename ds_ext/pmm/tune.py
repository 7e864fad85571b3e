"""``ds-ext tune``: rank the 4D grids of a model (001 §5.1.2) and measure the bandwidth database.

* ranking the grids is the planner's (``ds_ext.planner.pmm_grids`` through ``ds-ext tune`` /
  ``ds-ext plan --families pmm3d``); :func:`bandwidths` gives it Eq 5.7's inputs.
* :func:`measure_database`: 001 §5.1.2 Case 1 profiling. For every two-level hierarchy
  (G_0, G_1) with G_0 G_1 <= G_node, all outer groups of size G_1 (rank stride G_0) run
  all-reduces of ``message_bytes`` at once; the bandwidth is the bytes one rank sends (ring
  convention) over the time. β_inter comes from one ring over one rank per node. Run on
  the ranks of a job (on one host, with alpha-beta emulation, it measures the emulated
  machine: ``ds-ext tune --measure``, :func:`ds_ext.cli.tune_measure_on_rank`).
"""

from __future__ import annotations

import time
from typing import Any

from ds_ext.parallel import ParallelDims
from ds_ext.perf import pmm as perf
from ds_ext.topology import Topology

REPEATS = 3


def measure_database(comm, topology: Topology, message_bytes: int) -> dict[str, Any]:
    """Runs on every rank of the job; returns the database (identical on all ranks)."""
    import torch
    import torch.distributed as dist

    world, g_node = topology.world_size, topology.ranks_per_node
    from ds_ext.comm import backend_device

    buf = torch.zeros(message_bytes // 4, dtype=torch.float32, device=backend_device())
    intra = {}
    pairs = [
        (g0, g1)
        for g0 in range(1, g_node + 1)
        for g1 in range(2, g_node + 1)
        if g0 * g1 <= g_node and g_node % (g0 * g1) == 0
    ]
    for g0, g1 in pairs:
        dims = ParallelDims.build([("inner", g0), ("outer", g1), ("rest", None)], world)
        intra[f"{g0},{g1}"] = _bandwidth(comm, comm.registry.group(dims.groups(["outer"])), buf, g1)
    beta_inter = None
    if world > g_node:
        nodes = world // g_node
        dims = ParallelDims.build([("local", g_node), ("nodes", nodes)], world)
        beta_inter = _bandwidth(comm, comm.registry.group(dims.groups(["nodes"])), buf, nodes)
    dist.barrier()
    return {"ranks_per_node": g_node, "message_bytes": message_bytes, "intra": intra, "beta_inter": beta_inter}


def _bandwidth(comm, group, buf, d: int) -> float:
    """Bytes one rank sends per second in a ring all-reduce, the slowest rank's view (on an
    accelerator the host waits for the device: NCCL's collectives return once enqueued)."""
    import torch
    import torch.distributed as dist

    def sync() -> None:
        if buf.device.type != "cpu":
            torch.accelerator.synchronize(buf.device)

    comm.all_reduce(buf, group=group)  # warm-up
    times = []
    for _ in range(REPEATS):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        comm.all_reduce(buf, group=group)
        sync()
        times.append(time.perf_counter() - t0)
    slowest = torch.tensor([min(times)], dtype=torch.float64, device=buf.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return 2 * buf.numel() * buf.element_size() * (d - 1) / d / float(slowest)


LINKS = ("shared", "per-rank")


def bandwidths(topology: Topology, database: dict[str, Any] | None, links: str) -> perf.Bandwidths | None:
    """The Eq 5.7 inputs ``ds-ext tune`` ranks with. ``links="shared"``: Eq 5.7 as written, the
    rings of an axis across nodes share a node's NICs; ``"per-rank"``: every rank has its own
    share of each level's links (the machine ``ds_ext.comm.emulation`` emulates). A database
    (``ds-ext tune --measure``) gives the intra-node bandwidths and β_inter."""
    if links not in LINKS:
        raise ValueError(f"--links: {links!r}; allowed: {', '.join(LINKS)}")
    if database is None:
        return None if links == "shared" else perf.Bandwidths.per_rank_links(topology)
    intra = {tuple(int(v) for v in key.split(",")): bw for key, bw in database["intra"].items()}
    beta_inter = database.get("beta_inter")
    if beta_inter is None:
        default = perf.Bandwidths.from_topology if links == "shared" else perf.Bandwidths.per_rank_links
        beta_inter = default(topology).beta_inter
    return perf.Bandwidths(intra, beta_inter, ring_sharing=links == "shared")  # type: ignore[arg-type]
