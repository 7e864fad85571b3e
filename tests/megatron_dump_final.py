"""Runs a Megatron-DeepSpeed script and writes each rank's initial and final parameters: the
parameter side of the ZeRO-topo acceptance run (tests/test_megatron_deepspeed_zero_topo.py).

Usage (examples/megatron_deepspeed_zero_topo.sh with ``FINAL_DUMP=DIR``; the client's directory as
working directory)::

    torchrun --nproc_per_node 8 tests/megatron_dump_final.py DIR ds_ext|plain pretrain_gpt.py ARGS...

``ds_ext``: the script runs as under ``python -m ds_ext.run`` (``ds_ext.patch_deepspeed()``, the
ledger's table at exit); ``plain``: plain DeepSpeed, ds_ext never imported, as
tests/megatron_deepspeed_reference.py runs it. The client's ``--save`` refuses ZeRO-topo under
model parallelism, so the parameters are taken from the engine: when ``deepspeed.initialize``
returns (before the first step) and when the script returns (after its last iteration), each
rank's ``engine.module.named_parameters()`` (its tensor-parallel slices), inside
``engine.ds_ext.gathered_parameters()`` under ZeRO-topo (its parameters are sharded over the
data-parallel group between steps). Written to ``DIR/rank<r>.pt``: ``init`` and ``final``
parameters, the tensor and data ranks and, under ds_ext, the last step's ledger by phase and level,
the analytic model of it and ZeRO-topo's padded shard bytes.
"""

from __future__ import annotations

import atexit
import functools
import runpy
import sys
from pathlib import Path

import torch


def _params(engine) -> dict[str, torch.Tensor]:
    runtime = getattr(engine, "ds_ext", None)
    with runtime.gathered_parameters() if runtime is not None else torch.no_grad():
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _traffic(engine) -> dict:
    runtime = getattr(engine, "ds_ext", None)
    if runtime is None or not runtime.ledger.steps:
        return {}
    plugin = next(p for p in runtime.plugins if hasattr(p, "analytic_traffic"))
    return {"measured": {ph: dict(v) for ph, v in runtime.ledger.steps[-1].by_phase().items()},
            "analytic": plugin.analytic_traffic(1).bytes,
            "padded_bytes": sum(u.U for u in plugin.sharded.all_units) * plugin.sharded.ctx.dtype.itemsize,
            "banner": runtime.banner()}


if __name__ == "__main__":
    out, mode, script = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    assert mode in ("ds_ext", "plain"), mode
    out.mkdir(parents=True, exist_ok=True)
    sys.argv = sys.argv[3:]
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # unused on CPU, a 1-min JIT build otherwise
    if mode == "ds_ext":
        import ds_ext
        from ds_ext.run import _exit_report

        ds_ext.patch_deepspeed()
        atexit.register(_exit_report)
    initialize = deepspeed.initialize
    engines = []

    @functools.wraps(initialize)
    def initialize_and_keep(*args, **kwargs):
        result = initialize(*args, **kwargs)
        engines.append((result[0], _params(result[0])))
        return result

    deepspeed.initialize = initialize_and_keep
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")

    from megatron.core import parallel_state

    (engine, init), = engines
    torch.save({"tensor_rank": parallel_state.get_tensor_model_parallel_rank(),
                "data_rank": parallel_state.get_data_parallel_rank(),
                "init": init, "final": _params(engine), **_traffic(engine)},
               out / f"rank{torch.distributed.get_rank()}.pt")
    torch.distributed.destroy_process_group()  # as ds_ext.run does after a clean run (pytorch#190489)
