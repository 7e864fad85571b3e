"""Communication and memory model of 3D-PMM (001 §5.1.2, Eqs 5.1-5.7; 000 §V-B).

Notation (001 §5.1.2): grid G = (G_x, G_y, G_z, G_data), X innermost; a layer computes
O = I W with I of m x k, W of k x n; m = micro-batch x sequence rows of one data-parallel
group (each rank holds m / G_z of them); e bytes per element. Per layer and micro-step,
in bytes sent by one rank (the ledger's convention, ds_ext/comm/ledger.py), which is the
paper's time times β:

    AG_z    (G_z - 1) k n / (G_x G_y G_z) e                       (5.1)  forward, line 2
    RS_z    (G_z - 1)/G_z  k n / (G_x G_y) e                      (5.2)  backward, line 14
    AR_y    2 (G_y - 1)/G_y  m n / (G_z G_x) e                    (5.3)  forward, line 4
    AR_x    2 (G_x - 1)/G_x  m k / (G_z G_y) e                    (5.4)  backward, line 12
    AR_data 2 (G_data - 1)/G_data  k n / (G_x G_y G_z) e          (5.5)  once per step
    t_comm = Σ_layers Σ_terms bytes / β_axis                       (5.6)

A transposed layer swaps G_x and G_y (and their bandwidths). Embedding tables and the LM
head (``ds_ext.pmm.vocab``) are stored as the weight of a normal layer with n = V rows, placed
one of two ways (``ds_ext.pmm3d.tables``):

* vocabulary-parallel (rows over X, Megatron-LM's ``VocabParallelEmbedding``): a table costs
  Eqs 5.1 / 5.2 (its block gathered over Z in forward, its gradient reduce-scattered over Z)
  plus the lookup's all-reduce over X of m d / (G_z G_y) e, and the head is a normal layer
  k = d, n = V without bias (Eqs 5.1-5.4; gathered again when tied), followed by the
  cross-entropy's reductions over X;
* replicated over X (every X rank holds all V rows of its feature block; ``TableSpec.split_rows``
  and ``LayerSpec.split_out`` False): Eqs 5.1 / 5.2 / 5.5 with G_x -> 1 for the table (G_x
  times the bytes), no lookup all-reduce, the head's Eq 5.3 with G_x -> 1 (m V / G_z over Y)
  and no Eq 5.4 (the X ranks hold the whole vocabulary, so the input gradient is complete),
  and no cross-entropy reduction. It trades 2 all-reduces of the residual stream over X per
  micro-step for G_x times the table's memory and head matmul: cheaper for a small vocabulary
  (``ds-ext bench pmm``'s, V = 256 < d), not for an LLM's.

Other terms that ds_ext issues beyond Eqs 5.1-5.5, modelled
exactly as the engine issues them: norm statistics all-reduced over Y (forward and
backward, fp32), the vocabulary-parallel cross-entropy over X (row maximum, then target
logit and sum of exponentials: m / G_z and 2 m / G_z fp32 values), the gradients of the
parameters replicated over Z (layer biases, n/G_out each, and norm vectors, d/G_y each)
summed over Z in ONE bucketed all-reduce per micro-step, the loss
averaged over Z, and DeepSpeed's data-parallel all-reduce of every local gradient (Eq 5.5
for the layers).

Bandwidth of axis i (Eq 5.7): inside a node (Π_{j<=i} G_j <= G_node) the profiled value
for (G_0 = Π_{j<i} G_j, G_1 = G_i) from a database (``ds-ext tune --measure``) or, without
one, the bandwidth of the topology level the axis spans; across nodes
β_inter / min(G_node, Π_{j<i} G_j), β_inter = one node's injection bandwidth.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field, replace

from ds_ext.comm import hops
from ds_ext.comm.emulation import message_steps
from ds_ext.parallel import Grid, member_group
from ds_ext.perf import collectives
from ds_ext.topology import Topology

AXES = ("x", "y", "z", "data")
STATS_BYTES = 4  # norm statistics and the loss are fp32


@dataclass(frozen=True)
class LayerSpec:
    """One converted linear layer: k in-features, n out-features."""

    name: str
    k: int
    n: int
    transposed: bool = False
    bias: bool = False
    out_chunks: int = 1
    recomputed: bool = False  # inside an activation-checkpointed block
    split_out: bool = True  # False: out-features whole on every rank of the out axis (a replicated LM head)


@dataclass(frozen=True)
class NormSpec:
    name: str
    features: int
    stats: int  # row statistics all-reduced: 2 (LayerNorm: Σx, Σx²), 1 (RMSNorm: Σx²)
    params: int  # affine vectors of ``features``
    recomputed: bool = False


@dataclass(frozen=True)
class TableSpec:
    """An embedding table or untied LM head weight ``[rows, features]``, vocabulary-parallel:
    rows over X, features over Y, the block in G_z chunks (``ds_ext.pmm.vocab``)."""

    name: str
    rows: int
    features: int
    lookup: bool = True  # an embedding (False: the untied head's weight, used by ``ModelSpec.head``)
    per_position: bool = False  # looked up by position ids ``[s]``, once for all sequences (GPT's ``pos``)
    split_rows: bool = True  # vocabulary-parallel; False: all rows on every X rank (replicated over X)


@dataclass(frozen=True)
class ModelSpec:
    layers: tuple[LayerSpec, ...]
    norms: tuple[NormSpec, ...] = ()
    tables: tuple[TableSpec, ...] = ()
    head: LayerSpec | None = None  # the LM head d -> V (normal, no bias; its weight is one of the tables)
    heads: dict[str, int] = field(default_factory=dict)  # attention head counts X must divide


@dataclass(frozen=True)
class Item:
    """One kind of collective: ``calls`` calls of ``nbytes`` each, on ``axis``."""

    phase: str  # ledger phase: "forward", "backward", or "<phase>/<layer>" with per-layer tags
    op: str
    axis: str
    nbytes: float
    calls: int
    equation: str
    payload: float  # one call's input (all_gather, reduce_scatter) or tensor (all_reduce) bytes: ``hops.sends``'


def _axes(layer: LayerSpec) -> tuple[str, str]:
    """(out axis, in axis): normal layers split out-features over X, transposed over Y."""
    return ("y", "x") if layer.transposed else ("x", "y")


def _size(grid: Grid, axis: str) -> int:
    return getattr(grid, axis)


def _out_parts(layer: LayerSpec, grid: Grid) -> int:
    """Blocks the out-features are split into: the out axis's size, 1 when not split over it."""
    return _size(grid, _axes(layer)[0]) if layer.split_out else 1


def _row_parts(table: TableSpec, grid: Grid) -> int:
    """Blocks a table's rows are split into: G_x (vocabulary-parallel) or 1 (replicated over X)."""
    return grid.x if table.split_rows else 1


def place_tables(spec: ModelSpec, vocab_parallel: bool) -> ModelSpec:
    """``spec`` with every table and the LM head vocabulary-parallel (rows over X) or replicated
    over X (``ds_ext.pmm3d.tables``)."""
    tables = tuple(replace(T, split_rows=vocab_parallel) for T in spec.tables)
    head = replace(spec.head, split_out=vocab_parallel) if spec.head else None
    return replace(spec, tables=tables, head=head)


def _ar(nbytes: float, d: int) -> float:
    return 2 * nbytes * (d - 1) / d


def items(
    spec: ModelSpec,
    grid: Grid,
    micro_batch: int,
    seq_len: int,
    elem_bytes: int,
    grad_accum: int = 1,
    by_layer: bool = True,
    data_reduction: bool = True,
) -> list[Item]:
    """Every collective of one optimizer step, per rank (axes of size one send nothing);
    ``data_reduction`` False: the data axis's gradient reduction is not DeepSpeed's all-reduce
    but ZeRO-topo's (``ds_ext.zero_topo.perf`` models it)."""
    e, rows = elem_bytes, micro_batch * seq_len // grid.z
    out: list[Item] = []

    def add(phase: str, op: str, axis: str, per_call: float, calls: int, eq: str) -> None:
        d = _size(grid, axis)
        if d > 1 and calls:
            nbytes = {
                "all_gather": per_call * (d - 1),
                "reduce_scatter": per_call * (d - 1) / d,
                "all_reduce": _ar(per_call, d),
            }[op]
            out.append(Item(phase, op, axis, nbytes, calls, eq, per_call))

    same: dict[tuple, list[Item]] = {}  # by_layer=False: identical layers give identical items
    for T in spec.tables:
        if T.lookup:
            block = T.rows * T.features // (_row_parts(T, grid) * grid.y) * e
            fwd, bwd = (f"forward/{T.name}", f"backward/{T.name}") if by_layer else ("forward", "backward")
            add(fwd, "all_gather", "z", block / grid.z, grad_accum, "5.1 (table)")
            looked_up = seq_len if T.per_position else rows
            if T.split_rows:  # each X rank looked up the ids of its vocabulary block only
                add(fwd, "all_reduce", "x", looked_up * T.features // grid.y * e, grad_accum, "lookup")
            add(bwd, "reduce_scatter", "z", block, grad_accum, "5.2 (table)")
    for L in (*spec.layers, *([spec.head] if spec.head else [])):
        key = (L.k, L.n, L.transposed, L.bias, L.out_chunks, L.recomputed, L.split_out)
        if not by_layer and key in same:
            out.extend(same[key])
            continue
        first = len(out)
        o, i = _axes(L)
        go, gi, gz = _out_parts(L, grid), _size(grid, i), grid.z
        fwd = f"forward/{L.name}" if by_layer else "forward"
        bwd = f"backward/{L.name}" if by_layer else "backward"
        block = L.n * L.k // (go * gi) * e
        forward = [("all_gather", "z", block / gz, "5.1"), ("all_reduce", i, rows * L.n // go * e, "5.3")]
        for op, axis, per_call, eq in forward:
            add(fwd, op, axis, per_call, grad_accum, eq)
            if L.recomputed:
                add(bwd, op, axis, per_call, grad_accum, eq + " (recompute)")
        if L.split_out:  # else every rank of the out axis holds all out-features: dL/dI is complete
            add(bwd, "all_reduce", o, rows * L.k // gi * e, grad_accum, "5.4")
        add(bwd, "reduce_scatter", "z", block, grad_accum, "5.2")
        same[key] = out[first:]
    for N in spec.norms:
        per_call = rows * N.stats * STATS_BYTES
        add("forward", "all_reduce", "y", per_call, grad_accum, "norm stats")
        add("backward", "all_reduce", "y", per_call, grad_accum * (2 if N.recomputed else 1), "norm stats")
    if spec.head and spec.head.split_out:
        add("forward", "all_reduce", "x", rows * STATS_BYTES, grad_accum, "vocab CE max")
        add("forward", "all_reduce", "x", 2 * rows * STATS_BYTES, grad_accum, "vocab CE sums")
    add("forward", "all_reduce", "z", STATS_BYTES, grad_accum, "loss mean")
    add(
        "backward",
        "all_reduce",
        "z",
        sum(replicated_numels(spec, grid)) * e,
        grad_accum,
        "replicated grads (one bucket)",
    )
    layers = sharded_numel(spec, grid)
    if data_reduction:
        add("backward", "all_reduce", "data", layers * e, 1, "5.5 (DeepSpeed, one bucket with the rest)")
        add("backward", "all_reduce", "data", (local_numel(spec, grid) - layers) * e, 1, "data (DeepSpeed)")
    return out


# GPT models of 001 Table 5.1 (= 000 Table II): name -> (layers, hidden, heads)
TABLE_5_1: dict[str, tuple[int, int, int]] = {
    "gpt-5b": (24, 4096, 32),
    "gpt-10b": (32, 5120, 40),
    "gpt-20b": (32, 7168, 56),
    "gpt-40b": (38, 9216, 72),
    "gpt-60b": (56, 9216, 72),
    "gpt-80b": (42, 12288, 96),
    "gpt-160b": (84, 12288, 96),
    "gpt-320b": (96, 16384, 128),
    "gpt-640b": (192, 16384, 128),
}


def gpt_spec(d_model: int, n_layers: int, n_heads: int, vocab: int, seq_len: int, ffn_mult: int = 4) -> ModelSpec:
    """The spec of ds_ext's GPT (ds_ext.models.gpt) without building it: per block a fused
    q|k|v (normal), attention-out (transposed), FC1 (normal), FC2 (transposed), two
    LayerNorms; a final LayerNorm; token and position tables; the head tied to the tokens."""
    d, f = d_model, ffn_mult * d_model
    layers, norms = [], []
    for b in range(n_layers):
        p = f"blocks.{b}."
        layers += [
            LayerSpec(p + "qkv", d, 3 * d, False, True, 3),
            LayerSpec(p + "proj", d, d, True, True),
            LayerSpec(p + "fc1", d, f, False, True),
            LayerSpec(p + "fc2", f, d, True, True),
        ]
        norms += [NormSpec(p + "ln1", d, 2, 2), NormSpec(p + "ln2", d, 2, 2)]
    norms.append(NormSpec("ln_f", d, 2, 2))
    tables = (TableSpec("embed", vocab, d), TableSpec("pos", seq_len, d, per_position=True))
    return ModelSpec(tuple(layers), tuple(norms), tables, LayerSpec("embed", d, vocab), {"GPTConfig.n_heads": n_heads})


def replicated_numels(spec: ModelSpec, grid: Grid) -> list[int]:
    """Local sizes of the parameters replicated over Z (layer biases, norm vectors), one each."""
    biases = [L.n // _size(grid, _axes(L)[0]) for L in spec.layers if L.bias]
    return biases + [N.features // grid.y for N in spec.norms for _ in range(N.params)]


def sharded_numel(spec: ModelSpec, grid: Grid) -> int:
    """Elements of the Z-chunked weights one rank holds: layer shards and table shards,
    serial / (G_x G_y G_z) each (a table replicated over X: serial / (G_y G_z))."""
    tables = sum(T.rows * T.features // (_row_parts(T, grid) * grid.y * grid.z) for T in spec.tables)
    return tables + sum(_layer_numel(L, grid) for L in spec.layers)


def local_numel(spec: ModelSpec, grid: Grid) -> int:
    """Parameters one rank holds: layer and table shards, biases, norm vectors."""
    return sharded_numel(spec, grid) + sum(replicated_numels(spec, grid))


def ledger_bytes(
    spec: ModelSpec,
    grid: Grid,
    topology: Topology,
    micro_batch: int,
    seq_len: int,
    elem_bytes: int,
    grad_accum: int = 1,
    by_layer: bool = True,
    algorithm: str = "native",
    data_reduction: bool = True,
) -> dict[str, dict[str, float]]:
    """``{phase: {level: bytes}}`` per optimizer step, as the ledger records it."""
    return _ledger(
        spec, grid, topology, micro_batch, seq_len, elem_bytes, grad_accum, by_layer, algorithm, data_reduction
    )[0]


def ledger_messages(
    spec: ModelSpec,
    grid: Grid,
    topology: Topology,
    micro_batch: int,
    seq_len: int,
    elem_bytes: int,
    grad_accum: int = 1,
    by_layer: bool = True,
    algorithm: str = "native",
    data_reduction: bool = True,
) -> dict[str, dict[str, float]]:
    """``{phase: {level: messages}}`` per optimizer step, as the ledger counts them."""
    return _ledger(
        spec, grid, topology, micro_batch, seq_len, elem_bytes, grad_accum, by_layer, algorithm, data_reduction
    )[1]


def _ledger(
    spec: ModelSpec,
    grid: Grid,
    topology: Topology,
    micro_batch: int,
    seq_len: int,
    elem_bytes: int,
    grad_accum: int,
    by_layer: bool,
    algorithm: str,
    data_reduction: bool = True,
) -> tuple[dict, dict]:
    """Bytes and messages per phase and level. With ``ds_ext.comm.algorithm`` pccl (or auto, chosen
    per call as the communicator does) an all-gather / reduce-scatter is split over the levels of its
    phases by ``ds_ext.perf.collectives`` (001 §6.2); a collective left to torch counts d - 1 messages
    (all-reduce 2 (d - 1)) at its axis's level, the ledger's convention."""
    levels = grid.parallel_dims.spans(topology)
    groups = {a: grid.partition(a)[0] for a in AXES}  # rank 0's group; the others are congruent
    nbytes: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    messages: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for it in items(spec, grid, micro_batch, seq_len, elem_bytes, grad_accum, by_layer, data_reduction):
        d = _size(grid, it.axis)
        chosen = algorithm
        if it.op in ("all_gather", "reduce_scatter") and algorithm == "auto":
            chosen = collectives.choose(topology, groups[it.axis], it.nbytes / (d - 1))
        if it.op in ("all_gather", "reduce_scatter") and chosen in ("pccl", "ring"):
            split = collectives.traffic(chosen, topology, groups[it.axis], it.nbytes / (d - 1))
        else:
            split = {levels[it.axis]: (it.nbytes, message_steps(it.op, d))}
        for lv, (b, m) in split.items():
            nbytes[it.phase][lv] += b * it.calls
            messages[it.phase][lv] += m * it.calls
    return {ph: dict(v) for ph, v in nbytes.items()}, {ph: dict(v) for ph, v in messages.items()}


def ledger_links(
    spec: ModelSpec,
    grid: Grid,
    topology: Topology,
    rank: int,
    micro_batch: int,
    seq_len: int,
    elem_bytes: int,
    grad_accum: int = 1,
    by_layer: bool = True,
    gloo: bool = False,
    data_reduction: bool = True,
) -> dict[str, dict[str, float]]:
    """``{phase: {level of the link: bytes}}`` ``rank`` sends per optimizer step (the ledger's link
    bytes, ``ds_ext.comm.hops``) with torch's own collectives (``ds_ext.comm.algorithm`` native):
    each call a ring over its axis group in rank order, a reduce-scatter on ``gloo`` ds_ext's
    all-to-all of the chunks; ``gloo``: the backend whose algorithms the bytes follow."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for it in items(spec, grid, micro_batch, seq_len, elem_bytes, grad_accum, by_layer, data_reduction):
        members = member_group(grid.partition(it.axis), rank)
        d, payload = len(members), it.payload
        per_peer = [payload / d] * d if gloo and it.op == "reduce_scatter" else None
        for level, b in hops.by_level(
            topology, rank, hops.sends(it.op, members, rank, payload, gloo, per_peer=per_peer)
        ).items():
            out[it.phase][level] += b * it.calls
    return {ph: dict(v) for ph, v in out.items()}


# ---- bandwidths (Eq 5.7) and time ----------------------------------------------------------
@dataclass(frozen=True)
class Bandwidths:
    """Eq 5.7 inputs: profiled intra-node bandwidths keyed (G_0, G_1), and β_inter (bytes/s)."""

    intra: dict[tuple[int, int], float]
    beta_inter: float
    ring_sharing: bool = True  # Eq 5.7's β_inter / min(G_node, Π_{j<i} G_j) across nodes

    @classmethod
    def from_topology(cls, topology: Topology) -> "Bandwidths":
        """No database: inside a node, the bandwidth of the level a group spans; β_inter is a
        node's injection bandwidth: one flow's on the node link where measured
        (``Level.link_bandwidth``), else ranks per node x the outer level's per-rank bandwidth."""
        return cls({}, topology.levels[-1].link(topology.ranks_per_node))

    @classmethod
    def per_rank_links(cls, topology: Topology) -> "Bandwidths":
        """The machine ``ds_ext.comm.emulation`` emulates: every rank has its own share of each
        level's links, so a group gets its level's per-rank bandwidth whatever runs beside it
        (no ring sharing across nodes)."""
        return cls({}, topology.levels[-1].bandwidth, ring_sharing=False)


def axis_bandwidths(grid: Grid, topology: Topology, bw: Bandwidths | None = None) -> dict[str, float]:
    """β of each axis of size > 1 (Eq 5.7, Case 1 inside a node, Case 2 across nodes)."""
    bw = bw or Bandwidths.from_topology(topology)
    g_node = topology.ranks_per_node
    levels = grid.parallel_dims.spans(topology)
    out, before = {}, 1
    for axis, g in zip(AXES, grid.dims):
        if g > 1:
            if before * g <= g_node:
                default = topology.level(levels[axis]).bandwidth
                out[axis] = bw.intra.get((before, g), default)
            else:
                out[axis] = bw.beta_inter / (min(g_node, before) if bw.ring_sharing else 1)
        before *= g
    return out


def comm_time(
    spec: ModelSpec,
    grid: Grid,
    topology: Topology,
    micro_batch: int,
    seq_len: int,
    elem_bytes: int,
    grad_accum: int = 1,
    bw: Bandwidths | None = None,
    paper_terms_only: bool = False,
    latency: bool = False,
) -> float:
    """Predicted seconds of communication per step, Eq 5.6 summed over layers.

    ``paper_terms_only``: only Eqs 5.1-5.5 of the linear layers. ``latency``: drop
    Assumption-3 and add α per ring step (d - 1 steps, 2 (d - 1) for an all-reduce) with α
    the latency of the level the axis spans, as ``ds_ext.comm.emulation`` charges it; small
    messages (a CPU emulation, or a small model) are latency-bound.
    """
    beta = axis_bandwidths(grid, topology, bw)
    levels = grid.parallel_dims.spans(topology)
    total = 0.0
    for it in items(spec, grid, micro_batch, seq_len, elem_bytes, grad_accum):
        if paper_terms_only and not it.equation.startswith("5."):
            continue
        total += it.nbytes * it.calls / beta[it.axis]
        if latency:
            alpha = topology.level(levels[it.axis]).latency
            total += it.calls * message_steps(it.op, _size(grid, it.axis)) * alpha
    return total


def _layer_numel(L: LayerSpec, grid: Grid) -> int:
    return L.n * L.k // (_out_parts(L, grid) * _size(grid, _axes(L)[1]) * grid.z)


# ---- memory ---------------------------------------------------------------------------------
def memory(spec: ModelSpec, grid: Grid, elem_bytes: int, zero_stage: int = 0) -> dict[str, float]:
    """Bytes of model state per rank.

    ``layer_params`` / ``layer_grads``: the converted layers' and tables' weight shards,
    serial / (G_x G_y G_z); ``replicated_params`` / ``replicated_grads``: biases (split over
    the out axis only) and norm vectors (split over Y only); ``optimizer``: Adam m and v, plus
    an fp32 master copy when training in 16 bit, divided by G_data under ZeRO-1/2;
    ``gathered_weights``: the all-gathered blocks Algorithm 3 caches from forward to backward
    (layers and the head; transient).
    """
    layer = sharded_numel(spec, grid)
    cached = (*spec.layers, *([spec.head] if spec.head else []))
    total = local_numel(spec, grid)
    per_param = 8 + (4 if elem_bytes < 4 else 0)
    return {
        "layer_params": layer * elem_bytes,
        "layer_grads": layer * elem_bytes,
        "replicated_params": (total - layer) * elem_bytes,
        "replicated_grads": (total - layer) * elem_bytes,
        "optimizer": total * per_param / (grid.data if zero_stage >= 1 else 1),
        "gathered_weights": sum(_layer_numel(L, grid) * grid.z for L in cached) * elem_bytes,
    }


def model_state_bytes(spec: ModelSpec, grid: Grid, elem_bytes: int, zero_stage: int = 0) -> float:
    m = memory(spec, grid, elem_bytes, zero_stage)
    return sum(m.values())


# ---- search (001 §5.1.2, "Configuration search") ------------------------------------------
def factorizations(world: int) -> list[Grid]:
    """Every ordered (G_x, G_y, G_z, G_data) with product ``world``."""
    divs = [d for d in range(1, world + 1) if world % d == 0]
    return [
        Grid(x, y, z, world // (x * y * z)) for x, y, z in itertools.product(divs, repeat=3) if world % (x * y * z) == 0
    ]


def block_split_error(n: int, k: int, out_parts: int, in_parts: int, z_parts: int, out_chunks: int = 1) -> str | None:
    """Why an ``[n, k]`` weight does not split into 3D-PMM shards (001 Algorithm 3): out-features
    into ``out_chunks`` stacked blocks of ``out_parts`` each, in-features into ``in_parts``, the local
    block into ``z_parts`` equal chunks; None if it does (``ds_ext.pmm.layout.LinearLayout``'s rule)."""
    if n % (out_chunks * out_parts) or k % in_parts:
        return f"a [{n}, {k}] weight does not split into {out_parts} x {in_parts} blocks" + (
            f" ({out_chunks} stacked out blocks)" if out_chunks > 1 else ""
        )
    n_local, k_local = n // out_parts, k // in_parts
    if (n_local * k_local) % z_parts:
        return f"a {n_local} x {k_local} block does not split into {z_parts} Z chunks"
    return None


def unfit_reason(spec: ModelSpec, grid: Grid, micro_batch: int) -> str | None:
    """Why ``grid`` cannot run ``spec`` (divisibility), or None."""
    for key, heads in spec.heads.items():
        if heads % grid.x:
            return f"x={grid.x} does not divide {key}={heads}"
    if micro_batch % grid.z:
        return f"z={grid.z} does not divide the micro-batch {micro_batch}"
    for L in spec.layers:
        o, i = _axes(L)
        if err := block_split_error(L.n, L.k, _size(grid, o), _size(grid, i), grid.z, L.out_chunks):
            return f"{L.name}: {err}"
    for f in [N.features for N in spec.norms]:
        if f % grid.y:
            return f"y={grid.y} does not divide {f} hidden features"
    for T in spec.tables:
        if err := block_split_error(T.rows, T.features, _row_parts(T, grid), grid.y, grid.z):
            return f"table {T.name}: {err}"
    return None


@dataclass(frozen=True)
class Candidate:
    grid: Grid
    time: float  # predicted communication seconds per step (Eq 5.6 + ds_ext terms)
    paper_time: float  # Eqs 5.1-5.5 only
    memory: float  # model-state bytes per rank
    bytes_by_level: dict[str, float]


def rank_grids(
    spec: ModelSpec,
    world: int,
    topology: Topology,
    micro_batch: int,
    seq_len: int,
    elem_bytes: int,
    grad_accum: int = 1,
    zero_stage: int = 0,
    memory_limit: float | None = None,
    bw: Bandwidths | None = None,
) -> list[Candidate]:
    """Factorizations that fit the model and memory, fastest predicted first."""
    out = []
    for grid in factorizations(world):
        if unfit_reason(spec, grid, micro_batch) is not None:
            continue
        mem = model_state_bytes(spec, grid, elem_bytes, zero_stage)
        if memory_limit is not None and mem > memory_limit:
            continue
        args = (spec, grid, topology, micro_batch, seq_len, elem_bytes, grad_accum)
        levels: dict[str, float] = defaultdict(float)
        for per in ledger_bytes(*args).values():
            for lv, b in per.items():
                levels[lv] += b
        out.append(
            Candidate(grid, comm_time(*args, bw=bw), comm_time(*args, bw=bw, paper_terms_only=True), mem, dict(levels))
        )
    return sorted(out, key=lambda c: (c.time, c.grid.dims))


def megatron_bytes(layers: list[LayerSpec], rows: int, g: int, e: int) -> float:
    """Megatron-LM tensor parallelism of width g (column / row pairs): one all-reduce of the
    layer output (row-parallel, forward) or input gradient (column-parallel, backward) each."""
    total = 0.0
    for L in layers:
        total += _ar(rows * (L.n if L.transposed else L.k) * e, g)
    return total


def fsdp_bytes(layers: list[LayerSpec], g: int, e: int) -> float:
    """FSDP / ZeRO-3 over g ranks without re-gathering in backward: all-gather + reduce-scatter."""
    return sum(L.n * L.k * e * (g - 1) / g * 2 for L in layers)


def ddp_bytes(layers: list[LayerSpec], g: int, e: int) -> float:
    """Plain data parallelism over g ranks: one all-reduce of every gradient."""
    return sum(_ar(L.n * L.k * e, g) for L in layers)


__all__ = [
    "Bandwidths",
    "Candidate",
    "Item",
    "LayerSpec",
    "ModelSpec",
    "NormSpec",
    "TableSpec",
    "axis_bandwidths",
    "comm_time",
    "ddp_bytes",
    "factorizations",
    "fsdp_bytes",
    "items",
    "ledger_bytes",
    "ledger_messages",
    "local_numel",
    "megatron_bytes",
    "memory",
    "model_state_bytes",
    "place_tables",
    "rank_grids",
    "replicated_numels",
    "sharded_numel",
    "unfit_reason",
]
