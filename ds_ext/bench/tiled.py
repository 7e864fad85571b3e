"""``ds-ext bench tiled``: the tiled optimizer step (001 §7.2) against DeepSpeed's own.

4 CPU ranks (local gloo world, ``DS_ACCELERATOR=cpu``, one thread each) train a
DeepSpeed-MoE model -- Linear -> ``deepspeed.moe.layer.MoE`` (E experts of
hidden -> ffn -> hidden, ep_size 4, top-1) -> Linear -- with ZeRO stage 1 in bf16. With
ep_size = world size every rank holds E/4 whole experts and their optimizer state
(expert data parallelism 1, 001 eq. 7.7), so the step's up-cast spike grows with E.
Variants, side by side for E = 4, 8, 16, 32:

* ``untiled``: DeepSpeed's step with the default MoE param groups;
* ``ds_group_split``: DeepSpeed with ``split_params_into_different_moe_groups_for_optimizer(
  ..., max_group_size=tile_size)``, DeepSpeed's own partial answer;
* ``tiled``: ``"ds_ext": {"tiled_optimizer": {"enabled": true, "tile_size": ...}}``.

Peaks and times come from two worlds: one in memory mode from its start, one with glibc's
steady-state allocator thresholds (so times carry no memory-mode page faults). The step peak is the extra resident memory during
``engine.step()``: allocations above 64 KiB are forced onto mmap (``mallopt``) so that
freed temporaries leave the resident set, the kernel's high-water mark is reset
(``5 > /proc/self/clear_refs``) right before the step and ``VmHWM - VmRSS(before)`` is
read after it. Every number is the median over measured steps, the max over ranks. A second part sweeps the tile size at
the largest E, and a third times ZeRO-topo's step (plus its weight all-gather, with
alpha-beta time emulation) tiled-and-overlapped against untiled.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import time
from pathlib import Path
from typing import Any

from ds_ext.bench import median, write_json

WORLD = 4
VARIANTS = ("untiled", "ds_group_split", "tiled")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
MMAP_THRESHOLD_BYTES = 64 * 1024
# glibc's dynamic thresholds settle at (at most) these; used for the timed steps
STEADY_MMAP_THRESHOLD, STEADY_TRIM_THRESHOLD = 32 << 20, 64 << 20


# ---- memory measurement (CPU) -----------------------------------------------------------
def _mallopt(param: int, value: int) -> None:
    if ctypes.CDLL("libc.so.6").mallopt(param, value) != 1:
        raise RuntimeError(f"mallopt({param}, {value}) failed")


def use_mmap_for_large_allocations(threshold: int = MMAP_THRESHOLD_BYTES) -> None:
    """Serve every allocation above ``threshold`` bytes by mmap, so that freeing it returns
    the pages to the kernel and the resident set follows the live tensors (memory mode)."""
    _mallopt(M_MMAP_THRESHOLD, threshold)
    _mallopt(M_TRIM_THRESHOLD, threshold)


def use_steady_state_allocator() -> None:
    """glibc's thresholds as its dynamic adjustment leaves them in a long run (mmap above
    32 MiB, keep up to 64 MiB of freed heap): the allocator a training job really has, so
    step times are not inflated by the page faults that memory mode causes."""
    _mallopt(M_MMAP_THRESHOLD, STEADY_MMAP_THRESHOLD)
    _mallopt(M_TRIM_THRESHOLD, STEADY_TRIM_THRESHOLD)


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def measure_peak(fn) -> tuple[int, float, Any]:
    """(extra peak resident bytes, seconds, result) of calling ``fn()``; meaningful in a
    process that has been in memory mode (:func:`use_mmap_for_large_allocations`) since
    before its first large allocation, so that no large freed chunk sits in the heap."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    return max(0, peak - before) * 1024, dt, out


# ---- the DeepSpeed-MoE model ------------------------------------------------------------
def moe_model(hidden: int, ffn: int, experts: int, ep_size: int, seed: int = 1234):
    """Linear -> DeepSpeed MoE (top-1, ``experts`` FFN experts over ``ep_size`` ranks) -> Linear."""
    import torch
    from deepspeed.moe.layer import MoE
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(hidden, hidden)
            expert = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
            self.moe = MoE(
                hidden, expert, num_experts=experts, ep_size=ep_size, k=1, capacity_factor=2.0, min_capacity=4
            )
            self.out = nn.Linear(hidden, hidden)

        def forward(self, x, y):
            h, l_aux, _ = self.moe(torch.relu(self.inp(x)))
            pred = self.out(h).float()
            return ((pred - y.float()) ** 2).mean() + 0.01 * l_aux

    torch.manual_seed(seed)
    return Net()


def moe_param_groups(model, max_group_size: int | None = None, weight_decay: float = 0.01) -> list[dict]:
    """The dense / expert param groups DeepSpeed's ZeRO needs for MoE, optionally split
    into groups of at most ``max_group_size`` parameters (DeepSpeed's answer to the spike)."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    base = {"params": list(model.parameters()), "name": "dense", "weight_decay": weight_decay}
    if max_group_size is None:
        return split_params_into_different_moe_groups_for_optimizer(base)
    return split_params_into_different_moe_groups_for_optimizer(base, max_group_size=max_group_size)


def batch(step: int, hidden: int, tokens: int, dtype):
    """A deterministic micro-batch for this rank and step."""
    import torch
    import torch.distributed as dist

    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x = torch.randn(tokens, hidden, generator=g)
    y = torch.randn(tokens, hidden, generator=g)
    return x.to(dtype), y


def ds_config(stage: int, precision: str, clip: float, tiled: int | None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "ds_ext": {"comm": {"ledger": False}},
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 4}
    if tiled is not None:
        cfg["ds_ext"]["tiled_optimizer"] = {"enabled": True, "tile_size": tiled}
    return cfg


def moe_engine(
    experts: int,
    variant: str,
    tile_size: int,
    hidden: int,
    ffn: int,
    stage: int = 1,
    precision: str = "bf16",
    clip: float = 1.0,
    lr: float = 1e-3,
    optimizer: str = "torch",
):
    """A DeepSpeed engine (through ``ds_ext.initialize``) for one benchmark variant;
    ``optimizer``: torch's AdamW or DeepSpeed's FusedAdam (``"ds_fused"``), same hyper-parameters."""
    import torch

    import ds_ext

    model = moe_model(hidden, ffn, experts, WORLD if experts >= WORLD else experts)
    groups = moe_param_groups(model, tile_size if variant == "ds_group_split" else None)
    if optimizer == "ds_fused":
        from deepspeed.ops.adam import FusedAdam

        opt = FusedAdam(groups, lr=lr, weight_decay=0.01, adam_w_mode=True)
    else:
        opt = torch.optim.AdamW(groups, lr=lr)
    cfg = ds_config(stage, precision, clip, tile_size if variant == "tiled" else None)
    engine, *_ = ds_ext.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def _measure_moe(
    experts: int,
    variant: str,
    tile_size: int,
    hidden: int,
    ffn: int,
    tokens: int,
    warmup: int,
    steps: int,
    memory: bool,
) -> dict[str, Any]:
    """Median step peak bytes (``memory``: this world is in memory mode) or median step
    seconds (a world with the steady-state allocator) of one variant on this rank."""
    import torch

    (use_mmap_for_large_allocations if memory else use_steady_state_allocator)()
    engine = moe_engine(experts, variant, tile_size, hidden, ffn)
    values = []
    for step in range(warmup + steps):
        x, y = batch(step, hidden, tokens, torch.bfloat16)
        engine.backward(engine(x, y))
        if memory:
            value: float = measure_peak(engine.step)[0]
        else:
            torch.distributed.barrier()
            t0 = time.perf_counter()
            engine.step()
            value = time.perf_counter() - t0
        if step >= warmup:
            values.append(value)
    local_expert = sum(p.numel() for n, p in engine.module.named_parameters() if "deepspeed_experts" in n)
    engine.destroy()
    del engine
    gc.collect()
    return {"value": median(values), "local_expert_params": local_expert}


# ---- ZeRO-topo: step + weight all-gather, tiled-and-overlapped vs untiled ---------------
def _measure_zero_topo(
    tiled: int | None, d_model: int, n_layers: int, time_scale: float, warmup: int, steps: int
) -> dict[str, Any]:
    """Median seconds of ZeRO-topo's ``engine.step()`` (gradient reduction, update and the
    weight all-gather from the world-sharded optimizer shard down to the GCD-pair primary
    shard, time-emulated) and the step's ledger bytes per level."""
    import torch

    import ds_ext
    from ds_ext.models import GPT, GPTConfig

    torch.manual_seed(1234)
    model = GPT(GPTConfig(seq_len=32, d_model=d_model, n_layers=n_layers, n_heads=4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9,
        "ds_ext": {
            "topology": {"preset": "frontier", "sizes": {"gpu": 2}, "emulate": True},
            "comm": {"emulate_time": True, "time_scale": time_scale},
            "zero_topo": {
                "enabled": True,
                "preset": "zero_topo",
                "weights": {"gather_bits": 16},
                "gradients": {"bits": 16, "hops": 1},
                "secondary": {"bits": 16},
            },
        },
    }
    if tiled is not None:
        cfg["ds_ext"]["tiled_optimizer"] = {"enabled": True, "tile_size": tiled}
    engine, *_ = ds_ext.initialize(model=model, optimizer=opt, config=cfg)
    times = []
    g = torch.Generator().manual_seed(7)
    for step in range(warmup + steps):
        tokens = torch.randint(0, 256, (1, 33), generator=g)
        engine.backward(engine(tokens))
        torch.distributed.barrier()
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        if step >= warmup:
            times.append(dt)
    step_bytes = {lv: b for lv, b in engine.ds_ext.ledger.steps[-1].by_phase().get("step", {}).items()}
    engine.destroy()
    return {"time": median(times), "step_bytes": step_bytes}


# ---- driver -----------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="JSON file to write (a PNG is written next to it)")
    p.add_argument("--experts", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--tile-size", type=int, default=1_800_000)
    p.add_argument(
        "--sweep",
        type=int,
        nargs="+",
        default=[100_000, 450_000, 1_800_000, 7_200_000],
        help="tile sizes swept at the largest E",
    )
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=64, help="tokens per rank per step")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="measured steps (medians)")
    p.add_argument(
        "--zero-topo-time-scale",
        type=float,
        default=300.0,
        help="emulated link-time factor for the ZeRO-topo part (weight all-gathers "
        "of about the update's duration, where overlap matters most)",
    )
    p.add_argument("--zero-topo-steps", type=int, default=20)
    p.add_argument(
        "--zero-topo-repeats",
        type=int,
        default=2,
        help="alternating untiled / tiled runs; the median over all measured steps",
    )
    p.add_argument("--quick", action="store_true", help="small model, E = 4 and 16, no tile-size sweep (for tests)")
    p.add_argument("--timeout", type=float, default=3600)


def _apply_quick(args: argparse.Namespace) -> None:
    args.experts = [4, 16]
    args.hidden, args.ffn, args.tile_size = 128, 512, 65_536
    args.sweep = []
    args.warmup, args.steps, args.tokens = 1, 2, 16
    args.zero_topo_steps, args.zero_topo_repeats = 3, 1


def checks(records: list[dict[str, Any]], tile_size: int) -> dict[str, Any]:
    """The issue's acceptance criteria, computed from the records."""
    main = sorted((r for r in records if r["tile_size"] == tile_size), key=lambda r: r["experts"])
    tiled = [r["step_peak_bytes_tiled"] for r in main]
    untiled = [r["step_peak_bytes_untiled"] for r in main]
    return {
        "tiled_peak_largest_E_over_smallest_E": tiled[-1] / max(tiled[0], 1),
        "tiled_peak_max_over_min": max(tiled) / max(min(tiled), 1),
        "untiled_peak_largest_E_over_smallest_E": untiled[-1] / max(untiled[0], 1),
        "tiled_le_group_split": all(r["step_peak_bytes_tiled"] <= r["step_peak_bytes_ds_group_split"] for r in main),
        "time_ratio_tiled_over_untiled": {
            r["experts"]: r["step_time_s_tiled"] / r["step_time_s_untiled"] for r in main
        },
        "time_ratio_tiled_over_group_split": {
            r["experts"]: r["step_time_s_tiled"] / r["step_time_s_ds_group_split"] for r in main
        },
        "peak_ratio_tiled_over_untiled": {
            r["experts"]: r["step_peak_bytes_tiled"] / r["step_peak_bytes_untiled"] for r in main
        },
    }


def table(records: list[dict[str, Any]]) -> str:
    head = (
        f"{'E':>3} {'tile':>9} {'peak untiled MB':>16} {'group split MB':>15} {'tiled MB':>9} "
        f"{'t untiled s':>12} {'t split s':>10} {'t tiled s':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in records:
        lines.append(
            f"{r['experts']:>3} {r['tile_size']:>9} {r['step_peak_bytes_untiled'] / 1e6:>16.2f} "
            f"{r['step_peak_bytes_ds_group_split'] / 1e6:>15.2f} {r['step_peak_bytes_tiled'] / 1e6:>9.2f} "
            f"{r['step_time_s_untiled']:>12.4f} {r['step_time_s_ds_group_split']:>10.4f} "
            f"{r['step_time_s_tiled']:>10.4f}"
        )
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], tile_size: int, path: Path) -> None:
    from ds_ext import plotting

    main = sorted((r for r in records if r["tile_size"] == tile_size), key=lambda r: r["experts"])
    es = [r["experts"] for r in main]
    fig = plotting.figure(figsize=(6, 4))
    ax = fig.subplots()
    for key, label in (
        ("untiled", "DeepSpeed untiled"),
        ("ds_group_split", "DeepSpeed max_group_size"),
        ("tiled", "ds_ext tiled"),
    ):
        ax.plot(es, [r[f"step_peak_bytes_{key}"] / 1e6 for r in main], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(es, [str(e) for e in es])
    ax.set_xlabel("experts E (ep_size 4, ZeRO-1, bf16)")
    ax.set_ylabel("extra resident MB during engine.step()")
    ax.set_title(f"optimizer step peak, tile_size {tile_size:,}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _zero_topo_part(world, args: argparse.Namespace) -> dict[str, Any]:
    """Alternating untiled / tiled ZeRO-topo runs (step incl. weight all-gather)."""
    zt: dict[str, Any] = {}
    zt_times: dict[str, list[float]] = {"untiled": [], "tiled": []}
    for _ in range(args.zero_topo_repeats):
        for name, ts in (("untiled", None), ("tiled", args.tile_size)):
            per_rank = world.run(
                _measure_zero_topo,
                ts,
                128 if args.quick else 256,
                4,
                args.zero_topo_time_scale,
                args.warmup,
                args.zero_topo_steps,
            )
            zt_times[name].append(max(r["time"] for r in per_rank))
            zt[f"step_bytes_by_level_{name}"] = per_rank[0]["step_bytes"]
    for name, times in zt_times.items():
        zt[f"step_time_s_{name}"] = median(times)
    return zt


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ds_ext.local_world import World

    if args.quick:
        _apply_quick(args)
    env = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    cases = [(e, args.tile_size) for e in args.experts]
    cases += [(max(args.experts), ts) for ts in args.sweep if ts != args.tile_size]
    records: list[dict[str, Any]] = [{"experts": e, "tile_size": ts} for e, ts in cases]
    local_expert_params: dict[int, int] = {}
    # memory and time in separate worlds: memory mode must hold from the process start
    for memory in (True, False):
        with World(WORLD, env, timeout=args.timeout) as world:
            for rec in records:
                for variant in VARIANTS:
                    per_rank = world.run(
                        _measure_moe,
                        rec["experts"],
                        variant,
                        rec["tile_size"],
                        args.hidden,
                        args.ffn,
                        args.tokens,
                        args.warmup,
                        args.steps,
                        memory,
                    )
                    value = max(r["value"] for r in per_rank)
                    if memory:
                        rec[f"step_peak_bytes_{variant}"] = int(value)
                    else:
                        rec[f"step_time_s_{variant}"] = value
                local_expert_params[rec["experts"]] = per_rank[0]["local_expert_params"]
                if not memory:
                    print(table([rec]).splitlines()[-1], flush=True)
            if not memory:
                zt = _zero_topo_part(world, args)
    payload = {
        "benchmark": "tiled",
        "world_size": WORLD,
        "model": {
            "hidden": args.hidden,
            "ffn": args.ffn,
            "tokens_per_rank": args.tokens,
            "ep_size": WORLD,
            "zero_stage": 1,
            "precision": "bf16",
        },
        "local_expert_params_per_rank": local_expert_params,
        "records": records,
        "zero_topo": {"preset": "zero_topo (unquantized)", "time_scale": args.zero_topo_time_scale, **zt},
        "checks": checks(records, args.tile_size),
    }
    out = write_json(args.out, payload)
    plot(records, args.tile_size, out.with_suffix(".png"))
    print(table(records))
    print(
        f"zero_topo step+all-gather: untiled {zt['step_time_s_untiled']:.4f} s, "
        f"tiled+overlapped {zt['step_time_s_tiled']:.4f} s"
    )
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return payload
