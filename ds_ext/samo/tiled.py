"""SAMO's compressed step in the tiled optimizer's tiles (001 §4.1.3 with §7.2).

``"ds_ext": {"samo": {"enabled": true}, "tiled_optimizer": {"enabled": true, "tile_size": ts}}``:
steps 3-5 of :mod:`ds_ext.samo.optimizer` run over each compressed fp32 master θ32 in tiles of at
most ``ts`` entries, through the tiled optimizer's one reused fp32 buffer
(:class:`ds_ext.optim.tiled.TiledAdam`, 4 ts bytes), so ∇θ32 (4 k bytes) never exists whole:

1. load: the tile of ∇θ16 up-cast into the buffer, divided by ``s`` and multiplied by ``c`` with the
   untiled step's kernels and scalars (elementwise: the same bits);
2. Adam on the tile of θ32 and os (TiledAdam: torch's arithmetic on slices, the same bits as the
   wrapped optimizer's own step);
3. store: without ZeRO-1, the tile's 16-bit copy (§4.1.3's temporary, now w ts bytes at most) is
   expanded through the tile's slice of the index into θ16 (the parameter's pruned entries written
   as zero at its first tile); under ZeRO-1 the tile is written into the chunk's buffer over its
   gradient, which the load has consumed, and the chunk is all-gathered after the last tile.

The global norm, the overflow skip and ``c`` are decided before the first tile, from the
training-dtype buffer as the untiled step decides them (:func:`ds_ext.samo.optimizer.squared_norm`).
The step's peak is sampled at its last tile of the largest size (from the second step on every
master's moments exist then): what :func:`ds_ext.perf.samo.tiled_model_state_bytes` predicts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ds_ext.optim.tiled import TiledAdam
from ds_ext.samo.index import expand_range

if TYPE_CHECKING:
    from ds_ext.samo.optimizer import SamoOptimizer


class TiledSamoStep:
    """Steps 3-5 of ``opt`` (a :class:`~ds_ext.samo.optimizer.SamoOptimizer`) in tiles of ``tile_size``."""

    def __init__(self, opt: SamoOptimizer, tile_size: int) -> None:
        self.opt = opt
        self.adam = TiledAdam(opt.inner, tile_size)
        self._piece = {id(m): i for i, m in enumerate(opt.masters)}
        self._owner = [] if opt.sharded else [e for e in opt.grads.entries if e.kept]  # master i's parameter

    @property
    def largest_tile(self) -> int:
        """Entries of the step's largest tile: min(tile_size, the longest master)."""
        return min(self.adam.tile_size, max((m.numel() for m in self.opt.masters), default=0))

    def step(self, local: torch.Tensor, scale: float, clip: float | None) -> None:
        """Steps 3-5 on ``local`` (∇θ16: the flat buffer, or the ZeRO-1 chunk), ``scale`` s, ``clip`` c or None."""
        o, n = self.opt, self.largest_tile
        order = [(g, m) for g in o.inner.param_groups for m in g["params"]]
        last = max((j for j, (_, m) in enumerate(order) if m.numel() >= n), default=-1)
        for j, (group, master) in enumerate(order):
            i = self._piece[id(master)]
            peak = (master.numel() // n - 1) * n if j == last else -1  # the start of the step's peak tile
            held: list[torch.Tensor] = []

            def load(buf: torch.Tensor, s: int, start: int = o.pieces[i][0], held: list = held) -> None:
                buf.copy_(local[start + s : start + s + buf.numel()])
                if scale != 1.0:
                    buf.div_(scale)
                if clip is not None:
                    buf.mul_(clip)
                held[:] = [buf]

            self.adam.update(master, group, load, self._store(i, master, peak, held))
        if o.sharded:
            o.gather_shards()
        self.adam.end_step()

    def _store(self, i: int, master: torch.Tensor, peak: int, held: list[torch.Tensor]):
        """The store of master ``i``'s tiles (module docstring, 3); the tile at ``peak`` samples the bytes held."""
        o = self.opt
        if o.sharded:
            start = o.pieces[i][0]

            def store(s: int, e: int) -> None:
                o.shard[start + s : start + e].copy_(master[s:e])
                if s == peak:
                    o._sample_bytes(held[0], [o.shard])

            return store
        entry = self._owner[i]

        def store(s: int, e: int) -> None:
            if s == 0 and entry.index is not None:
                entry.param.data.zero_()  # the pruned entries, as expand writes them
            copy = master[s:e].to(o.dtype)  # the tile's temporary 16-bit θ32 (§4.1.3)
            if s == peak:
                o._sample_bytes(held[0], [copy])
            expand_range(copy, entry.index, entry.param.data, s)

        return store
