"""What a benchmark record carries for a reviewer (``ds_ext.bench.stats``, ``bench zero --rounds``):
ratios with bootstrap intervals, the rounds' step times merged, provenance (no processes)."""

import statistics

import pytest

from ds_ext.bench.stats import StatsError, provenance, ratio_interval
from ds_ext.bench.zero import merge_rounds


def test_ratio_interval_brackets_the_ratio_of_medians():
    slow, fast = [2.0, 2.2, 1.9, 2.1, 2.0], [1.0, 1.1, 0.9, 1.0, 1.05]
    out = ratio_interval(slow, fast)
    assert out["ratio"] == statistics.median(slow) / statistics.median(fast) == 2.0
    assert out["lo"] <= out["ratio"] <= out["hi"] and out["n"] == 5
    # each resample's medians lie between the samples' extremes
    assert 1.9 / 1.1 <= out["lo"] and out["hi"] <= 2.2 / 0.9
    assert ratio_interval(slow, fast) == out  # seeded: a record recomputes exactly
    assert ratio_interval([3.0] * 4, [1.5] * 4) == {"ratio": 2.0, "lo": 2.0, "hi": 2.0, "n": 4}
    # more steps, narrower interval
    wide, narrow = ratio_interval(slow[:3], fast[:3]), ratio_interval(slow * 4, fast * 4)
    assert narrow["hi"] - narrow["lo"] < wide["hi"] - wide["lo"]
    with pytest.raises(StatsError, match="at least one step"):
        ratio_interval([], fast)


def _record(variant, round_, times, emulated=None):
    return {
        "variant": variant,
        "grad_accum": 1,
        "round": round_,
        "step_times_s": times,
        "step_time_s": statistics.median(times),
        "quantizer_s_per_step": [0.1] * len(times),
        "losses": [5.0 - round_],
        "step_time_emulated_s": emulated,
        "bytes_per_step": {"node": 7.0},
    }


def test_rounds_merge_in_round_order():
    per_round = [_record("a", 0, [1.0, 3.0]), _record("b", 0, [2.0]), _record("a", 1, [2.0]), _record("b", 1, [4.0])]
    merged = {r["variant"]: r for r in merge_rounds(per_round)}
    a = merged["a"]
    assert a["step_times_s"] == [1.0, 3.0, 2.0] and a["step_times_by_round"] == [[1.0, 3.0], [2.0]]
    assert a["step_time_s"] == 2.0 and a["losses_by_round"] == [[5.0], [4.0]] and "round" not in a
    assert a["quantizer_s_per_step"] == [0.1] * 3 and a["bytes_per_step"] == {"node": 7.0}
    assert merged["b"]["step_times_s"] == [2.0, 4.0] and merged["b"]["step_time_emulated_s"] is None


def test_provenance_names_the_commit_and_the_host():
    out = provenance(model="tiny", rounds=5)
    assert len(out["commit"]) == 40 and isinstance(out["uncommitted_changes"], bool)
    assert out["date"].endswith("+00:00") and out["host"]["cores"] >= 1
    assert len(out["host"]["load_average_before"]) == 3 and out["versions"]["torch"]
    assert (out["model"], out["rounds"]) == ("tiny", 5)
