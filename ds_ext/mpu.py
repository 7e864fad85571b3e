"""The model-parallel unit ds_ext hands ``deepspeed.initialize`` (Megatron's mpu interface).

DeepSpeed reads an mpu through ``deepspeed.utils.groups`` / ``utils/bwc.py``: its model-parallel
group sums gradient norms (and, for MoE, sets the expert groups' tensor dimension); its
data-parallel group averages gradients, shards ZeRO states and broadcasts parameters. Each
plugin names its two groups: 3D-PMM the tensor grid X x Y x Z and the ``data`` axis
(``ds_ext.pmm.plugin``), TED the tensor group and the non-expert data group
(``ds_ext.moe.plugin``). No pipeline parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ds_ext.groups import ProcessGroups


@dataclass(frozen=True)
class ParallelGroup:
    """One process group as this rank sees it; ``ranks``: its global ranks in group order."""

    group: object | None
    size: int
    rank: int
    ranks: tuple[int, ...]


class MegatronMPU:
    """``get_{data,model,tensor_model}_parallel_{group,rank,world_size}`` and the rest of the
    interface DeepSpeed calls, over a tensor (model-parallel) and a data-parallel group."""

    def __init__(self, tensor: ParallelGroup, data: ParallelGroup) -> None:
        self._tensor, self._data = tensor, data

    @classmethod
    def over(cls, groups: "ProcessGroups", tensor: str = "tensor", data: str = "data") -> "MegatronMPU":
        """The mpu over two named groups of a plugin's bundle (:func:`ds_ext.groups.build_process_groups`)."""

        def side(name: str) -> ParallelGroup:
            return ParallelGroup(groups[name], groups.size(name), groups.rank(name), groups.ranks(name))

        return cls(side(tensor), side(data))

    def get_model_parallel_group(self):
        return self._tensor.group

    def get_model_parallel_rank(self) -> int:
        return self._tensor.rank

    def get_model_parallel_world_size(self) -> int:
        return self._tensor.size

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self._tensor.ranks[0]

    def get_data_parallel_group(self):
        return self._data.group

    def get_data_parallel_rank(self) -> int:
        return self._data.rank

    def get_data_parallel_world_size(self) -> int:
        return self._data.size

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self._data.ranks)

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0


def model_parallel_sizes(mpu: Any) -> dict[str, Any]:
    """Tensor / pipeline parallel sizes an mpu reports (GPT-NeoX and Megatron pass one with
    size 1 when they run pure data parallelism); an mpu that reports none counts as
    model-parallel ('unknown')."""
    sizes: dict[str, Any] = {}
    for name, getters in (
        ("tensor parallel", ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size")),
        ("pipeline parallel", ("get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size")),
    ):
        getter = next((getattr(mpu, g) for g in getters if callable(getattr(mpu, g, None))), None)
        if getter is not None:
            sizes[name] = getter()
    return sizes or {"model parallel": "unknown"}
