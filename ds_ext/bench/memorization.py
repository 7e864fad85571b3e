"""``ds-ext bench memorization``: 000 §VIII-B/D at small scale, standard loss against Goldfish.

000 §VIII-B: documents in four disjoint buckets, three of them trained for 1, 4 and 6 epochs, the
fourth never (the control); a warm-up on other text (50 steps, learning rate rising to its peak),
then the buckets injected while the learning rate decays to a tenth; the model is prompted with
each document's beginning and writes the last ``n`` tokens greedily; a document counts as
memorized iff all ``n`` come out exactly (:mod:`ds_ext.goldfish.memorization`). 000 §VIII-D repeats
it with the Goldfish loss (k = 2, h = 13): exact match falls to the control's level.

Scaled down here (every difference from 000 is a flag): a GPT of 0.8 M parameters built from its
config (random init, byte tokens) instead of pre-trained Llama models; documents of 129 bytes of the
Python standard library's sources (``ds_ext.data.ByteCorpus``: nothing downloaded) instead of
Wikipedia pages of 2048+ tokens, 32 per bucket instead of 200, the last 32 tokens instead of 50;
the warm-up reads other stdlib windows. A model this small memorizes nothing in 6 passes (000
Fig. 10, left: under 1 % below 13B parameters), so one of 000's epochs is ``--passes-per-epoch``
passes over the bucket here (default 12: the buckets are seen 12, 48 and 72 times); the record
says so. Training runs through ``ds_ext.initialize`` on one CPU rank, Goldfish switched on from the
ds_config's ``"ds_ext": {"goldfish": ...}`` block. Exact match is averaged over ``--seeds`` (each
seed draws the model, the documents and the order).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

from ds_ext.bench import write_json

BUCKET_EPOCHS = (0, 1, 4, 6)  # 000 §VIII-B; 0 = the control bucket, never trained
VARIANTS: tuple[dict[str, Any], ...] = (
    {"loss": "standard", "k": None, "h": None},
    {"loss": "goldfish", "k": 2, "h": 13},
    {"loss": "goldfish", "k": 4, "h": 13},
)
WARMUP_BYTES = 1_500_000  # warm-up windows start below this offset; documents lie above it
DOCUMENT_BYTES = 400_000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="JSON file to write (the PNG goes next to it)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--passes-per-epoch", type=int, default=12, help="passes over a bucket per 000 epoch")
    p.add_argument("--docs", type=int, default=32, help="documents per bucket")
    p.add_argument("--doc-len", type=int, default=129, help="tokens per document (the model reads doc-len - 1)")
    p.add_argument("--n", type=int, default=32, help="the last n tokens, written greedily")
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (decayed to a tenth)")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)


def _schedule(warmup: int, inject: int):
    """000 §VIII-B: linear warm-up to the peak, then linear decay to a tenth over the injection."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 1.0 - 0.9 * min(1.0, (step - warmup) / max(1, inject - 1))

    return factor


def _train_and_measure(args: dict[str, Any], variant: dict[str, Any], seed: int) -> dict[str, Any]:
    """One run on this (single) rank: warm-up, injection, exact match per bucket."""
    import torch

    import ds_ext
    from ds_ext.data import ByteCorpus
    from ds_ext.goldfish.mask import goldfish_keep
    from ds_ext.goldfish.memorization import exact_match
    from ds_ext.models import GPT, GPTConfig

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(seed)
    D, N, B = args["doc_len"], args["docs"], args["batch"]
    corpus = ByteCorpus(max_bytes=WARMUP_BYTES + DOCUMENT_BYTES)
    slots = torch.randperm(DOCUMENT_BYTES // D, generator=g)[: len(BUCKET_EPOCHS) * N]
    buckets = corpus.tokens[WARMUP_BYTES + slots[:, None] * D + torch.arange(D)].long().view(len(BUCKET_EPOCHS), N, D)
    injected = torch.cat([buckets[i].repeat(e * args["passes_per_epoch"], 1) for i, e in enumerate(BUCKET_EPOCHS) if e])
    injected = injected[torch.randperm(len(injected), generator=g)]
    inject_steps = math.ceil(len(injected) / B)

    torch.manual_seed(seed)
    model = GPT(GPTConfig(seq_len=D - 1, d_model=args["d_model"], n_layers=args["layers"], n_heads=args["heads"]))
    opt = torch.optim.AdamW(model.parameters(), lr=args["lr"], betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(args["warmup_steps"], inject_steps))
    block: dict[str, Any] = {}
    if variant["loss"] == "goldfish":
        block["goldfish"] = {"enabled": True, "k": variant["k"], "h": variant["h"]}
    cfg = {"train_micro_batch_size_per_gpu": B, "steps_per_print": 10**9, "ds_ext": block}
    engine, *_ = ds_ext.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=cfg)
    t0 = time.perf_counter()
    for step in range(args["warmup_steps"] + inject_steps):
        if step < args["warmup_steps"]:
            starts = torch.randint(0, WARMUP_BYTES - D, (B,), generator=g)
            x = corpus.tokens[starts[:, None] + torch.arange(D)].long()
        else:
            j = step - args["warmup_steps"]
            x = injected[j * B : (j + 1) * B]
        loss = engine(x)
        engine.backward(loss)
        engine.step()
    seconds = time.perf_counter() - t0
    engine.module.eval()
    matched = [exact_match(engine.module.logits, buckets[i], args["n"]).double().mean().item() for i in range(4)]
    dropped = 0.0
    if variant["loss"] == "goldfish":
        dropped = 1 - goldfish_keep(buckets[1:], variant["k"], variant["h"])[..., variant["h"] :].double().mean().item()
    engine.destroy()
    return {
        "exact_match": dict(zip(BUCKET_EPOCHS, matched)),
        "final_loss": loss.item(),
        "steps": args["warmup_steps"] + inject_steps,
        "train_seconds": seconds,
        "parameters": model.cfg.num_parameters,
        "dropped_fraction": dropped,
    }


def _label(variant: dict[str, Any]) -> str:
    return "standard loss" if variant["loss"] == "standard" else f"goldfish k={variant['k']}, h={variant['h']}"


def _plot(payload: dict[str, Any], path: Path) -> None:
    from ds_ext.plotting import colours, figure

    labels = [_label(v) for v in VARIANTS]
    colour = colours(labels)
    fig = figure(figsize=(7, 4))
    ax = fig.add_subplot()
    width = 0.8 / len(VARIANTS)
    for i, (variant, label) in enumerate(zip(VARIANTS, labels)):
        recs = [r for r in payload["records"] if _label(r) == label]
        xs = [BUCKET_EPOCHS.index(r["epochs"]) + (i - (len(VARIANTS) - 1) / 2) * width for r in recs]
        ax.bar(xs, [100 * r["exact_match"] for r in recs], width, label=label, color=colour[label])
    ax.set_xticks(range(len(BUCKET_EPOCHS)))
    ax.set_xticklabels(
        ["0 Ep (control)"] + [f"{e} Ep ({e * payload['passes_per_epoch']} passes)" for e in BUCKET_EPOCHS[1:]]
    )
    ax.set_ylabel(f"exact match of the last {payload['n']} tokens (%)")
    ax.set_ylim(0, 105)
    ax.set_title(
        f"000 §VIII at small scale: {payload['parameters']:,}-parameter GPT, mean of {len(payload['seeds'])} seeds"
    )
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import os
    import subprocess

    from ds_ext.bench.quant import environment
    from ds_ext.local_world import World

    keys = ("passes_per_epoch", "docs", "doc_len", "n", "warmup_steps", "batch", "lr", "d_model", "layers", "heads")
    params = {k: getattr(args, k) for k in keys}
    load_before = os.getloadavg()
    runs: dict[tuple[int, int], dict[str, Any]] = {}
    with World(1, timeout=7200) as world:
        for seed in args.seeds:
            for i, variant in enumerate(VARIANTS):
                (runs[i, seed],) = world.run(_train_and_measure, params, variant, seed)
                r = runs[i, seed]
                print(
                    f"seed {seed} {_label(variant):<22}: "
                    + ", ".join(f"{e} Ep {100 * m:5.1f} %" for e, m in r["exact_match"].items())
                    + f" ({r['steps']} steps, {r['train_seconds']:.0f} s, final loss {r['final_loss']:.3f})"
                )
    records = []
    for i, variant in enumerate(VARIANTS):
        for e in BUCKET_EPOCHS:
            per_seed = [runs[i, s]["exact_match"][e] for s in args.seeds]
            records.append(
                {
                    **variant,
                    "epochs": e,
                    "passes": e * args.passes_per_epoch,
                    "exact_match": sum(per_seed) / len(per_seed),
                    "exact_match_per_seed": per_seed,
                    "dropped_fraction": sum(runs[i, s]["dropped_fraction"] for s in args.seeds) / len(args.seeds),
                }
            )
    repo = Path(__file__).resolve().parents[2]
    git = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    commit = git.stdout.strip()
    payload = {
        "benchmark": "memorization",
        "command": "ds-ext bench memorization "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in params.items())
        + " --seeds "
        + " ".join(map(str, args.seeds))
        + f" --out {args.out}",
        "commit": commit or None,
        "date": time.strftime("%Y-%m-%d"),
        "environment": environment("cpu"),
        "load_before_after": [load_before[0], os.getloadavg()[0]],
        "parameters": runs[0, args.seeds[0]]["parameters"],
        "steps": runs[0, args.seeds[0]]["steps"],
        "train_seconds": [runs[k]["train_seconds"] for k in sorted(runs)],
        "seeds": args.seeds,
        **params,
        "records": records,
    }
    out = write_json(args.out, payload)
    png = out.with_suffix(".png")
    _plot(payload, png)
    print(f"wrote {out} and {png}")
    return payload
