"""Alpha-beta model of ds_ext.comm's all-gather / reduce-scatter algorithms (001 §6.2, §6.3).

Per rank and topology level: the bytes and messages one rank sends (what the ledger counts,
ds_ext/comm/ledger.py), and the time ``sum_L messages_L alpha_L + bytes_L / beta_L``.

Notation (001 §6.2.1): a group of d = N x M ranks, N nodes of M ranks; c bytes per chunk (one
rank's all-gather input = its reduce-scatter output); alpha_L, beta_L latency and per-rank
bandwidth of level L (``ds_ext.topology.Level``); G the level the group spans, X the level one
node sub-communicator spans, I the level one node's M ranks span. Both operations cost the
same (reduce-scatter is the transpose of all-gather).

==========  =====  ======================  =======================
algorithm   level  bytes                   messages
==========  =====  ======================  =======================
ring        G      c (d - 1)               d - 1
pccl        X      c (N - 1)               ceil(log2 N)   (recursive doubling / halving)
            I      c N (M - 1)             M - 1          (ring inside the node)
native      G      c (d - 1)               d - 1          (the ledger's ring convention)
==========  =====  ======================  =======================

Time. PCCL's phases run one after the other; its M node sub-communicators run at once, each
rank on its own share of the node's links (001 §6.2.1: one NIC per GCD pair), so every phase
moves at its level's per-rank bandwidth. A flat ring is as slow as its slowest hop; a hop that
leaves a node has the node's links to itself (one ring flow per node: beta_X^link, one flow's
bandwidth where measured, else the M ranks' shares, M beta_X), one inside a node beta_I:
``T_ring = (d - 1) (alpha_G + c / min(beta_I, beta_X^link))`` (M = 1: beta_G). Hence pccl wins
below the crossover c* where the (d - 1) alpha_G of the ring outweighs pccl's extra bandwidth
term, and loses above it (001 Fig 6.9: slower only in the bandwidth-bound corner).
"""

from __future__ import annotations

import math
from typing import Sequence

from ds_ext.topology import Topology

Traffic = dict[str, tuple[float, int]]  # level -> (bytes, messages) sent by one rank


def node_shape(topology: Topology, ranks: Sequence[int]) -> tuple[int, int] | None:
    """(N, M) of a group, or None if its nodes hold different numbers of its ranks."""
    per_node = topology.ranks_per_node
    counts: dict[int, int] = {}
    for r in ranks:
        counts[r // per_node] = counts.get(r // per_node, 0) + 1
    if len(set(counts.values())) != 1:
        return None
    return len(counts), len(ranks) // len(counts)


def _levels(topology: Topology, ranks: Sequence[int]) -> tuple[str | None, str | None]:
    """(X, I): the level of one node sub-communicator and of one node's ranks of the group."""
    per_node = topology.ranks_per_node
    rs = sorted(ranks)
    first_node = [r for r in rs if r // per_node == rs[0] // per_node]
    firsts = sorted({r // per_node: r for r in reversed(rs)}.values())
    return topology.level_of(firsts), topology.level_of(first_node)


def traffic(algorithm: str, topology: Topology, ranks: Sequence[int], chunk_bytes: float) -> Traffic:
    """Bytes and messages one rank of the group sends, per level (table in the docstring)."""
    d = len(ranks)
    if d == 1:
        return {}
    if algorithm in ("ring", "native"):
        return {topology.level_of(ranks): (chunk_bytes * (d - 1), d - 1)}  # type: ignore[dict-item]
    if algorithm != "pccl":
        raise ValueError(f"no model for algorithm {algorithm!r}; allowed: ring, pccl, native")
    shape = node_shape(topology, ranks)
    if shape is None:
        raise ValueError(f"pccl needs the same number of ranks on every node; ranks {list(ranks)} are uneven")
    N, M = shape
    X, I = _levels(topology, ranks)
    out: Traffic = {}
    if N > 1:
        out[X] = (chunk_bytes * (N - 1), math.ceil(math.log2(N)))  # type: ignore[index]
    if M > 1:
        b, m = out.get(I, (0.0, 0))  # type: ignore[arg-type]
        out[I] = (b + chunk_bytes * N * (M - 1), m + M - 1)  # type: ignore[index]
    return out


def time(algorithm: str, topology: Topology, ranks: Sequence[int], chunk_bytes: float) -> float:
    """Predicted seconds of one all-gather / reduce-scatter (docstring's time model)."""
    if algorithm == "pccl":
        return sum(
            m * topology.level(lv).latency + b / topology.level(lv).bandwidth
            for lv, (b, m) in traffic("pccl", topology, ranks, chunk_bytes).items()
        )
    d = len(ranks)
    if d == 1:
        return 0.0
    G = topology.level(topology.level_of(ranks))  # type: ignore[arg-type]
    shape = node_shape(topology, ranks)
    beta = G.bandwidth
    if shape is not None and shape[0] > 1 and shape[1] > 1:
        X, I = _levels(topology, ranks)
        beta = min(topology.level(I).bandwidth, topology.level(X).link(shape[1]))  # type: ignore[arg-type]
    return (d - 1) * (G.latency + chunk_bytes / beta)


def choose(topology: Topology, ranks: Sequence[int], chunk_bytes: float) -> str:
    """``auto``: pccl if it can run on the group and is predicted faster than a ring, else native
    (the vendor's ring; inside one node pccl is a ring and never faster)."""
    if node_shape(topology, ranks) is None:
        return "native"
    faster = time("pccl", topology, ranks, chunk_bytes) < time("ring", topology, ranks, chunk_bytes)
    return "pccl" if faster else "native"


def crossover(topology: Topology, ranks: Sequence[int]) -> float | None:
    """Chunk bytes above which ring is predicted faster than pccl (both times are linear in c);
    None if pccl is predicted faster at every size."""
    a_ring, a_pccl = time("ring", topology, ranks, 0.0), time("pccl", topology, ranks, 0.0)
    b_ring = time("ring", topology, ranks, 1.0) - a_ring
    b_pccl = time("pccl", topology, ranks, 1.0) - a_pccl
    if b_pccl <= b_ring:
        return None
    return (a_ring - a_pccl) / (b_pccl - b_ring)
