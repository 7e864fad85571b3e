"""Tiled mixed-precision optimizer step (001 §7.2): :mod:`ds_ext.optim.tiled` holds the
arithmetic, :mod:`ds_ext.optim.plugin` the ``"tiled_optimizer"`` plugin, :mod:`ds_ext.optim.config`
its section. The names below load on first use (PEP 562): the config schema imports no torch."""

from ds_ext.lazy import lazy_exports

_EXPORTS = dict.fromkeys(("TiledAdam", "TileBuffer", "check_tileable", "piecewise_loader"), "ds_ext.optim.tiled")
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
