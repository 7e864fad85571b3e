"""The "ds_ext" block: defaults, one-line errors naming the key, plugin sections, CLI."""

import json
import subprocess
import sys

import pytest

from ds_ext import config as cfgmod
from ds_ext.plugin import Plugin, PluginConfig, register_plugin, unregister_plugin


def test_defaults():
    cfg = cfgmod.parse({})
    assert cfg.topology.preset is None and cfg.topology.emulate is False
    assert cfg.comm.ledger is True and cfg.comm.emulate_time is False
    assert cfgmod.parse(None).model_dump() == cfg.model_dump()


@pytest.mark.parametrize(
    "block, message",
    [
        ({"topology": {"preset": "summit"}},
         "ds_ext.topology.preset: Input should be 'frontier' or 'dgx-a100' (got 'summit')"),
        ({"topolgy": {}}, "ds_ext.topolgy: unknown key; allowed keys: comm, pccl, pmm3d, ted, tiled_optimizer, topology"),
        ({"topology": {"emulte": True}},
         "ds_ext.topology.emulte: unknown key; allowed keys: emulate, levels, preset, sizes"),
        ({"comm": {"time_scale": 0}}, "ds_ext.comm.time_scale: Input should be greater than 0 (got 0)"),
        ({"topology": {"preset": "frontier", "levels": []}}, "give either 'preset' or 'levels'"),
        ({"topology": {"levels": [{"name": "x", "size": 0, "bandwidth_GBps": 1}]}},
         "ds_ext.topology.levels.0.size: Input should be greater than or equal to 1 (got 0)"),
        ([1, 2], "ds_ext: must be a JSON object, got list"),
    ],
)
def test_errors_name_the_key(block, message):
    with pytest.raises(cfgmod.DsExtConfigError) as err:
        cfgmod.parse(block)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


class _DemoConfig(PluginConfig):
    level: str = "gpu"


class _Demo(Plugin):
    name = "demo_plugin"
    Config = _DemoConfig


def test_plugin_registers_its_section():
    register_plugin(_Demo)
    try:
        cfg = cfgmod.parse({"demo_plugin": {"enabled": True, "level": "node"}})
        assert cfgmod.plugin_configs(cfg)["demo_plugin"].level == "node"
        assert "demo_plugin" in cfgmod.json_schema()["properties"]
        with pytest.raises(cfgmod.DsExtConfigError, match="ds_ext.demo_plugin.bits: unknown key; allowed keys: enabled, level"):
            cfgmod.parse({"demo_plugin": {"bits": 3}})
    finally:
        unregister_plugin("demo_plugin")
    with pytest.raises(cfgmod.DsExtConfigError, match="ds_ext.demo_plugin: unknown key"):
        cfgmod.parse({"demo_plugin": {}})


def test_load_ds_config_errors(tmp_path):
    with pytest.raises(cfgmod.DsExtConfigError, match="does not exist"):
        cfgmod.load_ds_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(cfgmod.DsExtConfigError, match="is not valid JSON"):
        cfgmod.load_ds_config(bad)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "ds_ext.cli", *args], capture_output=True, text=True)


def test_cli_schema_and_detect():
    out = _cli("schema")
    assert out.returncode == 0
    assert set(json.loads(out.stdout)["properties"]) >= {"topology", "comm"}
    det = _cli("detect", "--preset", "frontier", "--world-size", "16", "--rank", "9")
    assert det.returncode == 0
    assert "gcd=2" in det.stdout and "node=2" in det.stdout
    assert "cross [1, 9]" in det.stdout and "span [8, 9]" in det.stdout
    bad = _cli("detect", "--preset", "frontier", "--world-size", "12")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "ds-ext: error: world size 12 does not fit topology 'frontier' "
        "(2 gcd x 4 gpu = 8 ranks per node): it must be a multiple of 8"
    ]
    all_ranks = _cli("detect", "--preset", "frontier", "--world-size", "384", "--all")
    assert sum(line.startswith("rank ") for line in all_ranks.stdout.splitlines()) == 384
