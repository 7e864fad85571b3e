"""``ds_ext.tiled_optimizer``'s section (001 §7.2), apart from the plugin so that the config
schema (``ds-ext schema``) imports no torch."""

from __future__ import annotations

from pydantic import Field

from ds_ext.plugin import PluginConfig

DEFAULT_TILE_SIZE = 1_800_000  # 001 §7.2: "we fix the tile size to 1.8 million parameters"
MAX_TILE_SIZE = 2**30  # a 4 GiB buffer: the tiles are there to keep the step's buffer small


class TiledOptimizerConfig(PluginConfig):
    """``ds_ext.tiled_optimizer`` (001 §7.2)."""

    tile_size: int = Field(
        DEFAULT_TILE_SIZE,
        gt=0,
        le=MAX_TILE_SIZE,
        description="Parameters per tile, at most 2^30 (a 4 GiB buffer); the step's fp32 gradient buffer is "
        "4 x tile_size bytes.",
    )
