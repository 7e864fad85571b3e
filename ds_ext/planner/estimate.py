"""One plan's prediction: memory per state, bytes per level, step time, fit.

Step time (α-β per level, compute at the machine's efficiency, no overlap)::

    t_step = F / (W peak efficiency) + Σ_L (bytes_L / β_L + messages_L α_L)

with F the step's FLOPs (``ds_ext.perf.compute.step_flops``), W ranks, and bytes_L /
messages_L what one rank sends over level L per optimizer step by the plan's own analytic model
(``ds_ext.zero_topo.perf``, ``ds_ext.perf.pmm``, ``ds_ext.perf.ted``), in 003's volume convention:
each collective at the outermost level its group spans. That is the convention of a ring's time:
every hop of a ring carries the same bytes at once, so the ring waits on its slowest hop, the
outermost link it crosses, whatever share of its hops cross it. What the NICs carry is another
figure: ``nic_bytes``, the link bytes (``ds_ext.comm.hops``: each byte at the level of the
link it crosses) leaving a node per rank, for the plans whose model books links (ZeRO-topo's presets).
Communication is not overlapped with compute: 003's ratios between ZeRO-3, ZeRO++ and
ZeRO-topo show that it was not hidden on Frontier, and it is the bound ds_ext's engines reach
without prefetch. TFLOPS per rank = F / (t_step W), GPT-NeoX's definition (spec A1).

Memory per rank and state: ``weights`` (16-bit parameters the rank keeps), ``secondary``
(ZeRO-topo / hpZ secondary partition; for 3D-PMM the Z-gathered weight blocks Algorithm 3
caches from forward to backward), ``gradients``, ``optimizer`` (fp32 master + Adam moments),
``activations`` (``ds_ext.perf.compute.activation_bytes``). A plan fits when their sum is at
most the device memory. ``max_params`` scales the model at the plan's bytes per parameter of
model states alone (003 §II-A: "not including data batches, temporary buffers, and
activations"), the size at which they fill the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

from ds_ext.perf.compute import step_flops
from ds_ext.perf.pmm import Bandwidths
from ds_ext.planner.machine import Machine
from ds_ext.planner.models import Arch
from ds_ext.topology import Topology

STATES: tuple[str, ...] = ("weights", "secondary", "gradients", "optimizer", "activations")


@dataclass(frozen=True)
class Job:
    """A model on a machine: the global batch, accumulation (None: fewest micro-steps that fit)."""

    arch: Arch
    machine: Machine
    topology: Topology
    global_batch: int
    grad_accum: int | None = None
    elem_bytes: int = 2
    checkpointing: bool = True
    batch_source: str = ""  # where the global batch comes from (printed with every plan)
    latency: bool = True  # charge α per message (False: 001 §5.1.2's Assumption 3, bandwidth only)
    eq_5_7: Bandwidths | None = None  # 3D-PMM axes at 001 Eq 5.7's bandwidths (ds-ext tune --links shared / --database)
    recipe_accum: bool = False  # grad_accum is the recipe's per-rank one (pure data parallelism), not given
    checkpointing_source: str = "ds_ext default"  # where the activation checkpointing setting comes from
    sparsity: float | None = None  # --sparsity: the model pruned by this fraction, trained with SAMO (001 ch. 4)

    @property
    def world(self) -> int:
        return self.topology.world_size

    @property
    def flops(self) -> float:
        """F of one optimizer step."""
        a = self.arch
        return step_flops(self.global_batch, a.seq, a.layers, a.hidden, a.vocab, self.checkpointing)


@dataclass(frozen=True)
class Traffic:
    """Per optimizer step, what one rank sends over each level and in how many messages."""

    bytes: dict[str, float]
    messages: dict[str, float]


@dataclass(frozen=True)
class Estimate:
    family: str  # "zero", "pmm3d", "ted"
    name: str
    config: dict  # the ds_config keys that select this plan
    micro_batch: int  # sequences per data-parallel replica per micro-step
    grad_accum: int
    memory: dict[str, float]  # bytes per rank, STATES
    traffic: Traffic
    compute_s: float
    comm_s: dict[str, float]  # seconds per level
    tflops: float  # per rank
    fits: bool
    reason: str  # why it does not fit ("" if it does)
    max_params: float
    notes: tuple[str, ...] = field(default_factory=tuple)
    nic: Callable[[], float] | None = field(default=None, repr=False, compare=False)

    @cached_property
    def nic_bytes(self) -> float | None:
        """Bytes per rank and step over the links out of its node (the NICs), the mean over a node's
        ranks, by the link model (module docstring); None where the plan's model books no links.
        Computed when asked: it evaluates the model once per rank of a node."""
        return None if self.nic is None else self.nic()

    @property
    def step_s(self) -> float:
        return self.compute_s + sum(self.comm_s.values())

    @property
    def total_memory(self) -> float:
        return sum(self.memory.values())


def comm_seconds(traffic: Traffic, topology: Topology, latency: bool = True) -> dict[str, float]:
    """α-β seconds per level (module docstring); ``latency=False``: β only."""
    out = {}
    for level, nbytes in traffic.bytes.items():
        lv = topology.level(level)
        out[level] = nbytes / lv.bandwidth + (traffic.messages.get(level, 0.0) * lv.latency if latency else 0.0)
    return out


def batch_options(job: Job, data: int, micro: int | None = None) -> list[tuple[int, int]]:
    """(micro-batch per replica, accumulation steps) for ``data`` replicas, fewest micro-steps first;
    ``micro``: that micro-batch only, its accumulation whatever the batch gives, unless one was given
    (a recipe's per-rank accumulation is pure data parallelism's and does not bind it)."""
    if job.global_batch % data:
        return []
    per = job.global_batch // data
    if micro is not None:
        fits = per % micro == 0 and (job.grad_accum is None or job.recipe_accum or per // micro == job.grad_accum)
        return [(micro, per // micro)] if fits else []
    steps = [job.grad_accum] if job.grad_accum else divisors(per)
    return [(per // g, g) for g in steps if per % g == 0]


def divisors(n: int) -> list[int]:
    """Divisors of ``n``, ascending."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


@dataclass(frozen=True)
class Dropped:
    """A plan the planner considered and does not rank, with the reason (no silent drops)."""

    family: str
    name: str
    reason: str


@dataclass(frozen=True)
class Candidate:
    """How a plan family describes one plan to :func:`evaluate`."""

    family: str
    name: str
    config: dict
    data: int  # data-parallel replicas
    states: dict[str, float]  # model-state bytes per rank (weights, secondary, gradients, optimizer)
    activations: Callable[[int], float]  # micro-batch -> bytes per rank
    traffic: Callable[[int, int], Traffic]  # (micro-batch, accumulation) -> per-step traffic
    unfit: Callable[[int], str | None] = lambda micro: None  # a micro-batch the plan cannot split
    notes: tuple[str, ...] = ()
    seconds: Callable[[int, int], dict[str, float]] | None = None  # another time model than α-β per level
    micro: int | None = None  # a fixed micro-batch (batch_options)
    stretch: Callable[[int, int], float] = lambda micro, accum: 1.0  # compute slots per busy slot (pipeline bubble)
    nic: Callable[[int, int], float] | None = None  # (micro-batch, accumulation) -> Estimate.nic_bytes


def unsplittable(job: Job, cand: Candidate) -> str:
    """Why :func:`evaluate` finds no (micro-batch, accumulation) for ``cand``."""
    if job.global_batch % cand.data:
        return f"the global batch of {job.global_batch} sequences does not divide over {cand.data} replicas"
    per = job.global_batch // cand.data
    if job.grad_accum and per % job.grad_accum:
        return f"--grad-accum {job.grad_accum} does not divide the {per} sequences per replica"
    if cand.micro is not None and not batch_options(job, cand.data, cand.micro):
        return f"micro-batch {cand.micro} does not divide the {per} sequences per replica" + (
            "" if job.grad_accum is None or job.recipe_accum else f" into --grad-accum {job.grad_accum} micro-steps"
        )
    reasons = [r for r in (cand.unfit(b) for b, _ in batch_options(job, cand.data)) if r]
    return reasons[0] + (f", nor any of its {len(reasons) - 1} smaller splits" if len(reasons) > 1 else "")


def evaluate(job: Job, cand: Candidate) -> Estimate | None:
    """The plan at the fewest micro-steps whose memory fits (or, if none does, the most);
    None if the global batch cannot be split over its replicas at all."""
    options = [(b, g) for b, g in batch_options(job, cand.data, cand.micro) if cand.unfit(b) is None]
    if not options:
        return None
    limit = job.machine.device_memory
    states = sum(cand.states.values())
    chosen = next(((b, g) for b, g in options if states + cand.activations(b) <= limit), options[-1])
    b, g = chosen
    memory = {**cand.states, "activations": cand.activations(b)}
    total = sum(memory.values())
    traffic = cand.traffic(b, g)
    comm = cand.seconds(b, g) if cand.seconds else comm_seconds(traffic, job.topology, job.latency)
    compute = job.flops / job.world / job.machine.flops * cand.stretch(b, g)
    step = compute + sum(comm.values())
    fits = total <= limit
    reason = "" if fits else f"needs {total / 1e9:.1f} GB per rank > {limit / 1e9:.1f} GB"
    return Estimate(
        cand.family,
        cand.name,
        cand.config,
        b,
        g,
        memory,
        traffic,
        compute,
        comm,
        job.flops / (step * job.world),
        fits,
        reason,
        limit * job.arch.params / states,
        cand.notes,
        None if cand.nic is None else lambda: cand.nic(b, g),  # type: ignore[misc]
    )
