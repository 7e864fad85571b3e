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
gradient norm counts a parameter on every tensor rank if it is tensor-parallel
(``tensor_model_parallel`` / ``model_parallel``, DeepSpeed's ``is_model_parallel_parameter``)
and on tensor rank 0 only otherwise, then sums over the model-parallel group, as DeepSpeed's
ZeRO-1/2 ``get_grad_norm_direct`` does.

MoE experts (TED, 001 §7.1) are sharded over their expert-data-parallel group instead (role
``expert_data``): each expert rank holds other experts, so their norm sums over
``expert_model`` (tensor x pipeline x expert); their gradients are averaged as DeepSpeed-MoE
averages them (summed over the expert-data group, divided by the dense data-parallel size).
Experts kept whole on every tensor rank (DeepSpeed's ``enable_expert_tensor_parallelism=False``
beside tensor parallelism) have TED's ``expert_replicas`` (tensor x expert-data) as that group:
each tensor rank ran its share of the tokens through the whole expert (duplicate token
dropping), so their gradients sum over it, every rank's shard is distinct (all count in the
norm), and the norm then sums over pipeline x expert only.
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
    tensor_rank: int  # position along the tensor axes the group does not span (0: counts replicated parameters)
    model_size: int
    model_level: str | None  # the outermost world level the model-parallel group crosses
    model_role: str  # that group's role in the layout: ``model`` or ``expert_model``

    @classmethod
    def of(cls, layout: JobLayout, world: Topology, rank: int, role: str = "data") -> "DataGroup":
        """``role`` ``data`` (dense parameters; norms summed over the ``model`` group after it) or
        ``expert_data`` (MoE experts; then over ``expert_model``: other slices and other experts)."""
        partition = layout.partition(role)
        members = member_group(partition, rank)
        whole = len(members) == world.world_size
        what = role.replace("_", "-")
        topo = (
            world
            if whole
            else world.of_group(members, f"{world.name}, {what}-parallel group of {layout.describe_degrees()}")
        )
        model = "model" if role == "data" else "expert_model"
        dims = layout.parallel_dims
        return cls(
            topo,
            members.index(rank),
            members,
            partition,
            dims.group_rank(layout.GROUPS[model], rank),
            dims.group_rank([a for a in layout.GROUPS.get("tensor", ()) if a not in layout.GROUPS[role]], rank),
            layout.degree(model),
            world.level_of(member_group(layout.partition(model), rank)),
            model,
        )

    def to_world(self, partition: Partition) -> Partition:
        """``partition`` of group ranks as global ranks, in every data-parallel group (a process
        group is created by all ranks at once, so each gets the groups of all)."""
        if len(self.partition) == 1:
            return partition
        return tuple(tuple(g[i] for i in part) for g in self.partition for part in partition)

    def counted(self, param: object) -> bool:
        """Whether this rank counts ``param``'s gradient in the global norm (see module); a tied
        weight's copy on a later pipeline stage (DeepSpeed's ``ds_pipe_replicated``) never."""
        if getattr(param, "ds_pipe_replicated", False):
            return False
        return self.tensor_rank == 0 or tensor_parallel(param)
