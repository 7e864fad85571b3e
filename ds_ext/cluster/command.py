"""``ds-ext cluster``: run a command on every rank of an emulated cluster; the cluster flags
and the measured-network run that ``ds-ext tune --measure --network netns`` uses.

    ds-ext cluster --nodes 2 --ranks-per-node 2 --node-rate 40mbit -- python train.py ...
    ds-ext cluster --config ds_config.json --nodes 2 --rate-scale 2000 -- python train.py ...
    ds-ext cluster --nic per-gpu --gpus-per-node 2 --gpu-rate 400mbit --node-rate 100mbit -- CMD  # a NIC per GPU
    ds-ext cluster --nic per-gpu --ranks-per-node 4 --gpus-per-node 2 --node-rate 100mbit --gpu-rate 400mbit \\
        --gcd-rate 800mbit -- CMD  # every level shaped, Frontier / 2000: a namespace and a link per GCD
    ds-ext cluster --node-rate 40mbit --wire-out wire.json -- CMD  # bytes each link carried, written at the end
    ds-ext cluster --check      # can this host build one? (exit 0, or 2 with the reason)
    ds-ext cluster --clean      # remove the leftovers of killed runs

``python -m ds_ext.cluster ...`` is the same command without the rest of ``ds-ext`` (the
runner then does not import torch: seconds saved per launch on a loaded host).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from ds_ext.cluster import launch, netns
from ds_ext.cluster.spec import NIC_SHAPES, ClusterError, ClusterSpec, LinkShape, parse_rate, spec_from_topology
from ds_ext.cluster.wire import WireCounters


def add_cluster_arguments(p: argparse.ArgumentParser, ranks_per_node: bool = True) -> None:
    """The flags that describe a cluster (``ranks_per_node=False``: the caller derives it)."""
    g = p.add_argument_group("emulated cluster (network namespaces, tc tbf links)")
    g.add_argument("--nodes", type=int, default=2, help="emulated nodes")
    if ranks_per_node:
        g.add_argument(
            "--ranks-per-node", type=int, default=None, help="ranks per node (default 2; from --config when given)"
        )
    g.add_argument(
        "--node-rate",
        default=None,
        metavar="RATE",
        help="each link out of a node (the node's, or with --nic per-gpu each GPU's NIC), both "
        "directions, e.g. 40mbit (or from --config)",
    )
    g.add_argument("--node-burst", type=int, default=None, metavar="BYTES", help="tbf bucket of a node link")
    g.add_argument("--gpus-per-node", type=int, default=1, help="> 1: a second shaped level, one link per GPU")
    g.add_argument("--gpu-rate", default=None, metavar="RATE", help="each GPU's link inside a node")
    g.add_argument("--gpu-burst", type=int, default=None, metavar="BYTES")
    g.add_argument(
        "--gcd-rate",
        default=None,
        metavar="RATE",
        help="each rank (GCD) in a namespace of its own with a link of this rate to the other GCDs "
        "of its GPU (needs 2 or more ranks per GPU; Frontier: 2x --gpu-rate, 8x a NIC); without it "
        "the ranks of a GPU share its namespace and talk over its unshaped loopback",
    )
    g.add_argument("--gcd-burst", type=int, default=None, metavar="BYTES")
    g.add_argument(
        "--nic",
        choices=NIC_SHAPES,
        default=None,
        help="per-node (default): one link out of each node, shared by its GPUs; per-gpu: a link out "
        "of the node for each GPU (Frontier: a NIC per MI250X), GPUs of a node joined by "
        "their --gpu-rate links",
    )
    g.add_argument("--config", default=None, help="ds_config JSON whose ds_ext.topology block gives the levels")
    g.add_argument("--gpu-level", action="store_true", help="--config: also shape the 'gpu' level")
    g.add_argument(
        "--gcd-level", action="store_true", help="--config with --gpu-level: also shape the 'gcd' level (GCD links)"
    )
    g.add_argument(
        "--rate-scale",
        type=float,
        default=1.0,
        help="--config: divide the topology's bandwidths by this (fit them to one host's CPU)",
    )


def spec_from_args(ns: argparse.Namespace, ranks_per_node: int | None = None) -> ClusterSpec:
    """The cluster the flags describe; explicit rate flags override ``--config``."""
    per_node = ranks_per_node or getattr(ns, "ranks_per_node", None)
    nic = ns.nic or "per-node"
    if ns.config is not None:
        block = json.loads(Path(ns.config).read_text()).get("ds_ext", {}).get("topology")
        if block is None:
            raise ClusterError(f"{ns.config} has no ds_ext.topology block")
        base = spec_from_topology(block, ns.nodes, ns.rate_scale, ns.gpu_level, nic, ns.gcd_level)
        if per_node is not None and per_node != base.ranks_per_node:
            raise ClusterError(f"{ns.config} has {base.ranks_per_node} ranks per node, not {per_node}")
        node = LinkShape.of(parse_rate(ns.node_rate), ns.node_burst) if ns.node_rate else base.node_link
        gpu = LinkShape.of(parse_rate(ns.gpu_rate), ns.gpu_burst) if ns.gpu_rate else base.gpu_link
        gcd = LinkShape.of(parse_rate(ns.gcd_rate), ns.gcd_burst) if ns.gcd_rate else base.gcd_link
        return ClusterSpec(ns.nodes, base.ranks_per_node, node, base.gpus_per_node, gpu, nic, gcd)
    if ns.node_rate is None:
        raise ClusterError("give --node-rate (e.g. 40mbit) or --config with a ds_ext.topology block")
    if ns.gcd_level:
        raise ClusterError("--gcd-level reads the 'gcd' level of --config; without --config give --gcd-rate")
    gpu = LinkShape.of(parse_rate(ns.gpu_rate), ns.gpu_burst) if ns.gpu_rate else None
    gcd = LinkShape.of(parse_rate(ns.gcd_rate), ns.gcd_burst) if ns.gcd_rate else None
    return ClusterSpec(
        ns.nodes,
        per_node or 2,
        LinkShape.of(parse_rate(ns.node_rate), ns.node_burst),
        ns.gpus_per_node,
        gpu,
        nic,
        gcd,
    )


def require_capability() -> None:
    """Raise with the one-line reason when this host cannot build a cluster."""
    problem = netns.capability_problem()
    if problem is not None:
        raise ClusterError(problem)


@contextmanager
def signals_unwind() -> Iterator[None]:
    """SIGTERM and SIGHUP raise ``SystemExit`` (as Ctrl-C raises KeyboardInterrupt) so that
    the cluster's cleanup runs; the previous handlers come back afterwards."""

    def _raise(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, _raise) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def run_on_cluster(
    spec: ClusterSpec,
    command: list[str],
    timeout: float | None = None,
    local_rank_arg: bool = False,
    wire_out: Path | None = None,
) -> int:
    """Build the cluster, run ``command`` on every rank, remove the cluster; the job's exit code.
    With ``wire_out``, the bytes every link carried during the job (:mod:`ds_ext.cluster.wire`)
    are written there as JSON, whatever the exit code."""
    require_capability()
    with signals_unwind(), netns.NetnsCluster(spec) as cluster:
        print(
            f"ds-ext cluster {cluster.rid}: {spec.describe()}; ranks in "
            f"{', '.join(leaf.namespace for leaf in cluster.leaves)}",
            file=sys.stderr,
            flush=True,
        )
        counters = None if wire_out is None else WireCounters.of(cluster)
        before = None if counters is None else counters.snapshot()
        try:
            return launch.run_job(cluster, command, timeout, local_rank_arg)
        finally:
            if counters is not None:
                moved = counters.snapshot() - before
                wire_out.write_text(json.dumps({"cluster": spec.to_json(), **moved.to_json()}, indent=2) + "\n")


def measure_network(spec: ClusterSpec, message_bytes: int, timeout: float = 300) -> dict[str, Any]:
    """Run :mod:`ds_ext.cluster.measure` on the cluster; its JSON."""
    with tempfile.TemporaryDirectory(prefix="ds_ext_cluster_") as tmp:
        out = Path(tmp) / "measure.json"
        code = run_on_cluster(
            spec,
            [sys.executable, "-m", "ds_ext.cluster.measure", "--out", str(out), "--message-bytes", str(message_bytes)],
            timeout,
        )
        if code:
            raise ClusterError(f"the measuring ranks failed with exit code {code}")
        return json.loads(out.read_text())


def format_measurement(db: dict[str, Any]) -> str:
    """The measured network as a table: per level, shaped rate and the measured figures."""

    def mbit(bps: float | None) -> str:
        return "-" if bps is None else f"{bps * 8 / 1e6:.1f}"

    lines = [
        f"{'level':<6} {'pair':>5} {'shaped':>7} {'p2p':>7} {'shared':>7} {'all-gather span':>16} "
        f"{'all-gather cross':>17} {'latency us':>11}   (Mbit/s; shared: per rank, all exchanging at once; "
        f"all-gather = ring bus bandwidth)"
    ]
    for name, lv in db["levels"].items():
        lines.append(
            f"{name:<6} {'%d-%d' % tuple(lv['pair']):>5} {mbit(lv['shaped_bytes_per_s']):>7} "
            f"{mbit(lv['p2p_bytes_per_s']):>7} {mbit(lv.get('shared_bytes_per_s')):>7} "
            f"{mbit(lv['allgather_span_bytes_per_s']):>16} "
            f"{mbit(lv['allgather_cross_bytes_per_s']):>17} {lv['latency_s'] * 1e6:>11.0f}"
        )
    if db.get("step_latency_s") is not None:
        lines.append(f"step latency (every rank exchanging at once): {db['step_latency_s'] * 1e6:.0f} us per message")
    lines.append(f"all-gather correct on every rank: {db['allgather_correct']}")
    return "\n".join(lines)


def cmd_cluster(ns: argparse.Namespace) -> int:
    """``ds-ext cluster`` (see module docstring)."""
    try:
        if ns.check:
            require_capability()
            print("ds-ext cluster: this host can build emulated clusters")
            return 0
        if ns.clean:
            removed = netns.sweep_leftovers()
            print(f"removed {len(removed)} leftover namespaces" + (f": {', '.join(removed)}" if removed else ""))
            return 0
        command = ns.job[1:] if ns.job[:1] == ["--"] else ns.job
        if not command:
            raise ClusterError("no command to run: ds-ext cluster [flags] -- COMMAND ...")
        return run_on_cluster(
            spec_from_args(ns),
            command,
            ns.timeout,
            ns.local_rank_arg,
            None if ns.wire_out is None else Path(ns.wire_out),
        )
    except ClusterError as err:
        print(f"ds-ext cluster: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ds-ext cluster: interrupted; ranks stopped, cluster removed", file=sys.stderr)
        return 130


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``ds-ext cluster`` parser."""
    add_cluster_arguments(p)
    p.add_argument("--check", action="store_true", help="only say whether this host can build a cluster")
    p.add_argument("--clean", action="store_true", help="only remove the leftovers of killed runs")
    p.add_argument("--timeout", type=float, default=None, help="stop the job after this many seconds")
    p.add_argument(
        "--local-rank-arg",
        action="store_true",
        help="append --local_rank=N to the command, as the deepspeed launcher does",
    )
    p.add_argument(
        "--wire-out",
        default=None,
        metavar="FILE",
        help="write the bytes each link carried during the job, per direction and level (JSON)",
    )
    p.add_argument("job", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...] run on every rank")


def main(argv: list[str] | None = None) -> int:
    """``python -m ds_ext.cluster``: ``ds-ext cluster`` alone."""
    p = argparse.ArgumentParser(
        prog="python -m ds_ext.cluster", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(p)
    return cmd_cluster(p.parse_args(argv))
