"""Route DeepSpeed's own all-gathers and reduce-scatters through ds_ext.comm's algorithms
(001 §6.3.2: PCCL under DeepSpeed ZeRO-3).

DeepSpeed's torch backend calls ``cdb.all_gather_function`` and ``cdb.reduce_scatter_function``
for every ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (comm/torch.py:210-211, 380,
437 in DeepSpeed 0.19.8): ZeRO-3's parameter gathers (partition_parameters.py) and gradient
reduce-scatters (runtime/comm/coalesced_collectives.py) both end there. Replacing the two
attributes sends them through a :class:`~ds_ext.comm.Communicator` with a chosen algorithm,
which records them in its ledger (the torch.distributed wrappers of ``ds_ext.comm.instrument``
are bypassed, so nothing is counted twice).

Behind the version gate of :mod:`ds_ext.integration.ds_version`.
"""

from __future__ import annotations

import sys
from typing import Callable

import torch.distributed as dist

from ds_ext.comm import Communicator
from ds_ext.errors import DsExtSetupError
from ds_ext.integration.ds_version import check_version

check_version()


def route_backend_collectives(comm: Communicator, algorithm: str) -> Callable[[], None]:
    """Make DeepSpeed's backend run its all-gathers / reduce-scatters by ``algorithm`` through
    ``comm``; return the function that restores the previous ones."""
    cdb = sys.modules["deepspeed.comm.comm"].cdb
    if cdb is None:
        raise DsExtSetupError("ds_ext.pccl: DeepSpeed's communication backend is not initialized yet")
    before = (cdb.all_gather_function, cdb.reduce_scatter_function)

    def all_gather_function(output_tensor, input_tensor, group=None, async_op=False):
        return comm.all_gather(output_tensor, input_tensor, group=group, async_op=async_op, algorithm=algorithm)

    def reduce_scatter_function(output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return comm.reduce_scatter(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op, algorithm=algorithm
        )

    cdb.all_gather_function = all_gather_function
    cdb.reduce_scatter_function = reduce_scatter_function

    def restore() -> None:
        cdb.all_gather_function, cdb.reduce_scatter_function = before

    return restore
