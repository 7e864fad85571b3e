"""``ds-ext bench ledger``: what the communication ledger adds to each collective.

The ledger is meant to stay on in production, where groups span thousands of ranks
(Frontier: 1,176 nodes x 8 GCDs = 9,408). Per collective it finds the topology level the
group spans, records the bytes, and (for third-party calls through torch.distributed)
binds the call's arguments. This benchmark times, in one process and one thread, with no
process group (group handles are registered with their ranks as torch would report them):

* ``first_call_us``: the first collective on a group, which computes its level once;
* ``account_us``: every later ``Communicator.account`` (level look-up + ledger record);
* ``wrapper_us``: the whole instrumented ``torch.distributed.all_reduce`` wrapper around a
  no-op collective (argument binding, volume, account, error guard) minus the no-op;
* ``uncached_us``: the level computed per call as the ledger did before (coordinates of
  every rank, ``O(ranks x levels)``), for the ratio.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

from ds_ext.bench import median, write_json

FRONTIER_NODES = 1176


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--nodes", type=int, default=FRONTIER_NODES, help="Frontier nodes (8 GCDs each)")
    p.add_argument("--calls", type=int, default=20_000, help="calls per timing")
    p.add_argument("--repeats", type=int, default=5)


def _per_call_us(fn: Callable[[], Any], calls: int, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    return median(out)


def _level_by_coordinates(topo, ranks) -> str | None:
    """The per-call level computation the ledger used before (for the ratio only)."""
    cs = [topo.coords(r) for r in ranks]
    for i in range(len(topo.levels) - 1, -1, -1):
        if len({c[i] for c in cs}) > 1:
            return topo.levels[i].name
    return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from ds_ext.comm import instrument
    from ds_ext.comm.collectives import Communicator
    from ds_ext.groups import GroupRegistry
    from ds_ext.topology import Topology

    torch.set_num_threads(1)
    topo = Topology.from_preset("frontier", 8 * args.nodes)
    world = topo.world_size
    groups = {
        "gcd pair": (0, 1),
        "node": tuple(range(8)),
        "same GCD on every node": tuple(range(0, world, 8)),
        "world": tuple(range(world)),
    }
    tensor = torch.empty(1024)

    def noop(tensor, op=None, group=None, async_op=False):
        return None

    records = []
    for name, ranks in groups.items():
        registry = GroupRegistry(topo)
        comm = Communicator(registry)
        handle = object()  # a process-group handle: the registry knows its ranks
        registry._ranks[handle] = ranks
        t0 = time.perf_counter()
        comm.account("all_reduce", handle, 4096, 2048)
        first = (time.perf_counter() - t0) * 1e6
        account = _per_call_us(lambda: comm.account("all_reduce", handle, 4096, 2048), args.calls, args.repeats)
        wrapped = instrument._wrap(comm, "all_reduce", noop)
        bare = _per_call_us(lambda: noop(tensor, group=handle), args.calls, args.repeats)
        wrapper = _per_call_us(lambda: wrapped(tensor, group=handle), args.calls, args.repeats) - bare
        uncached_calls = max(3, min(args.calls, 200_000 // len(ranks)))
        uncached = _per_call_us(lambda: _level_by_coordinates(topo, ranks), uncached_calls, 3) + account
        rec = {
            "group": name,
            "ranks": len(ranks),
            "level": registry.level(handle),
            "world": world,
            "first_call_us": first,
            "account_us": account,
            "wrapper_us": wrapper,
            "uncached_us": uncached,
            "speedup_vs_uncached": uncached / account,
        }
        records.append(rec)
        print(
            f"{name:<24} {len(ranks):>6} ranks ({rec['level']:>4}): first call {first:9.1f} us, then "
            f"account {account:5.2f} us, torch.distributed wrapper {wrapper:5.2f} us per call "
            f"(per-call level as before: {uncached:10.1f} us, {rec['speedup_vs_uncached']:,.0f}x)"
        )
    payload = {"benchmark": "ledger", "preset": "frontier", "world": world, "calls": args.calls, "records": records}
    out = write_json(args.out, payload)
    print(f"wrote {out}")
    return payload
