"""``ds-ext bench zero``: ZeRO-topo presets against DeepSpeed's own ZeRO-3 and ZeRO++.

8 CPU ranks emulate 2 nodes x 2 GPUs x 2 GCDs (003 §IV's Frontier hierarchy, shrunk; ``--nodes N``: 4N ranks);
a GPT of ~19M parameters (bf16; ``--model gpt5m``: ~4.8M, whose steps a 2-core host runs link-bound at
lower link rates in a quarter of the time) trains on byte-level stdlib text at each gradient
accumulation. Every variant runs in a fresh gloo world, side by side in one invocation:

* ``deepspeed_zero3``: DeepSpeed ZeRO-3 in the large-model regime (prefetch 0, reuse
  distance 0, persistence 0), as spec/deepspeed_traffic_measured.md;
* ``deepspeed_zeropp``: ZeRO-3 + hpZ over the node + qwZ + qgZ, with DeepSpeed's
  pure-torch quantizer patched in (``ds_zeropp_quantizer.enable_cpu_zeropp_quantizer``);
* ``ds_ext_<preset>`` for every ZeRO-topo preset (003 §III-C, §V);
* ``torch_fsdp2``: PyTorch's ``fully_shard`` per block and on the root (bf16 compute and
  reduce, fp32 shards, a reduce-scatter every micro-batch as ZeRO-3);
* ``torch_ddp``: PyTorch's DDP with bf16 autocast, fp32 gradients all-reduced at the
  accumulation boundary (its bf16 compression hook needs CUDA).

DeepSpeed's and PyTorch's collectives are counted by the same ledger as ds_ext's
(torch.distributed is wrapped), so bytes per level compare like for like. Measured steps alternate between
plain wall time and alpha-beta time emulation (Frontier latencies and bandwidths x
``--time-scale``), so both step times come from the same warm process.

``--tensor-parallel 2``: the same variants under Megatron tensor parallelism (megatron-core's
``parallel_state`` passed as ``mpu=``, the GPT's block linears megatron-core column / row parallel
layers, each tensor pair inside a GCD pair): ZeRO-topo shards over the data-parallel group and its
analytic model adds Megatron's 4 activation all-reduces per block and micro-batch;
``deepspeed_zero1`` is DeepSpeed's ZeRO-1 under the same mpu; ``deepspeed_zeropp`` runs without
hpZ (see :data:`HPZ_UNDER_TP`).

``--pipeline-parallel 2``: the GPT as a ``deepspeed.pipe.PipelineModule``
(:func:`ds_ext.models.gpt_pipe.gpt_pipeline`: embedding tied to the LM head, 2 stages x data 4, each
stage on one node as DeepSpeed's pipe-outermost rank order puts it) trained by DeepSpeed's
PipelineEngine with ``train_batch`` (1F1B over GA micro-batches): ``deepspeed_zero1`` (DeepSpeed's
ZeRO-1, the engine's own path) against ZeRO-topo's pipeline form (``ds_ext.zero_topo.pipeline``;
003 §V-A at the step boundary: weights whole, gradients reduced once per ``train_batch`` level by
level, the optimizer state sharded) and its int8 step (``ds_ext_zero_topo_int8``). The ledger's
``step`` phase is checked against the analytic model on every rank, DeepSpeed's tied-weight
all-reduce (phase ``tied_grads``) against an independent count; the floor of the data-parallel group
is stated at its outermost level (the inter-node floor is 0 where the group sits in one node). The
stages' activation send / recv (point to point) are not ledger collectives: they are not counted.
``--pipeline-parallel 1``: the same on one stage (data 8 across both nodes).

``--network netns``: no emulation; the ranks run on an emulated cluster (``ds_ext.cluster``:
2 nodes x 2 GPUs as network namespaces with tbf-shaped links), every measured step is a plain
step over those links and ``step_time_emulated_s`` is None. ``--quick``: the tiny model,
GA 1, one step each of ds_ext_zero_topo, ds_ext_zero3 and deepspeed_zero3 unless ``--variants`` says (a
plumbing check).

Timing (docs/architecture.md, Benchmarks): ``--rounds`` R runs every variant R times, round-robin, each run a fresh world
(warm-up steps, one untimed bridge step, then ``2 * --steps`` timed steps back to back: see
:func:`_measure`); ratios are medians with a 95 % interval from a bootstrap over rounds
(:func:`ds_ext.bench.stats.round_ratio_interval`), so drift between rounds widens it.
"""

from __future__ import annotations

import argparse
import functools
import gc
import time
from pathlib import Path
from typing import Any, Callable

from ds_ext.bench import mean_over_world, median, write_json
from ds_ext.bench.stats import round_ratio_interval
from ds_ext.cluster.world import add_network_arguments

LEVELS = ("gcd", "gpu", "node")
DEEPSPEED_VARIANTS = ("deepspeed_zero1", "deepspeed_zero3", "deepspeed_zeropp")
TORCH_VARIANTS = ("torch_fsdp2", "torch_ddp")
DS_EXT_PRESETS = ("zero3", "zeropp", "mics", "zero_topo_paper", "zero_topo", "zero_topo_int8")
# zero_topo with every step-boundary collective in the step, one after another (overlap_step: false)
SERIAL = "ds_ext_zero_topo_serial"
# zero_topo with the boundary overlapped but its weight all-gathers completed in the step
# (gather_across_step: false): what carrying them into the next forward buys
IN_STEP = "ds_ext_zero_topo_gather_in_step"
DEFAULT_VARIANTS = DEEPSPEED_VARIANTS + TORCH_VARIANTS + tuple(f"ds_ext_{p}" for p in DS_EXT_PRESETS)
ALL_VARIANTS = DEFAULT_VARIANTS + (SERIAL, IN_STEP)
# on DeepSpeed's PipelineEngine (ZeRO stage 0 or 1 only): ZeRO-1 and ZeRO-topo's pipeline form
PIPELINE_VARIANTS = ("deepspeed_zero1", "ds_ext_zero_topo", "ds_ext_zero_topo_int8")
MODELS = {  # name -> (d_model, n_layers, n_heads, seq_len)
    "gpt20m": (512, 6, 8, 128),
    "gpt5m": (256, 6, 4, 128),
    "tiny": (64, 2, 4, 32),
}
RANKS_PER_NODE = 4  # ranks of an emulated node (2 GPUs x 2 GCDs); --nodes of them (default 2)
HPZ_UNDER_TP = (
    "hpZ off: DeepSpeed 0.19.8 builds the hpZ group from consecutive world ranks "
    "(utils/groups.py _create_zero_param_parallel_group ignores the mpu), so under tensor "
    "parallelism it would all-gather secondary shards of different tensor ranks' parameters"
)
# the fair baseline: DeepSpeed's and torch's reduce-scatters on gloo send each chunk to its
# owner as ds_ext's own do, not gloo's all-reduce of the whole input (ds_ext.comm.instrument)
FAIR_GLOO_REDUCE_SCATTER = "all_to_all"
# DeepSpeed's counterpart of a ds_ext preset, for the "same inter-node bytes" check
DEEPSPEED_TWIN = {"ds_ext_zero3": "deepspeed_zero3", "ds_ext_zeropp": "deepspeed_zeropp"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="JSON file to write (a PNG is written next to it)")
    p.add_argument("--grad-accum", type=int, nargs="+", default=[1, 8], metavar="GA")
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=ALL_VARIANTS)
    p.add_argument("--model", choices=sorted(MODELS), default="gpt20m")
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="tokens per sequence (default: the model's); fewer tokens cut the compute per step and "
        "leave the bytes per step as they are (the parameters set those), so a slow host's run can "
        "be bound by the links",
    )
    p.add_argument("--warmup", type=int, default=1, help="optimizer steps before measuring")
    p.add_argument("--steps", type=int, default=3, help="measured steps per timing mode (per round)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="interleave the variants: each round runs every variant once (--warmup, then --steps), "
        "in a fresh world, the order rotated by one variant per round; a variant's step times are "
        "all its rounds' (a reviewer's run: --rounds 5 --steps 1 or more)",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=100.0,
        help="multiply emulated link times (latency and bytes/bandwidth) by this factor: one CPU "
        "core computes ~1000x slower than a GCD, so unscaled link times vanish in the noise",
    )
    p.add_argument("--timeout", type=float, default=3600, help="seconds per variant before giving up")
    p.add_argument("--quick", action="store_true", help="tiny model, GA 1, 3 variants, 1 step")
    p.add_argument(
        "--tensor-parallel",
        type=int,
        choices=(1, 2),
        default=1,
        help="Megatron tensor-parallel degree (megatron-core's parallel_state as the mpu)",
    )
    p.add_argument(
        "--pipeline-parallel",
        type=int,
        choices=(0, 1, 2),
        default=0,
        help="0: the plain GPT; N: the GPT as a deepspeed.pipe.PipelineModule of N stages on "
        f"DeepSpeed's PipelineEngine (variants {', '.join(PIPELINE_VARIANTS)})",
    )
    add_network_arguments(p)


# ---- one rank ---------------------------------------------------------------------------
def _unit_elements(net: Any) -> int:
    """Parameters of the model's largest gather unit, as ZeRO-topo's ``units: 'auto'`` finds them
    (a transformer block)."""
    from ds_ext.zero_topo.sharded_model import find_units

    return max(sum(p.numel() for p in m.parameters()) for _, m in find_units(net, "auto"))


def _ds_config(
    variant: str,
    grad_accum: int,
    time_scale: float | None,
    tensor: int = 1,
    pipeline: int = 0,
    unit_elements: int = 0,
) -> dict[str, Any]:
    """The variant's ds_config; ``time_scale`` None: no alpha-beta emulation (a real network);
    ``unit_elements``: what DeepSpeed ZeRO-3 prefetches (:func:`deepspeed_zero3`)."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "steps_per_print": 1_000_000,
        "ds_ext": {
            "topology": {"preset": "frontier", "sizes": {"gpu": 2}, "emulate": True},
            "comm": {"ledger": True, "emulate_time": time_scale is not None, "time_scale": time_scale or 1.0},
        },
    }
    if pipeline:  # DeepSpeed's tied-weight all-reduce is counted for every variant
        cfg["ds_ext"]["comm"]["count_torch_collectives"] = True
        cfg["zero_allow_untested_optimizer"] = True  # torch's AdamW under DeepSpeed's ZeRO-1
    if variant in TORCH_VARIANTS:
        cfg["ds_ext"]["comm"]["count_torch_collectives"] = True
    elif variant == "deepspeed_zero1":
        cfg["zero_optimization"] = {"stage": 1, "reduce_bucket_size": 10_000_000}
        cfg["ds_ext"]["comm"]["count_torch_collectives"] = True
    elif variant in DEEPSPEED_VARIANTS:
        zero = deepspeed_zero3(unit_elements)
        if variant == "deepspeed_zeropp":
            zero.update(
                zero_hpz_partition_size=RANKS_PER_NODE if tensor == 1 else 1,
                zero_quantized_weights=True,
                zero_quantized_gradients=True,
            )
        cfg["zero_optimization"] = zero
        cfg["ds_ext"]["comm"]["count_torch_collectives"] = True
    else:
        cfg["zero_optimization"] = {"stage": 0}
        if variant == SERIAL:
            cfg["ds_ext"]["zero_topo"] = {"enabled": True, "preset": "zero_topo", "overlap_step": False}
        elif variant == IN_STEP:
            cfg["ds_ext"]["zero_topo"] = {"enabled": True, "preset": "zero_topo", "gather_across_step": False}
        else:
            cfg["ds_ext"]["zero_topo"] = {"enabled": True, "preset": variant.removeprefix("ds_ext_")}
    if cfg["ds_ext"]["comm"].get("count_torch_collectives"):  # DeepSpeed's / torch's on gloo as ds_ext's own
        cfg["ds_ext"]["comm"]["torch_gloo_reduce_scatter"] = FAIR_GLOO_REDUCE_SCATTER
    return cfg


def deepspeed_zero3(unit_elements: int) -> dict[str, Any]:
    """DeepSpeed ZeRO-3's settings in the bench, on ds_ext's terms: every parameter sharded
    (persistence threshold 0) and released after its use, so re-gathered for backward (reuse
    distance 0), as ds_ext's units are; the next ``unit_elements`` parameters prefetched, as
    ds_ext's ``prefetch`` gathers the next unit while one computes."""
    return {
        "stage": 3,
        "reduce_bucket_size": 10_000_000,
        "stage3_param_persistence_threshold": 0,
        "stage3_prefetch_bucket_size": unit_elements,
        "stage3_max_reuse_distance": 0,
    }


class _TorchEngine:
    """PyTorch's own data parallelism behind the calls the loop makes of a DeepSpeed engine
    (``engine(x)``, ``backward``, ``step``), with a ds_ext runtime whose ledger counts its
    torch.distributed calls per phase and topology level."""

    def __init__(self, variant: str, net, grad_accum: int, ds_config: dict[str, Any]) -> None:
        import torch
        from torch.nn.parallel import DistributedDataParallel

        from ds_ext import config as cfgmod
        from ds_ext.comm import instrument
        from ds_ext.runtime import Runtime

        self.ds_ext = Runtime.create(cfgmod.parse(ds_config["ds_ext"]))
        instrument.install(self.ds_ext.comm, ds_config["ds_ext"]["comm"]["torch_gloo_reduce_scatter"])
        self.fsdp = variant == "torch_fsdp2"
        if self.fsdp:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
            for block in net.blocks:
                fully_shard(block, mp_policy=policy)
            self.module = fully_shard(net, mp_policy=policy)
        else:  # torch's bf16 compression hook needs CUDA/XPU: fp32 gradients, all-reduced as DDP does
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            self.module = DistributedDataParallel(net)
            # DDP's default reduction, through Python's torch.distributed (so the ledger sees it)
            self.module.register_comm_hook(None, allreduce_hook)
        self.optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.0)
        self.grad_accum, self.micro, self.global_steps = grad_accum, 0, 0

    def __call__(self, tokens):
        import torch

        with self.ds_ext.ledger.phase("forward"):
            if self.fsdp:
                return self.module(tokens)
            self.module.require_backward_grad_sync = self.micro == self.grad_accum - 1
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.module(tokens)

    def backward(self, loss) -> None:
        with self.ds_ext.ledger.phase("backward"):
            (loss / self.grad_accum).backward()

    def step(self) -> None:
        import torch

        self.micro += 1
        if self.micro < self.grad_accum:
            return
        with self.ds_ext.ledger.phase("step"):
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), 1.0)
            self.optimizer.step()
            self.optimizer.zero_grad()
        self.micro, self.global_steps = 0, self.global_steps + 1
        self.ds_ext.ledger.mark_step()


def _tensor_parallel_gpt(cfg, tensor: int) -> tuple[Any, Any]:
    """The GPT at ``tensor``-parallel degree and the mpu over the tensor and data groups of
    megatron-core's ``parallel_state`` (initialized here; megatron-core 0.16 no longer has the
    ``get_model_parallel_*`` names DeepSpeed calls); (the plain GPT, None) at degree 1."""
    import torch.distributed as dist

    from ds_ext.bench import megatron_tensor_parallel
    from ds_ext.models import GPT
    from ds_ext.mpu import MegatronMPU, ParallelGroup

    if tensor == 1:
        return GPT(cfg), None
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor)

    def side(group) -> ParallelGroup:
        return ParallelGroup(
            group, dist.get_world_size(group), dist.get_rank(group), tuple(dist.get_process_group_ranks(group))
        )

    mpu = MegatronMPU(
        side(parallel_state.get_tensor_model_parallel_group()), side(parallel_state.get_data_parallel_group())
    )
    return megatron_tensor_parallel(GPT(cfg), tensor), mpu


def _tensor_parallel_traffic(cfg, grad_accum: int, tensor: int, micro: int) -> tuple[float, int]:
    """(bytes, calls) per rank per step of Megatron's activation all-reduces over the tensor group:
    per block and micro-batch, forward after proj and fc2, backward before qkv and fc1, each of
    micro x seq x d bf16 values (ring all-reduce: 2 (T - 1) / T of them sent)."""
    from ds_ext.comm.ledger import all_reduce_bytes

    if tensor == 1:
        return 0.0, 0
    calls = 4 * cfg.n_layers * grad_accum
    return calls * all_reduce_bytes(micro * cfg.seq_len * cfg.d_model * 2, tensor), calls


def _tied_traffic(engine, topology) -> tuple[dict[str, float], dict[str, int]]:
    """Bytes per level per step of DeepSpeed's ``ReduceTiedGrads`` (runtime/pipe/engine.py), counted
    from the tied weights alone: one all-reduce of each tied weight's gradient over the stages
    holding it (fp32 ``_hp_grad`` under DeepSpeed's bf16 optimizer, else the weight's dtype)."""
    import torch.distributed as dist

    from ds_ext.comm.ledger import all_reduce_bytes

    out: dict[str, float] = {}
    calls: dict[str, int] = {}
    for weight, group in engine.module.get_tied_weights_and_groups():
        ranks = dist.get_process_group_ranks(group)
        if len(ranks) > 1:
            e = 4 if engine.using_bf16_optimizer else weight.element_size()
            level = topology.level_of(ranks)
            out[level] = out.get(level, 0.0) + all_reduce_bytes(weight.numel() * e, len(ranks))
            calls[level] = calls.get(level, 0) + 1
    return out, calls


def data_group_floor(topology, data_ranks: list[int], model_bytes: float) -> dict[str, Any]:
    """003's floor of one exact 16-bit gradient synchronisation, 2 (M / P)(N - 1) / N, at the outermost
    level the data-parallel group ``data_ranks`` spans (N of its domains there, P of the group's ranks
    in each); ``inter_node``: that floor across nodes (0 where the group sits in one node)."""
    group = topology.of_group(data_ranks, "data")
    outer = group.levels[-1]
    n, p = outer.size, len(data_ranks) // outer.size
    floor = 2 * (model_bytes / p) * (n - 1) / n if len(data_ranks) > 1 else 0.0
    return {
        "level": outer.name if n > 1 else None,
        "domains": n,
        "ranks_per_domain": p,
        "bytes": floor,
        "inter_node": floor if outer.name == topology.levels[-1].name and n > 1 else 0.0,
    }


def _pipeline_gpt(cfg, pipeline: int) -> Any:
    """The GPT as a PipelineModule of ``pipeline`` stages (after ``deepspeed.init_distributed``)."""
    from ds_ext.integration import ds_engine
    from ds_ext.models.gpt_pipe import gpt_pipeline

    ds_engine.init_distributed()
    return gpt_pipeline(cfg, num_stages=pipeline)


def _rel_err(measured: dict[str, float], model: dict[str, float]) -> float:
    return max(
        (
            abs(measured.get(lv, 0.0) - model.get(lv, 0.0)) / max(model.get(lv, 0.0), 1.0)
            for lv in set(measured) | set(model)
        ),
        default=0.0,
    )


def _measure(
    variant: str,
    grad_accums: list[int],
    model: str,
    warmup: int,
    steps: int,
    time_scale: float | None,
    tensor: int = 1,
    pipeline: int = 0,
    seq_len: int | None = None,
) -> list[dict[str, Any]]:
    """Runs on every rank: train ``warmup + 1 + 2 * steps`` steps per grad_accum and time the last
    ``2 * steps`` back to back (sequences of ``seq_len`` tokens, default the model's)."""
    import torch
    import torch.distributed as dist

    import ds_ext
    from ds_ext.data import ByteCorpus
    from ds_ext.integration import ds_zero3_state, ds_zeropp_quantizer
    from ds_ext.models import GPTConfig

    if variant == "deepspeed_zeropp":
        ds_zeropp_quantizer.enable_cpu_zeropp_quantizer()
    d, layers, heads, seq = MODELS[model]
    seq = seq_len or seq
    corpus = ByteCorpus()
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for ga in grad_accums:
        torch.manual_seed(1234)
        cfg = GPTConfig(seq_len=seq, d_model=d, n_layers=layers, n_heads=heads)
        net, mpu = (_pipeline_gpt(cfg, pipeline), None) if pipeline else _tensor_parallel_gpt(cfg, tensor)
        grid = net.mpu() if pipeline else mpu
        data_rank, data_world = (
            (rank, world) if grid is None else (grid.get_data_parallel_rank(), grid.get_data_parallel_world_size())
        )
        data_ranks = (
            list(range(world)) if grid is None else sorted(dist.get_process_group_ranks(grid.get_data_parallel_group()))
        )
        rank_bytes = sum(p.numel() for p in net.parameters()) * 2  # bf16; this rank's share under TP
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.0)
        if variant in TORCH_VARIANTS:
            engine = _TorchEngine(variant, net, ga, _ds_config(variant, ga, time_scale))
        else:
            engine, *_ = ds_ext.initialize(
                model=net,
                optimizer=opt,
                mpu=mpu,
                config=_ds_config(
                    variant,
                    ga,
                    time_scale,
                    tensor,
                    pipeline,
                    _unit_elements(net) if variant in DEEPSPEED_VARIANTS and variant != "deepspeed_zero1" else 0,
                ),
            )
        rt = engine.ds_ext
        emulator = rt.comm.emulator
        times: dict[bool, list[float]] = {False: [], True: []}
        busy: dict[str, Any] = {}
        losses, state = [], {}
        wire = _WireWindow(time_scale is None)
        quantizer_s, clock = [], _quantizer_clock()
        # The timed steps run back to back: step k's time runs from the barrier that ends step k - 1
        # to the one that ends step k, so nothing a variant leaves in flight past its step
        # (ZeRO-topo's gather_across_step) progresses in an untimed gap. Before them, the warm-up's
        # collectives still in flight are completed (Runtime.settle), the wire window opens, and one
        # bridge step runs untimed: the first timed step then waits for a step's carried work, as
        # every later one does. After them, settle again: the window holds 2 * steps + 1 steps.
        bridge = warmup
        for step in range(warmup + 1 + 2 * steps):
            measured = step - bridge - 1  # the timed steps' index, < 0 before them
            emulate = emulator is not None and measured >= 0 and measured % 2 == 1
            rt.comm.emulator = emulator if emulate else None
            if step == bridge:
                rt.settle()
                dist.barrier()
                wire.open()
                dist.barrier()
                t0, q0 = time.perf_counter(), clock()
            elif step < bridge:
                dist.barrier()
                t0, q0 = time.perf_counter(), clock()
            if measured == 2 * steps - 1:  # the last timed step: its spans, for level_busy
                rt.ledger.trace = []
            step_losses = []
            if pipeline:  # one train_batch: GA micro-batches through the 1F1B schedule, then the step
                batch = [corpus.micro_batch(step, m, data_rank, data_world, 2, ga, seq) for m in range(ga)]
                step_losses = [float(engine.train_batch(iter([(t[:, :-1], t[:, 1:]) for t in batch])))] * ga
            for micro in range(0 if pipeline else ga):
                tokens = corpus.micro_batch(step, micro, data_rank, data_world, 2, ga, seq)
                loss = engine(tokens)
                engine.backward(loss)
                if micro == ga - 1 and variant in DEEPSPEED_VARIANTS and variant != "deepspeed_zero1":
                    state = ds_zero3_state.deepspeed_zero3_state_bytes(engine)  # secondary still held
                engine.step()
                step_losses.append(loss.item())
            dist.barrier()
            t1, q1 = time.perf_counter(), clock()
            if rt.ledger.trace is not None:
                busy, rt.ledger.trace = level_busy(rt.ledger.trace, t0, t1), None
            if measured >= 0:
                times[emulate].append(t1 - t0)
                if not emulate:
                    quantizer_s.append(q1 - q0)
            t0, q0 = t1, q1
            losses.append(sum(step_losses) / ga)
        rt.settle()
        rt.comm.emulator = emulator
        led = rt.ledger
        wire_bytes = wire.close(2 * steps + 1, led.mean_by_level(warmup), led.mean_link_bytes_by_level(warmup))
        floor = data_group_floor(rt.topology, data_ranks, rank_bytes)
        record: dict[str, Any] = {
            "variant": variant,
            "grad_accum": ga,
            "tensor_parallel": tensor,
            "pipeline_parallel": pipeline,
            "model_parameters": cfg.num_parameters,
            "model_bytes": rank_bytes,
            "nodes": len({r // RANKS_PER_NODE for r in data_ranks}),  # the data-parallel group's
            "ranks_per_node": len(data_ranks) // len({r // RANKS_PER_NODE for r in data_ranks}),
            "data_parallel_floor": floor,
            "bytes_per_step": led.mean_by_level(warmup),
            "calls_per_step": led.mean_calls_by_level(warmup),
            "bytes_per_step_by_phase": led.mean_by_phase(warmup),
            "analytic_bytes_per_step": None,
            "analytic_calls_per_step": None,
            "step_time_s": median(times[False]),
            "step_times_s": times[False],
            # seconds in the quantizer per measured plain step (mean over ranks)
            "quantizer_s_per_step": mean_over_world(quantizer_s),
            "wire_bytes_per_step": wire_bytes,
            "level_busy_last_step": busy,
            "step_time_emulated_s": median(times[True]) if times[True] else None,
            "time_scale": time_scale,
            "losses": losses,
            "loss": losses[-1],
            "peak_state_bytes": state,
            "analytic_state_bytes": None,
        }
        if pipeline:
            tied, tied_calls = _tied_traffic(engine, rt.topology)
            by_phase = led.mean_by_phase(warmup)
            record.update(
                stage=grid.get_stage_id(),
                data_ranks=data_ranks,
                expected_tied_grads_bytes=tied,
                tied_grads_vs_expected_rel_err=_rel_err(by_phase.get("tied_grads", {}), tied),
            )
        if variant.startswith("ds_ext_") and pipeline:
            plugin = rt.plugins[0]
            model_traffic = plugin.analytic_traffic(ga)
            step_model = model_traffic.bytes.get("step", {})
            record.update(
                analytic_bytes_per_step={lv: step_model.get(lv, 0.0) + tied.get(lv, 0.0) for lv in LEVELS},
                analytic_calls_per_step={
                    lv: model_traffic.calls_by_level().get(lv, 0) + tied_calls.get(lv, 0) for lv in LEVELS
                },
                analytic_bytes_per_step_by_phase={"step": step_model, "tied_grads": tied},
                step_vs_model_rel_err=_rel_err(by_phase.get("step", {}), step_model),
                plan=plugin.describe(),
                peak_state_bytes=plugin.state_bytes(),
                analytic_state_bytes=plugin.analytic_memory(),
            )
        elif variant.startswith("ds_ext_"):
            plugin = rt.plugins[0]
            model_traffic = plugin.analytic_traffic(ga)
            tp_bytes, tp_calls = _tensor_parallel_traffic(cfg, ga, tensor, 2)
            record.update(
                analytic_bytes_per_step={
                    lv: model_traffic.by_level().get(lv, 0.0) + (tp_bytes if lv == "gcd" else 0) for lv in LEVELS
                },
                analytic_calls_per_step={
                    lv: model_traffic.calls_by_level().get(lv, 0) + (tp_calls if lv == "gcd" else 0) for lv in LEVELS
                },
                peak_state_bytes=plugin.state_bytes(),
                analytic_state_bytes=plugin.analytic_memory(),
            )
        out.append(record)
        if mpu is not None:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        if pipeline:
            engine.destroy()
        del engine, opt, net
        gc.collect()
    return out


_QUANTIZER_SECONDS = [0.0]


def _quantizer_clock() -> Callable[[], float]:
    """Seconds this process has spent in a quantizer so far: ds_ext's ``BlockQuantizer``
    (quantize / dequantize) and DeepSpeed ZeRO++'s CPU quantizer (quantize, dequantize,
    swizzle_quant, quantized_reduction; ``ds_zeropp_quantizer.deepspeed_cpu_quantizer``),
    their methods wrapped once per worker process; a call inside another counts once."""
    from ds_ext.comm.quant import BlockQuantizer
    from ds_ext.integration import ds_zeropp_quantizer

    depth = [0]

    def timed(fn):
        @functools.wraps(fn)
        def call(*a, **kw):
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    _QUANTIZER_SECONDS[0] += time.perf_counter() - t0

        call._ds_ext_timed = True  # type: ignore[attr-defined]
        return call

    deepspeed = ds_zeropp_quantizer.deepspeed_cpu_quantizer()
    for cls, names, static in (
        (BlockQuantizer, ("quantize", "dequantize"), False),
        (deepspeed, ("quantize", "dequantize", "dequantize_fp32", "swizzle_quant", "quantized_reduction"), True),
    ):
        for name in names:
            fn = getattr(cls, name)
            if not getattr(fn, "_ds_ext_timed", False):
                setattr(cls, name, staticmethod(timed(fn)) if static else timed(fn))
    return lambda: _QUANTIZER_SECONDS[0]


class _WireWindow:
    """On the shaped network (``active``): the kernel's bytes on every link over the measured
    steps (``ds_ext.cluster.wire``), per step, beside the ledger's bytes of all ranks (rank 0's
    record; None elsewhere and when emulating)."""

    def __init__(self, active: bool) -> None:
        self.active, self.region, self._ctx = active, None, None

    def open(self) -> None:
        if self.active:
            from ds_ext.cluster.wire import wire_region

            self._ctx = wire_region()
            self.region = self._ctx.__enter__()

    def close(
        self, measured: int, ledger_by_level: dict[str, float], links_by_level: dict[str, float]
    ) -> dict[str, Any] | None:
        """Collective: the wire per step beside the ledger's bytes per step summed over ranks: its
        volume (``ledger``, at each group's outermost level) and its link bytes (``links``, at the
        level of the link each byte crosses: ``ds_ext.comm.hops``)."""
        if self._ctx is None:
            return None
        import torch.distributed as dist

        self._ctx.__exit__(None, None, None)
        ranks: list[tuple[dict[str, float], dict[str, float]]] = [({}, {})] * dist.get_world_size()
        dist.all_gather_object(ranks, (ledger_by_level, links_by_level))
        if self.region.bytes is None:
            return None

        def summed(which: int) -> dict[str, float]:
            levels = {lv for r in ranks for lv in r[which]}
            return {lv: sum(r[which].get(lv, 0.0) for r in ranks) for lv in levels}

        total, links = summed(0), summed(1)
        per_step = self.region.bytes.beside_ledger({lv: b * measured for lv, b in total.items()})
        for lv, row in per_step["levels"].items():
            row["links"] = links.get(lv, 0.0) * measured
        for row in (*per_step["levels"].values(), per_step["total"]):
            for key in ("ledger", "links", "wire_up", "wire_down", "wire_sent"):
                if key in row:
                    row[key] /= measured
        return per_step


# ---- driver -----------------------------------------------------------------------------
STAGE_FIELDS = (
    "stage",
    "model_bytes",
    "data_ranks",
    "data_parallel_floor",
    "bytes_per_step",
    "calls_per_step",
    "bytes_per_step_by_phase",
    "analytic_bytes_per_step",
    "analytic_bytes_per_step_by_phase",
)


def level_busy(trace: list[tuple[tuple[str, str, str], float, float]], t0: float, t1: float) -> dict[str, Any]:
    """Where one step of ``t1 - t0`` seconds waited on which level: per level, the union of the
    ledger's spans (``Ledger.trace``: from a collective's call until its wait returns) inside the
    step (``busy_s``), the first call and the last return (``first_s`` / ``last_s``, from the step's
    start; a span open at the start counts from 0), and the spans."""
    by_level: dict[str, list[tuple[float, float]]] = {}
    for (_, _, level), start, end in trace:
        lo, hi = max(start, t0), min(end, t1)
        if hi > lo:
            by_level.setdefault(level, []).append((lo - t0, hi - t0))
    out: dict[str, Any] = {"step_s": t1 - t0, "levels": {}}
    for level, spans in sorted(by_level.items()):
        spans.sort()
        busy, reach = 0.0, 0.0
        for lo, hi in spans:
            busy += max(0.0, hi - max(lo, reach))
            reach = max(reach, hi)
        out["levels"][level] = {
            "busy_s": busy,
            "first_s": spans[0][0],
            "last_s": max(hi for _, hi in spans),
            "spans": len(spans),
        }
    return out


def _merge_ranks(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rank 0's record with the loss averaged over ranks (traffic is symmetric over the data-parallel
    group) and every rank's :func:`level_busy` of its last timed step (``level_busy_by_rank``);
    under a PipelineEngine also the first rank of every stage (``stages``) and the largest
    ledger-vs-model errors over all ranks."""
    merged = []
    for i, rec in enumerate(per_rank[0]):
        rec = dict(rec)
        rec["level_busy_by_rank"] = [r[i].pop("level_busy_last_step") for r in per_rank]
        del rec["level_busy_last_step"]
        rec["losses"] = [sum(r[i]["losses"][k] for r in per_rank) / len(per_rank) for k in range(len(rec["losses"]))]
        rec["loss"] = rec["losses"][-1]
        if rec.get("pipeline_parallel"):
            firsts = {}
            for r in per_rank:
                firsts.setdefault(r[i]["stage"], r[i])
            rec["stages"] = [{k: firsts[s].get(k) for k in STAGE_FIELDS} for s in sorted(firsts)]
            for key in ("step_vs_model_rel_err", "tied_grads_vs_expected_rel_err"):
                if key in rec:
                    rec[key] = max(r[i][key] for r in per_rank)
        merged.append(rec)
    return merged


def merge_rounds(per_round: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per (variant, GA) from its rounds (``--rounds``): the first round's bytes, model
    and ``level_busy_by_rank`` (the bytes are the same every round: the ledger is deterministic), every round's step times in round
    order (``step_times_s``; ``step_time_s`` their median), per round too (``step_times_by_round``),
    with the quantizer seconds, the losses and the emulated step time (median) of each round."""
    merged: dict[tuple[str, int], dict[str, Any]] = {}
    for rec in per_round:
        key = (rec["variant"], rec["grad_accum"])
        if key not in merged:
            merged[key] = {
                **rec,
                "step_times_by_round": [],
                "quantizer_s_by_round": [],
                "losses_by_round": [],
                "step_time_emulated_by_round": [],
            }
            del merged[key]["round"]
        m = merged[key]
        m["step_times_by_round"].append(rec["step_times_s"])
        m["quantizer_s_by_round"].append(rec["quantizer_s_per_step"])
        m["losses_by_round"].append(rec["losses"])
        if rec["step_time_emulated_s"] is not None:
            m["step_time_emulated_by_round"].append(rec["step_time_emulated_s"])
    for m in merged.values():
        m["step_times_s"] = [t for times in m["step_times_by_round"] for t in times]
        m["step_time_s"] = median(m["step_times_s"])
        m["quantizer_s_per_step"] = [q for qs in m["quantizer_s_by_round"] for q in qs]
        if m["step_time_emulated_by_round"]:
            m["step_time_emulated_s"] = median(m["step_time_emulated_by_round"])
    return list(merged.values())


def checks(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The acceptance numbers, computed from the records."""
    by = {(r["variant"], r["grad_accum"]): r for r in records}
    out: dict[str, Any] = {
        "model_vs_measured_max_rel_err": {},
        "inter_node_vs_deepspeed": {},
        "zero_topo_vs_floor": {},
        "step_time_ratio_emulated": {},
        "step_time_ratio": {},
        # the ratio of median step times with its 95 % interval, bootstrapped over rounds (ds_ext.bench.stats)
        "step_time_ratio_interval": {},
        "inter_node_x_M": {},
        # DeepSpeed ZeRO++'s steps less the seconds in its pure-torch CPU quantizer (a CUDA kernel on a GPU)
        "step_time_ratio_interval_without_deepspeed_quantizer": {},
        # the bytes the NICs sent per step (the kernel's counters, --network netns), and ours / zeropp's
        "nic_bytes_per_step": {},
        "nic_bytes_vs_zeropp": {},
        "goal": {},
    }
    for (v, ga), r in by.items():
        if r["analytic_bytes_per_step"] is not None:
            measured = r["bytes_per_step"]
            if r.get("pipeline_parallel"):  # the modelled phases (not DeepSpeed's loss reporting, phase "other")
                phases = [r["bytes_per_step_by_phase"].get(ph, {}) for ph in ("step", "tied_grads")]
                measured = {lv: sum(ph.get(lv, 0.0) for ph in phases) for lv in LEVELS}
            errs = [
                abs(measured[lv] - r["analytic_bytes_per_step"][lv]) / max(r["analytic_bytes_per_step"][lv], 1.0)
                for lv in LEVELS
            ]
            out["model_vs_measured_max_rel_err"][f"{v}@GA{ga}"] = max(errs)
        twin = DEEPSPEED_TWIN.get(v)
        if twin and (twin, ga) in by:
            out["inter_node_vs_deepspeed"][f"{v}@GA{ga}"] = (
                r["bytes_per_step"]["node"] / by[twin, ga]["bytes_per_step"]["node"]
            )
        out["inter_node_x_M"][f"{v}@GA{ga}"] = r["bytes_per_step"]["node"] / r["model_bytes"]
        floor = r["data_parallel_floor"]["inter_node"]  # one exact 16-bit gradient synchronisation
        if v in ("ds_ext_zero_topo", "ds_ext_zero_topo_int8") and floor > 0:
            out["zero_topo_vs_floor"][f"{v}@GA{ga}"] = r["bytes_per_step"]["node"] / floor
        if v == "ds_ext_zero3" and ("torch_fsdp2", ga) in by:
            for key, field in (
                ("step_time_ratio", "step_time_s"),
                ("step_time_ratio_emulated", "step_time_emulated_s"),
            ):
                if r[field] is not None:
                    out[key][f"ds_ext_zero3/torch_fsdp2@GA{ga}"] = r[field] / by["torch_fsdp2", ga][field]
        for ours in ("ds_ext_zero_topo", "ds_ext_zero_topo_paper", "ds_ext_zero_topo_int8"):
            for theirs in DEEPSPEED_VARIANTS + ("ds_ext_zeropp", "ds_ext_zero3", SERIAL, IN_STEP):
                # the schedule variants are the 16-bit preset's: paired with it alone
                schedule_of_another = theirs in (SERIAL, IN_STEP) and ours != "ds_ext_zero_topo"
                if v == ours and (theirs, ga) in by and not schedule_of_another:
                    key = f"{theirs}/{ours}@GA{ga}"
                    if r["step_time_emulated_s"] is not None:
                        out["step_time_ratio_emulated"][key] = (
                            by[theirs, ga]["step_time_emulated_s"] / r["step_time_emulated_s"]
                        )
                    out["step_time_ratio"][key] = by[theirs, ga]["step_time_s"] / r["step_time_s"]
                    out["step_time_ratio_interval"][key] = round_ratio_interval(
                        _by_round(by[theirs, ga], by[theirs, ga]["step_times_s"]),
                        _by_round(r, r["step_times_s"]),
                    )
                    if theirs == "deepspeed_zeropp" and by[theirs, ga]["quantizer_s_per_step"] is not None:
                        out["step_time_ratio_interval_without_deepspeed_quantizer"][key] = round_ratio_interval(
                            _by_round(by[theirs, ga], steps_without_quantizer(by[theirs, ga])),
                            _by_round(r, r["step_times_s"]),
                        )
        nic = nic_bytes(r)
        if nic is not None:
            out["nic_bytes_per_step"][f"{v}@GA{ga}"] = nic
            if v in ("ds_ext_zero_topo", "ds_ext_zero_topo_int8") and ("ds_ext_zeropp", ga) in by:
                out["nic_bytes_vs_zeropp"][f"{v}@GA{ga}"] = nic / nic_bytes(by["ds_ext_zeropp", ga])
    out["goal"] = goal(out)
    if any(r.get("pipeline_parallel") for r in records):
        out["pipeline"] = pipeline_checks(records)
    return out


GOAL_RATIO, GOAL_LOWER_BOUND = 1.3, 1.2  # ratio of medians, lower 95 % bound


def _by_round(record: dict[str, Any], steps: list[float]) -> list[list[float]]:
    """``steps`` (one value per step of ``record``, in round order) split into its rounds."""
    sizes = [len(r) for r in record.get("step_times_by_round") or [record["step_times_s"]]]
    cuts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    return [steps[lo:hi] for lo, hi in zip(cuts, cuts[1:])]


def steps_without_quantizer(record: dict[str, Any]) -> list[float]:
    """A record's plain step times less the seconds each spent in a quantizer (mean over ranks)."""
    return [t - q for t, q in zip(record["step_times_s"], record["quantizer_s_per_step"])]


def nic_bytes(record: dict[str, Any]) -> float | None:
    """Bytes all NICs sent per measured step (the node links' kernel counters; None unless the
    run was on the shaped cluster)."""
    wire = record.get("wire_bytes_per_step")
    if not wire or "node" not in wire["levels"]:
        return None
    return wire["levels"]["node"]["wire_up"]


def goal(checked: dict[str, Any]) -> dict[str, Any]:
    """The goal from the checks: each ZeRO-topo preset's ratio over ds_ext ``zeropp`` and
    DeepSpeed ZeRO++ (fair: without its CPU quantizer's seconds) at least :data:`GOAL_RATIO` with
    the lower bound above :data:`GOAL_LOWER_BOUND`, and NIC bytes at most ``zeropp``'s."""
    out: dict[str, Any] = {}
    for key, iv in checked["step_time_ratio_interval"].items():
        theirs, rest = key.split("/", 1)
        if theirs not in ("ds_ext_zeropp", "deepspeed_zeropp"):
            continue
        if theirs == "deepspeed_zeropp":
            iv = checked["step_time_ratio_interval_without_deepspeed_quantizer"].get(key, iv)
        out[key] = {
            "ratio": iv["ratio"],
            "lo": iv["lo"],
            "met": iv["ratio"] >= GOAL_RATIO and iv["lo"] > GOAL_LOWER_BOUND,
        }
    for key, share in checked["nic_bytes_vs_zeropp"].items():
        out[f"nic_bytes/{key}"] = {"vs_zeropp": share, "met": share <= 1.0}
    return out


def pipeline_checks(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The numbers on the PipelineEngine: the ``step`` phase against the analytic model and
    DeepSpeed's tied-weight all-reduce against its own count (largest error over all ranks), and each
    variant's step-phase bytes at the data-parallel group's outermost level against its floor there
    (per stage: the first rank of each)."""
    out: dict[str, Any] = {
        "step_vs_model_max_rel_err": {},
        "tied_grads_vs_expected_max_rel_err": {},
        "data_parallel_floor": {},
        "step_vs_floor": {},
        "step_bytes_vs_deepspeed_zero1": {},
    }
    zero1 = {r["grad_accum"]: r for r in records if r["variant"] == "deepspeed_zero1"}
    for r in records:
        key = f"{r['variant']}@GA{r['grad_accum']}"
        if "step_vs_model_rel_err" in r:
            out["step_vs_model_max_rel_err"][key] = r["step_vs_model_rel_err"]
        out["tied_grads_vs_expected_max_rel_err"][key] = r["tied_grads_vs_expected_rel_err"]
        for st in r["stages"]:
            floor = st["data_parallel_floor"]
            out["data_parallel_floor"][f"stage{st['stage']}"] = floor
            step = st["bytes_per_step_by_phase"].get("step", {})
            if floor["bytes"]:
                out["step_vs_floor"][f"{key}/stage{st['stage']}"] = step.get(floor["level"], 0.0) / floor["bytes"]
        base = zero1.get(r["grad_accum"])
        if base is not None and r is not base:
            mine, theirs = r["bytes_per_step_by_phase"].get("step", {}), base["bytes_per_step_by_phase"].get("step", {})
            out["step_bytes_vs_deepspeed_zero1"][key] = {
                lv: mine.get(lv, 0.0) / theirs[lv] for lv in LEVELS if theirs.get(lv)
            }
    return out


def table(records: list[dict[str, Any]]) -> str:
    head = (
        f"{'variant':<24}{'GA':>3}{'gcd xM':>9}{'gpu xM':>9}{'node xM':>9}{'model node':>11}"
        f"{'calls':>7}{'step s':>8}{'emul s':>8}{'NIC MB':>8}{'loss':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in records:
        m = r["model_bytes"]
        b = r["bytes_per_step"]
        model = r["analytic_bytes_per_step"]
        lines.append(
            f"{r['variant']:<24}{r['grad_accum']:>3}{b['gcd'] / m:>9.3f}{b['gpu'] / m:>9.3f}{b['node'] / m:>9.3f}"
            f"{(model['node'] / m if model else float('nan')):>11.3f}{sum(r['calls_per_step'].values()):>7.0f}"
            f"{r['step_time_s']:>8.2f}{r['step_time_emulated_s'] or float('nan'):>8.2f}"
            f"{(nic_bytes(r) or float('nan')) / 1e6:>8.1f}{r['loss']:>8.3f}"
        )
    lines.append(
        "bytes sent per rank per optimizer step in units of M = model bytes (bf16), booked at each group's "
        "outermost level (003's volume convention); 'emul s' with alpha-beta time emulation; 'NIC MB' what all "
        "NICs sent per step (the kernel's counters, --network netns)"
    )
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], path: Path) -> None:
    from ds_ext import plotting

    gas = sorted({r["grad_accum"] for r in records})
    fig = plotting.figure(figsize=(6 * len(gas), 4.5))
    axes = fig.subplots(1, len(gas), squeeze=False)
    for ax, ga in zip(axes[0], gas):
        rows = [r for r in records if r["grad_accum"] == ga]
        bottom = [0.0] * len(rows)
        for lv in LEVELS:
            vals = [r["bytes_per_step"][lv] / r["model_bytes"] for r in rows]
            ax.bar(range(len(rows)), vals, bottom=bottom, label=lv)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(
            range(len(rows)),
            [r["variant"].replace("deepspeed_", "DS ").replace("ds_ext_", "") for r in rows],
            rotation=35,
            ha="right",
        )
        ax.set_ylabel("bytes per rank per step (x model bytes)")
        ax.set_title(f"grad accumulation {ga}")
        ax.legend(title="level")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from ds_ext.cluster.world import bench_world

    if args.seq_len is not None and args.seq_len < 2:
        raise SystemExit(
            f"ds-ext bench zero: --seq-len must be at least 2 (a token and its successor); got {args.seq_len}"
        )
    if args.pipeline_parallel:
        if args.tensor_parallel > 1:
            raise SystemExit(
                "ds-ext bench zero: --pipeline-parallel with --tensor-parallel 2 is not supported; allowed: one of them"
            )
        if args.variants == list(DEFAULT_VARIANTS):
            args.variants = list(PIPELINE_VARIANTS)
        other = [v for v in args.variants if v not in PIPELINE_VARIANTS]
        if other:
            raise SystemExit(
                f"ds-ext bench zero: {', '.join(other)} cannot run on DeepSpeed's PipelineEngine "
                f"(ZeRO stage 0 or 1 only); allowed with --pipeline-parallel: {', '.join(PIPELINE_VARIANTS)}"
            )
    if args.quick:
        args.model, args.grad_accum, args.warmup, args.steps = "tiny", [1], 1, 1
        if args.variants == list(DEFAULT_VARIANTS):
            args.variants = ["ds_ext_zero_topo", "ds_ext_zero3", "deepspeed_zero3"]
    if args.rounds < 1:
        raise SystemExit(f"ds-ext bench zero: --rounds must be at least 1; got {args.rounds}")
    if args.nodes < 2 or (args.nodes != 2 and (args.tensor_parallel > 1 or args.pipeline_parallel)):
        raise SystemExit(
            f"ds-ext bench zero: --nodes {args.nodes}: allowed 2 or more, and 2 with --tensor-parallel or "
            "--pipeline-parallel (their groups are laid out for 2 nodes)"
        )
    world = args.nodes * RANKS_PER_NODE
    time_scale = None if args.network == "netns" else args.time_scale
    from ds_ext.bench.stats import load_average, provenance, utc_now
    from ds_ext.cluster.world import bench_cluster_spec

    prov = provenance(
        world_size=world,
        ranks_per_node=RANKS_PER_NODE,
        model=args.model,
        seq_len=args.seq_len or MODELS[args.model][3],
        grad_accum=args.grad_accum,
        warmup=args.warmup,
        steps_per_round=args.steps,
        rounds=args.rounds,
        network=args.network,
        cluster=bench_cluster_spec(args, world, args.nodes).to_json() if args.network == "netns" else None,
        time_scale=time_scale,
        # DeepSpeed's and torch's reduce-scatters on gloo (comm.torch_gloo_reduce_scatter)
        peers_gloo_reduce_scatter=FAIR_GLOO_REDUCE_SCATTER,
        peers_deepspeed_zero3=deepspeed_zero3(0) | {"stage3_prefetch_bucket_size": "one unit (a block's parameters)"},
    )
    per_round: list[dict[str, Any]] = []
    variants = list(args.variants)
    runs = [(r, variants[(r + i) % len(variants)]) for r in range(args.rounds) for i in range(len(variants))]
    for round_, variant in tqdm(runs, desc="bench zero", unit="run"):
        with bench_world(args, world, {"LOCAL_SIZE": str(RANKS_PER_NODE)}, args.nodes) as ranks:
            per_rank = ranks.run(
                _measure,
                variant,
                args.grad_accum,
                args.model,
                args.warmup,
                args.steps,
                time_scale,
                args.tensor_parallel,
                args.pipeline_parallel,
                args.seq_len,
            )
        per_round.extend({**rec, "round": round_} for rec in _merge_ranks(per_rank))
    prov["host"]["load_average_after"] = load_average()
    prov["finished"] = utc_now()
    records = merge_rounds(per_round)
    records.sort(key=lambda r: (r["grad_accum"], ALL_VARIANTS.index(r["variant"])))
    import os

    import torch

    payload = {
        "benchmark": "zero",
        "provenance": prov,
        # the ranks' compute depends on it (bf16 matmuls without AVX-512 / AMX run far slower)
        "host": {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpus": os.cpu_count()},
        "world_size": world,
        "model": args.model,
        "seq_len": args.seq_len or MODELS[args.model][3],
        "network": args.network,
        "quick": args.quick,
        "tensor_parallel": args.tensor_parallel,
        "pipeline_parallel": args.pipeline_parallel,
        "records": records,
        "checks": checks(records),
    }
    if args.tensor_parallel > 1 and "deepspeed_zeropp" in args.variants:
        payload["deepspeed_zeropp"] = HPZ_UNDER_TP
    out = write_json(args.out, payload)
    plot(records, out.with_suffix(".png"))
    print(table(records))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return payload
