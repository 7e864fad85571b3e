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
the analytic model of it and ZeRO-topo's padded shard bytes, and the bytes per level from the end of
``deepspeed.initialize`` to the end of the run by the ledger and by :class:`TorchCount`.
"""

from __future__ import annotations

import atexit
import functools
import runpy
import sys
from pathlib import Path

import torch


class TorchCount:
    """An independent count of the bytes this rank sends through torch.distributed, per topology
    level, for comparison with ds_ext's ledger: every tensor collective of the ``torch.distributed``
    namespace wrapped here before DeepSpeed or ds_ext is imported (so ds_ext's own collectives,
    which call what torch.distributed held when its instrument was installed, pass through it too),
    the outermost call only (one collective may call another), groups of one rank left out. Bytes
    sent by one rank as the bandwidth-optimal ring sends them (n input bytes, d ranks): all-reduce
    2n(d-1)/d, all-gather n(d-1), reduce-scatter / reduce / broadcast n(d-1)/d, all-to-all the input
    addressed to the other ranks. Level: the outermost one the group's ranks differ in, Frontier in
    miniature as the example script lays it out (rank = node x 4 + gpu x 2 + gcd)."""

    OPS = (
        "all_reduce",
        "all_reduce_coalesced",
        "all_gather_into_tensor",
        "all_gather_single",
        "all_gather",
        "reduce_scatter_tensor",
        "reduce_scatter_single",
        "reduce_scatter",
        "reduce",
        "broadcast",
        "all_to_all_single",
        "all_to_all",
    )

    def __init__(self) -> None:
        import threading

        self.bytes: dict[str, float] = {}
        self._inside = threading.local()

    def install(self) -> None:
        import torch.distributed as dist

        for name in self.OPS:
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name, fn):
        import inspect

        names = tuple(inspect.signature(fn).parameters)

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if getattr(self._inside, "depth", 0):
                return fn(*args, **kwargs)
            self._count(name, {**dict(zip(names, args)), **kwargs})
            self._inside.depth = 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._inside.depth = 0

        return counted

    def _count(self, name: str, a: dict) -> None:
        import torch.distributed as dist

        group = a.get("group")
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        d = len(ranks)
        if d == 1:
            return

        def nb(t):
            return t.numel() * t.element_size()

        if name in ("all_reduce", "all_reduce_coalesced"):
            n = sum(nb(t) for t in a["tensors"]) if "tensors" in a else nb(a["tensor"])
            sent = 2 * n * (d - 1) / d
        elif name in ("all_gather_into_tensor", "all_gather_single"):
            sent = nb(a["input_tensor"]) * (d - 1)
        elif name == "all_gather":
            sent = nb(a["tensor"]) * (d - 1)
        elif name in ("reduce_scatter_tensor", "reduce_scatter_single"):
            sent = nb(a["input"]) * (d - 1) / d
        elif name == "reduce_scatter":
            sent = sum(nb(t) for t in a["input_list"]) * (d - 1) / d
        elif name in ("reduce", "broadcast"):
            sent = nb(a["tensor"]) * (d - 1) / d
        else:
            me = ranks.index(dist.get_rank())
            if name == "all_to_all":
                sent = sum(nb(t) for i, t in enumerate(a["input_tensor_list"]) if i != me)
            else:
                inp, split = a["input"], a.get("input_split_sizes")
                rows = inp.shape[0]
                own = split[me] if split else rows // d
                sent = nb(inp) - own * nb(inp) // rows
        level = "node" if len({r // 4 for r in ranks}) > 1 else "gpu" if len({r // 2 for r in ranks}) > 1 else "gcd"
        self.bytes[level] = self.bytes.get(level, 0.0) + sent

    def snapshot(self) -> dict[str, float]:
        return dict(self.bytes)


def _ledger_total(engine) -> dict[str, float]:
    """ds_ext's ledger since it was last reset: the closed steps and the open one, per level."""
    ledger = engine.ds_ext.ledger
    out: dict[str, float] = {}
    for traffic in [*ledger.steps, ledger.current]:
        for level, b in traffic.by_level().items():
            out[level] = out.get(level, 0.0) + b
    return out


def _since(now: dict[str, float], then: dict[str, float]) -> dict[str, float]:
    return {lv: b - then.get(lv, 0.0) for lv, b in now.items() if b - then.get(lv, 0.0)}


def _params(engine) -> dict[str, torch.Tensor]:
    runtime = getattr(engine, "ds_ext", None)
    with runtime.gathered_parameters() if runtime is not None else torch.no_grad():
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _traffic(engine) -> dict:
    runtime = getattr(engine, "ds_ext", None)
    plugin = next((p for p in runtime.plugins if hasattr(p, "analytic_traffic")), None) if runtime else None
    if plugin is None or not runtime.ledger.steps:  # no ZeRO-topo (a plugin beside DeepSpeed's ZeRO-1)
        return {}
    return {
        "measured": {ph: dict(v) for ph, v in runtime.ledger.steps[-1].by_phase().items()},
        "analytic": plugin.analytic_traffic(1).bytes,
        "padded_bytes": sum(u.U for u in plugin.sharded.all_units) * plugin.sharded.ctx.dtype.itemsize,
        "banner": runtime.banner(),
    }


def _cpu_accelerator_gaps(argv: list[str]) -> None:
    """Two gaps of DeepSpeed 0.19.6's CPU accelerator that the shrunk Frontier recipes (fp16, activation
    checkpointing on the PipelineEngine) meet on both sides, plain and ds_ext alike: ``is_fp16_supported``
    is False without oneDNN fp16 kernels (engine.py refuses the fp16 section; torch's fp16 CPU arithmetic
    is enough for the tiny model), and ``Stream`` is None where the pipeline's activation checkpoint
    (runtime/activation_checkpointing/checkpointing.py) constructs a transport stream it never uses."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        return
    if "--fp16" in argv:
        accelerator.is_fp16_supported = lambda: True
    if "--checkpoint-activations" in argv:
        type(accelerator).Stream = property(lambda self: lambda device=None: None)


if __name__ == "__main__":
    out, mode, script = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    assert mode in ("ds_ext", "plain"), mode
    out.mkdir(parents=True, exist_ok=True)
    sys.argv = sys.argv[3:]
    count = TorchCount()
    count.install()  # before DeepSpeed and ds_ext bind anything of torch.distributed
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # unused on CPU, a 1-min JIT build otherwise
    _cpu_accelerator_gaps(sys.argv)
    if mode == "ds_ext":
        import ds_ext
        from ds_ext.run import _exit_report

        ds_ext.patch_deepspeed()
        atexit.register(_exit_report)
    initialize = deepspeed.initialize
    engines, starts = [], []

    @functools.wraps(initialize)
    def initialize_and_keep(*args, **kwargs):
        result = initialize(*args, **kwargs)
        engine = result[0]
        engines.append((engine, _params(engine)))
        if hasattr(engine, "ds_ext"):  # both counts from here on
            starts.append((count.snapshot(), _ledger_total(engine)))
        return result

    deepspeed.initialize = initialize_and_keep
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")

    from megatron.core import parallel_state

    ((engine, init),) = engines
    totals = {}
    if starts:
        ((count_start, ledger_start),) = starts
        totals = {
            "ledger_total": _since(_ledger_total(engine), ledger_start),
            "torch_total": _since(count.snapshot(), count_start),
        }
    torch.save(
        {
            "tensor_rank": parallel_state.get_tensor_model_parallel_rank(),
            "data_rank": parallel_state.get_data_parallel_rank(),
            "init": init,
            "final": _params(engine),
            **_traffic(engine),
            **totals,
        },
        out / f"rank{torch.distributed.get_rank()}.pt",
    )
    torch.distributed.destroy_process_group()  # as ds_ext.run does after a clean run (pytorch#190489)
