"""A plain DeepSpeed training script (no ds_ext call): ``deepspeed.initialize`` directly.

This is examples/train.py as any DeepSpeed user writes it. Run it under ds_ext without
editing it, and the ``"ds_ext"`` block of its ds_config takes effect::

    deepspeed --num_gpus 8 --module ds_ext.run examples/train_deepspeed.py --deepspeed_config configs/demo.json

``ds_ext.run`` routes ``deepspeed.initialize`` through ``ds_ext.initialize`` and prints
the per-level traffic table at exit. Launched without it, DeepSpeed would keep the block
and ignore it (ds_ext, imported here for the model, warns about that).
"""

from __future__ import annotations

import argparse
import time

import deepspeed
import torch
import torch.distributed as dist
from tqdm import tqdm

from ds_ext.data import ByteCorpus
from ds_ext.models import GPT, GPTConfig


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log-losses", action="store_true", help="print every step's loss (rank 0)")
    p.add_argument("--local_rank", type=int, default=-1, help="set by the DeepSpeed launcher")
    deepspeed.add_config_arguments(p)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    cfg = GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, optimizer=optimizer)

    rank, world = dist.get_rank(), dist.get_world_size()
    dp = engine.data_parallel_group.size() if engine.data_parallel_group else world
    dp_rank = dist.get_rank(engine.data_parallel_group) if engine.data_parallel_group else rank
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    corpus = ByteCorpus()
    bar = tqdm(range(args.steps), disable=rank != 0, desc="train", unit="step")
    t0 = time.perf_counter()
    for step in bar:
        losses = []
        for m in range(accum):
            tokens = corpus.micro_batch(step, m, dp_rank, dp, micro, accum, cfg.seq_len).to(engine.device)
            loss = engine(tokens)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        bar.set_postfix(loss=f"{sum(losses) / len(losses):.4f}")
        if rank == 0 and args.log_losses:
            print(f"step {step}: loss {sum(losses) / len(losses):.6f}", flush=True)
    elapsed = time.perf_counter() - t0
    if rank == 0:
        print(
            f"\nfinal loss {sum(losses) / len(losses):.4f} after {args.steps} steps "
            f"({elapsed / args.steps:.2f} s/step), {cfg.num_parameters:,} parameters"
        )


if __name__ == "__main__":
    main()
