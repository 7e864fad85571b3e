"""No full model per rank: build on the meta device, materialise only this rank's shards.

AxoNN's 4D hybrid parallelism (001 ch. 5, 000 §V) stores each layer as
serial / (G_x G_y G_z) per rank; slicing a serial model built in full on every rank would
need the whole model in every rank's memory first (a 70B fine-tune could not start).

* :func:`build_on_meta` runs the model's constructor with every parameter on the meta device
  and each parameter's initialisation recorded (:mod:`ds_ext.pmm.init_replay`), or, given
  ``checkpoint=``, each parameter bound to its tensor in a full serial state dict on disk
  (:class:`~ds_ext.pmm.full_checkpoint.FullCheckpoint`: safetensors files or a ``torch.save``'d
  dict). Buffers stay real.
* :func:`ds_ext.pmm.parallelize` (or ``ds_ext.initialize`` with ``pmm3d``) then converts one
  module at a time: its full serial parameters are materialised (:func:`serial_values`: the
  recorded init replayed under the recorded generator states, or read from the file), this
  rank's shard is cut and the full tensors are dropped. Peak memory per rank: its shards plus
  about one parameter.

The shards equal slicing the serial model built on CPU under the same seed, bit for bit
(``tests/test_pmm_meta.py``), and the global generator ends where the serial build leaves it.
A checkpoint build runs no initialisation (the generator does not advance).
"""

from __future__ import annotations

import contextlib
import ctypes
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from ds_ext.pmm.full_checkpoint import FullCheckpoint, bind
from ds_ext.pmm.init_replay import InitRecorder, MetaBuildError, NoInitSkips

try:
    _LIBC = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc: its allocator keeps what it keeps
    _LIBC = None

__all__ = ["build_on_meta", "materialize", "serial_values"]


def build_on_meta(factory: Callable[[], nn.Module], *, checkpoint: str | Path | None = None) -> nn.Module:
    """``factory()`` (e.g. ``lambda: GPT(cfg)``, ``lambda: LlamaForCausalLM(config)``) with its
    parameters on the meta device, each carrying how to materialise its serial value: the
    recorded initialisation (seed the global generator as for the serial build), or with
    ``checkpoint`` its tensor in that full serial state dict (see
    :class:`~ds_ext.pmm.full_checkpoint.FullCheckpoint`).
    Hand the result to :func:`ds_ext.pmm.parallelize` / ``ds_ext.initialize`` (001 ch. 5)."""
    recorder = InitRecorder(record=checkpoint is None)
    guard = NoInitSkips() if checkpoint is None else contextlib.nullcontext()
    with recorder, recorder.parameters_on_meta(), guard:
        model = factory()
    if checkpoint is not None:
        bind(model, FullCheckpoint(checkpoint))
    return model


def full_value(p: nn.Parameter, name: str) -> torch.Tensor:
    """The serial value of meta parameter ``p`` (CPU, ``p``'s dtype)."""
    source = getattr(p, "pmm_init", None)
    if source is None:
        raise MetaBuildError(
            f"ds_ext.pmm: {name} is on the meta device with no recorded initialisation or checkpoint "
            "tensor; build the model with ds_ext.pmm.build_on_meta(lambda: Model(...)[, checkpoint=])"
        )
    full = source.full(name)
    if tuple(full.shape) != tuple(p.shape):
        raise MetaBuildError(f"ds_ext.pmm: {name} was built with shape {list(full.shape)}, is now {list(p.shape)}")
    return full.to(p.dtype)


@contextlib.contextmanager
def serial_values(module: nn.Module, prefix: str) -> Iterator[None]:
    """While open, ``module``'s own meta parameters hold their full serial values (then the meta
    ones return): what a conversion slices, one module at a time."""
    saved = {n: p for n, p in module._parameters.items() if p is not None and p.is_meta}
    for n, p in saved.items():
        module._parameters[n] = nn.Parameter(full_value(p, f"{prefix}.{n}" if prefix else n), p.requires_grad)
    try:
        yield
    finally:
        module._parameters.update(saved)
        if saved:
            _release_freed()


def _release_freed() -> None:
    """Hand the freed full tensors back to the OS now (glibc keeps blocks below 32 MiB in its heap,
    where the shards cut next would fragment them and the next parameter would grow the heap)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def materialize(model: nn.Module) -> nn.Module:
    """The whole serial model from a :func:`build_on_meta` one, in place (ties kept): for one
    rank that needs it all (a reference, an export); ranks of a grid use ``parallelize``."""
    done: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id -> (meta, real): the meta one kept alive
    for prefix, m in model.named_modules(remove_duplicate=False):
        for n, p in list(m._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in done:
                    done[id(p)] = (p, nn.Parameter(full_value(p, f"{prefix}.{n}" if prefix else n), p.requires_grad))
                m._parameters[n] = done[id(p)][1]
    return model
