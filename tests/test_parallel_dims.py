"""One parallel-layout object (:mod:`ds_ext.parallel`) and one group builder (no processes).

TED's layout and 3D-PMM's grid are views of a :class:`ParallelDims` (their named groups are sets
of its axes); :func:`ds_ext.groups.build_process_groups` creates the named groups of any view in
one order and hands back one bundle whose sizes, ranks and members follow from the dims alone
(and from which both plugins' mpu is built);
``spans`` says which topology level each axis crosses; the dims, the planner and the CLI's pure
commands import no torch.
"""

import subprocess
import sys
from types import SimpleNamespace

import pytest

from ds_ext.groups import GridGroups, ProcessGroups, TEDGroups, build_process_groups
from ds_ext.mpu import MegatronMPU
from ds_ext.parallel import Grid, GroupError, Layout, ParallelDims, TEDLayout, member_group
from ds_ext.topology import Topology

FRONTIER_32 = Topology.from_preset("frontier", 32)


def test_ted_and_pmm_layouts_are_views_of_parallel_dims():
    ted = TEDLayout.build(16, 2, 4)
    assert isinstance(ted, Layout) and ted.parallel_dims == ParallelDims(
        (("tensor", 2), ("expert", 4), ("expert_data", 2))
    )
    assert (ted.tensor, ted.expert, ted.expert_data, ted.nonexp_data) == (2, 4, 2, 8)
    grid = Grid(2, 1, 4, 2)
    assert isinstance(grid, Layout) and grid.parallel_dims == ParallelDims.build(
        [("x", 2), ("y", 1), ("z", 4), ("data", None)], 16
    )
    for layout in (ted, grid):
        for name, axes in layout.GROUPS.items():
            assert layout.partition(name) == layout.parallel_dims.groups(axes)
    assert grid.partition("tensor") == grid.parallel_dims.groups(["x", "y", "z"])
    with pytest.raises(GroupError, match="unknown TED group 'pipe'"):
        ted.partition("pipe")


@pytest.mark.parametrize(
    "layout", [TEDLayout.build(32, 2, 4), TEDLayout.build(32, 1, 8, 4), Grid(2, 2, 2, 4), Grid(1, 4, 1, 8)], ids=str
)
def test_group_rank_and_size_follow_from_the_dims(layout):
    """A rank's place in each named group is its position among the group's ascending ranks (torch's
    order), computed from its coordinates alone."""
    dims = layout.parallel_dims
    for name, axes in layout.GROUPS.items():
        for rank in range(dims.world_size):
            members = member_group(layout.partition(name), rank)
            assert dims.group_rank(axes, rank) == dims.group_rank(axes[::-1], rank) == members.index(rank)
            assert dims.size(*axes) == len(members)


@pytest.mark.parametrize(
    "dims",
    [
        ParallelDims.build([("tensor", 2), ("expert", 4), ("expert_data", None)], 32),
        ParallelDims.build([("a", 4), ("b", 2), ("c", 4)], 32),
        ParallelDims.build([("a", 1), ("b", 16), ("c", 2)], 32),
    ],
    ids=str,
)
def test_spans_are_the_outermost_level_of_the_axis_groups(dims):
    for axis, level in dims.spans(FRONTIER_32).items():
        levels = {FRONTIER_32.level_of(g) for g in dims.groups([axis])} - {None}
        assert level == (max(levels, key=FRONTIER_32.index) if levels else None), axis
    assert TEDLayout.build(32, 2, 4).parallel_dims.spans(FRONTIER_32) == {
        "tensor": "gcd",
        "expert": "gpu",
        "expert_data": "node",
    }


class FakeRegistry:
    def __init__(self, world_size: int) -> None:
        self.topology = SimpleNamespace(world_size=world_size)
        self.created: list = []

    def group(self, partition):
        self.created.append(partition)
        return f"pg{len(self.created) - 1}"


def test_builder_creates_named_groups_in_order_and_hands_one_bundle():
    registry, grid = FakeRegistry(8), Grid(2, 1, 2, 2)
    bundle = build_process_groups(registry, grid, rank=5)
    assert isinstance(bundle, ProcessGroups) and list(bundle) == ["x", "y", "z", "data", "tensor"]
    assert bundle["y"] is None  # an optional axis of degree 1: nothing to communicate
    assert registry.created == [grid.partition(n) for n in ("x", "z", "data", "tensor")]
    # rank 5 = x 1, y 0, z 0, data 1 (X innermost)
    assert [(bundle.size(n), bundle.rank(n)) for n in bundle] == [(2, 1), (1, 0), (2, 0), (2, 1), (4, 1)]
    assert bundle.ranks("tensor") == (4, 5, 6, 7) and bundle.ranks("data") == (1, 5)
    assert isinstance(bundle, GridGroups) and (bundle.x, bundle.y, bundle.z, bundle.data, bundle.tensor) == tuple(
        bundle[n] for n in ("x", "y", "z", "data", "tensor")
    )  # the same groups as typed fields
    mpu = MegatronMPU.over(bundle)  # what the plugin hands DeepSpeed
    assert (
        mpu.get_model_parallel_group(),
        mpu.get_model_parallel_world_size(),
        mpu.get_model_parallel_rank(),
        mpu.get_tensor_model_parallel_src_rank(),
    ) == ("pg3", 4, 1, 4)
    assert (
        mpu.get_data_parallel_group(),
        mpu.get_data_parallel_world_size(),
        mpu.get_data_parallel_rank(),
        mpu.get_data_parallel_group_ranks(),
    ) == ("pg2", 2, 1, [1, 5])

    registry, ted = FakeRegistry(8), TEDLayout.build(8, 2, 2)
    bundle = build_process_groups(registry, ted, rank=3)
    assert list(bundle) == ["tensor", "expert", "expert_data", "data", "expert_replicas"]
    assert all(bundle[n] is not None for n in bundle)  # TED hands every group to DeepSpeed
    assert isinstance(bundle, TEDGroups) and (
        bundle.tensor,
        bundle.expert,
        bundle.expert_data,
        bundle.data,
        bundle.expert_replicas,
    ) == tuple(bundle[n] for n in bundle)
    assert len(set(map(id, tuple(bundle[n] for n in bundle)))) == 5  # five distinct groups, none swapped
    assert (bundle.rank("tensor"), bundle.rank("expert"), bundle.rank("data")) == (1, 1, 1)
    with pytest.raises(GroupError, match="TED layout of 8 ranks on a topology of 16"):
        build_process_groups(FakeRegistry(16), ted, rank=0)


def test_parallel_dims_planner_and_grid_import_without_torch():
    script = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, *args):\n"
        "        if name.split('.')[0] in ('torch', 'deepspeed'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import ds_ext.parallel, ds_ext.groups, ds_ext.pmm.grid, ds_ext.planner.plan, ds_ext.planner.ted_layouts\n"
        "import ds_ext.planner.pmm_grids, ds_ext.perf.ted, ds_ext.config, ds_ext.cli\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


# ---- the job's layout and the hierarchy a group sees -------------------------------
def test_job_layout_from_megatron_degrees_and_the_data_group_hierarchy():
    """Megatron's order (tensor innermost, then data, then pipeline), written out by hand for 8 ranks
    at TP 2: the data groups hold one GCD of each MI250X, so they span gpu x node only."""
    from ds_ext.parallel import JobLayout
    from ds_ext.topology import Topology

    topo = Topology.from_preset("frontier", 8, {"gpu": 2})
    job = JobLayout.megatron(8, 2, 1, "test")
    assert job.partition("tensor") == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert job.partition("data") == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert job.partition("model") == job.partition("tensor") and job.degree("pipeline") == 1
    sub = topo.of_group([1, 3, 5, 7], "dp")
    assert [(lv.name, lv.size) for lv in sub.levels] == [("gpu", 2), ("node", 2)]
    assert job.describe(topo).startswith("tensor 2 (crosses gcd), pipeline 1 (within a rank), data 4 (crosses node)")
    piped = JobLayout.megatron(8, 2, 2, "test")
    assert piped.partition("data") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert piped.partition("model") == ((0, 1, 4, 5), (2, 3, 6, 7))


def test_job_layout_refuses_groups_out_of_megatron_order_and_non_grid_groups():
    from ds_ext.parallel import GroupError, JobLayout
    from ds_ext.topology import Topology, TopologyError

    job = JobLayout.megatron(8, 2, 1, "test")
    job.check_groups(3, {"tensor": [2, 3], "data": [1, 3, 5, 7]})
    with pytest.raises(GroupError, match=r"^the mpu's data group of rank 3 is \[3, 7\], not \[1, 3, 5, 7\]"):
        job.check_groups(3, {"tensor": [2, 3], "data": [3, 7]})
    with pytest.raises(TopologyError, match="do not form a grid"):
        Topology.from_preset("frontier", 8, {"gpu": 2}).of_group([0, 3], "x")
    with pytest.raises(GroupError, match="not divisible"):
        JobLayout.megatron(8, 3, 1, "test")
