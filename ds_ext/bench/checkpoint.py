"""``ds-ext bench checkpoint``: what saving every step costs a ZeRO-topo job, and what a lost node's
restore takes from the partner tier against the shared one.

8 gloo ranks laid out as Frontier shrunk to 2 nodes x 2 GPUs x 2 GCDs train ds_ext's GPT (bf16,
ZeRO-topo's default preset, torch's AdamW, gradient accumulation 2). Variants, each an engine built
by ``ds_ext.initialize`` in the same world, one after another in every round (the order rotated
by one per round, each round in a fresh world):

* ``no_save``: training only;
* ``shared``: ``save_checkpoint`` after every step into the shared directory, synchronous;
* ``shared_async``: the same with ``zero_topo.async_save`` (:mod:`ds_ext.zero_topo.async_save`);
* ``tiers_async``: ``zero_topo.checkpoint_tiers`` (:mod:`ds_ext.zero_topo.tiers`): every step into
  each node's own local directory with a copy of every rank's files on the partner node, every
  ``--shared-every`` steps also into the shared directory, with ``async_save``.

Measured per step: the slowest rank's wall time of the step's micro-batches and its save call (an
asynchronous save's wait for the previous one falls into the next step's save). After each
round: the bytes each tier holds per save (the files on disk: the local tier per node, its
partner copies apart, and the shared one) and, on the shaped cluster, the bytes one tiered save
put on the NICs (the kernel's counters, ``ds_ext.cluster.wire``). Then the restore of a lost
node, timed as ``load_checkpoint`` on every rank (the slowest): node 1's local directory deleted
and new engines built in the same world, as a restarted job starts them, loading from the partner
tier (``restore_partner``); and the same engines without tiers loading the shared variant's
newest save (``restore_shared``).

On this host the node-local and the shared directory are the same disk: the shared tier is not
the network file system it is on Frontier, so ``restore_shared`` is a floor of what Lustre would
take; the partner copies do cross the shaped NICs. Ratios are medians over every measured step
(restores: over the rounds) with the two-stage bootstrap intervals of ``ds_ext.bench.stats``.

``--network netns``: the ranks run on an emulated cluster (``ds_ext.cluster``); ``--network
emulate``: local ranks, nothing shaped. ``--quick``: the tiny model, 1 round of 1 step.
"""

from __future__ import annotations

import argparse
import re
import shutil
import time
from pathlib import Path
from typing import Any

from ds_ext.bench import median, write_json
from ds_ext.cluster.world import add_network_arguments

WORLD, NODES, RANKS_PER_NODE = 8, 2, 4
TOPOLOGY = {"preset": "frontier", "sizes": {"gcd": 2, "gpu": 2}, "emulate": True}
MODELS = {"gpt5m": (256, 6, 4, 128), "tiny": (64, 2, 4, 32)}  # name -> (d_model, n_layers, n_heads, seq_len)
MICRO, ACCUM = 2, 2
VARIANTS = ("no_save", "shared", "shared_async", "tiers_async")
SAVING = VARIANTS[1:]
SHARD = re.compile(r"ds_ext_zero_topo_rank(\d+)\.pt")  # ds_ext.zero_topo.checkpoint.SHARD_FILE


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--model", choices=sorted(MODELS), default="gpt5m")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every variant (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps per variant and round (default 1)")
    p.add_argument("--steps", type=int, default=5, help="measured steps per variant and round (default 5)")
    p.add_argument("--shared-every", type=int, default=4, help="tiers_async: a shared save every N saves (default 4)")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    p.add_argument("--quick", action="store_true", help="the tiny model, 1 round of 1 step (a plumbing check)")
    p.add_argument("--timeout", type=float, default=900, help="seconds a collective may wait (default 900)")
    add_network_arguments(p)


def _config(variant: str, root: Path, shared_every: int, seq: int) -> dict[str, Any]:
    zero_topo: dict[str, Any] = {"enabled": True, "preset": "zero_topo", "async_save": variant.endswith("_async")}
    if variant.startswith("tiers"):
        zero_topo["checkpoint_tiers"] = {
            "local_dir": str(root / variant / "local" / "node{node}"),
            "local_every": 1,
            "shared_every": shared_every,
        }
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9,
        "ds_ext": {"topology": TOPOLOGY, "comm": {"timeout_s": 900}, "zero_topo": zero_topo},
    }


def _engine(model: str, cfg: dict[str, Any]):
    import torch

    import ds_ext
    from ds_ext.models import GPT, GPTConfig

    d, layers, heads, seq = MODELS[model]
    torch.manual_seed(1234)
    net = GPT(GPTConfig(seq_len=seq, d_model=d, n_layers=layers, n_heads=heads))
    engine, *_ = ds_ext.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-3), config=cfg)
    return engine


def _slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _sizes(tag_dir: Path, node_ranks: set[int]) -> tuple[int, int]:
    """(bytes of the files of ``node_ranks``, bytes of the other ranks') in one node's save; DeepSpeed's
    files are rank 0's (it writes them)."""
    own = other = 0
    for path in tag_dir.rglob("*.pt"):
        match = SHARD.fullmatch(path.name)
        if (int(match.group(1)) if match else 0) in node_ranks:
            own += path.stat().st_size
        else:
            other += path.stat().st_size
    return own, other


def _newest(tier: Path) -> Path | None:
    """The newest complete save of a tier (its ``latest`` file names it), None before the first."""
    latest = tier / "latest"
    return tier / latest.read_text().strip() if latest.exists() else None


def _tier_bytes(variant: str, root: Path) -> dict[str, int]:
    """The bytes each tier holds of its newest save of ``variant`` (module docstring; 0: none yet)."""
    shared = _newest(root / variant / "shared")
    out = {"shared": 0 if shared is None else sum(p.stat().st_size for p in shared.rglob("*.pt"))}
    if variant.startswith("tiers"):
        local = root / variant / "local"
        parts = [
            _sizes(_newest(local / f"node{n}"), set(range(n * RANKS_PER_NODE, (n + 1) * RANKS_PER_NODE)))
            for n in range(NODES)
        ]
        out |= {"local": sum(own for own, _ in parts), "partner": sum(other for _, other in parts)}
    return out


def _measure(variant: str, model: str, root: str, warmup: int, steps: int, shared_every: int, wire: bool):
    """On every rank: train ``variant`` ``warmup`` + ``steps`` steps, saving as it says; the
    slowest rank's time per measured step, and (saving variants, rank 0) the bytes per tier."""
    import torch.distributed as dist

    from ds_ext.data import ByteCorpus

    root_dir = Path(root)
    seq = MODELS[model][3]
    engine = _engine(model, _config(variant, root_dir, shared_every, seq))
    corpus, rank = ByteCorpus(), dist.get_rank()
    shared = root_dir / variant / "shared"
    times = []
    for step in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        for micro in range(ACCUM):
            engine.backward(engine(corpus.micro_batch(step, micro, rank, WORLD, MICRO, ACCUM, seq)))
            engine.step()
        if variant != "no_save":
            engine.save_checkpoint(shared)
        wall = _slowest(time.perf_counter() - t0)
        if step >= warmup:
            times.append(wall)
    out: dict[str, Any] = {"step_times_s": times}
    plugin = engine.ds_ext.plugin("zero_topo")
    if variant.endswith("_async"):
        plugin.checkpoints.background.wait()
    if variant != "no_save":
        dist.barrier()
        out["tier_bytes"] = _tier_bytes(variant, root_dir)
    if variant == "tiers_async" and wire:
        from ds_ext.cluster.wire import wire_region

        with wire_region() as region:  # one more tiered save: its partner copies cross the NICs
            engine.save_checkpoint(shared)
            plugin.checkpoints.background.wait()
        if region.bytes is not None:
            out["nic_bytes_per_local_save"] = region.bytes.by_level().get("node", {}).get("up")
    engine.destroy()
    dist.barrier()
    return out


def _restore(model: str, root: str, shared_every: int) -> dict[str, float]:
    """On every rank: a lost node 1 restored from the partner tier, then the shared variant's newest
    save loaded without tiers; the slowest rank's ``load_checkpoint`` seconds of each."""
    import torch.distributed as dist

    root_dir = Path(root)
    seq = MODELS[model][3]
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root_dir / "tiers_async" / "local" / "node1", ignore_errors=True)
    dist.barrier()
    out = {}
    for name, variant in (("restore_partner", "tiers_async"), ("restore_shared", "shared")):
        cfg = _config(variant, root_dir, shared_every, seq)
        engine = _engine(model, cfg)
        dist.barrier()
        t0 = time.perf_counter()
        engine.load_checkpoint(root_dir / variant / "shared")
        out[name] = _slowest(time.perf_counter() - t0)
        out[f"{name}_step"] = engine.global_steps
        engine.destroy()
        dist.barrier()
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    from tqdm import tqdm

    from ds_ext.bench.stats import load_average, provenance, round_ratio_interval
    from ds_ext.cluster.world import bench_cluster_spec, bench_world

    if args.quick:
        args.model, args.rounds, args.warmup, args.steps = "tiny", 1, 1, 1
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0 or args.shared_every < 1:
        raise SystemExit(
            "ds-ext bench checkpoint: --rounds, --steps and --shared-every must be at least 1, --warmup at least 0"
        )
    netns = args.network == "netns"
    prov = provenance(
        world_size=WORLD,
        nodes=NODES,
        ranks_per_node=RANKS_PER_NODE,
        model=args.model,
        seq_len=MODELS[args.model][3],
        micro_batch=MICRO,
        grad_accum=ACCUM,
        dtype="bf16",
        preset="zero_topo",
        shared_every=args.shared_every,
        warmup=args.warmup,
        steps_per_round=args.steps,
        rounds=args.rounds,
        network=args.network,
        cluster=bench_cluster_spec(args, WORLD, NODES).to_json() if netns else None,
        storage="node-local and shared directories on this host's one disk",
    )
    steps: dict[str, list[list[float]]] = {v: [] for v in VARIANTS}
    tiers: dict[str, list[dict[str, int]]] = {v: [] for v in SAVING}
    restores: list[dict[str, float]] = []
    nic: list[float] = []
    for round_ in tqdm(range(args.rounds), desc="bench checkpoint", unit="round"):
        order = VARIANTS[round_ % len(VARIANTS) :] + VARIANTS[: round_ % len(VARIANTS)]
        with tempfile.TemporaryDirectory(dir=args.dir) as root:
            with bench_world(args, WORLD, {"LOCAL_SIZE": str(RANKS_PER_NODE)}, NODES) as world:
                for v in order:
                    got = world.run(_measure, v, args.model, root, args.warmup, args.steps, args.shared_every, netns)
                    steps[v].append(got[0]["step_times_s"])
                    if v in SAVING:
                        tiers[v].append(got[0]["tier_bytes"])
                    if got[0].get("nic_bytes_per_local_save") is not None:
                        nic.append(got[0]["nic_bytes_per_local_save"])
                restores.append(world.run(_restore, args.model, root, args.shared_every)[0])
    prov["host"]["load_average_after"] = load_average()
    records = [
        {
            "variant": v,
            "step_times_s": [t for r in steps[v] for t in r],
            "median_step_s": median([t for r in steps[v] for t in r]),
            **({"tier_bytes_per_save": tiers[v][-1]} if v in SAVING else {}),
        }
        for v in VARIANTS
    ]
    ratios = {f"{v}/no_save": round_ratio_interval(steps[v], steps["no_save"]) for v in SAVING}
    restore = {
        key: {"seconds": [r[key] for r in restores], "median_s": median([r[key] for r in restores])}
        for key in ("restore_partner", "restore_shared")
    }
    restore["steps_restored"] = {key: restores[-1][f"{key}_step"] for key in ("restore_partner", "restore_shared")}
    payload = {
        "benchmark": "checkpoint",
        "provenance": prov,
        "network": args.network,
        "quick": args.quick,
        "world_size": WORLD,
        "model": args.model,
        "records": records,
        "step_time_ratio_interval": ratios,
        "restore": restore,
        "nic_bytes_per_local_save": median(nic) if nic else None,
    }
    out = write_json(args.out, payload)
    print(table(payload))
    print(f"wrote {out}")
    return payload


def table(payload: dict[str, Any]) -> str:
    """The step times, their ratios to ``no_save`` and the restores, as printed by the run."""
    lines = [f"{'variant':<14}{'median s/step':>15}{'vs no_save [95 %]':>28}"]
    for r in payload["records"]:
        iv = payload["step_time_ratio_interval"].get(f"{r['variant']}/no_save")
        shown = "" if iv is None else f"{iv['ratio']:.3f} [{iv['lo']:.3f}, {iv['hi']:.3f}]"
        lines.append(f"{r['variant']:<14}{r['median_step_s']:>15.3f}{shown:>28}")
    rs = payload["restore"]
    lines.append(
        f"restore of a lost node: partner tier {rs['restore_partner']['median_s']:.2f} s, "
        f"shared {rs['restore_shared']['median_s']:.2f} s"
    )
    return "\n".join(lines)
