"""Arguments and entry points of ``ds-ext plan`` and ``ds-ext simulate`` (heavy imports deferred)."""

from __future__ import annotations

import argparse

SHAPE = ("layers", "hidden", "heads", "vocab", "seq")


def _level_values(items: list[str], flag: str) -> dict[str, float]:
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        try:
            out[name] = float(value)
        except ValueError:
            raise SystemExit(f"ds-ext: error: {flag} expects LEVEL=NUMBER, got {item!r}") from None
    return out


def add_machine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--machine", default="frontier", help="machine preset (default frontier)")
    p.add_argument("--memory-GB", type=float, default=None, help="device memory per rank instead of the preset's")
    p.add_argument("--peak-TFLOPS", type=float, default=None, help="16-bit peak per rank instead of the preset's")
    p.add_argument("--efficiency", type=float, default=None, help="fraction of the peak compute reaches")
    p.add_argument("--bandwidth", action="append", default=[], metavar="LEVEL=GBps", help="per-rank bandwidth of a level")
    p.add_argument("--latency", action="append", default=[], metavar="LEVEL=us", help="per-message latency of a level")


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a catalogue model (ds_ext.planner.models), or give the shape")
    for key in SHAPE:
        p.add_argument(f"--{key}", type=int, default=None)
    p.add_argument("--ffn-mult", type=int, default=4)
    p.add_argument("--experts", type=int, default=1, help="MoE: experts of every alternate layer (001 §7.1.1); with --model, an MoE built on that base")
    p.add_argument("--untied", action="store_true", help="separate LM head (GPT-NeoX no-weight-tying)")
    p.add_argument("--rotary", action="store_true", help="no learned position table")
    p.add_argument("--nodes", type=int, required=True)
    add_machine_arguments(p)
    p.add_argument("--ds-config", default=None, help="read batch, precision and the configured plan from it")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: the model's recipe)")
    p.add_argument("--grad-accum", type=int, default=None, help="micro-steps per step (default: recipe, else fewest that fit)")
    p.add_argument("--families", nargs="*", default=None, help="plan families to enumerate (default: all)")
    p.add_argument("--top-k", type=int, default=5, help="3D-PMM grids shown")
    p.add_argument("--out", default=None, help="write JSON here and a PNG next to it")


def machine_from(ns: argparse.Namespace):
    from ds_ext.planner import machine as machines

    m = machines.lookup(ns.machine)
    update = {k: v for k, v in (("device_memory", ns.memory_GB and ns.memory_GB * 1e9),
                                ("peak_flops", ns.peak_TFLOPS and ns.peak_TFLOPS * 1e12),
                                ("efficiency", ns.efficiency)) if v is not None}
    for key, value in update.items():
        if not 0 < value <= (1 if key == "efficiency" else float("inf")):
            raise machines.MachineError(f"--{key.replace('_', '-')}: {value} out of range")
    return m.model_copy(update=update)


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
    return models.custom(**{k: getattr(ns, k) for k in SHAPE}, ffn_mult=ns.ffn_mult, experts=ns.experts,
                         tied_embeddings=not ns.untied, learned_positions=not ns.rotary)


def _write(out: str, payload: dict, plot) -> None:
    from ds_ext.bench import write_json

    path = write_json(out, payload)
    plot(path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")


def run_plan(ns: argparse.Namespace) -> int:
    from ds_ext.planner import dsconfig, plan, report

    arch, machine = arch_from(ns), machine_from(ns)
    ds = dsconfig.read(ns.ds_config) if ns.ds_config else None
    world_hint = machine.build_topology(ns.nodes).world_size
    batch = ns.global_batch or (ds.batch(world_hint) if ds else None)
    accum = ns.grad_accum or (ds.grad_accum if ds else None)
    job = plan.make_job(arch, machine, ns.nodes, batch, accum, _level_values(ns.bandwidth, "--bandwidth"),
                        _level_values(ns.latency, "--latency"), ds.elem_bytes if ds else 2)
    extra = ds.candidates(job) if ds else []
    result = plan.plan(job, ns.families or tuple(plan.FAMILIES), extra)
    print(report.table(result, ns.top_k))
    if ns.out:
        _write(ns.out, report.to_json(result), lambda png: report.plot(result, png, ns.top_k))
    return 0


def add_simulate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", default=["gpt-neox-20b"], help="catalogue models to sweep")
    p.add_argument("--nodes", nargs="+", type=int, default=[2, 4, 8, 16, 32, 48],
                   help="node counts (default 2..48: 16..384 GCDs on Frontier)")
    add_machine_arguments(p)
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step for every point (default: recipes)")
    p.add_argument("--grad-accum", type=int, default=None, help="micro-steps per step for every point")
    p.add_argument("--families", nargs="*", default=None, help="plan families (default: all)")
    p.add_argument("--validate", action="store_true",
                   help="instead of the sweep: predictions beside 003's and 000's published numbers")
    p.add_argument("--out", default=None, help="write JSON here and a PNG next to it")


def run_validate(ns: argparse.Namespace) -> int:
    from ds_ext.planner import validate

    machine = machine_from(ns)
    rows = validate.validate(machine)
    print(validate.markdown(rows))
    if ns.out:
        payload = {"machine": machine.model_dump(), "rows": [r.record() for r in rows]}
        _write(ns.out, payload, lambda png: validate.plot(rows, png))
    return 0


def run_simulate(ns: argparse.Namespace) -> int:
    import time

    from ds_ext.planner import models, plan, simulate

    if ns.validate:
        return run_validate(ns)
    machine = machine_from(ns)
    archs = [models.lookup(m) for m in ns.models]
    for n in ns.nodes:
        machine.build_topology(n)
    families = ns.families or tuple(plan.FAMILIES)
    t0 = time.perf_counter()
    records = simulate.sweep(archs, ns.nodes, machine, families, ns.global_batch, ns.grad_accum, progress=True)
    seconds = time.perf_counter() - t0
    print(simulate.table(records))
    print(f"sweep: {len(records)} points in {seconds:.2f} s")
    if ns.out:
        payload = {"machine": machine.model_dump(), "models": [a.model_dump() for a in archs], "nodes": ns.nodes,
                   "families": list(families), "sweep_seconds": seconds, "records": records}
        _write(ns.out, payload, lambda png: simulate.plot(records, png))
    return 0
