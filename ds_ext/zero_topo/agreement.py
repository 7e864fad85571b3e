"""Ranks agree on the units of a step.

ZeRO-topo issues one gather per unit a rank runs and one reduction per unit it trained
(003 §V-A). A rank that takes a branch the others do not (a module called on some ranks
only) pairs its collectives with different units of its peers: same-sized units exchange
wrong shards silently, and the first mismatch in count or size hangs until
``ds_ext.comm.timeout_s`` with a misleading "peer died".

Every rank records the units of its collectives, in order, in a :class:`UnitTrace`. When a
collective has waited ``zero_topo.agreement_check_s`` (watched by ``ds_ext.comm``'s
collectives on gloo), or fails, the rank publishes
its recent trace through the job's rendezvous store and compares it with the traces its
peers published (they publish when they stall too). The first position where two traces
name different units ends the wait on that rank in one line naming both units; equal
traces mean a slow peer, and the wait goes on.

Contract: the trace is per process and per :class:`UnitTrace` (one per ZeRO-topo model,
numbered in creation order, which is the same on every rank); it holds the last
:data:`KEEP` collectives; nothing is sent while collectives complete. A trace is compared with
those of the ranks that run the same units: every rank (the sharded form), or the rank's
data-parallel group (the pipeline form, where each stage has a unit of its own).
"""

from __future__ import annotations

import itertools
import json
import time
from collections import deque
from collections.abc import Sequence

from ds_ext.comm.collectives import CommError

KEEP = 256  # collectives kept per trace: the disagreement is looked for among the latest
FAILED_GRACE_S = 5.0  # how long a failed collective waits for its peers' traces
VERDICT_WAIT_S = 30.0  # how long rank 0 (hosting the store) waits for every rank to read the verdict
_instances = itertools.count()


class UnitDisagreementError(CommError):
    """Ranks ran different units at the same position of their collective sequence."""


class UnitTrace:
    """The units of this rank's ZeRO-topo collectives; a ``Communicator`` watch."""

    def __init__(self, rank: int, world_size: int, check_s: float, peers: Sequence[int] | None = None) -> None:
        """``peers``: the global ranks that run this rank's units (None: every rank)."""
        self.rank, self.world_size, self.check_s = rank, world_size, check_s
        self.peers = tuple(range(world_size)) if peers is None else tuple(peers)
        self._key = f"ds_ext/zero_topo/trace/{next(_instances)}"
        self._entries: deque[tuple[int, str, str]] = deque(maxlen=KEEP)
        self._seq = 0

    def record(self, op: str, unit: str) -> None:
        """Note that this rank issues ``op`` ('gather' / 'reduce') for ``unit``."""
        self._entries.append((self._seq, op, unit))
        self._seq += 1

    # ---- the Communicator watch -----------------------------------------------------------
    def stalled(self, op: str, waited_s: float) -> None:
        """A collective (``op``) has waited ``waited_s``: raise if the ranks' traces disagree."""
        self._check(self._published_peers())

    def failed(self, op: str) -> None:
        """A collective failed: raise the disagreement that caused it, if the peers that
        publish within :data:`FAILED_GRACE_S` show one (a dead peer never publishes; a store
        already gone: nothing to add)."""
        deadline = time.monotonic() + min(self.check_s, FAILED_GRACE_S)
        try:
            while True:
                peers = self._published_peers()
                self._check(peers)
                if len(peers) == len(self.peers) - 1 or time.monotonic() > deadline:
                    return
                time.sleep(0.05)
        except UnitDisagreementError:
            raise
        except Exception:  # the store's host left: the collective's own error stands
            return

    # ---- store ---------------------------------------------------------------------------
    def _store(self):
        import torch.distributed as dist

        return dist.distributed_c10d._get_default_store()

    def _published_peers(self) -> dict[int, list[tuple[int, str, str]]]:
        store = self._store()
        verdict = f"{self._key}/verdict"
        if store.check([verdict]):  # a rank found the disagreement: every rank reports it
            self._report(store, verdict)
        store.set(f"{self._key}/{self.rank}", json.dumps(list(self._entries)))
        peers = {}
        for r in self.peers:
            key = f"{self._key}/{r}"
            if r != self.rank and store.check([key]):
                peers[r] = [tuple(e) for e in json.loads(store.get(key))]
        return peers

    def _check(self, peers: dict[int, list[tuple[int, str, str]]]) -> None:
        """Raise for the earliest position where a peer's trace names another unit than ours."""
        mine = {seq: (op, unit) for seq, op, unit in self._entries}
        differ = [
            (seq, r, op, unit)
            for r, entries in peers.items()
            for seq, op, unit in entries
            if seq in mine and mine[seq] != (op, unit)
        ]
        if not differ:
            return
        seq, r, op, unit = min(differ)
        my_op, my_unit = mine[seq]
        message = (
            f"ds_ext.zero_topo: ranks run different units in one step: at ZeRO-topo collective #{seq} "
            f"rank {self.rank} {my_op}s unit '{my_unit}' while rank {r} {op}s unit '{unit}'; every rank "
            "must run the same units in the same order (a module called on some ranks only?)"
        )
        store, verdict = self._store(), f"{self._key}/verdict"
        store.compare_set(verdict, "", message)  # the first finder's words stand
        self._report(store, verdict)

    def _report(self, store, verdict: str) -> None:
        """Raise the verdict; rank 0 (the rendezvous store's usual host) first waits until
        every rank has read it, or :data:`VERDICT_WAIT_S`."""
        seen = store.add(f"{verdict}/seen", 1)
        if self.rank == 0:
            deadline = time.monotonic() + VERDICT_WAIT_S
            while seen < self.world_size and time.monotonic() < deadline:
                time.sleep(0.05)
                seen = store.add(f"{verdict}/seen", 0)
        raise UnitDisagreementError(store.get(verdict).decode())
