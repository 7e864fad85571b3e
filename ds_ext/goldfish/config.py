"""``ds_ext.goldfish``'s section (000 §VIII-D; Hans et al., arXiv 2406.10209), apart from the
plugin so that the config schema (``ds-ext schema``) imports no torch."""

from __future__ import annotations

from pydantic import Field

from ds_ext.plugin import PluginConfig

KEY = "ds_ext.goldfish"


class GoldfishConfig(PluginConfig):
    """``"ds_ext": {"goldfish": {"enabled": true, "k": 2, "h": 13}}``: leave out of the loss every
    token whose hashed ``h`` preceding tokens select it, 1 in ``k`` on average (000 §VIII-D)."""

    k: int = Field(
        2,
        ge=2,
        le=2**31,
        description="Drop frequency: a token is left out of the loss with probability 1/k over contexts "
        "(000 §VIII-D uses 2; 10**9 drops practically nothing).",
    )
    h: int = Field(
        13,
        ge=1,
        le=4096,
        description="Context width: the number of preceding tokens whose hash decides whether a token is dropped "
        "(000 §VIII-D uses 13); the first h tokens of a sequence are always kept.",
    )
