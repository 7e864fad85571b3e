"""Terminal table, JSON and PNG of a :class:`ds_ext.planner.plan.PlanResult`."""

from __future__ import annotations

from typing import Any

from ds_ext.planner.dsconfig import CONFIGURED
from ds_ext.planner.estimate import STATES, Dropped, Estimate
from ds_ext.planner.plan import PlanResult

MANY = ("pmm3d", "megatron")  # families with many layouts: the top_k fastest shown in full


def published(result: PlanResult, e: Estimate) -> bool:
    """The layout of the model's published recipe (004 Table V): always shown, never steered away from silently."""
    recipe = result.job.arch.recipe
    return (
        recipe.megatron is not None
        and e.family == "megatron"
        and e.micro_batch == recipe.micro_batch
        and e.name.startswith(f"megatron tp{recipe.megatron[0]} pp{recipe.megatron[1]} ")
    )


def shown(result: PlanResult, top_k: int) -> list[Estimate]:
    """Every ZeRO preset and TED layout, the ``top_k`` fastest 3D-PMM grids and Megatron layouts,
    the published recipe's layout and the configured plan."""
    keep = {id(e) for f in MANY for e in [e for e in result.estimates if e.family == f][:top_k]}
    keep |= {id(e) for e in result.estimates if e.name.startswith(CONFIGURED) or published(result, e)}
    return [e for e in result.estimates if e.family not in MANY or id(e) in keep]


def not_shown(result: PlanResult, top_k: int) -> list[Dropped]:
    """Every candidate the table leaves out, with the reason: the families' and the batch's
    drops, and the 3D-PMM grids past ``--top-k``."""
    kept = {id(e) for e in shown(result, top_k)}
    past = [
        Dropped(
            e.family,
            e.name,
            f"fit, slower than the --top-k {top_k} shown (fastest first)"
            if e.fits
            else f"past --top-k {top_k}; does not fit: {e.reason}",
        )
        for e in result.estimates
        if id(e) not in kept
    ]
    return list(result.dropped) + past


def _reason_lines(dropped: list[Dropped]) -> list[str]:
    """One line per (family, reason): the plans it drops."""
    by: dict[tuple[str, str], list[str]] = {}
    for d in dropped:
        by.setdefault((d.family, d.reason), []).append(d.name.removeprefix(f"{d.family} "))
    return [f"  {fam}: {reason}: {', '.join(names)}" for (fam, reason), names in by.items()]


SHORT = {"weights": "wts", "secondary": "sec", "gradients": "grad", "optimizer": "opt", "activations": "act"}


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def table(result: PlanResult, top_k: int = 5) -> str:
    job = result.job
    levels = job.topology.level_names
    a = job.arch
    head = (
        f"{a.name}: {a.params / 1e9:.2f}B parameters ({a.layers} layers, hidden {a.hidden}, {a.heads} heads, "
        f"vocab {a.vocab}, seq {a.seq}{f', {a.experts} experts' if a.experts > 1 else ''}) on "
        f"{job.topology.describe()}\n"
        f"batch {job.global_batch} sequences per step ({job.batch_source}); activation checkpointing "
        f"{'on' if job.checkpointing else 'off'} ({job.checkpointing_source}); "
        f"{job.machine.device_memory / 1e9:.1f} GB per rank; "
        f"compute at {job.machine.flops / 1e12:.1f} TFLOP/s per rank; "
        f"{job.flops / 1e15:.1f} PFLOP per step (GPT-NeoX formula)"
        + (
            ""
            if job.sparsity is None
            else f"\npruned at sparsity p = {job.sparsity:g} (--sparsity): the '+ samo' plans train it with SAMO "
            "(001 ch. 4), the others dense"
        )
    )
    cols = (
        ["#", "plan", "mb x GA"]
        + [SHORT[s] for s in STATES]
        + ["total", "fits"]
        + [f"{lv} GB" for lv in levels]
        + ["NIC GB"]
        + ["comp s", "comm s", "step s", "TFLOPS", "max B"]
    )
    rows = []
    rank = {id(e): i for i, e in enumerate(result.ranked, 1)}
    for e in shown(result, top_k):
        rows.append(
            [str(rank.get(id(e), "-")), e.name, f"{e.micro_batch} x {e.grad_accum}"]
            + [_gb(e.memory[s]) for s in STATES]
            + [_gb(e.total_memory), "yes" if e.fits else "no"]
            + [_gb(e.traffic.bytes.get(lv, 0.0)) for lv in levels]
            + ["-" if e.nic_bytes is None else _gb(e.nic_bytes)]
            + [
                f"{e.compute_s:.2f}",
                f"{sum(e.comm_s.values()):.2f}",
                f"{e.step_s:.2f}",
                f"{e.tflops / 1e12:.1f}",
                f"{e.max_params / 1e9:.1f}",
            ]
        )
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    fmt = lambda r: "  ".join(v.ljust(w) if i == 1 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths)))  # noqa: E731
    lines = [head, "", fmt(cols), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]
    lines.append(
        "wts / sec / grad / opt / act: GB per rank of weights, secondary, gradients, optimizer states, "
        "activations; <level> GB: bytes one rank sends per optimizer step, each collective at the outermost "
        "level it spans (003's convention, the one a ring's time follows); NIC GB: of those, the bytes "
        "that cross a node's links, per rank (the link model; - where the plan's model books no links); "
        "max B: billions of parameters whose model states fill the device at this plan's bytes per parameter"
    )
    hidden = not_shown(result, top_k)
    if hidden:
        lines.append(f"not shown ({len(hidden)}), by reason:")
        lines += _reason_lines(hidden)
    for label, e in (("best", result.best), ("runner-up", result.runner_up)):
        lines.append(
            f"{label}: "
            + (f"{e.name} ({e.step_s:.2f} s per step, {e.tflops / 1e12:.1f} TFLOPS per rank)" if e else "no plan fits")
        )
    for e in result.estimates:  # what the ds_config's plan needs beside the table's figures
        if e.name.startswith(CONFIGURED):
            lines += [f"{e.name}:"] + [f"  {note}" for note in e.notes]
    return "\n".join(lines)


def record(e: Estimate) -> dict[str, Any]:
    return {
        "family": e.family,
        "name": e.name,
        "config": e.config,
        "micro_batch": e.micro_batch,
        "grad_accum": e.grad_accum,
        "memory_bytes": e.memory,
        "total_memory_bytes": e.total_memory,
        "fits": e.fits,
        "reason": e.reason,
        "bytes_per_level": e.traffic.bytes,
        "nic_bytes_per_rank": e.nic_bytes,
        "messages_per_level": e.traffic.messages,
        "compute_s": e.compute_s,
        "comm_s_per_level": e.comm_s,
        "step_s": e.step_s,
        "tflops_per_rank": e.tflops,
        "max_params": e.max_params,
        "notes": list(e.notes),
    }


def job_record(result: PlanResult) -> dict[str, Any]:
    job = result.job
    return {
        "model": {**job.arch.model_dump(), "params": job.arch.params},
        "machine": job.machine.model_dump(),
        "topology": job.topology.describe(),
        "world": job.world,
        "global_batch": job.global_batch,
        "batch_source": job.batch_source,
        "grad_accum": job.grad_accum or "fewest that fit",
        "element_bytes": job.elem_bytes,
        "checkpointing": job.checkpointing,
        "checkpointing_source": job.checkpointing_source,
        "flops_per_step": job.flops,
        "sparsity": job.sparsity,
    }


def to_json(result: PlanResult) -> dict[str, Any]:
    return {
        "job": job_record(result),
        "best": result.best.name if result.best else None,
        "runner_up": result.runner_up.name if result.runner_up else None,
        "configured": [e.name for e in result.estimates if e.name.startswith(CONFIGURED)],
        "plans": [record(e) for e in result.estimates],
        "not_ranked": [vars(d) for d in result.dropped],
    }


def figure(result: PlanResult, top_k: int = 5):
    """Memory per state (left) and step time per component (right) of the shown plans; one
    colour per state and per component across both panels (:func:`ds_ext.plotting.colours`)."""
    from ds_ext import plotting

    plans = shown(result, top_k)
    names = [e.name for e in plans]
    levels = result.job.topology.level_names
    colour = plotting.colours((*STATES, "compute", *levels))
    fig = plotting.figure(figsize=(14, 0.45 * len(plans) + 2.5))
    ax_m, ax_t = fig.subplots(1, 2, sharey=True)
    for ax, parts, unit in ((ax_m, STATES, 1e9), (ax_t, ("compute",) + levels, 1.0)):
        left = [0.0] * len(plans)
        for part in parts:
            if ax is ax_m:
                vals = [e.memory[part] / unit for e in plans]
            else:
                vals = [e.compute_s if part == "compute" else e.comm_s.get(part, 0.0) for e in plans]
            ax.barh(names, vals, left=left, label=part, color=colour[part])
            left = [a + b for a, b in zip(left, vals)]
        ax.legend(fontsize=8)
    ax_m.axvline(result.job.machine.device_memory / 1e9, color="k", ls="--", lw=1)
    ax_m.set_xlabel("GB per rank (dashed: device memory)")
    ax_t.set_xlabel("seconds per optimizer step")
    ax_m.invert_yaxis()
    fig.suptitle(f"{result.job.arch.name} on {result.job.world} ranks of {result.job.machine.name}")
    fig.tight_layout()
    return fig


def plot(result: PlanResult, path, top_k: int = 5) -> None:
    """:func:`figure` written to ``path`` (PNG)."""
    figure(result, top_k).savefig(path, dpi=110)
