"""Measure the network of an emulated cluster from its ranks: per level, point-to-point
bandwidth, latency and all-gather bandwidth, with gloo over the shaped links.

Run on every rank by ``ds-ext cluster`` / ``ds-ext tune --measure --network netns``
(``python -m ds_ext.cluster.measure --out FILE``); reads the cluster's shape from
``DS_EXT_CLUSTER`` (set by :mod:`ds_ext.cluster.launch`). Levels are the link classes a pair
of ranks talks over (:meth:`ClusterSpec.level_of_pair`): ``local`` (one namespace, loopback) or,
with GCD links, ``gcd`` (the GCDs of one GPU), ``gpu`` (two GPUs of one node, when the cluster
has a GPU level) and ``node``.

For each level, with rank 0 and the first rank ``b`` across that level:

* latency: half the fastest round trip of a 4-byte message, 0 -> b -> 0;
* point-to-point bandwidth: ``message`` bytes 0 -> b, then a 4-byte reply, bytes over the
  fastest time (the reply's latency is left in: it makes the figure a lower bound);
* all-gather bandwidth over the ranks that span the level (``span``: all ranks for ``node``,
  the ranks of node 0 for ``gpu``, of GPU 0 for ``local`` / ``gcd``), ``message`` bytes from
  each; ring bus bandwidth ``(g - 1) * message / t``, the bytes each rank receives per second.
  gloo's ring runs in rank order, so with two or more ranks per namespace each shaped link
  carries one ring connection per direction and the figure should match the link's rate;
* the same over the cross group (one rank per domain: rank 0 of every node / GPU). With two
  domains that is a 2-rank all-gather, whose two directions share one gloo connection (it
  reaches less of the rate than the span all-gather; docs/benchmarks/network.md): reported,
  not checked against the rate.

* shared bandwidth: every rank exchanges ``message`` bytes both ways, at once, with the rank at
  its position in the partner domain across the level (domain index XOR 1: node i with node
  i ^ 1, GPU g with GPU g ^ 1 of its node, in a GPU rank q with q ^ 1); ``message`` over
  the slowest rank's time, the fastest of ``REPEATS``. It is what one rank gets while all ranks
  use the level (``Level.bandwidth``): the ranks behind one link share it, and on the shaped
  cluster two TCP flows through one tbf link move less together than one alone.

And once for the job: the step latency, a ring step's time per 4-byte message with every
rank exchanging at once (send to r + 1, receive from r - 1; the fastest of ``STEP_REPEATS``
runs of W - 1 steps, over W - 1; fewer runs leave the minimum far from its floor). It is what
a collective's message costs when all W ranks of the job communicate: on a host whose cores
serve every rank it is far above an idle pair's latency, and it is the latency a collective
sees (figures: docs/benchmarks/network.md).

Rank 0 writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from ds_ext.cluster.spec import ClusterSpec, LinkShape
from ds_ext.topology import Level, Topology

PING_REPEATS = 20
STEP_REPEATS = 100
REPEATS = 10  # fastest of 10: a contended 2-core host still finds a clean transfer
PG_TIMEOUT_S = 120


def spec_from_env() -> ClusterSpec:
    """The cluster this rank runs in, from ``DS_EXT_CLUSTER``."""
    return spec_from_json(json.loads(os.environ["DS_EXT_CLUSTER"]))


def spec_from_json(d: dict[str, Any]) -> ClusterSpec:
    """The inverse of :meth:`ClusterSpec.to_json`."""
    gpu = LinkShape(d["gpu_rate_bps"], d["gpu_burst_bytes"]) if "gpu_rate_bps" in d else None
    gcd = LinkShape(d["gcd_rate_bps"], d["gcd_burst_bytes"]) if "gcd_rate_bps" in d else None
    return ClusterSpec(
        d["nodes"],
        d["ranks_per_node"],
        LinkShape(d["node_rate_bps"], d["node_burst_bytes"]),
        d["gpus_per_node"],
        gpu,
        d.get("nic", "per-node"),
        gcd,
    )


def level_partners(spec: ClusterSpec) -> dict[str, int]:
    """For each level present, the lowest rank that talks to rank 0 over it."""
    out: dict[str, int] = {}
    for b in range(1, spec.world_size):
        out.setdefault(spec.level_of_pair(0, b), b)
    return out


def span_group(spec: ClusterSpec, level: str) -> list[int]:
    """The ranks of the first domain that ``level`` joins: GPU 0, node 0, or the world."""
    size = {"gpu": spec.ranks_per_node, "node": spec.world_size}.get(level, spec.ranks_per_gpu)
    return list(range(size))


def cross_group(spec: ClusterSpec, level: str) -> list[int]:
    """One rank per domain of ``level`` inside the first domain of the level above: the ranks of
    GPU 0 (``local``, ``gcd``), rank 0 of every GPU of node 0 (``gpu``), of every node (``node``)."""
    if level in ("local", "gcd"):
        return list(range(spec.ranks_per_gpu))
    if level == "gpu":
        return list(range(0, spec.ranks_per_node, spec.ranks_per_gpu))
    return list(range(0, spec.world_size, spec.ranks_per_node))


def _timed(fn, repeats: int) -> float:
    """Fastest wall time of ``fn`` over ``repeats`` runs, each started after a barrier: on a
    shaped link CPU contention only adds time, so the fastest run is the link's (the bucket's
    burst, about 10 KB against 1-2 MB messages, is the only way to beat the rate)."""
    import torch.distributed as dist

    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _pair(rank: int, a: int, b: int, payload, reply) -> None:
    """``payload`` a -> b, then ``reply`` b -> a; other ranks do nothing."""
    import torch.distributed as dist

    if rank == a:
        dist.send(payload, b)
        dist.recv(reply, b)
    elif rank == b:
        dist.recv(payload, a)
        dist.send(reply, a)


def _gather(member: bool, out, inp, group) -> None:
    """All-gather ``inp`` into ``out`` over ``group`` when this rank is a member."""
    import torch.distributed as dist

    if member:
        dist.all_gather_into_tensor(out, inp, group=group)


def measure(message_bytes: int) -> dict[str, Any]:
    """Every measurement of the module docstring; called on every rank, the result on rank 0."""
    import torch
    import torch.distributed as dist

    spec = spec_from_env()
    rank = dist.get_rank()
    small = torch.zeros(1, dtype=torch.float32)
    big = torch.zeros(message_bytes // 4, dtype=torch.float32)
    downward = dist.new_group(list(range(spec.world_size)))  # a pair's second connection (_exchange)
    levels: dict[str, Any] = {}
    for level, b in level_partners(spec).items():
        _pair(rank, 0, b, small, small)  # warm-up: connection and buffers
        rtt = _timed(lambda: _pair(rank, 0, b, small, small), PING_REPEATS)
        t_p2p = _timed(lambda: _pair(rank, 0, b, big, small), REPEATS)
        rate = spec.path_rate_bps(level)
        levels[level] = {
            "pair": [0, b],
            "latency_s": rtt / 2,
            "p2p_bytes_per_s": message_bytes / t_p2p,
            "shaped_bytes_per_s": None if rate is None else rate / 8,
        }
        span, cross = span_group(spec, level), cross_group(spec, level)
        span_bw = _allgather_bandwidth(rank, span, big)
        levels[level].update(
            allgather_span_group=span,
            allgather_span_bytes_per_s=span_bw,
            allgather_cross_group=cross,
            allgather_cross_bytes_per_s=(span_bw if cross == span else _allgather_bandwidth(rank, cross, big)),
        )
        partner = exchange_partner(spec, level, rank)
        back = torch.empty_like(big)
        _exchange(rank, partner, big, back, downward)  # warm-up: the pairs' second connections
        t_shared = _timed_slowest(lambda: _exchange(rank, partner, big, back, downward), REPEATS)
        levels[level]["shared_bytes_per_s"] = message_bytes / t_shared
    world = dist.get_world_size()
    step = None
    if world > 1:
        _ring_steps(rank, world, small, small.clone())  # warm-up
        step = _timed(lambda: _ring_steps(rank, world, small, small.clone()), STEP_REPEATS) / (world - 1)
    return {
        "network": "netns",
        "cluster": spec.to_json(),
        "message_bytes": message_bytes,
        "levels": levels,
        "step_latency_s": step,
    }


def exchange_partner(spec: ClusterSpec, level: str, rank: int) -> int | None:
    """The rank ``rank`` exchanges with in the shared-bandwidth measurement: its position in the
    domain of ``level`` whose index is its own XOR 1 (None: that domain does not exist)."""
    unit = {"gpu": spec.ranks_per_gpu, "node": spec.ranks_per_node}.get(level, 1)
    count = {"gpu": spec.gpus_per_node, "node": spec.nodes}.get(level, spec.ranks_per_gpu)
    index = rank // unit % count
    return None if index ^ 1 >= count else rank + ((index ^ 1) - index) * unit


def _exchange(rank: int, partner: int | None, send, recv, downward) -> None:
    """``send`` to ``partner`` and ``recv`` from it at once; a message to a lower rank goes over
    ``downward``, so the two directions use two connections (gloo moves one connection's two
    directions one after the other)."""
    import torch.distributed as dist

    if partner is None:
        return
    works = [
        dist.isend(send, partner, group=None if partner > rank else downward),
        dist.irecv(recv, partner, group=None if rank > partner else downward),
    ]
    for w in works:
        w.wait()


def _timed_slowest(fn, repeats: int) -> float:
    """Fastest over ``repeats`` runs (each after a barrier) of the slowest rank's wall time."""
    import torch
    import torch.distributed as dist

    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    return min(times)


def _ring_steps(rank: int, world: int, send, recv) -> None:
    """``world`` - 1 ring steps of one message: to ``rank`` + 1 and from ``rank`` - 1 at once."""
    import torch.distributed as dist

    for _ in range(world - 1):
        ops = [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _allgather_bandwidth(rank: int, members: list[int], inp) -> float:
    """Ring bus bandwidth of an all-gather of ``inp`` over ``members`` (every rank calls this)."""
    import torch
    import torch.distributed as dist

    group = dist.new_group(members)
    out = torch.empty(len(members) * inp.numel(), dtype=inp.dtype)
    member = rank in members
    _gather(member, out, inp, group)  # warm-up: the group's connections
    t = _timed(lambda: _gather(member, out, inp, group), REPEATS)
    return (len(members) - 1) * inp.numel() * inp.element_size() / t


def allgather_correct() -> bool:
    """Rank r contributes the 1000 values ``1000 r ... 1000 r + 999``; True when every rank
    received every rank's values in rank order."""
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    mine = torch.arange(1000, dtype=torch.float32) + 1000 * rank
    out = torch.empty(world * 1000, dtype=torch.float32)
    dist.all_gather_into_tensor(out, mine)
    want = torch.arange(world * 1000, dtype=torch.float32)
    ok = torch.tensor([int(torch.equal(out, want))])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


LEVEL_ORDER = ("local", "gcd", "gpu", "node")


def measured_topology(db: dict[str, Any], names: tuple[str, ...]) -> Topology:
    """A :class:`~ds_ext.topology.Topology` whose levels are the measured network of ``db``
    (what :func:`measure` returns), named ``names`` innermost first (e.g. gcd, gpu, node for
    local, gpu, node), so that ``ds_ext.perf`` models can be fed measured links.

    ``Level.bandwidth`` is per rank while all ranks use the level: the shared bandwidth where
    measured; else (a measurement from before it was taken) the point-to-point bandwidth
    divided among the ranks behind the link (a GPU link's or a GPU's NIC by the ranks of a GPU, a
    node link's by the ranks of a node; a GCD link and loopback as measured). ``Level.link_bandwidth`` is one
    flow's: the point-to-point bandwidth. Latency: half the idle pair's round trip, or the job's step
    latency where that is longer (every rank of a collective communicates at once; a
    measurement without it gives the pair's)."""
    spec = spec_from_json(db["cluster"])
    present = [lv for lv in LEVEL_ORDER if lv in db["levels"]]
    if len(present) != len(names):
        raise ValueError(f"the cluster measured levels {present}; cannot name them {list(names)}")
    behind_nic = spec.ranks_per_gpu if spec.nic == "per-gpu" else spec.ranks_per_node
    sharing = {"local": 1, "gcd": 1, "gpu": spec.ranks_per_gpu, "node": behind_nic}
    sizes = {"local": spec.ranks_per_gpu, "gcd": spec.ranks_per_gpu, "gpu": spec.gpus_per_node, "node": spec.nodes}
    step = db.get("step_latency_s") or 0.0
    levels = []
    for name, lv in zip(names, present):
        got = db["levels"][lv]
        shared = got.get("shared_bytes_per_s") or got["p2p_bytes_per_s"] / sharing[lv]
        levels.append(
            Level(name, sizes[lv], shared, max(got["latency_s"], step), link_bandwidth=got["p2p_bytes_per_s"])
        )
    return Topology(tuple(levels), "measured-netns")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON written by rank 0")
    p.add_argument("--message-bytes", type=int, default=2 * 2**20)
    ns = p.parse_args(argv)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=PG_TIMEOUT_S))
    try:
        result = {"allgather_correct": allgather_correct(), **measure(ns.message_bytes)}
        if dist.get_rank() == 0:
            Path(ns.out).write_text(json.dumps(result, indent=2) + "\n")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
