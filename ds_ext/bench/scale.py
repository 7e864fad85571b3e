"""``ds-ext bench scale``: ZeRO-topo, TED and PCCL as one rank of a world at the papers' scale.

One process is rank r of a W-rank world on the ``mirror`` backend (``ds_ext.comm.mirror``:
torch's fake process group with every output filled as in a symmetric world), placed by the
Frontier preset into (W / 8 nodes) x 4 MI250X x 2 GCDs. It runs the real code path,
``ds_ext.initialize`` on a tiny model and two optimizer steps, so the ledger
(``ds_ext.comm.ledger``) holds the bytes and messages this rank sends per level at W ranks. Each
case sets them beside the analytic model the plugin is held to:

* ``zero_topo`` (003 §V, Table VII): 003's three schemes in ds_ext's engine (``zero3``,
  ``zeropp``, ``zero_topo_paper`` = Sec-Degree 2) and ds_ext's default ``zero_topo`` at 384 GCDs,
  003's largest run (48 nodes): ledger == ``ds_ext.zero_topo.perf.traffic`` in volume and in link
  bytes (each byte at the level of the link it crosses under RCCL's ring in rank order: at 48 nodes
  a world ring crosses the NICs on 48 of its 384 hops, so the link bytes say what each NIC carries
  where two nodes cannot), and the forward all-gather volume == Table VII's
  (ZeRO-3 ψ (d-1)/d over the world; ZeRO++ ψ/2 (d-1)/d over the world; Sec-Degree 2 ψ/2 (d-1)/d over
  the GCD pair, d = 2; ψ the 16-bit bytes of the padded units, ψ/2 the int8 codes plus their
  block scales);
* ``ted`` (001 ch. 7): TED blocks (G_tensor x G_expert x G_data^exp), DTD + CAC, ZeRO-1:
  ledger == ``ds_ext.planner.ted_layouts.traffic`` (``ds_ext.perf.ted`` per MoE block, the dense
  tensor-parallel all-reduces, ZeRO-1's step) to within DeepSpeed's gradient-norm and overflow
  scalars (a few bytes per step, not modelled);
* ``pccl`` (001 §6.2-6.3): DeepSpeed ZeRO-3 with its all-gathers / reduce-scatters left to the
  backend (RCCL's ring, as the ledger counts it) and routed through PCCL, at 384 and 2,048 GCDs
  (001 ch. 6's largest): per call, PCCL's bytes and messages per level ==
  ``ds_ext.perf.collectives.traffic`` of the ring's chunk, and the same bytes in total.

Every case runs in a process of its own (a world per process), forked from the forkserver of
``ds_ext.local_world`` with DeepSpeed imported.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable

from ds_ext.bench import write_json

FRONTIER_GCDS = 384  # 003's largest run: 48 nodes x 4 MI250X x 2 GCDs
PCCL_GCDS = (384, 2048)  # 2,048: 001 §6.3's largest
ZERO_SCHEMES = ("zero3", "zeropp", "zero_topo_paper", "zero_topo")  # 003's three, then ds_ext's default
TED_LAYOUT = (2, 8)  # (G_tensor, G_expert): a TP pair on one MI250X, experts over a node
STEPS = 2  # the last step is read (the first builds DeepSpeed's trace and caches)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--world", type=int, default=FRONTIER_GCDS, help="ranks of the ZeRO-topo and TED runs")
    p.add_argument("--pccl-world", type=int, nargs="+", default=list(PCCL_GCDS), help="ranks of the PCCL runs")
    p.add_argument("--rank", type=int, default=0, help="the rank this process plays")


# ---- the runs (each in a fresh process) ------------------------------------------------------
def _start(world: int, rank: int) -> None:
    os.environ.update(
        DS_ACCELERATOR="cpu",
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
        OMP_NUM_THREADS="1",
    )
    from ds_ext.comm import mirror

    mirror.init(world, rank)


def _topology() -> dict[str, Any]:
    return {"preset": "frontier"}  # 2 GCDs x 4 MI250X per node, W / 8 nodes


def _ledger(engine) -> dict[str, Any]:
    """The last step's bytes / calls / messages by (phase, op, level), as lists (JSON)."""
    last = engine.ds_ext.ledger.steps[-1]
    kinds = ("bytes", "link_bytes", "calls", "messages")
    return {kind: [[*k, v] for k, v in getattr(last, kind).items()] for kind in kinds}


def zero_topo_rank(world: int, rank: int, scheme: str) -> dict[str, Any]:
    """One rank of ds_ext's engine under ``scheme``: its ledger, the analytic model, Table VII."""
    _start(world, rank)
    import torch

    import ds_ext
    from ds_ext.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2))
    engine, *_ = ds_ext.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        config={
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "steps_per_print": 10**9,
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 0},
            "ds_ext": {"topology": _topology(), "zero_topo": {"enabled": True, "preset": scheme}},
        },
    )
    for _ in range(STEPS):
        engine.backward(engine(torch.randint(0, 64, (1, 17))))
        engine.step()
    plugin = engine.ds_ext.plugins[0]
    model_traffic = plugin.analytic_traffic(1)
    units = plugin.sharded.unit_specs()
    out = {
        "case": "zero_topo",
        "scheme": scheme,
        "world": world,
        "rank": rank,
        "ledger": _ledger(engine),
        "model_bytes": model_traffic.bytes,
        "model_links": model_traffic.links,
        "model_calls": model_traffic.calls_by_level(),
        "model_messages": model_traffic.steps_by_level(),
        "table_vii": table_vii(scheme, [u.U for u in units], plugin.plan.block_size, world, engine.ds_ext.topology),
    }
    engine.destroy()
    return out


def table_vii(scheme: str, units: list[int], block: int, world: int, topology) -> dict[str, float]:
    """003 Table VII's forward all-gather bytes per rank for the padded ``units`` (elements), at
    the level Table VII puts it: ψ = 2 bytes per element, ψ/2 = int8 codes + 4-byte scales per
    ``block``; d = the world (ZeRO-3, ZeRO++), the GCD pair (Sec-Degree 2)."""
    psi = sum(2.0 * u for u in units)
    half = sum(u + 4.0 * u / block for u in units)
    if scheme == "zero3":
        return {topology.levels[-1].name: psi * (world - 1) / world}
    if scheme == "zeropp":
        return {topology.levels[-1].name: half * (world - 1) / world}
    return {topology.levels[0].name: half * (2 - 1) / 2}


def ted_rank(world: int, rank: int, tensor: int, expert: int) -> dict[str, Any]:
    """One rank of a TED GPT-MoE (every block MoE, checkpointed, DTD + CAC) under ZeRO-1, 2 micro-steps."""
    _start(world, rank)
    import torch
    import torch.distributed as dist
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    import ds_ext
    from ds_ext.models.gpt_moe import GPTMoE, GPTMoEConfig

    cfg = GPTMoEConfig(
        vocab_size=64,
        seq_len=16,
        d_model=32,
        n_layers=2,
        n_heads=4,
        num_experts=expert,
        min_capacity=0,
        use_rts=False,
        top2_2nd_expert_sampling=False,
        ep_size=expert,
        checkpoint="torch",
    )
    torch.manual_seed(0)
    model = GPTMoE(cfg)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "dense", "lr": 1e-3}
    )
    engine, *_ = ds_ext.initialize(
        model=model,
        optimizer=torch.optim.AdamW(groups, lr=1e-3),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
            "steps_per_print": 10**9,
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 1},
            "gradient_clipping": 0.0,
            "ds_ext": {
                "topology": _topology(),
                "ted": {"enabled": True, "tensor_parallel": tensor, "expert_parallel": expert},
            },
        },
    )
    for _ in range(STEPS * 2):
        engine.backward(engine(torch.randint(0, 64, (2, cfg.seq_len + 1))))
        engine.step()
    out = {
        "case": "ted",
        "world": world,
        "rank": dist.get_rank(),
        "tensor": tensor,
        "expert": expert,
        "ledger": _ledger(engine),
        "model": [cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.vocab_size, cfg.seq_len, cfg.num_experts],
    }
    engine.destroy()
    return out


def pccl_rank(world: int, rank: int, algorithm: str | None) -> dict[str, Any]:
    """One rank of DeepSpeed ZeRO-3, its all-gathers / reduce-scatters by ``algorithm`` through the
    pccl plugin (None: the backend's, counted as RCCL's ring)."""
    _start(world, rank)
    import torch

    import ds_ext
    from ds_ext.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2))
    block: dict[str, Any] = {"topology": _topology()}
    if algorithm is not None:
        block["pccl"] = {"enabled": True, "algorithm": algorithm}
    engine, *_ = ds_ext.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        config={
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "steps_per_print": 10**9,
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "ds_ext": block,
        },
    )
    for _ in range(STEPS):
        engine.backward(engine(torch.randint(0, 64, (1, 17))))
        engine.step()
    out = {"case": "pccl", "world": world, "rank": rank, "algorithm": algorithm or "ring", "ledger": _ledger(engine)}
    engine.destroy()
    return out


def in_process(fn: Callable[..., dict[str, Any]], *args: Any, timeout: float = 600) -> dict[str, Any]:
    """``fn(*args)`` in a fresh process of ``ds_ext.local_world``'s forkserver (DeepSpeed preloaded)."""
    from ds_ext.local_world import mp_context, preload

    preload("ds_ext._world_preload_deepspeed")
    ctx = mp_context()
    with ctx.Pool(1) as pool:
        return pool.apply_async(fn, args).get(timeout)


# ---- comparisons ------------------------------------------------------------------------------
def _sum(rows: list[list], keep: Callable[[str, str], bool] = lambda ph, op: True) -> dict[str, float]:
    """{level: total} of ledger rows [phase, op, level, value] that ``keep``."""
    out: dict[str, float] = {}
    for ph, op, lv, v in rows:
        if keep(ph, op):
            out[lv] = out.get(lv, 0.0) + v
    return out


def zero_topo_check(r: dict[str, Any]) -> dict[str, Any]:
    """Ledger vs ``zero_topo.perf`` (bytes and link bytes per phase and level, calls and messages per
    level) and the forward all-gather vs Table VII. The link bytes follow RCCL's ring in group-rank
    order (``ds_ext.comm.hops``): ``links`` at ``node`` is what this rank puts on its NIC."""

    def by_phase(kind: str) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for ph, _, lv, b in r["ledger"][kind]:
            if ph != "other":
                out.setdefault(ph, {})
                out[ph][lv] = out[ph].get(lv, 0.0) + b
        return out

    measured = {
        "bytes": by_phase("bytes"),
        "links": by_phase("link_bytes"),
        "calls": _sum(r["ledger"]["calls"], lambda ph, op: ph != "other"),
        "messages": _sum(r["ledger"]["messages"], lambda ph, op: ph != "other"),
    }
    model = {
        "bytes": r["model_bytes"],
        "links": r["model_links"],
        "calls": r["model_calls"],
        "messages": r["model_messages"],
    }
    forward = _sum(r["ledger"]["bytes"], lambda ph, op: ph == "forward" and op == "all_gather")
    return {"measured": measured, "model": model, "forward_all_gather": forward, "table_vii": r["table_vii"]}


def ted_check(r: dict[str, Any]) -> dict[str, Any]:
    """Ledger vs the planner's TED step for the run's model, in two parts: TED's micro-steps
    (``perf.ted`` per MoE block and the dense tensor-parallel all-reduces, ``ted_layouts.micro_traffic``
    x 2 micro-steps) and DeepSpeed ZeRO-1's step (gradient all-reduce in the boundary backward,
    weight all-gather after the step: ``ted_layouts.step_traffic``), with the step's scalars
    (gradient norm, overflow) apart."""
    from ds_ext.parallel import TEDLayout
    from ds_ext.planner import ted_layouts
    from ds_ext.planner.models import Arch
    from ds_ext.topology import Topology

    layers, hidden, heads, vocab, seq, experts = r["model"]
    arch = Arch(name="moe", layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=seq, experts=experts)
    topo = Topology.from_preset("frontier", r["world"])
    layout = TEDLayout.build(r["world"], r["tensor"], r["expert"])
    levels = layout.levels(topo, r["rank"])
    data = {levels["data"], levels["expert_data"]} - {levels["tensor"]}  # the ZeRO-1 all-reduce's levels, not TP's

    def zero1(ph, op, lv):
        return (ph == "backward" and op == "all_reduce" and lv in data) or (ph, op) == ("step", "all_gather")

    rows = r["ledger"]["bytes"]
    micro = ted_layouts.micro_traffic(arch, layout, topo, 2, 2)
    step = ted_layouts.step_traffic(arch, layout, topo, 2)
    return {
        "micro": _sum([x for x in rows if x[0] in ("forward", "backward") and not zero1(*x[:3])]),
        "model_micro": {lv: 2 * b for lv, b in micro.bytes.items()},
        "zero1": _sum([x for x in rows if zero1(*x[:3])]),
        "model_zero1": dict(step.bytes),
        "scalars": _sum([x for x in rows if x[0] == "step" and x[1] == "all_reduce"]),
    }


def pccl_check(ring: dict[str, Any], pccl: dict[str, Any]) -> dict[str, Any]:
    """Per op: the ring's calls and chunk bytes, PCCL's bytes and messages per level, and the
    model's (``perf.collectives.traffic`` of one chunk byte, times the ring's chunk bytes / calls)."""
    from ds_ext.perf import collectives
    from ds_ext.topology import Topology

    world = ring["world"]
    topo = Topology.from_preset("frontier", world)
    unit = collectives.traffic("pccl", topo, tuple(range(world)), 1.0)
    out = {}
    for op in ("all_gather", "reduce_scatter"):
        keep = lambda ph, o, op=op: o == op  # noqa: E731
        calls = _sum(ring["ledger"]["calls"], keep)[topo.levels[-1].name]
        chunks = _sum(ring["ledger"]["bytes"], keep)[topo.levels[-1].name] / (world - 1)
        out[op] = {
            "calls": calls,
            "ring": {"bytes": _sum(ring["ledger"]["bytes"], keep), "messages": _sum(ring["ledger"]["messages"], keep)},
            "pccl": {"bytes": _sum(pccl["ledger"]["bytes"], keep), "messages": _sum(pccl["ledger"]["messages"], keep)},
            "model": {
                "bytes": {lv: b * chunks for lv, (b, _) in unit.items()},
                "messages": {lv: m * calls for lv, (_, m) in unit.items()},
            },
            "messages_per_call": {"ring": world - 1, "pccl": sum(m for _, m in unit.values())},
        }
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    records: list[dict[str, Any]] = []
    for scheme in ZERO_SCHEMES:
        r = in_process(zero_topo_rank, args.world, args.rank, scheme)
        records.append(
            {"case": "zero_topo", "scheme": scheme, "world": args.world, "rank": args.rank, **zero_topo_check(r)}
        )
    r = in_process(ted_rank, args.world, args.rank, *TED_LAYOUT)
    records.append({"case": "ted", "world": args.world, "rank": args.rank, "layout": list(TED_LAYOUT), **ted_check(r)})
    for world in args.pccl_world:
        ring, hier = (in_process(pccl_rank, world, args.rank, a) for a in (None, "pccl"))
        records.append({"case": "pccl", "world": world, "rank": args.rank, **pccl_check(ring, hier)})
    payload = {"backend": "mirror (ds_ext.comm.mirror)", "records": records}
    path = write_json(args.out, payload)
    print(table(records))
    print(f"wrote {path}")
    return payload


def table(records: list[dict[str, Any]]) -> str:
    """One line per case: per level, the ledger's bytes and messages beside the model's."""
    lines = []
    for r in records:
        if r["case"] == "pccl":
            for op in ("all_gather", "reduce_scatter"):
                c = r[op]
                lines.append(
                    f"pccl {r['world']:>5} GCDs {op:<14} {c['calls']:.0f} calls; messages per call ring "
                    f"{c['messages_per_call']['ring']}, pccl {c['messages_per_call']['pccl']}; pccl ledger "
                    f"{c['pccl']['messages']} model {c['model']['messages']}"
                )
        elif r["case"] == "ted":
            lines.append(
                f"ted  {r['world']:>5} GCDs T x P {r['layout']}: micro-steps ledger {r['micro']} model "
                f"{r['model_micro']}; ZeRO-1 ledger {r['zero1']} model {r['model_zero1']}"
            )
        else:
            nic = sum(per.get("node", 0.0) for per in r["measured"]["links"].values())
            volume = sum(per.get("node", 0.0) for per in r["measured"]["bytes"].values())
            lines.append(
                f"zero {r['world']:>5} GCDs {r['scheme']:<15} forward all-gather {r['forward_all_gather']} "
                f"Table VII {r['table_vii']}; node bytes: volume {volume:.0f}, on the NIC {nic:.0f}"
            )
    return "\n".join(lines)
