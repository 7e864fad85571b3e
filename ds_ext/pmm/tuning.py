"""Matmul-mode tuning (001 §5.1.3).

A product ``a @ b`` can run with each operand in row-major ('n') or column-major ('t')
memory layout (NN, NT, TN; 'as_is' keeps the operands' own strides), either directly or
as the transposed product ``(bᵀ aᵀ)ᵀ``. The first time a call site meets a signature
(site, shapes, strides, dtype), every mode is timed (one warm-up, ``REPEATS`` timed runs,
median, layout conversion included); the slowest rank's time per mode decides (a MAX
all-reduce over the world), so every rank keeps the same mode and replicated computations
stay bit-identical across ranks. The choice is cached per signature and logged.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ds_ext.pmm.engine import PMMEngine

log = logging.getLogger("ds_ext.pmm")

LAYOUTS: tuple[str, ...] = ("as_is", "nn", "nt", "tn")
FORMS: tuple[str, ...] = ("ab", "(btat)t")
MODES: tuple[tuple[str, str], ...] = tuple((f, lay) for f in FORMS for lay in LAYOUTS)
REPEATS = 3


def _layout(t: torch.Tensor, kind: str) -> torch.Tensor:
    return t.contiguous() if kind == "n" else t.t().contiguous().t()


def run_mode(mode: tuple[str, str], a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` computed in ``mode`` = (form, layout); the result is contiguous."""
    form, lay = mode
    lhs, rhs = (a, b) if form == "ab" else (b.t(), a.t())
    if lay != "as_is":
        lhs, rhs = _layout(lhs, lay[0]), _layout(rhs, lay[1])
    out = lhs @ rhs
    return out if form == "ab" else out.t().contiguous()


def mode_name(mode: tuple[str, str]) -> str:
    form, lay = mode
    return lay if form == "ab" else f"{form}:{lay}"


class MatmulTuner:
    """Per-signature cache of the fastest mode."""

    def __init__(self, engine: "PMMEngine") -> None:
        self.engine = engine
        self.choice: dict[tuple, tuple[str, str]] = {}
        self.timings: dict[tuple, dict[str, float]] = {}

    def matmul(self, site: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        key = (site, tuple(a.shape), tuple(b.shape), a.stride(), b.stride(), a.dtype)
        mode = self.choice.get(key)
        if mode is None:
            mode = self._tune(key, a, b)
        return run_mode(mode, a, b)

    def _tune(self, key: tuple, a: torch.Tensor, b: torch.Tensor) -> tuple[str, str]:
        times = []
        for mode in MODES:
            run_mode(mode, a, b)
            runs = []
            for _ in range(REPEATS):
                t0 = time.perf_counter()
                run_mode(mode, a, b)
                runs.append(time.perf_counter() - t0)
            times.append(statistics.median(runs))
        agreed = torch.tensor(times, dtype=torch.float64)
        self.engine.all_reduce_world_max(agreed)
        best = MODES[int(torch.argmin(agreed))]
        self.choice[key] = best
        self.timings[key] = {mode_name(m): float(t) for m, t in zip(MODES, agreed)}
        log.info("matmul tuning: %s %s @ %s -> %s (%.1f us)", key[0], list(key[1]), list(key[2]),
                 mode_name(best), 1e6 * float(agreed.min()))
        return best
