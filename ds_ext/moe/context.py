"""What a TED layer needs from the runtime: its process groups, coordinates and switches.

Built once by the ``ted`` plugin (or by hand, from a :class:`~ds_ext.comm.Communicator`)
and handed to every TED layer in ``ted_bind``; layers never look groups up globally
(DESIGN.md §4). Groups follow ``ds_ext.groups.TEDLayout`` (001 §7.1, Eq 7.1 / 7.7).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch.distributed as dist

from ds_ext.comm import Communicator
from ds_ext.groups import TEDLayout, ted_process_groups
from ds_ext.mpu import MegatronMPU, ParallelGroup


@dataclass(frozen=True)
class TEDContext:
    """One rank's view of a TED layout.

    ``groups``: ``tensor`` (G_tensor), ``expert`` (G_expert), ``expert_data`` (G_data^exp),
    ``data`` (G_data^nonexp) and ``expert_replicas`` (G_tensor x G_data^exp: the ranks of one
    expert rank, for experts kept whole on every tensor rank) process groups of this rank. ``dtd`` / ``cac`` switch
    duplicate token dropping (001 §7.3.1) and communication-aware checkpointing (§7.3.2);
    ``cac_lean``: CAC does not stash the all-to-all outputs that only feed DTD's all-gather.
    ``seed`` seeds the gates' noise (identical on the ranks of a tensor group).
    """

    layout: TEDLayout
    comm: Communicator
    groups: Mapping[str, object]
    rank: int
    dtd: bool = True
    cac: bool = True
    seed: int = 0
    cac_lean: bool = False

    @classmethod
    def create(cls, layout: TEDLayout, comm: Communicator, dtd: bool = True, cac: bool = True,
               seed: int = 0, cac_lean: bool = False) -> "TEDContext":
        """Create the TED process groups (collective over the world) and the context."""
        groups = dict(ted_process_groups(comm.registry, layout))
        groups["expert_replicas"] = (comm.registry.group(layout.partition("expert_replicas")) if layout.tensor > 1
                                     else groups["expert_data"])
        return cls(layout, comm, groups, dist.get_rank(), dtd, cac, seed, cac_lean)

    @property
    def coords(self) -> dict[str, int]:
        return self.layout.coords(self.rank)

    @property
    def tensor_rank(self) -> int:
        return self.coords["tensor"]

    @property
    def expert_rank(self) -> int:
        return self.coords["expert"]

    @property
    def data_rank(self) -> int:
        """This rank's index in its non-expert data-parallel group (its batch shard)."""
        c = self.coords
        return c["expert"] + self.layout.expert * c["expert_data"]

    def ranks(self, kind: str) -> tuple[int, ...]:
        return self.comm.registry.ranks(self.groups[kind])

    def mpu(self) -> MegatronMPU:
        """The mpu TED hands DeepSpeed: model parallel = the tensor group (G_tensor), data parallel =
        the non-expert data group (G_data^nonexp), which DeepSpeed uses for non-expert gradient
        reduction, ZeRO partitioning and the parameter broadcast."""
        return MegatronMPU(
            ParallelGroup(self.groups["tensor"], self.layout.tensor, self.tensor_rank, self.ranks("tensor")),
            ParallelGroup(self.groups["data"], self.layout.nonexp_data, self.data_rank, self.ranks("data")))
