"""``ds-ext bench checkpoint --quick`` end to end (8 CPU ranks, 2 emulated nodes x 2 GPUs x 2 GCDs):
every variant's steps are timed, the local tier's partner copies hold every byte of the nodes' own
files (each node's files copied whole to the other), a tiered shared save holds what the two nodes'
own local files hold, every variant's shared save about the same bytes, and a lost node is
restored from the partner tier at the newest step."""

import argparse
import json


def test_quick_benchmark(tmp_path):
    from ds_ext.bench import checkpoint

    parser = argparse.ArgumentParser()
    checkpoint.add_arguments(parser)
    out = tmp_path / "checkpoint.json"
    checkpoint.run(parser.parse_args(["--out", str(out), "--quick", "--shared-every", "1", "--dir", str(tmp_path)]))
    data = json.loads(out.read_text())
    by = {r["variant"]: r for r in data["records"]}
    assert sorted(by) == sorted(checkpoint.VARIANTS)
    assert all(len(r["step_times_s"]) == 1 and r["median_step_s"] > 0 for r in by.values())
    tiers = by["tiers_async"]["tier_bytes_per_save"]
    assert tiers["local"] > 0 and tiers["partner"] == tiers["local"]
    assert tiers["shared"] == tiers["local"]
    # DeepSpeed's own model-states file differs by its config (paths) and, saved synchronously, by the
    # storages its views share; ds_ext's shards are the same bytes in every variant
    sizes = [by[v]["tier_bytes_per_save"]["shared"] for v in checkpoint.SAVING]
    assert max(sizes) - min(sizes) < 0.01 * min(sizes)
    assert data["restore"]["steps_restored"] == {"restore_partner": 2, "restore_shared": 2}
    assert set(data["step_time_ratio_interval"]) == {f"{v}/no_save" for v in checkpoint.SAVING}
    assert data["provenance"]["commit"] is not None
