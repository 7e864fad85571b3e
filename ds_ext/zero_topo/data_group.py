"""ZeRO-topo over the job's data-parallel group instead of the world (003 §V under model parallelism).

DeepSpeed's ZeRO shards over the mpu's data-parallel group; so does ZeRO-topo. Its levels are
those the group's members cross (:meth:`ds_ext.topology.Topology.of_group`): with Megatron
tensor parallelism 2 over the two GCDs of an MI250X (004's and Frontier's usual placement) a
data-parallel group holds one GCD of each MI250X, so it spans only the ``gpu`` and ``node``
levels. The plan resolves against that hierarchy: presets' relative levels (innermost, node,
world) land on the levels the group crosses, and a level it does not cross, named
explicitly, is refused (``ds_ext.zero_topo.plan``).

Sharding contract: every rank shards its own parameters (a tensor-parallel rank its slices of
``ColumnParallelLinear`` / ``RowParallelLinear`` / ``VocabParallelEmbedding``, replicated
norms and biases whole) over its data-parallel group, exactly as ZeRO-topo over a world of
that group's size; group rank i is the i-th smallest member. Collectives over a set of group
levels run in every data-parallel group at once (:meth:`DataGroup.to_world`). The global
gradient norm counts a parameter on every model-parallel rank if it is tensor-parallel
(``tensor_model_parallel`` / ``model_parallel``, DeepSpeed's ``is_model_parallel_parameter``)
and on model-parallel rank 0 only otherwise, then sums over the model-parallel group, as
DeepSpeed's ZeRO-1/2 ``get_grad_norm_direct`` does.
"""

from __future__ import annotations

from dataclasses import dataclass

from ds_ext.parallel import JobLayout, Partition, member_group
from ds_ext.topology import Topology


def tensor_parallel(param: object) -> bool:
    """Whether ``param`` is split over the tensor group (each rank's slice is distinct)."""
    return bool(getattr(param, "tensor_model_parallel", False) or getattr(param, "model_parallel", False))


@dataclass(frozen=True)
class DataGroup:
    """This rank's data-parallel group as ZeRO-topo sees it (see module)."""

    topology: Topology  # the hierarchy the group's members span
    rank: int  # this rank's position in its group
    members: tuple[int, ...]  # the group's global ranks, ascending
    partition: Partition  # every data-parallel group of the job
    model_rank: int  # this rank's position in its model-parallel group (tensor x pipeline)
    model_size: int
    model_level: str | None  # the outermost world level the model-parallel group crosses

    @classmethod
    def of(cls, layout: JobLayout, world: Topology, rank: int) -> "DataGroup":
        partition = layout.partition("data")
        members = member_group(partition, rank)
        whole = len(members) == world.world_size
        topo = world if whole else world.of_group(
            members, f"{world.name}, data-parallel group of {layout.describe_degrees()}")
        model = layout.GROUPS["model"]
        return cls(topo, members.index(rank), members, partition, layout.parallel_dims.group_rank(model, rank),
                   layout.degree("model"), world.level_of(member_group(layout.partition("model"), rank)))

    def to_world(self, partition: Partition) -> Partition:
        """``partition`` of group ranks as global ranks, in every data-parallel group (a process
        group is created by all ranks at once, so each gets the groups of all)."""
        if len(self.partition) == 1:
            return partition
        return tuple(tuple(g[i] for i in part) for g in self.partition for part in partition)

    def counted(self, param: object) -> bool:
        """Whether this rank counts ``param``'s gradient in the global norm (see module)."""
        return self.model_rank == 0 or tensor_parallel(param)
