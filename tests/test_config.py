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
        (
            {"topology": {"preset": "summit"}},
            "ds_ext.topology.preset: Input should be 'frontier' or 'dgx-a100' (got 'summit')",
        ),
        (
            {"topolgy": {}},
            "ds_ext.topolgy: unknown key; allowed keys: comm, goldfish, pccl, pmm3d, samo, ted, tiled_optimizer, topology",
        ),
        (
            {"topology": {"emulte": True}},
            "ds_ext.topology.emulte: unknown key; allowed keys: emulate, levels, preset, sizes",
        ),
        ({"comm": {"time_scale": 0}}, "ds_ext.comm.time_scale: Input should be greater than 0 (got 0)"),
        (
            {"tiled_optimizer": {"tile_size": 10**30}},
            "ds_ext.tiled_optimizer.tile_size: Input should be less than or equal to 1073741824 (got 10000000",
        ),
        ({"topology": {"preset": "frontier", "levels": []}}, "give either 'preset' or 'levels'"),
        (
            {"topology": {"levels": [{"name": "x", "size": 0, "bandwidth_GBps": 1}]}},
            "ds_ext.topology.levels.0.size: Input should be greater than or equal to 1 (got 0)",
        ),
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
        with pytest.raises(
            cfgmod.DsExtConfigError, match="ds_ext.demo_plugin.bits: unknown key; allowed keys: enabled, level"
        ):
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


# ---- one strict base, clear errors, ds_config files -----------------------
def _sections(model):
    """Every config section class reachable from ``model``'s fields."""
    from typing import get_args

    from pydantic import BaseModel

    found, todo = set(), [model]
    while todo:
        cls = todo.pop()
        for field in cls.model_fields.values():
            stack = [field.annotation]
            while stack:
                ann = stack.pop()
                if isinstance(ann, type) and issubclass(ann, BaseModel) and ann not in found:
                    found.add(ann)
                    todo.append(ann)
                stack.extend(get_args(ann))
    return found


def test_every_section_has_the_one_strict_base():
    from ds_ext.config_base import ConfigSection

    sections = _sections(cfgmod._schema_model())
    assert len(sections) >= 15
    assert all(issubclass(s, ConfigSection) for s in sections), [
        s for s in sections if not issubclass(s, ConfigSection)
    ]


@pytest.mark.parametrize(
    "block, message",
    [
        ({"zero_topo": {"enabled": "yes"}}, "ds_ext.zero_topo.enabled: Input should be a valid boolean (got 'yes')"),
        ({"comm": {"ledger": "off"}}, "ds_ext.comm.ledger: Input should be a valid boolean (got 'off')"),
        ({"zero_topo": {"prefetch": "yes"}}, "ds_ext.zero_topo.prefetch: Input should be a valid boolean (got 'yes')"),
        (
            {"zero_topo": {"quant_block_size": "512"}},
            "ds_ext.zero_topo.quant_block_size: Input should be a valid integer (got '512')",
        ),
        ({"ted": {"enabled": 1}}, "ds_ext.ted.enabled: Input should be a valid boolean (got 1)"),
        (
            {"tiled_optimizer": {"tile_size": 1.5}},
            "ds_ext.tiled_optimizer.tile_size: Input should be a valid integer (got 1.5)",
        ),
        ({"comm": {"timeout_s": float("inf")}}, "ds_ext.comm.timeout_s: Input should be a finite number (got inf)"),
        ({"comm": {"time_scale": float("nan")}}, "ds_ext.comm.time_scale: Input should be a finite number (got nan)"),
        ({"topology": {"emulate": "true"}}, "ds_ext.topology.emulate: Input should be a valid boolean (got 'true')"),
    ],
)
def test_every_section_refuses_coercion(block, message):
    with pytest.raises(cfgmod.DsExtConfigError) as err:
        cfgmod.parse(block)
    assert str(err.value) == message


@pytest.mark.parametrize(
    "block, message",
    [
        ({"zero_topo": {"units": [1]}}, "ds_ext.zero_topo.units.0: Input should be a valid string (got 1)"),
        (
            {"zero_topo": {"units": "blocks"}},
            "ds_ext.zero_topo.units: Input should be a valid list or 'auto' (got 'blocks')",
        ),
        ({"pmm3d": {"grid": {"x": 0}}}, "ds_ext.pmm3d.grid.x: Input should be greater than or equal to 1 (got 0)"),
        (
            {"pmm3d": {"grid": "best"}},
            "ds_ext.pmm3d.grid: Input should be an object with keys data, x, y, z or 'auto' (got 'best')",
        ),
        (
            {"ted": {"num_experts": 6, "expert_parallel": 4}},
            "ds_ext.ted: num_experts 6 is not a multiple of expert_parallel 4 (E = k x G_expert)",
        ),
        (
            {"zero_topo": {"overlap_step": False, "gather_across_step": True}},
            "ds_ext.zero_topo: gather_across_step true needs overlap_step true (the step's gathers are carried past "
            "it only when the step boundary is overlapped); allowed: overlap_step true, or gather_across_step false",
        ),
        (
            {"topology": {"preset": "frontier", "sizes": {"gpus": 2}}},
            "ds_ext.topology.sizes.gpus: unknown level; levels of preset 'frontier': gcd, gpu, node",
        ),
        (
            {"topology": {"sizes": {"gpu": 2}}},
            "ds_ext.topology.sizes.gpu: unknown level; levels of the detected topology: local, node",
        ),
        (
            {"topology": {"levels": [{"name": "a", "bandwidth_GBps": 1}], "sizes": {"b": 1}}},
            "ds_ext.topology.sizes.b: unknown level; levels of the given levels: a",
        ),
        ({"topology": {"preset": "frontier", "sizes": {"gpu": 0}}}, "ds_ext.topology.sizes.gpu: must be >= 1 (got 0)"),
    ],
)
def test_errors_show_the_key_path_without_pydantic_internals(block, message):
    with pytest.raises(cfgmod.DsExtConfigError) as err:
        cfgmod.parse(block)
    assert str(err.value) == message


def test_load_ds_config_reads_what_deepspeed_reads_and_refuses_the_rest(tmp_path):
    import base64

    config = {"train_batch_size": 8, "ds_ext": {"topology": {"preset": "frontier"}}, "tag": "??>>~~"}
    standard = base64.b64encode(json.dumps(config).encode()).decode()
    assert "/" in standard or "+" in standard
    assert cfgmod.load_ds_config(standard) == config
    cases = {
        "empty.json": ("", "is empty"),
        "nan.json": ('{"lr": NaN}', "NaN is not a JSON number"),
        "dup.json": ('{"ds_ext": {}, "ds_ext": {"ted": {}}}', "duplicate key 'ds_ext'"),
        "dup.hjson": ("{\n// hjson\nds_ext: {}\nds_ext: {}\n}", "duplicate key 'ds_ext'"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(cfgmod.DsExtConfigError, match=message):
            cfgmod.load_ds_config(tmp_path / name)
    with pytest.raises(cfgmod.DsExtConfigError, match="is a directory"):
        cfgmod.load_ds_config(tmp_path)
    duplicated = base64.b64encode(b'{"ds_ext": {}, "ds_ext": {}}').decode()
    with pytest.raises(cfgmod.DsExtConfigError, match=r"base64 string\): duplicate key 'ds_ext'"):
        cfgmod.load_ds_config(duplicated)
    (tmp_path / "inf.json").write_text('{"ds_ext": {"comm": {"timeout_s": 1e999}}}')
    with pytest.raises(cfgmod.DsExtConfigError, match=r"^ds_ext.comm.timeout_s: Input should be a finite number"):
        cfgmod.parse(cfgmod.load_ds_config(tmp_path / "inf.json")["ds_ext"])
