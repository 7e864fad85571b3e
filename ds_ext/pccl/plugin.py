"""The ``pccl`` plugin: DeepSpeed ZeRO-3's all-gathers and reduce-scatters by PCCL (001 §6.3.2).

With ``"ds_ext": {"pccl": {"enabled": true}}`` every ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` DeepSpeed issues (ZeRO-3's parameter gathers and gradient
reduce-scatters) runs by ``algorithm`` through ds_ext.comm (default ``pccl``: recursive
doubling / halving across nodes, then a ring inside the node, 001 §6.2) and is recorded in the
ledger with its messages per level. DeepSpeed's other collectives are untouched.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ds_ext.plugin import Plugin, PluginConfig, register_plugin


class PCCLConfig(PluginConfig):
    """``"ds_ext": {"pccl": {...}}``."""

    algorithm: Literal["pccl", "ring", "auto"] = Field(
        "pccl",
        description="Algorithm for DeepSpeed's all-gathers / reduce-scatters: 'pccl' (001 §6.2), 'ring', or 'auto' "
        "(pccl where ds_ext.perf.collectives predicts it faster than a ring, per call, else DeepSpeed's own).",
    )


@register_plugin
class PCCLPlugin(Plugin):
    """Routes DeepSpeed's backend all-gather / reduce-scatter through ``runtime.comm``."""

    name = "pccl"
    Config = PCCLConfig

    def prepare(self, model: Any, optimizer: Any, ds_config: dict) -> tuple[Any, Any, dict]:
        from ds_ext.integration import ds_pccl

        self._restore = ds_pccl.route_backend_collectives(self.runtime.comm, self.config.algorithm)
        return model, optimizer, ds_config

    def attach(self, engine: Any) -> None:
        from ds_ext.integration import ds_engine

        ds_engine.restore_on_destroy(engine, self._restore)
