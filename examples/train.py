"""Train a small GPT (or GPT-MoE) with DeepSpeed through ``ds_ext.initialize``.

Launch with the DeepSpeed launcher (see launch/local_cpu.sh)::

    deepspeed --num_gpus 8 examples/train.py --deepspeed_config configs/demo.json
    deepspeed --num_gpus 8 examples/train.py --deepspeed_config configs/ted_moe.json --model gpt-moe

``--model`` defaults to what the config needs: ``gpt-moe`` when its ``ds_ext.ted`` block is
enabled, else ``gpt``. ``gpt-moe`` builds ``ds_ext.models.gpt_moe.GPTMoE`` (every other block an MoE layer)
with the experts, top-k and capacity factor of the config's ``"ds_ext": {"ted": ...}`` block
and one expert group of ``expert_parallel`` ranks; ``--checkpoint`` recomputes each block
in backward (what CAC, 001 §7.3.2, optimizes).

The optimizer: a config with an ``"optimizer"`` section gets DeepSpeed's (built on the
parameters ds_ext hands over; its ``lr`` wins over ``--lr``); with ``ds_ext.pmm3d``, which
converts the model's layers first, AdamW is passed as a callable on the converted
parameters; otherwise as an AdamW instance.

The model is built from its config (random init) and reads byte-level tokens of the
Python standard library sources: nothing is downloaded. Rank 0 shows a progress bar
with the loss and, at the end, the bytes each rank sent per optimizer step on each
topology level, from ds_ext's communication ledger.
"""

from __future__ import annotations

import argparse
import time

import deepspeed
import torch
import torch.distributed as dist
from tqdm import tqdm

import ds_ext
from ds_ext import config as cfgmod
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
    p.add_argument(
        "--model",
        choices=("gpt", "gpt-moe"),
        default=None,
        help="default: gpt-moe if the config enables ds_ext.ted, else gpt",
    )
    p.add_argument(
        "--checkpoint",
        choices=("none", "torch", "torch-reentrant", "deepspeed"),
        default="none",
        help="gpt-moe: activation checkpointing of every block",
    )
    p.add_argument("--aux-loss-coef", type=float, default=0.01, help="gpt-moe: weight of the MoE load-balancing loss")
    p.add_argument("--local_rank", type=int, default=-1, help="set by the DeepSpeed launcher")
    deepspeed.add_config_arguments(p)
    return p.parse_args()


def gpt_moe(args: argparse.Namespace):
    """GPT-MoE shaped by the ds_config's ``ds_ext.ted`` block, and DeepSpeed-MoE param groups
    (ZeRO-1/2 reduce expert gradients per group)."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    from ds_ext.models.gpt_moe import GPTMoE, GPTMoEConfig

    ted = cfgmod.parse(cfgmod.load_ds_config(args.deepspeed_config).get(cfgmod.BLOCK)).ted
    layer = {"num_experts": ted.num_experts, "top_k": ted.top_k, "capacity_factor": ted.capacity_factor}
    cfg = GPTMoEConfig(
        seq_len=args.seq_len,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        ep_size=ted.expert_parallel if ted.enabled else 1,
        checkpoint=args.checkpoint,
        aux_loss_coef=args.aux_loss_coef,
        **{k: v for k, v in layer.items() if v is not None},
    )
    model = GPTMoE(cfg)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "dense", "lr": args.lr, "weight_decay": 0.0}
    )
    return cfg, model, groups


def model_kind(ds_config: dict) -> str:
    """The model a config needs when ``--model`` is not given."""
    return "gpt-moe" if cfgmod.parse(ds_config.get(cfgmod.BLOCK)).ted.enabled else "gpt"


def optimizer_for(ds_config: dict, params, lr: float):
    """What ``ds_ext.initialize`` takes as ``optimizer`` for this config (module docstring)."""
    if "optimizer" in ds_config:
        return None
    if cfgmod.parse(ds_config.get(cfgmod.BLOCK)).pmm3d.enabled:
        return lambda converted: torch.optim.AdamW(converted, lr=lr, weight_decay=0.0)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    ds_config = cfgmod.load_ds_config(args.deepspeed_config)
    args.model = args.model or model_kind(ds_config)
    if args.model == "gpt-moe":
        cfg, model, params = gpt_moe(args)
    else:
        cfg = GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads)
        model = GPT(cfg)
        params = model.parameters()
    engine, _, _, _ = ds_ext.initialize(args=args, model=model, optimizer=optimizer_for(ds_config, params, args.lr))

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

    runtime = engine.ds_ext
    if rank == 0:
        print(
            f"\nfinal loss {sum(losses) / len(losses):.4f} after {args.steps} steps "
            f"({elapsed / args.steps:.2f} s/step), {cfg.num_parameters:,} parameters, "
            f"M = {runtime.model_bytes:,} bytes"
        )
        print(runtime.report())
    engine.destroy()
    dist.destroy_process_group()  # as torch asks of every job: gloo's threads stop while Python still runs


if __name__ == "__main__":
    main()
