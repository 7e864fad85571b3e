"""Bytes on an emulated cluster's links, run by the ranks of tests/test_cluster_nic.py (a NIC per GPU)
and tests/test_cluster_gcd.py (every level shaped): point-to-point sends between pairs, and one
collective through ds_ext's ledger, its link bytes beside the kernel's counters."""

from __future__ import annotations

MESSAGE = 2**20
WIRE_OVERHEAD = 0.03  # headers and gloo framing on the payload: docs/cluster.md, "Bytes on the wire"
STRAY = 16_000  # bytes a link may carry in a region without payload: barriers, ARP
ACKS = 0.01  # TCP acknowledgements up a link, per byte it delivered (measured 0.4 %)

LINK_KINDS = [
    "world_all_reduce",
    "world_all_gather",
    "world_reduce_scatter",
    "world_all_to_all",
    "world_broadcast",
    "ring",
    "pccl",
    "torch_reduce_scatter",
    "torch_reduce",
    "torch_all_to_all",
]


def links_and_wire(kind: str, nbytes: int, gcd: bool) -> tuple[dict[str, float], dict | None]:
    """One collective of ``nbytes`` per rank over the world (2 nodes x 2 GPUs, x 2 GCDs with ``gcd``;
    ``world_*``: through ds_ext's
    Communicator, ``ring`` / ``pccl``: its point-to-point algorithms, ``torch_*``: torch.distributed
    called as DeepSpeed calls it, under ds_ext's instrumentation), after a warm-up; this rank's
    link bytes per level (``ds_ext.comm.hops``) and, on rank 0, the bytes each link carried."""
    import torch
    import torch.distributed as dist

    from ds_ext.cluster.wire import wire_region
    from ds_ext.comm import Communicator
    from ds_ext.comm.instrument import instrument_torch_distributed
    from ds_ext.groups import GroupRegistry
    from ds_ext.topology import GB, US, Level, Topology

    levels = [Level("gpu", 2, 1 * GB, 8 * US), Level("node", None, 1 * GB, 15 * US)]
    if gcd:
        levels.insert(0, Level("gcd", 2, 1 * GB, 5 * US))
    d = dist.get_world_size()
    comm = Communicator(GroupRegistry(Topology.build(levels, d, "cluster")))
    x = torch.ones(nbytes // 4)
    out, part = torch.empty(d * x.numel()), torch.empty(x.numel() // d)

    def collective() -> None:
        if kind == "world_all_reduce":
            comm.all_reduce(x)
        elif kind == "world_all_gather":
            comm.all_gather(out, x)
        elif kind == "world_reduce_scatter":  # gloo: an all_to_all of the chunks
            comm.reduce_scatter(part, x)
        elif kind == "world_all_to_all":
            comm.all_to_all(torch.empty_like(x), x)
        elif kind == "world_broadcast":
            comm.broadcast(x, src=1)
        elif kind in ("ring", "pccl"):
            comm.all_gather(out, x, algorithm=kind)
            comm.reduce_scatter(part, x, algorithm=kind)
        else:
            with instrument_torch_distributed(comm):
                if kind == "torch_reduce_scatter":  # DeepSpeed's ZeRO on gloo: an all-reduce of the input
                    dist.reduce_scatter_tensor(part, x)
                elif kind == "torch_reduce":
                    dist.reduce(x, dst=2)
                elif kind == "torch_all_to_all":  # uneven: rows 1, 2, 3, 0, 1, ... to ranks 0, 1, 2, 3, 4, ...
                    row, splits = nbytes // 16, [(i + 1) % 4 for i in range(d)]  # rows of nbytes / 4
                    mine = splits[dist.get_rank()]
                    dist.all_to_all_single(torch.empty(d * mine, row), torch.ones(sum(splits), row), [mine] * d, splits)

    collective()  # warm-up: connections
    comm.ledger.reset()
    with wire_region() as region:
        collective()
    return comm.ledger.current.link_bytes_by_level(), region.bytes.links if region.bytes else None


def assert_links_match_the_wire(world, kind: str, gcd: bool, owners: dict[str, tuple[str, list[int]]]) -> None:
    """Each link of ``owners`` (name -> (its level, the ranks that send up it)) carried up the link
    bytes its ranks booked at its level, within ``WIRE_OVERHEAD`` + ``STRAY`` + ``ACKS`` of what it
    delivered down; retried up to 3 times (a loaded host adds spurious TCP retransmissions, never
    removes bytes). At least one link of the outermost level carries ``MESSAGE`` / 2 or more."""
    for _ in range(3):
        results = world.run(links_and_wire, kind, 2 * MESSAGE, gcd)
        links, misses = results[0][1], []
        for name, (level, ranks) in owners.items():
            want = sum(results[r][0].get(level, 0.0) for r in ranks)
            moved = links[name]
            most = want * (1 + WIRE_OVERHEAD) + STRAY + ACKS * moved["down"]
            if not want <= moved["up"] <= most:
                misses.append((name, want, moved, most))
        if not misses:
            break
    assert not misses, (kind, misses)
    assert any(booked.get("node", 0.0) >= MESSAGE / 2 for booked, _ in results)


def send_pairs(pairs: list[tuple[int, int]], nbytes: int) -> tuple[float, dict | None]:
    """Each pair (a, b): ``nbytes`` a -> b, all at once, between barriers; this rank's time and,
    on rank 0, the bytes each link carried meanwhile."""
    import time

    import torch
    import torch.distributed as dist

    from ds_ext.cluster.wire import wire_region

    rank = dist.get_rank()
    buf = torch.zeros(nbytes // 4)
    with wire_region() as region:
        t0 = time.perf_counter()
        works = [dist.isend(buf, b) for a, b in pairs if a == rank] + [
            dist.irecv(buf, a) for a, b in pairs if b == rank
        ]
        for w in works:
            w.wait()
        seconds = time.perf_counter() - t0
    return seconds, region.bytes.links if region.bytes else None
