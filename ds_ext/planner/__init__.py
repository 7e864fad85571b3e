"""Planner and simulator: pick a plan for a model on a machine, predict at scale.

``models`` (catalogue), ``machine`` (presets with sourced constants), ``rccl`` (Frontier's RCCL
latency per ring step, derived from 001 §6.3.1), ``estimate`` (memory, bytes per level, α-β step
time of one plan), ``zero_plans`` / ``pmm_grids`` / ``ted_layouts`` / ``megatron_plans``
(candidates from the plugins' analytic models in ``ds_ext.perf`` and 004's 3D parallelism),
``plan`` (rank them, list the rest with reasons), ``simulate`` (sweeps), ``validate`` (against the
papers), ``report`` and ``command`` (CLI: plan, simulate, tune). Nothing here imports torch.
"""

from ds_ext.errors import DsExtError


class PlannerError(DsExtError, ValueError):
    """Input the planner cannot use; the message names the argument and what is allowed."""
