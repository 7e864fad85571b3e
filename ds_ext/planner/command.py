"""Arguments and entry points of ``ds-ext plan`` and ``ds-ext simulate`` (heavy imports deferred).

No flag is ignored and no bad value reaches the arithmetic: every number is checked
here, before anything runs, and refused in one line that names the flag (:class:`ArgumentError`);
``simulate --validate`` refuses the sweep's own flags, which it would not use.
"""

from __future__ import annotations

import argparse
import math

from ds_ext.planner import PlannerError

SHAPE = ("layers", "hidden", "heads", "vocab", "seq")


class ArgumentError(PlannerError):
    """A flag's value the planner refuses; the message names the flag."""


def _level_values(items: list[str], flag: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in items:
        name, _, value = item.partition("=")
        try:
            number = float(value)
        except ValueError:
            raise ArgumentError(f"{flag} expects LEVEL=NUMBER, got {item!r}") from None
        if name in out:
            raise ArgumentError(f"{flag}: level {name!r} given twice")
        if not math.isfinite(number):
            raise ArgumentError(f"{flag}: {item!r} is not a finite number")
        out[name] = number
    return out


def check_numbers(ns: argparse.Namespace) -> None:
    """Refuse a flag whose number the planner cannot use (one line naming the flag)."""
    rules = (
        ("global_batch", "a positive integer", lambda v: v >= 1),
        ("grad_accum", "a positive integer", lambda v: v >= 1),
        ("top_k", "a positive integer", lambda v: v >= 1),
        ("ffn_mult", "a positive integer", lambda v: v >= 1),
        ("experts", "a positive integer", lambda v: v >= 1),
        ("memory_GB", "a positive number", lambda v: 0 < v < math.inf),
        ("peak_TFLOPS", "a positive number", lambda v: 0 < v < math.inf),
        ("efficiency", "in (0, 1]", lambda v: 0 < v <= 1),
    )
    for key, allowed, ok in rules:
        values = getattr(ns, key, None)
        for v in values if isinstance(values, list) else [values]:
            if v is not None and not ok(v):
                raise ArgumentError(f"--{key.replace('_', '-')}: {v:g} must be {allowed}")


def add_machine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--machine", default="frontier", help="machine preset (default frontier)")
    p.add_argument("--memory-GB", type=float, default=None, help="device memory per rank instead of the preset's")
    p.add_argument("--peak-TFLOPS", type=float, default=None, help="16-bit peak per rank instead of the preset's")
    p.add_argument("--efficiency", type=float, default=None, help="fraction of the peak compute reaches")
    p.add_argument(
        "--bandwidth", action="append", default=[], metavar="LEVEL=GBps", help="per-rank bandwidth of a level"
    )
    p.add_argument("--latency", action="append", default=[], metavar="LEVEL=us", help="per-message latency of a level")


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a catalogue model (ds_ext.planner.models), or give the shape")
    for key in SHAPE:
        p.add_argument(f"--{key}", type=int, default=None)
    p.add_argument("--ffn-mult", type=int, default=4)
    p.add_argument(
        "--experts",
        type=int,
        default=1,
        help="MoE: experts of every alternate layer (001 §7.1.1); with --model, an MoE built on that base",
    )
    p.add_argument("--untied", action="store_true", help="separate LM head (GPT-NeoX no-weight-tying)")
    p.add_argument("--rotary", action="store_true", help="no learned position table")
    p.add_argument("--nodes", type=int, required=True)
    add_machine_arguments(p)
    p.add_argument("--ds-config", default=None, help="read batch, precision and the configured plan from it")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: the model's recipe)")
    p.add_argument(
        "--grad-accum", type=int, default=None, help="micro-steps per step (default: recipe, else fewest that fit)"
    )
    p.add_argument("--families", nargs="+", default=None, help="plan families to enumerate (default: all)")
    p.add_argument(
        "--sparsity",
        type=float,
        default=None,
        help="the model is pruned by this fraction in [0, 1) and trained with SAMO (001 ch. 4): the megatron "
        "family adds each TP-1 layout's SAMO form",
    )
    p.add_argument("--top-k", type=int, default=5, help="3D-PMM grids shown in full (the others are listed)")
    p.add_argument("--out", default=None, help="write JSON here and a PNG next to it")


def machine_from(ns: argparse.Namespace):
    """The machine preset with every machine flag applied (memory, peak, efficiency, links)."""
    from ds_ext.planner import machine as machines

    check_numbers(ns)
    m = machines.lookup(ns.machine)
    update = {
        k: v
        for k, v in (
            ("device_memory", None if ns.memory_GB is None else ns.memory_GB * 1e9),
            ("peak_flops", None if ns.peak_TFLOPS is None else ns.peak_TFLOPS * 1e12),
            ("efficiency", ns.efficiency),
        )
        if v is not None
    }
    m = m.model_copy(update=update)
    return m.with_links(_level_values(ns.bandwidth, "--bandwidth"), _level_values(ns.latency, "--latency"))


def arch_from(ns: argparse.Namespace):
    from ds_ext.planner import models

    given = [k for k in SHAPE if getattr(ns, k) is not None]
    if ns.model is not None:
        if given:
            raise models.ModelError(f"--model {ns.model} takes no --{given[0]}; give a model or a shape")
        return models.with_experts(models.lookup(ns.model), ns.experts)
    if len(given) < len(SHAPE):
        missing = [f"--{k}" for k in SHAPE if k not in given]
        raise models.ModelError(f"give --model NAME or the shape; missing {' '.join(missing)}")
    return models.custom(
        **{k: getattr(ns, k) for k in SHAPE},
        ffn_mult=ns.ffn_mult,
        experts=ns.experts,
        tied_embeddings=not ns.untied,
        learned_positions=not ns.rotary,
    )


def _write(out: str, payload: dict, plot) -> None:
    import json
    from pathlib import Path

    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    plot(path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")


def run_plan(ns: argparse.Namespace) -> int:
    from ds_ext.planner import dsconfig, plan, report

    machine = machine_from(ns)
    arch = arch_from(ns)
    ds = dsconfig.read(ns.ds_config) if ns.ds_config else None
    world_hint = machine.build_topology(ns.nodes).world_size
    batch = ns.global_batch if ns.global_batch is not None else (ds.batch(world_hint) if ds else None)
    accum = ns.grad_accum if ns.grad_accum is not None else (ds.grad_accum if ds else None)
    source = "--global-batch" if ns.global_batch is not None else f"--ds-config {ns.ds_config}"
    job = plan.make_job(arch, machine, ns.nodes, batch, accum, ds.elem_bytes if ds else 2, source, ns.sparsity)
    if ds:
        from dataclasses import replace

        job = replace(
            job,
            checkpointing=ds.checkpointing,
            checkpointing_source=f"--ds-config {ns.ds_config}: "
            + ("its activation_checkpointing section" if ds.checkpointing else "no activation_checkpointing section"),
        )
    extra = ds.candidates(job) if ds else []
    families = ns.families or tuple(plan.FAMILIES)
    result = plan.plan(job, families, extra)
    print(report.table(result, ns.top_k))
    if result.best is None:
        print(f"no plan fits: {plan.what_would_fit(job, families, batch is not None)}")
    if ns.out:
        _write(ns.out, report.to_json(result), lambda png: report.plot(result, png, ns.top_k))
    return 0


def add_simulate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--models", nargs="+", default=None, help=f"catalogue models to sweep (default {' '.join(SWEEP_MODELS)})"
    )
    p.add_argument(
        "--nodes", nargs="+", type=int, default=None, help="node counts (default 2..48: 16..384 GCDs on Frontier)"
    )
    add_machine_arguments(p)
    p.add_argument(
        "--global-batch", type=int, default=None, help="sequences per step for every point (default: recipes)"
    )
    p.add_argument("--grad-accum", type=int, default=None, help="micro-steps per step for every point")
    p.add_argument("--families", nargs="+", default=None, help="plan families (default: all)")
    p.add_argument(
        "--validate",
        action="store_true",
        help="instead of the sweep: predictions beside 003's and 000's published numbers",
    )
    p.add_argument("--out", default=None, help="write JSON here and a PNG next to it")


SWEEP_MODELS = ("gpt-neox-20b",)
SWEEP_NODES = (2, 4, 8, 16, 32, 48)
SWEEP_ONLY = ("models", "nodes", "global_batch", "grad_accum", "families")  # flags --validate has no use for


def run_validate(ns: argparse.Namespace) -> int:
    from ds_ext.planner import validate

    given = [f"--{k.replace('_', '-')}" for k in SWEEP_ONLY if getattr(ns, k) is not None]
    if given:
        raise ArgumentError(
            f"--validate: takes no {' '.join(given)} (the comparisons fix their own models, nodes "
            "and batches); the machine flags apply"
        )
    machine = machine_from(ns)
    rows = validate.validate(machine)
    print("hardware figures (ds_ext.planner.hardware; --bandwidth / --latency / --memory-GB override them):")
    print(validate.hardware_table())
    print()
    print(validate.markdown(rows))
    if ns.out:
        from ds_ext.planner import hardware

        payload = {"machine": machine.model_dump(), "hardware": hardware.records(), "rows": [r.record() for r in rows]}
        _write(ns.out, payload, lambda png: validate.plot(rows, png))
    return 0


def run_simulate(ns: argparse.Namespace) -> int:
    import time

    from ds_ext.planner import models, plan, simulate

    if ns.validate:
        return run_validate(ns)
    machine = machine_from(ns)
    archs = [models.lookup(m) for m in ns.models or SWEEP_MODELS]
    nodes = list(dict.fromkeys(ns.nodes or SWEEP_NODES))
    for n in nodes:
        machine.build_topology(n)
    families = ns.families or tuple(plan.FAMILIES)
    for arch in archs:
        plan.check_families_apply(arch, list(families))
    t0 = time.perf_counter()
    records = simulate.sweep(archs, nodes, machine, families, ns.global_batch, ns.grad_accum, progress=True)
    seconds = time.perf_counter() - t0
    print(simulate.table(records))
    for arch in archs:
        print(
            f"batch of {arch.name}: "
            + (
                f"{ns.global_batch} sequences (--global-batch)"
                if ns.global_batch
                else f"its recipe: {arch.recipe.source}"
            )
        )
    print(f"sweep: {len(records)} points in {seconds:.2f} s")
    if ns.out:
        payload = {
            "machine": machine.model_dump(),
            "models": [a.model_dump() for a in archs],
            "nodes": nodes,
            "families": list(families),
            "sweep_seconds": seconds,
            "records": records,
        }
        _write(ns.out, payload, lambda png: simulate.plot(records, png))
    return 0


TUNE_RANKING = ("model", "global_batch", "grad_accum", "memory_GB", "database", "links", "no_latency", "top_k", "out")


def add_tune_arguments(p: argparse.ArgumentParser) -> None:
    """``ds-ext tune``: the planner's 3D-PMM family for one model on ``--world`` ranks (one ranker, one definition of memory and batch with ``plan --families pmm3d``)."""
    p.add_argument("--model", default=None, help="a catalogue model (default gpt-20b, 001 Table 5.1)")
    p.add_argument("--world", type=int, required=True, help="ranks (GPUs / GCDs); a multiple of the ranks per node")
    p.add_argument("--machine", default="frontier", help="machine preset (default frontier)")
    p.add_argument("--size", action="append", default=[], metavar="LEVEL=N", help="ranks per domain of an inner level")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: the model's recipe)")
    p.add_argument("--grad-accum", type=int, default=None, help="micro-steps per step (default: fewest that fit)")
    p.add_argument(
        "--memory-GB",
        type=float,
        default=None,
        help="device memory per rank (model states + activations, as plan counts it)",
    )
    p.add_argument("--database", default=None, help="bandwidth database JSON from 'ds-ext tune --measure' (Eq 5.7)")
    p.add_argument(
        "--links",
        choices=("shared", "per-rank"),
        default=None,
        help="per-rank (default): the planner's alpha-beta per level, every rank its own share; shared: "
        "Eq 5.7, rings across nodes share a node's NICs",
    )
    p.add_argument(
        "--no-latency",
        action="store_true",
        default=None,
        help="no latency per ring message (001's bandwidth-bound Assumption 3)",
    )
    p.add_argument("--top-k", type=int, default=None, help="grids shown (default 10; the others are listed)")
    p.add_argument("--out", default=None, help="write the result as JSON")


def parse_sizes(items: list[str]) -> dict[str, int]:
    """``--size LEVEL=N`` items (detect, tune)."""
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        if not value.isdigit():
            raise ArgumentError(f"--size expects LEVEL=INT, got {item!r}")
        out[name] = int(value)
    return out


def run_tune(ns: argparse.Namespace) -> int:
    """Rank the grids with :func:`ds_ext.planner.plan.plan` on the ``pmm3d`` family; ``--links
    shared`` / ``--database`` put the axes at Eq 5.7's bandwidths (``pmm_grids.eq_5_7_seconds``)."""
    import json
    from dataclasses import replace
    from pathlib import Path

    from ds_ext.perf.pmm import Bandwidths
    from ds_ext.planner import machine as machines
    from ds_ext.planner import models, plan, report
    from ds_ext.pmm.tune import bandwidths

    ns.bandwidth, ns.latency, ns.peak_TFLOPS, ns.efficiency = [], [], None, None
    machine = machine_from(ns).with_sizes(parse_sizes(ns.size))
    per_node = machine.ranks_per_node()
    if ns.world < 1 or ns.world % per_node:
        raise machines.MachineError(f"--world: {ns.world} is not a positive multiple of {per_node} ranks per node")
    arch = models.lookup(ns.model or "gpt-20b")
    job = plan.make_job(arch, machine, ns.world // per_node, ns.global_batch, ns.grad_accum)
    links = ns.links or "per-rank"
    database = json.loads(Path(ns.database).read_text()) if ns.database else None
    eq = bandwidths(job.topology, database, links)
    if links == "shared" and eq is None:
        eq = Bandwidths.from_topology(job.topology)
    job = replace(job, latency=not ns.no_latency, eq_5_7=eq if database or links == "shared" else None)
    result = plan.plan(job, ["pmm3d"])
    top_k = ns.top_k or 10
    print(report.table(result, top_k))
    if ns.out:
        records = [report.record(e) for e in result.ranked[:top_k]]
        Path(ns.out).write_text(
            json.dumps(
                {
                    "model": arch.name,
                    "world": ns.world,
                    "links": links,
                    "latency": job.latency,
                    "global_batch": job.global_batch,
                    "top": records,
                },
                indent=2,
            )
            + "\n"
        )
    return 0
