"""The model-parallel unit 3D-PMM hands ``deepspeed.initialize`` (Megatron's mpu interface).

DeepSpeed's data-parallel group is the grid's ``data`` axis: it averages gradients and
shards ZeRO-1 optimizer states over it. Its model-parallel group is the tensor grid
X x Y x Z, over which it sums gradient norms (parameters counted per
``ds_ext.integration.ds_pmm.mark_parameters``).
"""

from __future__ import annotations

from ds_ext.pmm.grid import Axis


class GridMPU:
    """``get_{data,model,tensor_model}_parallel_{group,rank,world_size}`` of one rank."""

    def __init__(self, axes: dict[str, Axis], data_ranks: tuple[int, ...], tensor_src: int) -> None:
        self._data, self._tensor = axes["data"], axes["tensor"]
        self._data_ranks = data_ranks
        self._tensor_src = tensor_src

    def get_data_parallel_group(self):
        return self._data.group

    def get_data_parallel_rank(self) -> int:
        return self._data.rank

    def get_data_parallel_world_size(self) -> int:
        return self._data.size

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self._data_ranks)

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
        return self._tensor_src
