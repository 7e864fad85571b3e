"""Count collectives that third-party code (DeepSpeed) issues through torch.distributed.

:func:`instrument_torch_distributed` replaces the tensor collectives of
``torch.distributed`` with wrappers that record into a :class:`Communicator`'s ledger
(same byte convention, same level attribution, same time emulation, the same timed span: from
the call until it returns, or for ``async_op=True`` until the returned work's ``wait()``
returns; ``ds_ext.comm.ledger``) and then call the
function it replaced, captured at install time (so a profiler's or the user's wrapper
installed earlier stays in the chain). ds_ext's own collectives call the captured
functions (``collectives.torch_op``), so nothing is counted twice. DeepSpeed binds ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` when its
backend starts; ``ds_ext.integration.ds_engine`` re-binds those.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Callable, Iterator, NamedTuple

import torch
import torch.distributed as dist

from ds_ext.comm import collectives
from ds_ext.comm.collectives import TORCH_OP_NAMES, Communicator
from ds_ext.comm.emulation import TimeEmulator
from ds_ext.comm.ledger import (
    Ledger,
    Span,
    all_gather_bytes,
    all_reduce_bytes,
    broadcast_bytes,
    reduce_scatter_bytes,
)


def _nb(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Call(NamedTuple):
    """A bound torch.distributed call as the ledger books it (``Communicator.account``)."""

    op: str
    nbytes: float  # sent by this rank, by the ledger's volume convention
    payload: float  # the bytes ``ds_ext.comm.hops.sends`` takes
    root: int | None = None  # broadcast's source / reduce's destination (global rank)
    per_peer: list[float] | None = None  # all_to_all: bytes for each group rank


def _root(comm: Communicator, a: dict, key: str) -> int:
    """The global rank of a broadcast's ``src`` / a reduce's ``dst`` (or its ``group_src`` / ``group_dst``)."""
    if a.get(key) is not None:
        return a[key]
    return comm.registry.ranks(a.get("group"))[a[f"group_{key}"]]


def _volume(comm: Communicator, name: str, a: dict) -> _Call:
    """How the ledger books a bound torch.distributed call (:class:`_Call`)."""
    group = a.get("group")
    d = comm.size(group)
    if name in ("all_gather_into_tensor", "all_gather_single"):
        return _Call("all_gather", all_gather_bytes(_nb(a["input_tensor"]), d), _nb(a["input_tensor"]))
    if name == "all_gather":
        return _Call("all_gather", all_gather_bytes(_nb(a["tensor"]), d), _nb(a["tensor"]))
    if name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        return _Call("reduce_scatter", reduce_scatter_bytes(_nb(a["input"]), d), _nb(a["input"]))
    if name == "reduce_scatter":
        total = sum(_nb(t) for t in a["input_list"])
        return _Call("reduce_scatter", reduce_scatter_bytes(total, d), total)
    if name == "reduce":
        return _Call("reduce", reduce_scatter_bytes(_nb(a["tensor"]), d), _nb(a["tensor"]), _root(comm, a, "dst"))
    if name == "all_reduce":
        return _Call("all_reduce", all_reduce_bytes(_nb(a["tensor"]), d), _nb(a["tensor"]))
    if name == "all_reduce_coalesced":
        total = sum(_nb(t) for t in a["tensors"])
        return _Call("all_reduce", all_reduce_bytes(total, d), total)
    if name == "broadcast":
        return _Call("broadcast", broadcast_bytes(_nb(a["tensor"]), d), _nb(a["tensor"]), _root(comm, a, "src"))
    me = comm.registry.group_rank(group)
    if name == "all_to_all_single":
        inp, split = a["input"], a.get("input_split_sizes")
        rows = inp.shape[0] if inp.dim() else 1
        row = _nb(inp) / rows if rows else 0.0
        per_peer = [n * row for n in split] if split else [_nb(inp) / d] * d
        return _Call("all_to_all", _nb(inp) - per_peer[me], _nb(inp), per_peer=per_peer)
    if name == "all_to_all":
        per_peer = [float(_nb(t)) for t in a["input_tensor_list"]]
        return _Call("all_to_all", sum(b for i, b in enumerate(per_peer) if i != me), sum(per_peer), per_peer=per_peer)
    raise KeyError(name)


REROUTED = ("reduce_scatter_tensor", "reduce_scatter_single")  # comm.torch_gloo_reduce_scatter 'all_to_all'


def _wrap(comm: Communicator, name: str, fn: Callable, gloo_reduce_scatter: str = "native") -> Callable:
    """``fn`` (the function in torch.distributed now) behind the ledger; arguments are
    named by torch's own signature, since ``fn`` may be a ``(*args, **kwargs)`` wrapper.
    ``gloo_reduce_scatter`` 'all_to_all': a reduce-scatter on a gloo group of two or more ranks
    runs as :meth:`Communicator.reduce_scatter` (each chunk to its owner, reduced there), which
    books it; ``fn`` is not called."""
    torch_fn = getattr(dist.distributed_c10d, name, fn)
    names = tuple(inspect.signature(torch_fn).parameters)  # by name without Signature.bind (µs per call)
    reroute = gloo_reduce_scatter == "all_to_all" and name in REROUTED

    @functools.wraps(fn)
    def wrapper(*args, **kw):
        arguments = dict(zip(names, args))
        arguments.update(kw)
        group = arguments.get("group")
        if reroute and comm.size(group) > 1 and comm.is_gloo(group):
            return comm.reduce_scatter(
                arguments["output"],
                arguments["input"],
                op=arguments.get("op", dist.ReduceOp.SUM),
                group=group,
                async_op=bool(arguments.get("async_op")),
            )
        call = _volume(comm, name, arguments)
        op = call.op
        span, deadline = comm.account(op, group, call.nbytes, call.payload, call.root, call.per_peer)
        try:
            work = fn(*args, **kw)
        except RuntimeError as err:
            raise comm.failed(op, group, err) from err
        if arguments.get("async_op"):
            return _TimedWork(work, deadline, lambda: comm.guard(op, group), comm.ledger, span)
        TimeEmulator.hold_until(deadline)
        comm.ledger.finish(span)
        return work

    wrapper.__ds_ext_original__ = fn  # type: ignore[attr-defined]
    return wrapper


class _TimedWork:
    """A torch Work whose ``wait`` also honours the emulated completion time and closes the
    call's timed span (at the first ``wait`` that returns)."""

    def __init__(self, work, deadline: float, guard, ledger: Ledger, span: Span) -> None:
        self._work = work
        self._deadline = deadline
        self._guard = guard
        self._ledger = ledger
        self._span: Span | None = span

    def wait(self, *args, **kw):
        with self._guard():
            out = self._work.wait(*args, **kw)
        TimeEmulator.hold_until(self._deadline)
        if self._span is not None:
            self._ledger.finish(self._span)
            self._span = None
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


_wrappers: dict[str, Callable] = {}


def install(comm: Communicator, gloo_reduce_scatter: str = "native") -> None:
    """Route every torch.distributed tensor collective through ``comm``'s ledger, chained
    in front of whatever torch.distributed holds now; ``gloo_reduce_scatter``: the setting
    ``comm.torch_gloo_reduce_scatter`` (:func:`_wrap`).

    Installing again replaces the previous communicator.
    """
    uninstall()
    for n in TORCH_OP_NAMES:
        current = getattr(dist, n)
        collectives._captured[n] = current
        _wrappers[n] = _wrap(comm, n, current, gloo_reduce_scatter)
        setattr(dist, n, _wrappers[n])


def uninstall() -> None:
    """Put back the functions :func:`install` replaced, where torch.distributed still holds
    its wrapper (a wrapper someone installed on top of it since stays, and calls through)."""
    for n, fn in collectives._captured.items():
        if getattr(dist, n) is _wrappers.get(n):
            setattr(dist, n, fn)
    collectives._captured.clear()
    _wrappers.clear()


@contextlib.contextmanager
def instrument_torch_distributed(comm: Communicator) -> Iterator[None]:
    """Within the block, every torch.distributed tensor collective is counted by ``comm``."""
    install(comm)
    try:
        yield
    finally:
        uninstall()
