"""``python -m ds_ext.run``, writing each rank's initial weights: the distributed side of the
whole-expert acceptance run (tests/test_megatron_deepspeed_ted.py).

Usage (examples/megatron_deepspeed_ted.sh with ``TED_INIT_DUMP=DIR``)::

    torchrun --nproc_per_node 4 tests/megatron_dump_init.py DIR pretrain_gpt.py ARGS...

Runs SCRIPT as ``ds_ext.run`` does and, when ``deepspeed.initialize`` returns (TED bound, weights
broadcast, before the first step), writes ``DIR/rank<r>.pt``: this rank's parameters with their
tensor-parallel split dimension (-1: whole) and its tensor, expert and data ranks.
tests/megatron_serial_reference.py (``REFERENCE_INIT=DIR``) starts the serial model from them:
Megatron-DeepSpeed cannot initialize whole experts at tensor-parallel 2 on the CPU path
(examples/megatron_deepspeed_ted.sh), and its other path draws each tensor rank's shard from a
per-rank RNG, so no serial run can draw the same weights itself.
"""

from __future__ import annotations

import functools
import runpy
import sys
from pathlib import Path

import torch


def dump(engine, out: Path) -> None:
    from megatron.core import parallel_state

    ted = next(m.ted for m in engine.module.modules() if getattr(m, "ted", None) is not None)
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    split = {
        n: (p.partition_dim if getattr(p, "tensor_model_parallel", False) else -1)
        for n, p in engine.module.named_parameters()
    }
    torch.save(
        {
            "tensor_rank": parallel_state.get_tensor_model_parallel_rank(),
            "expert_rank": ted.expert_rank,
            "data_rank": ted.data_rank,
            "params": params,
            "split": split,
        },
        out / f"rank{torch.distributed.get_rank()}.pt",
    )


if __name__ == "__main__":
    import deepspeed
    import deepspeed.ops

    import ds_ext

    out, script = Path(sys.argv[1]), sys.argv[2]
    out.mkdir(parents=True, exist_ok=True)
    sys.argv = sys.argv[2:]
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    ds_ext.patch_deepspeed()
    initialize = deepspeed.initialize

    @functools.wraps(initialize)
    def initialize_and_dump(*args, **kwargs):
        result = initialize(*args, **kwargs)
        dump(result[0], out)
        return result

    deepspeed.initialize = initialize_and_dump
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")
