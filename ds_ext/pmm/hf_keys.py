"""Hugging Face checkpoint keys -> a model's parameter names, by transformers' own renamings.

transformers 5 saves and loads some tensors under names other than the module path (its
``conversion_mapping``: GPT-NeoX's head ``lm_head`` is ``embed_out`` on disk; legacy
``LayerNorm.gamma``; a base model's prefix added or stripped). :func:`model_names` applies
the same renamings that ``from_pretrained`` does; a key that needs a tensor *conversion*
(merging or splitting tensors, e.g. stacked MoE experts) is refused in one line.
transformers 4 saves under the module paths: there the names are the keys.
"""

from __future__ import annotations

from typing import Iterable

from torch import nn

from ds_ext.errors import DsExtError


def model_names(model: nn.Module, keys: Iterable[str], where: str) -> dict[str, str]:
    """``{model name: checkpoint key}`` for the checkpoint ``keys`` of Hugging Face ``model``."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # transformers 4: keys are module paths
        return {k: k for k in keys}
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    names = dict(model.state_dict(keep_vars=True))
    out = {}
    for key in keys:
        name, converter = rename_source_key(key, renamings, converters, model.base_model_prefix, names)
        if converter is not None:
            raise DsExtError(
                f"checkpoint {where}: {key} needs transformers' tensor conversion '{converter}' "
                "(tensors merged or split), which ds_ext does not apply; convert it with from_pretrained "
                "and save_pretrained once"
            )
        out[name] = key
    return out
