"""Where SAMO's pruning mask comes from (001 §4.1: ``ind``, "output of a parameter pruning
algorithm"; SAMO is applied after a network has been pruned).

Three sources (``ds_ext.samo.mask``), each read once, before DeepSpeed sees the model:

* ``prune``: the ``<name>_mask`` buffers that ``torch.nn.utils.prune`` leaves on a module beside
  ``<name>_orig``. Each such tensor is made permanent (``torch.nn.utils.prune.remove``: the
  parameter object of ``<name>_orig`` becomes ``<name>`` with the value ``orig * mask``), so the
  forward runs on the dense weight with its zeros and an optimizer built over the model's
  parameters before keeps the same parameter objects;
* ``zeros``: the entries exactly zero in every trainable parameter of two or more dimensions
  (weights; biases and norms, one-dimensional, are kept whole);
* ``file``: a ``torch.save``'d dict of parameter name -> bool tensor of the parameter's shape
  (True = kept), read with ``torch.load(weights_only=True)``.

A parameter with no mask is kept whole (no index). The result maps each trainable parameter with
a mask to that bool mask, on the parameter's device.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ds_ext.errors import DsExtConfigError
from ds_ext.samo.config import KEY


def _from_prune(model: nn.Module) -> dict[nn.Parameter, torch.Tensor]:
    from torch.nn.utils import prune

    out: dict[nn.Parameter, torch.Tensor] = {}
    for module in model.modules():
        for hook in [h for h in module._forward_pre_hooks.values() if isinstance(h, prune.BasePruningMethod)]:
            name = hook._tensor_name
            mask = getattr(module, f"{name}_mask").detach().clone().bool()
            prune.remove(module, name)
            out[getattr(module, name)] = mask
    return out


def _from_zeros(model: nn.Module) -> dict[nn.Parameter, torch.Tensor]:
    return {p: p.detach() != 0 for p in model.parameters() if p.requires_grad and p.dim() >= 2}


def _from_file(model: nn.Module, path: str | None) -> dict[nn.Parameter, torch.Tensor]:
    if not path:
        raise DsExtConfigError(f"{KEY}.mask 'file' needs {KEY}.mask_file; allowed: the path of a torch.save'd dict")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError) as err:
        raise DsExtConfigError(f"{KEY}.mask_file {path!r} cannot be read: {err}") from err
    if not isinstance(saved, dict):
        raise DsExtConfigError(f"{KEY}.mask_file {path!r} holds a {type(saved).__name__}; allowed: a dict name -> mask")
    params = dict(model.named_parameters())
    out: dict[nn.Parameter, torch.Tensor] = {}
    for name, mask in saved.items():
        p = params.get(name)
        if p is None:
            raise DsExtConfigError(
                f"{KEY}.mask_file {path!r} names {name!r}, which is no parameter of the model; allowed: names of "
                f"model.named_parameters(), e.g. {', '.join(list(params)[:4])}"
            )
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(p.shape):
            shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise DsExtConfigError(
                f"{KEY}.mask_file {path!r}: the mask of {name!r} has shape {shape}; allowed: {tuple(p.shape)}"
            )
        out[p] = mask.to(device=p.device, dtype=torch.bool)
    return out


def read_masks(model: nn.Module, source: str, path: str | None = None) -> dict[nn.Parameter, torch.Tensor]:
    """Each trainable parameter that has a mask -> its bool mask (True = kept), from ``source``
    (module docstring)."""
    readers: dict[str, Any] = {"prune": _from_prune, "zeros": _from_zeros}
    masks = _from_file(model, path) if source == "file" else readers[source](model)
    frozen = [p for p in masks if not p.requires_grad]
    if frozen:
        raise DsExtConfigError(
            f"{KEY}: a frozen parameter (requires_grad False) of shape {tuple(frozen[0].shape)} has a mask; SAMO "
            "compresses the states of trained parameters; allowed: masks on trainable parameters"
        )
    return masks
