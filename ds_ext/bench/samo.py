"""``ds-ext bench samo``: SAMO's model-state bytes, compressed all-reduce and pipeline / data split (001 ch. 4).

4 gloo ranks laid out as 2 nodes x 2 GPUs (one rank per GPU) train a pruned MLP
(:mod:`ds_ext.models.pruned_mlp`: bias-free square linears, each weight pruned by
``torch.nn.utils.prune`` to exactly round(p n) zeros) in bf16 with torch's AdamW. Variants, each a
DeepSpeed engine built by ``ds_ext.initialize`` in the same world:

* ``samo_p<p>`` for every ``--sparsity`` p: SAMO on 4 data-parallel ranks (ZeRO stage 0),
  ``gradient_accumulation`` = B / (4 mbs);
* ``dense``: DeepSpeed's own dense stage-0 engine on the same model (masked dense training: the
  pruned weights' gradients are dense tensors with zeros), the same batch. Its bytes and its
  all-reduce do not depend on p (it all-reduces every entry), so it is the dense peer of every p;
* ``dense_pp2``: the dense layout §4.2.2 argues against: ``choose_split`` (``ds_ext.perf.samo``)
  with an assumed device capacity of ``--device-state-bytes-per-parameter`` x φ bytes puts dense
  training (20 φ) on 2 pipeline stages x 2 data-parallel ranks and SAMO at the largest p on 1 stage
  x 4; the bench refuses a capacity for which the planner does not choose those two layouts. The
  dense layout runs on DeepSpeed's PipelineEngine (``train_batch``, 1F1B over B / (2 mbs)
  micro-batches), to be compared with ``samo_p<max p>``, which is SAMO's layout.

Measured per variant and optimizer step: the wall time (barrier, the step's micro-batches, the
slowest rank's time), the ledger's all-reduce bytes (``ds_ext.comm.ledger``: DeepSpeed's dense
all-reduce is counted from torch.distributed, SAMO's through ds_ext's communicator) and the seconds
spent inside all-reduces (the data-parallel synchronisation time, the slowest rank's); for SAMO,
the bytes of every tensor it holds at the step's peak (``SamoPlugin.state_bytes``) beside Eq. 4.1
(``model_state_bytes``). Rounds (``--rounds``) run every variant once (``--warmup`` steps, then
``--steps`` measured), the order rotated by one variant per round, each round in a fresh world;
ratios are medians over every measured step with percentile-bootstrap 95 % intervals
(``ds_ext.bench.stats``).

``--network netns``: the ranks run on an emulated cluster (``ds_ext.cluster``: 2 nodes x 2 GPUs as
network namespaces, tbf-shaped node and GPU links), no emulation. ``--network emulate``: local
ranks with the ledger's alpha-beta time emulation (``--time-scale``), an illustration only.
``--quick``: the tiny model, 1 round of 1 step (a plumbing check).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from ds_ext.bench import median, write_json
from ds_ext.cluster.world import add_network_arguments

WORLD, NODES, RANKS_PER_NODE = 4, 2, 2
TOPOLOGY = {"preset": "frontier", "sizes": {"gcd": 1, "gpu": 2}, "emulate": True}  # a rank per GPU
MODELS = {"mlp4m": (1024, 4), "tiny": (64, 2)}  # name -> (width, layers): φ = layers x width^2
MICRO, BATCH = 4, 32  # micro-batch per rank and global batch (GA 2 on data 4, GA 4 on data 2)
DENSE, DENSE_PIPELINE = "dense", "dense_pp2"
LR = 1e-3


def samo_variant(p: float) -> str:
    return f"samo_p{p:g}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="JSON file to write (a PNG is written next to it)")
    p.add_argument("--sparsity", type=float, nargs="+", default=[0.5, 0.8, 0.9], help="pruned fractions p")
    p.add_argument("--model", choices=sorted(MODELS), default="mlp4m")
    p.add_argument("--warmup", type=int, default=1, help="optimizer steps per variant and round before measuring")
    p.add_argument("--steps", type=int, default=1, help="measured optimizer steps per variant and round")
    p.add_argument("--rounds", type=int, default=5, help="rounds, each variant once per round, order rotated")
    p.add_argument(
        "--device-state-bytes-per-parameter",
        type=float,
        default=12.0,
        help="the assumed device capacity for model states, in bytes per parameter φ, that choose_split "
        "(§4.2.2) lays the dense and the SAMO layout out by (12: dense 20 φ needs 2 stages, SAMO at p 0.9 fits 1)",
    )
    p.add_argument("--time-scale", type=float, default=100.0, help="--network emulate: multiply emulated link times")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per round before the world is killed")
    p.add_argument("--quick", action="store_true", help="tiny model, 1 round of 1 measured step")
    add_network_arguments(p)


# ---- one rank -------------------------------------------------------------------------------
def _mse(out, y):
    return ((out.float() - y) ** 2).mean()


def _batch(step: int, data_rank: int, micro: int, width: int, dtype):
    import torch

    g = torch.Generator().manual_seed(100_000 * step + 100 * data_rank + micro)
    return torch.randn(MICRO, width, generator=g).to(dtype), torch.randn(MICRO, width, generator=g)


def _ds_config(data: int, samo: bool, time_scale: float | None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_batch_size": BATCH,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": BATCH // (MICRO * data),
        "bf16": {"enabled": True},
        "steps_per_print": 10**9,
        "ds_ext": {
            "topology": TOPOLOGY,
            "comm": {"ledger": True, "emulate_time": time_scale is not None, "time_scale": time_scale or 1.0},
        },
    }
    if samo:
        cfg["ds_ext"]["samo"] = {"enabled": True, "mask": "prune"}
    return cfg


def _measure(
    variant: str, width: int, layers: int, p: float, warmup: int, steps: int, time_scale: float | None
) -> dict[str, Any]:
    """On every rank: train ``variant`` ``warmup`` + ``steps`` optimizer steps; per measured step
    this rank's wall time, all-reduce bytes and seconds (ledger); SAMO's state bytes and model."""
    import torch
    import torch.distributed as dist

    import ds_ext
    from ds_ext.integration import ds_engine
    from ds_ext.models.pruned_mlp import PrunedLayer, pruned_mlp

    ds_engine.init_distributed()
    pipeline = variant == DENSE_PIPELINE
    if pipeline:
        from deepspeed.pipe import LayerSpec, PipelineModule

        model = PipelineModule(
            [LayerSpec(PrunedLayer, i, width, layers, p) for i in range(layers)],
            num_stages=2,
            loss_fn=_mse,
            partition_method="uniform",
        )
    else:
        model = pruned_mlp(width, layers, p)
    data = WORLD // 2 if pipeline else WORLD
    cfg = _ds_config(data, variant.startswith("samo_"), time_scale)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    engine, *_ = ds_ext.initialize(model=model, optimizer=optimizer, config=cfg)
    data_rank = engine.grid.get_data_parallel_rank() if pipeline else dist.get_rank()
    accum = cfg["gradient_accumulation_steps"]
    out: dict[str, Any] = {"steps": []}
    for step in range(warmup + steps):
        micro = [_batch(step, data_rank, m, width, torch.bfloat16) for m in range(accum)]
        dist.barrier()
        t0 = time.perf_counter()
        if pipeline:
            engine.train_batch(iter(micro))
        else:
            for x, y in micro:
                engine.backward(_mse(engine(x), y))
                engine.step()
        wall = time.perf_counter() - t0
        if step >= warmup:
            traffic = engine.ds_ext.ledger.steps[-1]
            out["steps"].append(
                {
                    "wall_s": wall,
                    "allreduce_bytes": sum(b for (_, op, _), b in traffic.bytes.items() if op == "all_reduce"),
                    "allreduce_s": traffic.seconds_by_op().get("all_reduce", 0.0),
                }
            )
    if variant.startswith("samo_"):
        plugin = engine.ds_ext.plugin("samo")
        g = plugin.grads
        out |= {
            "state_bytes": plugin.state_bytes(),
            "model_state_bytes": plugin.analytic_state_bytes(),
            "analytic_allreduce_bytes": plugin.analytic_allreduce_bytes()[0],
            "phi": g.phi,
            "kept": g.kept,
            "indexed": g.indexed,
        }
    engine.destroy()
    dist.barrier()
    return out


# ---- the driver ------------------------------------------------------------------------------
def _split_layouts(phi: int, p_max: float, capacity: float) -> dict[str, Any]:
    """The layouts ``choose_split`` picks for dense training and for SAMO at ``p_max`` on the 4
    ranks; refuses a capacity for which they are not 2 x 2 and 1 x 4 (what the bench runs)."""
    from ds_ext.perf import samo as samo_model

    device = capacity * phi
    dense = samo_model.choose_split(phi, None, WORLD, device, BATCH, MICRO)
    ours = samo_model.choose_split(phi, p_max, WORLD, device, BATCH, MICRO)
    got = tuple(None if s is None else (s.inter, s.data) for s in (dense, ours))
    if got != ((2, 2), (1, 4)):
        raise SystemExit(
            f"ds-ext bench samo: --device-state-bytes-per-parameter {capacity:g} lays out (dense, SAMO p {p_max:g}) as "
            f"{got} (G_inter, G_data); the bench runs ((2, 2), (1, 4)): allowed a capacity with "
            f"{samo_model.model_state_bytes_at(1, p_max):.2f} <= capacity < 20 and >= 10"
        )
    return {
        "device_state_bytes": device,
        "dense": {"inter": dense.inter, "data": dense.data, "state_bytes_per_gpu": dense.state_bytes_per_gpu},
        "samo": {"inter": ours.inter, "data": ours.data, "state_bytes_per_gpu": ours.state_bytes_per_gpu},
    }


def _steps_over_ranks(per_rank: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Each measured step: the slowest rank's wall time and all-reduce seconds, rank 0's bytes
    (every rank of a data-parallel step sends the same)."""
    return [
        {
            "wall_s": max(r["steps"][i]["wall_s"] for r in per_rank),
            "allreduce_s": max(r["steps"][i]["allreduce_s"] for r in per_rank),
            "allreduce_bytes": per_rank[0]["steps"][i]["allreduce_bytes"],
            "allreduce_bytes_ranks": [r["steps"][i]["allreduce_bytes"] for r in per_rank],
        }
        for i in range(len(per_rank[0]["steps"]))
    ]


def _summary(steps: list[dict[str, float]]) -> dict[str, Any]:
    return {
        "step_time_s": median([s["wall_s"] for s in steps]),
        "sync_time_s": median([s["allreduce_s"] for s in steps]),
        "allreduce_bytes": median([s["allreduce_bytes"] for s in steps]),
        "measured_steps": len(steps),
    }


def records_of(
    sparsities: list[float], steps: dict[str, list[dict[str, float]]], samo: dict[str, dict[str, Any]]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One record per sparsity (SAMO against ``dense``) and the §4.2.2 layout comparison."""
    from ds_ext.bench.stats import ratio_interval
    from ds_ext.perf import samo as samo_model

    dense = steps[DENSE]
    records = []
    for p in sparsities:
        v = samo_variant(p)
        s = samo[v]
        ours = steps[v]
        records.append(
            {
                "sparsity": p,
                "variant": v,
                "phi": s["phi"],
                "kept": s["kept"],
                "indexed": s["indexed"],
                "state_bytes": sum(s["state_bytes"].values()),
                "state_bytes_by_kind": s["state_bytes"],
                "model_state_bytes": s["model_state_bytes"],
                "model_state_bytes_eq_4_3": samo_model.model_state_bytes_at(s["phi"], p),
                "default_model_state_bytes": samo_model.default_model_state_bytes(s["phi"]),
                "memory_saved": 1 - sum(s["state_bytes"].values()) / samo_model.default_model_state_bytes(s["phi"]),
                "memory_saved_eq_4_5": samo_model.memory_saved(p),
                "allreduce_bytes": _summary(ours)["allreduce_bytes"],
                "analytic_allreduce_bytes": s["analytic_allreduce_bytes"],
                "dense_allreduce_bytes": _summary(dense)["allreduce_bytes"],
                "samo": _summary(ours),
                "dense": _summary(dense),
                "sync_time_ratio": ratio_interval([x["allreduce_s"] for x in ours], [x["allreduce_s"] for x in dense]),
                "step_time_ratio": ratio_interval([x["wall_s"] for x in ours], [x["wall_s"] for x in dense]),
            }
        )
    p_max = max(sparsities)
    ours, theirs = steps[samo_variant(p_max)], steps[DENSE_PIPELINE]
    layout = {
        "samo_variant": samo_variant(p_max),
        "dense_variant": DENSE_PIPELINE,
        "samo": _summary(ours),
        "dense": _summary(theirs),
        "step_time_ratio": ratio_interval([x["wall_s"] for x in ours], [x["wall_s"] for x in theirs]),
    }
    return records, layout


def plot(payload: dict[str, Any], path) -> None:
    import numpy as np

    from ds_ext import plotting
    from ds_ext.perf import samo as samo_model

    fig = plotting.figure(figsize=(12, 4))
    a, b, c = fig.subplots(1, 3)
    ps = np.linspace(0.0, 1.0, 101)
    a.plot(ps, [100 * samo_model.memory_saved(p) for p in ps], "k-", label="001 Fig. 4.2: (24 p - 6) / 20")
    recs = payload["records"]
    a.plot([r["sparsity"] for r in recs], [100 * r["memory_saved"] for r in recs], "ro", label="measured (bench)")
    a.axhline(0, color="grey", lw=0.5)
    a.set_xlabel("sparsity p")
    a.set_ylabel("model-state memory saved vs 20 φ (%)")
    a.set_title("model-state memory")
    a.legend(fontsize=8)
    names = [f"p {r['sparsity']:g}" for r in recs]
    x = np.arange(len(recs))
    b.bar(x - 0.2, [r["dense_allreduce_bytes"] / 2**20 for r in recs], 0.4, label="dense (DeepSpeed)")
    b.bar(x + 0.2, [r["allreduce_bytes"] / 2**20 for r in recs], 0.4, label="SAMO")
    b.set_xticks(x, names)
    b.set_ylabel("all-reduce MiB per rank per step")
    b.set_title("data-parallel all-reduce bytes")
    b.legend(fontsize=8)
    lay = payload["layout"]
    labels = [*(f"sync p {r['sparsity']:g}" for r in recs), "step: SAMO 1x4\nvs dense 2x2"]
    ivs = [r["sync_time_ratio"] for r in recs] + [lay["step_time_ratio"]]
    mid = [iv["ratio"] for iv in ivs]
    err = [[m - iv["lo"] for m, iv in zip(mid, ivs)], [iv["hi"] - m for m, iv in zip(mid, ivs)]]
    c.bar(range(len(ivs)), mid, yerr=err, capsize=4, color="tab:green")
    c.axhline(1, color="k", lw=0.8)
    c.set_xticks(range(len(ivs)), labels, fontsize=7)
    c.set_ylabel("SAMO / dense, median (95 % bootstrap)")
    c.set_title(f"time ({payload['network']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(payload: dict[str, Any]) -> str:
    lines = [
        f"{'p':>4} {'state MB':>9} {'Eq4.1 MB':>9} {'saved':>6} {'AR MB':>7} {'dense AR MB':>11} "
        f"{'sync ms':>8} {'dense ms':>8} {'sync ratio [95%]':>22}"
    ]
    for r in payload["records"]:
        iv = r["sync_time_ratio"]
        lines.append(
            f"{r['sparsity']:4g} {r['state_bytes'] / 1e6:9.3f} {r['model_state_bytes'] / 1e6:9.3f} "
            f"{r['memory_saved']:6.1%} {r['allreduce_bytes'] / 1e6:7.3f} {r['dense_allreduce_bytes'] / 1e6:11.3f} "
            f"{r['samo']['sync_time_s'] * 1e3:8.1f} {r['dense']['sync_time_s'] * 1e3:8.1f} "
            f"{iv['ratio']:8.3f} [{iv['lo']:.3f}, {iv['hi']:.3f}]"
        )
    lay = payload["layout"]
    iv = lay["step_time_ratio"]
    lines.append(
        f"layout: {lay['samo_variant']} (1 x 4) {lay['samo']['step_time_s'] * 1e3:.1f} ms vs {lay['dense_variant']} "
        f"(2 x 2) {lay['dense']['step_time_s'] * 1e3:.1f} ms per step: {iv['ratio']:.3f} [{iv['lo']:.3f}, {iv['hi']:.3f}]"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from ds_ext.bench.stats import load_average, provenance
    from ds_ext.cluster.world import bench_cluster_spec, bench_world

    if args.quick:
        args.model, args.rounds, args.warmup, args.steps = "tiny", 1, 1, 1
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        raise SystemExit("ds-ext bench samo: --rounds and --steps must be at least 1, --warmup at least 0")
    bad = [p for p in args.sparsity if not 0 <= p < 1]
    if bad:
        raise SystemExit(f"ds-ext bench samo: --sparsity {bad[0]:g}; allowed: 0 <= p < 1")
    width, layers = MODELS[args.model]
    phi = layers * width * width
    split = _split_layouts(phi, max(args.sparsity), args.device_state_bytes_per_parameter)
    time_scale = None if args.network == "netns" else args.time_scale
    variants = [DENSE, *(samo_variant(p) for p in args.sparsity), DENSE_PIPELINE]
    # the dense engines train the model pruned at the largest p (their traffic does not depend on p)
    sparsity_of = {samo_variant(p): p for p in args.sparsity} | dict.fromkeys(
        (DENSE, DENSE_PIPELINE), max(args.sparsity)
    )
    prov = provenance(
        world_size=WORLD,
        nodes=NODES,
        ranks_per_node=RANKS_PER_NODE,
        model=args.model,
        width=width,
        layers=layers,
        micro_batch=MICRO,
        batch=BATCH,
        dtype="bf16",
        optimizer="torch.optim.AdamW",
        warmup=args.warmup,
        steps_per_round=args.steps,
        rounds=args.rounds,
        network=args.network,
        cluster=bench_cluster_spec(args, WORLD, NODES).to_json() if args.network == "netns" else None,
        time_scale=time_scale,
    )
    steps: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    samo: dict[str, dict[str, Any]] = {}
    for round_ in tqdm(range(args.rounds), desc="bench samo", unit="round"):
        order = variants[round_ % len(variants) :] + variants[: round_ % len(variants)]
        with bench_world(args, WORLD, {"LOCAL_SIZE": str(RANKS_PER_NODE)}, NODES) as world:
            for v in order:
                per_rank = world.run(_measure, v, width, layers, sparsity_of[v], args.warmup, args.steps, time_scale)
                steps[v] += [{**s, "round": round_} for s in _steps_over_ranks(per_rank)]
                if v.startswith("samo_"):
                    samo[v] = {k: val for k, val in per_rank[0].items() if k != "steps"}
    prov["host"]["load_average_after"] = load_average()
    records, layout = records_of(args.sparsity, steps, samo)
    payload = {
        "benchmark": "samo",
        "provenance": prov,
        "network": args.network,
        "quick": args.quick,
        "world_size": WORLD,
        "model": args.model,
        "phi": phi,
        "split": split,
        "records": records,
        "layout": layout,
        "steps": steps,
    }
    out = write_json(args.out, payload)
    plot(payload, out.with_suffix(".png"))
    print(table(payload))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return payload
