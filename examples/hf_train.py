"""Train a tiny Hugging Face ``GPTNeoXForCausalLM`` or ``LlamaForCausalLM`` with ds_ext.

The model is built from a config with random weights (nothing is downloaded) and trained
on byte tokens of the Python standard library with ZeRO-topo (units = the decoder-layer
class, ``configs/hf_zero_topo.json``) and the tiled optimizer::

    deepspeed --num_gpus 8 examples/hf_train.py --model llama --deepspeed_config configs/hf_zero_topo.json

The Hugging Face model is used unchanged: ``engine(input_ids=x, labels=x).loss``.
"""

from __future__ import annotations

import argparse

import deepspeed
import torch
import torch.distributed as dist

import ds_ext
from ds_ext.data import ByteCorpus
from ds_ext.models.hf import tiny_causal_lm


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("gpt-neox", "llama"), default="llama")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--local_rank", type=int, default=-1, help="set by the DeepSpeed launcher")
    deepspeed.add_config_arguments(p)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    model = tiny_causal_lm(args.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    engine, *_ = ds_ext.initialize(args=args, model=model, optimizer=optimizer)
    rank, world = dist.get_rank(), dist.get_world_size()
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    corpus = ByteCorpus()
    for step in range(args.steps):
        losses = []
        for m in range(accum):
            x = corpus.micro_batch(step, m, rank, world, micro, accum, args.seq_len).to(engine.device)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        if rank == 0:
            print(f"step {step}: loss {sum(losses) / len(losses):.6f}", flush=True)
    if rank == 0:
        print(engine.ds_ext.report())
    engine.destroy()
    dist.destroy_process_group()  # as torch asks of every job: gloo's threads stop while Python still runs


if __name__ == "__main__":
    main()
