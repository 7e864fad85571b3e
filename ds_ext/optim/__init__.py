"""Tiled mixed-precision optimizer step (001 §7.2): :mod:`ds_ext.optim.tiled` holds the
arithmetic, :mod:`ds_ext.optim.plugin` the ``"tiled_optimizer"`` plugin, :mod:`ds_ext.optim.config`
its section. The names below load on first use (PEP 562): the config schema imports no torch."""

from importlib import import_module
from typing import Any

_EXPORTS = ("TiledAdam", "TileBuffer", "check_tileable", "piecewise_loader")
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ds_ext.optim' has no attribute {name!r}")
    return getattr(import_module("ds_ext.optim.tiled"), name)
