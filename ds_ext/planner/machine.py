"""Machine presets: the hardware facts the planner uses, each with its source.

Communication is an α-β model per topology level (``ds_ext.topology``): a collective that
spans level L costs ``messages x α_L + bytes / β_L`` for the bytes one rank sends (the
ledger's convention), β_L being one rank's share of the level's links when every rank uses
them at once (the machine ``ds_ext.comm.emulation`` emulates). Compute runs at
``peak x efficiency``, the efficiency of a training step's computation as one paper measured it
(``ds_ext.planner.compute_rate``).
"""

from __future__ import annotations

import math
from dataclasses import replace

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt

from ds_ext.planner import PlannerError, compute_rate, hardware, rccl
from ds_ext.topology import GB, US, Topology, preset_levels

GiB = 2**30


class MachineError(PlannerError):
    """Nodes or overrides that do not fit the machine; the message names the argument."""


class Machine(BaseModel):
    """One machine: topology preset, device memory, 16-bit peak and the compute efficiency."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    topology: str = Field(description="ds_ext.topology preset (levels, bandwidths, latencies).")
    device_memory: PositiveFloat = Field(description="Bytes of memory per rank (device).")
    peak_flops: PositiveFloat = Field(description="16-bit peak FLOP/s per rank.")
    efficiency: PositiveFloat = Field(le=1, description="Fraction of the peak the compute reaches.")
    max_nodes: PositiveInt
    sources: dict[str, str]
    bandwidth_GBps: dict[str, PositiveFloat] = Field({}, description="Per-level bandwidth overrides (--bandwidth).")
    latency_us: dict[str, float] = Field({}, description="Per-level latency overrides (--latency).")
    level_sizes: dict[str, PositiveInt] = Field({}, description="Ranks per domain of inner levels (tune --size).")

    @property
    def flops(self) -> float:
        """FLOP/s the compute model runs at."""
        return self.peak_flops * self.efficiency

    def with_links(self, bandwidth_GBps: dict[str, float], latency_us: dict[str, float]) -> "Machine":
        """This machine with per-level bandwidth (GB/s) / latency (µs) overrides, checked against its levels."""
        names = [lv.name for lv in preset_levels(self.topology)]
        for key, values in (("--bandwidth", bandwidth_GBps), ("--latency", latency_us)):
            for name, value in values.items():
                if name not in names:
                    raise MachineError(f"{key}: {self.name} has no level {name!r}; allowed: {', '.join(names)}")
                if value < 0 or (key == "--bandwidth" and value == 0):
                    raise MachineError(f"{key}: {name}={value} must be {'> 0' if key == '--bandwidth' else '>= 0'}")
        return self.model_copy(
            update={
                "bandwidth_GBps": {**self.bandwidth_GBps, **bandwidth_GBps},
                "latency_us": {**self.latency_us, **latency_us},
            }
        )

    def with_sizes(self, sizes: dict[str, int]) -> "Machine":
        """This machine with ``sizes`` ranks per domain of its inner levels (an emulated node)."""
        inner = [lv.name for lv in preset_levels(self.topology)][:-1]
        for name, value in sizes.items():
            if name not in inner:
                raise MachineError(f"--size: {self.name} has no inner level {name!r}; allowed: {', '.join(inner)}")
            if value < 1:
                raise MachineError(f"--size: {name}={value} must be >= 1")
        return self.model_copy(update={"level_sizes": {**self.level_sizes, **sizes}})

    def ranks_per_node(self) -> int:
        """Ranks of one node (the product of the inner levels' sizes)."""
        return math.prod(self.level_sizes.get(lv.name, lv.size) for lv in preset_levels(self.topology)[:-1])  # type: ignore[misc]

    def build_topology(self, nodes: int) -> Topology:
        """The topology of ``nodes`` nodes, with this machine's per-level overrides."""
        if not 1 <= nodes <= self.max_nodes:
            raise MachineError(f"--nodes: {nodes} does not fit {self.name}; allowed: 1 to {self.max_nodes}")
        levels = [
            replace(
                lv,
                bandwidth=self.bandwidth_GBps.get(lv.name, lv.bandwidth / GB) * GB,
                latency=self.latency_us.get(lv.name, lv.latency / US) * US,
                size=self.level_sizes.get(lv.name, lv.size),
            )
            for lv in preset_levels(self.topology)
        ]
        inner = 1
        for lv in levels[:-1]:
            inner *= lv.size  # type: ignore[operator]
        return Topology.build(levels, nodes * inner, self.topology)


MACHINES: dict[str, Machine] = {
    "frontier": Machine(
        bandwidth_GBps={lv: hardware.value(f"{lv}_bandwidth") for lv in ("gcd", "gpu", "node")},
        latency_us={
            "gcd": hardware.value("gcd_latency"),
            "gpu": hardware.value("gpu_latency"),
            "node": rccl.RING_STEP_ALPHA_S * 1e6,
        },
        name="frontier",
        topology="frontier",
        device_memory=hardware.value("device_memory"),
        peak_flops=compute_rate.PEAK_FLOPS,
        efficiency=compute_rate.STEP_EFFICIENCY,
        max_nodes=int(hardware.value("max_nodes")),
        sources={
            "levels": "ds_ext.planner.hardware: GCD pair 200 GB/s (003 §IV, 004 §III-A), between MI250X 100 GB/s "
            "(004 §III-A: half the in-die bandwidth; 003 §IV's two-link adjacent pairs), Slingshot "
            "4 x 25 GB/s per node = 12.5 GB/s per GCD (003 §IV, 004 §III-A); latencies 5 / 8 us assumed "
            "inside a node (no paper gives them)",
            "latency_us": "node: RCCL's latency per inter-node ring step, derived from 001 §6.3.1's PCCL / RCCL "
            "speedups at 2,048 and 32 GCDs (ds_ext.planner.rccl)",
            "device_memory": "64 GB HBM2e per GCD (003 §IV, 000 §VI-A) in binary units, as 003 §II-A's 68B ZeRO-3 "
            "figure counts it (64 GiB / 16 B per parameter x 16 GCDs)",
            "peak_flops": "191.5 Tflop/s 16-bit per GCD (000 §VI-C, 004 §V-B)",
            "efficiency": f"a training step's computation: GPT-320B's {compute_rate.TUNED_S} s per batch on "
            f"{compute_rate.RUN_GCDS:,} GCDs (000 §V-C, Table III, Table I) = "
            f"{compute_rate.rate() / 1e12:.1f} Tflop/s per GCD (ds_ext.planner.compute_rate); the best "
            "single GEMM, 125 Tflop/s (000 §VI-C), is an upper bound",
            "max_nodes": "9,408 nodes = 75,264 GCDs (004 abstract)",
        },
    ),
}


def lookup(name: str) -> Machine:
    try:
        return MACHINES[name]
    except KeyError:
        raise MachineError(f"--machine: unknown machine {name!r}; allowed: {', '.join(MACHINES)}") from None
