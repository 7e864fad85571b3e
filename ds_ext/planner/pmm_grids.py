"""3D-PMM grids as planner candidates (001 ch. 5, 000 §V; ``ds_ext.perf.pmm``).

Every factorization (G_x, G_y, G_z, G_data) of the world that divides the model
(``perf.pmm.unfit_reason``), with ZeRO-1 over the data axis as ``ds-ext tune`` assumes.
A data-parallel replica of G_x G_y G_z ranks runs micro-batches of ``b`` sequences, each rank
``b s / G_z`` rows of them. Bytes per step are ``perf.pmm.items`` (Eqs 5.1-5.5 and the terms
ds_ext adds), memory ``perf.pmm.memory``; activations split rows over Z, the residual stream
over Y and matmul activations over X Y (001 §5.1.2's layout; the head is vocabulary-parallel,
so each rank keeps its rows' logits of its X block of the vocabulary).

Time is the planner's α-β per level, or, when the job asks for it (``ds-ext tune --links shared``
or ``--database``), 001 Eq 5.7's per-axis bandwidths (``perf.pmm.axis_bandwidths``) on the same
items: ``ds-ext tune`` and ``ds-ext plan --families pmm3d`` are this one module.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from ds_ext.comm.emulation import message_steps
from ds_ext.parallel import Grid
from ds_ext.perf import pmm as perf
from ds_ext.perf.compute import ActivationSplit, activation_bytes
from ds_ext.planner.estimate import Candidate, Dropped, Job, Traffic
from ds_ext.planner.models import Arch
from ds_ext.topology import Topology


def model_spec(arch: Arch, checkpointing: bool = True) -> perf.ModelSpec:
    """``perf.pmm.gpt_spec`` with ``arch``'s tables (no position table with rotary, an untied
    head) and, with activation checkpointing, every block's layers and norms recomputed in
    backward (as ``ds_ext.pmm.spec.model_spec`` reads a checkpointed GPT)."""
    spec = perf.gpt_spec(arch.hidden, arch.layers, arch.heads, arch.vocab, arch.seq, arch.ffn_mult)
    tables = [t for t in spec.tables if arch.learned_positions or t.name != "pos"]
    head = spec.head
    if not arch.tied_embeddings:
        tables.append(perf.TableSpec("head", arch.vocab, arch.hidden, lookup=False))
        head = replace(head, name="head")
    block = lambda x: checkpointing and x.name.startswith("blocks.")  # noqa: E731
    return replace(
        spec,
        tables=tuple(tables),
        head=head,
        layers=tuple(replace(L, recomputed=block(L)) for L in spec.layers),
        norms=tuple(replace(N, recomputed=block(N)) for N in spec.norms),
    )


def traffic(
    spec: perf.ModelSpec, grid: Grid, topology: Topology, micro: int, seq: int, elem_bytes: int, grad_accum: int
) -> Traffic:
    levels = grid.parallel_dims.spans(topology)
    nbytes: dict[str, float] = defaultdict(float)
    calls: dict[tuple[str, str], int] = defaultdict(int)
    for it in perf.items(spec, grid, micro, seq, elem_bytes, grad_accum, by_layer=False):
        nbytes[levels[it.axis]] += it.nbytes * it.calls  # type: ignore[index]
        calls[(it.op, it.axis)] += it.calls
    messages: dict[str, float] = defaultdict(float)
    for (op, axis), n in calls.items():
        messages[levels[axis]] += n * message_steps(op, getattr(grid, axis))  # type: ignore[index]
    return Traffic(dict(nbytes), dict(messages))


def eq_5_7_seconds(
    spec: perf.ModelSpec,
    grid: Grid,
    topology: Topology,
    micro: int,
    seq: int,
    elem_bytes: int,
    grad_accum: int,
    bw: perf.Bandwidths,
    latency: bool,
) -> dict[str, float]:
    """Seconds per level with every axis at its Eq 5.7 bandwidth (and α per ring step with ``latency``):
    ``perf.pmm.comm_time``'s sum, kept per level."""
    levels = grid.parallel_dims.spans(topology)
    beta = perf.axis_bandwidths(grid, topology, bw)
    out: dict[str, float] = defaultdict(float)
    for it in perf.items(spec, grid, micro, seq, elem_bytes, grad_accum, by_layer=False):
        level = levels[it.axis]
        out[level] += it.nbytes * it.calls / beta[it.axis]  # type: ignore[index]
        if latency:
            out[level] += it.calls * message_steps(it.op, getattr(grid, it.axis)) * topology.level(level).latency  # type: ignore[arg-type,index]
    return dict(out)


def states(spec: perf.ModelSpec, grid: Grid, elem_bytes: int) -> dict[str, float]:
    m = perf.memory(spec, grid, elem_bytes, zero_stage=1)
    return {
        "weights": m["layer_params"] + m["replicated_params"],
        "secondary": m["gathered_weights"],
        "gradients": m["layer_grads"] + m["replicated_grads"],
        "optimizer": m["optimizer"],
    }


def candidate(job: Job, grid: Grid, spec: perf.ModelSpec | None = None) -> Candidate:
    a, e = job.arch, job.elem_bytes
    spec = spec or model_spec(a, job.checkpointing)
    split = ActivationSplit(rows=grid.z, residual=grid.y, tensor=grid.x * grid.y, vocab=grid.x)
    return Candidate(
        family="pmm3d",
        name=f"pmm3d {grid.x}x{grid.y}x{grid.z}x{grid.data}",
        config={
            "zero_optimization": {"stage": 1},
            "ds_ext": {"pmm3d": {"enabled": True, "grid": {"x": grid.x, "y": grid.y, "z": grid.z, "data": grid.data}}},
        },
        data=grid.data,
        states=states(spec, grid, e),
        activations=lambda b: activation_bytes(
            b * a.seq, a.layers, a.hidden, a.heads, a.seq, a.vocab, split, job.checkpointing
        ),
        traffic=lambda b, g: traffic(spec, grid, job.topology, b, a.seq, e, g),
        unfit=lambda b: None if b % grid.z == 0 else f"z={grid.z} does not divide the micro-batch {b}",
        seconds=None
        if job.eq_5_7 is None
        else lambda b, g: eq_5_7_seconds(spec, grid, job.topology, b, a.seq, e, g, job.eq_5_7, job.latency),  # type: ignore[arg-type]
    )


def candidates(job: Job) -> tuple[list[Candidate], list[Dropped]]:
    """Every grid whose layers, heads and hidden sizes it divides (``perf.pmm.unfit_reason`` at a
    micro-batch of G_z; the candidate then only needs G_z to divide its micro-batch) and whose
    model states alone fit the device (as ``perf.pmm.rank_grids`` filters); none for an MoE.
    The others are returned as dropped, with the reason."""
    name = lambda g: f"pmm3d {g.x}x{g.y}x{g.z}x{g.data}"  # noqa: E731
    grids = perf.factorizations(job.world)
    if job.arch.experts > 1:
        return [], [Dropped("pmm3d", name(g), "3D-PMM has no experts (an MoE): the ted family plans it") for g in grids]
    spec = model_spec(job.arch, job.checkpointing)
    out, dropped = [], []
    limit = job.machine.device_memory
    for g in grids:
        reason = perf.unfit_reason(spec, g, g.z)
        if reason is not None:
            dropped.append(Dropped("pmm3d", name(g), reason))
            continue
        c = candidate(job, g, spec)
        states = sum(c.states.values())
        if states <= limit:
            out.append(c)
        else:
            dropped.append(
                Dropped(
                    "pmm3d", c.name, f"model states alone need {states / 1e9:.1f} GB per rank > {limit / 1e9:.1f} GB"
                )
            )
    return out, dropped
