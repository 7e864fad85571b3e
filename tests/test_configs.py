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
    assert names == {"zero3", "zeropp", "mics", "zero_topo_paper", "zero_topo"}
