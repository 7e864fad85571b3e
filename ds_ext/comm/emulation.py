"""Alpha-beta time emulation of collectives on one host.

A collective of ``b`` bytes sent per rank over a group of ``d`` ranks spanning level L
costs ``steps(op, d) * alpha_L + b / beta_L`` (Hockney model; 001 §6.2 uses the same
form for its collective models). ``alpha_L`` and ``beta_L`` are the level's latency and
per-rank bandwidth from the topology. Ring all-gather / reduce-scatter and pairwise
all-to-all take ``d - 1`` steps, ring all-reduce ``2 (d - 1)``.

When enabled, the communicator holds each collective until ``start + cost`` so that
topology effects show in wall time; async collectives overlap with compute as they
would on the real machine (the hold happens at ``wait``).
"""

from __future__ import annotations

import time

from ds_ext.topology import Topology

_STEP_FACTOR = {"all_reduce": 2}


def message_steps(op: str, d: int) -> int:
    """Sequential messages of the ring/pairwise algorithm for ``op`` on ``d`` ranks."""
    return _STEP_FACTOR.get(op, 1) * (d - 1)


class TimeEmulator:
    """Computes and enforces the alpha-beta cost of each collective."""

    def __init__(self, topology: Topology, scale: float = 1.0) -> None:
        self.topology = topology
        self.scale = scale

    def cost(self, op: str, level: str | None, nbytes: float, d: int) -> float:
        """Seconds the collective would take on the emulated machine."""
        if level is None or d <= 1:
            return 0.0
        lv = self.topology.level(level)
        return self.scale * (message_steps(op, d) * lv.latency + nbytes / lv.bandwidth)

    @staticmethod
    def hold_until(deadline: float) -> None:
        remaining = deadline - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
