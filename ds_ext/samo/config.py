"""``ds_ext.samo``'s section (001 ch. 4), apart from the plugin so that the config schema
(``ds-ext schema``) imports no torch."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ds_ext.plugin import PluginConfig

KEY = "ds_ext.samo"


class SamoConfig(PluginConfig):
    """``"ds_ext": {"samo": {"enabled": true, "mask": "prune"}}``: store every model state but the
    dense 16-bit weights compressed by the pruning mask (001 §4.1), all-reduce the compressed
    gradients (001 §4.2.1)."""

    mask: Literal["prune", "zeros", "file"] = Field(
        "prune",
        description="Where the pruning mask comes from: 'prune' = the weight_mask buffers of torch.nn.utils.prune "
        "(each pruned tensor is made permanent, weight = weight_orig * weight_mask); 'zeros' = the entries that are "
        "exactly zero, at ds_ext.initialize, in every trainable parameter of two or more dimensions; 'file' = "
        "mask_file.",
    )
    mask_file: str | None = Field(
        None,
        description="With mask 'file': a torch.save'd dict {parameter name: bool tensor of its shape, True = kept} "
        "(read with torch.load(weights_only=True)); parameters it does not name are kept whole.",
    )
