"""What a benchmark record carries for a reviewer (``ds_ext.bench.stats``, ``bench zero --rounds``):
ratios with bootstrap intervals, the rounds' step times merged, provenance (no processes)."""

import statistics

import pytest

from ds_ext.bench.stats import StatsError, provenance, ratio_interval, round_ratio_interval, utc_now
from ds_ext.bench.zero import _by_round, level_busy, merge_rounds


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


def test_round_interval_widens_with_drift_between_rounds_and_pairs_the_rounds():
    """The two-stage bootstrap: rounds drawn (the same for both variants), then their steps."""
    flat = [[1.0, 1.0, 1.0, 1.0]] * 5
    # steps alike within a round, the rounds apart: 20 pooled steps look precise, 5 rounds do not
    drifting = [[x] * 4 for x in (2.0, 2.2, 1.8, 2.1, 1.9)]
    by_round = round_ratio_interval(drifting, flat)
    pooled = ratio_interval(sum(drifting, []), sum(flat, []))
    assert by_round["ratio"] == pooled["ratio"] == 2.0 and (by_round["n"], by_round["rounds"]) == (20, 5)
    assert by_round["hi"] - by_round["lo"] > 1.5 * (pooled["hi"] - pooled["lo"])
    assert round_ratio_interval(drifting, flat) == by_round  # seeded
    # a drift both variants share (they ran side by side) cancels in the ratio
    both = round_ratio_interval(drifting, [[x / 2 for x in r] for r in drifting])
    assert both["lo"] == both["hi"] == both["ratio"] == 2.0
    # one round: the step bootstrap
    one = round_ratio_interval([[2.0, 2.2, 1.9]], [[1.0, 1.1, 0.9]])
    assert one["lo"] <= one["ratio"] == 2.0 <= one["hi"] and one["rounds"] == 1
    with pytest.raises(StatsError, match="same rounds"):
        round_ratio_interval(drifting, flat[:4])
    with pytest.raises(StatsError, match="same number"):
        round_ratio_interval([[1.0], [1.0, 2.0]], [[1.0], [1.0]])


def test_steps_split_into_their_rounds():
    record = {"step_times_s": [1.0, 2.0, 3.0, 4.0], "step_times_by_round": [[1.0, 2.0], [3.0, 4.0]]}
    assert _by_round(record, [5.0, 6.0, 7.0, 8.0]) == [[5.0, 6.0], [7.0, 8.0]]
    assert _by_round({"step_times_s": [1.0, 2.0]}, [1.0, 2.0]) == [[1.0, 2.0]]  # a record of one round


def test_level_busy_is_the_union_of_each_levels_spans_inside_the_step():
    node, gpu = ("step", "all_gather", "node"), ("forward", "all_gather", "gpu")
    trace = [
        (node, 9.0, 11.0),  # issued in the step before: counts from the step's start (10)
        (node, 10.5, 12.0),  # overlaps the one before
        (node, 14.0, 16.0),  # ends after the step: cut at its end (15)
        (gpu, 11.0, 11.5),
        (gpu, 8.0, 9.5),  # wholly before the step: not in it
    ]
    out = level_busy(trace, 10.0, 15.0)
    assert out["step_s"] == 5.0
    assert out["levels"]["node"] == {"busy_s": 3.0, "first_s": 0.0, "last_s": 5.0, "spans": 3}
    assert out["levels"]["gpu"] == {"busy_s": 0.5, "first_s": 1.0, "last_s": 1.5, "spans": 1}


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
    assert out["date"].endswith("+00:00") and out["host"]["cores"] >= 1 and utc_now() >= out["date"]
    assert len(out["host"]["load_average_before"]) == 3 and out["versions"]["torch"]
    assert (out["model"], out["rounds"]) == ("tiny", 5)
