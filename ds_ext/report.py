"""Human-readable tables of ledger traffic."""

from __future__ import annotations

from ds_ext.comm.ledger import Ledger
from ds_ext.topology import GB, Topology


def traffic_table(ledger: Ledger, topology: Topology, model_bytes: int | None = None, skip: int = 0) -> str:
    """Bytes and calls sent by this rank per optimizer step, one row per topology level.

    Means over the closed steps after the first ``skip``. ``bytes/step``, ``MB/step`` and ``x M``
    (in units of M = model bytes, when ``model_bytes`` is given) use 003's volume convention: a
    collective's bytes at the outermost level its group spans, as the papers' tables count them;
    ``on links MB`` books each byte at the level of the link it crosses (``ds_ext.comm.hops``), what
    that level's links carry.
    """
    nbytes = ledger.mean_by_level(skip)
    links = ledger.mean_link_bytes_by_level(skip)
    calls = ledger.mean_calls_by_level(skip)
    header = f"{'level':<8}{'link GB/s':>10}{'bytes/step':>16}{'MB/step':>11}{'on links MB':>13}{'calls/step':>12}"
    if model_bytes:
        header += f"{'x M':>9}"
    lines = [header, "-" * len(header)]
    for lv in topology.levels:
        b = nbytes.get(lv.name, 0.0)
        row = (
            f"{lv.name:<8}{lv.bandwidth / GB:>10g}{b:>16,.0f}{b / 1e6:>11.3f}"
            f"{links.get(lv.name, 0.0) / 1e6:>13.3f}{calls.get(lv.name, 0.0):>12.1f}"
        )
        if model_bytes:
            row += f"{b / model_bytes:>9.3f}"
        lines.append(row)
    n = len(ledger.steps) - skip
    lines.append(
        f"(bytes sent by this rank, mean over {n} optimizer steps; bytes/step, MB/step, x M: at the outermost "
        "level of each collective's group (003's volume); on links: at the level of the link each byte crosses)"
    )
    return "\n".join(lines)
