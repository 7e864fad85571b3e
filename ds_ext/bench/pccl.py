"""``ds-ext bench pccl``: ring vs PCCL vs torch's native all-gather / reduce-scatter (001 §6.3, Fig 6.9).

One gloo world of 8 ranks laid out as 8 nodes x 1 rank and as 4 x 2. For every per-rank
buffer size (all-gather output / reduce-scatter input, 4 KB - 64 MB by default) and both
operations, each algorithm runs ``--repeats`` times interleaved (one call of each per round,
after a barrier); a call's time is the slowest rank's. The record keeps every call, the median
and the fastest. Speedups and crossovers are taken on the fastest call: the model is fed
fastest-of-N network figures (``ds_ext.cluster.measure``), since contention and scheduling
only ever add time, so its predictions are compared with the measurement taken the same way.
A row's ``tie_band`` is how precisely that minimum is known: the larger of ring's and pccl's
gap between their fastest and second-fastest call (relative). The ring is *ahead* where
pccl / ring < 1 - tie_band; the crossover is the smallest size from which the ring is ahead at
every larger size (``None``: nowhere, e.g. where both tie at large sizes). The medians' speedup
and crossover (ring faster by any margin) are kept beside it.

``--network emulate`` (ALPHA-BETA EMULATION, not a network): the ranks share one host's
loopback, and each collective is held until its alpha-beta time on the emulated topology
(``ds_ext.comm.emulation``; scaled by ``--time-scale``) has passed: ring and pccl for the time
``ds_ext.perf.collectives`` predicts, native for the emulator's (d - 1) messages at the group
level. The measured crossover is then the model's crossover plus what gloo's point-to-point
really costs on this host, not evidence that the model is right.

``--network netns``: no emulation. Each layout runs on its own emulated cluster
(``ds_ext.cluster``): 8 nodes of one rank, and 4 nodes of 2 ranks, every node link shaped to
``--node-rate``; with ``--gpu-rate`` the 2 ranks of a node sit on 2 GPUs, each behind its own
link of that rate (else they share a namespace and its loopback). The network is measured
first (``ds_ext.cluster.measure``: per level one flow's bandwidth, the per-rank bandwidth with
every rank exchanging across the level at once, and the job's step latency); the predicted
times and crossover are ``ds_ext.perf.collectives`` fed those measured α and β
(``measured_topology``; nothing fitted to the collectives' times).

Every rank first has glibc keep the memory it frees (:func:`keep_freed_memory`), as a GPU
job's caching allocator does: by default glibc maps each block of 32 MB and more afresh and
unmaps it on free, so every call paid the first touch of its large temporaries, and only pccl
has such (its reduce-scatter's first receive buffer, the node phase's shuffle buffers): on 8 x 1
its reduce-scatter trailed the ring by 0.1-0.5 % at 64 MB in four runs of four, its all-gather
(no temporary there) did not. The JSON says what was set.

Writes JSON (every record, the predicted and measured crossover of each layout and operation)
and a PNG heatmap of the pccl-over-ring speedup like 001 Fig 6.9.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from ds_ext.bench import median, write_json
from ds_ext.cluster.world import refuse_link_flags_when_emulating

WORLD = 8
LAYOUTS = {"8x1": 1, "4x2": 2}  # name -> ranks per emulated node
ALGOS = ("ring", "pccl", "native")
OPS = ("all_gather", "reduce_scatter")
# emulated links: inside a node 50 GB/s and 8 us per message, across nodes 12.5 GB/s per rank and
# 15 us (the Frontier preset's gpu and node levels, ds_ext/topology.py)
INTRA = (50.0, 8.0)
INTER = (12.5, 15.0)
EMULATE_LABEL = "ALPHA-BETA EMULATION on one host (not a network)"
NETNS_LABEL = "shaped network (network namespaces, tc tbf), no emulation; model fed the measured network"


def _size(text: str) -> int:
    """Bytes from ``4096``, ``4K`` or ``64M`` (powers of 1024)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B")
    try:
        return int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a size in bytes such as 4096, 4K or 64M, got {text!r}") from None


def _repeats(text: str) -> int:
    n = int(text)
    if n < 2:
        raise argparse.ArgumentTypeError(
            f"--repeats needs at least 2 calls (the tie band compares the two fastest), got {n}"
        )
    return n


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="JSON file to write (the PNG goes next to it)")
    p.add_argument("--min-size", type=_size, default=4 << 10, help="smallest per-rank buffer (4K, 1M, ...)")
    p.add_argument("--max-size", type=_size, default=64 << 20, help="largest per-rank buffer (4K, 1M, ...)")
    p.add_argument(
        "--repeats",
        type=_repeats,
        default=5,
        help="calls per algorithm and size, at least 2 (the second-fastest bounds the tie band)",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=100.0,
        help="multiply emulated times so that they dominate gloo's own cost on one host",
    )
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per layout before the world is killed")
    p.add_argument(
        "--network",
        choices=("emulate", "netns"),
        default="emulate",
        help="emulate: alpha-beta holds on one host's loopback; netns: no emulation, each layout's "
        "nodes as network namespaces with shaped links (--node-rate, --gpu-rate)",
    )
    p.add_argument("--node-rate", default=None, metavar="RATE", help="netns: each node's link, e.g. 200mbit")
    p.add_argument(
        "--gpu-rate",
        default=None,
        metavar="RATE",
        help="netns: each GPU's link inside a node of the 4x2 layout (one rank per GPU), e.g. 400mbit; "
        "without it the node's 2 ranks share its loopback",
    )


def _sizes(lo: int, hi: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 2
    return out


def _topology_block(per_node: int) -> dict[str, Any]:
    return {
        "levels": [
            {"name": "local", "size": per_node, "bandwidth_GBps": INTRA[0], "latency_us": INTRA[1]},
            {"name": "node", "bandwidth_GBps": INTER[0], "latency_us": INTER[1]},
        ],
        "emulate": True,
    }


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
KEEP_FREED = "glibc mallopt: M_MMAP_MAX 0 (no block mapped on its own), M_TRIM_THRESHOLD 1 GiB (freed memory kept)"


def keep_freed_memory() -> str:
    """Make this process's allocator keep freed memory for reuse (module docstring): with glibc,
    serve every block from the heap and do not return freed memory to the system (a large
    temporary then costs its first touch once, not on every call). Returns what was set,
    or why nothing was (another C library), for the JSON."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return f"system default: {name or 'no C library found'} is not glibc"
    if not (libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)):
        raise RuntimeError("glibc refused mallopt(M_MMAP_MAX, 0) / mallopt(M_TRIM_THRESHOLD, 1 GiB)")
    return KEEP_FREED


def _measure(per_node: int, sizes: list[int], repeats: int, time_scale: float | None) -> list[dict[str, Any]]:
    """On every rank: the per-call seconds of each (op, size, algorithm), and its ledger
    (``time_scale`` None: no emulation, a real network); the allocator setting in every record."""
    import torch
    import torch.distributed as dist

    from ds_ext import config as cfgmod
    from ds_ext.runtime import Runtime

    allocator = keep_freed_memory()
    rt = Runtime.create(
        cfgmod.parse(
            {
                "topology": _topology_block(per_node),
                "comm": {"emulate_time": time_scale is not None, "time_scale": time_scale or 1.0},
            }
        )
    )
    comm = rt.comm
    out = []
    for op in OPS:
        for size in sizes:
            numel = size // 4
            chunk = numel // WORLD
            big = torch.randn(chunk * WORLD)
            small = torch.randn(chunk)
            times: dict[str, list[float]] = {a: [] for a in ALGOS}
            ledger: dict[str, dict[str, tuple[float, int]]] = {}
            for rnd in range(repeats + 1):  # round 0 warms up
                for algo in ALGOS:
                    dist.barrier()
                    comm.ledger.reset()
                    t0 = time.perf_counter()
                    if op == "all_gather":
                        comm.all_gather(big, small, algorithm=algo)
                    else:
                        comm.reduce_scatter(small, big.clone(), algorithm=algo)
                    dt = time.perf_counter() - t0
                    if rnd:
                        times[algo].append(dt)
                    step = comm.ledger.mark_step()
                    ledger[algo] = {lv: (b, step.messages_by_level()[lv]) for lv, b in step.by_level().items()}
            out.append(
                {
                    "op": op,
                    "size": chunk * WORLD * 4,
                    "chunk_bytes": chunk * 4,
                    "times": times,
                    "ledger": ledger,
                    "allocator": allocator,
                }
            )
    return out


def _crossover(
    records: list[dict[str, Any]], key: str = "speedup_pccl_over_ring", band: str | None = "tie_band"
) -> float | None:
    """Smallest buffer size from which the ring is ahead of pccl at every larger size: its
    ``key`` speedup below 1 by more than the row's ``band`` (no band: by any margin)."""
    cross = None
    for r in sorted(records, key=lambda r: r["size"], reverse=True):
        if r[key] < 1 - (r[band] if band else 0.0):
            cross = r["size"]
        else:
            break
    return cross


def _resolution(calls: list[float]) -> float:
    """How precisely the fastest of ``calls`` is known: the second-fastest's excess over it."""
    fast = sorted(calls)
    return fast[1] / fast[0] - 1


def plot(payload: dict[str, Any], path) -> None:
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    from ds_ext import plotting

    layouts, sizes = payload["layouts"], payload["sizes"]
    fig = plotting.figure(figsize=(9, 6))
    axes = fig.subplots(1, 2)
    for ax, op in zip(axes, OPS):
        grid = np.full((len(sizes), len(layouts)), np.nan)
        for r in payload["records"]:
            if r["op"] == op:
                grid[sizes.index(r["size"]), layouts.index(r["layout"])] = r["speedup_pccl_over_ring"]
        im = ax.imshow(
            grid,
            origin="lower",
            cmap="RdYlGn",
            aspect="auto",
            norm=TwoSlopeNorm(vcenter=1.0, vmin=min(0.5, np.nanmin(grid)), vmax=max(2.0, np.nanmax(grid))),
        )
        for (i, j), v in np.ndenumerate(grid):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
        for j, lay in enumerate(layouts):
            pred = payload["crossover"][lay][op]["predicted_size"]
            if pred is not None and sizes[0] <= pred <= sizes[-1]:
                ax.plot([j - 0.5, j + 0.5], [np.log2(pred / sizes[0])] * 2, "k--", lw=1.5)
        ax.set_xticks(range(len(layouts)), [f"{lay} ({WORLD} ranks)" for lay in layouts])
        ax.set_yticks(range(len(sizes)), [_human(s) for s in sizes], fontsize=7)
        ax.set_title(f"{op}: pccl / ring speedup (fastest call)")
        ax.set_ylabel("per-rank buffer (all-gather output / reduce-scatter input)")
        fig.colorbar(im, ax=ax, fraction=0.05)
    fig.suptitle(f"{payload['label']}; dashed: the model's crossover", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024:
            return f"{n:g} {unit}"
        n /= 1024
    return f"{n:g} TB"


def _cluster_spec(args: argparse.Namespace, per_node: int):
    """``--network netns``: the cluster of one layout (see module docstring)."""
    from ds_ext.cluster.spec import ClusterError, ClusterSpec, LinkShape, parse_rate

    if args.node_rate is None:
        raise ClusterError("bench pccl --network netns needs --node-rate (e.g. 200mbit)")
    gpus = per_node if args.gpu_rate is not None and per_node > 1 else 1
    gpu = LinkShape.of(parse_rate(args.gpu_rate)) if gpus > 1 else None
    return ClusterSpec(WORLD // per_node, per_node, LinkShape.of(parse_rate(args.node_rate)), gpus, gpu)


def _layout_run(args: argparse.Namespace, per_node: int, sizes: list[int]):
    """One layout's per-rank measurements, the topology its predictions use, and (netns) the
    measured network: the emulated topology, or the measured one (α, β per level)."""
    from ds_ext import config as cfgmod
    from ds_ext.local_world import World
    from ds_ext.topology import detect_environment, resolve_topology

    if args.network == "emulate":
        topo = resolve_topology(
            cfgmod.parse({"topology": _topology_block(per_node)}).topology, WORLD, detect_environment({})
        )
        with World(WORLD, {"LOCAL_SIZE": str(WORLD)}, timeout=args.timeout) as world:
            return world.run(_measure, per_node, sizes, args.repeats, args.time_scale), topo, None
    from ds_ext.cluster.measure import measure, measured_topology
    from ds_ext.cluster.world import BENCH_MESSAGE_BYTES, cluster_world

    with cluster_world(_cluster_spec(args, per_node), timeout=args.timeout) as world:
        network = world.run(measure, BENCH_MESSAGE_BYTES)[0]
        per_rank = world.run(_measure, per_node, sizes, args.repeats, None)
    names = ("node",) if per_node == 1 else ("local", "node")
    return per_rank, measured_topology(network, names), network


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ds_ext.perf import collectives as model

    netns = args.network == "netns"
    refuse_link_flags_when_emulating(args)
    scale = 1.0 if netns else args.time_scale
    sizes = _sizes(args.min_size, args.max_size)
    records: list[dict[str, Any]] = []
    crossover: dict[str, dict[str, Any]] = {}
    networks: dict[str, Any] = {}
    allocators: set[str] = set()
    for layout in args.layouts:
        per_node = LAYOUTS[layout]
        per_rank, topo, networks[layout] = _layout_run(args, per_node, sizes)
        allocators |= {rec["allocator"] for rank in per_rank for rec in rank}
        rows = []
        for k, rec in enumerate(per_rank[0]):
            calls = {a: [max(r[k]["times"][a][i] for r in per_rank) for i in range(args.repeats)] for a in ALGOS}
            med = {a: median(c) for a, c in calls.items()}
            fast = {a: min(c) for a, c in calls.items()}
            predicted = {
                a: scale * model.time(a, topo, tuple(range(WORLD)), rec["chunk_bytes"]) for a in ("ring", "pccl")
            }
            rows.append(
                {
                    "layout": layout,
                    "op": rec["op"],
                    "size": rec["size"],
                    "chunk_bytes": rec["chunk_bytes"],
                    "calls_s": calls,
                    "median_s": med,
                    "fastest_s": fast,
                    "predicted_s": predicted,
                    "ledger": rec["ledger"],
                    "speedup_pccl_over_ring": fast["ring"] / fast["pccl"],
                    "tie_band": max(_resolution(calls["ring"]), _resolution(calls["pccl"])),
                    "speedup_pccl_over_native": fast["native"] / fast["pccl"],
                    "median_speedup_pccl_over_ring": med["ring"] / med["pccl"],
                    "predicted_speedup_pccl_over_ring": predicted["ring"] / predicted["pccl"],
                }
            )
        records += rows
        crossover[layout] = {}
        star = model.crossover(topo, tuple(range(WORLD)))
        for op in OPS:
            of_op = [r for r in rows if r["op"] == op]
            measured = _crossover(of_op)
            predicted = None if star is None else star * WORLD
            ratio = None if measured is None or predicted is None else measured / predicted
            agrees = (measured is None) if predicted is None else (ratio is not None and 0.5 <= ratio <= 2)
            crossover[layout][op] = {
                "predicted_size": predicted,
                "measured_size": measured,
                "ratio": ratio,
                "agrees": agrees,
                "measured_size_median": _crossover(of_op, "median_speedup_pccl_over_ring", None),
            }
    label = NETNS_LABEL if netns else EMULATE_LABEL
    payload = {
        "benchmark": "pccl",
        "network": args.network,
        "emulation": None if netns else label,
        "world": WORLD,
        "repeats": args.repeats,
        "layouts": list(args.layouts),
        "sizes": sizes,
        "records": records,
        "crossover": crossover,
        "label": label,
        "allocator": sorted(allocators),
        **(
            {"node_rate": args.node_rate, "gpu_rate": args.gpu_rate, "measured_network": networks}
            if netns
            else {
                "intra_node": {"GBps": INTRA[0], "us": INTRA[1]},
                "inter_node": {"GBps": INTER[0], "us": INTER[1]},
                "time_scale": args.time_scale,
            }
        ),
    }
    out = write_json(args.out, payload)
    plot(payload, out.with_suffix(".png"))
    print("fastest call of each (slowest rank); median speedup beside it")
    print(
        f"{'layout':<6} {'op':<15} {'size':>8} {'ring ms':>9} {'pccl ms':>9} {'native ms':>9} "
        f"{'pccl/ring':>9} {'tie band':>8} {'predicted':>9} {'median':>7}"
    )
    for r in records:
        m = r["fastest_s"]
        print(
            f"{r['layout']:<6} {r['op']:<15} {_human(r['size']):>8} {m['ring'] * 1e3:9.2f} {m['pccl'] * 1e3:9.2f} "
            f"{m['native'] * 1e3:9.2f} {r['speedup_pccl_over_ring']:9.2f} {r['tie_band']:8.3f} "
            f"{r['predicted_speedup_pccl_over_ring']:9.2f} {r['median_speedup_pccl_over_ring']:7.2f}"
        )
    for layout, ops in crossover.items():
        for op, c in ops.items():
            print(
                f"crossover {layout} {op}: predicted {c['predicted_size']}, measured {c['measured_size']} "
                f"(medians: {c['measured_size_median']}), ratio {c['ratio']}, agrees {c['agrees']}"
            )
    print(f"allocator: {'; '.join(sorted(allocators))}")
    print(f"wrote {out} and {out.with_suffix('.png')} ({label})")
    return payload
