"""The model-parallel unit TED hands DeepSpeed (Megatron's mpu interface).

DeepSpeed reads it through ``deepspeed.utils.groups`` / ``utils/bwc.py``: model parallel =
TED's tensor group (G_tensor), data parallel = the non-expert data group (G_data^nonexp),
which DeepSpeed uses for non-expert gradient reduction, ZeRO partitioning and the
parameter broadcast. No pipeline parallelism.
"""

from __future__ import annotations

from ds_ext.moe.context import TEDContext


class TEDMpu:
    """Megatron-style mpu over a :class:`TEDContext` (see module docstring)."""

    def __init__(self, ted: TEDContext) -> None:
        self._ted = ted

    def get_tensor_model_parallel_group(self):
        return self._ted.groups["tensor"]

    def get_tensor_model_parallel_world_size(self) -> int:
        return self._ted.layout.tensor

    def get_tensor_model_parallel_rank(self) -> int:
        return self._ted.tensor_rank

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self._ted.ranks("tensor")[0]

    get_model_parallel_group = get_tensor_model_parallel_group
    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_model_parallel_rank = get_tensor_model_parallel_rank

    def get_data_parallel_group(self):
        return self._ted.groups["data"]

    def get_data_parallel_world_size(self) -> int:
        return self._ted.layout.nonexp_data

    def get_data_parallel_rank(self) -> int:
        return self._ted.data_rank

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self._ted.ranks("data"))

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0
