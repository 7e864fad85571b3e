"""Pure-logic tests of topology layouts, level attribution, groups and detection."""

import pytest

from ds_ext.config import TopologyConfig
from ds_ext.groups import topology_partition
from ds_ext.parallel import GroupError, ParallelDims, member_group
from ds_ext.runtime import resolve_topology
from ds_ext.topology import GB, Topology, TopologyError, check_fits_job, detect_environment


def frontier(world: int, **sizes) -> Topology:
    return Topology.from_preset("frontier", world, sizes or None)


def test_frontier_preset_levels_and_bandwidths():
    t = frontier(16)
    assert t.level_names == ("gcd", "gpu", "node")
    assert [lv.size for lv in t.levels] == [2, 4, 2]
    assert [lv.bandwidth / GB for lv in t.levels] == [200, 100, 12.5]  # 004 §III-A: 100 GB/s per GCD between MI250X
    assert t.ranks_per_node == 8 and t.world_size == 16
    assert t.coords(13) == (1, 2, 1)  # 13 = 1 + 2*(2 + 4*1)


def test_dgx_preset():
    t = Topology.from_preset("dgx-a100", 32)
    assert t.level_names == ("gpu", "node") and t.ranks_per_node == 8
    assert t.level("gpu").bandwidth == 600 * GB
    assert t.level_of([0, 7]) == "gpu" and t.level_of([7, 8]) == "node"


@pytest.mark.parametrize("world", [8, 16, 384])
def test_frontier_groups_partition_the_world(world):
    t = frontier(world)
    nodes = world // 8
    for level, size, count in [("gcd", 2, world // 2), ("gpu", 8, nodes), ("node", world, 1)]:
        part = topology_partition(t, "span", level)
        assert len(part) == count and all(len(g) == size for g in part)
        assert sorted(r for g in part for r in g) == list(range(world))
    inter = topology_partition(t, "cross", "node")
    assert len(inter) == 8 and all(len(g) == nodes for g in inter)
    assert inter[3] == tuple(3 + 8 * n for n in range(nodes))
    intra = topology_partition(t, "cross", "gpu")
    assert len(intra) == 2 * nodes and intra[1] == (1, 3, 5, 7)
    assert topology_partition(t, "cross", "gcd") == topology_partition(t, "span", "gcd")


@pytest.mark.parametrize("world", [8, 16, 384])
def test_level_attribution(world):
    t = frontier(world)
    assert t.level_of([0]) is None
    assert t.level_of([4, 5]) == "gcd"  # one MI250X
    assert t.level_of([0, 2, 4, 6]) == "gpu"  # same node, different MI250X
    assert t.level_of([0, 1, 2, 3, 4, 5, 6, 7]) == "gpu"
    if world > 8:
        assert t.level_of([7, 8]) == "node"
        assert t.level_of(list(range(world))) == "node"
    for g in topology_partition(t, "cross", "node"):
        assert t.level_of(g) == ("node" if world > 8 else None)


def test_member_group_for_384():
    t = frontier(384)
    assert member_group(topology_partition(t, "span", "gpu"), 200) == tuple(range(200, 208))
    assert member_group(topology_partition(t, "cross", "node"), 200) == tuple(range(0, 384, 8))
    assert member_group(topology_partition(t, "span", "gcd"), 201) == (200, 201)


def test_emulated_two_nodes_two_gpus_two_gcds():
    t = frontier(8, gpu=2)
    assert t.ranks_per_node == 4 and t.levels[-1].size == 2
    assert t.level_of([0, 1]) == "gcd" and t.level_of([0, 2]) == "gpu" and t.level_of([0, 4]) == "node"
    assert topology_partition(t, "cross", "node") == ((0, 4), (1, 5), (2, 6), (3, 7))


def test_world_size_that_does_not_fit():
    with pytest.raises(TopologyError, match=r"world size 12 does not fit topology 'frontier'.*multiple of 8"):
        frontier(12)
    with pytest.raises(TopologyError, match="unknown topology preset 'summit'; allowed: frontier, dgx-a100"):
        Topology.from_preset("summit", 8)
    with pytest.raises(TopologyError, match="has no level 'socket'"):
        frontier(8, socket=2)


def test_parallel_axes_products_innermost_first():
    ax = ParallelDims.build([("tensor", 2), ("expert", 2), ("data", None)], 16)
    assert ax.axes == (("tensor", 2), ("expert", 2), ("data", 4))
    assert ax.coords(13) == {"tensor": 1, "expert": 0, "data": 3}
    assert ax.groups(["tensor"])[0] == (0, 1)
    assert ax.groups(["expert"])[0] == (0, 2)
    assert ax.groups(["data"])[1] == (1, 5, 9, 13)
    te = ax.groups(["tensor", "expert"])
    assert te == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15))
    assert ax.groups(["expert", "data"])[0] == (0, 2, 4, 6, 8, 10, 12, 14)
    with pytest.raises(GroupError, match="not divisible"):
        ParallelDims.build([("tensor", 3), ("data", None)], 16)
    with pytest.raises(GroupError, match="!= world size"):
        ParallelDims.build([("tensor", 2), ("data", 2)], 8)
    with pytest.raises(GroupError, match="unknown parallel axis 'pipe'"):
        ax.groups(["pipe"])


def test_detect_launcher_and_slurm_environments():
    job = detect_environment(
        {"WORLD_SIZE": "16", "RANK": "9", "LOCAL_RANK": "1", "LOCAL_SIZE": "8", "ROCR_VISIBLE_DEVICES": "0,1"}
    )
    assert (job.world_size, job.rank, job.local_rank, job.local_size, job.num_nodes) == (16, 9, 1, 8, 2)
    assert job.visible_devices == ("0", "1") and job.source == "launcher"
    slurm = detect_environment(
        {
            "SLURM_NTASKS": "384",
            "SLURM_PROCID": "17",
            "SLURM_LOCALID": "1",
            "SLURM_NTASKS_PER_NODE": "8(x48)",
            "SLURM_NNODES": "48",
        }
    )
    assert (slurm.world_size, slurm.rank, slurm.local_size, slurm.num_nodes) == (384, 17, 8, 48)
    torchrun = detect_environment({"WORLD_SIZE": "4", "RANK": "0", "LOCAL_WORLD_SIZE": "4"})
    assert torchrun.local_size == 4
    assert detect_environment({}).source == "single-process"


def test_real_job_must_match_ranks_per_node():
    job = detect_environment({"WORLD_SIZE": "8", "RANK": "0", "LOCAL_SIZE": "8"})
    check_fits_job(frontier(8), job)
    with pytest.raises(TopologyError, match="runs 8 ranks per node.*needs 4.*emulate=true"):
        check_fits_job(frontier(8, gpu=2), job)
    emulated = resolve_topology(TopologyConfig(preset="frontier", sizes={"gpu": 2}, emulate=True), 8, job)
    assert emulated.ranks_per_node == 4
    detected = resolve_topology(
        TopologyConfig(), 16, detect_environment({"WORLD_SIZE": "16", "RANK": "0", "LOCAL_SIZE": "4"})
    )
    assert detected.level_names == ("local", "node") and detected.ranks_per_node == 4


def test_generic_levels():
    cfg = TopologyConfig(
        levels=[
            {"name": "socket", "size": 2, "bandwidth_GBps": 100},
            {"name": "rack", "bandwidth_GBps": 10, "latency_us": 20},
        ],
        emulate=True,
    )
    t = resolve_topology(cfg, 6, detect_environment({}))
    assert t.level_names == ("socket", "rack") and t.world_size == 6
    assert t.level("rack").latency == pytest.approx(20e-6)


def test_slurm_rank_variables_for_srun_tasks():
    from ds_ext.topology import slurm_rank_variables

    srun = {
        "SLURM_NTASKS": "16",
        "SLURM_PROCID": "9",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS_PER_NODE": "8(x2)",
        "SLURM_NNODES": "2",
    }
    assert slurm_rank_variables(srun) == {"WORLD_SIZE": "16", "RANK": "9", "LOCAL_RANK": "1", "LOCAL_SIZE": "8"}
    # a launcher that already set the variables wins; outside Slurm nothing is set
    assert slurm_rank_variables({**srun, "WORLD_SIZE": "16", "RANK": "9"}) == {}
    assert slurm_rank_variables({}) == {}


def test_ledger_level_is_computed_once_per_group(monkeypatch):
    """The ledger's hot path: a group's level is found once, not per collective
    (``ds-ext bench ledger`` times it for 9,408 ranks)."""
    from ds_ext.comm.collectives import Communicator
    from ds_ext.groups import GroupRegistry

    topo = Topology.from_preset("frontier", 9408)
    registry = GroupRegistry(topo)
    comm = Communicator(registry)
    handle = object()
    registry._ranks[handle] = tuple(range(0, 9408, 8))
    calls = []
    level_of = topo.level_of
    monkeypatch.setattr(Topology, "level_of", lambda self, ranks: calls.append(1) or level_of(ranks))
    for _ in range(100):
        comm.account("all_reduce", handle, 1000, 500)
    # the group's level, and the level of the link to this rank's ring neighbour (its link bytes)
    assert len(calls) == 2 and comm.ledger.current.by_level() == {"node": 100 * 1000}
