"""What a benchmark record must carry for a reviewer (docs/architecture.md, Benchmarks): ratios with intervals and the
provenance of the run.

* :func:`ratio_interval`: the ratio of two variants' median step times with a percentile-bootstrap
  95 % interval (each variant's steps resampled with replacement, the ratio of the medians
  recomputed; numpy's generator, seeded, so a record recomputes exactly from its steps);
* :func:`round_ratio_interval`: the same over steps measured in interleaved rounds (each round a
  fresh run of every variant): a two-stage (cluster) bootstrap that resamples rounds, the same
  rounds for both variants (they ran side by side), then the steps within each drawn round, so
  that drift from round to round (the host's load, a link's queue) widens the interval where a
  bootstrap over pooled steps would call it precision;
* :func:`provenance`: the commit (and whether the tree had uncommitted changes), the date, the
  command, the host (CPU model, cores, load average) and the library versions; a benchmark adds
  its own settings (link rates, NIC layout, ranks, model, sequence length, GA), the load average
  after the run and when it finished.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Sequence

from ds_ext.errors import DsExtError

BOOTSTRAP_SAMPLES = 10_000
CONFIDENCE = 0.95


class StatsError(DsExtError, ValueError):
    """A ratio asked of a variant without measured steps."""


def ratio_interval(
    numerator: Sequence[float], denominator: Sequence[float], samples: int = BOOTSTRAP_SAMPLES, seed: int = 0
) -> dict[str, float | int]:
    """median(numerator) / median(denominator) with its percentile-bootstrap ``CONFIDENCE``
    interval (``lo``, ``hi``) over ``samples`` resamples, and the step counts it rests on."""
    import numpy as np

    a, b = np.asarray(numerator, dtype=float), np.asarray(denominator, dtype=float)
    if a.size == 0 or b.size == 0:
        raise StatsError("ratio_interval needs at least one step of each variant")
    rng = np.random.default_rng(seed)
    ra = np.median(rng.choice(a, (samples, a.size)), axis=1)
    rb = np.median(rng.choice(b, (samples, b.size)), axis=1)
    tail = (1 - CONFIDENCE) / 2 * 100
    lo, hi = np.percentile(ra / rb, [tail, 100 - tail])
    return {
        "ratio": float(np.median(a) / np.median(b)),
        "lo": float(lo),
        "hi": float(hi),
        "n": int(min(a.size, b.size)),
    }


def round_ratio_interval(
    numerator: Sequence[Sequence[float]],
    denominator: Sequence[Sequence[float]],
    samples: int = BOOTSTRAP_SAMPLES,
    seed: int = 0,
) -> dict[str, float | int]:
    """median(all numerator steps) / median(all denominator steps) with its two-stage bootstrap
    ``CONFIDENCE`` interval (module docstring): ``numerator[r]`` and ``denominator[r]`` are round
    r's steps of each variant. ``n``: the steps of the smaller side, ``rounds``: the rounds. One
    round is the step bootstrap of :func:`ratio_interval`."""
    import numpy as np

    if len(numerator) != len(denominator) or not numerator:
        raise StatsError(
            f"round_ratio_interval needs the same rounds of each variant; got {len(numerator)} and {len(denominator)}"
        )
    if any(len({len(x) for x in side}) != 1 or not side[0] for side in (numerator, denominator)):
        raise StatsError("round_ratio_interval needs the same number (> 0) of steps in every round of a variant")
    a, b = np.asarray(numerator, dtype=float), np.asarray(denominator, dtype=float)  # (rounds, steps)
    rng = np.random.default_rng(seed)
    rounds = a.shape[0]
    drawn = rng.integers(0, rounds, (samples, rounds))  # the same rounds for both variants

    def medians(side: "np.ndarray") -> "np.ndarray":
        steps = rng.integers(0, side.shape[1], (samples, rounds, side.shape[1]))  # each drawn round's steps
        return np.median(side[drawn[:, :, None], steps].reshape(samples, -1), axis=1)

    ra, rb = medians(a), medians(b)
    tail = (1 - CONFIDENCE) / 2 * 100
    lo, hi = np.percentile(ra / rb, [tail, 100 - tail])
    return {
        "ratio": float(np.median(a) / np.median(b)),
        "lo": float(lo),
        "hi": float(hi),
        "n": int(min(a.size, b.size)),
        "rounds": rounds,
    }


def _git(*argv: str) -> str | None:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", *argv], cwd=root, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def load_average() -> list[float]:
    """The host's 1, 5 and 15 minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def utc_now() -> str:
    """Now, in UTC, to the second (a run's ``date`` and ``finished``)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def provenance(**settings: Any) -> dict[str, Any]:
    """Where and how a run was made (module docstring), with the benchmark's ``settings``; the
    caller adds ``load_average_after`` when the run ends."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "commit": _git("rev-parse", "HEAD"),
        "uncommitted_changes": None if status is None else bool(status),
        "date": utc_now(),
        "command": " ".join(["ds-ext", *sys.argv[1:]]) if sys.argv else None,
        "host": {"cpu": _cpu_model(), "cores": os.cpu_count(), "load_average_before": load_average()},
        "versions": {p: _version(p) for p in ("ds_ext", "torch", "deepspeed")} | {"python": platform.python_version()},
        **settings,
    }
