"""``ds-ext bench pmm``: every 4D factorization of 8 ranks on a GPT, beside the anchors.

8 CPU ranks emulate 2 nodes x 2 GPUs x 2 GCDs (the Frontier hierarchy of
``ds_ext.topology``, shrunk); a GPT (fp32) trains on byte-level stdlib text with the same
global batch in every variant, side by side in one gloo world:

* ``pmm3d`` on every factorization (G_x, G_y, G_z, G_data) of 8 that divides the model,
  among them Megatron-style 1D tensor parallelism (8,1,1,1) with alternating transposes,
  FSDP (1,1,8,1) and DDP (1,1,1,8), its tables placed as ``--tables`` says (default
  replicated over X, as the megatron-core anchor keeps them) and ds_ext.pmm3d's default
  overlap (OAR on); on the grids given by ``--overlap-grids``, the same with OAR + ORS + OAG
  on; on ``--tables-twin-grids``, the
  same with the other placement (``pmm3d+vocab_parallel`` / ``pmm3d+replicated``);
* ``deepspeed_zero3``: the plain GPT under DeepSpeed ZeRO-3 over all 8 ranks;
* ``megatron_tp8``: the GPT's block linears replaced by megatron-core's
  ``ColumnParallelLinear`` / ``RowParallelLinear`` (tensor parallel 8, CPU initialization),
  embeddings, norms and the tied head replicated, trained with torch AdamW after Megatron's
  gradient clipping (the norm summed over the tensor group, replicated parameters counted on
  tensor rank 0; at the ``gradient_clipping`` DeepSpeed applies to the pmm3d variants);
  a bytes-and-time anchor (its fused q|k|v split differs).

Every collective (ds_ext's, DeepSpeed's, megatron-core's) is counted by the same ledger
per topology level and held for its alpha-beta time (Frontier latencies and bandwidths x
``--time-scale``). Reported per variant: bytes per level per step (and, for pmm3d, the
exact ``ds_ext.perf.pmm`` prediction), every collective of the last step by ledger phase
(per layer for pmm3d), op and level (``collectives``), the predicted communication time
(Eqs 5.1-5.7), every step time and their medians with and without emulation, model-state
bytes per rank, the loss.

``--network netns`` runs the same variants with no emulation on an emulated cluster
(``ds_ext.cluster``: 2 nodes x 2 GPUs as network namespaces, tbf-shaped GPU and node links,
2 ranks per GPU on loopback). The network is measured first (per level bandwidth and
latency, ``ds-ext tune --measure --network netns``) and ``predicted_measured_network_comm_s``
is Eqs 5.1-5.7 with α fed those measurements (nothing fitted to step times); the ranking is
checked against the measured step time on the shaped network, beside the baseline that ranks
grids by their inter-node bytes alone (``spearman[inter_node_bytes]``). ``--quick``: the tiny model,
four grids, no anchors or overlap twins, two steps (a plumbing check, not a result).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from ds_ext.bench import mean_over_world, median, write_json
from ds_ext.cluster.world import BENCH_MESSAGE_BYTES, add_network_arguments
from ds_ext.errors import require_extra

WORLD = 8
LEVELS = ("gcd", "gpu", "node")
TOPOLOGY = {"preset": "frontier", "sizes": {"gpu": 2}, "emulate": True}
MODELS = {  # name -> (d_model, n_layers, n_heads, seq_len)
    "gpt": (512, 2, 8, 128),
    "tiny": (64, 2, 8, 16),
}
ANCHORS = ("deepspeed_zero3", "megatron_tp8")
TABLES = ("replicated", "vocab_parallel")  # ds_ext.pmm3d.tables
BYTES_ONLY = "inter_node_bytes"  # the baseline predictor: a grid's bytes at the node level
# Predicted communication per step by ds_ext.perf.pmm, ranked against the measured emulated step:
# Eqs 5.1-5.5 only; + ds_ext's extra terms, Eq 5.7 bandwidths (rings share a node's NICs); the same
# with every rank on its own share of each level's links; and that with α per message. The last is
# the machine ds_ext.comm.emulation emulates (``ds-ext tune``, its default): the model
# the ranking acceptance is checked with; the others show what each assumption costs here.
PREDICTORS = (
    "predicted_paper_comm_s",
    "predicted_comm_s",
    "predicted_per_rank_links_comm_s",
    "predicted_alpha_beta_comm_s",
)
RANKING_MODEL = "predicted_alpha_beta_comm_s"
NETNS_PREDICTOR = "predicted_measured_network_comm_s"
QUICK_GRIDS = ["2,2,2,1", "8,1,1,1", "1,1,1,8", "2,1,1,4"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="JSON file to write (a PNG is written next to it)")
    p.add_argument("--model", choices=sorted(MODELS), default="gpt")
    p.add_argument("--global-batch", type=int, default=8, help="samples per optimizer step (all variants)")
    p.add_argument("--warmup", type=int, default=1, help="optimizer steps before measuring")
    p.add_argument("--steps", type=int, default=5, help="measured emulated steps (and half as many plain ones)")
    p.add_argument(
        "--time-scale",
        type=float,
        default=1000.0,
        help="multiply emulated link times: one CPU core computes ~1000x slower than a GCD",
    )
    p.add_argument(
        "--overlap-grids",
        nargs="*",
        default=["2,2,2,1", "1,1,8,1", "1,2,4,1", "8,1,1,1"],
        metavar="X,Y,Z,D",
        help="grids also measured with OAR + ORS + OAG on",
    )
    p.add_argument(
        "--grids",
        nargs="*",
        default=None,
        metavar="X,Y,Z,D",
        help="only these grids (default: every factorization of 8 that divides the model)",
    )
    p.add_argument(
        "--tables",
        choices=TABLES,
        default="replicated",
        help="ds_ext.pmm3d.tables of the pmm3d grids (replicated over X: the megatron-core anchor's placement)",
    )
    p.add_argument(
        "--tables-twin-grids",
        nargs="*",
        default=["8,1,1,1"],
        metavar="X,Y,Z,D",
        help="grids also measured with the other table placement",
    )
    p.add_argument("--anchors", nargs="*", default=list(ANCHORS), choices=ANCHORS)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--quick", action="store_true", help="tiny model, 4 grids, no anchors / overlap, 2 steps")
    add_network_arguments(p)


# ---- one rank ---------------------------------------------------------------------------
def _gpt(model: str):
    import torch

    from ds_ext.models import GPT, GPTConfig

    d, layers, heads, seq = MODELS[model]
    torch.manual_seed(1234)
    return GPT(GPTConfig(seq_len=seq, d_model=d, n_layers=layers, n_heads=heads))


def _config(micro: int, time_scale: float | None, block: dict) -> dict[str, Any]:
    """ds_config of one variant; ``time_scale`` None: no alpha-beta emulation (a real network)."""
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "ds_ext": {"topology": TOPOLOGY, "comm": _comm_block(time_scale), **block},
        **({"zero_optimization": {"stage": 0}} if "pmm3d" in block else {}),
    }


def _comm_block(time_scale: float | None) -> dict[str, Any]:
    return {"ledger": True, "emulate_time": time_scale is not None, "time_scale": time_scale or 1.0}


def _timed_steps(step_fn, comm, warmup: int, steps: int) -> tuple[dict[str, list[float]], list[float], dict[str, int]]:
    """Warm-up, then ``steps`` emulated and ``steps // 2`` plain steps; each step's time and
    the losses. Without an emulator (a real network) all ``steps`` are plain and there are no
    emulated times."""
    import torch.distributed as dist

    emulator, times, losses = comm.emulator, {"emulated": [], "plain": []}, []
    state: dict[str, int] = {}
    plain = max(1, steps // 2) if emulator is not None else steps
    steps = steps if emulator is not None else 0
    for i in range(warmup + steps + plain):
        mode = "emulated" if i < warmup + steps else "plain"
        comm.emulator = emulator if mode == "emulated" else None
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(step_fn(i, state))
        dist.barrier()
        if i >= warmup:
            times[mode].append(time.perf_counter() - t0)
    comm.emulator = emulator
    return times, losses, state


def _step_times(times: dict[str, list[float]]) -> dict[str, Any]:
    """A record's step-time fields: every step (``step_times_s``, ``step_times_emulated_s``)
    and their medians (``step_time_s``, ``step_time_emulated_s``; None without emulation)."""
    return {
        "step_time_emulated_s": median(times["emulated"]) if times["emulated"] else None,
        "step_time_s": median(times["plain"]),
        "step_times_emulated_s": times["emulated"],
        "step_times_s": times["plain"],
    }


def _collectives(traffic) -> list[dict[str, Any]]:
    """Every collective of one ledger step: phase (``forward/<layer>`` with per-layer tags),
    op, level, bytes sent by this rank and calls."""
    return [
        {"phase": ph, "op": op, "level": lv, "bytes": float(b), "calls": int(traffic.calls[(ph, op, lv)])}
        for (ph, op, lv), b in sorted(traffic.bytes.items())
    ]


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _measure_pmm(
    grid: tuple[int, int, int, int],
    overlap: bool,
    tables: str,
    variant: str,
    model: str,
    global_batch: int,
    warmup: int,
    steps: int,
    time_scale: float | None,
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import ds_ext
    from ds_ext.data import ByteCorpus
    from ds_ext.integration.ds_pmm import optimizer_state_bytes
    from ds_ext.perf import pmm as perf
    from ds_ext.pmm.plans import plan_for
    from ds_ext.pmm.spec import model_spec

    x, y, z, data = grid
    micro, seq = global_batch // data, MODELS[model][3]
    # the plugin's defaults (OAR on), or every overlap of 001 §5.1.4 on
    flags = {"all_reduce": True, "reduce_scatter": True, "all_gather": True} if overlap else {}
    block = {
        "pmm3d": {
            "enabled": True,
            "grid": {"x": x, "y": y, "z": z, "data": data},
            "overlap": flags,
            "tables": tables,
            "ledger_by_layer": True,
        }
    }
    serial = _gpt(model)
    spec = model_spec(serial, plan_for(serial), vocab_parallel=tables == "vocab_parallel")
    engine, *_ = ds_ext.initialize(
        model=_gpt(model), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), config=_config(micro, time_scale, block)
    )
    rt = engine.ds_ext
    plugin = rt.plugin("pmm3d")
    corpus = ByteCorpus(max_bytes=300_000)
    drank = plugin.axes["data"].rank

    def step(i: int, state: dict[str, int]) -> float:
        loss = engine(corpus.micro_batch(i, 0, drank, data, micro, 1, seq))
        engine.backward(loss)
        state["grads"] = _nbytes(p.grad for p in engine.module.parameters())
        engine.step()
        return loss.item()

    times, losses, state = _timed_steps(step, rt.comm, warmup, steps)
    measured = {ph: lv for ph, lv in rt.ledger.steps[-1].by_phase().items() if ph != "step"}
    g = plugin.grid
    links = perf.Bandwidths.per_rank_links(rt.topology)
    model_bytes = perf.ledger_bytes(spec, g, rt.topology, micro, seq, 4)
    mem = perf.memory(spec, g, 4, 0)
    record = {
        "variant": variant,
        "grid": list(grid),
        "tables": tables,
        "bytes_per_step": _by_level(rt.ledger.steps[-1].by_level()),
        "collectives": _collectives(rt.ledger.steps[-1]),
        "model_bytes_per_step": _by_level(_sum_levels(model_bytes)),
        "ledger_equals_model": measured == model_bytes,
        "predicted_comm_s": perf.comm_time(spec, g, rt.topology, micro, seq, 4),
        "predicted_paper_comm_s": perf.comm_time(spec, g, rt.topology, micro, seq, 4, paper_terms_only=True),
        "predicted_per_rank_links_comm_s": perf.comm_time(spec, g, rt.topology, micro, seq, 4, bw=links),
        "predicted_alpha_beta_comm_s": perf.comm_time(spec, g, rt.topology, micro, seq, 4, bw=links, latency=True),
        **_step_times(times),
        "model_state_bytes": _nbytes(engine.module.parameters()) + state["grads"] + optimizer_state_bytes(engine),
        "model_state_bytes_predicted": mem["layer_params"]
        + mem["layer_grads"]
        + mem["replicated_params"]
        + mem["replicated_grads"]
        + mem["optimizer"],
        "losses": _mean_over_data(losses, plugin.axes["data"]),
        "prefetch_hits": plugin.engine.prefetcher.hits if plugin.engine.prefetcher else 0,
    }
    engine.destroy()
    dist.barrier()
    return record


def _mean_over_data(losses: list[float], data_axis) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(t, group=data_axis.group)
    return (t / data_axis.size).tolist()


def _sum_levels(by_phase: dict[str, dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for per in by_phase.values():
        for lv, b in per.items():
            out[lv] = out.get(lv, 0.0) + b
    return out


def _by_level(d: dict[str, float]) -> dict[str, float]:
    return {lv: float(d.get(lv, 0.0)) for lv in LEVELS}


def _measure_zero3(model: str, global_batch: int, warmup: int, steps: int, time_scale: float | None) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import ds_ext
    from ds_ext.data import ByteCorpus
    from ds_ext.integration.ds_zero3_state import deepspeed_zero3_state_bytes

    micro, seq = global_batch // WORLD, MODELS[model][3]
    cfg = _config(micro, time_scale, {})
    cfg["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": 0}
    net = _gpt(model)
    engine, *_ = ds_ext.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-3), config=cfg)
    rt, corpus, rank = engine.ds_ext, ByteCorpus(max_bytes=300_000), dist.get_rank()

    def step(i: int, state: dict[str, int]) -> float:
        loss = engine(corpus.micro_batch(i, 0, rank, WORLD, micro, 1, seq))
        engine.backward(loss)
        state.update(deepspeed_zero3_state_bytes(engine))
        engine.step()
        return loss.item()

    times, losses, state = _timed_steps(step, rt.comm, warmup, steps)
    record = {
        "variant": "deepspeed_zero3",
        "grid": [1, 1, WORLD, 1],
        "bytes_per_step": _by_level(rt.ledger.steps[-1].by_level()),
        "collectives": _collectives(rt.ledger.steps[-1]),
        **_step_times(times),
        "model_state_bytes": sum(state.values()),
        "losses": mean_over_world(losses),
    }
    engine.destroy()
    return record


def _measure_megatron(
    model: str, global_batch: int, warmup: int, steps: int, time_scale: float | None
) -> dict[str, Any]:
    """megatron-core tensor parallelism over 8 ranks, counted by a ds_ext ledger."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state

    from ds_ext import config as cfgmod
    from ds_ext.comm import instrument_torch_distributed
    from ds_ext.data import ByteCorpus
    from ds_ext.integration.ds_engine import gradient_clipping
    from ds_ext.runtime import Runtime

    rt = Runtime.create(cfgmod.parse({"topology": TOPOLOGY, "comm": _comm_block(time_scale)}))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=WORLD)
    try:
        net = _megatron_gpt(model)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        corpus, seq = ByteCorpus(max_bytes=300_000), MODELS[model][3]
        clip, group = (
            gradient_clipping(_config(global_batch, time_scale, {})),
            parallel_state.get_tensor_model_parallel_group(),
        )
        ledger = rt.ledger

        def step(i: int, state: dict[str, int]) -> float:
            with ledger.phase("forward"):
                loss = net(corpus.micro_batch(i, 0, 0, 1, global_batch, 1, seq))
            with ledger.phase("backward"):
                loss.backward()
            state["grads"] = _nbytes(p.grad for p in net.parameters())
            with ledger.phase("step"):
                if clip > 0:
                    _clip_tensor_parallel(list(net.parameters()), clip, group)
                opt.step()
            opt.zero_grad()
            ledger.mark_step()
            return loss.item()

        with instrument_torch_distributed(rt.comm):
            times, losses, state = _timed_steps(step, rt.comm, warmup, steps)
        opt_bytes = _nbytes(v for st in opt.state.values() for v in st.values() if v.dim())
        return {
            "variant": "megatron_tp8",
            "grid": [WORLD, 1, 1, 1],
            "bytes_per_step": _by_level(rt.ledger.steps[-1].by_level()),
            "collectives": _collectives(rt.ledger.steps[-1]),
            **_step_times(times),
            "model_state_bytes": _nbytes(net.parameters()) + state["grads"] + opt_bytes,
            "losses": losses,
        }
    finally:
        parallel_state.destroy_model_parallel()


def _clip_tensor_parallel(params: list, max_norm: float, group) -> float:
    """Megatron-LM's gradient clipping (megatron.core.optimizer.clip_grads, whose kernels need
    CUDA): the squared norms of the tensor-parallel shards and, on tensor rank 0 only, of the
    replicated parameters, summed over the tensor group; gradients scaled when the norm
    exceeds ``max_norm``. Returns the norm."""
    import torch
    import torch.distributed as dist

    first = dist.get_rank(group) == 0
    counted = [p.grad for p in params if p.grad is not None and (getattr(p, "tensor_model_parallel", False) or first)]
    sq = torch.stack([g.float().pow(2).sum() for g in counted]).sum()
    dist.all_reduce(sq, group=group)
    norm = float(sq.sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm


def _megatron_gpt(model: str):
    """ds_ext's GPT with megatron-core column / row parallel block linears (TP 8)."""
    from ds_ext.bench import megatron_tensor_parallel

    return megatron_tensor_parallel(_gpt(model), WORLD)


# ---- driver -----------------------------------------------------------------------------
def _rank_of(values: list[float]) -> list[float]:
    require_extra("scipy", "the grid ranking's Spearman coefficients")
    from scipy.stats import rankdata

    return list(rankdata(values))


def checks(
    records: list[dict[str, Any]], time_key: str = "step_time_emulated_s", ranking_model: str = RANKING_MODEL
) -> dict[str, Any]:
    """The acceptance numbers (with ``--network netns``: ``time_key``
    "step_time_s", ``ranking_model`` the model fed the measured network), from the records."""
    require_extra("scipy", "the grid ranking's Spearman coefficients")
    from scipy.stats import spearmanr

    grids = [r for r in records if r["variant"] == "pmm3d"]
    measured = [r[time_key] for r in grids]
    out: dict[str, Any] = {
        "ledger_equals_model_all_grids": all(r["ledger_equals_model"] for r in grids),
        "ranking_model": ranking_model,
        "ranked_time": time_key,
    }
    for key in [k for k in (*PREDICTORS, NETNS_PREDICTOR, BYTES_ONLY) if k in grids[0] or k == BYTES_ONLY]:
        predicted = [r["bytes_per_step"]["node"] if key == BYTES_ONLY else r[key] for r in grids]
        first = min(range(len(grids)), key=lambda i: predicted[i])
        out[f"spearman[{key}]"] = float(spearmanr(predicted, measured).statistic)
        out[f"model_first_choice[{key}]"] = grids[first]["grid"]
        out[f"model_first_choice_measured_rank[{key}]"] = float(_rank_of(measured)[first])
    rho, rank = out[f"spearman[{ranking_model}]"], out[f"model_first_choice_measured_rank[{ranking_model}]"]
    out["ranking_holds"] = rho >= 0.6 and rank <= 3  # Spearman >= 0.6, first choice in the 3 fastest
    # the model must rank the grids better than their inter-node bytes alone
    out["model_ranks_better_than_bytes_only"] = rho > out[f"spearman[{BYTES_ONLY}]"]
    by_grid = {tuple(r["grid"]): r for r in grids}
    suffix = "emulated" if time_key == "step_time_emulated_s" else "network"
    out[f"overlap_step_time_ratio_{suffix}"] = {
        "x{}y{}z{}d{}".format(*r["grid"]): r[time_key] / by_grid[tuple(r["grid"])][time_key]
        for r in records
        if r["variant"] == "pmm3d+overlap"
    }
    best = min(grids, key=lambda r: r[time_key])
    for r in records:
        if r["variant"] in ANCHORS:
            out[f"{r['variant']}_over_best_pmm3d_{suffix}"] = r[time_key] / best[time_key]
    out["fastest_measured_grid"] = best["grid"]
    megatron = next((r for r in records if r["variant"] == "megatron_tp8"), None)
    if megatron is not None:  # pmm3d (8,1,1,1) at most 1.05x megatron-core TP8's step
        for r in records:
            if r["variant"].startswith("pmm3d") and r["grid"] == megatron["grid"]:
                out[f"{r['variant']}_x8y1z1d1_over_megatron_tp8_{suffix}"] = r[time_key] / megatron[time_key]
        out[f"best_pmm3d_over_megatron_tp8_{suffix}"] = best[time_key] / megatron[time_key]
    return out


def table(records: list[dict[str, Any]]) -> str:
    head = (
        f"{'variant':<18}{'grid':>10}{'gcd MB':>9}{'gpu MB':>9}{'node MB':>9}{'=model':>7}{'pred ms':>9}"
        f"{'emul s':>8}{'step s':>8}{'state MB':>9}{'loss':>7}"
    )
    lines = [head, "-" * len(head)]
    predictor = NETNS_PREDICTOR if any(NETNS_PREDICTOR in r for r in records) else RANKING_MODEL
    for r in records:
        b = r["bytes_per_step"]
        lines.append(
            f"{r['variant']:<18}{'x'.join(map(str, r['grid'])):>10}{b['gcd'] / 1e6:>9.2f}{b['gpu'] / 1e6:>9.2f}"
            f"{b['node'] / 1e6:>9.2f}{str(r.get('ledger_equals_model', '-')):>7}"
            f"{1e3 * r.get(predictor, float('nan')):>9.3f}{r['step_time_emulated_s'] or float('nan'):>8.3f}"
            f"{r['step_time_s']:>8.3f}{r['model_state_bytes'] / 1e6:>9.2f}{r['losses'][-1]:>7.3f}"
        )
    lines.append(
        "bytes sent per rank per step; grid = x*y*z*data; 'pred ms' = Eqs 5.1-5.6 + ds_ext terms + alpha, "
        + (
            "Eq 5.7 with the measured network's bandwidths and latencies; 'step s' = step on the shaped network"
            if predictor == NETNS_PREDICTOR
            else "per-rank links (the emulated machine, unscaled); 'emul s' = step with alpha-beta emulation"
        )
    )
    return "\n".join(lines)


def figure(records: list[dict[str, Any]], time_key: str = "step_time_emulated_s"):
    """Measured step time against the models' predictions per grid (left; labels ``4x1x1x2``,
    none overlapping) and bytes per level per variant (right)."""
    from ds_ext import plotting

    grids = [r for r in records if r["variant"] == "pmm3d"]
    fig = plotting.figure(figsize=(14, 5))
    ax1, ax2 = fig.subplots(1, 2)
    series = (
        ((NETNS_PREDICTOR, "Eq 5.7 + α, the measured network"),)
        if NETNS_PREDICTOR in grids[0]
        else (
            (RANKING_MODEL, "α-β, per-rank links (the emulated machine)"),
            ("predicted_comm_s", "Eq 5.7 bandwidths, no α"),
        )
    )
    for key, label in series:
        ax1.scatter([1e3 * r[key] for r in grids], [r[time_key] for r in grids], label=label)
    ax1.legend(fontsize=8, loc="lower right")
    ax1.set_xlabel("predicted communication per step, ms (ds_ext.perf.pmm, unscaled)")
    ax1.set_ylabel(
        "measured step time, s"
        + (" (alpha-beta emulation)" if time_key == "step_time_emulated_s" else " (shaped network)")
    )
    ax1.set_title("grids (x y z data) of 8 ranks")
    rows = sorted(records, key=lambda r: r[time_key])
    bottom = [0.0] * len(rows)
    for lv in LEVELS:
        vals = [r["bytes_per_step"][lv] / 1e6 for r in rows]
        ax2.bar(range(len(rows)), vals, bottom=bottom, label=lv)
        bottom = [b + v for b, v in zip(bottom, vals)]
    labels = [f"{r['variant'].replace('pmm3d', '')} {plotting.grid_label(r['grid'])}".strip() for r in rows]
    ax2.set_xticks(range(len(rows)), labels, rotation=70, ha="right", fontsize=7)
    ax2.set_ylabel("MB sent per rank per step (fastest first)")
    ax2.legend(title="level")
    fig.tight_layout()
    plotting.annotate_apart(
        ax1,
        [
            (plotting.grid_label(r["grid"]), (1e3 * r[series[0][0]], r[time_key]))
            for r in sorted(grids, key=lambda r: r[time_key])
        ],
    )
    return fig


def plot(records: list[dict[str, Any]], path, time_key: str = "step_time_emulated_s") -> None:
    """:func:`figure` written to ``path`` (PNG)."""
    figure(records, time_key).savefig(path, dpi=120)


def _predict_on_network(
    records: list[dict[str, Any]], network: dict[str, Any], spec, model: str, global_batch: int
) -> None:
    """Add Eqs 5.1-5.7 + α fed the measured network (:func:`ds_ext.cluster.measure.measured_topology`)
    to every pmm3d record."""
    from ds_ext.cluster.measure import measured_topology
    from ds_ext.parallel import Grid
    from ds_ext.perf import pmm as perf

    topo = measured_topology(network, LEVELS)
    bw = perf.Bandwidths.from_topology(topo)
    for r in records:
        if r["variant"].startswith("pmm3d"):
            g = Grid(*r["grid"])
            placed = perf.place_tables(spec, r["tables"] == "vocab_parallel")
            r[NETNS_PREDICTOR] = perf.comm_time(
                placed, g, topo, global_batch // g.data, MODELS[model][3], 4, bw=bw, latency=True
            )


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from ds_ext.cluster.measure import measure
    from ds_ext.cluster.world import bench_world
    from ds_ext.perf.pmm import factorizations, unfit_reason
    from ds_ext.pmm.plans import plan_for
    from ds_ext.pmm.spec import model_spec

    if args.quick:
        args.model, args.warmup, args.steps = "tiny", 1, 2
        args.grids, args.overlap_grids, args.anchors = QUICK_GRIDS, [], []
    netns = args.network == "netns"
    serial = _gpt(args.model)
    spec = model_spec(serial, plan_for(serial), vocab_parallel=args.tables == "vocab_parallel")
    grids = [g.dims for g in factorizations(WORLD) if unfit_reason(spec, g, args.global_batch // g.data) is None]
    parse = lambda s: tuple(int(v) for v in s.split(","))  # noqa: E731
    if args.grids is not None:
        grids = [g for g in grids if g in {parse(s) for s in args.grids}]
    overlap = [parse(s) for s in args.overlap_grids]
    twins = [parse(s) for s in args.tables_twin_grids]
    other = next(t for t in TABLES if t != args.tables)
    jobs: list[tuple] = []  # each twin right after its plain variant: same machine load
    for g in grids:
        jobs.append(("pmm", g, (False, args.tables, "pmm3d")))
        if g in overlap:
            jobs.append(("pmm", g, (True, args.tables, "pmm3d+overlap")))
        if g in twins:
            jobs.append(("pmm", g, (False, other, f"pmm3d+{other}")))
    jobs += [(a, None, None) for a in args.anchors]
    common = (args.model, args.global_batch, args.warmup, args.steps, None if netns else args.time_scale)
    records: list[dict[str, Any]] = []
    with bench_world(args, WORLD, {"LOCAL_SIZE": str(WORLD)}) as world:
        network = world.run(measure, BENCH_MESSAGE_BYTES)[0] if netns else None
        for kind, grid, how in tqdm(jobs, desc="bench pmm", unit="variant"):
            if kind == "pmm":
                records.append(world.run(_measure_pmm, grid, *how, *common)[0])
            elif kind == "deepspeed_zero3":
                records.append(world.run(_measure_zero3, *common)[0])
            else:
                records.append(world.run(_measure_megatron, *common)[0])
    time_key, ranking = ("step_time_s", NETNS_PREDICTOR) if netns else ("step_time_emulated_s", RANKING_MODEL)
    if netns:
        _predict_on_network(records, network, spec, args.model, args.global_batch)
    payload = {
        "benchmark": "pmm",
        "world_size": WORLD,
        "model": args.model,
        "model_dims": MODELS[args.model],
        "global_batch": args.global_batch,
        "tables": args.tables,
        "network": args.network,
        "measured_network": network,
        "time_scale": None if netns else args.time_scale,
        "quick": args.quick,
        "records": records,
        "checks": checks(records, time_key, ranking),
    }
    out = write_json(args.out, payload)
    plot(records, out.with_suffix(".png"), time_key)
    print(table(records))
    print({k: v for k, v in payload["checks"].items()})
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return payload
