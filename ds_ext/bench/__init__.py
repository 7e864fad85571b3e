"""Benchmarks behind ``ds-ext bench <name>``.

Each module exposes ``add_arguments(parser)`` and ``run(args) -> dict``; ``run`` writes
its records to ``args.out`` (JSON), prints a table and saves a PNG next to the JSON.
Variants are always measured side by side in the same invocation so that ratios, not
absolute times on a noisy machine, carry the claims.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

BENCHMARKS: tuple[str, ...] = ("zero", "tiled", "quant", "ledger", "pmm", "ted", "pccl", "scale")


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    return path
