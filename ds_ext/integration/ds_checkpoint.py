"""DeepSpeed's checkpoint engine as the asynchronous save captures it (read in DeepSpeed 0.19.8).

Every file ``DeepSpeedEngine.save_checkpoint`` writes (the module and engine state, a
PipelineModule's layer files, MoE expert files, ZeRO's optimizer files) goes through
``engine.checkpoint_engine.save(state_dict, path)`` (runtime/engine.py ``_save_checkpoint``,
``_save_moe_checkpoint``, ``_save_zero_checkpoint``; runtime/pipe/module.py ``save_state_dict``),
and ``latest`` is written only when ``commit`` succeeds and ``save_latest`` is true. For the
duration of one save :func:`capture` puts a :class:`SnapshotCheckpointEngine` there: ``save``
copies the state into host memory and records it with its path, and nothing is written. The
caller writes the snapshot later (``ds_ext.zero_topo.plugin``'s background writer).

Why not DeepSpeed's own ``DecoupledCheckpointEngine`` (``checkpoint.writer.decoupled``): it
hands the live tensors to a writer process (CUDA IPC or shared memory, not a copy) and so must
finish writing before the next optimizer step changes them (``engine.step`` calls
``_commit_decoupled_checkpoint``, which blocks until the writer is done); it writes ``latest``
itself at that commit, outside ds_ext's staging directory and agreement; and it needs the
``checkpoint.writer`` section with DeepSpeed's fast file writer. The snapshot lets training run
on for the whole write and keeps ``latest`` last in ds_ext's atomic protocol.
"""

from __future__ import annotations

import contextlib
import copy
from collections import OrderedDict
from typing import Any, Iterator

import torch

from ds_ext.integration.ds_version import check_version

check_version()


def host_copy(obj: Any, copy_host_tensors: bool = True) -> Any:
    """``obj`` with every tensor copied into host memory (containers rebuilt, other values
    deep-copied): a snapshot that training can no longer change. ``copy_host_tensors`` False: a
    tensor already in host memory is taken as it is (one the caller has just cloned)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=copy_host_tensors)
    if isinstance(obj, dict):
        out = OrderedDict() if isinstance(obj, OrderedDict) else {}
        out.update((k, host_copy(v, copy_host_tensors)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):  # a module state dict's versions (nn.Module.load_state_dict reads them)
            out._metadata = copy.deepcopy(obj._metadata)  # type: ignore[attr-defined]
        return out
    if type(obj) in (list, tuple):
        return type(obj)(host_copy(v, copy_host_tensors) for v in obj)
    return copy.deepcopy(obj)


def _engine_class():
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    class SnapshotCheckpointEngine(CheckpointEngine):
        """Records ``(path, host copy of the state)`` per ``save``; writes nothing."""

        def __init__(self, loader) -> None:
            super().__init__(None)
            self.name = "ds_ext.SnapshotCheckpointEngine"
            self.files: list[tuple[str, Any]] = []
            self._loader = loader

        def create(self, info) -> None:
            pass

        def save(self, state_dict, path: str) -> None:
            self.files.append((str(path), host_copy(state_dict)))

        def load(self, path: str, map_location=None):
            return self._loader.load(path, map_location=map_location)

        def commit(self, info) -> bool:
            return True

        def preserves_storage_sharing(self) -> bool:
            return False  # host_copy already copies each view alone (DeepSpeed need not clone first)

    return SnapshotCheckpointEngine


def writer_section(ds_config: dict) -> Any:
    """DeepSpeed's ``checkpoint.writer`` section of a ds_config (None when absent)."""
    return (ds_config.get("checkpoint") or {}).get("writer")


@contextlib.contextmanager
def capture(engine) -> Iterator[list[tuple[str, Any]]]:
    """Within the block, ``engine``'s checkpoint engine snapshots instead of writing; yields
    the list of ``(path, host state)`` it fills."""
    original = engine.checkpoint_engine
    snapshot = _engine_class()(original)
    engine.checkpoint_engine = snapshot
    try:
        yield snapshot.files
    finally:
        engine.checkpoint_engine = original
