"""The background writer of ``zero_topo.async_save`` (deliverable 1).

``save_checkpoint`` takes the save's collectives that need the training ranks in step on the
main thread (preparing the staging directory, DeepSpeed's own barriers and tag check, the save
id), snapshots every file of the rank into host memory and hands the list to
:meth:`BackgroundSave.start`. One thread then writes the files (temporary name, fsync, rename),
the ranks agree on success, rank 0 publishes the directory and writes ``latest``, and the ranks
agree again: the atomic protocol of :mod:`ds_ext.zero_topo.checkpoint`, in the background. A
crash at any point before the publish leaves ``latest`` at the previous complete save.

The two agreements are collectives issued from the writer thread while the main thread trains.
They run on a gloo process group of their own, made collectively when the engine is set up
(:func:`agreement_group`), and never on a group training uses: two threads issuing collectives
on one group would pair one rank's agreement with another rank's training collective. Only one
save is in flight at a time (a second :meth:`start` waits for the first), so the writer threads
of the ranks issue the group's collectives in the same order. Gloo keeps the agreement off the
accelerator's streams and off NCCL/RCCL communicators, and its timeout (``ds_ext.comm.timeout_s``)
bounds the wait for a rank that died mid-write. (The other choice, agreeing on the main thread
at the next save or step, would leave ``latest`` one save behind until then, and the last save
of a job unpublished.) The agreement's collectives are not counted by the ledger: they are not
training traffic, and the ledger's phases belong to the main thread.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Callable

import torch.distributed as dist


def agreement_group(timeout: timedelta | None) -> object:
    """Collective over the world: the gloo group the background agreements use."""
    kwargs = {} if timeout is None else {"timeout": timeout}
    return dist.new_group(list(range(dist.get_world_size())), backend="gloo", **kwargs)


class BackgroundSave:
    """At most one save in flight; its failure is raised by the next :meth:`wait`."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    @property
    def pending(self) -> bool:
        return self._thread is not None

    def start(self, finish: Callable[[], None]) -> None:
        """Run ``finish`` (write, agree, publish) in a thread, after the save before it.
        Not a daemon: an interpreter that exits with a save in flight first completes it."""
        self.wait()

        def run() -> None:
            try:
                finish()
            except BaseException as err:  # noqa: BLE001 - raised on the main thread by wait()
                self._failure = err

        self._thread = threading.Thread(target=run, name="ds_ext.zero_topo.async_save", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        """Block until the save in flight (if any) has completed; raise its failure."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure
