"""The ``pccl`` plugin: DeepSpeed ZeRO-3's all-gathers and reduce-scatters by PCCL (001 §6.3.2).

With ``"ds_ext": {"pccl": {"enabled": true}}`` every ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` DeepSpeed issues (ZeRO-3's parameter gathers and gradient
reduce-scatters) runs by ``algorithm`` through ds_ext.comm (default ``pccl``: recursive
doubling / halving across nodes, then a ring inside the node, 001 §6.2) and is recorded in the
ledger with its messages per level. DeepSpeed's other collectives are untouched.
"""

from __future__ import annotations

from typing import Any

from ds_ext.pccl.config import PCCLConfig
from ds_ext.plugin import Plugin


class PCCLPlugin(Plugin):
    """Routes DeepSpeed's backend all-gather / reduce-scatter through ``runtime.comm``."""

    name = "pccl"
    Config = PCCLConfig

    def prepare(self, model: Any, optimizer: Any, ds_config: dict) -> tuple[Any, Any, dict]:
        """Route DeepSpeed's backend all-gather / reduce-scatter through ds_ext's communicator and PCCL's
        algorithm (001 ch. 6)."""
        from ds_ext.integration import ds_pccl

        self._restore = ds_pccl.route_backend_collectives(self.runtime.comm, self.config.algorithm)
        return model, optimizer, ds_config

    def attach(self, engine: Any) -> None:
        """DeepSpeed's backend collectives restored when the engine is destroyed."""
        from ds_ext.integration import ds_engine

        ds_engine.restore_on_destroy(engine, self._restore)
