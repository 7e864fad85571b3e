"""ZeRO-topo's pipeline form: inside DeepSpeed's PipelineEngine (003 §V-A under 004's TP x PP x ZeRO-1).

DeepSpeed's PipelineEngine runs ZeRO stage 0 or 1 only (runtime/pipe/engine.py: "ZeRO-2 and ZeRO-3
are incompatible with pipeline parallelism"): each stage keeps its weights whole for every
micro-batch of the 1F1B schedule. What 003's hierarchy still gives there is the step boundary.
Per stage, one :class:`~ds_ext.zero_topo.units.FlatUnit` in whole mode holds the stage's
trainable parameters (block-aligned per parameter, as a ZeRO-topo unit). Sharding contract:

* weights: whole on every rank (the unit never releases them);
* gradients: accumulated by autograd over the micro-batches of one ``train_batch`` and reduced
  once, at the step, over the pipeline's data-parallel group exactly as a ZeRO-topo unit reduces
  one micro-batch (the plan's gradient level, bits and hops), then level by level to the
  optimizer level (its step kind and bits);
* optimizer: fp32 masters and moments sharded at the plan's optimizer level;
* after the step the updated shards are gathered back level by level (int8 blocks across nodes
  with ``step.bits`` 8) into the whole weights.

Tied weights (``TiedLayerSpec``: embedding and LM head) are summed over their stages by
DeepSpeed's own ReduceTiedGrads before the step, and counted once in the global norm (DeepSpeed's
``ds_pipe_replicated`` mark), as DeepSpeed does.
"""

from __future__ import annotations

from torch import nn

from ds_ext.zero_topo.sharded_model import ShardedModel, assign_parameters
from ds_ext.zero_topo.units import FlatUnit, ShardContext


class PipelineStage(ShardedModel):
    """This rank's pipeline stage as one whole-mode unit (see module): no gather or release hooks.
    Expert parameters are refused before (``support.check_model``)."""

    def __init__(self, model: nn.Module, ctx: ShardContext, stage: int) -> None:
        self.model, self.ctx, self.expert_ctx, self.prefetch, self.root = model, ctx, None, False, None
        (params,) = assign_parameters(model, [])  # each parameter once, with its qualified names
        self.units = (
            [FlatUnit(f"stage{stage}", [p for p, _ in params], ctx, [n for _, n in params], whole=True)]
            if params
            else []
        )
        self.all_units = list(self.units)
        self._order: list[FlatUnit] = []
        self.peak_state_bytes: dict[str, int] = {}
