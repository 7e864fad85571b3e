"""Network namespaces, veth pairs, bridges and ``tc tbf`` shapes of one emulated cluster.

Nothing is created in the host's own network namespace: the switch is a bridge inside a
namespace of its own, every node (and, with a GPU level, every GPU) is a namespace, and the
veth pairs run between namespaces. Deleting the namespaces therefore removes everything.

Names, per run (``RID`` = 6 random hex digits): namespaces ``ds_ext-RID-sw`` (the switch),
``ds_ext-RID-nI`` (node I), ``ds_ext-RID-nIgJ`` (GPU J of node I); interfaces ``dsxRID...``;
addresses ``10.77.0.K/24`` on the namespaces that hold ranks (no route leaves them).

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
MTU = 9000
TBF_LATENCY = "30ms"  # tbf queue bound, not an added delay
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
TCP_SETTINGS = {"net.ipv4.tcp_slow_start_after_idle": "0", "net.ipv4.tcp_congestion_control": "reno",
                "net.ipv4.tcp_limit_output_bytes": "8192"}
LOCK_DIR = Path("/run/ds_ext_cluster")
_NS_RE = re.compile(rf"^{re.escape(NS_PREFIX)}([0-9a-f]{{6}})-\S+")
_CMD_TIMEOUT_S = 30
_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1


def run_cmd(*argv: str) -> str:
    """Run ``ip`` / ``tc``; a failure raises :class:`ClusterError` with the command and its stderr."""
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ClusterError(f"{' '.join(argv)}: {err}") from None
    if res.returncode:
        first = (res.stderr.strip() or res.stdout.strip() or f"exit {res.returncode}").splitlines()[0]
        raise ClusterError(f"{' '.join(argv)}: {first}")
    return res.stdout


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
    return [line.split()[0].split("@")[0] for line in run_cmd("ip", "-br", "link").splitlines()
            if line.startswith(IF_PREFIX)]


@dataclass(frozen=True)
class Leaf:
    """A namespace that holds ranks: node ``node``, GPU ``gpu`` (0 without a GPU level)."""

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
    """

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.rid = new_run_id()
        self.lock = RunLock(self.rid)
        self.namespaces: list[str] = []
        self.leaves: list[Leaf] = []

    def ns(self, suffix: str) -> str:
        return f"{NS_PREFIX}{self.rid}-{suffix}"

    def ifname(self, kind: str, i: int) -> str:
        return f"{IF_PREFIX}{self.rid}{kind}{i}"

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
        name = self.ns(suffix)
        self.namespaces.append(name)  # before creating: a half-made namespace is removed too
        run_cmd("ip", "netns", "add", name)
        run_cmd("ip", "-n", name, "link", "set", "lo", "up")
        for key, value in TCP_SETTINGS.items():
            run_cmd(*_tcp_setting_argv(name, key, value))
        return name

    def _bridge(self, ns: str, i: int) -> str:
        br = self.ifname("b", i)
        run_cmd("ip", "-n", ns, "link", "add", br, "mtu", str(MTU), "type", "bridge")
        run_cmd("ip", "-n", ns, "link", "set", br, "up")
        return br

    def _link(self, upper: str, bridge: str, lower: str, i: int, kind: str, shape: LinkShape) -> str:
        """A veth from bridge ``bridge`` in namespace ``upper`` down to namespace ``lower``, shaped
        to ``shape`` on both ends (each end's egress: both directions). Returns the lower end."""
        up, down = self.ifname(f"{kind}p", i), self.ifname(f"{kind}l", i)
        run_cmd("ip", "-n", upper, "link", "add", up, "mtu", str(MTU), "type", "veth",
                "peer", "name", down, "mtu", str(MTU), "netns", lower)
        run_cmd("ip", "-n", upper, "link", "set", up, "master", bridge, "up")
        run_cmd("ip", "-n", lower, "link", "set", down, "up")
        for ns, dev in ((upper, up), (lower, down)):
            run_cmd("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{int(shape.rate_bps)}bit",
                    "burst", str(shape.burst_bytes), "latency", TBF_LATENCY)
        return down

    def _build(self) -> None:
        spec = self.spec
        switch = self._add_ns("sw")
        top = self._bridge(switch, 0)
        for node in range(spec.nodes):
            node_ns = self._add_ns(f"n{node}")
            uplink = self._link(switch, top, node_ns, node, "n", spec.node_link)
            if spec.gpu_link is None:
                self._add_leaf(node, 0, node_ns, uplink)
                continue
            node_br = self._bridge(node_ns, node + 1)
            run_cmd("ip", "-n", node_ns, "link", "set", uplink, "master", node_br)
            for gpu in range(spec.gpus_per_node):
                leaf_ns = self._add_ns(f"n{node}g{gpu}")
                dev = self._link(node_ns, node_br, leaf_ns, len(self.leaves), "g", spec.gpu_link)
                self._add_leaf(node, gpu, leaf_ns, dev)

    def _add_leaf(self, node: int, gpu: int, ns: str, dev: str) -> None:
        index = len(self.leaves)
        address = f"{SUBNET}.{index + 1}"
        run_cmd("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", dev)
        self.leaves.append(Leaf(index, node, gpu, ns, dev, address))

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


def _tcp_setting_argv(ns: str, key: str, value: str) -> tuple[str, ...]:
    """The command that sets one of :data:`TCP_SETTINGS` inside namespace ``ns``."""
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
            ("create a veth pair", ("ip", "-n", ns, "link", "add", f"{IF_PREFIX}{rid}a", "type", "veth",
                                    "peer", "name", f"{IF_PREFIX}{rid}z")),
            ("create tc tbf", ("tc", "-n", ns, "qdisc", "add", "dev", f"{IF_PREFIX}{rid}a", "root", "tbf",
                               "rate", "1mbit", "burst", "32768", "latency", TBF_LATENCY)),
            *((f"set {key}={value} in a namespace", _tcp_setting_argv(ns, key, value))
              for key, value in TCP_SETTINGS.items()),
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
