"""Matmul-mode tuning (001 §5.1.3), decided at one agreed point.

A product ``a @ b`` can run with each operand in row-major ('n') or column-major ('t')
memory layout (NN, NT, TN; 'as_is' keeps the operands' own strides), either directly or
as the transposed product ``(bᵀ aᵀ)ᵀ``.

When it is measured and agreed (no collective on a new shape: ranks of a data group may
see different sequence lengths, and a collective per shape would pair up differently on
each rank):

* the *timing window* is the first grad-enabled forward pass and its backward; every
  call site times every mode for each signature (site, shapes, strides, dtype) it meets
  (one warm-up, ``REPEATS`` timed runs, median, layout conversion included; on an
  accelerator between its timing events, synchronised; on the CPU with the wall clock)
  and meanwhile runs the default mode, so replicas stay bit-identical;
* the *agreed point* is the next forward pass's start (:meth:`MatmulTuner.begin_forward`),
  which every rank reaches in step: one all-gather of every rank's timings over the world;
  every rank merges them the same way (per signature and mode the slowest rank's time),
  keeps the fastest mode per signature and, per call site, the mode of its largest
  signature;
* afterwards a signature seen by some rank uses its agreed mode, any other one its call
  site's mode (the default where the site was never timed). The choices are logged.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from typing import Callable

import torch

from ds_ext import log

LAYOUTS: tuple[str, ...] = ("as_is", "nn", "nt", "tn")
FORMS: tuple[str, ...] = ("ab", "(btat)t")
MODES: tuple[tuple[str, str], ...] = tuple((f, lay) for f in FORMS for lay in LAYOUTS)
DEFAULT: tuple[str, str] = ("ab", "as_is")
REPEATS = 3

# gathers every rank's uint8 tensor of the given size (equal sizes) into one, in rank order
Gather = Callable[[torch.Tensor], torch.Tensor]


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


def time_mode(mode: tuple[str, str], a: torch.Tensor, b: torch.Tensor) -> float:
    """Median seconds of ``REPEATS`` runs of ``mode`` after one warm-up; on an accelerator the
    time between two of its timing events (kernels run asynchronously: the host clock would
    time their launch)."""
    run_mode(mode, a, b)
    runs = []
    for _ in range(REPEATS):
        if a.device.type == "cpu":
            t0 = time.perf_counter()
            run_mode(mode, a, b)
            runs.append(time.perf_counter() - t0)
        else:
            start = torch.Event(device=a.device, enable_timing=True)
            end = torch.Event(device=a.device, enable_timing=True)
            start.record()
            run_mode(mode, a, b)
            end.record()
            end.synchronize()
            runs.append(start.elapsed_time(end) / 1e3)
    return statistics.median(runs)


def signature(site: str, a: torch.Tensor, b: torch.Tensor) -> str:
    """The key a choice is kept under (the same text on every rank)."""
    return json.dumps([site, list(a.shape), list(b.shape), list(a.stride()), list(b.stride()), str(a.dtype)])


def merge(per_rank: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Per signature and mode the slowest rank's time, over the ranks that timed it."""
    merged: dict[str, list[float]] = {}
    for timings in per_rank:
        for sig, times in timings.items():
            merged[sig] = [max(t, u) for t, u in zip(merged[sig], times)] if sig in merged else list(times)
    return merged


class MatmulTuner:
    """Timing window, agreed point and the agreed choices (see the module docstring)."""

    def __init__(self, gather: Gather | None) -> None:
        """``gather``: the all-gather over the world (None: a single process)."""
        self.gather = gather
        self.state = "waiting"  # -> "timing" at the first grad-enabled forward -> "agreed"
        self.local: dict[str, list[float]] = {}  # this rank's timings, per signature
        self.choice: dict[str, tuple[str, str]] = {}  # agreed, per signature
        self.site_choice: dict[str, tuple[str, str]] = {}  # agreed, per call site
        self.timings: dict[str, dict[str, float]] = {}  # agreed times per signature and mode

    def matmul(self, site: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        sig = signature(site, a, b)
        if self.state == "timing" and sig not in self.local:
            self.local[sig] = [time_mode(mode, a, b) for mode in MODES]
        mode = self.choice.get(sig) or self.site_choice.get(site, DEFAULT)
        return run_mode(mode, a, b)

    def begin_forward(self, grad_enabled: bool) -> None:
        """A model forward starts (on every rank in step): open the window or agree."""
        if self.state == "waiting" and grad_enabled:
            self.state = "timing"
        elif self.state == "timing":
            self.agree()

    def agree(self) -> None:
        """The agreed point: one all-gather of every rank's timings, merged identically."""
        per_rank = [self.local] if self.gather is None else self._gather_all(self.local)
        merged = merge(per_rank)
        self.state, self.local = "agreed", {}
        largest: dict[str, tuple[int, str]] = {}
        for sig in sorted(merged):
            times = merged[sig]
            best = MODES[min(range(len(MODES)), key=times.__getitem__)]
            self.choice[sig] = best
            self.timings[sig] = {mode_name(m): t for m, t in zip(MODES, times)}
            site, shape_a, shape_b = json.loads(sig)[:3]
            size = math.prod(shape_a) * shape_b[-1]
            if size > largest.get(site, (-1, ""))[0]:
                largest[site] = (size, sig)
                self.site_choice[site] = best
            log.info(f"matmul tuning: {site} {shape_a} @ {shape_b} -> {mode_name(best)} ({1e6 * min(times):.1f} us)")

    def _gather_all(self, timings: dict[str, list[float]]) -> list[dict[str, list[float]]]:
        data = torch.frombuffer(bytearray(json.dumps(timings).encode()), dtype=torch.uint8)
        sizes = self.gather(torch.tensor([data.numel()], dtype=torch.int64))
        padded = torch.zeros(int(sizes.max()), dtype=torch.uint8)
        padded[: data.numel()] = data
        blobs = self.gather(padded).view(len(sizes), -1)
        return [json.loads(bytes(blob[: int(n)].tolist()).decode()) for blob, n in zip(blobs, sizes)]
