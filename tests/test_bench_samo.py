"""The committed ``examples/results/bench_samo.json`` (``ds-ext bench samo``,
001 ch. 4): a record per sparsity (0.5, 0.8, 0.9 at least) whose measured state bytes equal Eq. 4.1
(``ds_ext.perf.samo``, recomputed here from the record's φ and kept entries), whose ledger all-reduce
bytes are (1 - p) of DeepSpeed's dense ones, with the timing fields of the shaped-cluster run and
its provenance. Reads the JSON only (no world)."""

import json
from pathlib import Path

import pytest

from ds_ext.perf import samo as model

RESULT = Path(__file__).resolve().parents[1] / "examples" / "results" / "bench_samo.json"
INTERVAL = {"ratio", "lo", "hi", "n"}


@pytest.fixture(scope="module")
def data() -> dict:
    return json.loads(RESULT.read_text())


def test_records_carry_the_fields_at_the_required_sparsities(data):
    assert {0.5, 0.8, 0.9} <= {r["sparsity"] for r in data["records"]}
    for r in data["records"]:
        for key in ("state_bytes", "model_state_bytes", "allreduce_bytes", "dense_allreduce_bytes"):
            assert r[key] > 0, key
        for key in ("sync_time_ratio", "step_time_ratio"):
            assert set(r[key]) == INTERVAL and r[key]["lo"] <= r[key]["ratio"] <= r[key]["hi"], key
            assert r[key]["n"] >= 5, key  # docs/architecture.md, Benchmarks: at least 5 measured steps
        for side in ("samo", "dense"):
            assert r[side]["sync_time_s"] > 0 and r[side]["step_time_s"] > 0
    assert set(data["layout"]["step_time_ratio"]) == INTERVAL and data["layout"]["step_time_ratio"]["n"] >= 5
    assert (data["split"]["dense"]["inter"], data["split"]["samo"]["inter"]) == (2, 1)
    prov = data["provenance"]
    assert prov["commit"] and prov["network"] == "netns" and prov["cluster"] is not None
    assert len(prov["host"]["load_average_before"]) == 3 and len(prov["host"]["load_average_after"]) == 3
    assert not data["quick"]


def test_measured_state_bytes_equal_eq_4_1(data):
    """Every tensor SAMO held at the step's peak, summed, equals Eq. 4.1 for the record's φ and k (bf16,
    every weight masked: 24 k + 2 φ), and k is the kept fraction of φ."""
    for r in data["records"]:
        phi, k = r["phi"], r["kept"]
        assert phi == data["phi"] and k == pytest.approx((1 - r["sparsity"]) * phi, abs=4)  # one per layer
        assert r["indexed"] == k
        assert r["state_bytes"] == sum(r["state_bytes_by_kind"].values())
        assert r["state_bytes"] == r["model_state_bytes"] == model.model_state_bytes(phi, k) == 24 * k + 2 * phi
        assert r["memory_saved"] == pytest.approx(model.memory_saved(r["sparsity"]), abs=1e-5)  # Fig. 4.2


def test_allreduce_carries_the_kept_fraction_of_the_dense_bytes(data):
    """Ledger bytes per rank per step: SAMO's = (k / φ) x DeepSpeed's dense stage-0 engine's, = §4.2.1's
    model; no index travels."""
    for r in data["records"]:
        dense = model.allreduce_bytes(r["phi"], 2, data["world_size"])
        assert r["dense_allreduce_bytes"] == pytest.approx(dense, rel=1e-12)
        assert r["allreduce_bytes"] == pytest.approx(r["kept"] / r["phi"] * r["dense_allreduce_bytes"], rel=1e-12)
        assert r["allreduce_bytes"] == pytest.approx(r["analytic_allreduce_bytes"], rel=1e-12)
    for variant, steps in data["steps"].items():
        assert len({s["allreduce_bytes"] for s in steps}) == 1, variant  # the same bytes every step
