"""Analytic traffic and memory of TED (001 §7.1.1, §7.3; Eq 7.2-7.6).

Traffic of one transformer block whose feed-forward is a TED MoE layer, bytes sent by one
rank in the ledger's convention (ds_ext/comm/ledger.py), for one micro-batch of S tokens
(T = G_tensor, P = G_expert, E experts, C capacity, H hidden, b bytes per element;
A = S H b one activation, V = E C H b the dispatched buffer, V' = V / T with DTD else V):

  op            group    forward        backward      recompute (checkpointing, no CAC)
  all_reduce    tensor   ❷ A, ❻ V       f: A, V       ❷ A, ❻ V
  all_to_all    expert   ❹, ❼           ❹, ❼          ❹, ❼        each V' (P-1)/P
  all_gather    tensor   2 (DTD)        2 (DTD drop)  2 (DTD)     each V' (T-1)
  all_reduce    expert   capacity agreement (8 bytes, MAX), never recomputed

(DTD only where G_expert > 1: with one expert rank there is no all-to-all to shrink.)

Link bytes (``Traffic.link_bytes``; ``ds_ext.comm.hops``): each call's bytes at the level of the link
to each peer, under the algorithm the backend runs (``gloo`` or NCCL / RCCL): the all-reduces and
all-gathers as rings over the group in rank order, the all-to-all straight to each peer (V' / P each).

so per layer: 4 + 4 all-to-all / all-reduce calls, 6 + 6 with checkpointing, 4 + 4 again with
CAC (001 §7.3.2), plus the capacity agreement where G_expert > 1; DTD divides the all-to-all bytes by T (001 §7.3.1). Recompute traffic is
tagged ``backward`` (it runs inside the backward pass).

Memory (mixed precision with Adam and ZeRO-1, bytes per rank): Eq 7.4
  M >= (4 + 12 / G_data^nonexp) NP_gpu^nonexp + (4 + 12 / G_data^exp) NP_gpu^exp
(2 + 2 bytes of 16-bit parameter and gradient, 4 + 4 + 4 of fp32 master, Adam m and v,
sharded), and for the model family of 001 §7.1.1 (Eq 7.2, 7.3) Eq 7.5
  M >= 4 NP_base (1 / G_tensor + (E + 2) / G),   Eq 7.6 (large G): NP_base <= G_tensor M / 4.
"""

from __future__ import annotations

from dataclasses import dataclass

from ds_ext.comm import hops
from ds_ext.comm.ledger import Traffic, all_gather_bytes, all_reduce_bytes
from ds_ext.parallel import TEDLayout, member_group
from ds_ext.topology import Topology

CAPACITY_BYTES = 8  # the int64 capacity a gate agrees over the expert group


@dataclass(frozen=True)
class MoEBlockShape:
    """One micro-batch through one MoE block on one rank."""

    tokens: int  # S
    hidden: int  # H
    num_experts: int  # E
    capacity: int  # C
    element_bytes: int  # b


def moe_block_traffic(
    layout: TEDLayout,
    topology: Topology,
    rank: int,
    shape: MoEBlockShape,
    *,
    dtd: bool,
    cac: bool,
    checkpointing: bool,
    gloo: bool = False,
) -> Traffic:
    """Bytes, link bytes and calls ``rank`` sends in forward + backward of one MoE block (module
    docstring); ``gloo``: the backend whose algorithms the link bytes follow."""
    T, P = layout.tensor, layout.expert
    levels = layout.levels(topology, rank)
    members = {kind: member_group(layout.partition(kind), rank) for kind in ("tensor", "expert")}
    A = shape.tokens * shape.hidden * shape.element_bytes
    V = shape.num_experts * shape.capacity * shape.hidden * shape.element_bytes
    dtd = dtd and T > 1 and P > 1
    V_a2a = V // T if dtd else V
    recompute = checkpointing and not cac
    out = Traffic()

    def add(phase: str, op: str, kind: str, nbytes: float, calls: int, payload: float) -> None:
        d = len(members[kind])
        per_peer = [payload / d] * d if op == "all_to_all" else None
        links = hops.by_level(topology, rank, hops.sends(op, members[kind], rank, payload, gloo, per_peer=per_peer))
        for _ in range(calls):
            out.add((phase, op, levels[kind]), nbytes)
            for level, b in links.items():
                out.link_bytes[(phase, op, level)] += b

    passes = [("forward", 1), ("backward", 1 + recompute)]
    if T > 1:
        for phase, n in passes:
            add(phase, "all_reduce", "tensor", all_reduce_bytes(A, T), n, A)
            add(phase, "all_reduce", "tensor", all_reduce_bytes(V, T), n, V)
            if dtd:
                add(phase, "all_gather", "tensor", all_gather_bytes(V_a2a, T), 2 * n, V_a2a)
    if P > 1:
        for phase, n in passes:
            add(phase, "all_to_all", "expert", V_a2a - V_a2a // P, 2 * n, V_a2a)
        add("forward", "all_reduce", "expert", all_reduce_bytes(CAPACITY_BYTES, P), 1, CAPACITY_BYTES)
    return out


# ---- memory (001 §7.1.1) ----------------------------------------------------------------
@dataclass(frozen=True)
class StateBytes:
    """Model-state bytes of one rank: 16-bit parameters and gradients, optimizer (fp32
    master + Adam m, v) shard."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def eq_7_4(np_nonexp_gpu: int, np_exp_gpu: int, layout: TEDLayout) -> StateBytes:
    """Eq 7.4 for the parameters one rank holds (split into its three terms)."""
    n = np_nonexp_gpu + np_exp_gpu
    return StateBytes(2 * n, 2 * n, 12 * np_nonexp_gpu / layout.nonexp_data + 12 * np_exp_gpu / layout.expert_data)


def eq_7_5(np_base: float, num_experts: int, world: int, tensor: int) -> float:
    """Eq 7.5: bytes per GPU of an MoE built from a base model of ``np_base`` parameters
    with G_expert = E (Eq 7.2, 7.3)."""
    return 4 * np_base * (1 / tensor + (num_experts + 2) / world)


def max_base_params(memory: float, num_experts: int, world: int, tensor: int) -> float:
    """The largest base model Eq 7.5 fits in ``memory`` bytes per GPU (G_tensor = 1:
    DeepSpeed-MoE, 001 §7.1.1)."""
    return memory / (4 * (1 / tensor + (num_experts + 2) / world))


def eq_7_6(memory: float, tensor: int) -> float:
    """Eq 7.6, the large-G bound: NP_base <= G_tensor M / 4."""
    return tensor * memory / 4


# Frontier: 64 GB of HBM per GCD, 8 GCDs per node (G_tensor <= 8, 001 §7.1.1).
FRONTIER_GCD_BYTES = 64e9
BASE_MODEL_GRID = ((64, 16), (256, 16), (256, 64), (1024, 64), (4096, 128))  # (G, E)


def base_model_table(
    memory: float = FRONTIER_GCD_BYTES, grid=BASE_MODEL_GRID, tensors=(1, 2, 4, 8)
) -> list[dict[str, float | int | None]]:
    """Largest base model (Eq 7.5) per (G, E) and G_tensor; None where G_tensor x E > G
    (G_expert = E needs G_data^exp = G / (G_tensor E) >= 1). G_tensor = 1 is DeepSpeed-MoE."""
    return [
        {"G": G, "E": E, **{f"tensor_{T}": (max_base_params(memory, E, G, T) if T * E <= G else None) for T in tensors}}
        for G, E in grid
    ]
