"""A one-process world at the papers' scale: torch's fake process group, with outputs filled.

torch's fake backend (``torch.testing._internal.distributed.fake_pg``) lets one process be rank
r of a world of W ranks: every collective returns at once, shapes are real, and nothing is
written into the outputs. Code that reads a collective's result back as data then runs on
uninitialized memory: DeepSpeed's ZeRO-3 sees non-finite gradients and skips the optimizer
step (so the step's collectives never run), and ``all_gather_object`` unpickles garbage.

The ``"mirror"`` backend registered here is the same single-process world with every output
filled deterministically, as in a *symmetric* world where every rank holds what this rank
holds (every rank its own copy of the same data, as a data-parallel job with one batch on all
ranks would be):

=======================  =============================================================
all_gather (any form)    every slot = this rank's input
all_reduce / reduce      SUM: input x d; AVG / MIN / MAX / BAND / BOR: input; PRODUCT: input^d
reduce_scatter           SUM: this rank's chunk x d; AVG / MIN / MAX: the chunk
all_to_all               output = input (each peer sends the block this rank sends it)
broadcast / scatter      left as they are (the root's value is this rank's); a root that
                         holds different data (``dist.broadcast`` of a value only rank 0
                         sets) is only right when this rank is the root
recv                     zeros (the peer's data is not modelled, its size is)
send / barrier           nothing
=======================  =============================================================

The sizes of every collective are the real code path's, which is what the ledger
(``ds_ext.comm.ledger``) counts; the values only have to keep that path the one a real world
takes (finite gradients, agreeing metadata). ``init(world, rank)`` starts the world.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

from ds_ext.errors import DsExtSetupError

BACKEND = "mirror"
ReduceOp = dist.ReduceOp


def _done(result: object = None) -> dist.Work:
    fut: Future = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


def _reduced(t: torch.Tensor, opts: object, d: int) -> torch.Tensor:
    """``t`` reduced with itself over ``d`` ranks by ``opts.reduceOp`` (default SUM), the symmetric world's result."""
    op = getattr(opts, "reduceOp", ReduceOp.SUM)
    kind = getattr(op, "op", op)
    if kind == ReduceOp.SUM:
        return t * d
    if kind == ReduceOp.PRODUCT:
        return t**d
    return t


class MirrorGroup(dist.ProcessGroup):
    """One rank of a group of ``size`` ranks; collectives fill outputs as the module docstring says."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self._rank, self._size = rank, size

    def size(self) -> int:
        return self._size

    def getBackendName(self) -> str:
        return BACKEND

    @torch.no_grad()
    def allreduce(self, tensors, opts=None):
        for t in tensors:
            t.copy_(_reduced(t, opts, self._size))
        return _done(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    @torch.no_grad()
    def reduce(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    @torch.no_grad()
    def allgather(self, output_lists, inputs, opts=None):
        for outs, inp in zip(output_lists, inputs):
            for o in outs:
                o.copy_(inp)
        return _done(output_lists)

    @torch.no_grad()
    def all_gather_single(self, output, inp, opts=None):
        output.view(self._size, -1).copy_(inp.reshape(1, -1).expand(self._size, -1))
        return _done(output)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            self.all_gather_single(o, i, opts)
        return _done(outputs)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        return self.allgather(output_lists, inputs, opts)

    @torch.no_grad()
    def reduce_scatter(self, outputs, input_lists, opts=None):
        for o, chunks in zip(outputs, input_lists):
            o.copy_(_reduced(chunks[self._rank], opts, self._size))
        return _done(outputs)

    @torch.no_grad()
    def reduce_scatter_single(self, output, inp, opts=None):
        chunk = inp.reshape(self._size, -1)[self._rank].view_as(output)
        output.copy_(_reduced(chunk, opts, self._size))
        return _done(output)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            self.reduce_scatter_single(o, i, opts)
        return _done(outputs)

    @torch.no_grad()
    def all_to_all_single(self, output, inp, output_splits, input_splits, opts=None):
        if output.shape == inp.shape:
            output.copy_(inp)
        else:  # uneven splits: the received sizes are the caller's; their data is not modelled
            output.zero_()
        return _done(output)

    @torch.no_grad()
    def alltoall(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            o.copy_(i) if o.shape == i.shape else o.zero_()
        return _done(outputs)

    def broadcast(self, tensors, opts=None):
        return _done(tensors)

    def scatter(self, outputs, inputs, opts=None):
        return _done(outputs)

    @torch.no_grad()
    def gather(self, output_lists, inputs, opts=None):
        return self.allgather(output_lists, inputs)

    def barrier(self, opts=None):
        return _done()

    def _start_coalescing(self, device) -> None:  # noqa: ANN001 (torch's signature)
        """Coalesced calls run one by one (``_coalescing_manager``), each completed at once."""

    def _end_coalescing(self, device) -> dist.Work:  # noqa: ANN001
        return _done()

    def send(self, tensors, dst, tag=0):
        return _done()

    @torch.no_grad()
    def recv(self, tensors, src, tag=0):
        for t in tensors:
            t.zero_()
        return _done(tensors)

    def recv_anysource(self, tensors, tag=0):
        return self.recv(tensors, -1, tag)


def _create(store, rank: int, size: int, timeout) -> MirrorGroup:  # noqa: ANN001 (torch's creator signature)
    return MirrorGroup(rank, size)


def register() -> None:
    """Register the ``"mirror"`` backend with torch.distributed (once per process)."""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])


def init(world: int, rank: int) -> None:
    """Make this process rank ``rank`` of a ``world``-rank mirror world (module docstring)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not 0 <= rank < world:
        raise DsExtSetupError(f"rank {rank} is not in a world of {world} ranks")
    if dist.is_initialized():
        raise DsExtSetupError(
            "torch.distributed is already initialized in this process; the mirror world needs a process of its own"
        )
    register()
    dist.init_process_group(BACKEND, store=FakeStore(), rank=rank, world_size=world)
