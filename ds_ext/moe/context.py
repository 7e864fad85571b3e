"""What a TED layer needs from the runtime: its process groups, coordinates and switches.

Built once by the ``ted`` plugin (or by hand, from a :class:`~ds_ext.comm.Communicator`)
and handed to every TED layer in ``ted_bind``; layers never look groups up globally
(docs/architecture.md, Style). Groups are the bundle :func:`ds_ext.groups.build_process_groups` makes of a
:class:`ds_ext.parallel.TEDLayout` (001 §7.1, Eq 7.1 / 7.7).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ds_ext.comm import Communicator
from ds_ext.groups import TEDGroups, build_process_groups
from ds_ext.mpu import MegatronMPU
from ds_ext.parallel import TEDLayout


@dataclass(frozen=True)
class TEDContext:
    """One rank's view of a TED layout.

    ``groups``: ``tensor`` (G_tensor), ``expert`` (G_expert), ``expert_data`` (G_data^exp),
    ``data`` (G_data^nonexp) and ``expert_replicas`` (G_tensor x G_data^exp: the ranks of one
    expert rank, for experts kept whole on every tensor rank) process groups of this rank. ``dtd`` / ``cac`` switch
    duplicate token dropping (001 §7.3.1) and communication-aware checkpointing (§7.3.2);
    ``cac_lean`` (default, ``cac_stash: lean``): CAC does not stash the all-to-all outputs that only
    feed DTD's all-gather.
    ``seed`` seeds the gates' noise (identical on the ranks of a tensor group).
    """

    layout: TEDLayout
    comm: Communicator
    groups: TEDGroups
    rank: int
    dtd: bool = True
    cac: bool = True
    seed: int = 0
    cac_lean: bool = True

    @classmethod
    def create(
        cls,
        layout: TEDLayout,
        comm: Communicator,
        dtd: bool = True,
        cac: bool = True,
        seed: int = 0,
        cac_lean: bool = True,
    ) -> "TEDContext":
        """Create the TED process groups (collective over the world) and the context."""
        layout.check_placement(comm.registry.topology)
        rank = dist.get_rank()
        return cls(layout, comm, build_process_groups(comm.registry, layout, rank), rank, dtd, cac, seed, cac_lean)

    @property
    def tensor_rank(self) -> int:
        return self.groups.rank("tensor")

    @property
    def expert_rank(self) -> int:
        return self.groups.rank("expert")

    @property
    def data_rank(self) -> int:
        """This rank's index in its non-expert data-parallel group (its batch shard)."""
        return self.groups.rank("data")

    def ranks(self, kind: str) -> tuple[int, ...]:
        return self.groups.ranks(kind)

    def mpu(self) -> MegatronMPU:
        """The mpu TED hands DeepSpeed: model parallel = the tensor group (G_tensor), data parallel =
        the non-expert data group (G_data^nonexp), which DeepSpeed uses for non-expert gradient
        reduction, ZeRO partitioning and the parameter broadcast."""
        return MegatronMPU.over(self.groups)
