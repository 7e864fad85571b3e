"""Frontier's RCCL inter-node latency per ring step, derived from 001 §6.3.1.

Nothing here is fitted to the results the planner is validated against (003's TFLOPS ratios):
the inputs are 001's published PCCL-over-RCCL speedups and the machine's bandwidths.

Published (001 §6.3.1, the text of Fig 6.9; RCCL 2.20.5 on Frontier, §6.1.1), speedup ρ of
PCCL over RCCL for a per-process buffer S (all-gather: output, reduce-scatter: input, §6.1.1):

=============== ========= ========= ===========
collective      p = 2,048 p = 2,048 p = 32
=============== ========= ========= ===========
all-gather      11.4x at  7x at     0.52x at
                512 MB    1,024 MB  1,024 MB
reduce-scatter  11.4x at  6.2x at   0.55x at
                512 MB    1,024 MB  1,024 MB
=============== ========= ========= ===========

PCCL's time from the machine's α-β levels (001 §6.2.1-6.2.3: the inter-node phase runs on all
eight NIC shares at once, recursive doubling over the N = p / 8 nodes; the intra-node phase is
RCCL's ring over the node's 8 GCDs)::

    T_PCCL(p, S) = (N-1)/N (S/8) / β_node + log2(N) α_node + (7/8) S / β_gpu + 7 α_gpu

with β_node = 12.5 GB/s per GCD (the preset's node level: 4 x 25 GB/s NICs for 8 GCDs, 003 §IV)
and β_gpu the bandwidth of RCCL's ring over a node's 8 GCDs: 100 GB/s, its slowest hop, since a
ring through the four MI250X can use the GCD pairs' 200 GB/s and the adjacent MI250X pairs' two
Infinity Fabric links (2 x 50 GB/s, 003 §IV; the one-link 50 GB/s of 003 Table II joins only
the cross pairs, which a ring around the four needs not use). α_node / α_gpu are the preset's
assumed 15 / 8 µs (they add 0.2 ms to a 10-20 ms time). RCCL's flat ring over p ranks is ``(p-1)/p S / B + (p-1) α`` with two unknowns,
its ring bandwidth B and the latency α of one ring step; the 32-GCD point and one 2,048-GCD
point give two linear equations::

    ρ_32 T_PCCL(32, 1 GiB) = (31/32) 1 GiB / B + 31 α
    ρ    T_PCCL(2048, S)   = (2047/2048) S / B + 2047 α

solved for each of the four 2,048-GCD points (MB read as 2^20 bytes). The planner charges the
mean α of the four per inter-node ring step; the four span the band the README states. With
Table II's 50 GB/s for the node's ring instead (``TABLE_II``), α comes out 80-96 µs: the README
and ``simulate --validate`` show that reading as a sensitivity row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ds_ext.planner import hardware

MiB = 2**20
NODE_RING_BANDWIDTH = hardware.value("gpu_bandwidth") * 1e9  # bytes/s: 004 §III-A, 003 §IV (two links)
TABLE_II_BANDWIDTH = hardware.value("gpu_bandwidth_table_ii") * 1e9  # bytes/s: 003 Table II, one link


@dataclass(frozen=True)
class Point:
    """One published speedup at 2,048 GCDs and what it implies for RCCL."""

    collective: str
    size: int  # bytes per process
    speedup: float  # ρ at 2,048 GCDs
    speedup_32: float  # ρ_32 at 32 GCDs, 1 GiB
    pccl_s: float = 0.0  # T_PCCL(2048, S)
    rccl_s: float = 0.0  # ρ T_PCCL
    ring_bandwidth: float = 0.0  # B, bytes/s
    alpha_s: float = 0.0  # α per ring step


PUBLISHED = (
    Point("all-gather", 512 * MiB, 11.4, 0.52),
    Point("all-gather", 1024 * MiB, 7.0, 0.52),
    Point("reduce-scatter", 512 * MiB, 11.4, 0.55),
    Point("reduce-scatter", 1024 * MiB, 6.2, 0.55),
)


def pccl_seconds(p: int, size: float, ring_bandwidth: float = NODE_RING_BANDWIDTH) -> float:
    """T_PCCL(p, S) (module docstring) on Frontier's figures (``hardware``), the node's ring at ``ring_bandwidth``."""
    per_node = 8  # 4 MI250X x 2 GCDs (003 §IV)
    n = p // per_node
    node_bw, node_alpha = hardware.value("node_bandwidth") * 1e9, hardware.value("pccl_node_latency") * 1e-6
    inter = (n - 1) / n * size / per_node / node_bw + math.log2(n) * node_alpha
    intra = (per_node - 1) / per_node * size / ring_bandwidth + (per_node - 1) * hardware.value("gpu_latency") * 1e-6
    return inter + intra


def derive(
    ring_bandwidth: float = NODE_RING_BANDWIDTH, points: tuple[Point, ...] = PUBLISHED, p: int = 2048, p_small: int = 32
) -> list[Point]:
    """Each published point with T_PCCL, the implied RCCL time, B and α (module docstring)."""
    out = []
    big = 1024 * MiB
    for pt in points:
        a1, b1, y1 = (
            big * (p_small - 1) / p_small,
            p_small - 1,
            pt.speedup_32 * pccl_seconds(p_small, big, ring_bandwidth),
        )
        t = pccl_seconds(p, pt.size, ring_bandwidth)
        a2, b2, y2 = pt.size * (p - 1) / p, p - 1, pt.speedup * t
        det = a1 * b2 - a2 * b1
        inv_b, alpha = (y1 * b2 - y2 * b1) / det, (a1 * y2 - a2 * y1) / det
        out.append(Point(pt.collective, pt.size, pt.speedup, pt.speedup_32, t, y2, 1 / inv_b, alpha))
    return out


def mean_alpha(points: list[Point]) -> float:
    return sum(p.alpha_s for p in points) / len(points)


DERIVED = derive()
RING_STEP_ALPHA_S = mean_alpha(DERIVED)
ALPHA_BAND_S = (min(p.alpha_s for p in DERIVED), max(p.alpha_s for p in DERIVED))
TABLE_II = derive(TABLE_II_BANDWIDTH)  # the sensitivity reading (module docstring)


def markdown() -> str:
    """The derivation's table for the README."""
    lines = [
        "| collective | S | ρ (2,048) | ρ (32, 1 GiB) | T_PCCL ms | T_RCCL ms | B GB/s | α µs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in DERIVED:
        lines.append(
            f"| {p.collective} | {p.size // MiB} MiB | {p.speedup:g} | {p.speedup_32:g} | "
            f"{p.pccl_s * 1e3:.2f} | {p.rccl_s * 1e3:.1f} | {p.ring_bandwidth / 1e9:.1f} | "
            f"{p.alpha_s * 1e6:.1f} |"
        )
    lo, hi = ALPHA_BAND_S
    lines.append(
        f"\nα per inter-node ring step: mean {RING_STEP_ALPHA_S * 1e6:.1f} µs, band {lo * 1e6:.1f}-{hi * 1e6:.1f} µs; "
        f"with Table II's 50 GB/s node ring: mean {mean_alpha(TABLE_II) * 1e6:.1f} µs, "
        f"{min(p.alpha_s for p in TABLE_II) * 1e6:.1f}-{max(p.alpha_s for p in TABLE_II) * 1e6:.1f} µs"
    )
    return "\n".join(lines)
