"""ZeRO-topo's checkpoint I/O: the engine's ``save_checkpoint`` / ``load_checkpoint`` /
``save_16bit_model`` as sharded, atomic saves (003 §V; DeepSpeed's calls and returns).

:class:`CheckpointIO` writes each rank's shard of every part (the dense parameters over their
data-parallel group, MoE experts over their expert-data group) with the optimizer's
:meth:`~ds_ext.zero_topo.optimizer.ZeroTopoOptimizer.shard_state`, beside DeepSpeed's own files,
by the atomic protocol of :mod:`ds_ext.zero_topo.checkpoint` (staging directory, agreement,
``latest`` last); in the background with ``async_save`` (:mod:`ds_ext.zero_topo.async_save`); on
node-local storage with a partner copy with ``checkpoint_tiers`` (:mod:`ds_ext.zero_topo.tiers`).
A load reads and checks every shard before any state changes, then reshards it onto this run's
plan, world and topology (:meth:`~ds_ext.zero_topo.optimizer.ZeroTopoOptimizer.load_shard_state`).
"""

from __future__ import annotations

import contextlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from ds_ext import log
from ds_ext.models.hf import hf_record
from ds_ext.zero_topo import checkpoint as ckpt
from ds_ext.zero_topo import support
from ds_ext.zero_topo.async_save import BackgroundSave
from ds_ext.zero_topo.data_group import DataGroup
from ds_ext.zero_topo.layout import shard_count, shard_index
from ds_ext.zero_topo.optimizer import ZeroTopoOptimizer
from ds_ext.zero_topo.sharded_model import ShardedModel
from ds_ext.zero_topo.tiers import Tiers
from ds_ext.zero_topo.units import ShardContext


@dataclass
class CheckpointIO:
    """The checkpoint methods of one ZeRO-topo engine (module docstring). ``parts``: (group,
    context) of the dense parameters, then of the experts (if any); ``background``: the writer
    with ``async_save``; ``agreement_group``: its group; ``tiers``: with ``checkpoint_tiers``."""

    runtime: Any  # ds_ext.runtime.Runtime
    engine: Any  # the DeepSpeed engine
    sharded: ShardedModel
    optimizer: ZeroTopoOptimizer
    parts: list[tuple[DataGroup, ShardContext]]
    data: DataGroup
    experts: DataGroup | None
    background: BackgroundSave | None = None
    agreement_group: object | None = None
    tiers: Tiers | None = None

    def save(self, original, save_dir, tag, client_state, save_latest, exclude_frozen_parameters):
        """The atomic save (:mod:`ds_ext.zero_topo.checkpoint`) to ``save_dir`` and, with
        ``checkpoint_tiers``, to the node-local tier (:mod:`ds_ext.zero_topo.tiers`); with
        ``async_save`` every file is snapshot into host memory here and both are written in the
        background (:mod:`ds_ext.zero_topo.async_save`), the local tier first."""
        engine, background = self.engine, self.background
        if background is not None:
            background.wait()  # a second save waits for the first (and raises its failure)
        tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
        local, shared = self.tiers.next_save() if self.tiers is not None else (False, True)
        finish = []
        with self.runtime.ledger.phase("checkpoint"):
            if local:
                finish.append(self._save_local(original, tag, client_state, exclude_frozen_parameters))
            if shared:
                finish.append(
                    self._save_shared(
                        original, Path(save_dir), tag, client_state, save_latest, exclude_frozen_parameters
                    )
                )
            if background is None:
                for step in finish:
                    step()
        if background is not None:
            background.start(lambda: [step() for step in finish])

    def _save_shared(self, original, save_dir: Path, tag: str, client_state, save_latest, exclude_frozen_parameters):
        """The shared directory's save of ``tag``: what must run in step on the training thread now;
        returns what writes and publishes it (in the background with ``async_save``)."""
        from ds_ext.integration import ds_checkpoint  # DeepSpeed is imported on use

        engine, background = self.engine, self.background
        staged = ckpt.staging_dir(save_dir, tag)
        error = None
        if self.runtime.rank == 0:
            try:
                save_dir.mkdir(parents=True, exist_ok=True)
                if staged.exists():
                    shutil.rmtree(staged)  # left by a save that crashed
            except OSError as err:
                error = f"cannot prepare {staged}: {err}"
        ckpt.agree(error, f"saving checkpoint {save_dir / tag}")
        captured = ds_checkpoint.capture(engine) if background is not None else contextlib.nullcontext([])
        with self.sharded.held(self.sharded.all_units), captured as deepspeed_files:
            original(
                str(save_dir),
                staged.name,
                client_state=client_state,
                save_latest=False,
                exclude_frozen_parameters=exclude_frozen_parameters,
            )
        shards = self._shards(staged)  # one part's state at a time on the synchronous path
        if background is None:
            return lambda: self._write_and_publish(shards, save_dir, tag, save_latest, None)
        files = [(path, ds_checkpoint.host_copy(state, False)) for path, state in shards]  # cloned already
        files += [(Path(path), state) for path, state in deepspeed_files]
        group = self.agreement_group
        return lambda: self._write_and_publish(files, save_dir, tag, save_latest, group)

    def _shards(self, staged: Path) -> Iterator[tuple[Path, dict]]:
        """(path, state) of each of this rank's shard files of a save into ``staged``, one part's
        state made at a time (the save's id is agreed now: collective)."""
        engine, save_id = self.engine, ckpt.new_save_id()
        degrees = {axis: self.runtime.parallel.degree(axis) for axis in ("tensor", "pipeline")}
        hf = hf_record(engine.module)
        return (
            (
                folder / ckpt.SHARD_FILE.format(rank=group.rank),
                ckpt.shard_state(ctx, engine.global_steps, save_id, self.optimizer.shard_state(units), degrees, hf),
            )
            for group, ctx, units, folder in self._stores(staged)
        )

    def _save_local(self, original, tag: str, client_state, exclude_frozen_parameters):
        """The local tier's save of ``tag`` (:mod:`ds_ext.zero_topo.tiers`): DeepSpeed's files and the
        shards snapshot now; returns what writes them into the node's directory, copies them to the
        partner node and publishes the save (in the background with ``async_save``)."""
        from ds_ext.integration import ds_checkpoint  # DeepSpeed is imported on use

        tiers, engine = self.tiers, self.engine
        staged = tiers.prepare(tag)
        with self.sharded.held(self.sharded.all_units), ds_checkpoint.capture(engine) as deepspeed_files:
            original(
                str(tiers.local_dir()),
                staged.name,
                client_state=client_state,
                save_latest=False,
                exclude_frozen_parameters=exclude_frozen_parameters,
            )
        root = staged.resolve()
        copy_state = (
            (lambda state: state) if self.background is None else (lambda state: ds_checkpoint.host_copy(state, False))
        )
        files = [(path.relative_to(staged).as_posix(), copy_state(state)) for path, state in self._shards(staged)]
        files += [(Path(p).resolve().relative_to(root).as_posix(), state) for p, state in deepspeed_files]
        step = engine.global_steps
        return lambda: tiers.save(tag, staged, files, step)

    def _write_and_publish(
        self, files: Iterable[tuple[Path, Any]], save_dir: Path, tag: str, save_latest: bool, group: object | None
    ) -> None:
        """Write ``files`` (each atomically), agree, publish (rank 0: the staging directory becomes
        ``tag``, then ``latest``), agree; ``group`` None: on the world, else the writer's group."""
        what, error = f"saving checkpoint {save_dir / tag}", None
        for path, state in files:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                ckpt.atomic_save(state, path)
            except OSError as err:
                error = error or f"cannot write {path}: {err}"
        ckpt.agree(error, what, group)
        if self.runtime.rank == 0:
            try:
                ckpt.publish(save_dir, tag, save_latest)
            except OSError as err:
                error = f"cannot publish {save_dir / tag}: {err}"
        ckpt.agree(error, what, group)

    def load(
        self,
        original,
        load_dir,
        tag,
        load_module_strict,
        load_optimizer_states,
        load_lr_scheduler_states,
        load_module_only,
        custom_load_fn,
    ):
        if self.background is not None:
            self.background.wait()  # the save in flight first (it may be the one to load)
        optimizer_states = load_optimizer_states and not load_module_only
        restore = None
        if self.tiers is not None:
            restore, why = self.tiers.choose(tag, Path(load_dir))
            if restore is None:
                log.warn(f"{support.KEY}.checkpoint_tiers: {why}: loading the newest shared save from {load_dir}")
            else:
                if why:
                    log.warn(f"{support.KEY}.checkpoint_tiers: {why}")
                self.tiers.fill_common(restore)
                load_dir, tag = self.tiers.local_dir(), restore.tag
        if tag is None and not ckpt.agree_present(Path(load_dir) / ckpt.LATEST, f"loading checkpoint from {load_dir}"):
            if self.runtime.rank == 0:
                from deepspeed.utils import logger

                logger.warning(
                    f"{support.KEY}: no '{ckpt.LATEST}' file in {load_dir}: nothing loaded "
                    "(returns (None, None), as DeepSpeed does)"
                )
            return None, None
        with self.runtime.ledger.phase("checkpoint"):
            for _ in range(len(restore.files) + 1 if restore is not None else 1):
                error, loaded, missing = None, None, None
                try:
                    tag_dir = ckpt.resolve_tag_dir(load_dir, tag)
                    loaded = self._read(tag_dir, optimizer_states)
                except ckpt.MissingShardError as err:
                    error, missing = str(err), err.path
                except ckpt.CheckpointError as err:
                    error = str(err)
                # the local tier: fetch the shards the ranks found missing, and read again
                if restore is None or not self.tiers.fill_missing(restore, missing):
                    break
            ckpt.agree(error, f"loading checkpoint from {load_dir}")
            with self.sharded.held(self.sharded.all_units):
                path, client_state = original(
                    load_dir,
                    tag_dir.name,
                    load_module_strict=load_module_strict,
                    load_optimizer_states=load_optimizer_states,
                    load_lr_scheduler_states=load_lr_scheduler_states,
                    load_module_only=load_module_only,
                    custom_load_fn=custom_load_fn,
                )
                with torch.no_grad():
                    self.optimizer.load_shard_state(loaded, optimizer_states)
        return path, client_state

    def _read(self, tag_dir: Path, optimizer_states: bool) -> dict:
        """Everything this rank loads from the checkpoint in ``tag_dir``, checked, nothing changed."""
        ckpt.check_model_parallel(
            tag_dir, self.data.model_size, self.experts.model_size if self.experts is not None else 0
        )
        ckpt.check_zip(tag_dir / ckpt.DEEPSPEED_MODULE_FILE.format(rank=self.data.model_rank))
        parts = [
            self._read_shards(folder, group, ctx, units, optimizer_states)
            for group, ctx, units, folder in self._stores(tag_dir)
        ]
        return {  # the optimizer's param groups and the loss scaler: the dense part's
            **parts[0],
            "primaries": {k: v for part in parts for k, v in part["primaries"].items()},
            "segments": {k: v for part in parts for k, v in part["segments"].items()},
        }

    def _stores(self, tag_dir: Path) -> Iterator[tuple[DataGroup, ShardContext, list, Path]]:
        """(group, context, units, folder) of each part of a checkpoint: the dense parameters' shards
        in their data-parallel group's folder, the MoE experts' in their expert-data group's
        (``ds_ext.zero_topo.checkpoint``); each part is a checkpoint of one group."""
        for group, ctx in self.parts:
            units = [unit for unit in self.sharded.all_units if unit.ctx is ctx]
            dense = ctx is self.sharded.ctx
            folder = (
                ckpt.shard_dir(tag_dir, group.model_rank, group.model_size)
                if dense
                else ckpt.expert_dir(tag_dir, group.model_rank)
            )
            yield group, ctx, units, folder

    def _read_shards(
        self, tag_dir: Path, group: DataGroup, ctx: ShardContext, units: list, optimizer_states: bool
    ) -> dict:
        """Everything this rank takes from one part of the checkpoint (:meth:`_stores`), read and
        checked before any state changes: per unit the primary shard, per segment (by unit name and
        start) master and optimizer state."""
        saved = ckpt.SavedCheckpoint.open(tag_dir)
        # every saved shard is checked by some rank (then ckpt.agree refuses on all of them)
        saved.verify(range(group.rank, saved.meta["world_size"], ctx.topo.world_size))
        why = ckpt.compare_units(saved.meta["units"], ckpt.unit_table(units), tag_dir)
        if why:
            raise ckpt.CheckpointError(why)
        opt, plan, topo, rank = self.optimizer, ctx.plan, ctx.topo, group.rank
        inner = opt.inner
        saved_opt = saved.meta["optimizer"]
        if saved_opt["class"] != type(inner).__name__ or len(saved_opt["param_groups"]) != len(inner.param_groups):
            raise ckpt.CheckpointError(
                f"checkpoint {tag_dir} holds a {saved_opt['class']} with {len(saved_opt['param_groups'])} param "
                f"groups, this run a {type(inner).__name__} with {len(inner.param_groups)}"
            )
        primaries = {}
        n_w = shard_count(topo, plan.weights)
        for unit in units:
            size = unit.U // n_w
            start = shard_index(topo, rank, plan.weights) * size
            values = torch.zeros(size, dtype=unit.primary.dtype)
            for lo, hi, at in ckpt.saved_pieces(saved.units[unit.name]["params"], unit.offsets, start, start + size):
                values[lo - start : hi - start] = saved.weights(unit.name, at, at + hi - lo)
            primaries[unit.name] = values
        segments = {}
        if optimizer_states:
            keys = saved.state_keys()
            for unit, lo, hi, master in opt.segments:
                if unit.ctx is not ctx:
                    continue
                a, _ = opt.own_range(unit)
                ((_, _, at),) = ckpt.saved_pieces(saved.units[unit.name]["params"], unit.offsets, a + lo, a + hi)
                state = {k: saved.segment_values(unit.name, at, at + hi - lo, k) for k in keys}
                segments[unit.name, lo] = (saved.segment_values(unit.name, at, at + hi - lo, None), state)
        return {
            "primaries": primaries,
            "segments": segments,
            "groups": saved_opt["param_groups"],
            "scaler": saved.meta["loss_scaler"],
        }

    def save_16bit_model(self, original, save_dir, save_filename, exclude_frozen_parameters):
        with self.runtime.ledger.phase("checkpoint"), self.sharded.held(self.sharded.all_units):
            return original(save_dir, save_filename, exclude_frozen_parameters=exclude_frozen_parameters)
