"""Bytes on the wire: the kernel's byte counters of every shaped link of an emulated cluster.

Each link (:func:`ds_ext.cluster.netns.cluster_links`) is a veth whose upper end sits on a
bridge (the switch, or a node's); the counters of that end (``ip -s link``: what
``/sys/class/net/<if>/statistics/{rx,tx}_bytes`` holds inside its namespace) give both
directions: ``up`` (received by the upper end: bytes leaving the node or GPU below) and
``down`` (sent by it). They count Ethernet frames as the ``tbf`` shapes them: TCP/IP and
Ethernet headers, acknowledgements, ARP, on top of the payload.

A byte between two GPUs of one node crosses one ``gpu`` link up and one down; a byte between
nodes crosses one ``node`` link up and one down (with a NIC per GPU, the sending GPU's NIC;
with one link per node and a GPU level, also both GPUs' ``gpu`` links); with GCD links, a byte
between the GCDs of one GPU crosses the sender's ``gcd`` link up and the receiver's down, and
bytes to other GPUs reach their links over an unshaped hop that no level counts. So a level's
``up`` bytes are what the ranks sent over it, to set beside the ledger's bytes of that level
(``ds_ext.comm.ledger``, 003 §V-D's volumes).

Usable from the runner (:meth:`WireCounters.of`) and from a rank (:meth:`WireCounters.from_env`,
from ``DS_EXT_CLUSTER``): any root process can read another namespace's counters (``ip -n``),
so a benchmark brackets a region with :func:`wire_region` (collective; rank 0 reads)::

    with wire_region() as region:
        ...                              # the region, on every rank
    region.bytes.by_level()              # rank 0: {"node": {"up": ..., "down": ...}, "gpu": ..., "gcd": ...}

The region's two barriers (a few hundred bytes each) are counted too.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from ds_ext.cluster.measure import spec_from_json
from ds_ext.cluster.netns import Link, NetnsCluster, cluster_links, run_cmd
from ds_ext.cluster.spec import ClusterError, ClusterSpec

DIRECTIONS = ("up", "down")


@dataclass(frozen=True)
class WireBytes:
    """Bytes that crossed each link between two snapshots, per direction: ``{link: {"up": n,
    "down": n}}``, each link's level, and the links out of the namespaces that hold ranks (with
    GCD links: the GCD links and the links of the GPUs' routers)."""

    links: dict[str, dict[str, int]]
    levels: dict[str, str]
    rank_links: frozenset[str]

    def sent(self) -> int:
        """Bytes the ranks' namespaces sent out (up their own links): every byte between two
        namespaces once, whatever the shape."""
        return sum(self.links[name]["up"] for name in self.rank_links)

    def by_level(self) -> dict[str, dict[str, int]]:
        """``{level: {"up": bytes, "down": bytes}}`` summed over the level's links."""
        out: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(DIRECTIONS, 0))
        for name, moved in self.links.items():
            for d in DIRECTIONS:
                out[self.levels[name]][d] += moved[d]
        return dict(out)

    def to_json(self) -> dict[str, Any]:
        return {"by_level": self.by_level(), "sent": self.sent(), "links": self.links}

    def beside_ledger(self, ledger_by_level: Mapping[str, float]) -> dict[str, Any]:
        """The wire's bytes next to the ledger's bytes of the same region, summed over every rank
        (``Traffic.by_level()``), per level and in total. Per level they differ by attribution:
        the ledger books a collective at the outermost level its group crosses, the wire where
        each hop goes (a ring over 2 nodes x 2 GPUs crosses nodes on 2 of its 4 hops). In total,
        ``sent`` holds the payload plus headers, framing and acknowledgements; the ledger's bytes
        between ranks of one namespace go over loopback, which has no counter here (with GCD
        links no two ranks share a namespace)."""
        levels = self.by_level()
        ledger = sum(ledger_by_level.values())
        return {
            "levels": {
                lv: {
                    "ledger": ledger_by_level.get(lv, 0.0),
                    "wire_up": levels.get(lv, {}).get("up", 0),
                    "wire_down": levels.get(lv, {}).get("down", 0),
                }
                for lv in sorted(set(levels) | set(ledger_by_level))
            },
            "total": {
                "ledger": ledger,
                "wire_sent": self.sent(),
                "wire_over_ledger": self.sent() / ledger if ledger else None,
            },
        }


@dataclass(frozen=True)
class WireSnapshot:
    """Every link's counters at one moment (``{link: {"up": n, "down": n}}``)."""

    counters: dict[str, dict[str, int]]
    levels: dict[str, str]
    rank_links: frozenset[str]

    def __sub__(self, before: "WireSnapshot") -> WireBytes:
        return WireBytes(
            {name: {d: now[d] - before.counters[name][d] for d in DIRECTIONS} for name, now in self.counters.items()},
            self.levels,
            self.rank_links,
        )


class WireCounters:
    """Reads the counters of the links of one cluster (see module docstring)."""

    def __init__(self, links: list[Link]) -> None:
        self.links = links
        self.levels = {link.name: link.level for link in links}
        self.rank_links = frozenset(link.name for link in links if link.lower_bridge is None)
        self._by_ns: dict[str, list[Link]] = defaultdict(list)
        for link in links:
            self._by_ns[link.upper_ns].append(link)

    @classmethod
    def of(cls, cluster: NetnsCluster) -> "WireCounters":
        """The counters of a cluster this process built."""
        return cls(cluster.links)

    @classmethod
    def from_env(cls) -> "WireCounters":
        """The counters of the cluster this rank runs on (``DS_EXT_CLUSTER``, set by
        :func:`ds_ext.cluster.launch.rank_env`)."""
        text = os.environ.get("DS_EXT_CLUSTER")
        if not text:
            raise ClusterError("no DS_EXT_CLUSTER in the environment: wire counters need a rank of ds-ext cluster")
        d = json.loads(text)
        return cls.for_run(spec_from_json(d), d["run_id"])

    @classmethod
    def for_run(cls, spec: ClusterSpec, rid: str) -> "WireCounters":
        return cls(cluster_links(spec, rid))

    def snapshot(self) -> WireSnapshot:
        """Every link's counters now: one ``ip -s link`` per namespace that holds upper ends
        (the switch, and each node with a GPU level)."""
        counters = {}
        for ns, links in self._by_ns.items():
            stats = {
                dev["ifname"]: dev["stats64"] for dev in json.loads(run_cmd("ip", "-n", ns, "-j", "-s", "link", "show"))
            }
            for link in links:
                if link.upper_if not in stats:
                    raise ClusterError(f"link {link.name}: no interface {link.upper_if} in {ns} (cluster gone?)")
                s = stats[link.upper_if]
                counters[link.name] = {"up": int(s["rx"]["bytes"]), "down": int(s["tx"]["bytes"])}
        return WireSnapshot(counters, self.levels, self.rank_links)


@dataclass
class WireRegion:
    """What :func:`wire_region` measured: the bytes on rank 0, None on the others."""

    bytes: WireBytes | None = None


@contextmanager
def wire_region(reader_rank: int = 0) -> Iterator[WireRegion]:
    """Collective over the world: the bytes every link of this rank's cluster carried during the
    block, read by ``reader_rank`` between barriers (the other ranks get None)."""
    import torch.distributed as dist

    region = WireRegion()
    counters = WireCounters.from_env() if dist.get_rank() == reader_rank else None
    dist.barrier()
    before = counters.snapshot() if counters else None
    dist.barrier()
    yield region
    dist.barrier()
    if counters is not None:
        region.bytes = counters.snapshot() - before
