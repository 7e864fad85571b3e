"""Run a launcher and write each rank's gradients of the first optimizer step: the data of the
independent gradient-norm reference in tests/test_megatron_deepspeed_ted.py.

Usage (examples/megatron_deepspeed_ted.sh with ``TED_GRAD_DUMP=DIR``)::

    torchrun --nproc_per_node 8 tests/megatron_dump_grads.py DIR (-m ds_ext.run | SCRIPT) pretrain_gpt.py ARGS...

Runs the launcher after it (``python -m ds_ext.run`` for TED, tests/megatron_deepspeed_reference.py
for DeepSpeed-MoE) and, at the first ``DeepSpeedEngine._take_model_step`` (the data-parallel and
tied-weight reductions done, before clipping, ZeRO-1's partitioned norm or the step), writes
``DIR/rank<r>.pt``: ``grads``, every trainable parameter's gradient by name (at ZeRO stage 0, which
keeps them in ``param.grad``; None under ZeRO-1, which has moved them into its partitions), and
``norm``, the global gradient norm the engine reports after that step (``get_global_grad_norm``:
DeepSpeed's ZeRO-1 norm, TED's own at stage 0; None where the engine keeps none, as DeepSpeed's
stage-0 PipelineEngine).
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import torch


def main(out: Path, launcher: list[str]) -> None:
    from deepspeed.runtime.engine import DeepSpeedEngine

    take_step = DeepSpeedEngine._take_model_step
    written: list[bool] = []

    def take_step_and_dump(engine, *args, **kwargs):
        if written:
            return take_step(engine, *args, **kwargs)
        named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
        stage0 = all(p.grad is not None for _, p in named)
        grads = {n: p.grad.detach().clone() for n, p in named} if stage0 else None
        result = take_step(engine, *args, **kwargs)
        norm = engine.get_global_grad_norm()
        torch.save(
            {"grads": grads, "norm": None if norm is None else float(norm)}, out / f"rank{int(os.environ['RANK'])}.pt"
        )
        written.append(True)
        return result

    DeepSpeedEngine._take_model_step = take_step_and_dump
    if launcher[0] == "-m":
        sys.argv = launcher[1:]
        runpy.run_module(launcher[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = launcher
        sys.path.insert(0, str(Path(launcher[0]).resolve().parent))
        runpy.run_path(launcher[0], run_name="__main__")


if __name__ == "__main__":
    directory = Path(sys.argv[1])
    directory.mkdir(parents=True, exist_ok=True)
    main(directory, sys.argv[2:])
