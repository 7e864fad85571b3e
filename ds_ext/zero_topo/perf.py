"""Analytic traffic and memory of a ZeRO-topo plan (003 §V-C, §V-D, Tables V-VIII).

Bytes sent by one rank per optimizer step, per phase and topology level, following the
ledger's convention (ds_ext/comm/ledger.py) and exactly the collectives the engine
issues (``ds_ext.zero_topo.schedule``, which the executor reads too), so that a measured ledger equals this model.

Notation: U padded unit size (elements), e bytes per 16-bit (or fp32) element,
n_L = shards(L) = ranks in one domain of level L, d the group size, B the quantization
block, wire_b(n) = n b / 8 + 4 n / B for a quantized chunk of n elements.
Per micro-batch, for every unit:
  forward   all-gather of the source shard over span(source)   n (d-1) bytes per chunk;
            with an hpZ secondary narrower than the primary, the step's first forward gathers
            the primary and the others the secondary (DeepSpeed >= 0.13.2, PR #4906, and
            ds_ext's engine); ``secondary_serves_forward=False`` charges the primary in every
            micro-batch, as DeepSpeed 0.13.1 (003's version, Table IX) did under activation
            checkpointing: its recompute gathers with grad enabled, which hpZ did not serve
  backward  all-gather of the backward source (not the root unit, kept from forward)
            reduce of the gradient: reduce-scatter U e (d-1)/d, or int-b all-to-all
            (1 hop, or hop 1 over the node + hop 2 over N nodes): every chunk but the
            rank's own, each of q quantized blocks (B b / 8 + 4 bytes) and r raw blocks of
            1-D parameters (B e bytes), per the unit's raw-block counts per gradient shard;
            without raw blocks, wire_b(U)(d-1)/d.
Per step: the cross-level reduction (reduce-scatter / all-reduce of U e / n_g), the
grad-norm all-reduce (8 bytes), and the weight all-gather back to the primary shard.

With ``algorithm="pccl"`` (``ds_ext.comm.algorithm``, 001 §6.2) every all-gather and
reduce-scatter (quantized all-gathers included: they are two all-gathers) is split over the
levels its phases run on, by ``ds_ext.perf.collectives.traffic``: across nodes c (N-1) bytes in
ceil(log2 N) messages, inside the node c N (M-1) in M-1, one call at each level. ``ring`` counts
as ``native`` (the ledger's convention is the ring).

Link bytes (``Traffic.links``, the ledger's ``link_bytes``: each byte at the level of the link to
the peer it goes to, ``ds_ext.comm.hops``), modelled for the ``native`` algorithm under the given
backend (``gloo``: its all-reduce ring runs to the previous rank, and ds_ext's reduce-scatter is an
all_to_all of the chunks; else NCCL / RCCL's group-order rings): this rank's ring neighbour in
each group, or each peer of an all_to_all with the bytes of the shard it owns.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from ds_ext.comm import hops
from ds_ext.comm.emulation import message_steps
from ds_ext.perf import collectives
from ds_ext.topology import Topology
from ds_ext.zero_topo import schedule
from ds_ext.zero_topo.layout import padded_numel, param_offsets, shard_count, shard_index
from ds_ext.zero_topo.plan import ShardingPlan


@dataclass(frozen=True)
class UnitSpec:
    """One gather/release unit: padded size U, real parameter count, root or not; the
    collectives one gather of it takes (1 in ds_ext's engine; DeepSpeed's ZeRO-3 fetches per
    submodule, so a transformer block is several: ``ds_ext.planner.zero_plans``); where the
    engine measured one, the [start, stop) of each trainable parameter in the unit's flat
    order (default: one run from 0) and the raw (unquantized) gradient blocks in each
    gradient shard, in shard order (default: none)."""

    U: int
    numel: int
    root: bool = False
    gathers: int = 1
    spans: tuple[tuple[int, int], ...] = ()
    raw_per_shard: tuple[int, ...] = ()

    def trainable_spans(self) -> tuple[tuple[int, int], ...]:
        return self.spans or ((0, self.numel),)


def _members(topology: Topology, rank: int, levels: list[int]) -> tuple[int, ...]:
    """The group of ``rank`` over topology ``levels``: the ranks that differ from it only there,
    ascending (its process group's rank order; rank 0's is congruent to every other group)."""
    mine = topology.coords(rank)
    others = [i for i in range(len(topology.levels)) if i not in levels]
    return tuple(r for r in range(topology.world_size) if all(topology.coords(r)[i] == mine[i] for i in others))


def _raw_blocks_per_shard(
    params: list[tuple[int, int]], offsets: list[int], block: int, per: int, shards: int
) -> tuple[int, ...]:
    """Blocks holding a 1-D parameter in each of ``shards`` gradient shards of ``per`` blocks: the
    union of the 1-D parameters' block intervals, each interval split over the shards it crosses
    (as many steps as 1-D parameters and shards, not as blocks: millions of blocks, 8k shards)."""
    spans: list[list[int]] = []
    for (n, dim), o in zip(params, offsets):
        if dim <= 1:
            lo, hi = o // block, -(-(o + n) // block)
            if spans and lo <= spans[-1][1]:  # packed 1-D parameters sharing a block
                spans[-1][1] = max(spans[-1][1], hi)
            else:
                spans.append([lo, hi])
    out = [0] * shards
    for lo, hi in spans:
        while lo < hi:
            k = lo // per
            end = min(hi, (k + 1) * per)
            out[k] += end - lo
            lo = end
    return tuple(out)


def unit_spec(plan: ShardingPlan, params: list[tuple[int, int]], root: bool = False, gathers: int = 1) -> UnitSpec:
    """The unit of trainable parameters ``params`` ((numel, ndim) each, in order) as the engine
    lays it out under ``plan`` (``ds_ext.zero_topo.layout``; with per-parameter quantization groups:
    block-aligned offsets, 1-D parameters' blocks unquantized in the gradient reduction)."""
    B = plan.block_size
    offsets, end = param_offsets([n for n, _ in params], B, plan.aligned)
    U = padded_numel(end, plan.topology.world_size, B)
    n_g = shard_count(plan.topology, plan.gradients)
    per = U // B // n_g
    raw_per_shard = _raw_blocks_per_shard(params, offsets, B, per, n_g) if plan.raw_1d_gradients else (0,) * n_g
    return UnitSpec(
        U,
        sum(n for n, _ in params),
        root,
        gathers,
        tuple((o, o + n) for (n, _), o in zip(params, offsets)),
        raw_per_shard,
    )


class _Tally:
    def __init__(self, topology: Topology, algorithm: str = "native", rank: int = 0, gloo: bool = False) -> None:
        if algorithm not in ("native", "ring", "pccl"):
            raise ValueError(
                f"ds_ext.zero_topo.perf models ds_ext.comm.algorithm native, ring or pccl; got {algorithm!r}"
            )
        self.topology = topology
        self.algorithm = algorithm
        self.rank, self.gloo = rank, gloo
        self.bytes: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.calls: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.steps: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.links: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._groups: dict[tuple[int, tuple[int, ...]], tuple[int, ...]] = {}

    def members(self, rank: int, levels: list[int]) -> tuple[int, ...]:
        """:func:`_members`, computed once per group: a model at 9,408 ranks asks for the same few
        groups once per unit."""
        key = (rank, tuple(levels))
        if key not in self._groups:
            self._groups[key] = _members(self.topology, rank, levels)
        return self._groups[key]

    def add_links(self, phase: str, links: dict[str, float], times: int = 1) -> None:
        for lv, b in links.items():
            self.links[phase][lv] += b * times

    def link(
        self,
        phase: str,
        op: str,
        levels: list[int],
        nbytes: float,
        times: int,
        per_peer: dict[int, float] | None = None,
    ) -> None:
        """The link bytes of ``times`` collectives of ``op`` over the group of topology ``levels``
        in which this rank sends ``nbytes`` (module docstring); ``per_peer``: an all_to_all's bytes
        per group member (topology rank)."""
        members = self.members(self.rank, levels)
        d = len(members)
        if d < 2 or times == 0:
            return
        if per_peer is None and (op == "reduce_scatter" and self.gloo or op == ""):
            per_peer = {r: nbytes / (d - 1) for r in members}  # an all_to_all of equal chunks
        payload = {
            "all_gather": nbytes / (d - 1),
            "all_reduce": nbytes * d / (2 * (d - 1)),
            "reduce_scatter": nbytes * d / (d - 1),
        }.get(op, nbytes)
        peer_bytes = None if per_peer is None else [per_peer[r] for r in members]
        peers = hops.sends(op, members, self.rank, payload, self.gloo, per_peer=peer_bytes)
        self.add_links(phase, hops.by_level(self.topology, self.rank, peers), times)

    def add(
        self,
        phase: str,
        level: str | None,
        nbytes: float,
        calls: int,
        times: int = 1,
        op: str = "",
        d: int = 1,
        levels: list[int] | None = None,
    ) -> None:
        """``calls`` collectives of ``op`` over ``d`` ranks (all_reduce: 2 (d - 1) messages each, any
        other op d - 1), repeated ``times``; an all-gather / reduce-scatter over topology ``levels``
        by pccl is split over its phases' levels."""
        if level is None or times == 0:
            return
        if levels is not None and self.algorithm != "pccl":
            self.link(phase, op, levels, nbytes, times)
        if self.algorithm == "pccl" and op in ("all_gather", "reduce_scatter"):
            ranks = self.members(0, levels)  # type: ignore[arg-type]
            for lv, (b, m) in collectives.traffic("pccl", self.topology, ranks, nbytes / (d - 1)).items():
                self.bytes[phase][lv] += b * times
                self.calls[phase][lv] += calls * times
                self.steps[phase][lv] += calls * m * times
            return
        self.bytes[phase][level] += nbytes * times
        self.calls[phase][level] += calls * times
        self.steps[phase][level] += calls * message_steps(op, d) * times


@dataclass
class Traffic:
    """Bytes and calls per step: ``bytes[phase][level]``."""

    bytes: dict[str, dict[str, float]]
    calls: dict[str, dict[str, float]]
    steps: dict[str, dict[str, float]] = field(default_factory=dict)  # ring / pairwise messages (α terms)
    # link bytes[phase][level of the link] (module docstring); None where not modelled (pccl)
    links: dict[str, dict[str, float]] | None = None

    def by_level(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for per in self.bytes.values():
            for lv, b in per.items():
                out[lv] += b
        return dict(out)

    def calls_by_level(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for per in self.calls.values():
            for lv, c in per.items():
                out[lv] += c
        return dict(out)

    def __add__(self, other: "Traffic") -> "Traffic":
        """Both tallies (ZeRO-topo's dense units and its experts, over their own groups)."""

        def merged(a: dict, b: dict) -> dict:
            out = {ph: dict(per) for ph, per in a.items()}
            for ph, per in b.items():
                for lv, v in per.items():
                    out.setdefault(ph, {})[lv] = out.get(ph, {}).get(lv, 0) + v
            return out

        links = None if self.links is None or other.links is None else merged(self.links, other.links)
        return Traffic(
            merged(self.bytes, other.bytes), merged(self.calls, other.calls), merged(self.steps, other.steps), links
        )

    def steps_by_level(self) -> dict[str, float]:
        """Sequential messages per level (ds_ext.comm.emulation.message_steps per call), the
        count an alpha-beta model charges the level's latency for."""
        out: dict[str, float] = defaultdict(float)
        for per in self.steps.values():
            for lv, c in per.items():
                out[lv] += c
        return dict(out)


def _wire(n: float, bits: int, block: int) -> tuple[float, float]:
    """(payload bytes, scale bytes) of n quantized elements."""
    return n * bits / 8, 4 * n / block


def _level(plan: ShardingPlan, levels: list[int]) -> str | None:
    """Outermost level of a group over ``levels`` whose size exceeds one."""
    live = [i for i in levels if plan.topology.levels[i].size > 1]
    return plan.topology.levels[max(live)].name if live else None


def _group_size(plan: ShardingPlan, levels) -> int:
    return math.prod(plan.topology.levels[i].size for i in levels)  # type: ignore[misc]


def traffic(
    plan: ShardingPlan,
    units: list[UnitSpec],
    grad_accum: int,
    elem_bytes: int,
    secondary_serves_forward: bool = True,
    algorithm: str = "native",
    rank: int = 0,
    model_parallel: tuple[str | None, int] = (None, 1),
    pipeline: bool = False,
    gloo: bool = False,
    model_links: dict[str, float] | None = None,
) -> Traffic:
    """Bytes and calls per optimizer step of ``plan`` for ``units`` at ``grad_accum``, as rank
    ``rank`` of its data-parallel group sends them (module docstring; ranks differ only where raw
    blocks are uneven). ``model_parallel``: (outermost level, size) of the model-parallel group
    the grad-norm all-reduce also runs over (``ds_ext.zero_topo.data_group``). ``pipeline``: the
    pipeline form (``ds_ext.zero_topo.pipeline``): weights whole, no gathers in forward or backward;
    at the step the accumulated gradients are reduced once, the step runs, and the weights are
    gathered back whole. ``gloo``: the backend whose algorithms the link bytes follow (module
    docstring); ``model_links``: the link bytes of the grad-norm all-reduce over the model-parallel
    group, whose members the data group's topology does not hold."""
    t = _Tally(plan.topology, algorithm, rank, gloo)
    model_links = model_links or {}
    B = plan.block_size

    def gather(phase: str, c: schedule.Collective, u: UnitSpec, times: int) -> None:
        """``u.gathers`` all-gathers ``c`` (payload and scales each when quantized) of the unit's bytes."""
        levels = list(c.levels)
        d = _group_size(plan, levels)
        n = u.U / d
        if c.bits == 8:
            pay, sc = _wire(n, 8, B)
            t.add(phase, _level(plan, levels), (pay + sc) * (d - 1), 2 * u.gathers, times, "all_gather", d, levels)
        else:
            t.add(phase, _level(plan, levels), n * elem_bytes * (d - 1), u.gathers, times, "all_gather", d, levels)

    held = plan.secondary is not None
    first = schedule.weight_gather(plan, backward=False, secondary_held=False)  # the step's first forward
    later = schedule.weight_gather(plan, backward=False, secondary_held=held)  # hpZ: built by the first, kept
    for u in units:
        if pipeline:
            _gradient_reduce(t, plan, u, elem_bytes, 1, rank, "step")
            _step(t, plan, u.U, elem_bytes)
            gather("step", schedule.weight_gather(plan, False, False, exact=True), u, 1)  # back into whole weights
            continue
        if secondary_serves_forward and later != first:
            gather("forward", first, u, 1)
            gather("forward", later, u, grad_accum - 1)
        else:
            gather("forward", first, u, grad_accum)
        if not u.root:
            gather("backward", schedule.weight_gather(plan, backward=True, secondary_held=held), u, grad_accum)
        _gradient_reduce(t, plan, u, elem_bytes, grad_accum, rank)
        _step(t, plan, u.U, elem_bytes)
    o_levels = list(range(plan.optimizer + 1))
    d = _group_size(plan, o_levels)
    t.add("step", _level(plan, o_levels), 2 * 8 * (d - 1) / d, 1, op="all_reduce", d=d, levels=o_levels)  # grad norm
    level, m = model_parallel
    t.add("step", level, 2 * 8 * (m - 1) / m, 1, op="all_reduce", d=m)  # ... and over the model-parallel group
    if m > 1:
        t.add_links("step", model_links)
    return Traffic(
        {p: dict(v) for p, v in t.bytes.items()},
        {p: dict(v) for p, v in t.calls.items()},
        {p: dict(v) for p, v in t.steps.items()},
        None if algorithm == "pccl" else {p: dict(v) for p, v in t.links.items()},
    )


def _gradient_reduce(
    t: _Tally, plan: ShardingPlan, u: UnitSpec, e: int, times: int, rank: int, phase: str = "backward"
) -> None:
    U, g, B = u.U, plan.gradients, plan.block_size
    c = schedule.gradient_reduce(plan)
    levels = list(c.levels)
    d = _group_size(plan, levels)
    if c.op == schedule.REDUCE_SCATTER:
        t.add(phase, _level(plan, levels), U * e * (d - 1) / d, 1, times, "reduce_scatter", d, levels)
        return
    per = U // (d * B)  # blocks per gradient shard
    raw = u.raw_per_shard or (0,) * d
    code, value = B * c.bits / 8 + 4, B * e  # bytes of a quantized / a raw block

    def sent(shards: list[int]) -> float:
        return sum((per - raw[k]) * code + raw[k] * value for k in shards)

    def calls(shards: list[int]) -> int:  # payload (+ scales where any block is quantized)
        return 2 if any(raw[k] < per for k in shards) else 1

    topo = plan.topology
    if c.hops == 1:
        others = [k for k in range(d) if k != shard_index(topo, rank, g)]
        t.add(phase, _level(plan, levels), sent(others), calls(range(d)), times, d=d)
        per_peer = {r: sent([shard_index(topo, r, g)]) for r in t.members(rank, levels)}
        t.link(phase, "all_to_all", levels, 0.0, times, per_peer)
        return
    inner = list(range(g))
    p, n = _group_size(plan, inner), topo.levels[g].size
    mine, mine_g = shard_index(topo, rank, g - 1), topo.coords(rank)[g]
    peers = [k for k in range(d) if k // n != mine]  # shard k = (intra digits, level-g digit)
    t.add(phase, _level(plan, inner), sent(peers), calls(range(d)), times, d=p)

    def reduced_by(r: int) -> list[int]:  # the shards whose inner digits are r's: hop 1 sends them to r
        s = shard_index(topo, r, g - 1)
        return list(range(s * n, (s + 1) * n))

    hop1 = {r: sent(reduced_by(r)) for r in t.members(rank, inner)}
    t.link(phase, "all_to_all", inner, 0.0, times, hop1)
    own = [mine * n + c for c in range(n)]  # the partial sums this rank holds after hop 1
    t.add(phase, _level(plan, [g]), sent([k for k in own if k % n != mine_g]), calls(own), times, d=n)
    hop2 = {r: sent([mine * n + topo.coords(r)[g]]) for r in t.members(rank, [g])}
    t.link(phase, "all_to_all", [g], 0.0, times, hop2)


def _step(t: _Tally, plan: ShardingPlan, U: int, e: int) -> None:
    """The step boundary of one unit of ``U`` elements: ``schedule.step_reductions`` of its gradient
    shard, then ``schedule.step_gathers`` of its updated optimizer slice."""
    n_of = lambda lv: _group_size(plan, range(lv + 1))  # noqa: E731
    B = plan.block_size
    x = U / n_of(plan.gradients)
    for c in schedule.step_reductions(plan):
        levels = list(c.levels)
        d = _group_size(plan, levels)
        if c.op == schedule.ALL_REDUCE:
            t.add("step", _level(plan, levels), 2 * x * e * (d - 1) / d, 1, op="all_reduce", d=d, levels=levels)
            continue
        if c.op == schedule.ALL_TO_ALL_REDUCE:  # int8 all-to-all reduce-scatter: payload + scales
            t.add("step", _level(plan, levels), sum(_wire(x, c.bits, B)) * (d - 1) / d, 2, d=d, levels=levels)
        else:
            t.add("step", _level(plan, levels), x * e * (d - 1) / d, 1, op="reduce_scatter", d=d, levels=levels)
        x /= d
    x = U / n_of(plan.optimizer)
    for c in schedule.step_gathers(plan):
        levels = list(c.levels)
        d = _group_size(plan, levels)
        quantized = c.bits == 8  # int8 all-gather: payload + scales
        nbytes = sum(_wire(x, c.bits, B)) if quantized else x * e
        t.add(
            "step", _level(plan, levels), nbytes * (d - 1), 2 if quantized else 1, op="all_gather", d=d, levels=levels
        )
        x *= d


def memory(plan: ShardingPlan, units: list[UnitSpec], rank: int, elem_bytes: int) -> dict[str, float]:
    """Bytes rank ``rank`` holds per state (003 Tables V/VI): primary, secondary (at its
    peak, before the step), gradients, optimizer (fp32 master + two Adam moments)."""
    n = lambda lv: _group_size(plan, range(lv + 1))  # noqa: E731
    out = {"primary": 0.0, "secondary": 0.0, "gradients": 0.0, "optimizer": 0.0}
    for u in units:
        out["primary"] += u.U / n(plan.weights) * elem_bytes
        if plan.secondary is not None:
            m = u.U / n(plan.secondary)
            out["secondary"] += sum(_wire(m, 8, plan.block_size)) if plan.secondary_bits == 8 else m * elem_bytes
        out["gradients"] += u.U / n(plan.gradients) * elem_bytes
        size = u.U // n(plan.optimizer)
        a = shard_index(plan.topology, rank, plan.optimizer) * size
        out["optimizer"] += 12 * sum(max(0, min(a + size, hi) - max(a, lo)) for lo, hi in u.trainable_spans())
    return out


# The bytes per optimizer element that ZeRO-topo's untiled step (optimizer.py ``_untiled_step``)
# allocates beside the states and the tiled step (001 §7.2) does not: the reduced gradient slice
# up-cast to fp32, its unscaled copy where an fp16 loss scale divides it, and at most one more
# fp32 temporary per element in a foreach Adam (torch's ``_multi_tensor_adam``: the denominator;
# DeepSpeed's FusedAdam makes none).
UPCAST_BYTES, UNSCALED_BYTES, FOREACH_ADAM_BYTES = 4, 4, 4


def untiled_step_bytes(plan: ShardingPlan, units: list[UnitSpec], rank: int, loss_scaled: bool) -> float:
    """At most the bytes ZeRO-topo's untiled step holds beside the states that the tiled
    optimizer replaces by its one fp32 tile buffer (``4 x tile_size``): the terms above over
    rank ``rank``'s optimizer elements (the trainable ones of its optimizer slices, 12 bytes
    each in :func:`memory`); ``loss_scaled``: an fp16 loss scale (bf16 and fp32 have none)."""
    elements = memory(plan, units, rank, 2)["optimizer"] / 12
    return elements * (UPCAST_BYTES + (UNSCALED_BYTES if loss_scaled else 0) + FOREACH_ADAM_BYTES)


# The quantizer's working memory beside its input and output, per element (ds_ext.comm.quant
# ``_encode`` / ``_decode``, measured alike by tests/test_tiled_optimizer_memory.py). Eager (one
# torch op at a time, ``zero_topo.compile_quantizer`` false): encode holds at most three fp32 arrays
# of the blocks at once (the up-cast, the rounded and the clamped codes); decode the fp32 codes
# beside their scaled product, and with int4 the int16 nibbles and their concatenation (1 + 2 bytes
# per element). Fused (compile_quantizer true): none on an accelerator (one Triton launch each way),
# and at most the int4 codes' int16 concatenation (2 bytes per element) that torch.compile keeps on
# the CPU.
EAGER_ENCODE_BYTES = 12


def decode_work_bytes(bits: int, fused: bool) -> int:
    """Bytes per element the decode holds beside its fp32 output (above)."""
    if fused:
        return 2 if bits == 4 else 0
    return 4 + (3 if bits == 4 else 0)


def quantized_reduce_bytes(
    n: float, d: int, e_in: int, e_raw: int, raw: float, bits: int, B: int, fused: bool
) -> float:
    """At most the bytes ``comm.quantized.all_to_all_reduce`` holds beside its input of ``n``
    elements (``e_in`` bytes each, ``raw`` of them in raw blocks sent as ``e_raw``-byte values) over
    ``d`` ranks, its fp32 result of n / d elements included. Without raw blocks: the encode (its
    working memory and codes), then the codes sent and received (the sent ones counted until the
    call returns), the fp32 decode of the d received chunks beside its working memory or their sum.
    With raw blocks: the quantized blocks gathered (e_in per element) and encoded; then the codes,
    the raw values, their joined message and its receive buffer; then the fp32 result rows of the d
    chunks (4 n) with the decoded blocks written into them, and their sum."""
    enc = 0 if fused else EAGER_ENCODE_BYTES * n
    dec = decode_work_bytes(bits, fused) * n
    q = n - raw
    codes = sum(_wire(q, bits, B))
    if not raw:
        return max(enc + codes, 2 * codes + 4 * n + max(dec, 4 * n / d))
    values = e_raw * raw
    wire = codes + values
    return max(
        e_in * q + enc + codes,
        codes + values + 2 * wire,
        codes + values + wire + 4 * n + 4 * q + max(dec, 4 * n / d),
    )


def reduction_bytes(plan: ShardingPlan, unit: UnitSpec, elem_bytes: int, fused: bool, gloo: bool = False) -> float:
    """At most the bytes ``FlatUnit.reduce_gradients`` holds beside the states while it reduces one
    whole-mode unit's gradients (the pipeline form's step, one unit at a time: ``reduce_bucket_size``
    bounds U), read from the code: the flat gradient (e U) beside the parameters' gradients, which
    it then replaces (each freed once copied); its copy in the group's rank order where the group
    spans several levels (e U); then the plan's gradient reduction (``schedule.gradient_reduce``): a
    16-bit reduce-scatter's output (e U / d; with ``gloo`` beside the e U it receives,
    ``comm.collectives``' all_to_all form), or the quantized all-to-all
    (:func:`quantized_reduce_bytes`), with two hops the first over the inner levels' P ranks, then
    its fp32 partial sums (4 U / P) beside the second hop over their U / P elements. ``fused``:
    ``zero_topo.compile_quantizer``."""
    e, U, B = elem_bytes, unit.U, plan.block_size
    c = schedule.gradient_reduce(plan)
    raw = sum(unit.raw_per_shard) * B
    if c.hops == 1:
        d = _group_size(plan, c.levels)
        ordered = e * U if len(c.levels) > 1 else 0
        if c.op == schedule.REDUCE_SCATTER:
            return max(e * U, ordered + e * U / d + (e * U if gloo else 0))
        return max(e * U, ordered + quantized_reduce_bytes(U, d, e, e, raw, c.bits, B, fused))
    g = c.level
    P, N = _group_size(plan, range(g)), _group_size(plan, [g])
    by_peer = e * U if g > 1 else 0
    first = quantized_reduce_bytes(U, P, e, e, raw, c.bits, B, fused)
    second = 4 * U / P + quantized_reduce_bytes(U / P, N, 4, e, raw / P, c.bits, B, fused)
    return max(e * U, by_peer + max(first, second))
