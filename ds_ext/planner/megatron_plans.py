"""Megatron-DeepSpeed 3D parallelism (tensor x pipeline x data) as planner candidates (004 §II, §V-A).

A layout is (TP, PP, DP) with TP PP DP = W: TP inside a node and dividing the heads (004 §V-A:
"Limit Tensor-Parallelism to a Single Node"), PP dividing the layers, ZeRO-1 over DP (004 §V-A),
every micro-batch of ``MICRO_BATCHES`` and the model's recipe's (004 §IV, Fig 9: the micro-batch is
the most impactful setting; Table V runs MBS 1, GPT-NeoX's 20B.yml 4), one candidate each. Ranks are Megatron's order: TP innermost,
then DP, then PP. Notation: b micro-batch, m = B / (DP b) micro-batches per replica per step,
s sequence, h hidden, L layers, e bytes per element.

Time per step (1F1B, 004 §II-C and §V-A: DeepSpeed's pipeline engine, PipeDream's schedule): a
stage runs m forward-backward micro-batches and waits the (p - 1)-slot fill and drain, so every
per-micro-batch cost is stretched by the bubble, ``(m + p - 1) / m``. The stages run in
lockstep, so a slot is the slowest stage's: the last stage also runs the head, the V / (16 L h)
share of F (Narayanan et al.'s formula, ``perf.compute.step_flops``) that the mean stage holds
1 / p of (``stage_imbalance``)::

    t = (m + p - 1) / m x (F / (W peak eff) x imbalance + t_TP + t_PP) + t_DP

* t_TP: Megatron's all-reduces of b s h e over the TP group, per layer and micro-batch two in
  forward (attention out, FC2), two in backward (the f of QKV and FC1), two more in the
  checkpoint recompute; L / p layers per stage;
* t_PP: the stage boundary's point-to-point send, b s h e forward and b s h e backward per
  micro-batch (one message each), over the slowest boundary's level (a node's when the pipeline
  spans nodes). With TP > 1 DeepSpeed's pipeline engine sends each TP rank's 1 / TP slice and the
  receiving stage all-gathers it over the TP group (``pipe_partitioned`` / ``grad_partitioned``,
  default True: ``runtime/pipe/engine.py``, ``PartitionedTensor``; DeepSpeed 0.19.8);
* t_DP: ZeRO-1 once per step, as DeepSpeed's ZeRO-1 does it (``ted_layouts``): an all-reduce of
  the 16-bit gradients and an all-gather of the updated weights of the rank's parameters.

With ``zero_topo`` (a ``ds_ext.zero_topo`` section: ZeRO-topo's pipeline form in place of ZeRO-1,
``ds_ext.zero_topo.pipeline``) t_DP is instead ZeRO-topo's step over the data-parallel group
of rank 0 (its members' hierarchy, ``Topology.of_group``; the plan resolved there, then
``ShardingPlan.pipeline_form``): the larger end stage's parameters as whole-mode units of at most
``zero_optimization.reduce_bucket_size`` elements (DeepSpeed's 5e8 by default),
``zero_topo.perf.traffic(..., pipeline=True)``, the model the ledger tests hold the engine to; its
memory keeps 16-bit weights and gradients whole and the fp32 master and moments sharded at the
plan's optimizer level (``zero_topo.perf.memory``). Whether the tiled optimizer (001 §7.2) pays
there, the step's gradient reduction and optimizer phase counted, is :func:`tiled_optimizer`'s note.

With ``samo`` (a sparsity p, ``ds-ext plan --sparsity``: the model pruned and trained with SAMO,
001 ch. 4) the memory and t_DP are SAMO's instead (``samo_plans``: Eq. 4.1, the compressed
all-reduce of §4.2.1); :func:`candidates` builds that form of every layout the plugin runs beside
the dense one and lists the others' SAMO forms as dropped (``samo_plans.refusal``).

Memory per rank, the larger of the first stage (the embedding, p micro-batches in flight under
1F1B) and the last stage (the head, fp32 logits of its micro-batch, one in flight): 2 + 2 bytes per
parameter of 16-bit weights and gradients, 12 / DP of fp32 master and Adam moments (ZeRO-1);
activations per layer as ``perf.compute.activation_bytes`` with the matmul activations split
over TP, with checkpointing the layers' inputs of every micro-batch in flight plus one layer's
working set, without it every in-flight layer's working set.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from ds_ext.comm.emulation import message_steps
from ds_ext.comm.ledger import all_gather_bytes, all_reduce_bytes
from ds_ext.optim.config import DEFAULT_TILE_SIZE
from ds_ext.perf.compute import ActivationSplit, activation_bytes
from ds_ext.planner import PlannerError, samo_plans
from ds_ext.planner.estimate import Candidate, Dropped, Job, Traffic, comm_seconds, divisors
from ds_ext.planner.models import Arch
from ds_ext.topology import Topology
from ds_ext.zero_topo import perf
from ds_ext.zero_topo.layout import buckets
from ds_ext.zero_topo.perf import UnitSpec
from ds_ext.zero_topo.plan import ShardingPlan, ZeroTopoConfig, resolve_plan

REDUCE_BUCKET_SIZE = 500_000_000  # DeepSpeed's zero_optimization.reduce_bucket_size default (runtime/zero/config.py)
MICRO_BATCHES = (1, 2, 4, 8)  # swept (004 §IV); a recipe's own is added


def name(tp: int, pp: int, dp: int, micro: int | None = None) -> str:
    return f"megatron tp{tp} pp{pp} dp{dp}" + ("" if micro is None else f" mb{micro}")


def stage_params(arch: Arch, tp: int, pp: int) -> int:
    """Parameters one rank of the larger end stage holds: L / p blocks split over TP (Megatron: QKV,
    FC1 column-parallel with their biases, attention-out and FC2 row-parallel with whole biases,
    norms replicated), the vocabulary-parallel table on the first stage and the head on the last
    (Megatron keeps a copy of a tied embedding there), positions first, the final norm last."""
    h, f = arch.hidden, arch.ffn_mult * arch.hidden
    block = 4 * h + (3 * h * h + 3 * h) // tp + h * h // tp + h + (h * f + f) // tp + f * h // tp + h
    table = arch.vocab * h // tp
    positions = arch.seq * h if arch.learned_positions else 0
    if pp == 1:
        ends = table * (1 if arch.tied_embeddings else 2) + positions + 2 * h
    else:
        ends = table + max(positions, 2 * h)
    return arch.layers // pp * block + ends


def stage_param_shapes(arch: Arch, tp: int, pp: int) -> list[tuple[int, int]]:
    """The parameters of :func:`stage_params`, (numel, ndim) each: the larger end stage's table
    and positions or final norm, then its L / p blocks (``zero_plans._params``' order, split over TP)."""
    h, f = arch.hidden, arch.ffn_mult * arch.hidden
    block = [(h, 1), (h, 1), (3 * h * h // tp, 2), (3 * h // tp, 1), (h * h // tp, 2), (h, 1)]
    block += [(h, 1), (h, 1), (f * h // tp, 2), (f // tp, 1), (f * h // tp, 2), (h, 1)]
    table = [(arch.vocab * h // tp, 2)]
    positions = [(arch.seq * h, 2)] if arch.learned_positions else []
    if pp == 1:
        ends = table * (1 if arch.tied_embeddings else 2) + positions + [(h, 1), (h, 1)]
    else:
        ends = table + (positions if positions and arch.seq >= 2 else [(h, 1), (h, 1)])  # the larger end
    return ends + block * (arch.layers // pp)


def pipeline_form(
    job: Job, tp: int, pp: int, dp: int, section: dict[str, Any], bucket_size: int = REDUCE_BUCKET_SIZE
) -> tuple[ShardingPlan, list[UnitSpec]]:
    """ZeRO-topo's plan over the data-parallel group of rank 0 in its pipeline form, and the larger
    end stage's parameters cut into its whole-mode units of at most ``bucket_size`` elements
    (``zero_optimization.reduce_bucket_size``, as ``ds_ext.zero_topo.pipeline`` cuts them)."""
    members = list(range(0, tp * dp, tp))
    topology = job.topology
    if len(members) < topology.world_size:
        topology = topology.of_group(members, f"{topology.name}, data-parallel group of tp {tp} x pp {pp} x dp {dp}")
    plan = resolve_plan(ZeroTopoConfig(enabled=True, **section), topology).pipeline_form()
    shapes = stage_param_shapes(job.arch, tp, pp)
    return plan, [perf.unit_spec(plan, run) for run in buckets(shapes, [n for n, _ in shapes], bucket_size)]


def zero_topo_step_traffic(
    job: Job, tp: int, pp: int, dp: int, section: dict[str, Any], bucket_size: int = REDUCE_BUCKET_SIZE
) -> Traffic:
    """ZeRO-topo's pipeline form once per step, with the grad-norm all-reduce over the model group."""
    return _pipeline_step_traffic(job, tp, pp, dp, *pipeline_form(job, tp, pp, dp, section, bucket_size))


def _pipeline_step_traffic(job: Job, tp: int, pp: int, dp: int, plan: ShardingPlan, units: list[UnitSpec]) -> Traffic:
    """:func:`zero_topo_step_traffic` of a resolved :func:`pipeline_form`."""
    model = job.topology.level_of([r * tp * dp + t for r in range(pp) for t in range(tp)]) if tp * pp > 1 else None
    t = perf.traffic(plan, units, 1, job.elem_bytes, pipeline=True, model_parallel=(model, tp * pp))
    return Traffic(t.by_level(), t.steps_by_level())


def _levels(topology: Topology, tp: int, pp: int, dp: int) -> dict[str, str | None]:
    """The level each group of rank 0 spans (TP innermost, then DP, then PP); the pipeline's is
    its slowest boundary's (the whole group's level)."""
    return {
        "tensor": topology.level_of(range(tp)) if tp > 1 else None,
        "data": topology.level_of(range(0, tp * dp, tp)) if dp > 1 else None,
        "pipeline": topology.level_of(range(0, tp * dp * pp, tp * dp)) if pp > 1 else None,
    }


def micro_traffic(arch: Arch, job: Job, tp: int, pp: int, dp: int, micro: int, m: int) -> Traffic:
    """TP all-reduces and PP sends of ``m`` micro-batches, per level (module docstring)."""
    e, lv = job.elem_bytes, _levels(job.topology, tp, pp, dp)
    act = micro * arch.seq * arch.hidden * e
    nbytes: dict[str, float] = defaultdict(float)
    messages: dict[str, float] = defaultdict(float)
    if tp > 1:
        calls = m * (arch.layers // pp) * (6 if job.checkpointing else 4)
        nbytes[lv["tensor"]] += calls * all_reduce_bytes(act, tp)  # type: ignore[index]
        messages[lv["tensor"]] += calls * message_steps("all_reduce", tp)  # type: ignore[index]
    if pp > 1:
        nbytes[lv["pipeline"]] += 2 * m * act / tp  # type: ignore[index]
        messages[lv["pipeline"]] += 2 * m  # type: ignore[index]
        if tp > 1:  # the receiver's all-gather of the TP slices, activation and gradient
            nbytes[lv["tensor"]] += 2 * m * all_gather_bytes(act / tp, tp)  # type: ignore[index]
            messages[lv["tensor"]] += 2 * m * message_steps("all_gather", tp)  # type: ignore[index]
    return Traffic(dict(nbytes), dict(messages))


def step_traffic(arch: Arch, job: Job, tp: int, pp: int, dp: int) -> Traffic:
    """ZeRO-1 over DP once per step (module docstring)."""
    lv = _levels(job.topology, tp, pp, dp)
    nbytes: dict[str, float] = defaultdict(float)
    messages: dict[str, float] = defaultdict(float)
    if dp > 1:
        n, e = stage_params(arch, tp, pp), job.elem_bytes
        nbytes[lv["data"]] += 3 * n * e * (dp - 1) / dp  # type: ignore[index]
        messages[lv["data"]] += message_steps("all_reduce", dp) + message_steps("all_gather", dp)  # type: ignore[index]
    return Traffic(dict(nbytes), dict(messages))


def stage_imbalance(arch: Arch, pp: int) -> float:
    """The last stage's FLOPs over the mean stage's: L / p layers plus the head, whose share of
    ``perf.compute.step_flops`` is V / (16 L h) against the layers' 1 + s / (6 h)."""
    layers = 1 + arch.seq / (6 * arch.hidden)
    head = arch.vocab / (16 * arch.layers * arch.hidden)
    return (layers + pp * head) / (layers + head)


def activations(arch: Arch, tp: int, pp: int, micro: int, m: int, checkpointing: bool) -> float:
    """Peak activation bytes of the larger end stage (module docstring)."""
    split = ActivationSplit(tensor=tp, vocab=tp)
    per_stage = arch.layers // pp
    t = micro * arch.seq
    in_flight = min(pp, m)
    first = activation_bytes(t, per_stage * in_flight, arch.hidden, arch.heads, arch.seq, 0, split, checkpointing)
    last = activation_bytes(t, per_stage, arch.hidden, arch.heads, arch.seq, arch.vocab, split, checkpointing)
    return max(first, last)


def _sum(x: Traffic, y: Traffic) -> Traffic:
    return Traffic(
        {k: x.bytes.get(k, 0.0) + y.bytes.get(k, 0.0) for k in {*x.bytes, *y.bytes}},
        {k: x.messages.get(k, 0.0) + y.messages.get(k, 0.0) for k in {*x.messages, *y.messages}},
    )


def seconds(job: Job, tp: int, pp: int, dp: int, micro: int, m: int, step_t: Traffic) -> dict[str, float]:
    """Per level: the micro-batches' TP / PP time stretched by the bubble, plus the step's (``step_t``)."""
    stretched = comm_seconds(micro_traffic(job.arch, job, tp, pp, dp, micro, m), job.topology, job.latency)
    step = comm_seconds(step_t, job.topology, job.latency)
    bubble = (m + pp - 1) / m
    return {k: stretched.get(k, 0.0) * bubble + step.get(k, 0.0) for k in {*stretched, *step}}


def tiled_optimizer(
    limit: float, states: float, activations: float, untiled: float, reduction: float, tile_size: int, on: bool
) -> tuple[str, bool]:
    """Whether ``ds_ext.tiled_optimizer`` (001 §7.2) pays for the pipeline form: a note, and whether
    it does. The step runs after the last backward, one phase after the other: each unit's gradient
    reduction (``reduction``: the largest unit's, ``zero_topo.perf.reduction_bytes``), then the
    optimizer phase, whose buffers tiling cuts from at most ``untiled``
    (``zero_topo.perf.untiled_step_bytes``: the optimizer slice's fp32 copies) to its
    ``4 x tile_size`` buffer. A rank's peak is its states plus the largest of its activations and
    the two phases'. Tiling pays where the peak fits in ``limit`` tiled and not untiled. ``on``: the
    ds_config has it on."""
    peak = states + max(activations, reduction, untiled)
    tiled = states + max(activations, reduction, 4 * tile_size)
    figures = (
        f"the step's gradient reduction {reduction / 1e9:.2f} GB per bucket, optimizer phase at most "
        f"{untiled / 1e9:.2f} GB untiled, {4 * tile_size / 1e6:.1f} MB tiled; "
        f"peak {peak / 1e9:.1f} GB untiled, {tiled / 1e9:.1f} GB tiled, of {limit / 1e9:.1f} GB"
    )
    if peak <= limit:
        return f"ds_ext.tiled_optimizer {'on, not needed' if on else 'does not pay'}: {figures}", False
    if tiled <= limit:
        return f"ds_ext.tiled_optimizer {'on, needed' if on else 'pays, switched on'}: {figures}", True
    if states > limit:
        why = "the states alone exceed the device"
    elif activations >= reduction:
        why = "the activations set the peak"
    else:
        why = "the gradient reduction sets the peak (a smaller zero_optimization.reduce_bucket_size lowers it)"
    return f"ds_ext.tiled_optimizer does not make it fit, {why}: {figures}", False


def candidate(
    job: Job,
    tp: int,
    pp: int,
    dp: int,
    micro: int = 1,
    zero_topo: dict[str, Any] | None = None,
    samo: float | None = None,
    loss_scaled: bool = False,
    tile_size: int | None = None,
    bucket_size: int = REDUCE_BUCKET_SIZE,
) -> Candidate:
    """The layout with DeepSpeed's ZeRO-1, or with ``zero_topo`` (a ``ds_ext.zero_topo`` section)
    ZeRO-topo's pipeline form in its place, or with ``samo`` (a sparsity) SAMO's (module docstring).
    With ``zero_topo``: ``loss_scaled``, an fp16 loss scale; ``tile_size``, the ds_config's
    ``ds_ext.tiled_optimizer`` is on with it (:func:`tiled_optimizer`'s note; where it pays and is
    off, the candidate's config switches it on); ``bucket_size``, its
    ``zero_optimization.reduce_bucket_size``."""
    if samo is not None:
        why = samo_plans.refusal(tp, pp, job.arch.tied_embeddings) or (
            "SAMO runs beside no other ds_ext plugin" if zero_topo is not None else None
        )
        if why:
            raise PlannerError(f"{name(tp, pp, dp, micro)}{samo_plans.suffix(samo)}: {why}")
    a = job.arch
    n = stage_params(a, tp, pp)
    config = {
        "zero_optimization": {"stage": 1},
        "train_micro_batch_size_per_gpu": micro,
        "megatron": {"tensor-model-parallel-size": tp, "pipeline-model-parallel-size": pp},
    }
    states = {"weights": 2.0 * n, "secondary": 0.0, "gradients": 2.0 * n, "optimizer": 12.0 * n / dp}
    step_t = step_traffic(a, job, tp, pp, dp)
    suffix, notes = "", ()
    if zero_topo is not None:
        plan, units = pipeline_form(job, tp, pp, dp, zero_topo, bucket_size)
        e = job.elem_bytes
        U = sum(u.U for u in units)
        states = {
            "weights": e * U,
            "secondary": 0.0,
            "gradients": e * U,
            "optimizer": perf.memory(plan, units, 0, e)["optimizer"],
        }
        step_t = _pipeline_step_traffic(job, tp, pp, dp, plan, units)
        act = activations(a, tp, pp, micro, max(1, job.global_batch // (dp * micro)), job.checkpointing)
        fused = ZeroTopoConfig(enabled=True, **zero_topo).compile_quantizer
        verdict, pays = tiled_optimizer(
            job.machine.device_memory,
            sum(states.values()),
            act,
            perf.untiled_step_bytes(plan, units, 0, loss_scaled),
            max(perf.reduction_bytes(plan, u, e, fused) for u in units),
            tile_size or DEFAULT_TILE_SIZE,
            tile_size is not None,
        )
        section: dict[str, Any] = {"zero_topo": {"enabled": True, **zero_topo}}
        if pays and tile_size is None:
            section["tiled_optimizer"] = {"enabled": True, "tile_size": DEFAULT_TILE_SIZE}
        config |= {"zero_optimization": {"stage": 0, "reduce_bucket_size": bucket_size}, "ds_ext": section}
        suffix, notes = f" + zero_topo {zero_topo.get('preset', 'zero_topo')}", (plan.describe(), verdict)
    if samo is not None:
        states = samo_plans.states(n, samo, job.elem_bytes, dp)
        step_t = samo_plans.step_traffic(n, samo, job.elem_bytes, dp, _levels(job.topology, tp, pp, dp)["data"])
        config |= {"ds_ext": {"samo": samo_plans.section()}}
        suffix, notes = samo_plans.suffix(samo), (samo_plans.note(n, samo, dp),)
    return Candidate(
        family="megatron",
        name=name(tp, pp, dp, micro) + suffix,
        micro=micro,
        config=config,
        data=dp,
        states=states,
        activations=lambda b: activations(a, tp, pp, b, job.global_batch // (dp * b), job.checkpointing),
        traffic=lambda b, g: _sum(micro_traffic(a, job, tp, pp, dp, b, g), step_t),
        seconds=lambda b, g: seconds(job, tp, pp, dp, b, g, step_t),
        stretch=lambda b, g: (g + pp - 1) / g * stage_imbalance(a, pp),  # m = g micro-batches per replica
        notes=(
            f"1F1B bubble (p - 1) / m with p = {pp}; last stage (+ head) {stage_imbalance(a, pp):.3f} x the mean",
            *notes,
        ),
    )


def layouts(arch: Arch, topology: Topology) -> tuple[list[tuple[int, int, int]], list[Dropped]]:
    """Every (TP, PP, DP) of the module docstring; the (TP, PP) that break a rule, with the reason."""
    node = topology.ranks_per_node if len(topology.levels) > 1 else topology.world_size
    out, dropped = [], []
    for tp in divisors(topology.world_size):
        for pp in divisors(topology.world_size // tp):
            dp = topology.world_size // (tp * pp)
            if tp > node:
                reason = f"TP {tp} crosses a node of {node} ranks (004 §V-A)"
            elif arch.heads % tp or arch.hidden % tp:
                reason = f"TP {tp} does not divide heads {arch.heads} / hidden {arch.hidden}"
            elif arch.layers % pp:
                reason = f"PP {pp} does not divide {arch.layers} layers"
            else:
                out.append((tp, pp, dp))
                continue
            dropped.append(Dropped("megatron", name(tp, pp, dp), reason))
    return out, dropped


def candidates(job: Job) -> tuple[list[Candidate], list[Dropped]]:
    """Every layout of a dense model, with ``job.sparsity`` each one's SAMO form too (the TP > 1
    ones dropped with the plugin's reason); none for an MoE (the ted family plans it)."""
    if job.arch.experts > 1:
        return [], [Dropped("megatron", "megatron", "an MoE: the ted family plans it")]
    good, dropped = layouts(job.arch, job.topology)
    own = job.arch.recipe.micro_batch
    micros = sorted({*MICRO_BATCHES, *([own] if own else [])})
    out = [candidate(job, *lay, b) for lay in good for b in micros]
    p = job.sparsity
    if p is not None:
        for tp, pp, dp in good:
            why = samo_plans.refusal(tp, pp, job.arch.tied_embeddings)
            if why:
                dropped.append(Dropped("megatron", name(tp, pp, dp) + samo_plans.suffix(p), why))
            else:
                out += [candidate(job, tp, pp, dp, b, samo=p) for b in micros]
    return out, dropped
