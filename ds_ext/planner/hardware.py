"""Every hardware figure the planner uses, with its source (paper and section / table), as data.

``ds_ext.planner.machine`` builds the Frontier preset from this table, ``ds_ext.planner.rccl``
and ``ds_ext.planner.compute_rate`` read their inputs from it, and ``ds-ext simulate --validate``
prints it (:func:`markdown`) above its rows. Nothing here is fitted to a validation row: a figure
is a published number, a number derived from published numbers by the module named in its
source, or marked ``assumed``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

GiB = 2**30


@dataclass(frozen=True)
class Figure:
    """One hardware number: ``value`` in ``unit``, what it is, and where it comes from."""

    key: str
    value: float
    unit: str
    what: str
    source: str


FIGURES: tuple[Figure, ...] = (
    Figure(
        "gcd_bandwidth",
        200,
        "GB/s",
        "between the two GCDs of one MI250X (4 Infinity Fabric links of 50 GB/s)",
        "003 §IV; 004 §III-A, Fig 4 ('four (50+50 GB/s) infinite fabrics')",
    ),
    Figure(
        "gpu_bandwidth",
        100,
        "GB/s",
        "between GCDs of different MI250X of a node ('across the die': half of "
        "the in-die 200 GB/s); also the node's 8-GCD ring in the RCCL derivation",
        "004 §III-A, Fig 4; 003 §IV (adjacent MI250X pairs: two Infinity Fabric links)",
    ),
    Figure(
        "gpu_bandwidth_table_ii",
        50,
        "GB/s",
        "one Infinity Fabric link, the cross MI250X pairs (sensitivity rows only)",
        "003 Table II",
    ),
    Figure(
        "node_bandwidth",
        12.5,
        "GB/s per GCD",
        "4 Slingshot-11 NICs of 25 GB/s per node shared by its 8 GCDs",
        "003 §IV; 004 §III-A ('25+25 GB/s')",
    ),
    Figure("gcd_latency", 5, "µs", "per message between the GCDs of one MI250X", "assumed: no paper gives one"),
    Figure("gpu_latency", 8, "µs", "per message between MI250X of a node", "assumed: no paper gives one"),
    Figure(
        "pccl_node_latency",
        15,
        "µs",
        "per message of PCCL's recursive doubling across nodes (RCCL derivation input; 0.2 ms of a 10-20 ms time)",
        "assumed: no paper gives one",
    ),
    Figure(
        "device_memory",
        64 * GiB,
        "bytes",
        "HBM2e per GCD, binary units as 003 §II-A's 68B counts it",
        "003 §IV, 000 §VI-A",
    ),
    Figure("peak_flops", 191.5e12, "FLOP/s", "16-bit peak per GCD", "000 §VI-C, 004 §V-B"),
    Figure(
        "gemm_flops", 125e12, "FLOP/s", "best bf16 GEMM on one GCD, 32768² (upper bound, sensitivity rows)", "000 §VI-C"
    ),
    Figure(
        "tuned_step_s",
        13.19,
        "s",
        "GPT-320B computation per batch with BLAS tuning (the compute rate's input)",
        "000 §V-C",
    ),
    Figure("untuned_step_s", 30.1, "s", "the same without tuning (sensitivity rows)", "000 §V-C"),
    Figure("max_nodes", 9408, "nodes", "Frontier: 75,264 GCDs", "004 abstract"),
    Figure("summit_gpu_memory", 16 * GiB, "bytes", "V100 memory of Fig 7.9's Summit runs", "001 §3.3"),
)

_BY_KEY = {f.key: f for f in FIGURES}


def value(key: str) -> float:
    """The figure ``key``'s value in its unit."""
    return _BY_KEY[key].value


def records() -> list[dict]:
    """The table as JSON records."""
    return [asdict(f) for f in FIGURES]


def markdown(derived: tuple[tuple[str, str, str], ...] = ()) -> str:
    """The table for the README / ``simulate --validate``; ``derived``: (figure, value, source)
    rows of numbers the planner derives from these (RCCL's α, the compute rate)."""
    lines = ["| figure | value | source |", "|---|---|---|"]
    for f in FIGURES:
        shown = (
            f"{f.value / GiB:g} GiB"
            if f.unit == "bytes"
            else f"{f.value / 1e12:g} TFLOP/s"
            if f.unit == "FLOP/s"
            else f"{f.value:g} {f.unit}"
        )
        lines.append(f"| {f.what} (`{f.key}`) | {shown} | {f.source} |")
    lines += [f"| {what} | {val} | {src} |" for what, val, src in derived]
    return "\n".join(lines)
