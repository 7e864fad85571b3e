"""``ds-ext simulate``: sweep (model, nodes, plan) and predict TFLOPS per GCD and scaling efficiency.

For each model and node count the planner (:func:`ds_ext.planner.plan.plan`) evaluates every
candidate; the sweep keeps each ZeRO-topo preset by name and, per family with many layouts, the
fastest fitting one (``pmm3d``: the best grid, ``ted`` and ``megatron``: the best layout), since the best grid
changes with the scale. TFLOPS per GCD use GPT-NeoX's FLOPs formula (spec A1); the scaling
efficiency of a plan is its TFLOPS per GCD over those at the smallest node count where it fits
(003 does not define the metric; spec A1 reads it this way). The batch follows each model's
recipe (``ds_ext.planner.models``) unless ``--global-batch`` / ``--grad-accum`` are given.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

from ds_ext.planner.estimate import Estimate
from ds_ext.planner.machine import Machine
from ds_ext.planner.models import Arch
from ds_ext.planner.plan import FAMILIES, PlanResult, make_job, plan

PICK_BEST = ("pmm3d", "ted", "megatron")  # families represented by their fastest fitting layout


def representatives(result: PlanResult) -> dict[str, Estimate]:
    """Plan label -> estimate: every ZeRO preset, the fastest fitting layout of the other families."""
    out: dict[str, Estimate] = {}
    for e in result.estimates:  # fastest first, fitting first
        label = e.family if e.family in PICK_BEST else e.name
        if label not in out:
            out[label] = e
    return out


def sweep(
    archs: Iterable[Arch],
    nodes: Iterable[int],
    machine: Machine,
    families: Iterable[str] = tuple(FAMILIES),
    global_batch: int | None = None,
    grad_accum: int | None = None,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """One record per (model, nodes, plan label)."""
    from tqdm import tqdm

    jobs = [(a, n) for a in archs for n in sorted(nodes)]
    records: list[dict[str, Any]] = []
    for arch, n in tqdm(jobs, desc="simulate", unit="point", disable=not progress):
        result = plan(make_job(arch, machine, n, global_batch, grad_accum), families)
        for label, e in representatives(result).items():
            records.append(
                {
                    "model": arch.name,
                    "nodes": n,
                    "gcds": result.job.world,
                    "plan": label,
                    "name": e.name,
                    "fits": e.fits,
                    "micro_batch": e.micro_batch,
                    "grad_accum": e.grad_accum,
                    "global_batch": result.job.global_batch,
                    "step_s": e.step_s,
                    "compute_s": e.compute_s,
                    "comm_s": sum(e.comm_s.values()),
                    "tflops_per_gcd": e.tflops / 1e12,
                    "memory_GB": e.total_memory / 1e9,
                    "bytes_per_level": e.traffic.bytes,
                }
            )
    _add_efficiency(records)
    return records


def _add_efficiency(records: list[dict[str, Any]]) -> None:
    base: dict[tuple[str, str], float] = {}
    for r in sorted(records, key=lambda r: r["nodes"]):
        key = (r["model"], r["plan"])
        if r["fits"] and key not in base:
            base[key] = r["tflops_per_gcd"]
        r["scaling_efficiency"] = r["tflops_per_gcd"] / base[key] if r["fits"] and key in base else None


def table(records: list[dict[str, Any]]) -> str:
    """TFLOPS per GCD (scaling efficiency) per model and plan, one column per GCD count."""
    gcds = sorted({r["gcds"] for r in records})
    rows: dict[tuple[str, str], dict[int, dict[str, Any]]] = defaultdict(dict)
    for r in records:
        rows[(r["model"], r["plan"])][r["gcds"]] = r
    width = 14
    lines = [
        f"{'model':<14}{'plan':<17}" + "".join(f"{g:>{width}}" for g in gcds),
        "TFLOPS per GCD (scaling efficiency); '-' = does not fit",
    ]
    for (model, label), per in rows.items():
        cells = []
        for g in gcds:
            r = per.get(g)
            cells.append(
                ""
                if r is None
                else "-"
                if not r["fits"]
                else f"{r['tflops_per_gcd']:.1f} ({r['scaling_efficiency']:.2f})"
            )
        lines.append(f"{model:<14}{label:<17}" + "".join(f"{c:>{width}}" for c in cells))
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], path) -> None:
    """TFLOPS per GCD and scaling efficiency against GCDs, one row of panels per model."""
    from ds_ext import plotting

    models = list(dict.fromkeys(r["model"] for r in records))
    fig = plotting.figure(figsize=(12, 4 * len(models)))
    axes = fig.subplots(len(models), 2, squeeze=False)
    for (ax_t, ax_e), model in zip(axes, models):
        series: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in records:
            if r["model"] == model and r["fits"]:
                series[r["plan"]].append(r)
        for label, rs in series.items():
            rs.sort(key=lambda r: r["gcds"])
            ax_t.plot([r["gcds"] for r in rs], [r["tflops_per_gcd"] for r in rs], marker="o", label=label)
            ax_e.plot([r["gcds"] for r in rs], [r["scaling_efficiency"] for r in rs], marker="o", label=label)
        for ax, ylabel in ((ax_t, "predicted TFLOPS per GCD"), (ax_e, "scaling efficiency")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("GCDs")
            ax.set_ylabel(ylabel)
            ax.set_title(model)
            ax.grid(alpha=0.3)
        ax_t.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
