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
outermost topology level the group crosses (``Topology.level_of``): 003's *volume* convention,
which the analytic models and the papers' tables use.

Link bytes (where the bytes travel, :mod:`ds_ext.comm.hops`): beside that volume, each collective
books the bytes this rank actually sends under the algorithm the backend runs, each at the level
of the link to the peer it goes to. A ring over 8 ranks on 2 nodes books its volume at ``node``
and its link bytes at the level of this rank's ring neighbour: summed over the ranks, a level's
link bytes are what that level's links carry (the kernel's counters, ``ds_ext.cluster.wire``).

Messages (the alpha term of the alpha-beta model, 001 §6.2): point-to-point sends issued by
this rank. ds_ext's own algorithms (``ds_ext.comm.algorithms``: ring, PCCL) count their sends
one by one and record each phase at the level of the sub-group it runs on; a collective
left to torch.distributed (``native``, or issued by third-party code) is counted by the
convention of the ring it stands for, ``ds_ext.comm.emulation.message_steps``: d - 1 (all-reduce
2 (d - 1)).

Seconds (measured, never modelled; 001 ch. 7 reports all-to-all time as a share of batch
time): a timed span around each collective on the calling rank, ``time.perf_counter`` from
the call until it returns, or for ``async_op=True`` until its ``wait()`` returns: the time
this rank spends issuing, transferring, and waiting for its slowest peer (and, with time
emulation on, the emulated hold). Each span is keyed by the (phase, op, level) of its call,
accumulated into the step that is open when it closes; a hierarchical collective of ds_ext
(ring / PCCL) is one span at the outermost level its group spans; an async collective whose
work is never waited on records no time. On gloo the calls block, so a span is the transfer.
On a GPU (NCCL / RCCL) a collective returns once it is enqueued and ``wait()`` only orders
streams, so a span is launch time; set :attr:`Ledger.synchronize` (e.g.
``torch.cuda.synchronize``) to have each span start and end on a synchronized device: it then
covers the transfer, at the price of serializing the collective with compute around it.
With :attr:`Ledger.trace` a list, each closed span is also appended to it as
``(key, start, end)`` (perf_counter seconds): a timeline of where the step waited on which level
(``ds-ext bench zero``'s per-level busy time).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

Key = tuple[str, str, str]  # (phase, op, level)
Span = tuple[Key | None, float]  # (key, or None when not recorded; perf_counter at the call)


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
    """Aggregated bytes, calls, messages and measured seconds keyed by (phase, op, level)."""

    bytes: dict[Key, float] = field(default_factory=lambda: defaultdict(float))
    # bytes sent per (phase, op, level of the link they cross): module docstring, "Link bytes"
    link_bytes: dict[Key, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[Key, int] = field(default_factory=lambda: defaultdict(int))
    messages: dict[Key, int] = field(default_factory=lambda: defaultdict(int))
    seconds: dict[Key, float] = field(default_factory=lambda: defaultdict(float))

    def add(self, key: Key, nbytes: float, messages: int = 0) -> None:
        self.bytes[key] += nbytes
        self.calls[key] += 1
        self.messages[key] += messages

    def by_level(self, phase: str | None = None, op: str | None = None) -> dict[str, float]:
        """Bytes summed per level, optionally only one phase and/or op."""
        return _summed(self.bytes, 2, phase, op)

    def link_bytes_by_level(self, phase: str | None = None, op: str | None = None) -> dict[str, float]:
        """Link bytes (module docstring) summed per level of the link, optionally one phase and/or op."""
        return _summed(self.link_bytes, 2, phase, op)

    def calls_by_level(self, phase: str | None = None) -> dict[str, int]:
        return _summed(self.calls, 2, phase)

    def messages_by_level(self, phase: str | None = None, op: str | None = None) -> dict[str, int]:
        """Messages summed per level, optionally only one phase and/or op."""
        return _summed(self.messages, 2, phase, op)

    def seconds_by_op(self, phase: str | None = None, level: str | None = None) -> dict[str, float]:
        """Measured seconds inside collectives summed per op, optionally one phase and/or level."""
        return _summed(self.seconds, 1, phase, level=level)

    def by_phase(self) -> dict[str, dict[str, float]]:
        """{phase: {level: bytes}}."""
        out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for (ph, _, lv), b in self.bytes.items():
            out[ph][lv] += b
        return {ph: dict(v) for ph, v in out.items()}

    def link_bytes_by_phase(self) -> dict[str, dict[str, float]]:
        """{phase: {level of the link: link bytes}} (module docstring, "Link bytes")."""
        out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for (ph, _, lv), b in self.link_bytes.items():
            out[ph][lv] += b
        return {ph: dict(v) for ph, v in out.items()}

    def total(self) -> float:
        return float(sum(self.bytes.values()))


def _summed(
    values: dict[Key, Any], by: int, phase: str | None, op: str | None = None, level: str | None = None
) -> dict:
    """``values`` summed per key field ``by`` (1: op, 2: level) over the (phase, op, level) keys
    that match every filter given."""
    out: dict = {}
    for key, v in values.items():
        ph, o, lv = key
        if (phase is None or ph == phase) and (op is None or o == op) and (level is None or lv == level):
            out[key[by]] = out.get(key[by], 0) + v
    return out


class Ledger:
    """Per-rank record of every collective that passes through ``ds_ext.comm``.

    Use :meth:`phase` to tag records, :meth:`mark_step` at each optimizer step boundary
    (``ds_ext.initialize`` does this for the engine), :attr:`steps` for closed steps and
    :attr:`current` for the open one.
    """

    synchronize: Callable[[], None] | None = None
    """Called where a timed span starts and ends (module docstring: spans on a GPU); None: not."""

    def __init__(self, levels: tuple[str, ...]) -> None:
        self.levels = levels
        self.trace: list[tuple[Key, float, float]] | None = None  # closed spans, while a list
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

    def record_links(self, op: str, links: dict[str, float]) -> None:
        """The link bytes of one collective of ``op``: bytes this rank sent, per level of the link
        they crossed (:func:`ds_ext.comm.hops.by_level`)."""
        if not self.enabled:
            return
        for level, nbytes in links.items():
            self.current.link_bytes[(self._phase, op, level)] += nbytes

    def start(self, op: str, level: str | None) -> Span:
        """Open the timed span of one collective of ``op`` at ``level``, issued now."""
        key = (self._phase, op, level) if self.enabled and level is not None else None
        if key is not None and self.synchronize is not None:
            self.synchronize()
        return key, time.perf_counter()

    def finish(self, span: Span) -> None:
        """Close ``span`` now: its seconds go to the open step under its key."""
        key = span[0]
        if key is None:
            return
        if self.synchronize is not None:
            self.synchronize()
        end = time.perf_counter()
        self.current.seconds[key] += end - span[1]
        if self.trace is not None:
            self.trace.append((key, span[1], end))

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

    def mean_link_bytes_by_level(self, skip: int = 0) -> dict[str, float]:
        """Mean link bytes per closed step per level of the link, ignoring the first ``skip`` steps."""
        return self._mean_by_level(skip, Traffic.link_bytes_by_level)

    def mean_messages_by_level(self, skip: int = 0) -> dict[str, float]:
        """Mean messages per closed step per level, ignoring the first ``skip`` steps."""
        return self._mean_by_level(skip, Traffic.messages_by_level)

    def mean_calls_by_level(self, skip: int = 0) -> dict[str, float]:
        """Mean calls per closed step per level, ignoring the first ``skip`` steps."""
        return self._mean_by_level(skip, Traffic.calls_by_level)
