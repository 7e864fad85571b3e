"""The one choke point for ds_ext collectives.

:class:`Communicator` wraps torch.distributed's tensor collectives over any group,
records each call in the :class:`~ds_ext.comm.ledger.Ledger` (bytes sent per rank, by
the convention documented there, at the topology level the group spans), and, when a
:class:`~ds_ext.comm.emulation.TimeEmulator` is attached, holds each collective for its
alpha-beta cost. Every method has an ``async_op`` form returning a :class:`Handle`. Each call
is also a timed span in the ledger (the seconds this rank spends in it, until :meth:`Handle.wait`
returns for an async one; ``ds_ext.comm.ledger`` says what a span covers on a GPU).

All-gather and reduce-scatter run by an algorithm (``ds_ext.comm.algorithms``, 001 §6.2):
``native`` (torch.distributed's collective), ``ring``, ``pccl`` or ``auto``; the
communicator's default comes from ``ds_ext.comm.algorithm``, a call site may pass its own.
``auto`` and the emulated time of ring / pccl ask an :class:`AlgorithmModel`, the alpha-beta
model of the layer above (``ds_ext.perf.collectives``, which the runtime passes in).

Sharding contract: tensors are passed flat or N-d; the communicator hands gloo
contiguous 1-D views (gloo rejects an N-d input with a flat output, which NCCL accepts).

Faults: process groups are created with ``ds_ext.comm.timeout_s``; a collective that
fails (a peer died, or did not answer within the timeout) raises :class:`CommError`,
one line naming the op, the group's level and size, and the timeout, on every rank that
was waiting for it, so a lost rank ends the job instead of hanging it. A plugin may set
:attr:`Communicator.watch` (a :class:`Watch`): on gloo every collective then waits in slices
of ``watch.check_s`` (torch's timed wait; gloo's own reduce-scatter work ignores one, so on gloo
the reduce-scatter is an all-to-all and a local reduction), asking the watch after each slice (ZeRO-topo's unit agreement, ``ds_ext.zero_topo.agreement``); the watch is also
asked before a failed collective is reported.
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Callable, Iterator, Protocol, Sequence

import torch
import torch.distributed as dist

from ds_ext.comm import algorithms, hops
from ds_ext.comm.emulation import TimeEmulator, message_steps
from ds_ext.comm.ledger import (
    Ledger,
    Span,
    all_gather_bytes,
    all_reduce_bytes,
    broadcast_bytes,
    reduce_scatter_bytes,
)
from ds_ext.errors import DsExtError
from ds_ext.groups import GroupRegistry
from ds_ext.topology import Topology

# The torch.distributed tensor collectives ds_ext calls and ``ds_ext.comm.instrument`` wraps.
TORCH_OP_NAMES: tuple[str, ...] = tuple(
    name
    for name in (
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "all_gather_single",  # torch >= 2.13's names for the two above (FSDP2 calls these)
        "reduce_scatter_single",
        "all_reduce",
        "all_to_all_single",
        "broadcast",
        "all_gather",
        "reduce_scatter",
        "all_to_all",
        "all_reduce_coalesced",
        "reduce",
    )
    if hasattr(dist, name)
)

# While ``ds_ext.comm.instrument`` is installed: the functions it replaced (whatever was
# in torch.distributed then, a profiler's or the user's wrapper included).
_captured: dict[str, Callable] = {}


def torch_op(name: str) -> Callable:
    """The torch.distributed function ds_ext's own collectives call: the one the
    instrumentation captured when it was installed (so they are not counted twice), else
    the one in torch.distributed now (so a wrapper installed after ``import ds_ext`` is
    honoured)."""
    fn = _captured.get(name)
    return fn if fn is not None else getattr(dist, name)


def backend_device(group: object | None = None) -> torch.device:
    """The device a collective of ``group``'s backend takes its tensors on: the host for gloo,
    DeepSpeed's accelerator's current device for every other backend (NCCL / RCCL refuse host
    tensors). For the small tensors ds_ext creates itself (flags, counts, timings)."""
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


class CommError(DsExtError, RuntimeError):
    """A collective that failed: a peer rank died or did not answer within the timeout."""


class Watch(Protocol):
    """Asked while a collective waits longer than ``check_s`` and when one fails; raises to
    end the wait with its own error."""

    check_s: float

    def stalled(self, op: str, waited_s: float) -> None: ...

    def failed(self, op: str) -> None: ...


class InFlight(Protocol):
    """A collective in flight: :meth:`wait` completes it and returns its result, if it has one
    (a :class:`Handle`; a quantized collective's pending decode, :class:`ds_ext.comm.quantized.Pending`)."""

    def wait(self) -> object: ...


class Handle:
    """Result of an async collective; :meth:`wait` completes it (its emulated time, and its
    timed span in ``timed``'s ledger)."""

    def __init__(
        self,
        work: object | None,
        deadline: float,
        after: Callable[[], None] | None = None,
        guard: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        watch: tuple[str, Watch] | None = None,
        timed: tuple[Ledger, Span] | None = None,
    ):
        self._work = work
        self._deadline = deadline
        self._after = after
        self._guard = guard
        self._watch = watch
        self._timed = timed
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        if self._work is not None:
            with self._guard():
                if self._watch is None:
                    self._work.wait()
                else:
                    self._wait_watched(*self._watch)
        TimeEmulator.hold_until(self._deadline)
        if self._timed is not None:
            self._timed[0].finish(self._timed[1])
        if self._after is not None:
            self._after()
        self._done = True

    def _wait_watched(self, op: str, watch: Watch) -> None:
        """Wait by torch's timed wait, asking ``watch`` every ``check_s`` meanwhile."""
        start = time.monotonic()
        while True:
            try:
                self._work.wait(timedelta(seconds=watch.check_s))  # type: ignore[union-attr]
                return
            except RuntimeError as err:  # a failure completes the work; a timed-out wait does not
                if self._work.is_completed() or _TIMED_OUT not in str(err):  # type: ignore[union-attr]
                    raise
            watch.stalled(op, time.monotonic() - start)

    def is_completed(self) -> bool:
        return self._done


_TIMED_OUT = "Operation timed out"  # torch's Work.wait(timeout) when the work is not done yet


def _same_dtype(op: str, output: torch.Tensor, input: torch.Tensor) -> None:
    if output.dtype != input.dtype:
        raise TypeError(f"{op}: output dtype {output.dtype} != input dtype {input.dtype}")


def _flat(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("ds_ext.comm collectives need contiguous tensors")
    return t.view(-1)


class AlgorithmModel(Protocol):
    """The cost model of the p2p algorithms (001 §6.2; ``ds_ext.perf.collectives``)."""

    def choose(self, topology: Topology, ranks: Sequence[int], chunk_bytes: float) -> str:
        """``pccl`` or ``native`` for a chunk of ``chunk_bytes`` over ``ranks``."""
        ...

    def time(self, algorithm: str, topology: Topology, ranks: Sequence[int], chunk_bytes: float) -> float:
        """Seconds ``algorithm`` takes for a chunk of ``chunk_bytes`` over ``ranks``."""
        ...


class Communicator:
    """Collectives over process groups of one :class:`GroupRegistry`, with a ledger."""

    def __init__(
        self,
        registry: GroupRegistry,
        ledger: Ledger | None = None,
        emulator: TimeEmulator | None = None,
        timeout_s: float | None = None,
        algorithm: str = "native",
        model: AlgorithmModel | None = None,
    ) -> None:
        self.registry = registry
        self.model = model
        self.ledger = ledger or Ledger(registry.topology.level_names)
        self.emulator = emulator
        self.timeout_s = timeout_s
        self.algorithm = self._checked(algorithm)
        self.watch: Watch | None = None
        self._gloo_groups: dict[object, bool] = {}
        # (group, op, root) -> {link level: link bytes per payload byte}; group -> each member's link level
        self._link_units: dict[tuple, dict[str, float]] = {}
        self._peer_levels: dict[object, list[str | None]] = {}

    def failed(self, op: str, group: object | None, err: BaseException) -> BaseException:
        """The one-line :class:`CommError` for a failed collective (``err`` if it is one)."""
        if isinstance(err, CommError):
            return err
        ranks = self.registry.ranks(group)
        level = self.registry.level(group)
        timeout = "the process group's default" if self.timeout_s is None else f"{self.timeout_s:g} s"
        cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return CommError(
            f"ds_ext.comm: {op} over {len(ranks)} ranks ({level} level) failed: a peer rank died or did not "
            f"answer within the collective timeout (ds_ext.comm.timeout_s = {timeout}): {cause}"
        )

    @contextlib.contextmanager
    def guard(self, op: str, group: object | None) -> Iterator[None]:
        """Turn a failed collective into one :class:`CommError` line."""
        try:
            yield
        except RuntimeError as err:
            if self.watch is not None and not isinstance(err, CommError):
                self.watch.failed(op)
            raise self.failed(op, group, err) from err

    def _watched(self, group: object | None) -> bool:
        """Whether collectives over ``group`` wait watched by :attr:`watch` (gloo only: an NCCL
        work's wait returns at once, its hangs are NCCL's watchdog's to report)."""
        return self.watch is not None and self.is_gloo(group)

    def is_gloo(self, group: object | None = None) -> bool:
        """Whether ``group`` (default: the world) runs on gloo (its algorithms: ``ds_ext.comm.hops``)."""
        if group not in self._gloo_groups:
            self._gloo_groups[group] = dist.get_backend(group) == "gloo"
        return self._gloo_groups[group]

    def _async(self, async_op: bool, group: object | None) -> bool:
        """Issue torch's collective asynchronously: when asked, or to wait on it watched."""
        return async_op or self._watched(group)

    # ---- bookkeeping shared with ds_ext.comm.instrument -------------------------------
    def account(
        self,
        op: str,
        group: object | None,
        nbytes: float,
        payload: float,
        root: int | None = None,
        per_peer: Sequence[float] | None = None,
    ) -> tuple[Span, float]:
        """Record ``nbytes`` sent by this rank by a collective left to torch.distributed (its
        messages by the ring convention) and where they travel (:func:`ds_ext.comm.hops.sends` of
        ``payload``, ``root``, ``per_peer`` under the group's backend), and open its timed span;
        return the span (for ``ledger.finish`` when the collective completes) and the emulated
        completion deadline."""
        level = self.registry.level(group)
        ranks = self.registry.ranks(group)
        d = len(ranks)
        self.ledger.record(op, level, nbytes, message_steps(op, d))
        if self.ledger.enabled and d > 1:
            self.ledger.record_links(op, self._links(op, group, ranks, payload, root, per_peer))
        span = self.ledger.start(op, level)
        if self.emulator is None:
            return span, span[1]
        return span, span[1] + self.emulator.cost(op, level, nbytes, d)

    def _links(
        self,
        op: str,
        group: object | None,
        ranks: tuple[int, ...],
        payload: float,
        root: int | None,
        per_peer: Sequence[float] | None,
    ) -> dict[str, float]:
        """The link bytes of one call (:mod:`ds_ext.comm.hops`), the levels looked up once per group
        (and op and root): the ledger's hot path. Outside a process group (the ledger's own
        benchmark) as rank 0 under the NCCL model."""
        topo = self.registry.topology
        me = dist.get_rank() if dist.is_initialized() else 0
        if per_peer is not None:
            levels = self._peer_levels.get(group)
            if levels is None:
                levels = self._peer_levels[group] = [topo.level_of((me, r)) if r != me else None for r in ranks]
            out: dict[str, float] = {}
            for level, nbytes in zip(levels, per_peer, strict=True):
                if level is not None and nbytes:
                    out[level] = out.get(level, 0.0) + nbytes
            return out
        key = (group, op, root)
        unit = self._link_units.get(key)
        if unit is None:
            gloo = dist.is_initialized() and self.is_gloo(group)
            unit = self._link_units[key] = hops.by_level(topo, me, hops.sends(op, ranks, me, 1.0, gloo, root))
        return {level: share * payload for level, share in unit.items()}

    # ---- algorithm choice (001 §6.2) ----------------------------------------------------
    @staticmethod
    def _checked(algorithm: str) -> str:
        if algorithm not in algorithms.ALGORITHMS:
            raise algorithms.AlgorithmError(
                f"ds_ext.comm.algorithm={algorithm!r} is not an algorithm; allowed: {', '.join(algorithms.ALGORITHMS)}"
            )
        return algorithm

    def choose(self, group: object | None, chunk_bytes: float, algorithm: str | None, op=dist.ReduceOp.SUM) -> str:
        """The algorithm a call runs: the call site's, else the communicator's; ``auto`` asks
        :attr:`model` (pccl or native), and is ``native`` for a reduction other than
        SUM, which only torch's collective implements."""
        algorithm = self._checked(algorithm or self.algorithm)
        if algorithm in algorithms.P2P_ALGORITHMS and op != dist.ReduceOp.SUM:
            raise algorithms.AlgorithmError(
                f"ds_ext.comm.algorithm={algorithm!r} implements SUM reductions only, got {op}; allowed: auto, native"
            )
        if algorithm != "auto":
            return algorithm
        if op != dist.ReduceOp.SUM:
            return "native"
        return self._model().choose(self.registry.topology, self.registry.ranks(group), chunk_bytes)

    def _model(self) -> AlgorithmModel:
        if self.model is None:
            raise algorithms.AlgorithmError(
                "ds_ext.comm: the auto choice and the emulated time of ring / pccl need the algorithms' cost model; "
                "construct the Communicator with model=ds_ext.perf.collectives"
            )
        return self.model

    def _p2p(self, op: str, algorithm: str, output: torch.Tensor, input: torch.Tensor, group, async_op: bool):
        """Run ``algorithm`` (ring / pccl) and record each of its phases at its level."""
        ranks = self.registry.ranks(group)
        tally = algorithms.Tally()
        span = self.ledger.start(op, self.registry.level(group))
        run = algorithms.all_gather if op == "all_gather" else algorithms.reduce_scatter
        with self.guard(op, group):
            run(
                algorithm,
                _flat(output),
                _flat(input),
                ranks,
                dist.get_rank(),
                self.registry.topology,
                group,
                tally,
                self._downward(group, ranks),
            )
        for level, nbytes in tally.bytes.items():
            self.ledger.record(op, level, nbytes, tally.messages[level])
        self.ledger.record_links(op, hops.by_level(self.registry.topology, dist.get_rank(), tally.sends))
        deadline = span[1]
        if self.emulator is not None:
            chunk = _nbytes(input) if op == "all_gather" else _nbytes(output)
            deadline += self.emulator.scale * self._model().time(algorithm, self.registry.topology, ranks, chunk)
        return self._finish(op, group, None, (span, deadline), async_op)

    def _downward(self, group: object | None, ranks: tuple[int, ...]) -> object | None:
        """On gloo, the group that carries the p2p algorithms' messages to lower ranks
        (:meth:`GroupRegistry.p2p_downward`); made here by a collective that every rank runs
        (its group spans the world), else None until the registry makes it with its first
        group: that collective then uses one connection per pair."""
        if not self.is_gloo(group):
            return None
        downward = self.registry.p2p_downward()
        if downward is None and len(ranks) == self.registry.topology.world_size:
            downward = self.registry.make_p2p_downward()
        return downward

    def _finish(
        self,
        op: str,
        group,
        work,
        accounted: tuple[Span, float],
        async_op: bool,
        after: Callable[[], None] | None = None,
    ) -> Handle | None:
        """The call's :class:`Handle` (``accounted``: its span and emulated deadline; ``after``: run
        once the work is done), waited on here unless ``async_op``."""
        span, deadline = accounted
        watch = (op, self.watch) if work is not None and self._watched(group) else None
        handle = Handle(work, deadline, after, lambda: self.guard(op, group), watch, (self.ledger, span))
        if async_op:
            return handle
        handle.wait()
        return None

    def size(self, group: object | None) -> int:
        return len(self.registry.ranks(group))

    # ---- collectives ------------------------------------------------------------------
    def all_gather(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group=None,
        async_op: bool = False,
        algorithm: str | None = None,
    ) -> Handle | None:
        """Concatenate every rank's ``input`` into ``output`` in group-rank order."""
        d = self.size(group)
        _same_dtype("all_gather", output, input)
        if output.numel() != input.numel() * d:
            raise ValueError(f"all_gather output has {output.numel()} elements, needs {input.numel()} x {d}")
        algorithm = self.choose(group, _nbytes(input), algorithm)
        if algorithm != "native" and d > 1:
            return self._p2p("all_gather", algorithm, output, input, group, async_op)
        accounted = self.account("all_gather", group, all_gather_bytes(_nbytes(input), d), _nbytes(input))
        with self.guard("all_gather", group):
            work = torch_op("all_gather_into_tensor")(
                _flat(output), _flat(input), group=group, async_op=self._async(async_op, group)
            )
        return self._finish("all_gather", group, work, accounted, async_op)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op=dist.ReduceOp.SUM,
        group=None,
        async_op: bool = False,
        algorithm: str | None = None,
    ) -> Handle | None:
        """Reduce ``input`` over the group; rank i keeps chunk i in ``output``."""
        d = self.size(group)
        _same_dtype("reduce_scatter", output, input)
        if input.numel() != output.numel() * d:
            raise ValueError(f"reduce_scatter input has {input.numel()} elements, needs {output.numel()} x {d}")
        algorithm = self.choose(group, _nbytes(output), algorithm, op)
        if algorithm != "native" and d > 1:
            return self._p2p("reduce_scatter", algorithm, output, input, group, async_op)
        combine = _gloo_reduction(op) if d > 1 and self.is_gloo(group) else None
        volume = reduce_scatter_bytes(_nbytes(input), d)
        if combine is not None:  # run as an all_to_all of the chunks: each to its owner
            chunk = _nbytes(input) / d
            accounted = self.account("reduce_scatter", group, volume, _nbytes(input), per_peer=[chunk] * d)
            return self._gloo_reduce_scatter(output, input, combine, group, async_op, accounted)
        accounted = self.account("reduce_scatter", group, volume, _nbytes(input))
        with self.guard("reduce_scatter", group):
            work = torch_op("reduce_scatter_tensor")(
                _flat(output), _flat(input), op=op, group=group, async_op=self._async(async_op, group)
            )
        return self._finish("reduce_scatter", group, work, accounted, async_op)

    def _gloo_reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        combine: Callable[..., torch.Tensor],
        group,
        async_op: bool,
        accounted: tuple[Span, float],
    ) -> Handle | None:
        """gloo's reduce-scatter is an all-reduce of the whole input that keeps one chunk
        (ProcessGroupGloo's ``reduce_scatter_tensor_coalesced``): 2 (d - 1)/d of the input on the
        wire per rank, twice a reduce-scatter's. Here each rank's chunk goes to its owner by one
        ``all_to_all_single`` ((d - 1)/d of the input: the bytes the ledger books, and what NCCL /
        RCCL send) and the owner reduces the d chunks it received, in group-rank order, in their
        dtype (``combine``: :func:`_gloo_reduction`)."""
        received = torch.empty_like(_flat(input))
        with self.guard("reduce_scatter", group):
            work = torch_op("all_to_all_single")(received, _flat(input), group=group, async_op=True)
        chunks, out = received.view(self.size(group), -1), _flat(output)
        return self._finish(
            "reduce_scatter", group, work, accounted, async_op, after=lambda: _reduce_in_order(combine, chunks, out)
        )

    def all_reduce(
        self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False
    ) -> Handle | None:
        d = self.size(group)
        accounted = self.account("all_reduce", group, all_reduce_bytes(_nbytes(tensor), d), _nbytes(tensor))
        with self.guard("all_reduce", group):
            work = torch_op("all_reduce")(tensor, op=op, group=group, async_op=self._async(async_op, group))
        return self._finish("all_reduce", group, work, accounted, async_op)

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int] | None = None,
        input_split_sizes: Sequence[int] | None = None,
        group=None,
        async_op: bool = False,
    ) -> Handle | None:
        """Rank i sends split j of ``input`` (along dim 0) to rank j; even or uneven."""
        d = self.size(group)
        me = self.registry.group_rank(group)
        _same_dtype("all_to_all", output, input)
        row = input[0].numel() * input.element_size() if input.dim() > 1 else input.element_size()
        if input_split_sizes is None:
            if input.shape[0] % d:
                raise ValueError(f"all_to_all input dim 0 ({input.shape[0]}) not divisible by {d}")
            own = input.shape[0] // d
        else:
            if len(input_split_sizes) != d:
                raise ValueError(f"all_to_all needs {d} input splits, got {len(input_split_sizes)}")
            own = input_split_sizes[me]
        nbytes = _nbytes(input) - own * row
        splits = input_split_sizes if input_split_sizes is not None else [input.shape[0] // d] * d
        accounted = self.account("all_to_all", group, nbytes, nbytes, per_peer=[n * row for n in splits])
        with self.guard("all_to_all", group):
            work = torch_op("all_to_all_single")(
                output,
                input,
                output_split_sizes=list(output_split_sizes) if output_split_sizes is not None else None,
                input_split_sizes=list(input_split_sizes) if input_split_sizes is not None else None,
                group=group,
                async_op=self._async(async_op, group),
            )
        return self._finish("all_to_all", group, work, accounted, async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, group=None, async_op: bool = False) -> Handle | None:
        """Copy global rank ``src``'s ``tensor`` to every rank of the group."""
        d = self.size(group)
        accounted = self.account("broadcast", group, broadcast_bytes(_nbytes(tensor), d), _nbytes(tensor), root=src)
        with self.guard("broadcast", group):
            work = torch_op("broadcast")(tensor, src=src, group=group, async_op=self._async(async_op, group))
        return self._finish("broadcast", group, work, accounted, async_op)


_GLOO_REDUCTIONS: dict[object, Callable[..., torch.Tensor]] = {
    dist.ReduceOp.SUM: torch.add,
    dist.ReduceOp.PRODUCT: torch.mul,
    dist.ReduceOp.MIN: torch.minimum,
    dist.ReduceOp.MAX: torch.maximum,
}


def _gloo_reduction(op) -> Callable[..., torch.Tensor]:
    """The elementwise function of ``op`` for a gloo reduce-scatter's local reduction; checked
    before the call is recorded."""
    combine = _GLOO_REDUCTIONS.get(op)
    if combine is None:
        raise algorithms.AlgorithmError(
            f"ds_ext.comm: reduce_scatter on gloo reduces with SUM, PRODUCT, MIN or MAX; got {op}"
        )
    return combine


def _reduce_in_order(combine: Callable[..., torch.Tensor], chunks: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` = chunks[0] op chunks[1] op ... in that order, in the chunks' dtype."""
    out.copy_(chunks[0])
    for chunk in chunks[1:]:
        combine(out, chunk, out=out)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
