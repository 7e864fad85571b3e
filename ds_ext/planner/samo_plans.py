"""SAMO (001 ch. 4) on Megatron's layouts: what a pruned model trained with SAMO keeps per GPU and
sends per step (``ds-ext plan --sparsity P``).

Why in the ``megatron`` family, not a family of its own: SAMO changes a layout's model state and
its data-parallel step only. The pipeline (1F1B bubble, stage sends, activations, the head's
imbalance) is DeepSpeed's PipelineEngine either way, 001 §4.2.2's inter-layer parallelism, so a
SAMO plan is a Megatron layout with these two terms swapped (as ``+ zero_topo`` swaps them),
named ``... + samo p<P>`` and ranked beside the dense layouts: the ranking shows the split §4.2.2
argues for (the memory saved lets the model take fewer stages and more data parallelism) against
the dense one. SAMO's plugin runs at tensor parallel 1 and ZeRO stage 0 / 1
(``ds_ext.samo.support``): a layout with TP > 1, or PP > 1 for a model whose embedding is tied to
its head, is built dense only and its SAMO form listed in ``PlanResult.dropped`` with
:func:`refusal`'s reason; a SAMO layout runs the plugin's stage 1 (the
compressed optimizer state sharded over DP, ``ds_ext.samo.optimizer``), the counterpart of the
dense layouts' ZeRO-1; at DP 1 it is stage 0's Eq. 4.1.

With n the larger end stage's parameters (``megatron_plans.stage_params``), k = round((1 - p) n)
kept, e the element bytes and d = DP:

* model state per GPU: Eq. 4.1 sharded over d (``perf.samo.sharded_model_state_bytes`` for the
  rank holding a full chunk; at d = 1 Eq. 4.1 itself, 24 (1 - p) n + 2 n in 16-bit against 20 n,
  001 §4.1.4), split as weights = the dense θ16 (e n), gradients = the flat compressed ∇θ16 (e k,
  padded to d chunks), optimizer = the rest (θ32, ∇θ32, Adam's moments, the int32 index, the step's
  16-bit copy);
* the step: the compressed ∇θ16 reduce-scattered and the updated 16-bit chunks all-gathered over
  d, together ``perf.samo.allreduce_bytes`` of the padded k, (1 - p) of the dense all-reduce of the
  n gradients; no index travels (001 §4.2.1). The dense ZeRO-1 step all-gathers the n weights too.

The other families plan the model as if it were not pruned.
"""

from __future__ import annotations

from typing import Any

from ds_ext.comm.emulation import message_steps
from ds_ext.perf import samo as model
from ds_ext.planner.estimate import Traffic
from ds_ext.samo.config import SamoConfig


def suffix(p: float) -> str:
    """The name a layout's SAMO form adds to the layout's."""
    return f" + samo p{p:g}"


def refusal(tp: int, pp: int = 1, tied: bool = False) -> str | None:
    """Why SAMO's plugin refuses the layout, None if it runs it: tensor parallelism
    (``ds_ext.samo.support.check_layout``), and a pipeline whose embedding is tied to the head
    (a ``TiedLayerSpec``, ``ds_ext.samo.support.check_model``)."""
    if tp > 1:
        return f"SAMO at TP {tp}: the plugin runs tensor parallel 1 only (ds_ext.samo.support.check_layout)"
    if pp > 1 and tied:
        return (
            f"SAMO at PP {pp} with the embedding tied to the head: the plugin refuses a PipelineModule's tied "
            "layers (ds_ext.samo.support.check_model)"
        )
    return None


def kept(n: int, p: float) -> int:
    """k = (1 - p) n entries kept by the pruning mask (001 §4.1.4)."""
    return round((1 - p) * n)


def _flat(k: int, d: int) -> int:
    """The flat compressed ∇θ16's elements, padded to ``d`` equal chunks (``ds_ext.samo.state``)."""
    return -(-k // d) * d


def states(n: int, p: float, e: int, dp: int) -> dict[str, float]:
    """Model-state bytes per GPU of a stage of ``n`` parameters at sparsity ``p`` (module docstring)."""
    k = kept(n, p)
    total = model.sharded_model_state_bytes(n, k, k, e, dp, 0)
    weights, gradients = e * n, e * _flat(k, dp)
    return {"weights": weights, "secondary": 0.0, "gradients": gradients, "optimizer": total - weights - gradients}


def step_traffic(n: int, p: float, e: int, dp: int, level: str | None) -> Traffic:
    """The compressed reduce-scatter and all-gather over DP at ``level`` once per step (module docstring)."""
    if dp == 1:
        return Traffic({}, {})
    nbytes = model.allreduce_bytes(_flat(kept(n, p), dp), e, dp)
    steps = message_steps("reduce_scatter", dp) + message_steps("all_gather", dp)
    return Traffic({level: nbytes}, {level: steps})  # type: ignore[dict-item]


def section() -> dict[str, Any]:
    """The ``"ds_ext"`` block's SAMO section (``ds_ext.samo.config``) with its default mask source,
    the ``weight_mask`` buffers of ``torch.nn.utils.prune``: the planner does not know where a run keeps its mask."""
    return SamoConfig(enabled=True).model_dump(include={"enabled", "mask"})


def note(n: int, p: float, dp: int) -> str:
    k = kept(n, p)
    return (
        f"SAMO at p = {p:g} (001 ch. 4): {k} of the stage's {n} parameters kept; model state Eq. 4.1 with the "
        f"optimizer state sharded over DP {dp}; the DP step carries (1 - p) of the dense all-reduce (§4.2.1)"
    )
