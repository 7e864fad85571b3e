"""Communication ledger: bytes, calls and messages per (step, phase, op, topology level).

Byte convention (bytes *sent by one rank*, the usual bandwidth-optimal algorithms;
003 §V-D and the formula sheet of spec/zero_topo_and_frontier.md part D), for a group
of d ranks:

==================  ==============================================
all_gather          n (d-1)      for n input bytes per rank  (= S(d-1)/d of the output S)
reduce_scatter      S (d-1)/d    for S input bytes
all_reduce          2 S (d-1)/d  (reduce-scatter + all-gather)
all_to_all          input bytes addressed to the other ranks
broadcast           S (d-1)/d    (pipelined chain: S (d-1) in total over d ranks)
==================  ==============================================

A group of one rank sends nothing and is not recorded. Each record is attributed to the
outermost topology level the group crosses (``Topology.level_of``).

Messages (the alpha term of the alpha-beta model, 001 §6.2): point-to-point sends issued by
this rank. ds_ext's own algorithms (``ds_ext.comm.algorithms``: ring, PCCL) count their sends
one by one and record each phase at the level of the sub-group it runs on; a collective
left to torch.distributed (``native``, or issued by third-party code) is counted by the
convention of the ring it stands for, ``ds_ext.comm.emulation.message_steps``: d - 1 (all-reduce
2 (d - 1)).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterator

Key = tuple[str, str, str]  # (phase, op, level)


def all_gather_bytes(input_bytes: int, d: int) -> int:
    return input_bytes * (d - 1)


def reduce_scatter_bytes(input_bytes: int, d: int) -> float:
    return input_bytes * (d - 1) / d


def all_reduce_bytes(nbytes: int, d: int) -> float:
    return 2 * nbytes * (d - 1) / d


def broadcast_bytes(nbytes: int, d: int) -> float:
    return nbytes * (d - 1) / d


@dataclass
class Traffic:
    """Aggregated bytes, calls and messages keyed by (phase, op, level)."""

    bytes: dict[Key, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[Key, int] = field(default_factory=lambda: defaultdict(int))
    messages: dict[Key, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, key: Key, nbytes: float, messages: int = 0) -> None:
        self.bytes[key] += nbytes
        self.calls[key] += 1
        self.messages[key] += messages

    def by_level(self, phase: str | None = None, op: str | None = None) -> dict[str, float]:
        """Bytes summed per level, optionally only one phase and/or op."""
        out: dict[str, float] = defaultdict(float)
        for (ph, o, lv), b in self.bytes.items():
            if (phase is None or ph == phase) and (op is None or o == op):
                out[lv] += b
        return dict(out)

    def calls_by_level(self, phase: str | None = None) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for (ph, _, lv), c in self.calls.items():
            if phase is None or ph == phase:
                out[lv] += c
        return dict(out)

    def messages_by_level(self, phase: str | None = None, op: str | None = None) -> dict[str, int]:
        """Messages summed per level, optionally only one phase and/or op."""
        out: dict[str, int] = defaultdict(int)
        for (ph, o, lv), m in self.messages.items():
            if (phase is None or ph == phase) and (op is None or o == op):
                out[lv] += m
        return dict(out)

    def by_phase(self) -> dict[str, dict[str, float]]:
        """{phase: {level: bytes}}."""
        out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for (ph, _, lv), b in self.bytes.items():
            out[ph][lv] += b
        return {ph: dict(v) for ph, v in out.items()}

    def total(self) -> float:
        return float(sum(self.bytes.values()))


class Ledger:
    """Per-rank record of every collective that passes through ``ds_ext.comm``.

    Use :meth:`phase` to tag records, :meth:`mark_step` at each optimizer step boundary
    (``ds_ext.initialize`` does this for the engine), :attr:`steps` for closed steps and
    :attr:`current` for the open one.
    """

    def __init__(self, levels: tuple[str, ...]) -> None:
        self.levels = levels
        self.enabled = True
        self._phase = "other"
        self.steps: list[Traffic] = []
        self.current = Traffic()

    def record(self, op: str, level: str | None, nbytes: float, messages: int = 0) -> None:
        """One collective (or one phase of a hierarchical one) of ``op`` at ``level``: ``nbytes``
        and ``messages`` sent by this rank."""
        if not self.enabled or level is None:
            return
        self.current.add((self._phase, op, level), nbytes, messages)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Tag the collectives issued inside the block with ``name``."""
        prev, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = prev

    @property
    def current_phase(self) -> str:
        return self._phase

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        prev, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = prev

    def mark_step(self) -> Traffic:
        """Close the open step and return it."""
        done, self.current = self.current, Traffic()
        self.steps.append(done)
        return done

    def reset(self) -> None:
        self.steps.clear()
        self.current = Traffic()

    def _mean_by_level(self, skip: int, per_step: Callable[[Traffic], dict[str, float]]) -> dict[str, float]:
        """Mean of ``per_step`` (a step's {level: value}) over the closed steps after ``skip``."""
        steps = self.steps[skip:]
        out = {lv: 0.0 for lv in self.levels}
        for s in steps:
            for lv, v in per_step(s).items():
                out[lv] += v / len(steps)
        return out

    def mean_by_level(self, skip: int = 0) -> dict[str, float]:
        """Mean bytes per closed step per level, ignoring the first ``skip`` steps."""
        return self._mean_by_level(skip, Traffic.by_level)

    def mean_by_phase(self, skip: int = 0) -> dict[str, dict[str, float]]:
        """Mean bytes per closed step as {phase: {level: bytes}}, ignoring ``skip`` steps."""
        steps = self.steps[skip:]
        out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for s in steps:
            for ph, levels in s.by_phase().items():
                for lv, b in levels.items():
                    out[ph][lv] += b / len(steps)
        return {ph: dict(v) for ph, v in out.items()}

    def mean_messages_by_level(self, skip: int = 0) -> dict[str, float]:
        """Mean messages per closed step per level, ignoring the first ``skip`` steps."""
        return self._mean_by_level(skip, Traffic.messages_by_level)

    def mean_calls_by_level(self, skip: int = 0) -> dict[str, float]:
        """Mean calls per closed step per level, ignoring the first ``skip`` steps."""
        return self._mean_by_level(skip, Traffic.calls_by_level)
