"""TED: tensor x expert x data parallel Mixture-of-Experts (001 ch. 7).

``TEDMoE`` is a drop-in for ``deepspeed.moe.layer.MoE``; ``ColumnParallelLinear`` /
``RowParallelLinear`` are the Megatron tensor-parallel layers of the non-expert blocks;
``"ds_ext": {"ted": {...}}`` (:mod:`ds_ext.moe.plugin`) binds them to the TED groups.
"""

from ds_ext.moe.cac import clear_tapes
from ds_ext.moe.context import TEDContext
from ds_ext.moe.layer import TEDMoE
from ds_ext.moe.tensor_parallel import ColumnParallelLinear, RowParallelLinear

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "TEDContext", "TEDMoE", "clear_tapes"]
