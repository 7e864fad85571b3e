"""``ds-ext bench tiled --quick`` (001 §7.2) end to end: it launches its own 4 CPU ranks,
writes the issue's record keys and a PNG, and its measurements show the claims at small
scale (untiled step peak grows with E, tiled does not)."""

import argparse
import json

RECORD_KEYS = {
    "experts",
    "tile_size",
    "step_peak_bytes_tiled",
    "step_peak_bytes_untiled",
    "step_peak_bytes_ds_group_split",
    "step_time_s_tiled",
    "step_time_s_untiled",
    "step_time_s_ds_group_split",
}


def test_quick_benchmark(tmp_path):
    from ds_ext.bench import tiled

    parser = argparse.ArgumentParser()
    tiled.add_arguments(parser)
    out = tmp_path / "tiled.json"
    tiled.run(parser.parse_args(["--out", str(out), "--quick"]))
    data = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert [(r["experts"], r["tile_size"]) for r in data["records"]] == [(4, 65_536), (16, 65_536)]
    for r in data["records"]:
        assert set(r) == RECORD_KEYS
        assert r["step_peak_bytes_tiled"] < r["step_peak_bytes_untiled"]
    checks = data["checks"]
    assert checks["untiled_peak_largest_E_over_smallest_E"] > 2.5
    assert checks["tiled_peak_largest_E_over_smallest_E"] <= 1.25
    zt = data["zero_topo"]
    assert zt["step_bytes_by_level_tiled"] == zt["step_bytes_by_level_untiled"]
