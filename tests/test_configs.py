"""Every shipped ds_config parses, and its plan resolves on the topology it names."""

import json
from pathlib import Path

import pytest

from ds_ext import config as cfgmod
from ds_ext.runtime import resolve_topology
from ds_ext.topology import detect_environment
from ds_ext.zero_topo.plan import resolve_plan

CONFIGS = sorted((Path(__file__).parents[1] / "configs").rglob("*.json"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_shipped_config_is_valid(path):
    ds_config = json.loads(path.read_text())
    parsed = cfgmod.parse(ds_config["ds_ext"])
    topo_cfg = parsed.topology.model_copy(update={"emulate": True})
    topo = resolve_topology(topo_cfg, 16, detect_environment({}))
    if parsed.zero_topo.enabled:
        assert resolve_plan(parsed.zero_topo, topo).describe()
        assert ds_config.get("zero_optimization", {}).get("stage", 0) == 0


def test_one_config_per_zero_topo_preset():
    names = {p.stem for p in CONFIGS if p.parent.name == "zero_topo"}
    assert names == {"zero3", "zeropp", "mics", "zero_topo_paper", "zero_topo", "zero_topo_int8"}


class _Mpu:
    """The data-parallel size DeepSpeed's config parser checks the batch sizes against."""

    def __init__(self, dp):
        self.dp = dp

    def get_data_parallel_world_size(self):
        return self.dp

    def get_model_parallel_world_size(self):
        return 1

    def get_data_parallel_rank(self):
        return 0

    def get_model_parallel_rank(self):
        return 0


# file: (nodes, tensor parallel, pipeline parallel, global batch, gradient accumulation DeepSpeed derives)
RECIPES = {
    "gpt_22b_004.json": (8, 2, 2, 640, 40),  # the planner's first choice (docs/planner.md)
    "gpt_22b_004_zero_topo.json": (8, 2, 2, 640, 40),  # the same with ZeRO-topo's pipeline form
    "gpt_175b_004.json": (128, 4, 16, 640, 40),  # 004 Table V; strong scaling at 1024 GCDs
    "gpt_1t_004.json": (128, 8, 64, 3200, 1600),  # 004 Table V; two replicas of 512 GCDs (004 §V-C1)
    "gpt_1t_004_zero_topo.json": (128, 8, 64, 3200, 1600),
    "gpt_175b_004_zero_topo.json": (128, 4, 16, 640, 40),
    "neox_20b_zero_topo_003.json": (48, 1, 1, 1536, 1),  # 003: ZeRO-topo on 48 nodes = 384 GCDs
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_frontier_recipes_pass_the_schema_and_deepspeeds_own_parser(name, monkeypatch):
    """004 / 003 recipes: the "ds_ext" block validates, the plan resolves on the job's
    Frontier topology, and DeepSpeed's DeepSpeedConfig accepts the rest with the batch
    sizes consistent for the recipe's data-parallel size."""
    from deepspeed.runtime import config as ds_config_module

    # the parser asks torch.distributed for this process's rank before it reads the mpu
    monkeypatch.setattr(ds_config_module.dist, "get_rank", lambda *a, **k: 0)
    nodes, tp, pp, gbs, ga = RECIPES[name]
    ds_config = json.loads((Path(__file__).parents[1] / "configs" / "frontier" / name).read_text())
    parsed = cfgmod.parse(ds_config["ds_ext"])
    topo = resolve_topology(parsed.topology.model_copy(update={"emulate": True}), 8 * nodes, detect_environment({}))
    assert topo.level_names == ("gcd", "gpu", "node") and topo.levels[-1].size == nodes
    if parsed.zero_topo.enabled:
        assert resolve_plan(parsed.zero_topo, topo).describe().startswith("weights gcd")
    dp = 8 * nodes // (tp * pp)
    parsed_ds = ds_config_module.DeepSpeedConfig(ds_config, mpu=_Mpu(dp))
    assert (parsed_ds.train_batch_size, parsed_ds.gradient_accumulation_steps) == (gbs, ga)
    assert parsed_ds.train_micro_batch_size_per_gpu == (4 if "neox" in name else 1)
    assert parsed_ds.zero_optimization_stage == (0 if parsed.zero_topo.enabled else 1)
    half = parsed_ds.float16_config.enabled  # 004 and 003 train in fp16; so do their ZeRO-topo forms
    assert half and parsed_ds.gradient_clipping == 1.0
