"""Bytes on the wire: the kernel's byte counters of every shaped link of an emulated cluster.

Each link (:func:`ds_ext.cluster.netns.cluster_links`) is a veth whose upper end sits on a
bridge (the switch, or a node's); the counters of that end (``ip -s link``: what
``/sys/class/net/<if>/statistics/{rx,tx}_bytes`` holds inside its namespace) give both
directions: ``up`` (received by the upper end: bytes leaving the node or GPU below) and
``down`` (sent by it). They count Ethernet frames as the ``tbf`` shapes them: TCP/IP and
Ethernet headers, acknowledgements, ARP, on top of the payload.

A byte between two GPUs of one node crosses one ``gpu`` link up and one down; a byte between
nodes crosses one ``node`` link up and one down (with a NIC per GPU, the sending GPU's NIC;
with one link per node and a GPU level, also both GPUs' ``gpu`` links). So a level's ``up``
bytes are what the ranks sent over it, to set beside the ledger's bytes of that level
(``ds_ext.comm.ledger``, 003 §V-D's volumes).

Usable from the runner (:meth:`WireCounters.of`) and from a rank (:meth:`WireCounters.from_env`,
from ``DS_EXT_CLUSTER``): any root process can read another namespace's counters (``ip -n``),
so a benchmark brackets a region on one rank with :meth:`WireCounters.snapshot`, between
barriers::

    wire = WireCounters.from_env()
    dist.barrier(); before = wire.snapshot(); dist.barrier()
    ...                                  # the region
    dist.barrier(); moved = wire.snapshot() - before
    moved.by_level()                     # {"node": {"up": ..., "down": ...}, "gpu": {...}}

The barriers' own messages (a few hundred bytes each) are counted too.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from ds_ext.cluster.netns import Link, NetnsCluster, cluster_links, run_cmd
from ds_ext.cluster.spec import ClusterError, ClusterSpec

DIRECTIONS = ("up", "down")


@dataclass(frozen=True)
class WireBytes:
    """Bytes that crossed each link between two snapshots, per direction: ``{link: {"up": n,
    "down": n}}`` and each link's level."""

    links: dict[str, dict[str, int]]
    levels: dict[str, str]

    def by_level(self) -> dict[str, dict[str, int]]:
        """``{level: {"up": bytes, "down": bytes}}`` summed over the level's links."""
        out: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(DIRECTIONS, 0))
        for name, moved in self.links.items():
            for d in DIRECTIONS:
                out[self.levels[name]][d] += moved[d]
        return dict(out)

    def to_json(self) -> dict[str, Any]:
        return {"by_level": self.by_level(), "links": self.links}


@dataclass(frozen=True)
class WireSnapshot:
    """Every link's counters at one moment (``{link: {"up": n, "down": n}}``)."""

    counters: dict[str, dict[str, int]]
    levels: dict[str, str]

    def __sub__(self, before: "WireSnapshot") -> WireBytes:
        return WireBytes({name: {d: now[d] - before.counters[name][d] for d in DIRECTIONS}
                          for name, now in self.counters.items()}, self.levels)


class WireCounters:
    """Reads the counters of the links of one cluster (see module docstring)."""

    def __init__(self, links: list[Link]) -> None:
        self.links = links
        self.levels = {link.name: link.level for link in links}
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
        from ds_ext.cluster.measure import spec_from_json

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
            stats = {dev["ifname"]: dev["stats64"] for dev in json.loads(run_cmd("ip", "-n", ns, "-j", "-s", "link", "show"))}
            for link in links:
                if link.upper_if not in stats:
                    raise ClusterError(f"link {link.name}: no interface {link.upper_if} in {ns} (cluster gone?)")
                s = stats[link.upper_if]
                counters[link.name] = {"up": int(s["rx"]["bytes"]), "down": int(s["tx"]["bytes"])}
        return WireSnapshot(counters, self.levels)
