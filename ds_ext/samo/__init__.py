"""SAMO: training pruned models with compressed model states (001 ch. 4).

The 16-bit weights stay dense (dense kernels in forward and backward); every other model state
(16- and 32-bit gradients, fp32 master weights, the optimizer's moments) is stored compressed by
the pruning mask, with one shared 1-D index per parameter (001 §4.1.1-4.1.2). Gradients are
compressed as backward produces them, the data-parallel all-reduce carries the compressed
gradients (§4.2.1), the optimizer steps on the compressed tensors and the result is expanded back
into the dense weights (§4.1.3). Modules: :mod:`~ds_ext.samo.config` (the section),
:mod:`~ds_ext.samo.index` (compress / expand), :mod:`~ds_ext.samo.mask` (where the mask comes
from), :mod:`~ds_ext.samo.state` (the compressed gradients and their backward hooks),
:mod:`~ds_ext.samo.optimizer` (the step), :mod:`~ds_ext.samo.zero2` (ZeRO-2: the gradients
sharded, reduced in buckets during backward), :mod:`~ds_ext.samo.support` (what it refuses),
:mod:`~ds_ext.samo.plugin` (the ``"samo"`` plugin); the memory model is :mod:`ds_ext.perf.samo`.
"""
