"""What an emulated cluster looks like: nodes, ranks per node, and the shaped links.

A cluster has ``nodes`` emulated nodes of ``ranks_per_node`` ranks each, and one of two shapes
(``nic``):

* ``per-node``: every node hangs off one switch by a link shaped to ``node_link`` in both
  directions. With ``gpus_per_node`` > 1 a node is itself a switch with one link per GPU shaped
  to ``gpu_link`` (nested links): a GPU's cross-node traffic crosses its GPU link, then the node
  link that all GPUs of the node share.
* ``per-gpu`` (Frontier, 003 §IV: 4 Slingshot NICs per node, one per MI250X): every GPU has its
  own link straight to the switch, shaped to ``node_link`` (one NIC), and a second link shaped to
  ``gpu_link`` into its node's switch (Infinity Fabric) that carries only the traffic between
  GPUs of one node. A GPU's cross-node traffic leaves through its own NIC.

Without ``gcd_link`` the ranks of one GPU share its namespace and talk over its loopback, which
is not shaped (Frontier's GCD pair, the fastest level, free). With ``gcd_link`` every level is
shaped: each rank (GCD) has a namespace of its own and a link shaped to ``gcd_link`` into its
GPU's GCD switch (a bridge that joins only the GCDs of that GPU), and reaches everything outside
its GPU through the GPU's namespace, now a router, over an unshaped hop that belongs to no level;
so a byte crosses the links of exactly one level, the outermost its two ranks differ at
(``Topology.level_of``), up the sender's link and down the receiver's.

Frontier's ratios (003 §IV, 004 §III-A; spec/zero_topo_and_frontier.md A3, B5): GCD-GCD inside one
MI250X 200 GB/s; MI250X to MI250X 100 GB/s per GCD (004 §III-A: "across the die is half of it"; an
MI250X's links to the other three, 2 x 50 GB/s to its adjacent pair and 50 to each cross pair,
together 200 GB/s for its 2 GCDs); 25 GB/s per NIC. The ``frontier`` topology preset gives per rank
100 GB/s (``gpu``) and 12.5 GB/s (``node``), which :func:`spec_from_topology` turns into a 200 GB/s
GPU link (the star's one link stands for the MI250X's three) and a 25 GB/s NIC per GPU of 2 ranks;
``rate_scale`` 2000 makes those 800 and 100 Mbit/s, and the preset's 200 GB/s per rank of the
``gcd`` level a GCD link of 800 Mbit/s: 800 : 800 : 100, Frontier's 200 : 200 : 25 per link
(200 : 100 : 12.5 per rank).

Rates are bits per second on the wire, as ``tc tbf`` counts them (Ethernet frames, so about
0.7 % above the TCP payload rate at the 9000-byte MTU the cluster uses).

The topology block of a ds_config (``"ds_ext": {"topology": ...}``) can give the rates: a
level's ``bandwidth_GBps`` is per rank (``ds_ext.topology.Level``), so the link of one node
carries ``ranks_per_node`` times the ``node`` level's bandwidth and the link of one GPU the
ranks of that GPU times the ``gpu`` level's, and the link of one GCD the ``gcd`` level's (one
rank behind it); ``rate_scale`` divides them all so that a real machine's figures fit what one
host's CPU can push.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

from ds_ext.errors import DsExtError
from ds_ext.topology import Topology, TopologyError, preset_levels

NIC_SHAPES = ("per-node", "per-gpu")
MAX_LEAVES = 250  # one /24 of addresses, leaves numbered from .1
# Default tbf bucket: 200 us of traffic, never less than one 9000-byte frame with its headers.
# A wire cannot catch up on the time it stood idle; a bucket can, by what it holds, so a larger
# bucket delivers a burst sent after an idle pause faster than its bytes at the link rate and
# hides a process's wait for a core (measured: docs/benchmarks/network.md).
MIN_BURST_BYTES = 10_000
BURST_SECONDS = 0.0002

_UNITS = {"": 1, "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


class ClusterError(DsExtError, RuntimeError):
    """The cluster cannot be built, run or removed; the message says why in one line."""


def parse_rate(text: str) -> float:
    """``"40mbit"`` -> 4e7 bits/s (units bit, kbit, mbit, gbit; a bare number is bits/s)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ClusterError(f"rate {text!r}: expected a number with unit bit, kbit, mbit or gbit, e.g. 40mbit")
    rate = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if rate <= 0:
        raise ClusterError(f"rate {text!r} must be > 0")
    return rate


@dataclass(frozen=True)
class LinkShape:
    """A ``tc tbf`` shape: ``rate_bps`` bits/s and a bucket of ``burst_bytes``."""

    rate_bps: float
    burst_bytes: int

    @classmethod
    def of(cls, rate_bps: float, burst_bytes: int | None = None) -> "LinkShape":
        """A shape with the default bucket (``BURST_SECONDS`` of traffic, at least ``MIN_BURST_BYTES``) unless given."""
        if burst_bytes is None:
            burst_bytes = max(MIN_BURST_BYTES, int(rate_bps / 8 * BURST_SECONDS))
        if rate_bps <= 0 or burst_bytes <= 0:
            raise ClusterError(f"a link needs rate > 0 and burst > 0, got {rate_bps} bit/s, {burst_bytes} B")
        return cls(rate_bps, burst_bytes)

    @property
    def bytes_per_s(self) -> float:
        return self.rate_bps / 8

    def describe(self) -> str:
        return f"{self.rate_bps / 1e6:g} Mbit/s (burst {self.burst_bytes} B)"


@dataclass(frozen=True)
class ClusterSpec:
    """The emulated machine (see module docstring)."""

    nodes: int
    ranks_per_node: int
    node_link: LinkShape
    gpus_per_node: int = 1
    gpu_link: LinkShape | None = None
    nic: str = "per-node"
    gcd_link: LinkShape | None = None

    def __post_init__(self) -> None:
        if self.nic not in NIC_SHAPES:
            raise ClusterError(f"nic shape {self.nic!r}: expected one of {', '.join(NIC_SHAPES)}")
        if self.nic == "per-gpu" and self.gpus_per_node < 2:
            raise ClusterError(
                "a NIC per GPU needs more than one GPU per node (with one, the node's link is its GPU's)"
            )
        if self.nodes < 1 or self.ranks_per_node < 1 or self.gpus_per_node < 1:
            raise ClusterError(
                f"nodes, ranks per node and GPUs per node must be >= 1, got "
                f"{self.nodes}, {self.ranks_per_node}, {self.gpus_per_node}"
            )
        if self.ranks_per_node % self.gpus_per_node:
            raise ClusterError(
                f"{self.ranks_per_node} ranks per node do not split over {self.gpus_per_node} GPUs per node"
            )
        if (self.gpus_per_node > 1) != (self.gpu_link is not None):
            raise ClusterError("a GPU link rate is needed exactly when there is more than one GPU per node")
        if self.gcd_link is not None and self.ranks_per_gpu < 2:
            raise ClusterError(
                f"a GCD link (--gcd-rate) needs 2 or more ranks per GPU (the GCDs it joins), got "
                f"{self.ranks_per_gpu} ({self.ranks_per_node} ranks per node over {self.gpus_per_node} GPUs)"
            )
        if self.leaves > MAX_LEAVES:
            raise ClusterError(f"{self.leaves} namespaces with ranks exceed the {MAX_LEAVES} a /24 holds")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def gpus(self) -> int:
        """GPUs of the cluster (a node without a GPU level is one GPU)."""
        return self.nodes * self.gpus_per_node

    @property
    def ranks_per_gpu(self) -> int:
        return self.ranks_per_node // self.gpus_per_node

    @property
    def leaves(self) -> int:
        """Namespaces that hold ranks: one per rank with a GCD link, else one per GPU (one per
        node without a GPU level)."""
        return self.world_size if self.gcd_link is not None else self.gpus

    @property
    def ranks_per_leaf(self) -> int:
        return 1 if self.gcd_link is not None else self.ranks_per_gpu

    def leaf_of(self, rank: int) -> int:
        return rank // self.ranks_per_leaf

    def gpu_of(self, rank: int) -> int:
        return rank // self.ranks_per_gpu

    def level_of_pair(self, a: int, b: int) -> str:
        """The link class two ranks talk over: ``local`` (one namespace's loopback), ``gcd`` (two
        GCDs of one GPU, with a GCD link), ``gpu`` or ``node``."""
        if a // self.ranks_per_node != b // self.ranks_per_node:
            return "node"
        if self.gpu_of(a) != self.gpu_of(b):
            return "gpu"
        return "gcd" if self.gcd_link is not None and a != b else "local"

    def path_rate_bps(self, level: str) -> float | None:
        """Slowest shaped link on a path over ``level``; None for loopback."""
        if level == "local":
            return None
        if level == "gcd":
            return self.gcd_link.rate_bps
        if self.nic == "per-gpu":
            return self.node_link.rate_bps if level == "node" else self.gpu_link.rate_bps
        rates = [self.gpu_link.rate_bps] if self.gpu_link is not None else []
        if level == "node":
            rates.append(self.node_link.rate_bps)
        return min(rates)

    def describe(self) -> str:
        if self.nic == "per-gpu":
            text = (
                f"{self.nodes} nodes x {self.ranks_per_node} ranks, {self.gpus_per_node} GPUs per node, "
                f"a NIC per GPU {self.node_link.describe()}, GPU links inside a node {self.gpu_link.describe()}"
            )
        else:
            text = f"{self.nodes} nodes x {self.ranks_per_node} ranks, node links {self.node_link.describe()}"
            if self.gpu_link is not None:
                text += f", {self.gpus_per_node} GPUs per node on links {self.gpu_link.describe()}"
        if self.gcd_link is not None:
            text += f", a namespace per GCD, GCD links inside a GPU {self.gcd_link.describe()}"
        return text

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "nodes": self.nodes,
            "ranks_per_node": self.ranks_per_node,
            "node_rate_bps": self.node_link.rate_bps,
            "node_burst_bytes": self.node_link.burst_bytes,
            "gpus_per_node": self.gpus_per_node,
            "nic": self.nic,
        }
        if self.gpu_link is not None:
            out.update(gpu_rate_bps=self.gpu_link.rate_bps, gpu_burst_bytes=self.gpu_link.burst_bytes)
        if self.gcd_link is not None:
            out.update(gcd_rate_bps=self.gcd_link.rate_bps, gcd_burst_bytes=self.gcd_link.burst_bytes)
        return out


def spec_from_topology(
    block: Mapping[str, Any],
    nodes: int,
    rate_scale: float = 1.0,
    gpu_level: bool = False,
    nic: str = "per-node",
    gcd_level: bool = False,
) -> ClusterSpec:
    """A cluster of ``nodes`` nodes from a ``ds_ext.topology`` block: ranks per node from its
    inner levels, the node link from the ``node`` level (and, with ``gpu_level``, the GPU links
    from the ``gpu`` level), rates divided by ``rate_scale``. With ``nic="per-gpu"`` (which needs
    ``gpu_level``) each GPU's NIC carries the ``node`` level's bandwidth of the ranks of one GPU.
    With ``gcd_level`` (which needs ``gpu_level`` and a ``gcd`` level right inside ``gpu``) each
    rank gets a GCD link of the ``gcd`` level's bandwidth (003 §IV, 004 §III-A: 200 GB/s)."""
    from ds_ext import config as cfgmod  # pydantic: not for every ds-ext --help

    if rate_scale <= 0:
        raise ClusterError(f"rate scale must be > 0, got {rate_scale}")
    cfg = cfgmod.parse({"topology": {**block, "emulate": True}}).topology
    try:
        levels = [lv.to_level() for lv in cfg.levels] if cfg.levels is not None else list(preset_levels(cfg.preset))
        if not levels or levels[-1].name != "node":
            raise TopologyError("the outermost level must be named 'node'")
        per_node = math.prod(cfg.sizes.get(lv.name, lv.size) or 1 for lv in levels[:-1])
        topo = Topology.build(levels, per_node * nodes, cfg.preset or "custom", cfg.sizes)
        node = topo.level("node")
        if gpu_level and (len(levels) < 2 or levels[-2].name != "gpu"):
            raise TopologyError("--gpu-level needs a 'gpu' level right inside 'node'")
        gpu = topo.level("gpu") if gpu_level else None
        if gcd_level and (gpu is None or len(levels) != 3 or levels[0].name != "gcd"):
            raise TopologyError("--gcd-level needs --gpu-level and the levels gcd, gpu, node")
        gcd = topo.level("gcd") if gcd_level else None
    except TopologyError as err:
        raise ClusterError(f"topology block: {err}") from None
    if nic == "per-gpu" and gpu is None:
        raise ClusterError("a NIC per GPU needs the topology's 'gpu' level (--gpu-level)")
    if gpu is None:
        return ClusterSpec(nodes, per_node, LinkShape.of(node.bandwidth * 8 * per_node / rate_scale))
    per_gpu = topo.domain_size("gpu") // (gpu.size or 1)
    behind_nic = per_gpu if nic == "per-gpu" else per_node
    return ClusterSpec(
        nodes,
        per_node,
        LinkShape.of(node.bandwidth * 8 * behind_nic / rate_scale),
        per_node // per_gpu,
        LinkShape.of(gpu.bandwidth * 8 * per_gpu / rate_scale),
        nic,
        None if gcd is None else LinkShape.of(gcd.bandwidth * 8 / rate_scale),
    )
