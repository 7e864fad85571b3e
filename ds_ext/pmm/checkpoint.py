"""3D-PMM checkpoints that record their grid and layouts, reshard, and consolidate.

Next to DeepSpeed's own files, a save writes ``<tag>/pmm3d/``:

* ``layout.json`` (rank 0): the grid (x, y, z, data), DeepSpeed's step counters, the Hugging
  Face class and config of an HF model, and per parameter (serial name) how it is laid out
  (the sharding contracts of :mod:`ds_ext.pmm.linear` and :mod:`ds_ext.pmm.layers`):
  ``linear_weight`` (n, k, transposed, out_chunks, split_out: Ŵ, chunk z of the flattened block
  ``W[out block, in block]``, the out block all n rows when split_out is false; also the
  tables of :mod:`ds_ext.pmm.vocab`),
  ``linear_bias`` (out block), ``features`` (norms: last dimension split over Y);
* ``tensor_<x>_<y>_<z>.pt`` (the ranks with data coordinate 0): their shards and, with a
  torch optimizer, its per-parameter state under the same names.

:func:`full_tensor` rebuilds a serial tensor from every rank's shard; loading onto another
grid cuts this rank's shard from it with the converted layer's ``shard_full`` (one
parameter at a time), and :func:`consolidate` writes the serial state dict. Files are read
with ``torch.load(weights_only=True, mmap=True)``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ds_ext.errors import DsExtError
from ds_ext.models.hf import hf_record
from ds_ext.pmm.config import KEY
from ds_ext.pmm.layers import _FeatureSharded
from ds_ext.pmm.layout import LinearLayout, feature_slice
from ds_ext.pmm.linear import Linear

DIR = "pmm3d"
LAYOUT = "layout.json"


class CheckpointError(DsExtError, ValueError):
    """A checkpoint that cannot be loaded here; one line naming what to change."""


def _owners(model: nn.Module) -> dict[int, tuple[nn.Module, str]]:
    owners: dict[int, tuple[nn.Module, str]] = {}
    for m in model.modules():
        for p_name, p in m.named_parameters(recurse=False):
            owners.setdefault(id(p), (m, p_name))
    return owners


def layout_record(model: nn.Module) -> dict[str, dict[str, Any]]:
    """How each parameter of a converted ``model`` is laid out (by its serial name)."""
    owners, out = _owners(model), {}
    for name, p in model.named_parameters():
        m, p_name = owners[id(p)]
        if isinstance(m, Linear):
            geometry = {
                "n": m.out_features,
                "k": m.in_features,
                "transposed": m.transposed,
                "out_chunks": m.layout.out_chunks,
                "split_out": m.split_out,
            }
            out[name] = {"kind": f"linear_{p_name}", **geometry}
        elif isinstance(m, _FeatureSharded):
            out[name] = {"kind": "features", "shape": [*p.shape[:-1], m.features]}
        else:
            raise CheckpointError(f"{KEY}: parameter {name} belongs to {type(m).__name__}, not a converted layer")
    return out


def _optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, steps: int
) -> dict[str, dict[str, torch.Tensor]] | None:
    """The optimizer's state per parameter name; None where it is not keyed by the model's
    parameters (after a step, every trainable parameter must have one)."""
    if optimizer is None:
        return None
    names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    state = {
        names[id(p)]: {k: v.detach().cpu().clone() for k, v in st.items() if torch.is_tensor(v)}
        for p, st in optimizer.state.items()
        if id(p) in names
    }
    if steps > 0 and set(state) != set(names.values()):
        return None
    return state


def save(
    tag_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, axes: dict, grid, counters: dict[str, int]
) -> None:
    """Write this rank's part of ``<tag_dir>/pmm3d`` (every rank calls it)."""
    out = Path(tag_dir) / DIR
    out.mkdir(parents=True, exist_ok=True)
    if axes["data"].rank != 0:
        return
    params = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    state = _optimizer_state(model, optimizer, counters["global_steps"])
    coords = axes["x"].rank, axes["y"].rank, axes["z"].rank
    torch.save({"params": params, "optimizer": state}, out / "tensor_{}_{}_{}.pt".format(*coords))
    if axes["tensor"].rank == 0:
        record = {
            "grid": {"x": grid.x, "y": grid.y, "z": grid.z, "data": grid.data},
            "counters": counters,
            "hf": hf_record(model),
            "params": layout_record(model),
            "optimizer": state is not None,
        }
        (out / LAYOUT).write_text(json.dumps(record, indent=1))


def read_record(tag_dir: Path) -> dict[str, Any]:
    """The ``layout.json`` of a tag directory; one line if there is none."""
    path = Path(tag_dir) / DIR / LAYOUT
    if not Path(tag_dir).is_dir():
        raise CheckpointError(f"{KEY}: checkpoint {tag_dir} does not exist")
    if not path.is_file():
        raise CheckpointError(
            f"{KEY}: checkpoint {tag_dir} has no 3D-PMM layout record ({DIR}/{LAYOUT}: saved "
            "without ds_ext.pmm3d or by an older ds_ext), so the grid its shards belong to is "
            "unknown; save it again from a run on its grid with this ds_ext"
        )
    return json.loads(path.read_text())


def _shard_files(tag_dir: Path, grid: dict[str, int]) -> dict[tuple[int, int, int], dict]:
    files = {}
    for x in range(grid["x"]):
        for y in range(grid["y"]):
            for z in range(grid["z"]):
                path = Path(tag_dir) / DIR / f"tensor_{x}_{y}_{z}.pt"
                if not path.is_file():
                    raise CheckpointError(f"{KEY}: checkpoint {tag_dir} lacks {DIR}/{path.name} of its grid {grid}")
                files[(x, y, z)] = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    return files


def full_tensor(
    rec: dict[str, Any], grid: dict[str, int], shards: dict[tuple[int, int, int], torch.Tensor]
) -> torch.Tensor:
    """The serial tensor of one parameter (or optimizer state) from the shards of all tensor ranks."""
    any_shard = next(iter(shards.values()))
    kind = rec["kind"]
    if any_shard.dim() == 0:  # a scalar state (Adam's step)
        return any_shard.clone()
    if kind == "features":
        full = any_shard.new_empty(rec["shape"])
        for (_, y, _), t in shards.items():
            full[..., feature_slice(rec["shape"][-1], grid["y"], y)] = t
        return full
    full = any_shard.new_empty((rec["n"], rec["k"]) if kind == "linear_weight" else (rec["n"],))
    for x in range(grid["x"]):
        for y in range(grid["y"]):
            _place(full, kind, rec, grid, {"x": x, "y": y}, [shards[(x, y, z)] for z in range(grid["z"])])
    return full


def _place(
    full: torch.Tensor,
    kind: str,
    rec: dict[str, Any],
    grid: dict[str, int],
    c: dict[str, int],
    z_chunks: list[torch.Tensor],
) -> None:
    """Write the (x, y) block of a linear weight (its Z chunks, in order) or bias into ``full``."""
    out_ax, in_ax = ("y", "x") if rec["transposed"] else ("x", "y")
    n, k = rec["n"], rec["k"]
    split = rec.get("split_out", True)  # False: the out-features whole on every rank of out_ax
    out_parts, out_coord = (grid[out_ax], c[out_ax]) if split else (1, 0)
    lay = LinearLayout(n, k, out_parts, out_coord, grid[in_ax], c[in_ax], grid["z"], 0, rec["out_chunks"])
    rows = lay.out_index()
    if kind == "linear_bias":
        full[rows] = z_chunks[0]
        return
    cols = feature_slice(k, grid[in_ax], c[in_ax])
    full[rows, cols] = torch.cat(z_chunks).view(lay.n_local, lay.k_local)


def _full(record: dict, files: dict, name: str, state_key: str | None = None) -> torch.Tensor:
    if state_key is None:
        shards = {c: f["params"][name] for c, f in files.items()}
    else:
        shards = {c: f["optimizer"][name][state_key] for c, f in files.items()}
    return full_tensor(record["params"][name], record["grid"], shards)


def load_resharded(tag_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Load a checkpoint saved on another grid: each parameter (and its optimizer state)
    rebuilt in full, this rank's shard cut from it. Returns the layout record."""
    record = read_record(tag_dir)
    if optimizer is not None and not record["optimizer"]:
        raise CheckpointError(
            f"{KEY}: checkpoint {tag_dir} holds no per-parameter optimizer state (saved with "
            "ZeRO or 16-bit training), so it reshards only with load_optimizer_states=False"
        )
    files = _shard_files(tag_dir, record["grid"])
    owners = _owners(model)
    mine = dict(model.named_parameters())
    missing = sorted(set(mine) ^ set(record["params"]))
    if missing:
        raise CheckpointError(f"{KEY}: checkpoint {tag_dir} and the model differ in parameters {missing[:4]}")
    with torch.no_grad():
        for name, p in mine.items():
            m, p_name = owners[id(p)]
            p.copy_(m.shard_full(p_name, _full(record, files, name)))
            if optimizer is not None:
                state = {}
                for key in next(iter(files.values()))["optimizer"].get(name, {}):
                    full = _full(record, files, name, key)
                    state[key] = m.shard_full(p_name, full).to(p.device) if full.dim() else full
                optimizer.state[p] = state
    return record


def consolidate(tag_dir: Path) -> dict[str, torch.Tensor]:
    """The full serial state dict of a 3D-PMM checkpoint (any grid)."""
    record = read_record(tag_dir)
    files = _shard_files(tag_dir, record["grid"])
    return {name: _full(record, files, name) for name in record["params"]}


def save_pretrained(tag_dir: Path, state: dict[str, torch.Tensor], out_dir: Path) -> None:
    """A Hugging Face ``save_pretrained`` directory of the consolidated model."""
    import transformers

    hf = read_record(tag_dir)["hf"]
    if hf is None:
        raise CheckpointError(f"{KEY}: checkpoint {tag_dir} is not of a Hugging Face model (no 'hf' record)")
    cls = getattr(transformers, hf["class"])
    model = cls(cls.config_class.from_dict(hf["config"]))
    unexpected = model.load_state_dict(state, strict=False).unexpected_keys  # tied aliases are not in state
    absent = set(dict(model.named_parameters())) - set(state)
    if unexpected or absent:
        raise CheckpointError(
            f"{KEY}: checkpoint {tag_dir} does not match {hf['class']}: unexpected "
            f"{sorted(unexpected)[:4]}, missing {sorted(absent)[:4]}"
        )
    model.save_pretrained(out_dir)


def load_full(model: nn.Module, directory: Path) -> None:
    """Load a full (serial) Hugging Face checkpoint (``*.safetensors`` of ``save_pretrained``)
    into a converted ``model``, reading one tensor at a time and keeping this rank's shard."""
    from safetensors import safe_open

    owners = _owners(model)
    mine = dict(model.named_parameters())
    seen = set()
    with torch.no_grad():
        for path in sorted(Path(directory).glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as fh:
                for key in fh.keys():
                    if key not in mine:
                        continue
                    m, p_name = owners[id(mine[key])]
                    mine[key].copy_(m.shard_full(p_name, fh.get_tensor(key)))
                    seen.add(key)
    if set(mine) - seen:
        raise CheckpointError(f"{directory}: no tensors for parameters {sorted(set(mine) - seen)[:4]}")
