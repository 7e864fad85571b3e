"""Every level shaped (``ds-ext cluster --gcd-rate``): a namespace and a shaped link per GCD, so
that the GCD pair of a GPU (Frontier's MI250X, 003 §IV, 004 §III-A: 200 GB/s), the GPUs of a node
(100 GB/s) and the NICs (25 GB/s) are all links whose bytes the kernel counts.

Pure-logic tests need nothing. The others build clusters and skip, with the command's own
one-line reason, where the host cannot:

* on 2 nodes x 2 GPUs x 2 GCDs with a NIC per GPU, in Frontier's ratios: a rank's bytes to its
  GCD partner cross only its GCD link (up on the sender's, down on the receiver's), to the other
  GPU of its node only the two GPU links, to the other node only the two NICs;
* each level's measured rate is its own link's shape (fastest of 3; GCD : GPU : NIC = 8 : 4 : 1);
* 4 nodes (16 ranks): an all-gather over the world through ds_ext.comm's Communicator is
  correct, and its ring's hops put their bytes on all three levels, each level the bytes of the
  hops whose two ranks differ at it (``Topology.level_of``);
* ``ds-ext cluster --gcd-rate --wire-out`` with one link per node (nested GPU links) and with no
  GPU level: each pair's raw TCP bytes cross exactly the links of its path.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from wire_support import LINK_KINDS, assert_links_match_the_wire, send_pairs

from ds_ext.cluster import netns
from ds_ext.cluster.command import add_cluster_arguments, spec_from_args
from ds_ext.cluster.measure import cross_group, exchange_partner, measured_topology, span_group, spec_from_json
from ds_ext.cluster.netns import cluster_links
from ds_ext.cluster.spec import MAX_LEAVES, ClusterError, ClusterSpec, LinkShape, spec_from_topology
from ds_ext.cluster.world import bench_cluster_spec, bench_world, refuse_link_flags_when_emulating
from ds_ext.topology import GB, US, Level, Topology

# Frontier / 4000 (003 §IV, 004 §III-A: 200 : 100 : 25 GB/s per direction)
GCD_MBIT, GPU_MBIT, NIC_MBIT = 400, 200, 50
TOLERANCE = 0.15  # as the other rate tests (tests/test_cluster.py)
WIRE_OVERHEAD = 0.03  # headers and acknowledgements: docs/cluster.md, "Bytes on the wire"
STRAY = 16_000  # bytes a link may carry in a region without payload: barriers, ARP, acknowledgements
MESSAGE = 2**20
REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _spec(nodes: int = 2) -> ClusterSpec:
    """``nodes`` nodes x 2 GPUs x 2 GCDs, a NIC per GPU, every level shaped."""
    return ClusterSpec(
        nodes,
        4,
        LinkShape.of(NIC_MBIT * 1e6),
        2,
        LinkShape.of(GPU_MBIT * 1e6),
        "per-gpu",
        LinkShape.of(GCD_MBIT * 1e6),
    )


def _topology(nodes: int) -> Topology:
    """The cluster's levels as ds_ext.topology names them (rank = n P + g C + c)."""
    levels = [Level("gcd", 2, 1 * GB, 5 * US), Level("gpu", 2, 1 * GB, 8 * US), Level("node", None, 1 * GB, 15 * US)]
    return Topology.build(levels, 4 * nodes, "2x2x2")


def _link_of(rank: int, level: str) -> str:
    """The name of ``rank``'s link of ``level`` on a cluster of :func:`_spec` (4 ranks per node)."""
    node, gpu, gcd = rank // 4, rank // 2 % 2, rank % 2
    return f"gcd:n{node}g{gpu}c{gcd}" if level == "gcd" else f"{level}:n{node}g{gpu}"


# ---- pure logic ------------------------------------------------------------------------------


def test_gcd_links_and_levels():
    """Each GCD has a link into its GPU's GCD switch (a bridge in the GPU's namespace); a pair's
    link class is the outermost level its ranks differ at, as ds_ext.topology names it."""
    spec = _spec()
    assert (spec.world_size, spec.leaves, spec.ranks_per_leaf, spec.ranks_per_gpu) == (8, 8, 1, 2)
    links = cluster_links(spec, "abc123")
    gcd = [lk for lk in links if lk.level == "gcd"]
    assert [(lk.name, lk.upper_ns.rsplit("-", 1)[1], lk.lower_ns.rsplit("-", 1)[1]) for lk in gcd[:4]] == [
        ("gcd:n0g0c0", "n0g0", "n0g0c0"),
        ("gcd:n0g0c1", "n0g0", "n0g0c1"),
        ("gcd:n0g1c0", "n0g1", "n0g1c0"),
        ("gcd:n0g1c1", "n0g1", "n0g1c1"),
    ]
    assert len({lk.bridge for lk in gcd}) == 4 and all(lk.shape == spec.gcd_link for lk in gcd)
    assert [lk.name for lk in links if lk.level != "gcd"] == [lk.name for lk in cluster_links(_nic_only(), "abc123")]
    names = [n for lk in links for n in (lk.upper_if, lk.lower_if)]
    assert len(set(names)) == len(names) and all(len(n) <= 15 for n in names)
    topo = _topology(2)
    assert all(spec.level_of_pair(a, b) == topo.level_of([a, b]) for a in range(8) for b in range(8) if a != b)
    assert spec.path_rate_bps("gcd") == GCD_MBIT * 1e6 and spec.path_rate_bps("gpu") == GPU_MBIT * 1e6
    assert spec_from_json(spec.to_json()) == spec and "GCD links inside a GPU 400 Mbit/s" in spec.describe()


def _nic_only() -> ClusterSpec:
    return ClusterSpec(2, 4, LinkShape.of(NIC_MBIT * 1e6), 2, LinkShape.of(GPU_MBIT * 1e6), "per-gpu")


def test_gcd_links_of_the_other_shapes():
    """One link per node (nested GPU links) and no GPU level at all take GCD links too: the GPU's
    (or node's) namespace routes for its GCDs."""
    nested = ClusterSpec(2, 4, LinkShape.of(40e6), 2, LinkShape.of(80e6), gcd_link=LinkShape.of(160e6))
    assert [lk.name for lk in cluster_links(nested, "abc123")][:5] == [
        "node:n0",
        "gpu:n0g0",
        "gcd:n0g0c0",
        "gcd:n0g0c1",
        "gpu:n0g1",
    ]
    flat = ClusterSpec(2, 2, LinkShape.of(40e6), gcd_link=LinkShape.of(160e6))
    assert [(lk.name, lk.upper_ns.rsplit("-", 1)[1]) for lk in cluster_links(flat, "abc123")][:3] == [
        ("node:n0", "sw"),
        ("gcd:n0g0c0", "n0"),
        ("gcd:n0g0c1", "n0"),
    ]
    assert [flat.level_of_pair(0, b) for b in (1, 2)] == ["gcd", "node"]


def test_refusals_are_one_line_naming_the_setting():
    with pytest.raises(ClusterError) as err:
        ClusterSpec(2, 2, LinkShape.of(1e8), 2, LinkShape.of(4e8), "per-gpu", LinkShape.of(8e8))
    assert "\n" not in str(err.value) and "--gcd-rate" in str(err.value) and "2 or more ranks per GPU" in str(err.value)
    with pytest.raises(ClusterError, match="256 namespaces with ranks exceed the 250"):
        ClusterSpec(64, 4, LinkShape.of(1e8), 2, LinkShape.of(4e8), "per-gpu", LinkShape.of(8e8))
    assert (
        ClusterSpec(62, 4, LinkShape.of(1e8), 2, LinkShape.of(4e8), "per-gpu", LinkShape.of(8e8)).leaves <= MAX_LEAVES
    )
    with pytest.raises(ClusterError, match="--gcd-level needs --gpu-level"):
        spec_from_topology({"preset": "frontier"}, nodes=2, gcd_level=True)
    p = argparse.ArgumentParser()
    add_cluster_arguments(p)
    with pytest.raises(ClusterError, match="--gcd-level reads the 'gcd' level of --config"):
        spec_from_args(p.parse_args(["--node-rate", "1mbit", "--gcd-level"]))
    args = p.parse_args(["--gcd-rate", "8mbit"])
    args.network = "emulate"
    with pytest.raises(ClusterError, match="--gcd-rate only apply to --network netns"):
        refuse_link_flags_when_emulating(args)
    args = p.parse_args(
        "--nic per-gpu --ranks-per-node 4 --gpus-per-node 2 --node-rate 50mbit --gpu-rate 200mbit "
        "--gcd-rate 400mbit".split()
    )
    assert spec_from_args(args) == _spec()
    args = p.parse_args(["--nodes", "4"])
    args.network, args.timeout = "emulate", 60
    with pytest.raises(ClusterError, match="^--nodes 4: this benchmark runs 2 nodes .*; allowed: --nodes 2$"):
        bench_world(args, 8, {})  # a benchmark of 2 nodes (ds-ext bench ted, pmm)
    args = p.parse_args("--nodes 4 --nic per-gpu --gpus-per-node 2 --node-rate 50mbit --gpu-rate 200mbit".split())
    args.network, args.timeout = "netns", 60
    assert bench_cluster_spec(args, 16, 4).nodes == 4  # ds-ext bench zero --nodes 4: 16 ranks
    with pytest.raises(ClusterError, match="runs this benchmark's 2 nodes"):
        bench_cluster_spec(args, 8)


def test_frontier_preset_shapes_every_level_in_its_ratios(tmp_path):
    """frontier (per rank: gcd 200, gpu 100, node 12.5 GB/s) with a NIC per GPU and GCD links: a
    GCD's link 200 GB/s, a GPU's 200 (its 2 GCDs), a NIC 25 (003 §IV, 004 §III-A); / 2000: 800 : 800 :
    100 Mbit/s."""
    spec = spec_from_topology(
        {"preset": "frontier"}, nodes=2, rate_scale=2000, gpu_level=True, nic="per-gpu", gcd_level=True
    )
    assert (spec.ranks_per_node, spec.gpus_per_node, spec.leaves) == (8, 4, 16)
    rates = [spec.gcd_link.rate_bps, spec.gpu_link.rate_bps, spec.node_link.rate_bps]
    assert rates == pytest.approx([800e6, 800e6, 100e6])
    cfg = tmp_path / "cfg.json"
    cfg.write_text('{"ds_ext": {"topology": {"preset": "frontier"}}}')
    p = argparse.ArgumentParser()
    add_cluster_arguments(p)
    flags = f"--config {cfg} --gpu-level --gcd-level --nic per-gpu --rate-scale 2000 --gcd-rate 600mbit".split()
    assert spec_from_args(p.parse_args(flags[:-2])) == spec
    assert spec_from_args(p.parse_args(flags)).gcd_link.rate_bps == 600e6  # an explicit rate wins


def test_measurement_groups_of_the_gcd_level():
    """``tune --measure`` on GCD links: the gcd level's groups are a GPU's ranks, as loopback's were,
    and a measured gcd level becomes the topology's innermost level, unshared."""
    spec = _spec()
    assert span_group(spec, "gcd") == cross_group(spec, "gcd") == [0, 1]
    assert [exchange_partner(spec, "gcd", r) for r in range(4)] == [1, 0, 3, 2]
    assert [exchange_partner(spec, "gpu", r) for r in range(4)] == [2, 3, 0, 1]
    level = {"latency_s": 1e-4, "p2p_bytes_per_s": 1e7, "shared_bytes_per_s": None}
    db = {"cluster": spec.to_json(), "levels": {lv: dict(level) for lv in ("gcd", "gpu", "node")}}
    topo = measured_topology(db, ("gcd", "gpu", "node"))
    assert [(lv.size, lv.bandwidth) for lv in topo.levels] == [(2, 1e7), (2, 5e6), (2, 5e6)]


# ---- real clusters ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def capable():
    problem = netns.capability_problem()
    if problem is not None:
        pytest.skip(f"ds-ext cluster: {problem}")


@pytest.fixture(scope="module")
def world(capable):
    from ds_ext.cluster.world import cluster_world

    with cluster_world(_spec()) as w:
        yield w


def test_bytes_cross_exactly_one_level(world):
    """A rank's bytes to its GCD partner, to the other GPU of its node and to the other node: up
    the sender's link of the level the two ranks differ at, down the receiver's, and on no other
    link (the hop between a GCD and its GPU's router is counted by no level)."""
    topo = _topology(2)
    world.run(send_pairs, [(a, a ^ 1) for a in range(8)] + [(0, 2), (0, 4), (5, 2), (3, 7)], 4096)  # connections
    for a, b in ((0, 1), (1, 0), (6, 7), (0, 2), (3, 1), (0, 4), (5, 2), (7, 3)):
        level = topo.level_of([a, b])
        links = world.run(send_pairs, [(a, b)], MESSAGE)[0][1]
        up, down = _link_of(a, level), _link_of(b, level)
        assert MESSAGE <= links[up]["up"] <= MESSAGE * (1 + WIRE_OVERHEAD), (a, b, links)
        assert MESSAGE <= links[down]["down"] <= MESSAGE * (1 + WIRE_OVERHEAD), (a, b, links)
        others = {name: moved for name, moved in links.items() if name not in (up, down)}
        assert all(moved["up"] < STRAY and moved["down"] < STRAY for moved in others.values()), (a, b, links)


@pytest.mark.parametrize(
    "level,pair,mbit", [("gcd", (0, 1), GCD_MBIT), ("gpu", (0, 2), GPU_MBIT), ("node", (0, 4), NIC_MBIT)]
)
def test_each_level_runs_at_its_shape(world, level, pair, mbit):
    """Fastest of 3 (CPU contention only adds time): ``nbytes`` over the pair's path at its level's
    rate, 0.17 s of traffic whatever the level, so the three are measured alike."""
    assert _topology(2).level_of(list(pair)) == level
    rate = mbit * 1e6 / 8
    nbytes = int(rate * 0.17) // 4 * 4
    seconds = min(max(t for t, _ in world.run(send_pairs, [pair], nbytes)) for _ in range(3))
    assert nbytes / seconds == pytest.approx(rate, rel=TOLERANCE)


@pytest.mark.parametrize("kind", [k for k in LINK_KINDS if k not in ("world_broadcast", "ring", "torch_reduce")])
def test_link_bytes_equal_the_wire_of_every_level(world, kind):
    """Every level shaped: the ledger's link bytes equal the kernel's counters of each
    GCD's own link (its rank's ``gcd`` bytes) and of each GPU's link and NIC (the ``gpu`` / ``node``
    bytes of its two GCDs), for the collective kinds of ``wire_support.LINK_KINDS`` (broadcast, reduce
    and ds_ext's ring, rarer in a step, on the NIC-per-GPU cluster only: tests/test_cluster_nic.py)."""
    owners = {_link_of(r, "gcd"): ("gcd", [r]) for r in range(8)}
    for r in range(0, 8, 2):
        owners |= {_link_of(r, lv): (lv, [r, r + 1]) for lv in ("gpu", "node")}
    assert_links_match_the_wire(world, kind, True, owners)


def _all_gather(nbytes: int) -> tuple[bool, dict[str, dict[str, int]] | None]:
    """An all-gather over the world through ds_ext.comm (rank r gives ``nbytes`` of the value r),
    after a warm-up; whether it is correct on this rank and, on rank 0, the bytes per level."""
    import torch
    import torch.distributed as dist

    from ds_ext.cluster.wire import wire_region
    from ds_ext.comm import Communicator
    from ds_ext.groups import GroupRegistry

    world = dist.get_world_size()
    comm = Communicator(GroupRegistry(_topology(world // 4)))
    x = torch.full((nbytes // 4,), float(dist.get_rank()))
    out = torch.empty(world * x.numel())
    comm.all_gather(out, x)  # warm-up: connections
    with wire_region() as region:
        comm.all_gather(out, x)
    correct = bool(out.view(world, -1).eq(torch.arange(world, dtype=out.dtype)[:, None]).all())
    return correct, region.bytes.by_level() if region.bytes else None


def test_sixteen_ranks_all_gather_on_every_level(capable):
    """4 nodes x 2 GPUs x 2 GCDs: gloo's ring all-gather (rank r -> r + 1) sends W - 1 chunks over
    each hop; 8 hops join GCD partners, 4 the GPUs of a node, 4 cross nodes, and each level's
    links carry exactly its hops' bytes up (plus headers)."""
    from ds_ext.cluster.world import cluster_world

    nbytes, world_size = 256 * 2**10, 16
    topo = _topology(4)
    hops = [topo.level_of([r, (r + 1) % world_size]) for r in range(world_size)]
    with cluster_world(_spec(4)) as world:
        results = world.run(_all_gather, nbytes)
    assert all(correct for correct, _ in results)
    by_level = results[0][1]
    for level in ("gcd", "gpu", "node"):
        payload = hops.count(level) * (world_size - 1) * nbytes
        assert payload <= by_level[level]["up"] <= payload * (1 + WIRE_OVERHEAD), by_level
        assert payload <= by_level[level]["down"] <= payload * (1 + WIRE_OVERHEAD), by_level


_RAW_SEND = """
import os, socket, threading, time
pairs, rank = {pairs}, int(os.environ["RANK"])
def receive(src):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("", 29600 + src)); s.listen(1); c, _ = s.accept(); n = 0
    while (b := c.recv(65536)): n += len(b)
    assert n == 65536, n
def send(dst):
    s = socket.socket()
    for _ in range(200):
        try: s.connect((f"10.77.0.{{dst + 1}}", 29600 + rank)); break
        except OSError: time.sleep(0.05)
    s.sendall(bytes(65536)); s.close()
threads = [threading.Thread(target=receive, args=(a,)) for a, b in pairs if b == rank]
threads += [threading.Thread(target=send, args=(b,)) for a, b in pairs if a == rank]
for t in threads: t.start()
for t in threads: t.join()
"""


@pytest.mark.parametrize(
    "flags,expected",
    [
        (  # one link per node, nested GPU links: a GCD's bytes to another node cross its GPU's link and its node's
            ["--ranks-per-node", "4", "--gpus-per-node", "2", "--gpu-rate", "200mbit"],
            {
                (0, 1): [("gcd:n0g0c0", "up"), ("gcd:n0g0c1", "down")],
                (1, 2): [("gpu:n0g0", "up"), ("gpu:n0g1", "down")],
                (3, 4): [("gpu:n0g1", "up"), ("node:n0", "up"), ("node:n1", "down"), ("gpu:n1g0", "down")],
            },
        ),
        (  # no GPU level: the node's namespace routes for its GCDs
            ["--ranks-per-node", "2"],
            {(0, 1): [("gcd:n0g0c0", "up"), ("gcd:n0g0c1", "down")], (1, 2): [("node:n0", "up"), ("node:n1", "down")]},
        ),
    ],
    ids=["per-node", "no-gpu-level"],
)
def test_runner_shapes_gcd_links_of_the_other_shapes(capable, tmp_path, flags, expected):
    """``ds-ext cluster --gcd-rate --wire-out`` on the shapes without a NIC per GPU: ranks send
    64 KB over raw TCP; each pair's bytes cross exactly the links of its path, no others."""
    out = tmp_path / "wire.json"
    res = subprocess.run(
        [sys.executable, "-m", "ds_ext.cluster", "--nodes", "2", "--node-rate", "50mbit", "--gcd-rate", "400mbit"]
        + flags
        + ["--wire-out", str(out), "--", sys.executable, "-c", _RAW_SEND.format(pairs=list(expected))],
        env=ENV,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode == 0, res.stderr
    links = json.loads(out.read_text())["links"]
    crossed = {hop for hops in expected.values() for hop in hops}
    for (name, direction), moved in ((hop, links[hop[0]][hop[1]]) for hop in crossed):
        assert 65536 <= moved < 65536 + STRAY, (name, direction, links)
    assert all(links[name][d] < STRAY for name in links for d in ("up", "down") if (name, d) not in crossed), links
