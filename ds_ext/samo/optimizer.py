"""SAMO's optimizer step on the compressed states and the expansion (001 §4.1.3, §4.2.1).

Notation (001 §4.1): θ16 the dense weights in the training dtype, ∇θ16 / ∇θ32 the compressed
gradients in the training dtype / fp32, θ32 the compressed fp32 master weights, os the
optimizer's state (Adam's two moments), ``ind`` the shared 1-D indices, ``d`` the data-parallel
degree, ``s`` the fp16 loss scale, ``c`` the clip coefficient. Per optimizer step:

1. all-reduce the flat compressed ∇θ16 over the data-parallel group (§4.2.1: the collective
   carries the ``k`` kept entries, (1 - p) of the dense bytes, and no index) and divide by ``d``
   (DeepSpeed's gradient averaging);
2. the global norm of ∇θ16 / ``s`` (pruned entries are zero, so it is the dense norm; summed over
   the pipeline stages), taken from the training-dtype buffer in fixed blocks (:func:`squared_norm`,
   whatever runs the step next, so the tiled step's clip coefficient is the same bits), the fp16
   overflow skip and DeepSpeed's loss-scale update, ``c = clip / (norm + 1e-6)`` where ``c < 1``
   (DeepSpeed's and torch's rule);
3. up-cast: ∇θ32 = fp32 copy of ∇θ16 (in fp32 training the same tensor), divided by ``s``,
   clipped by ``c``;
4. the wrapped torch optimizer steps on θ32 (its param groups hold the compressed masters, so
   os is compressed too: it is created on them);
5. down-cast and expand: a temporary compressed copy of θ32 in the training dtype (001 §4.1.3,
   the 2fφ of Eq. 4.1), expanded by ``ind`` into θ16, whose pruned entries are written as zero.

With ``ds_ext.tiled_optimizer`` (001 §7.2) the plugin sets :attr:`SamoOptimizer.tiled`, and steps 3-5
run tile by tile instead (:class:`ds_ext.samo.tiled.TiledSamoStep`).

:meth:`SamoOptimizer.state_bytes` measures every tensor SAMO holds at the step's peak (after 5's
copies exist), each storage once: what :func:`ds_ext.perf.samo.model_state_bytes` predicts.

ZeRO-1 (``zero_optimization.stage`` 1, compressed optimizer shards): the flat ∇θ16 (padded to d
equal chunks, :mod:`ds_ext.samo.state`) is reduce-scattered instead of all-reduced (the same bytes),
data-parallel rank r keeps chunk r; ∇θ32, θ32 and os exist for that chunk only (one piece per
parameter the chunk overlaps), the squared norm is summed over the data group too, and after the
step the chunk's 16-bit copy is all-gathered into the flat buffer and expanded into θ16 from there.
ZeRO-2 (:mod:`ds_ext.samo.zero2`) overrides where the rank's chunk comes from (:meth:`_reduce`),
how its 16-bit copy reaches θ16 (:meth:`gather_shards`) and its zeroing (:meth:`_clear`); the rest
of the step, tiled or not, is this.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Protocol

import torch

from ds_ext.comm import Communicator
from ds_ext.errors import DsExtConfigError
from ds_ext.samo.config import KEY
from ds_ext.samo.index import compress, expand
from ds_ext.samo.state import CompressedGradients

# entries per block of the norm (step 2): a tile-size-independent unit, so the tiled and untiled steps
# sum the same partial norms; a 16-bit block is up-cast to fp32 (4 MiB) at most once at a time
NORM_BLOCK = 1 << 20

STATE_KINDS = ("weights", "gradients", "gradients_fp32", "masters", "optimizer", "indices", "copies")


def held_bytes(groups: dict[str, Iterable[torch.Tensor]]) -> dict[str, int]:
    """Bytes of the storages behind each group of tensors, each storage counted once (in the first
    group that holds it)."""
    seen: set[int] = set()
    out = {}
    for name, tensors in groups.items():
        n = 0
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                n += storage.nbytes()
        out[name] = n
    return out


def squared_norm(flat: torch.Tensor) -> torch.Tensor:
    """The squared 2-norm of ``flat`` in fp64: each block of ``NORM_BLOCK`` entries' norm in fp32,
    squared and summed in fp64, in order (the same bits whether the step then runs tiled or not)."""
    blocks = range(0, max(flat.numel(), 1), NORM_BLOCK)
    norms = [torch.linalg.vector_norm(flat[s : s + NORM_BLOCK], dtype=torch.float32) for s in blocks]
    return torch.stack(norms).double().square().sum()


class TiledStep(Protocol):
    """Steps 3-5 run in tiles (:class:`ds_ext.samo.tiled.TiledSamoStep`)."""

    def step(self, local: torch.Tensor, scale: float, clip: float | None) -> None: ...


class SamoOptimizer(torch.optim.Optimizer):
    """The compressed step (module docstring) around a torch optimizer whose params become the
    compressed fp32 masters. ``inner`` keeps its class, hyper-parameters and param groups (LR
    schedulers built on it keep working). ``scaler`` is DeepSpeed's own loss scaler
    (``ds_engine.loss_scaler``); ``data_group`` the data-parallel group (None: one rank);
    ``model_group`` the pipeline stages' group the norm sums over (None: one stage); ``shard``:
    ZeRO-1 over ``data_group`` (module docstring)."""

    def __init__(
        self,
        grads: CompressedGradients,
        inner: torch.optim.Optimizer,
        comm: Communicator,
        clip: float,
        scaler: Any,
        data_group: object | None,
        model_group: object | None,
        shard: bool = False,
    ) -> None:
        self.grads, self.inner, self.comm = grads, inner, comm
        self.clip, self.scaler = clip, scaler
        self.data_group, self.model_group = data_group, model_group
        self.data_size = comm.size(data_group) if data_group is not None else 1
        self.dtype = grads.dtype
        self.overflow = False
        self._global_grad_norm = 0.0
        self.peak_bytes: dict[str, int] = {}
        self.tiled: TiledStep | None = None  # set by the plugin beside ds_ext.tiled_optimizer
        group_of = {id(p): i for i, g in enumerate(inner.param_groups) for p in g["params"]}
        trained = {id(e.param) for e in grads.entries}
        stray = [i for pid, i in group_of.items() if pid not in trained]
        if stray:
            raise DsExtConfigError(
                f"{KEY}: param group {stray[0]} of the optimizer holds a tensor that is no trainable parameter of the "
                "model; allowed: an optimizer over the model's trainable parameters"
            )
        self.sharded = shard and data_group is not None
        self.rank = torch.distributed.get_rank(data_group) if self.sharded else 0
        self.shard = self._shard_buffer() if self.sharded else None
        ranges = grads.owned(self.rank)  # this rank's ranges of the flat layout (the whole of it unsharded)
        per_group: list[list[torch.Tensor]] = [[] for _ in inner.param_groups]
        self.pieces: list[tuple[int, int]] = []  # (start, stop) of each master in the rank's shard
        self.masters: list[torch.Tensor] = []
        for entry in grads.entries:
            if id(entry.param) not in group_of:
                raise DsExtConfigError(
                    f"{KEY}: a trainable parameter of shape {tuple(entry.param.shape)} is in none of the optimizer's "
                    "param groups; allowed: an optimizer over every trainable parameter (or freeze it)"
                )
            kept = compress(entry.param.detach(), entry.index)
            for lo, hi, local in ranges:
                start, stop = max(entry.offset, lo), min(entry.end, hi)
                if start >= stop:
                    continue
                master = kept[start - entry.offset : stop - entry.offset].float().clone()
                self.pieces.append((local + start - lo, local + stop - lo))
                self.masters.append(master)
                per_group[group_of[id(entry.param)]].append(master)
        for g, params in zip(inner.param_groups, per_group):
            g["params"] = params
        inner.state.clear()
        with torch.no_grad():
            self._zero_pruned()  # the pruned entries of θ16 are zero from the start

    @property
    def param_groups(self) -> list[dict]:  # type: ignore[override]
        """The wrapped optimizer's groups (over the compressed masters): LR schedulers and DeepSpeed's
        ``get_lr`` read them; a loaded state replaces the list."""
        return self.inner.param_groups

    @property
    def state(self) -> dict:  # type: ignore[override]
        return self.inner.state

    @property
    def defaults(self) -> dict:  # type: ignore[override]
        return self.inner.defaults

    def _expand(self, values: list[torch.Tensor]) -> None:
        for entry, v in zip(self.grads.entries, values, strict=True):
            expand(v, entry.index, entry.param.data)

    def _zero_pruned(self) -> None:
        """θ16's pruned entries written as zero (its kept entries as they are)."""
        self._expand([compress(e.param.detach(), e.index) for e in self.grads.entries])

    zero_stage = 1  # the ZeRO stage a sharded state is refused under (check_checkpointable)

    def check_checkpointable(self) -> None:
        """Refuse, in one line, a checkpoint of the sharded state (ZeRO-1 and 2: not implemented)."""
        if self.sharded:
            raise DsExtConfigError(
                f"{KEY} with zero_optimization.stage {self.zero_stage}: saving or loading the sharded compressed optimizer state is not "
                "implemented; allowed: zero_optimization.stage 0 for checkpoints"
            )

    def _norm(self, local: torch.Tensor, scale: float) -> float:
        """The global 2-norm of the unscaled compressed gradients (``local``: ∇θ16, scaled by
        ``scale``), over every data-parallel shard (ZeRO-1) and pipeline stage."""
        sumsq = (squared_norm(local) / (scale * scale)).reshape(1)
        if self.sharded:
            self.comm.all_reduce(sumsq, group=self.data_group)
        if self.model_group is not None:
            self.comm.all_reduce(sumsq, group=self.model_group)
        value = sumsq.item()
        return math.sqrt(value) if math.isfinite(value) else float("inf")

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise DsExtConfigError(f"{KEY}: step(closure) is not supported; call step() after backward")
        local = self._reduce()
        scale = self.scaler.loss_scale
        norm = self._norm(local, scale)
        self._global_grad_norm = norm
        self.overflow = not math.isfinite(norm)
        self.scaler.update_scale(self.overflow)
        if not self.overflow:
            coef = self.clip / (norm + 1e-6)
            clip = coef if self.clip > 0 and coef < 1.0 else None
            if self.tiled is not None:
                self.tiled.step(local, scale, clip)
            else:
                self._step_whole(local, scale, clip)
        self._clear()

    def _shard_buffer(self) -> torch.Tensor:
        """ZeRO-1: the reduce-scatter's output, this rank's chunk (reused for its 16-bit copy)."""
        return torch.zeros(self.grads.shard_size, dtype=self.dtype, device=self.grads.device)

    def _reduce(self) -> torch.Tensor:
        """∇θ16 summed over the data-parallel group and divided by d: this rank's chunk (ZeRO-1) or the
        whole flat buffer."""
        flat = self.grads.flat
        if self.sharded:
            self.comm.reduce_scatter(self.shard, flat, group=self.data_group)
            self.shard.div_(self.data_size)
            return self.shard
        if self.data_group is not None:
            self.comm.all_reduce(flat, group=self.data_group)
            flat.div_(self.data_size)
        return flat

    def _clear(self) -> None:
        """The accumulated ∇θ16 zeroed for the next step."""
        self.grads.flat.zero_()

    def _step_whole(self, local: torch.Tensor, scale: float, clip: float | None) -> None:
        """Steps 3-5 on the whole buffer (module docstring); ``clip``: c, or None where no clipping applies."""
        g32 = local.float()  # ∇θ32 (the same tensor in fp32 training)
        if scale != 1.0:
            g32.div_(scale)
        if clip is not None:
            g32.mul_(clip)
        for (start, stop), master in zip(self.pieces, self.masters):
            master.grad = g32[start:stop]
        self.inner.step()
        for master in self.masters:
            master.grad = None
        if self.sharded:  # the chunk's 16-bit copy, all-gathered into the flat buffer
            for (start, stop), master in zip(self.pieces, self.masters):
                self.shard[start:stop].copy_(master)
            self._sample_bytes(g32, [self.shard])
            self.gather_shards()
        else:
            copies = [m.to(self.dtype) for m in self.masters]  # the temporary compressed θ16 (§4.1.3)
            self._sample_bytes(g32, copies)
            self._expand(copies)

    def gather_shards(self) -> None:
        """ZeRO-1: the chunks' 16-bit copies (in :attr:`shard`) all-gathered into the flat buffer and
        expanded into θ16."""
        flat = self.grads.flat
        self.comm.all_gather(flat, self.shard, group=self.data_group)
        self._expand([flat[e.offset : e.end] for e in self.grads.entries])

    def _sample_bytes(self, g32: torch.Tensor, copies: list[torch.Tensor]) -> None:
        """Record every tensor SAMO holds now, the step's peak (module docstring)."""
        held = held_bytes(
            {
                "weights": (e.param for e in self.grads.entries),
                "gradients": self.grads.buffers(),
                "gradients_fp32": [g32],
                "masters": self.masters,
                "optimizer": (v for st in self.inner.state.values() for v in st.values() if _is_state_tensor(v)),
                "indices": self.grads.indices(),
                "copies": copies,
            }
        )
        if sum(held.values()) > sum(self.peak_bytes.values()):
            self.peak_bytes = held

    def state_bytes(self) -> dict[str, int]:
        """The bytes per model state at the largest step peak so far (``STATE_KINDS``; a storage
        shared by two states, as ∇θ32 and ∇θ16 in fp32 training, counted once, in the first)."""
        return dict(self.peak_bytes)

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1 without fp16), as DeepSpeed's optimizers report it."""
        return self.scaler.loss_scale

    cur_scale = loss_scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Dense gradients never outlive their backward hook; the compressed ones are zeroed by the step."""
        for entry in self.grads.entries:
            entry.param.grad = None

    def state_dict(self) -> dict:
        """The wrapped optimizer's state (over the compressed masters) and the masters themselves."""
        self.check_checkpointable()
        return {"inner": self.inner.state_dict(), "masters": [m.clone() for m in self.masters]}

    def refresh_fp32_params(self) -> None:
        """The masters from θ16 (DeepSpeed calls this after loading the module alone); θ16's pruned
        entries are written as zero again."""
        self.check_checkpointable()
        with torch.no_grad():
            for entry, master in zip(self.grads.entries, self.masters):
                master.copy_(compress(entry.param.detach(), entry.index))
            self._expand([m.to(self.dtype) for m in self.masters])

    def load_state_dict(self, state_dict: dict, load_optimizer_states: bool = True) -> None:
        """Restore :meth:`state_dict`'s masters and optimizer state and expand the masters into θ16;
        ``load_optimizer_states`` False (DeepSpeed's argument): the masters from the loaded θ16 and
        an empty optimizer state, as DeepSpeed's optimizers do."""
        self.check_checkpointable()
        if set(state_dict) != {"inner", "masters"} or len(state_dict["masters"]) != len(self.masters):
            raise DsExtConfigError(
                f"{KEY}: this optimizer state was not saved by {KEY} for this model; allowed: a checkpoint saved with "
                f"{KEY} enabled on the same model"
            )
        if not load_optimizer_states:
            self.refresh_fp32_params()
            self.inner.state.clear()
            return
        with torch.no_grad():
            self.inner.load_state_dict(state_dict["inner"])
            for master, saved in zip(self.masters, state_dict["masters"]):
                master.copy_(saved)
            self._expand([m.to(self.dtype) for m in self.masters])


def _is_state_tensor(value: Any) -> bool:
    """An optimizer state tensor of the parameter's size (Adam's moments), not a scalar step count."""
    return isinstance(value, torch.Tensor) and value.dim() > 0
