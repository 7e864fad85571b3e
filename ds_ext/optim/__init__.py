"""Tiled mixed-precision optimizer step (001 §7.2): :mod:`ds_ext.optim.tiled` holds the
arithmetic, :mod:`ds_ext.optim.plugin` the ``"tiled_optimizer"`` plugin."""

from ds_ext.optim.tiled import TiledAdam, TileBuffer, check_tileable, piecewise_loader

__all__ = ["TiledAdam", "TileBuffer", "check_tileable", "piecewise_loader"]
