"""A NIC per GPU (``ds-ext cluster --nic per-gpu``, Frontier's shape, 003 §IV) and the bytes on
the wire (``ds_ext.cluster.wire``).

Pure-logic tests need nothing. The others build one cluster of 2 nodes x 2 GPUs x 1 rank with a
NIC per GPU and skip, with the command's own one-line reason, where the host cannot:

* routing: a rank's bytes to the other node leave through its own GPU's NIC and no other link
  out of a node; bytes between the GPUs of one node go over their links inside the node;
* the two GPUs of a node sending across at once each get their NIC's rate (one shared node
  link would halve it);
* the ledger's bytes of known collectives against the kernel's counters: the wire carries at
  least the payload and at most ``WIRE_OVERHEAD`` more (headers, gloo framing, TCP
  acknowledgements);
* ``ds-ext cluster --wire-out`` writes the bytes of every link of the job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from wire_support import LINK_KINDS, assert_links_match_the_wire, send_pairs

from ds_ext.cluster import netns
from ds_ext.cluster.netns import cluster_links
from ds_ext.cluster.spec import ClusterError, ClusterSpec, LinkShape, spec_from_topology
from ds_ext.cluster.wire import WireBytes, WireSnapshot

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "PYTHONWARNINGS": "ignore"}
START_TIMEOUT_S = 240  # a runner's start on a host loaded far beyond its cores
TOLERANCE = 0.15
NIC_MBIT, GPU_MBIT = 100, 400  # Frontier's NIC : MI250X-to-MI250X ratio, 25 : 100 GB/s
MESSAGE = 2**20
WIRE_OVERHEAD = 0.03  # the measured overhead: docs/cluster.md, "Bytes on the wire"
STRAY = 16_000  # bytes a link may carry in a region without payload: barriers, ARP


def _frontier_like() -> ClusterSpec:
    return ClusterSpec(2, 2, LinkShape.of(NIC_MBIT * 1e6), 2, LinkShape.of(GPU_MBIT * 1e6), "per-gpu")


# ---- pure logic ------------------------------------------------------------------------------


def test_links_of_each_shape():
    """Per node: one link out of each node (its GPUs' links hang below it); per GPU: each GPU has
    its NIC straight to the switch and its link inside the node."""
    nested = ClusterSpec(2, 2, LinkShape.of(40e6), 2, LinkShape.of(80e6))
    assert [
        (lk.name, lk.upper_ns.rsplit("-", 1)[1], lk.lower_bridge is None) for lk in cluster_links(nested, "abc123")
    ] == [
        ("node:n0", "sw", False),
        ("gpu:n0g0", "n0", True),
        ("gpu:n0g1", "n0", True),
        ("node:n1", "sw", False),
        ("gpu:n1g0", "n1", True),
        ("gpu:n1g1", "n1", True),
    ]
    links = cluster_links(_frontier_like(), "abc123")
    assert [(lk.name, lk.upper_ns.rsplit("-", 1)[1], lk.lower_ns.rsplit("-", 1)[1]) for lk in links] == [
        ("gpu:n0g0", "n0", "n0g0"),
        ("node:n0g0", "sw", "n0g0"),
        ("gpu:n0g1", "n0", "n0g1"),
        ("node:n0g1", "sw", "n0g1"),
        ("gpu:n1g0", "n1", "n1g0"),
        ("node:n1g0", "sw", "n1g0"),
        ("gpu:n1g1", "n1", "n1g1"),
        ("node:n1g1", "sw", "n1g1"),
    ]
    assert all(len(name) <= 15 for lk in links for name in (lk.upper_if, lk.lower_if))
    assert len({lk.upper_if for lk in links if lk.level == "node"}) == 4  # one switch port per NIC


def test_per_gpu_spec():
    spec = _frontier_like()
    assert spec.path_rate_bps("node") == NIC_MBIT * 1e6 and spec.path_rate_bps("gpu") == GPU_MBIT * 1e6
    assert "a NIC per GPU" in spec.describe()
    from ds_ext.cluster.measure import spec_from_json

    assert spec_from_json(spec.to_json()) == spec
    for bad in ({"gpus_per_node": 1, "gpu_link": None}, {"nic": "per-rack"}):
        with pytest.raises(ClusterError) as err:
            ClusterSpec(
                **{
                    "nodes": 2,
                    "ranks_per_node": 2,
                    "node_link": LinkShape.of(1e8),
                    "gpus_per_node": 2,
                    "gpu_link": LinkShape.of(4e8),
                    "nic": "per-gpu",
                    **bad,
                }
            )
        assert "\n" not in str(err.value)


def test_frontier_preset_gives_frontiers_ratios():
    """The frontier preset (per rank: gpu 100 GB/s, node 12.5 GB/s) with a NIC per GPU: a GPU of 2
    GCDs gets a 25 GB/s NIC (003 §IV: 4 x 25 GB/s per node) and a 200 GB/s link inside the node
    (004 §III-A: 100 GB/s per GCD), scaled by 2000 to 100 and 800 Mbit/s."""
    spec = spec_from_topology({"preset": "frontier"}, nodes=2, rate_scale=2000, gpu_level=True, nic="per-gpu")
    assert (spec.ranks_per_node, spec.gpus_per_node, spec.nic) == (8, 4, "per-gpu")
    assert spec.node_link.rate_bps == pytest.approx(100e6) and spec.gpu_link.rate_bps == pytest.approx(800e6)
    shared = spec_from_topology({"preset": "frontier"}, nodes=2, rate_scale=2000, gpu_level=True)
    assert shared.node_link.rate_bps == pytest.approx(400e6)  # one node link: the 4 NICs together
    with pytest.raises(ClusterError, match="gpu-level"):
        spec_from_topology({"preset": "frontier"}, nodes=2, nic="per-gpu")


def test_wire_diff_by_level_and_beside_ledger():
    levels = {"node:n0g0": "node", "gpu:n0g0": "gpu", "node:n0": "node"}
    before = WireSnapshot({k: {"up": 10, "down": 20} for k in levels}, levels, frozenset({"node:n0g0", "gpu:n0g0"}))
    after = WireSnapshot(
        {
            "node:n0g0": {"up": 1010, "down": 25},
            "gpu:n0g0": {"up": 110, "down": 20},
            "node:n0": {"up": 510, "down": 20},
        },
        levels,
        before.rank_links,
    )
    moved = after - before
    assert moved.by_level() == {"node": {"up": 1500, "down": 5}, "gpu": {"up": 100, "down": 0}}
    assert moved.sent() == 1100  # node:n0 is a switch's uplink, not a link out of a rank's namespace
    report = moved.beside_ledger({"node": 1000.0})
    assert report["total"] == {"ledger": 1000.0, "wire_sent": 1100, "wire_over_ledger": 1.1}
    assert report["levels"]["gpu"] == {"ledger": 0.0, "wire_up": 100, "wire_down": 0}


# ---- a real cluster --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world():
    problem = netns.capability_problem()
    if problem is not None:
        pytest.skip(f"ds-ext cluster: {problem}")
    from ds_ext.cluster.world import cluster_world

    with cluster_world(_frontier_like()) as w:
        yield w


def test_each_gpu_sends_across_through_its_own_nic(world):
    world.run(send_pairs, [(0, 2), (1, 3), (0, 1)], 4096)  # warm-up: connections
    for a, b in ((0, 2), (1, 3), (3, 0), (2, 1)):
        links = world.run(send_pairs, [(a, b)], MESSAGE)[0][1]
        out_nic, in_nic = f"node:n{a // 2}g{a % 2}", f"node:n{b // 2}g{b % 2}"
        assert MESSAGE <= links[out_nic]["up"] <= MESSAGE * (1 + WIRE_OVERHEAD), links
        assert MESSAGE <= links[in_nic]["down"] <= MESSAGE * (1 + WIRE_OVERHEAD), links
        others = {name: moved for name, moved in links.items() if name not in (out_nic, in_nic)}
        assert all(moved["up"] < STRAY and moved["down"] < STRAY for moved in others.values()), (a, b, links)
    links = world.run(send_pairs, [(0, 1)], MESSAGE)[0][1]  # inside node 0: its GPU links, no NIC
    assert MESSAGE <= links["gpu:n0g0"]["up"] <= MESSAGE * (1 + WIRE_OVERHEAD), links
    assert MESSAGE <= links["gpu:n0g1"]["down"] <= MESSAGE * (1 + WIRE_OVERHEAD), links
    assert all(moved["up"] < STRAY for name, moved in links.items() if name.startswith("node:")), links


def test_gpus_of_a_node_do_not_share_a_link_out(world):
    """GPUs 0 and 1 of node 0 send across at once: each at its NIC's rate (a shared node link of
    the same rate would take twice as long). The fastest of 3: CPU contention only adds time."""
    rate = NIC_MBIT * 1e6 / 8
    nbytes = 2 * MESSAGE
    seconds = min(max(world.run(send_pairs, [(0, 2), (1, 3)], nbytes)[r][0] for r in range(4)) for _ in range(3))
    assert nbytes / seconds == pytest.approx(rate, rel=TOLERANCE)


def _ledger_and_wire(kind: str, nbytes: int) -> tuple[dict[str, float], WireBytes | None]:
    """One collective of ``nbytes`` per rank through ds_ext's Communicator (``cross``: an
    all-gather between the GPUs of the same index on the 2 nodes; ``span``: an all-gather between
    the 2 GPUs of each node; ``world``: an all-reduce over all 4 ranks; ``cross_rs``: a reduce-scatter
    between the GPUs of the same index on the 2 nodes, which gloo itself would run as an all-reduce
    of twice the bytes), after a warm-up; this
    rank's ledger bytes and, on rank 0, the wire's (:class:`~ds_ext.cluster.wire.WireBytes`)."""
    import torch

    from ds_ext.cluster.wire import wire_region
    from ds_ext.comm import Communicator
    from ds_ext.groups import GroupRegistry
    from ds_ext.topology import GB, US, Level, Topology

    topo = Topology.build([Level("gpu", 2, 1 * GB, 8 * US), Level("node", None, 1 * GB, 15 * US)], 4, "2x2")
    comm = Communicator(GroupRegistry(topo))
    group = {
        "cross": comm.registry.cross("node"),
        "cross_rs": comm.registry.cross("node"),
        "span": comm.registry.span("gpu"),
        "world": None,
    }[kind]
    x = torch.ones(nbytes // 4)
    out = torch.empty(comm.size(group) * x.numel())

    def collective() -> None:
        if kind == "world":
            comm.all_reduce(x, group=group)
        elif kind == "cross_rs":
            comm.reduce_scatter(torch.empty(x.numel() // comm.size(group)), x, group=group)
        else:
            comm.all_gather(out, x, group=group)

    collective()  # warm-up: connections
    comm.ledger.reset()
    with wire_region() as region:
        collective()
    return comm.ledger.current.by_level(), region.bytes


@pytest.mark.parametrize("kind,level", [("cross", "node"), ("cross_rs", "node"), ("span", "gpu"), ("world", None)])
def test_wire_bytes_bound_the_ledgers(world, kind, level):
    """payload <= wire <= payload x (1 + WIRE_OVERHEAD), in total (every byte between two GPUs
    leaves its sender's namespace once) and, for a group that crosses one level only, on that
    level's links in both directions."""
    results = world.run(_ledger_and_wire, kind, 2 * MESSAGE)
    ledger: dict[str, float] = {}
    for by_level, _ in results:
        for lv, b in by_level.items():
            ledger[lv] = ledger.get(lv, 0.0) + b
    wire = results[0][1]
    report = wire.beside_ledger(ledger)
    assert ledger and 1 <= report["total"]["wire_over_ledger"] <= 1 + WIRE_OVERHEAD, report
    if level is not None:
        row = report["levels"][level]
        assert set(ledger) == {level}
        for direction in ("wire_up", "wire_down"):
            assert row["ledger"] <= row[direction] <= row["ledger"] * (1 + WIRE_OVERHEAD), report


@pytest.mark.parametrize("kind", LINK_KINDS)
def test_link_bytes_equal_the_wire_of_each_rank(world, kind):
    """The ledger's link bytes (where each algorithm's bytes travel) equal the kernel's
    counters of each rank's own links (``wire_support``): rank r of node n, GPU g (one rank per
    GPU) sends its node bytes up its NIC ``node:n{n}g{g}`` and its bytes to the other GPU up
    ``gpu:n{n}g{g}``. The volume convention (everything at the outermost level the group spans)
    fails this for every group that spans both levels."""
    owners = {f"{lv}:n{r // 2}g{r % 2}": (lv, [r]) for r in range(4) for lv in ("gpu", "node")}
    assert_links_match_the_wire(world, kind, False, owners)


def test_runner_writes_the_wire_bytes(tmp_path):
    """``ds-ext cluster --nic per-gpu --wire-out``: each rank sends 64 KB to its counterpart on the
    other node over raw TCP; the JSON has every link, and each rank's NIC carried its bytes up."""
    problem = netns.capability_problem()
    if problem is not None:
        pytest.skip(f"ds-ext cluster: {problem}")
    out = tmp_path / "wire.json"
    script = (
        "import os, socket, time\n"
        "r = int(os.environ['RANK']); peer = f\"10.77.0.{(r ^ 2) + 1}\"\n"
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        "if r < 2:\n"
        "    for _ in range(200):\n"
        "        try: s.connect((peer, 29600)); break\n"
        "        except OSError: time.sleep(0.05)\n"
        "    s.sendall(bytes(65536)); s.close()\n"
        "else:\n"
        "    s.bind(('', 29600)); s.listen(1); c, _ = s.accept(); n = 0\n"
        "    while (b := c.recv(65536)): n += len(b)\n"
        "    assert n == 65536, n\n"
    )
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "ds_ext.cluster",
            "--nic",
            "per-gpu",
            "--nodes",
            "2",
            "--ranks-per-node",
            "2",
            "--gpus-per-node",
            "2",
            "--node-rate",
            "100mbit",
            "--gpu-rate",
            "400mbit",
            "--wire-out",
            str(out),
            "--",
            sys.executable,
            "-c",
            script,
        ],
        env=ENV,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
    )
    assert res.returncode == 0, res.stderr
    wire = json.loads(out.read_text())
    assert wire["cluster"]["nic"] == "per-gpu" and len(wire["links"]) == 8
    for nic in ("node:n0g0", "node:n0g1"):
        assert 65536 <= wire["links"][nic]["up"] < 65536 + STRAY, wire
    assert wire["by_level"]["node"]["up"] >= 2 * 65536 and wire["sent"] >= 2 * 65536
