"""Planner and simulator (issue 13): pick a plan for a model on a machine, predict at scale.

``models`` (catalogue), ``machine`` (presets with sourced constants), ``estimate`` (memory,
bytes per level, α-β step time of one plan), ``zero_plans`` / ``pmm_grids`` / ``ted_layouts``
(candidates from the plugins' analytic models in ``ds_ext.perf``), ``plan`` (rank them),
``simulate`` (sweeps), ``validate`` (against the papers), ``report`` and ``command`` (CLI).
"""


class PlannerError(ValueError):
    """Input the planner cannot use; the message names the argument and what is allowed."""
