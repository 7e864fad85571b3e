"""ZeRO-topo's pipeline form: inside DeepSpeed's PipelineEngine (003 §V-A under 004's TP x PP x ZeRO-1).

DeepSpeed's PipelineEngine runs ZeRO stage 0 or 1 only (runtime/pipe/engine.py: "ZeRO-2 and ZeRO-3
are incompatible with pipeline parallelism"): each stage keeps its weights whole for every
micro-batch of the 1F1B schedule. What 003's hierarchy still gives there is the step boundary.
The stage's trainable parameters, in model order, are cut into runs of at most
``zero_optimization.reduce_bucket_size`` elements (DeepSpeed's bucket of the gradient reduction,
5e8 by default; a larger parameter is a run of its own), and each run is one
:class:`~ds_ext.zero_topo.units.FlatUnit` in whole mode (block-aligned per parameter, as a
ZeRO-topo unit), so the step's reduction buffers (the flat and shard-ordered gradient, the
quantizer's) hold one bucket at a time, not the stage. Sharding contract, per unit:

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

from ds_ext.zero_topo.layout import buckets
from ds_ext.zero_topo.sharded_model import ShardedModel, assign_parameters
from ds_ext.zero_topo.units import FlatUnit, ShardContext


class PipelineStage(ShardedModel):
    """This rank's pipeline stage as whole-mode units of at most ``bucket_size`` elements each (see
    module; one unit is named ``stage{stage}``, several ``stage{stage}.{i}``): no gather or release
    hooks. Expert parameters are refused before (``support.check_model``)."""

    def __init__(self, model: nn.Module, ctx: ShardContext, stage: int, bucket_size: int) -> None:
        self.model, self.ctx, self.expert_ctx, self.prefetch, self.root = model, ctx, None, False, None
        (params,) = assign_parameters(model, [])  # each parameter once, with its qualified names
        runs = buckets(params, [p.numel() for p, _ in params], bucket_size)
        names = [f"stage{stage}"] if len(runs) == 1 else [f"stage{stage}.{i}" for i in range(len(runs))]
        self.units = [
            FlatUnit(name, [p for p, _ in run], ctx, [n for _, n in run], whole=True) for name, run in zip(names, runs)
        ]
        self.all_units = list(self.units)
        self._order: list[FlatUnit] = []
        self.peak_state_bytes: dict[str, int] = {}
