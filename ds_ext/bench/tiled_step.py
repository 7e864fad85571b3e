"""``ds-ext bench tiled_step``: the tiled optimizer step (001 §7.2) on one device against DeepSpeed's untiled step.

One rank (``--device cuda``: NCCL on the GPU; ``cpu``: gloo) builds the same model
(``--layers`` bias-free ``Linear(width, width)``, random init, one seed) once per variant, each
in its own DeepSpeed engine with bf16, ZeRO stage 1, gradient clipping and a ds_config
``optimizer`` section (AdamW: DeepSpeed's ``FusedAdam``, its CUDA kernel on the GPU):

* ``untiled``: DeepSpeed's own step (it up-casts the whole partition's gradient to fp32 and runs
  FusedAdam over the whole fp32 partition);
* ``tile=<n>``: the same engine with ``"ds_ext": {"tiled_optimizer": {"enabled": true,
  "tile_size": n}}``: FusedAdam's kernel on tiles of ``n`` parameters through one fp32 buffer.

Every step runs forward and backward on each engine in turn (variants interleaved, same data),
then times ``engine.step()`` alone: between CUDA events on the GPU (wall clock on the CPU), and
its peak memory above what was allocated before it (``torch.cuda.max_memory_allocated``; not
measured on the CPU). Per-step times are kept; the summary is the median over the measured
steps. After the last step the weights of every tiled engine are compared with the untiled
one's, bit for bit (the step must not change the arithmetic).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from ds_ext.bench import median, write_json

PAPER_TILE = 1_800_000  # 001 §7.2: "we fix the tile size to 1.8 million parameters"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--width", type=int, default=4096, help="Linear width (parameters per layer: width^2)")
    p.add_argument("--layers", type=int, default=16, help="Linear layers (default 16 x 4096^2 = 2^28 parameters)")
    p.add_argument(
        "--tiles",
        type=int,
        nargs="+",
        default=[PAPER_TILE, 1 << 23, 1 << 24, 1 << 25],
        help="tile sizes, one tiled variant each (default: the paper's 1.8M and 2^23..2^25)",
    )
    p.add_argument("--steps", type=int, default=12, help="measured steps (after 3 warm-up steps)")
    p.add_argument("--batch", type=int, default=64, help="rows of the random input")


def _engine(args: argparse.Namespace, tile: int | None, device: str):
    import torch

    import ds_ext

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)])
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
    }
    if tile is not None:
        cfg["ds_ext"] = {"tiled_optimizer": {"enabled": True, "tile_size": tile}}
    dev_args = argparse.Namespace(device_rank=0) if device == "cuda" else None
    engine, *_ = ds_ext.initialize(args=dev_args, model=model, config=cfg)
    return engine


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    """Runs on the one rank: every variant's step times, peaks and final weights."""
    import torch

    device = args.device
    cuda = device == "cuda"
    names = ["untiled", *(f"tile={t}" for t in args.tiles)]
    engines = {name: _engine(args, tile, device) for name, tile in zip(names, [None, *args.tiles])}
    optimizer = type(engines["untiled"].optimizer.optimizer).__name__
    gen = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {n: [] for n in names}
    peaks: dict[str, list[int]] = {n: [] for n in names}
    for step in range(3 + args.steps):
        x = torch.randn(args.batch, args.width, generator=gen).to(torch.bfloat16)
        for name, engine in engines.items():
            loss = engine(x.to(engine.device)).float().pow(2).mean()
            engine.backward(loss)
            if cuda:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                engine.step()
                end.record()
                end.synchronize()
                seconds, peak = start.elapsed_time(end) / 1e3, torch.cuda.max_memory_allocated() - before
            else:
                t0 = time.perf_counter()
                engine.step()
                seconds, peak = time.perf_counter() - t0, None
            if step >= 3:
                times[name].append(seconds)
                peaks[name].append(peak)
    ref = [p.detach() for p in engines["untiled"].module.parameters()]
    identical = {
        name: all(torch.equal(a, b.detach()) for a, b in zip(ref, engine.module.parameters()))
        for name, engine in engines.items()
        if name != "untiled"
    }
    return {
        "optimizer": optimizer,
        "times": times,
        "peaks": peaks,
        "identical": identical,
        "parameters": sum(p.numel() for p in ref),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ds_ext.bench.quant import environment
    from ds_ext.local_world import World

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("ds-ext bench tiled_step --device cuda: no CUDA device is visible")
    backend = "nccl" if args.device == "cuda" else "gloo"
    with World(1, backend=backend, accelerator=args.device, timeout=1800) as world:
        (r,) = world.run(_measure, args)
    base_t = median(r["times"]["untiled"])
    peaks_known = args.device == "cuda"
    base_p = max(r["peaks"]["untiled"]) if peaks_known else None
    records = []
    for name in r["times"]:
        t = median(r["times"][name])
        rec = {
            "variant": name,
            "tile_size": None if name == "untiled" else int(name.split("=")[1]),
            "step_s": t,
            "step_s_per_step": r["times"][name],
            "time_vs_untiled": t / base_t,
            "peak_bytes": max(r["peaks"][name]) if peaks_known else None,
            "bit_identical_to_untiled": r["identical"].get(name, True),
        }
        rec["peak_vs_untiled"] = rec["peak_bytes"] / base_p if peaks_known and base_p else None
        records.append(rec)
        peak = (
            f", step peak {rec['peak_bytes'] / 2**20:,.0f} MiB ({rec['peak_vs_untiled']:.3f}x)" if peaks_known else ""
        )
        print(
            f"{name:>14}: step {t * 1e3:8.3f} ms ({rec['time_vs_untiled']:.3f}x untiled){peak}, "
            f"bits {'identical' if rec['bit_identical_to_untiled'] else 'DIFFER'}"
        )
    env = environment(args.device)
    payload = {
        "benchmark": "tiled_step",
        "environment": env,
        "optimizer": r["optimizer"],
        "parameters": r["parameters"],
        "width": args.width,
        "layers": args.layers,
        "batch": args.batch,
        "measured_steps": args.steps,
        "records": records,
    }
    out = write_json(args.out, payload)
    print(f"wrote {out}")
    return payload
