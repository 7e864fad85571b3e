"""A full serial state dict on disk, read one tensor at a time.

:func:`ds_ext.pmm.build_on_meta` with ``checkpoint=`` binds each meta parameter to its tensor
here (:func:`bind`); :func:`ds_ext.pmm.parallelize` reads it while converting the parameter's
module, cuts this rank's shard (001 Algorithm 3's layout) and drops the full tensor. Hugging
Face keys are renamed as ``from_pretrained`` renames them (:mod:`ds_ext.pmm.hf_keys`).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from ds_ext.pmm.checkpoint import CheckpointError


class FullCheckpoint:
    """A full serial state dict on disk, read one tensor at a time.

    ``path``: a ``.safetensors`` file, a directory of them (Hugging Face ``save_pretrained``,
    sharded or not), or a ``torch.save``'d dict of tensors (a file, or the one ``*.bin`` /
    ``*.pt`` / ``*.pth`` of a directory), opened with ``torch.load(weights_only=True, mmap=True)``.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._files: dict[str, Path] = {}  # safetensors: key -> file
        self._loaded: dict[str, torch.Tensor] | None = None  # torch.save'd dict (memory-mapped)
        if self.path.is_dir():
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                pickled = [p for ext in ("bin", "pt", "pth") for p in sorted(self.path.glob(f"*.{ext}"))]
                if len(pickled) != 1:
                    raise CheckpointError(
                        f"checkpoint {self.path}: expected *.safetensors files or one *.bin / "
                        f"*.pt / *.pth file, found {[p.name for p in pickled] or 'none'}"
                    )
                self._load(pickled[0])
        elif self.path.suffix == ".safetensors":
            files = [self.path]
        elif self.path.is_file():
            files = []
            self._load(self.path)
        else:
            raise CheckpointError(f"checkpoint {self.path} does not exist")
        if files:
            from safetensors import safe_open

            for f in files:
                with safe_open(str(f), framework="pt") as fh:
                    self._files.update(dict.fromkeys(fh.keys(), f))

    def _load(self, path: Path) -> None:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        if not (isinstance(state, dict) and all(isinstance(v, torch.Tensor) for v in state.values())):
            raise CheckpointError(f"checkpoint {path}: not a flat dict of tensors (a state_dict())")
        self._loaded = state

    def keys(self) -> set[str]:
        return set(self._loaded) if self._loaded is not None else set(self._files)

    def shape(self, key: str) -> tuple[int, ...]:
        if self._loaded is not None:
            return tuple(self._loaded[key].shape)
        from safetensors import safe_open

        with safe_open(str(self._files[key]), framework="pt") as fh:
            return tuple(fh.get_slice(key).get_shape())

    def read(self, key: str) -> torch.Tensor:
        if self._loaded is not None:
            return self._loaded[key]
        from safetensors import safe_open

        with safe_open(str(self._files[key]), framework="pt") as fh:
            return fh.get_tensor(key)


class StoredTensor:
    """A meta parameter's value: tensor ``key`` of a :class:`FullCheckpoint`."""

    def __init__(self, checkpoint: FullCheckpoint, key: str) -> None:
        self.checkpoint, self.key = checkpoint, key

    def full(self, name: str) -> torch.Tensor:
        return self.checkpoint.read(self.key)


def _is_hf(model: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def bind(model: nn.Module, ckpt: FullCheckpoint) -> None:
    """Each parameter (under any of its tied names) and persistent buffer to its checkpoint
    tensor; a Hugging Face model's keys renamed as ``from_pretrained`` does."""
    if _is_hf(model):
        from ds_ext.pmm.hf_keys import model_names

        keys = model_names(model, ckpt.keys(), str(ckpt.path))
    else:
        keys = {k: k for k in ckpt.keys()}
    names: dict[int, list[str]] = defaultdict(list)
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names[id(p)].append(name)
        params[id(p)] = p
    used, missing = set(), []
    for pid, p in params.items():
        found = [n for n in names[pid] if n in keys]
        used.update(found)
        if not found:
            missing.append(names[pid][0])
            continue
        key = keys[found[0]]
        if ckpt.shape(key) != tuple(p.shape):
            raise CheckpointError(
                f"checkpoint {ckpt.path}: {key} has shape {list(ckpt.shape(key))}, the "
                f"model's {names[pid][0]} {list(p.shape)}"
            )
        p.pmm_init = StoredTensor(ckpt, key)
    if missing:
        raise CheckpointError(f"checkpoint {ckpt.path} lacks {len(missing)} parameter(s) of the model: {missing[:4]}")
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name in keys:
                buf.copy_(ckpt.read(keys[name]))
                used.add(name)
    if set(keys) - used:
        raise CheckpointError(
            f"checkpoint {ckpt.path} holds {len(set(keys) - used)} tensor(s) the model lacks: "
            f"{sorted(keys[n] for n in set(keys) - used)[:4]}"
        )
