"""TED: tensor x expert x data parallel Mixture-of-Experts (001 ch. 7).

``TEDMoE`` is a drop-in for ``deepspeed.moe.layer.MoE``; ``ColumnParallelLinear`` /
``RowParallelLinear`` are the Megatron tensor-parallel layers of the non-expert blocks;
``"ds_ext": {"ted": {...}}`` (:mod:`ds_ext.moe.plugin`) binds them to the TED groups.

Its names load on first use: ``TEDMoE`` subclasses DeepSpeed's ``MoE``, and importing DeepSpeed
(which logs to stdout) must not happen when only the config schema is needed.
"""

from ds_ext.errors import DsExtError
from ds_ext.lazy import lazy_exports


class TEDError(DsExtError, ValueError):
    """A TED layer built with arguments TED does not support, or that do not fit the TED layout or
    the tokens it is given; one line starting ``ds_ext.ted:`` (the ``ted`` plugin reports the layout
    checks as :class:`~ds_ext.errors.DsExtConfigError`)."""


_EXPORTS = {
    "ColumnParallelLinear": "ds_ext.moe.tensor_parallel",
    "RowParallelLinear": "ds_ext.moe.tensor_parallel",
    "TEDContext": "ds_ext.moe.context",
    "TEDMoE": "ds_ext.moe.layer",
    "clear_tapes": "ds_ext.moe.cac",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
