"""Portable exports of a ZeRO-topo checkpoint (item 3): what a user takes to the tools
they leave for.

* :func:`export_safetensors`: Hugging Face safetensors, sharded (``model-0000i-of-0000n.safetensors``
  files of at most ``max_shard_bytes`` each, a parameter larger than that alone in its file) with
  ``model.safetensors.index.json``, streamed: the parameters come one at a time from the
  memory-mapped shards (:func:`ds_ext.zero_topo.checkpoint.iter_params`), a file is written before
  the parameter that would overflow it is read, and an output file's tensors are all that is held:
  the host memory it takes is about the largest output file (a parameter's dtype conversion adds
  up to half of it) (DeepSpeed's ``zero_to_fp32`` builds the whole model first,
  deepspeedai/DeepSpeed#4025). The names are the model's own: a Hugging Face model trained under
  ZeRO-topo is saved in its Hugging Face layout, with the ``config.json`` its checkpoint recorded,
  so ``from_pretrained`` loads the directory; a tied weight is written once, under its first name
  (as ``save_pretrained`` does), its other names listed in the index's ``metadata.tied``.
  ``safetensors`` writes the files (zero-copy from the tensors, and the format every Hugging Face
  tool reads).
* :func:`export_dcp`: a ``torch.distributed.checkpoint`` directory, written with DCP's own writer
  (no process group needed), which ``dcp.load`` reads into a model sharded any way (FSDP2 /
  torchtitan at any world size). DCP plans one save over all its tensors, so this export holds
  the whole fp32 model in host memory.

Both write fp32 (the masters) unless ``dtype`` names another; neither needs the job's world.

The way back, where it is cheap (``ds-ext checkpoint import``): :func:`import_safetensors` and
:func:`import_dcp` read such an export (or any Hugging Face safetensors directory, or any DCP
checkpoint of a model's state dict) into one state dict of the model's names, as ``consolidate``
writes it: ``model.load_state_dict`` takes it before ``ds_ext.initialize``, which starts training
from those weights. The optimizer state does not travel: an export holds only the weights.
"""

from __future__ import annotations

import json
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ds_ext.zero_topo.checkpoint import CheckpointError, SavedCheckpoint, iter_params, open_parts

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"  # an unsharded Hugging Face save
SHARD = "model-{i:05d}-of-{n:05d}.safetensors"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Exported:
    """What an export wrote."""

    files: list[Path]
    tensors: int
    parameters: int
    total_bytes: int


def _dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise CheckpointError(f"export dtype {dtype!r}: allowed {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _fresh_dir(out_dir: Path) -> None:
    """``out_dir`` made, refused if it holds anything (an export that fails removes it whole)."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise CheckpointError(f"export directory {out_dir} is not empty; allowed: a new or empty directory")
    out_dir.mkdir(parents=True, exist_ok=True)


def export_safetensors(tag_dir: Path, out_dir: Path, max_shard_bytes: int = 2 * 2**30, dtype: str = "fp32") -> Exported:
    """Sharded, streamed safetensors of checkpoint ``tag_dir`` in ``out_dir`` (module docstring)."""
    if max_shard_bytes <= 0:
        raise CheckpointError(f"export max shard bytes must be positive, got {max_shard_bytes}")
    to = _dtype(dtype)
    parts = open_parts(tag_dir)
    _fresh_dir(out_dir)
    try:
        return _write_safetensors(parts, out_dir, max_shard_bytes, to)
    except BaseException:
        shutil.rmtree(out_dir, ignore_errors=True)
        raise


def _write_safetensors(parts: list[SavedCheckpoint], out_dir: Path, max_shard_bytes: int, to: torch.dtype) -> Exported:
    from safetensors.torch import save_file

    written: list[tuple[Path, list[str]]] = []
    tied: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    held = total = parameters = 0

    def flush() -> None:
        nonlocal shard, held
        if shard:
            path = out_dir / f".part-{len(written) + 1:05d}.safetensors"
            save_file(shard, str(path), metadata={"format": "pt"})
            written.append((path, list(shard)))
            shard, held = {}, 0

    size = to.itemsize
    for param in iter_params(parts):
        if held and held + param.numel * size > max_shard_bytes:
            flush()  # before the next parameter is read: the file's tensors and it are all that is held
        value = param.load().to(to)
        shard[param.names[0]] = value
        tied.update((alias, param.names[0]) for alias in param.names[1:])
        held += value.nbytes
        total += value.nbytes
        parameters += value.numel()
    flush()
    files, weight_map = [], {}
    for i, (path, names) in enumerate(written, 1):
        final = out_dir / SHARD.format(i=i, n=len(written))
        path.rename(final)
        files.append(final)
        weight_map.update((name, final.name) for name in names)
    index = {"metadata": {"total_size": total, "tied": tied}, "weight_map": weight_map}
    (out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    hf = parts[0].meta.get("hf")
    if hf is not None:  # the dtype written, under the key this config uses (transformers renamed it)
        key = "torch_dtype" if "torch_dtype" in hf["config"] else "dtype"
        config = hf["config"] | {"architectures": [hf["class"]], key: str(to).removeprefix("torch.")}
        (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return Exported(files, len(weight_map), parameters, total)


def export_dcp(tag_dir: Path, out_dir: Path, dtype: str = "fp32") -> Exported:
    """A ``torch.distributed.checkpoint`` of checkpoint ``tag_dir`` in ``out_dir`` (module
    docstring): every name of a tied weight, each its own tensor."""
    import torch.distributed.checkpoint as dcp

    to = _dtype(dtype)
    state: dict[str, torch.Tensor] = {}
    parameters = total = 0
    for param in iter_params(open_parts(tag_dir)):
        value = param.load().to(to)
        parameters, total = parameters + value.numel(), total + value.nbytes
        for i, name in enumerate(param.names):
            state[name] = value if i == 0 else value.clone()
    _fresh_dir(out_dir)
    try:
        with warnings.catch_warnings():  # DCP says it assumes one process: that is the intent here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(out_dir)), no_dist=True)
    except BaseException:
        shutil.rmtree(out_dir, ignore_errors=True)
        raise
    return Exported(sorted(out_dir.iterdir()), len(state), parameters, total)


def import_safetensors(src: Path) -> dict[str, torch.Tensor]:
    """The state dict of a safetensors directory (sharded with ``model.safetensors.index.json``, or
    one ``model.safetensors``): every tensor under its name, a tied name (the index's
    ``metadata.tied``, which :func:`export_safetensors` writes) the same tensor as the name it is
    tied to."""
    from safetensors.torch import load_file

    index_path, single = src / INDEX, src / SINGLE
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        files = sorted(set(index["weight_map"].values()))
        tied = (index.get("metadata") or {}).get("tied") or {}
    elif single.is_file():
        files, tied = [SINGLE], {}
    else:
        raise CheckpointError(f"import: {src} holds neither {INDEX} nor {SINGLE}; allowed: a safetensors directory")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(str(src / name)))
    for alias, name in tied.items():
        if name not in state:
            raise CheckpointError(f"import: {src}: {alias} is tied to {name}, which no file holds")
        state[alias] = state[name]
    return state


def import_dcp(src: Path, out: Path) -> None:
    """A ``torch.distributed.checkpoint`` directory of a model's state dict written as one
    ``torch.save`` file ``out``, by DCP's own converter (no process group needed)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    if not (src / ".metadata").is_file():
        raise CheckpointError(f"import: {src} holds no .metadata; allowed: a torch.distributed.checkpoint directory")
    dcp_to_torch_save(str(src), str(out))
