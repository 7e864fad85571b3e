"""Self-describing, reshardable, atomic ZeRO-topo checkpoints.

A checkpoint is DeepSpeed's tag directory (its module and engine state, written by
rank 0) plus one shard file per rank, ``ds_ext_zero_topo_rank{r:05d}.pt``, r the rank's place
in its data-parallel group. Under model parallelism (``ds_ext.zero_topo.data_group``) the
shards of model-parallel rank m lie in a folder ``ds_ext_zero_topo_mp{m:02d}`` of their own,
each a checkpoint of one data-parallel group (resharded on its own; the model-parallel size
must match; :func:`consolidate` joins pipeline stages, not tensor-parallel slices). MoE experts
(TED), sharded over expert-data-parallel groups, are a checkpoint of their own per expert-model
rank e (tensor x pipeline x expert), in ``ds_ext_zero_topo_experts_mp{e:02d}``, its shards
numbered by expert-data rank (:func:`consolidate` refuses them). A shard
records the save's id (one random id per save, the same in every shard of it) and step,
the world size, the topology's level sizes, the plan, every unit's parameters
(qualified names, shapes, offsets) and, for the rank's *optimizer slice* of each unit
(``U / shards(optimizer)`` elements at ``[start, stop)`` of the unit's flat index):

* ``weights``: the slice of the 16-bit weights (frozen parameters and padding included),
* one *segment* per trainable parameter piece in the slice: element range, param group,
  fp32 master and the optimizer state of that master (Adam's moments and step).

Element ranges refer to the unit's flat order as saved, whose parameter offsets the shard
records (they depend on the plan: quantizing plans start every parameter on a block
boundary), so a load under another world, topology or plan maps each parameter piece it
needs to its saved range and gathers it from the old slices that overlap it (resharding).
Units must match by name, parameter names and shapes; the optimizer state keys must match.

Saving is atomic: DeepSpeed writes into a staging directory ``.<tag>.partial``, every
rank writes its shard under a temporary name, flushes and renames it, the ranks agree on
success with a collective, then rank 0 renames the directory to ``<tag>`` and only then
writes ``latest`` (temporary name + rename). A crash at any point leaves the previous
checkpoint and ``latest`` untouched. With ``zero_topo.async_save`` the files are snapshot into
host memory and this protocol runs in a background thread (:mod:`ds_ext.zero_topo.async_save`). Loading validates every file it needs and the ranks
agree (a collective) before anything is modified, so a bad checkpoint is refused on
every rank with one line and never hangs the others.
"""

from __future__ import annotations

import os
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from ds_ext.comm.collectives import backend_device, torch_op
from ds_ext.errors import DsExtError
from ds_ext.zero_topo.layout import shard_count, shard_index

FORMAT = "ds_ext.zero_topo/1"
SHARD_FILE = "ds_ext_zero_topo_rank{rank:05d}.pt"
MODEL_PARALLEL_DIR = "ds_ext_zero_topo_mp{rank:02d}"
EXPERT_DIR = "ds_ext_zero_topo_experts_mp{rank:02d}"  # MoE experts, per expert-model rank
LATEST = "latest"
DEEPSPEED_MODULE_FILE = "mp_rank_{rank:02d}_model_states.pt"  # DeepSpeed's, per model-parallel rank


class CheckpointError(DsExtError, RuntimeError):
    """A checkpoint that cannot be written or loaded here; the message names the file."""


class MissingShardError(CheckpointError):
    """A shard file that is not there (``path``): a node-local tier fetches it from a node that
    holds a copy (:mod:`ds_ext.zero_topo.tiers`)."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"checkpoint shard {path} is missing")
        self.path = path


# ---- files ---------------------------------------------------------------------------
def atomic_write(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """``write`` into a temporary file beside ``path``, flush it to disk, rename it into place."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` under a temporary name, flush to disk, rename into place."""
    atomic_write(path, lambda f: torch.save(obj, f))


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode()))
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_shard(path: Path) -> dict:
    """A shard file's contents (tensors memory-mapped), or :class:`CheckpointError`."""
    if not path.is_file():
        raise MissingShardError(path)
    check_zip(path, "checkpoint shard")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file gets the same one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"checkpoint shard {path} is unreadable (truncated or corrupt): {first}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint shard {path} was not written by {FORMAT}")
    return state


def check_zip(path: Path, what: str = "checkpoint file") -> None:
    """Verify the CRC of every record of a torch zip file without unpickling it (a load
    with ``mmap`` reads tensor bytes unchecked)."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (OSError, zipfile.BadZipFile, EOFError) as err:
        raise CheckpointError(f"{what} {path} is unreadable (truncated or corrupt): {err}") from None
    if bad is not None:
        raise CheckpointError(f"{what} {path} is unreadable (truncated or corrupt): bad CRC in {bad}")


def resolve_tag_dir(load_dir: str | Path, tag: str | None) -> Path:
    """The tag directory to load: ``tag``, else the one ``latest`` names. A directory that
    was being replaced when a save crashed is found under its ``.old`` name."""
    load_dir = Path(load_dir)
    if tag is None:
        latest = load_dir / LATEST
        if not latest.is_file():
            raise CheckpointError(f"checkpoint directory {load_dir} has no '{LATEST}' file; pass tag=...")
        tag = latest.read_text().strip()
    path = load_dir / str(tag)
    if not path.is_dir() and (load_dir / f".{tag}.old").is_dir():
        path = load_dir / f".{tag}.old"
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {load_dir / str(tag)} does not exist")
    return path


def shard_paths(tag_dir: Path, world_size: int) -> list[Path]:
    return [tag_dir / SHARD_FILE.format(rank=r) for r in range(world_size)]


def shard_dir(tag_dir: Path, model_rank: int, model_size: int) -> Path:
    """Where model-parallel rank ``model_rank``'s shards lie (the tag directory itself without
    model parallelism)."""
    return tag_dir if model_size == 1 else tag_dir / MODEL_PARALLEL_DIR.format(rank=model_rank)


def expert_dir(tag_dir: Path, expert_model_rank: int) -> Path:
    """Where the MoE experts' shards of expert-model rank ``expert_model_rank`` (tensor x pipeline x
    expert) lie: one checkpoint of that rank's expert-data-parallel group."""
    return tag_dir / EXPERT_DIR.format(rank=expert_model_rank)


def _folders(tag_dir: Path, pattern: str) -> list[Path]:
    return sorted(p for p in tag_dir.glob(pattern.replace("{rank:02d}", "*")) if p.is_dir())


def model_parallel_parts(tag_dir: Path) -> list[Path]:
    """The per-model-parallel-rank folders of a checkpoint (none without model parallelism)."""
    return _folders(tag_dir, MODEL_PARALLEL_DIR)


def expert_parts(tag_dir: Path) -> list[Path]:
    """The per-expert-model-rank folders of a checkpoint (none without MoE experts)."""
    return _folders(tag_dir, EXPERT_DIR)


def check_model_parallel(tag_dir: Path, model_size: int, expert_model_size: int = 0) -> None:
    """Refuse a checkpoint saved under another model-parallel size than ``model_size``, or with
    another number of expert-model ranks than ``expert_model_size`` (0: the run has no experts)."""
    saved = len(model_parallel_parts(tag_dir)) or 1
    if saved != model_size:
        raise CheckpointError(
            f"checkpoint {tag_dir} was saved with model-parallel size {saved}, this run has "
            f"{model_size}; allowed: the same tensor x pipeline parallel sizes"
        )
    experts = len(expert_parts(tag_dir))
    if experts != expert_model_size:
        raise CheckpointError(
            f"checkpoint {tag_dir} holds the MoE experts of {experts} expert-model ranks, this run has "
            f"{expert_model_size}; allowed: the same tensor x pipeline x expert parallel sizes"
        )


# ---- agreement -----------------------------------------------------------------------
def agree(error: str | None, what: str, group: object | None = None) -> None:
    """Collective: raise the same one-line :class:`CheckpointError` on every rank if any
    rank failed (naming the first failing rank and its reason). ``group``: a group of every
    rank other than the world's (the background writer's, ``ds_ext.zero_topo.async_save``),
    whose collectives the ledger does not count."""
    flag = torch.tensor([0.0 if error is None else 1.0], device=backend_device(group))
    (dist.all_reduce if group is None else torch_op("all_reduce"))(flag, group=group)
    if flag.item() == 0:
        return
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error, group=group)
    rank, msg = next((r, e) for r, e in enumerate(errors) if e is not None)
    raise CheckpointError(f"ds_ext.zero_topo: {what} failed on rank {rank}: {msg}")


def agree_present(path: Path, what: str) -> bool:
    """Collective: whether ``path`` is a file on every rank (False on every rank when it
    is on none; a :class:`CheckpointError` on every rank when only some see it)."""
    flag = torch.tensor([1.0 if path.is_file() else 0.0], device=backend_device())
    dist.all_reduce(flag)
    if flag.item() in (0, dist.get_world_size()):
        return bool(flag.item())
    raise CheckpointError(
        f"ds_ext.zero_topo: {what}: {path} exists on {int(flag.item())} of "
        f"{dist.get_world_size()} ranks (a file system not shared by every rank?)"
    )


# ---- what a rank holds ---------------------------------------------------------------
def unit_table(units: Iterable[Any]) -> list[dict]:
    """Units as a checkpoint records them (world-independent)."""
    out = []
    for unit in units:
        params = [
            {"names": list(names), "shape": list(shape), "offset": off}
            for names, shape, off in zip(unit.param_names, unit.shapes, unit.offsets)
        ]
        out.append({"name": unit.name, "numel": unit.numel, "params": params})
    return out


def new_save_id() -> str:
    """Collective: one random id for this save, rank 0's, on every rank."""
    import uuid

    box = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shard_state(
    ctx: Any, step: int, save_id: str, state: dict, model_parallel: dict[str, int], hf: dict | None = None
) -> dict:
    """This rank's shard (module docstring): the metadata of the save, of ``ctx`` (the rank's
    :class:`~ds_ext.zero_topo.units.ShardContext`: topology, plan, dtype), the job's
    ``model_parallel`` degrees (``tensor``, ``pipeline``), ``state`` (the plugin's
    ``state_dict()``: units, optimizer slices, segments, optimizer, loss scaler) and ``hf``, the
    Hugging Face class and config of the model (:func:`ds_ext.models.hf.hf_record`; None for
    another model), which :mod:`ds_ext.zero_topo.export` writes beside its safetensors."""
    topo, plan = ctx.topo, ctx.plan
    n_opt = shard_count(topo, plan.optimizer)
    return {
        "format": FORMAT,
        "save_id": save_id,
        "rank": ctx.rank,
        "world_size": topo.world_size,
        "topology": {"name": topo.name, "levels": [[lv.name, lv.size] for lv in topo.levels]},
        "plan": plan.describe(),
        "dtype": str(ctx.dtype).removeprefix("torch."),
        "step": step,
        "model_parallel": dict(model_parallel),
        "units": state["units"],
        "optimizer_shards": n_opt,
        "optimizer_shard_of_rank": [shard_index(topo, r, plan.optimizer) for r in range(topo.world_size)],
        "slices": state["slices"],
        "segments": state["segments"],
        "optimizer": state["optimizer"],
        "loss_scaler": state["loss_scaler"],
        "hf": hf,
    }


# ---- reading ranges across old shards --------------------------------------------------
@dataclass
class SavedCheckpoint:
    """The shards of one checkpoint, opened lazily, with range look-ups across them."""

    tag_dir: Path
    meta: dict  # rank 0's shard (metadata shared by all shards)

    def __post_init__(self) -> None:
        self._open: dict[int, dict] = {0: self.meta}
        self.units = {u["name"]: u for u in self.meta["units"]}
        first = {}
        for r, k in enumerate(self.meta["optimizer_shard_of_rank"]):
            first.setdefault(k, r)
        self._rank_of_slice = first

    @classmethod
    def open(cls, tag_dir: Path) -> "SavedCheckpoint":
        return cls(tag_dir, read_shard(tag_dir / SHARD_FILE.format(rank=0)))

    def shard(self, rank: int) -> dict:
        """Shard ``rank``, checked to come from the same save as rank 0's."""
        if rank not in self._open:
            path = self.tag_dir / SHARD_FILE.format(rank=rank)
            state = read_shard(path)
            mine, ref = _stamp(state), _stamp(self.meta)
            if mine != ref:
                raise CheckpointError(
                    f"checkpoint shard {path} belongs to another save ({mine}) than rank 0's shard "
                    f"({ref}): shards of different saves are mixed in {self.tag_dir}"
                )
            self._open[rank] = state
        return self._open[rank]

    def verify(self, ranks: range) -> None:
        """Open shards ``ranks`` (each present, readable, of this save)."""
        for r in ranks:
            self.shard(r)

    def slice_size(self, unit: str) -> int:
        """Elements of one optimizer slice of ``unit`` in the saved (padded) layout."""
        saved = self.meta["slices"][self._unit_index(unit)]
        return saved["stop"] - saved["start"]

    def _unit_index(self, unit: str) -> int:
        return next(i for i, u in enumerate(self.meta["units"]) if u["name"] == unit)

    def _slices(self, unit: str, start: int, stop: int) -> Iterator[tuple[dict, int, int]]:
        """(shard, a, b) for every saved slice overlapping [start, stop), in order."""
        size = self.slice_size(unit)
        for k in range(start // size, (stop - 1) // size + 1):
            yield self.shard(self._rank_of_slice[k]), max(start, k * size), min(stop, (k + 1) * size)

    def weights(self, unit: str, start: int, stop: int) -> torch.Tensor:
        """Saved 16-bit weights of elements [start, stop) of ``unit`` (stop <= numel)."""
        i = self._unit_index(unit)
        parts = []
        for shard, a, b in self._slices(unit, start, stop):
            sl = shard["slices"][i]
            parts.append(sl["weights"][a - sl["start"] : b - sl["start"]])
        return torch.cat(parts) if parts else torch.empty(0)

    def segment_values(self, unit: str, start: int, stop: int, key: str | None) -> torch.Tensor | Any:
        """Masters (``key`` None) or the optimizer state ``key`` of [start, stop) of a
        trainable parameter of ``unit``; a 0-d state (Adam's step) is returned as is."""
        parts = []
        for shard, a, b in self._slices(unit, start, stop):
            for seg in shard["segments"]:
                if seg["unit"] != unit or seg["stop"] <= a or seg["start"] >= b:
                    continue
                value = seg["master"] if key is None else seg["state"][key]
                if not isinstance(value, torch.Tensor) or value.dim() == 0:
                    return value
                lo, hi = max(a, seg["start"]), min(b, seg["stop"])
                parts.append((lo, value[lo - seg["start"] : hi - seg["start"]]))
        parts.sort(key=lambda x: x[0])
        covered = sum(p.numel() for _, p in parts)
        if covered != stop - start:
            raise CheckpointError(
                f"checkpoint {self.tag_dir} holds {covered} of the {stop - start} elements "
                f"[{start}, {stop}) of unit {unit!r} (a parameter trainable here was frozen there?)"
            )
        return torch.cat([p for _, p in parts])

    def state_keys(self) -> set[str]:
        for seg in self.meta["segments"]:
            return set(seg["state"])
        return set()


def _stamp(shard: dict) -> str:
    return (
        f"save id {shard.get('save_id')}, step {shard['step']}, world size {shard['world_size']}, plan {shard['plan']}"
    )


def saved_pieces(saved_params: list[dict], offsets: list[int], start: int, stop: int) -> Iterator[tuple[int, int, int]]:
    """``(lo, hi, saved_lo)`` for each parameter piece ``[lo, hi)`` inside ``[start, stop)`` of
    this run's flat order (parameters at ``offsets``), with where it starts in the saved one."""
    for p, here in zip(saved_params, offsets):
        lo, hi = max(start, here), min(stop, here + int(torch.Size(p["shape"]).numel()))
        if lo < hi:
            yield lo, hi, p["offset"] + lo - here


def compare_units(saved: list[dict], here: list[dict], where: Path) -> str | None:
    """Why the saved units differ from this model's (None if they match; parameter offsets
    may differ, see the module docstring)."""
    if [u["name"] for u in saved] != [u["name"] for u in here]:
        return (
            f"checkpoint {where} has units {[u['name'] for u in saved][:6]}..., this model "
            f"{[u['name'] for u in here][:6]}... (a different model, ds_ext.zero_topo.units, or in the pipeline form zero_optimization.reduce_bucket_size)"
        )
    strip = lambda u: {**u, "params": [{k: v for k, v in p.items() if k != "offset"} for p in u["params"]]}  # noqa: E731
    for a, b in zip(saved, here):
        if strip(a) != strip(b):
            return f"unit {a['name']!r} of checkpoint {where} has other parameters (names, shapes) than this model's"
    return None


def consolidate(tag_dir: Path) -> dict[str, torch.Tensor]:
    """The full fp32 state dict (every name of tied parameters, one tensor) from a checkpoint's
    shards (:func:`iter_params`)."""
    out: dict[str, torch.Tensor] = {}
    for param in iter_params(open_parts(tag_dir)):
        value = param.load()
        for name in param.names:
            out[name] = value
    return out


@dataclass(frozen=True)
class SavedParam:
    """One parameter of a checkpoint: its names (tied ones share it), its shape, and ``load()``,
    which reads its fp32 value (a new tensor) from the memory-mapped shards."""

    names: list[str]
    shape: list[int]
    load: Callable[[], torch.Tensor]

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


def open_parts(tag_dir: Path) -> list[SavedCheckpoint]:
    """The data-parallel parts of a checkpoint that :func:`iter_params` joins: the checkpoint
    itself, or its pipeline stages (tensor parallel 1: each part holds whole parameters of its own
    layers). A checkpoint of tensor-parallel slices is refused (joining them needs the model's
    partition dimensions), as is one of TED's experts. Rank 0's shard of the first part carries
    what the save recorded of the model (``meta["hf"]``)."""
    if expert_parts(tag_dir):
        raise CheckpointError(
            f"checkpoint {tag_dir} holds MoE experts sharded over expert-data-parallel groups (ds_ext.ted), "
            "which consolidate does not join; allowed: a checkpoint of a dense model"
        )
    parts = model_parallel_parts(tag_dir)
    if not parts:
        return [SavedCheckpoint.open(tag_dir)]
    opened = [SavedCheckpoint.open(part) for part in parts]
    degrees = opened[0].meta.get("model_parallel", {})
    if degrees.get("tensor") != 1:
        raise CheckpointError(
            f"checkpoint {tag_dir} holds the slices of {len(parts)} model-parallel ranks (tensor parallel "
            f"{degrees.get('tensor', 'unrecorded')}), which ds_ext cannot join without the model's partition "
            "dimensions; allowed: a checkpoint saved with tensor parallel 1 (pipeline stages are joined)"
        )
    return opened


def iter_params(parts: list[SavedCheckpoint]) -> Iterator[SavedParam]:
    """Every parameter of the parts :func:`open_parts` opened, in the saved units' order, loaded
    only when asked (:class:`SavedParam`): trainable parameters from the fp32 masters, frozen ones
    from the 16-bit weights. Pipeline stages are joined by name: a weight tied across stages (held
    by each) once, after checking its copies agree (by digest; only such weights are read here)."""
    names = [{n for u in part.meta["units"] for p in u["params"] for n in p["names"]} for part in parts]
    shared = {n for i, mine in enumerate(names) for other in names[i + 1 :] for n in mine & other}
    seen: dict[str, str] = {}  # a name held by several stages -> digest of the value yielded under it
    for stage, part in enumerate(parts):
        for param in _iter_part(part):
            if shared.isdisjoint(param.names):
                yield param
                continue
            value = param.load()
            digest = _digest(value)
            for name in param.names:
                if seen.get(name, digest) != digest:
                    raise CheckpointError(
                        f"checkpoint {part.tag_dir.parent}: {name!r} differs between pipeline stages (a tied "
                        f"weight's copies must agree; stage {stage} holds another value)"
                    )
            new = [n for n in param.names if n not in seen]
            seen.update((n, digest) for n in param.names)
            if new:
                yield SavedParam(new, param.shape, lambda value=value: value)


def _digest(value: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(value.numpy().tobytes()).hexdigest()


def _iter_part(ckpt: SavedCheckpoint) -> Iterator[SavedParam]:
    """:func:`iter_params` of one data-parallel group's shards."""
    ckpt.verify(range(ckpt.meta["world_size"]))
    trainable = {(s["unit"], s["start"]) for r in ckpt._open for s in ckpt._open[r]["segments"]}

    def loader(unit: str, a: int, b: int, shape: list[int], masters: bool) -> Callable[[], torch.Tensor]:
        def load() -> torch.Tensor:  # each a new tensor: the pieces are concatenated out of the shards
            values = ckpt.segment_values(unit, a, b, None) if masters else ckpt.weights(unit, a, b).float()
            return values.reshape(shape)

        return load

    for unit in ckpt.meta["units"]:
        for p in unit["params"]:
            n = int(torch.Size(p["shape"]).numel())
            a, b = p["offset"], p["offset"] + n
            is_trainable = n > 0 and any(u == unit["name"] and a <= s < b for u, s in trainable)
            yield SavedParam(list(p["names"]), list(p["shape"]), loader(unit["name"], a, b, p["shape"], is_trainable))


def describe(tag_dir: Path) -> str:
    """What a checkpoint holds, for ``ds-ext checkpoint inspect``, after verifying that every
    shard is present, readable and of the same save (each model-parallel rank's part in turn)."""
    parts, experts = model_parallel_parts(tag_dir), expert_parts(tag_dir)
    if parts or experts:
        return "\n".join(
            [f"model-parallel part {i} of {len(parts)}:\n{describe(p)}" for i, p in enumerate(parts)]
            + [f"MoE experts, expert-model part {i} of {len(experts)}:\n{describe(p)}" for i, p in enumerate(experts)]
        )
    ckpt = SavedCheckpoint.open(tag_dir)
    ckpt.verify(range(ckpt.meta["world_size"]))
    m = ckpt.meta
    params = sum(int(torch.Size(p["shape"]).numel()) for u in m["units"] for p in u["params"])
    sizes = sum(
        (tag_dir / SHARD_FILE.format(rank=r)).stat().st_size
        for r in range(m["world_size"])
        if (tag_dir / SHARD_FILE.format(rank=r)).is_file()
    )
    levels = " x ".join(f"{n}={s}" for n, s in m["topology"]["levels"])
    lines = [
        f"checkpoint {tag_dir}",
        f"  format      {m['format']}, step {m['step']}, dtype {m['dtype']}, save id {m.get('save_id')}",
        f"  world       {m['world_size']} ranks, topology {m['topology']['name']}: {levels}",
        f"  plan        {m['plan']}",
        f"  model       {params:,} parameters in {len(m['units'])} units",
        f"  optimizer   {m['optimizer']['class']}, {len(m['optimizer']['param_groups'])} param groups, "
        f"{m['optimizer_shards']} optimizer shards, state {sorted(ckpt.state_keys())}",
        f"  loss scaler {m['loss_scaler']}",
        f"  shard files {m['world_size']} x {SHARD_FILE.format(rank=0).replace('00000', 'NNNNN')}, "
        f"{sizes / 1e6:.2f} MB in all, every one verified",
    ]
    return "\n".join(lines)


def staging_dir(save_dir: Path, tag: str) -> Path:
    return save_dir / f".{tag}.partial"


def publish(save_dir: Path, tag: str, save_latest: bool) -> None:
    """Rank 0, after every rank's files are in the staging directory: make it ``tag``
    (keeping the old one under ``.<tag>.old`` until the new one is in place), then
    write ``latest``."""
    final, staged, old = save_dir / tag, staging_dir(save_dir, tag), save_dir / f".{tag}.old"
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(staged, final)
    _fsync_dir(save_dir)
    if old.exists():
        shutil.rmtree(old)
    if save_latest:
        atomic_write_text(save_dir / LATEST, tag)
