"""TED: tensor x expert x data parallel Mixture-of-Experts (001 ch. 7).

``TEDMoE`` is a drop-in for ``deepspeed.moe.layer.MoE``; ``ColumnParallelLinear`` /
``RowParallelLinear`` are the Megatron tensor-parallel layers of the non-expert blocks;
``"ds_ext": {"ted": {...}}`` (:mod:`ds_ext.moe.plugin`) binds them to the TED groups.
"""


from importlib import import_module
from typing import Any

_EXPORTS = {"ColumnParallelLinear": "tensor_parallel", "RowParallelLinear": "tensor_parallel",
            "TEDContext": "context", "TEDMoE": "layer", "clear_tapes": "cac"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Imported on first use: ``TEDMoE`` subclasses DeepSpeed's ``MoE``, and importing DeepSpeed
    (which logs to stdout) must not happen when only the config schema is needed."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ds_ext.moe' has no attribute {name!r}")
    return getattr(import_module(f"ds_ext.moe.{_EXPORTS[name]}"), name)
