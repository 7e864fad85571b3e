"""The PNGs (item 7): one colour per meaning across the panels of ``plan_*.png``;
``bench_pmm.png`` grid labels written 4x1x1x2 and never overlapping; no module switches
matplotlib's global backend."""

import re
from pathlib import Path

from matplotlib.patches import Rectangle
from matplotlib.text import Text

from ds_ext.bench import pmm as bench_pmm
from ds_ext.planner import machine, models, plan, report

ROOT = Path(__file__).resolve().parents[1]


def test_plan_figure_gives_each_state_and_component_its_own_colour():
    result = plan.plan(plan.make_job(models.lookup("gpt-5b"), machine.lookup("frontier"), 2), ["zero"])
    fig = report.figure(result, top_k=3)
    colour_of: dict[str, tuple] = {}
    for ax in fig.axes:
        for bars in ax.containers:
            colours = {bar.get_facecolor() for bar in bars if isinstance(bar, Rectangle)}
            assert len(colours) == 1
            colour_of[bars.get_label()] = colours.pop()
    assert set(colour_of) == {
        "weights",
        "secondary",
        "gradients",
        "optimizer",
        "activations",
        "compute",
        *result.job.topology.level_names,
    }
    assert len(set(colour_of.values())) == len(colour_of)


def _pmm_records():
    grids = [
        (8, 1, 1, 1),
        (4, 2, 1, 1),
        (4, 1, 2, 1),
        (4, 1, 1, 2),
        (2, 2, 2, 1),
        (2, 2, 1, 2),
        (2, 1, 2, 2),
        (1, 2, 2, 2),
        (1, 1, 1, 8),
        (2, 4, 1, 1),
    ]
    levels = {"gcd": 1e6, "gpu": 2e6, "node": 3e6}
    records = [
        {
            "variant": "pmm3d",
            "grid": list(g),
            bench_pmm.RANKING_MODEL: 0.010 + 1e-5 * i,
            "predicted_comm_s": 0.012 + 1e-5 * i,
            "step_time_emulated_s": 1.0 + 1e-4 * i + (i == 9),
            "bytes_per_step": levels,
        }
        for i, g in enumerate(grids)
    ]  # nearly the same point: labels collide
    return records + [
        {"variant": "deepspeed_zero3", "grid": [1, 1, 8, 1], "step_time_emulated_s": 2.0, "bytes_per_step": levels}
    ]


def test_bench_pmm_figure_labels_grids_apart():
    fig = bench_pmm.figure(_pmm_records())
    renderer = fig.canvas.get_renderer()
    scatter_ax, bars_ax = fig.axes[:2]
    notes = [t for t in scatter_ax.texts]
    assert sorted(t.get_text() for t in notes) == sorted("x".join(map(str, r["grid"])) for r in _pmm_records()[:-1])
    fig.canvas.draw()
    boxes = [Text.get_window_extent(t, renderer) for t in notes]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])
    assert "deepspeed_zero3 1x1x8x1" in [t.get_text() for t in bars_ax.get_xticklabels()]


def test_no_module_switches_the_matplotlib_backend():
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "ds_ext").rglob("*.py")
        if re.search(r"matplotlib\.use\(|import matplotlib\.pyplot|from matplotlib import pyplot", p.read_text())
    ]
    assert offenders == []
