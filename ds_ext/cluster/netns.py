"""Network namespaces, veth pairs, bridges and ``tc tbf`` shapes of one emulated cluster.

Nothing is created in the host's own network namespace: the switch is a bridge inside a
namespace of its own, every node (and, with a GPU level, every GPU) is a namespace, and the
veth pairs run between namespaces. Deleting the namespaces therefore removes everything.

Names, per run (``RID`` = 6 random hex digits): namespaces ``ds_ext-RID-sw`` (the switch),
``ds_ext-RID-nI`` (node I), ``ds_ext-RID-nIgJ`` (GPU J of node I), ``ds_ext-RID-nIgJcK`` (GCD K
of that GPU, with GCD links); interfaces ``dsxRID...``; addresses ``10.77.0.K`` on the
namespaces that hold ranks and, with GCD links, ``10.77.1.K`` on the GPUs' routers (no route
leaves them).

A run holds an exclusive ``flock`` on ``/run/ds_ext_cluster/RID.lock`` from before its first
namespace until after its last is deleted. :func:`sweep_leftovers` removes the namespaces of
every run whose lock nobody holds (a runner killed with SIGKILL), after killing the processes
still inside them; a live run's lock keeps its namespaces safe from a concurrent sweep.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import re
import secrets
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ds_ext.cluster.spec import ClusterError, ClusterSpec, LinkShape

NS_PREFIX = "ds_ext-"
IF_PREFIX = "dsx"
SUBNET = "10.77.0"
ROUTER_SUBNET = "10.77.1"  # the GPUs' routers, with GCD links
MTU = 9000
# tbf queue bound, not an added delay: deep enough that two streams through one NIC queue rather than
# drop (with 30 ms, tbf's drops made TCP resend 5 % of an all_to_all's bytes; Slingshot, which the
# cluster stands for, is lossless)
TBF_LATENCY = "200ms"
# Per-namespace TCP settings (the host's own are untouched), so that the links behave the same
# on every host:
# * a connection idle between two collectives keeps its window instead of slow-starting again
#   (whose round trips, stretched by a loaded CPU, ate up to half of a 1 MB transfer's time);
# * Reno, not the host's congestion control: a host default of BBR paces each burst at its
#   bandwidth estimate, which slows short exchanges. Reno rather than CUBIC because every kernel
#   has it built in and lets every namespace choose it, where a namespace may choose only from
#   the host's allowed list (seen: "reno bbr", CUBIC available but not allowed); on these
#   sub-millisecond round trips CUBIC runs in its Reno-friendly region and behaves the same;
# * one packet of each connection at a time in a link's queue (TCP small queues): a node's
#   acknowledgements of the data it receives share its egress queue with the data it sends,
#   and behind a queue of its own data they held each exchange's sender; the modelled link is
#   full duplex.
# The measurements behind each setting: docs/benchmarks/network.md.
TCP_SETTINGS = {
    "net.ipv4.tcp_slow_start_after_idle": "0",
    "net.ipv4.tcp_congestion_control": "reno",
    "net.ipv4.tcp_limit_output_bytes": "8192",
}
LOCK_DIR = Path("/run/ds_ext_cluster")
_NS_RE = re.compile(rf"^{re.escape(NS_PREFIX)}([0-9a-f]{{6}})-\S+")
_CMD_TIMEOUT_S = 30
_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1


def run_cmd(*argv: str, stdin: str | None = None) -> str:
    """Run ``ip`` / ``tc``; a failure raises :class:`ClusterError` with the command and its stderr."""
    try:
        res = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ClusterError(f"{' '.join(argv)}: {err}") from None
    if res.returncode:
        first = (res.stderr.strip() or res.stdout.strip() or f"exit {res.returncode}").splitlines()[0]
        raise ClusterError(f"{' '.join(argv)}: {first}")
    return res.stdout


def run_ip_batch(ns: str, commands: list[str]) -> None:
    """Several ``ip`` commands inside namespace ``ns`` in one process (``ip -batch``)."""
    if commands:
        run_cmd("ip", "-n", ns, "-batch", "-", stdin="\n".join(commands) + "\n")


class RunLock:
    """The exclusive lock that marks run ``rid`` alive (see module docstring)."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.path = LOCK_DIR / f"{rid}.lock"
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        LOCK_DIR.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def release(self) -> None:
        """Remove the lock file and drop the lock (in that order: no one can lock a stale file)."""
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None


def new_run_id() -> str:
    return secrets.token_hex(3)


def list_namespaces() -> dict[str, list[str]]:
    """ds_ext's namespaces on this host, by run id."""
    out: dict[str, list[str]] = {}
    for line in run_cmd("ip", "netns", "list").splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NS_RE.match(name)
        if m:
            out.setdefault(m.group(1), []).append(name)
    return out


def namespace_pids(ns: str) -> list[int]:
    try:
        return [int(p) for p in run_cmd("ip", "netns", "pids", ns).split()]
    except ClusterError:
        return []


def delete_namespaces(names: list[str]) -> list[str]:
    """Kill every process inside ``names`` (SIGKILL) and delete them; the errors, one line each."""
    errors = []
    for ns in names:
        for pid in namespace_pids(ns):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for ns in names:
        try:
            run_cmd("ip", "netns", "delete", ns)
        except ClusterError as err:
            errors.append(str(err))
    return errors


def sweep_leftovers() -> list[str]:
    """Delete the namespaces of runs that are no longer alive; the names removed."""
    removed = []
    for rid, names in list_namespaces().items():
        lock = RunLock(rid)
        if not lock.try_acquire():
            continue
        try:
            delete_namespaces(names)
            removed.extend(names)
        finally:
            lock.release()
    return removed


def host_interfaces() -> list[str]:
    """Interfaces named like ds_ext's in the host's namespace (there should never be any)."""
    return [
        line.split()[0].split("@")[0]
        for line in run_cmd("ip", "-br", "link").splitlines()
        if line.startswith(IF_PREFIX)
    ]


def ns_name(rid: str, suffix: str) -> str:
    """Namespace ``suffix`` (``sw``, ``nI``, ``nIgJ``) of run ``rid``."""
    return f"{NS_PREFIX}{rid}-{suffix}"


def if_name(rid: str, kind: str, i: int) -> str:
    """Interface ``kind`` number ``i`` of run ``rid`` (at most 15 characters, the kernel's limit)."""
    return f"{IF_PREFIX}{rid}{kind}{i}"


@dataclass(frozen=True)
class Link:
    """One shaped veth: its upper end a port of bridge ``bridge`` in ``upper_ns`` (the switch, or
    a node's bridge), its lower end ``lower_if`` in ``lower_ns`` (a port of ``lower_bridge`` when
    the lower namespace is itself a switch; else the lower namespace holds ranks or, with GCD
    links, routes for them). ``level``: ``node`` for a link out of a node (the node's link, or one
    GPU's NIC), ``gpu`` for a GPU's link inside its node, ``gcd`` for a GCD's link inside its GPU;
    ``node`` and ``gpu`` say whose (``gpu`` 0 for a node's link)."""

    name: str
    level: str
    node: int
    gpu: int
    upper_ns: str
    bridge: str
    upper_if: str
    lower_ns: str
    lower_if: str
    shape: LinkShape
    lower_bridge: str | None = None


def gpu_ns_suffix(spec: ClusterSpec, node: int, gpu: int) -> str:
    """The namespace of GPU ``gpu`` of node ``node``: ``nIgJ``, or the node's ``nI`` without a GPU level."""
    return f"n{node}g{gpu}" if spec.gpus_per_node > 1 else f"n{node}"


def gcd_links(spec: ClusterSpec, rid: str, node: int, gpu: int) -> list[Link]:
    """The GCD links of one GPU (003 §IV, 004 §III-A: 200 GB/s between the GCDs of an MI250X):
    one per GCD, from its namespace ``nIgJcK`` to the GPU's GCD switch, a bridge in the GPU's
    namespace that joins only these links (``gcd:nIgJcK``)."""
    upper = ns_name(rid, gpu_ns_suffix(spec, node, gpu))
    gpu_index = node * spec.gpus_per_node + gpu
    out = []
    for gcd in range(spec.ranks_per_gpu):
        rank = gpu_index * spec.ranks_per_gpu + gcd
        out.append(
            Link(
                f"gcd:n{node}g{gpu}c{gcd}",
                "gcd",
                node,
                gpu,
                upper,
                if_name(rid, "cb", gpu_index),
                if_name(rid, "cp", rank),
                ns_name(rid, f"n{node}g{gpu}c{gcd}"),
                if_name(rid, "cl", rank),
                spec.gcd_link,
            )
        )
    return out


def cluster_links(spec: ClusterSpec, rid: str) -> list[Link]:
    """Every shaped link of run ``rid`` of ``spec``, named ``LEVEL:NAMESPACE`` after the namespace
    below it (``node:n0``: node 0's link; ``node:n0g1``: GPU 1 of node 0's NIC; ``gpu:n0g1``: its
    link inside node 0; ``gcd:n0g1c0``: GCD 0 of that GPU's link inside it). A pure function of
    the spec and the run id, so that a rank can find the links of its own cluster from
    ``DS_EXT_CLUSTER`` (:mod:`ds_ext.cluster.wire`)."""
    switch, top = ns_name(rid, "sw"), if_name(rid, "b", 0)
    with_gcd = spec.gcd_link is not None
    links = []
    for node in range(spec.nodes):
        node_ns = ns_name(rid, f"n{node}")
        node_br = if_name(rid, "b", node + 1) if spec.gpus_per_node > 1 else None
        if spec.nic == "per-node":
            links.append(
                Link(
                    f"node:n{node}",
                    "node",
                    node,
                    0,
                    switch,
                    top,
                    if_name(rid, "np", node),
                    node_ns,
                    if_name(rid, "nl", node),
                    spec.node_link,
                    node_br,
                )
            )
        for gpu in range(spec.gpus_per_node if node_br is not None else 0):
            leaf, leaf_ns = node * spec.gpus_per_node + gpu, ns_name(rid, f"n{node}g{gpu}")
            links.append(
                Link(
                    f"gpu:n{node}g{gpu}",
                    "gpu",
                    node,
                    gpu,
                    node_ns,
                    node_br,
                    if_name(rid, "gp", leaf),
                    leaf_ns,
                    if_name(rid, "gl", leaf),
                    spec.gpu_link,
                )
            )
            if spec.nic == "per-gpu":
                links.append(
                    Link(
                        f"node:n{node}g{gpu}",
                        "node",
                        node,
                        gpu,
                        switch,
                        top,
                        if_name(rid, "np", leaf),
                        leaf_ns,
                        if_name(rid, "nl", leaf),
                        spec.node_link,
                    )
                )
            if with_gcd:
                links.extend(gcd_links(spec, rid, node, gpu))
        if with_gcd and node_br is None:
            links.extend(gcd_links(spec, rid, node, 0))
    return links


@dataclass(frozen=True)
class Leaf:
    """A namespace that holds ranks: node ``node``, GPU ``gpu`` (0 without a GPU level);
    ``ifname`` carries its address (the ranks' ``GLOO_SOCKET_IFNAME``)."""

    index: int
    node: int
    gpu: int
    namespace: str
    ifname: str
    address: str


class NetnsCluster:
    """Build the namespaces of ``spec``; :meth:`remove` always undoes it.

    Use as a context manager: entering sweeps leftovers of dead runs, takes this run's lock
    and builds; leaving (normally, on an exception, on Ctrl-C) deletes what was built.

    With a NIC per GPU, a GPU's namespace holds its address on its NIC, and a host route per
    other GPU of its node sends that GPU's address down its link inside the node instead (the
    peer answers for its NIC's address on any of its links): cross-node traffic leaves by the
    NIC, traffic inside a node by the node's links.

    With GCD links every rank has a namespace (``nIgJcK``) holding its address on an unshaped
    veth (the hop) to its GPU's namespace, which becomes a router: it holds the address the GPU
    would have held (``10.77.1.K``) and a host route per GCD of the cluster, to its own GCDs down
    their hops, to another GPU's GCDs via that GPU's address over the link their traffic belongs
    to (a NIC per GPU: the link inside the node for the same node, the NIC otherwise; else the
    GPU's one link up). A GCD routes its partner GCDs' addresses over its GCD link and the rest of
    the cluster via its router over the hop. So a byte crosses the shaped links of exactly one
    level, the outermost its two ranks differ at, and the hop is counted by none. Every route has
    its reverse (strict reverse-path filtering passes).
    """

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.rid = new_run_id()
        self.lock = RunLock(self.rid)
        self.namespaces: list[str] = []
        self.leaves: list[Leaf] = []
        self.links = cluster_links(spec, self.rid)

    def __enter__(self) -> "NetnsCluster":
        sweep_leftovers()
        if not self.lock.try_acquire():
            raise ClusterError(f"run id {self.rid} is locked by another run")
        try:
            self._build()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _add_ns(self, suffix: str) -> str:
        name = ns_name(self.rid, suffix)
        self.namespaces.append(name)  # before creating: a half-made namespace is removed too
        run_cmd("ip", "netns", "add", name)
        run_cmd("ip", "-n", name, "link", "set", "lo", "up")
        for key, value in TCP_SETTINGS.items():
            run_cmd(*_sysctl_argv(name, key, value))
        return name

    @staticmethod
    def _bridge(ns: str, br: str) -> None:
        run_cmd("ip", "-n", ns, "link", "add", br, "mtu", str(MTU), "type", "bridge")
        run_cmd("ip", "-n", ns, "link", "set", br, "up")

    @staticmethod
    def _link(link: Link) -> None:
        """The veth of ``link``, shaped on both ends (each end's egress: both directions)."""
        run_cmd(
            "ip",
            "-n",
            link.upper_ns,
            "link",
            "add",
            link.upper_if,
            "mtu",
            str(MTU),
            "type",
            "veth",
            "peer",
            "name",
            link.lower_if,
            "mtu",
            str(MTU),
            "netns",
            link.lower_ns,
        )
        run_cmd("ip", "-n", link.upper_ns, "link", "set", link.upper_if, "master", link.bridge, "up")
        if link.lower_bridge is not None:
            run_cmd("ip", "-n", link.lower_ns, "link", "set", link.lower_if, "master", link.lower_bridge)
        run_cmd("ip", "-n", link.lower_ns, "link", "set", link.lower_if, "up")
        for ns, dev in ((link.upper_ns, link.upper_if), (link.lower_ns, link.lower_if)):
            run_cmd(
                "tc",
                "-n",
                ns,
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                f"{int(link.shape.rate_bps)}bit",
                "burst",
                str(link.shape.burst_bytes),
                "latency",
                TBF_LATENCY,
            )

    def _build(self) -> None:
        spec, rid = self.spec, self.rid
        self._bridge(self._add_ns("sw"), if_name(rid, "b", 0))
        for node in range(spec.nodes):
            node_ns = self._add_ns(f"n{node}")
            if spec.gpus_per_node > 1:
                self._bridge(node_ns, if_name(rid, "b", node + 1))
                for gpu in range(spec.gpus_per_node):
                    self._add_ns(f"n{node}g{gpu}")
        if spec.gcd_link is not None:
            self._add_gcd_namespaces()
        for link in self.links:
            self._link(link)
        # the links that carry a GPU's address: a node's link without a GPU level, else a GPU's
        # NIC (per-gpu) or its link inside the node (per-node)
        carrier = "node" if spec.gpus_per_node == 1 or spec.nic == "per-gpu" else "gpu"
        carriers = [link for link in self.links if link.level == carrier]
        if spec.gcd_link is not None:
            self._route_gcds(carriers)
            return
        for link in carriers:
            self._add_leaf(link.node, link.gpu, link.lower_ns, link.lower_if)
        if spec.nic == "per-gpu":
            self._route_inside_nodes()

    def _add_gcd_namespaces(self) -> None:
        """A namespace per GCD; each GPU's namespace gets its GCD switch and forwards packets."""
        spec, rid = self.spec, self.rid
        for index in range(spec.gpus):
            node, gpu = divmod(index, spec.gpus_per_node)
            router = ns_name(rid, gpu_ns_suffix(spec, node, gpu))
            self._bridge(router, if_name(rid, "cb", index))
            run_cmd(*_sysctl_argv(router, "net.ipv4.ip_forward", "1"))
            for gcd in range(spec.ranks_per_gpu):
                self._add_ns(f"n{node}g{gpu}c{gcd}")

    def _route_gcds(self, carriers: list[Link]) -> None:
        """GCD links: the hops, addresses and routes of the class docstring; ``carriers``: the
        link of each GPU, in GPU order, that holds its router's address."""
        spec, rid = self.spec, self.rid
        inner = {link.lower_ns: link.lower_if for link in self.links if link.level == "gpu"}
        gcds: dict[str, list[Link]] = {}  # each router's GCD links, in rank order
        for link in self.links:
            if link.level == "gcd":
                gcds.setdefault(link.upper_ns, []).append(link)
        router_addr = [f"{ROUTER_SUBNET}.{i + 1}" for i in range(len(carriers))]
        rank_addr = [f"{SUBNET}.{r + 1}" for r in range(spec.world_size)]
        ranks_of = [range(i * spec.ranks_per_gpu, (i + 1) * spec.ranks_per_gpu) for i in range(len(carriers))]
        for i, carrier in enumerate(carriers):
            router, mine = carrier.lower_ns, list(zip(ranks_of[i], gcds[carrier.lower_ns]))
            batch = [f"addr add {router_addr[i]}/32 dev {carrier.lower_if}"]
            for rank, gcd in mine:
                hop = if_name(rid, "hp", rank)
                batch += [
                    f"link add {hop} mtu {MTU} type veth peer name {if_name(rid, 'hl', rank)} mtu {MTU} "
                    f"netns {gcd.lower_ns}",
                    f"link set {hop} up",
                    f"route add {rank_addr[rank]}/32 dev {hop}",
                ]
            for j, other in enumerate(carriers):
                if j != i:
                    inside = spec.nic == "per-gpu" and other.node == carrier.node
                    dev = inner[router] if inside else carrier.lower_if
                    batch.append(f"route add {router_addr[j]}/32 dev {dev}")
                    batch += [f"route add {rank_addr[r]}/32 via {router_addr[j]} dev {dev}" for r in ranks_of[j]]
            run_ip_batch(router, batch)
            for rank, gcd in mine:
                hop = if_name(rid, "hl", rank)
                run_ip_batch(
                    gcd.lower_ns,
                    [
                        f"link set {hop} up",
                        f"addr add {rank_addr[rank]}/32 dev {hop}",
                        f"route add {router_addr[i]}/32 dev {hop}",
                        f"route add {SUBNET}.0/24 via {router_addr[i]} dev {hop}",
                        *(
                            f"route add {rank_addr[p]}/32 dev {gcd.lower_if} src {rank_addr[rank]}"
                            for p in ranks_of[i]
                            if p != rank
                        ),
                    ],
                )
                self.leaves.append(Leaf(rank, carrier.node, carrier.gpu, gcd.lower_ns, hop, rank_addr[rank]))

    def _add_leaf(self, node: int, gpu: int, ns: str, dev: str) -> None:
        index = len(self.leaves)
        address = f"{SUBNET}.{index + 1}"
        run_cmd("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", dev)
        self.leaves.append(Leaf(index, node, gpu, ns, dev, address))

    def _route_inside_nodes(self) -> None:
        """Per-gpu NICs: each GPU reaches the other GPUs of its node over its link inside the node."""
        inner = {link.lower_ns: link.lower_if for link in self.links if link.level == "gpu"}
        for leaf in self.leaves:
            for peer in self.leaves:
                if peer.node == leaf.node and peer is not leaf:
                    run_cmd(
                        "ip",
                        "-n",
                        leaf.namespace,
                        "route",
                        "add",
                        f"{peer.address}/32",
                        "dev",
                        inner[leaf.namespace],
                        "src",
                        leaf.address,
                    )

    def remove(self) -> None:
        """Kill what runs inside, delete the namespaces, drop the lock; errors raise after all of it."""
        errors = delete_namespaces(list(reversed(self.namespaces)))
        self.namespaces = []
        self.lock.release()
        if errors:
            raise ClusterError("cleanup: " + "; ".join(errors))


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL the calling process when its parent dies (PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def enter_namespace(name: str) -> None:
    """Move the calling process (single-threaded: threads started later follow) into network
    namespace ``name`` and make it die with its parent, as the ranks ``ip netns exec`` starts do."""
    die_with_parent()
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
            raise ClusterError(f"setns into {name}: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


def _sysctl_argv(ns: str, key: str, value: str) -> tuple[str, ...]:
    """The command that sets sysctl ``key`` (one of :data:`TCP_SETTINGS`, or a router's
    ``net.ipv4.ip_forward``) inside namespace ``ns``."""
    return ("ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"{key}={value}")


def capability_problem() -> str | None:
    """None when this host can build a cluster, else one line saying what is missing
    (to follow "ds-ext cluster: ").

    Checks the capabilities (CAP_NET_ADMIN for links and qdiscs, CAP_SYS_ADMIN for the
    namespace mounts), the ``ip`` and ``tc`` tools, then builds a probe namespace with a
    bridge, a veth pair and a ``tbf`` qdisc, sets :data:`TCP_SETTINGS` in it, and removes it.
    """
    import shutil

    caps = _effective_caps()
    missing = [name for bit, name in ((12, "CAP_NET_ADMIN"), (21, "CAP_SYS_ADMIN")) if not caps >> bit & 1]
    if missing:
        return f"needs root ({' and '.join(missing)} missing)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the '{tool}' command (iproute2), not found on PATH"
    rid = new_run_id()
    lock = RunLock(rid)
    if not lock.try_acquire():
        return f"cannot lock {lock.path}"
    ns = f"{NS_PREFIX}{rid}-probe"
    try:
        run_cmd("ip", "netns", "add", ns)
        for what, argv in (
            ("create a bridge", ("ip", "-n", ns, "link", "add", f"{IF_PREFIX}{rid}b", "type", "bridge")),
            (
                "create a veth pair",
                (
                    "ip",
                    "-n",
                    ns,
                    "link",
                    "add",
                    f"{IF_PREFIX}{rid}a",
                    "type",
                    "veth",
                    "peer",
                    "name",
                    f"{IF_PREFIX}{rid}z",
                ),
            ),
            (
                "create tc tbf",
                (
                    "tc",
                    "-n",
                    ns,
                    "qdisc",
                    "add",
                    "dev",
                    f"{IF_PREFIX}{rid}a",
                    "root",
                    "tbf",
                    "rate",
                    "1mbit",
                    "burst",
                    "32768",
                    "latency",
                    TBF_LATENCY,
                ),
            ),
            *(
                (f"set {key}={value} in a namespace", _sysctl_argv(ns, key, value))
                for key, value in TCP_SETTINGS.items()
            ),
        ):
            try:
                run_cmd(*argv)
            except ClusterError as err:
                return f"cannot {what}: {err}"
    except ClusterError as err:
        return f"cannot create a network namespace: {err}"
    finally:
        if ns in list_namespaces().get(rid, []):
            delete_namespaces([ns])
        lock.release()
    return None


def _effective_caps() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0
