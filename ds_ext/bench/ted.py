"""``ds-ext bench ted``: TED MoE (001 ch. 7) against DeepSpeed-MoE on the same model and data.

8 CPU ranks emulate 2 nodes x 2 GPUs x 2 GCDs (Frontier's hierarchy, shrunk); a GPT-MoE
(every other block an MoE layer of 4 experts, top-1, capacity factor 1.25, every block
activation-checkpointed, bf16, ZeRO-1, same initialization and byte-level data) trains in
one gloo world per variant, side by side in one invocation:

* ``deepspeed_ep``: DeepSpeed's ``deepspeed.moe.layer.MoE``, expert parallel only
  (G_expert = 4, G_data^exp = 2, no tensor parallelism);
* ``deepspeed_ep_tp``: DeepSpeed's MoE with expert tensor parallelism (G_tensor = 2 through a
  Megatron mpu, experts column/row-parallel), which drops duplicate tokens around both
  all-to-alls itself; on gloo its ``moe/mappings.py:_gather_tokens`` fails on an input-shape
  quirk (N-d input, flat output), so this variant runs inside
  :func:`ds_ext.integration.ds_moe.flat_gather_tokens`, which hands that all-gather the same
  input flattened (the bench's only change to DeepSpeed);
* ``ted_base``, ``ted_dtd``, ``ted_dtd_cac``: TEDMoE, G_tensor = 2, G_expert = 4, with
  duplicate token dropping (001 §7.3.1) and communication-aware checkpointing (§7.3.2)
  switched on one after the other; ``ted_dtd_cac_lean``: CAC with ``cac_stash: lean`` (the
  all-to-all outputs that only feed DTD's all-gathers are not stashed).

Per variant: bytes and calls per topology level per optimizer step (the ledger counts
DeepSpeed's collectives too), bytes and calls of one MoE block's forward + backward
(+ recompute) by op and level, which must equal ``ds_ext.perf.ted`` exactly for the TED
variants, and the bytes CAC stashes for that block's recompute (0 without CAC); the alpha-beta link time of a step's collectives at Frontier's latencies and
bandwidths (summed by the time emulator from bytes, calls and levels: no CPU noise), and the
wall time per step with and without that time (x ``--time-scale``) held (measured steps
alternate); this rank's parameter, gradient and optimizer bytes and Eq 7.4's value.

Per measured step (``steps``, max over ranks of the step's wall time): the seconds each rank
spent inside each collective op (the ledger's timed spans around TED's and DeepSpeed's
collectives, ``ds_ext.comm.ledger``; measured, not modelled), kept per rank with their max and
median over ranks, so that 001 ch. 7's measure, all-to-all time as a share of the step, and
DTD's and CAC's effect on each op's time can be recomputed from the JSON.

``--network netns``: no emulation; the ranks run on an emulated cluster (``ds_ext.cluster``:
2 nodes x 2 GPUs as network namespaces with tbf-shaped links), every measured step is plain
wall time over those links, the emulated and link times are None. ``--quick``: the tiny
model, ted_base / ted_dtd_cac / deepspeed_ep / deepspeed_ep_tp, one step each (a plumbing check).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time
from pathlib import Path
from typing import Any

from ds_ext.bench import median, write_json
from ds_ext.cluster.world import add_network_arguments

WORLD, RANKS_PER_NODE = 8, 4
LEVELS = ("gcd", "gpu", "node")
TOPOLOGY = {"preset": "frontier", "sizes": {"gpu": 2}, "emulate": True}
VARIANTS = {  # name -> (moe implementation, G_tensor, DTD, CAC, lean CAC stash)
    "deepspeed_ep": ("deepspeed", 1, False, False, False),
    "deepspeed_ep_tp": ("deepspeed", 2, False, False, False),
    "ted_base": ("ted", 2, False, False, False),
    "ted_dtd": ("ted", 2, True, False, False),
    "ted_dtd_cac": ("ted", 2, True, True, False),
    "ted_dtd_cac_lean": ("ted", 2, True, True, True),
}
EXPERTS, EXPERT_PARALLEL = 4, 4
MODELS = {  # name -> (d_model, n_layers, n_heads, seq_len, micro-batch)
    "moe6m": (256, 4, 8, 128, 8),
    "tiny": (32, 2, 4, 16, 2),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="JSON file to write (a PNG is written next to it)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--model", choices=sorted(MODELS), default="moe6m")
    p.add_argument("--warmup", type=int, default=2, help="optimizer steps before measuring")
    p.add_argument("--steps", type=int, default=4, help="measured steps per timing mode")
    p.add_argument(
        "--time-scale",
        type=float,
        default=300.0,
        help="multiply emulated link times by this factor (a CPU core computes ~1000x slower than a GCD)",
    )
    p.add_argument("--timeout", type=float, default=3600, help="seconds per variant before giving up")
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny model, ted_base / ted_dtd_cac / deepspeed_ep / deepspeed_ep_tp, 1 step",
    )
    add_network_arguments(p)


# ---- one rank ---------------------------------------------------------------------------
def _model_config(model: str):
    from ds_ext.models.gpt_moe import GPTMoEConfig

    d, layers, heads, seq, _ = MODELS[model]
    return GPTMoEConfig(
        seq_len=seq,
        d_model=d,
        n_layers=layers,
        n_heads=heads,
        num_experts=EXPERTS,
        top_k=1,
        capacity_factor=1.25,
        min_capacity=0,
        checkpoint="torch",
    )


def _ds_config(variant: str, micro: int, time_scale: float | None) -> dict[str, Any]:
    impl, T, dtd, cac, lean = VARIANTS[variant]
    block: dict[str, Any] = {
        "topology": TOPOLOGY,
        "comm": {"ledger": True, "emulate_time": time_scale is not None, "time_scale": time_scale or 1.0},
    }
    if impl == "ted":
        block["ted"] = {
            "enabled": True,
            "tensor_parallel": T,
            "expert_parallel": EXPERT_PARALLEL,
            "duplicate_token_dropping": dtd,
            "comm_aware_checkpointing": cac,
            "cac_stash": "lean" if lean else "full",
        }
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**6,
        "ds_ext": block,
    }


def _deepspeed_tp_model(cfg, state, layout):
    """DeepSpeed's MoE with Megatron-style expert tensor parallelism: ds_ext's tensor-parallel
    attention / MLP / experts bound to a TED context (DeepSpeed gets its mpu). Returns the model,
    the mpu and the context's communicator, whose ledger and time emulator :func:`_build` makes
    the engine's, so its tensor-parallel all-reduces are counted and timed like TED's."""
    import torch.distributed as dist
    from deepspeed.moe.layer import MoE
    from torch import nn

    from ds_ext import config as cfgmod
    from ds_ext.models.gpt_moe import GPTMoE
    from ds_ext.moe import ColumnParallelLinear, RowParallelLinear, TEDContext
    from ds_ext.moe.reference import local_expert_state
    from ds_ext.runtime import Runtime

    model = GPTMoE(dataclasses.replace(cfg, moe_impl="deepspeed", ep_size=EXPERT_PARALLEL))
    d, f = cfg.d_model, cfg.ffn_mult * cfg.d_model
    for block in model.blocks:
        if block.moe:
            expert = nn.Sequential(ColumnParallelLinear(d, f), nn.GELU(), RowParallelLinear(f, d))
            block.ffn = MoE(
                d,
                expert,
                num_experts=cfg.num_experts,
                ep_size=EXPERT_PARALLEL,
                k=cfg.top_k,
                capacity_factor=cfg.capacity_factor,
                min_capacity=cfg.min_capacity,
                enable_expert_tensor_parallelism=True,
            )
    model.load_state_dict(
        local_expert_state(state, layout.coords(dist.get_rank())["expert"], cfg.num_experts // EXPERT_PARALLEL)
    )
    runtime = Runtime.create(cfgmod.parse({"topology": TOPOLOGY}))
    ted = TEDContext.create(layout, runtime.comm, dtd=False, cac=False)
    for i, m in enumerate(m for m in model.modules() if hasattr(m, "ted_bind")):
        m.ted_bind(ted, i)
    return model, ted.mpu(), runtime.comm


def _build(variant: str, cfg, micro: int, time_scale: float | None):
    """(engine, layout, data rank, communicators whose ledger and emulator are the engine's) of
    one variant; the same initialization for all."""
    import torch
    import torch.distributed as dist
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    import ds_ext
    from ds_ext.models.gpt_moe import GPTMoE
    from ds_ext.moe.reference import local_expert_state
    from ds_ext.parallel import TEDLayout

    impl, T = VARIANTS[variant][:2]
    torch.manual_seed(1234)
    state = GPTMoE(cfg).state_dict()
    layout = TEDLayout.build(dist.get_world_size(), T, EXPERT_PARALLEL)
    mpu, side = None, []
    if impl == "deepspeed" and T > 1:
        model, mpu, comm = _deepspeed_tp_model(cfg, state, layout)
        side.append(comm)
    else:
        model = GPTMoE(dataclasses.replace(cfg, moe_impl=impl, ep_size=EXPERT_PARALLEL))
        model.load_state_dict(
            local_expert_state(state, layout.coords(dist.get_rank())["expert"], cfg.num_experts // EXPERT_PARALLEL)
        )
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "dense", "lr": 1e-3, "weight_decay": 0.0}
    )
    engine, *_ = ds_ext.initialize(
        model=model,
        optimizer=torch.optim.AdamW(groups, lr=1e-3),
        config=_ds_config(variant, micro, time_scale),
        mpu=mpu,
    )
    for comm in side:
        comm.ledger, comm.emulator = engine.ds_ext.comm.ledger, engine.ds_ext.comm.emulator
    d = layout.coords(dist.get_rank())
    return engine, layout, d["expert"] + EXPERT_PARALLEL * d["expert_data"], [engine.ds_ext.comm, *side]


def _state_bytes(engine, layout) -> dict[str, Any]:
    """16-bit parameter and gradient bytes, optimizer bytes (fp32 partitions + Adam m, v),
    and Eq 7.4 for this rank's expert / non-expert parameter counts."""
    import torch
    from deepspeed.moe.utils import is_moe_param

    from ds_ext.perf.ted import eq_7_4

    params = list(engine.module.parameters())
    n_exp = sum(p.numel() for p in params if is_moe_param(p))
    zero = engine.optimizer
    optim = sum(t.numel() * t.element_size() for t in zero.single_partition_of_fp32_groups) + sum(
        v.numel() * v.element_size()
        for s in zero.optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.dim() > 0
    )
    model = eq_7_4(sum(p.numel() for p in params) - n_exp, n_exp, layout)
    pbytes = sum(p.numel() * p.element_size() for p in params)
    return {
        "params": pbytes,
        "grads": pbytes,
        "optimizer": optim,
        "eq_7_4": {"params": model.params, "grads": model.grads, "optimizer": model.optimizer},
    }


def _moe_block(engine, cfg, tokens) -> tuple[dict[str, Any], int]:
    """Ledger of one checkpointed MoE block's forward + backward on this micro-batch, and the
    bytes CAC stashed between its forward and its recompute (its layers' tapes)."""
    import torch

    from ds_ext.models.gpt_moe import _checkpointed

    net = engine.module
    block = next(b for b in net.blocks if b.moe)
    ledger = engine.ds_ext.ledger
    with torch.no_grad():
        x = (net.embed(tokens[:, :-1]) + net.pos.weight[: cfg.seq_len]).detach()
    x.requires_grad_(True)
    ledger.reset()
    with ledger.phase("forward"):
        y, l_aux = _checkpointed(block, x, cfg.checkpoint)
    stash = sum(m.ted_tape.stash_bytes() for m in block.modules() if hasattr(m, "ted_tape"))
    with ledger.phase("backward"):
        (y.float().sum() + l_aux).backward()
    engine.zero_grad()
    traffic = ledger.current
    ledger.reset()
    return (
        {
            "bytes": {f"{ph}/{op}/{lv}": b for (ph, op, lv), b in traffic.bytes.items()},
            "calls": {f"{ph}/{op}/{lv}": c for (ph, op, lv), c in traffic.calls.items()},
        },
        stash,
    )


def _moe_block_model(variant: str, cfg, micro: int, layout, topology) -> dict[str, Any]:
    from ds_ext.perf.ted import MoEBlockShape, moe_block_traffic

    _, _, dtd, cac, _ = VARIANTS[variant]
    tokens = micro * cfg.seq_len
    capacity = -(-tokens * cfg.top_k * cfg.capacity_factor // cfg.num_experts)
    shape = MoEBlockShape(tokens, cfg.d_model, cfg.num_experts, int(capacity), element_bytes=2)
    traffic = moe_block_traffic(layout, topology, 0, shape, dtd=dtd, cac=cac, checkpointing=True)
    return {
        "bytes": {f"{ph}/{op}/{lv}": b for (ph, op, lv), b in traffic.bytes.items()},
        "calls": {f"{ph}/{op}/{lv}": c for (ph, op, lv), c in traffic.calls.items()},
    }


def _collective_seconds(step) -> dict[str, dict[str, float]]:
    """This rank's measured seconds inside collectives in one ledger step, by op and by op/level."""
    by_level: dict[str, float] = {}
    for (_, op, lv), t in step.seconds.items():
        by_level[f"{op}/{lv}"] = by_level.get(f"{op}/{lv}", 0.0) + t
    return {"collective_s": step.seconds_by_op(), "collective_s_by_level": by_level}


class _LinkClock:
    """Wraps the time emulator and sums the link time it charges: the alpha-beta cost of a
    step's collectives from their bytes, calls and levels alone (no CPU noise)."""

    def __init__(self, emulator) -> None:
        self.emulator = emulator
        self.total = 0.0

    def cost(self, op: str, level: str | None, nbytes: float, d: int) -> float:
        c = self.emulator.cost(op, level, nbytes, d)
        self.total += c
        return c


def _measure(variant: str, model: str, warmup: int, steps: int, time_scale: float | None) -> dict[str, Any]:
    """Runs on every rank: build, train ``warmup + 2 steps`` steps, measure (DeepSpeed's expert
    tensor parallelism inside its gloo shim, module docstring)."""
    import contextlib

    from ds_ext.integration.ds_moe import flat_gather_tokens

    impl, T = VARIANTS[variant][:2]
    with flat_gather_tokens() if impl == "deepspeed" and T > 1 else contextlib.nullcontext():
        return _train_and_measure(variant, model, warmup, steps, time_scale)


def _train_and_measure(variant: str, model: str, warmup: int, steps: int, time_scale: float | None) -> dict[str, Any]:
    """Build, train ``warmup + 2 steps`` steps, measure. ``time_scale`` None (a real network,
    ``--network netns``): every step plain, no emulated or link time."""
    import torch.distributed as dist

    from ds_ext.data import ByteCorpus

    cfg, micro = _model_config(model), MODELS[model][4]
    corpus = ByteCorpus()
    engine, layout, data_rank, comms = _build(variant, cfg, micro, time_scale)
    rt = engine.ds_ext
    clock = _LinkClock(rt.comm.emulator) if rt.comm.emulator is not None else None
    times: dict[bool, list[float]] = {False: [], True: []}
    link: list[float] = []
    losses = []
    steps_record: list[dict[str, Any]] = []
    try:
        for step in range(warmup + 2 * steps):
            emulate = clock is not None and step >= warmup and (step - warmup) % 2 == 1
            for comm in comms:
                comm.emulator = clock if emulate else None
            if clock is not None:
                clock.total = 0.0
            dist.barrier()
            t0 = time.perf_counter()
            loss = engine(corpus.micro_batch(step, 0, data_rank, layout.nonexp_data, micro, 1, cfg.seq_len))
            engine.backward(loss)
            engine.step()
            dist.barrier()
            if step >= warmup:
                elapsed = time.perf_counter() - t0
                times[emulate].append(elapsed)
                steps_record.append(
                    {"step_s": elapsed, "emulated": emulate, **_collective_seconds(rt.ledger.steps[-1])}
                )
                if emulate:
                    link.append(clock.total / time_scale)
            losses.append(loss.item())
    except RuntimeError as err:
        engine.destroy()
        return {"variant": variant, "error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
    for comm in comms:
        comm.emulator = None
    per_step = {
        "bytes_per_step": {lv: rt.ledger.mean_by_level(warmup).get(lv, 0.0) for lv in LEVELS},
        "calls_per_step": {lv: rt.ledger.mean_calls_by_level(warmup).get(lv, 0.0) for lv in LEVELS},
    }
    block, stash = _moe_block(
        engine, cfg, corpus.micro_batch(10**6, 0, data_rank, layout.nonexp_data, micro, 1, cfg.seq_len)
    )
    record = {
        "variant": variant,
        "error": None,
        "layout": {"tensor": layout.tensor, "expert": layout.expert, "expert_data": layout.expert_data},
        "tokens_per_rank": micro * cfg.seq_len,
        **per_step,  # measured before _moe_block, which resets the ledger
        "step_time_s": median(times[False]),
        "steps": steps_record,
        "step_time_emulated_s": median(times[True]) if times[True] else None,
        "link_time_per_step_s": median(link) if link else None,
        "time_scale": time_scale,
        "losses": losses,
        "state_bytes": _state_bytes(engine, layout),
        "moe_block": block,
        "cac_stash_bytes_per_block": stash,
        "moe_block_model": (
            _moe_block_model(variant, cfg, micro, layout, rt.topology) if VARIANTS[variant][0] == "ted" else None
        ),
    }
    engine.destroy()
    gc.collect()
    return record


# ---- driver -----------------------------------------------------------------------------
def _merge_ranks(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's record, the loss averaged over ranks, times the max over ranks; per measured
    step its wall time (max over ranks) and the collective seconds of each op (and op/level)
    per rank (in rank order) with their max and median."""
    rec = dict(per_rank[0])
    if rec["error"] is None:
        rec["losses"] = [sum(r["losses"][k] for r in per_rank) / len(per_rank) for k in range(len(rec["losses"]))]
        for key in ("step_time_s", "step_time_emulated_s", "link_time_per_step_s"):
            if rec[key] is not None:
                rec[key] = max(r[key] for r in per_rank)
        rec["steps"] = [
            {
                "step_s": max(r["steps"][k]["step_s"] for r in per_rank),
                "emulated": first["emulated"],
                **{what: _over_ranks([r["steps"][k][what] for r in per_rank]) for what in _TIMED_KEYS},
            }
            for k, first in enumerate(per_rank[0]["steps"])
        ]
    return rec


_TIMED_KEYS = ("collective_s", "collective_s_by_level")


def _over_ranks(per_rank: list[dict[str, float]]) -> dict[str, dict[str, Any]]:
    """{key: seconds} of every rank -> {key: {max, median, ranks (rank order, 0 where none)}}."""
    keys = sorted({k for r in per_rank for k in r})
    out = {}
    for k in keys:
        v = [r.get(k, 0.0) for r in per_rank]
        out[k] = {"max": max(v), "median": median(v), "ranks": v}
    return out


TIMED_OPS = ("all_to_all", "all_gather", "all_reduce")


def collective_times(record: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Medians over a record's plain (not emulated) measured steps of each op's collective
    seconds (max and median over ranks) and of its share of the step (the median rank's
    seconds over the step's wall time, 001 ch. 7's measure); ``step_s`` the median step."""
    plain = [s for s in record["steps"] if not s["emulated"]]
    out: dict[str, dict[str, float]] = {"step_s": {"median": median([s["step_s"] for s in plain])}}
    for op in TIMED_OPS:
        cell = [s["collective_s"].get(op, {"max": 0.0, "median": 0.0}) for s in plain]
        out[op] = {
            "max_s": median([c["max"] for c in cell]),
            "median_s": median([c["median"] for c in cell]),
            "share_of_step": median([c["median"] / s["step_s"] for c, s in zip(cell, plain)]),
        }
    return out


def _per_op(block: dict[str, Any], what: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, v in block[what].items():
        op = key.split("/")[1]
        out[op] = out.get(op, 0) + v
    return out


def checks(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Ledger == model per MoE block; DTD / CAC ratios; TED vs DeepSpeed step times."""
    by = {r["variant"]: r for r in records if r["error"] is None}
    out: dict[str, Any] = {
        "moe_block_ledger_equals_model": {},
        "moe_block_calls": {},
        "a2a_bytes_dtd_over_base": None,
        "a2a_bytes_over_ted_base": {},
        "cac_stash_bytes_per_block": {},
        "cac_stash_lean_over_full": None,
        "link_time_ratio": {},
        "step_time_emulated_ratio": {},
        "step_time_ratio": {},
        "collective_times": {v: collective_times(r) for v, r in by.items()},
        "collective_time_ted_base_over": {},
    }
    for v, r in by.items():
        out["moe_block_calls"][v] = _per_op(r["moe_block"], "calls")
        out["cac_stash_bytes_per_block"][v] = r["cac_stash_bytes_per_block"]
        if "ted_base" in by:
            out["a2a_bytes_over_ted_base"][v] = (
                _per_op(r["moe_block"], "bytes")["all_to_all"]
                / _per_op(by["ted_base"]["moe_block"], "bytes")["all_to_all"]
            )
        if r["moe_block_model"] is not None:
            out["moe_block_ledger_equals_model"][v] = r["moe_block"] == r["moe_block_model"]
    if "ted_base" in by and "ted_dtd" in by:
        out["a2a_bytes_dtd_over_base"] = (
            _per_op(by["ted_dtd"]["moe_block"], "bytes")["all_to_all"]
            / _per_op(by["ted_base"]["moe_block"], "bytes")["all_to_all"]
        )
    if "ted_dtd_cac" in by and "ted_dtd_cac_lean" in by:
        out["cac_stash_lean_over_full"] = (
            by["ted_dtd_cac_lean"]["cac_stash_bytes_per_block"] / by["ted_dtd_cac"]["cac_stash_bytes_per_block"]
        )
    for v in by:
        if v != "ted_base" and "ted_base" in by:
            if by[v]["link_time_per_step_s"] is not None:
                out["link_time_ratio"][f"ted_base/{v}"] = (
                    by["ted_base"]["link_time_per_step_s"] / by[v]["link_time_per_step_s"]
                )
                out["step_time_emulated_ratio"][f"ted_base/{v}"] = (
                    by["ted_base"]["step_time_emulated_s"] / by[v]["step_time_emulated_s"]
                )
            out["step_time_ratio"][f"ted_base/{v}"] = by["ted_base"]["step_time_s"] / by[v]["step_time_s"]
            base, other = out["collective_times"]["ted_base"], out["collective_times"][v]
            out["collective_time_ted_base_over"][v] = {
                op: base[op]["median_s"] / other[op]["median_s"] if other[op]["median_s"] else None for op in TIMED_OPS
            }
    return out


def table(records: list[dict[str, Any]]) -> str:
    head = (
        f"{'variant':<17}{'gcd MB':>8}{'gpu MB':>8}{'node MB':>8}{'a2a':>5}{'AR':>5}{'AG':>5}{'a2a MB':>8}"
        f"{'stash MB':>9}{'link ms':>9}{'step s':>8}{'a2a s':>7}{'AG s':>7}{'AR s':>7}{'emul s':>8}"
        f"{'state MB':>10}{'loss':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in records:
        if r["error"] is not None:
            lines.append(f"{r['variant']:<17}fails: {r['error'][:100]}")
            continue
        b = r["bytes_per_step"]
        calls, nbytes = _per_op(r["moe_block"], "calls"), _per_op(r["moe_block"], "bytes")
        state = r["state_bytes"]
        timed = collective_times(r)
        lines.append(
            f"{r['variant']:<17}{b['gcd'] / 1e6:>8.2f}{b['gpu'] / 1e6:>8.2f}{b['node'] / 1e6:>8.2f}"
            f"{calls.get('all_to_all', 0):>5.0f}{calls.get('all_reduce', 0):>5.0f}{calls.get('all_gather', 0):>5.0f}"
            f"{nbytes.get('all_to_all', 0) / 1e6:>8.3f}{r['cac_stash_bytes_per_block'] / 1e6:>9.3f}"
            f"{(r['link_time_per_step_s'] or float('nan')) * 1e3:>9.2f}"
            f"{r['step_time_s']:>8.2f}"
            + "".join(f"{timed[op]['median_s']:>7.2f}" for op in TIMED_OPS)
            + f"{r['step_time_emulated_s'] or float('nan'):>8.2f}"
            f"{(state['params'] + state['grads'] + state['optimizer']) / 1e6:>10.2f}{r['losses'][-1]:>7.3f}"
        )
    lines.append(
        "MB per rank per optimizer step by level; a2a / AR / AG calls and a2a MB of one checkpointed MoE "
        "block (forward + backward + recompute); 'stash MB': what CAC keeps of that block's forward collectives for its recompute; 'link ms': alpha-beta link time of a step's collectives "
        "at Frontier's latencies and bandwidths; 'a2a s' / 'AG s' / 'AR s': measured seconds inside those "
        "collectives per step (median rank, median of the steps without emulation); 'emul s': wall time with that "
        "link time x time_scale held"
    )
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], path: Path) -> None:
    from ds_ext import plotting

    rows = [r for r in records if r["error"] is None]
    fig = plotting.figure(figsize=(17, 4.5))
    ax1, ax2, ax3 = fig.subplots(1, 3)
    bottom = [0.0] * len(rows)
    for lv in LEVELS:
        vals = [r["bytes_per_step"][lv] / 1e6 for r in rows]
        ax1.bar(range(len(rows)), vals, bottom=bottom, label=lv)
        bottom = [b + v for b, v in zip(bottom, vals)]
    names = [r["variant"] for r in rows]
    ax1.set_xticks(range(len(rows)), names, rotation=30, ha="right")
    ax1.set_ylabel("MB per rank per optimizer step")
    ax1.legend(title="level")
    network = rows and rows[0]["link_time_per_step_s"] is None
    key = "step_time_s" if network else "link_time_per_step_s"
    ax2.bar(range(len(rows)), [r[key] * 1e3 for r in rows])
    ax2.set_xticks(range(len(rows)), names, rotation=30, ha="right")
    ax2.set_ylabel(
        "step time on the shaped network (ms)" if network else "alpha-beta link time per step on Frontier (ms)"
    )
    timed = [collective_times(r) for r in rows]
    bottom = [0.0] * len(rows)
    for op in TIMED_OPS:
        vals = [t[op]["median_s"] for t in timed]
        ax3.bar(range(len(rows)), vals, bottom=bottom, label=op)
        bottom = [b + v for b, v in zip(bottom, vals)]
    rest = [max(t["step_s"]["median"] - b, 0.0) for t, b in zip(timed, bottom)]
    ax3.bar(range(len(rows)), rest, bottom=bottom, label="rest of the step", color="lightgrey")
    ax3.set_xticks(range(len(rows)), names, rotation=30, ha="right")
    ax3.set_ylabel("measured s per step (median rank)")
    ax3.legend(fontsize="small", framealpha=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from ds_ext.cluster.world import bench_world

    if args.quick:
        args.model, args.warmup, args.steps = "tiny", 1, 1
        args.variants = ["ted_base", "ted_dtd_cac", "deepspeed_ep", "deepspeed_ep_tp"]
    time_scale = None if args.network == "netns" else args.time_scale
    records: list[dict[str, Any]] = []
    for variant in tqdm(args.variants, desc="bench ted", unit="variant"):
        with bench_world(args, WORLD, {"LOCAL_SIZE": str(RANKS_PER_NODE)}) as world:
            records.append(_merge_ranks(world.run(_measure, variant, args.model, args.warmup, args.steps, time_scale)))
    from ds_ext.perf.ted import base_model_table

    payload = {
        "benchmark": "ted",
        "world_size": WORLD,
        "model": args.model,
        "network": args.network,
        "quick": args.quick,
        "records": records,
        "checks": checks(records),
        "eq_7_5_base_model_params_64GB": base_model_table(),
    }
    out = write_json(args.out, payload)
    plot(records, out.with_suffix(".png"))
    print(table(records))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return payload
