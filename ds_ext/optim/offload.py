"""Optimizer offload: fp32 masters and optimizer state in host memory, the step on the host in
tiles, overlapped with the copies (001 §3.3.2; DeepSpeed's ``zero_optimization.offload_optimizer``).

Notation (001 §3.3.2): φ = parameters on the device, θ32 = fp32 master weights, s_opt = the
optimizer's state (Adam: m, v), ∇θ16 / θ16 = the 16-bit (or fp32) gradients and weights the
device keeps, ``ts`` = tile size (001's bucket size b_size).

001 §3.3.2 keeps only θ16 and ∇θ16 on the device and moves θ32 and s_opt to the host (20φ -> 4φ
bytes of device memory with Adam in mixed precision). Here the update itself runs on the host, tile
by tile (:class:`HostStep`): for tile i,

1. the device-to-host copy of tile i+1's reduced gradient is issued (into one of two host
   staging tiles) before tile i is updated;
2. tile i's gradient is up-cast into the tiled step's fp32 buffer on the host, unscaled and
   clipped with the same kernels and scalars as the on-device step, and θ32, m, v of the tile are
   updated by :class:`ds_ext.optim.tiled.TiledAdam` (torch's Adam/AdamW arithmetic);
3. the tile's new weights are cast to the training dtype in the other host staging tile and
   the host-to-device copy into the device's weight shard is issued; it runs while tile i+1 is
   updated.

Copies run on a side stream of DeepSpeed's accelerator with events between them; the step
waits for a unit's last host-to-device copy before that unit's weight all-gather (on the device's
current stream), and for every copy before it returns. A *synchronized* accelerator
(``is_synchronized_device()``: DeepSpeed's CPU accelerator, whose device is the host itself) has
no streams: each copy completes when issued, in the same order. ``pin_memory`` (DeepSpeed's key)
page-locks the four staging tiles so that the copies are asynchronous DMA; without it the copies
are synchronous (no overlap) and nothing is page-locked. θ32 and s_opt never cross the bus, so
they stay in ordinary (pageable) host memory.

Device memory of the optimizer: 0 bytes of θ32 and s_opt (12 bytes per trainable parameter of the
optimizer shard with Adam, on the host instead), plus the unit's 16-bit updated slice that the
on-device step also holds. Host memory: 12 bytes per optimizer-shard parameter, the fp32 tile
buffer (4 x ts) and the staging tiles (4 x ts x the training dtype's bytes).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

import torch

from ds_ext.errors import DsExtError

HOST = torch.device("cpu")


class OffloadOrderError(DsExtError, RuntimeError):
    """The tiled step asked for a tile out of the order the copies were issued in (a bug)."""


class OffloadPlacementError(DsExtError, RuntimeError):
    """An offloaded optimizer's state tensor is not where offload keeps it."""


def copies_are_asynchronous() -> bool:
    """Whether DeepSpeed's accelerator copies between device and host asynchronously (streams); on
    a synchronized one (its CPU accelerator: the device is the host) nothing is page-locked."""
    from deepspeed.accelerator import get_accelerator

    return not get_accelerator().is_synchronized_device()


class _Copies:
    """Device <-> host copies on a side stream of DeepSpeed's accelerator (each returns an event),
    or, on a synchronized accelerator, in program order (no event: complete when issued)."""

    def __init__(self, pinned: bool) -> None:
        from deepspeed.accelerator import get_accelerator

        self.acc = get_accelerator()
        self.asynchronous = copies_are_asynchronous()
        self.stream = self.acc.Stream() if self.asynchronous else None
        self.non_blocking = pinned and self.asynchronous

    def after_compute(self) -> None:
        """Later copies start after everything issued so far on the device's current stream."""
        if self.stream is not None:
            self.stream.wait_stream(self.acc.current_stream())

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """``dst.copy_(src)`` on the side stream; the event that marks its completion (None: done)."""
        if self.stream is None:
            dst.copy_(src)
            return None
        with self.acc.stream(self.stream):
            dst.copy_(src, non_blocking=self.non_blocking)
            event = self.acc.Event()
            event.record(self.stream)
        return event

    @staticmethod
    def host_wait(event: Any) -> None:
        """The host waits until the copy of ``event`` is done."""
        if event is not None:
            event.synchronize()

    def device_wait(self, event: Any) -> None:
        """The device's current stream waits (without the host) until the copy of ``event`` is done."""
        if event is not None:
            self.acc.current_stream().wait_event(event)

    def compute_after_copies(self) -> None:
        """Work issued later on the device's current stream starts after every copy issued so far."""
        if self.stream is not None:
            self.acc.current_stream().wait_stream(self.stream)


class OffloadStore:
    """Host memory of an offloaded optimizer: the fp32 masters and the optimizer state it takes in
    custody (:meth:`master`, :meth:`keep`), and the staging tiles of the copies.

    ``pin_memory``: DeepSpeed's ``offload_optimizer.pin_memory``: the staging tiles are page-locked
    through DeepSpeed's accelerator (a no-op on its CPU accelerator, whose device is the host).
    """

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self.copies = _Copies(pin_memory)
        self._held: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()
        self._staging: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}

    def master(self, weights: torch.Tensor) -> torch.Tensor:
        """The fp32 master of the device tensor ``weights``: a new host tensor, held by the store."""
        out = torch.empty(weights.shape, dtype=torch.float32, device=HOST)
        out.copy_(weights)
        return self.keep(out)

    def keep(self, t: torch.Tensor) -> torch.Tensor:
        """Take optimizer state ``t`` in custody: ``t`` itself if it is a host tensor, else a host
        copy (a state created or loaded on the device moves to the host)."""
        if t.device != HOST:
            t = t.to(HOST, copy=True)
        self._held.add(t)
        return t

    def holds(self, t: torch.Tensor) -> bool:
        return any(t is h for h in self._held)

    def staging(self, tile_size: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Four host tiles of ``tile_size`` elements (the step's tile size, or its largest segment
        where that is smaller) of ``dtype``: two for gradients (device -> host), two for weights (host
        -> device); allocated once per (size, dtype), page-locked with ``pin_memory``."""
        key = (tile_size, dtype)
        if key not in self._staging:
            tiles = [torch.empty(tile_size, dtype=dtype, device=HOST) for _ in range(4)]
            if self.pin_memory:
                tiles = [self.copies.acc.pin_memory(t) for t in tiles]
            self._staging[key] = tiles
        return self._staging[key]

    def staging_tiles(self) -> list[torch.Tensor]:
        return [t for tiles in self._staging.values() for t in tiles]

    def check_placement(
        self, states: Iterable[tuple[str, torch.Tensor]], device_buffers: Iterable[torch.Tensor]
    ) -> int:
        """Raise :class:`OffloadPlacementError` naming the first state tensor (``(name, tensor)``)
        that is not a host tensor held by this store, or that shares storage with one of
        ``device_buffers`` (what the device keeps: weights, gradients, gathered buffers); with
        ``pin_memory`` on an asynchronous accelerator, also a staging tile that is not page-locked.
        Returns the number of state tensors checked. On a GPU the device check alone catches any
        state left on the accelerator; on a CPU-only host (the device is the host) custody and
        storage tell offloaded state from state the device-side step would have kept."""
        device_storage = {b.untyped_storage().data_ptr() for b in device_buffers if b.numel()}
        n = 0
        for name, t in states:
            n += 1
            if t.device != HOST:
                raise OffloadPlacementError(f"offloaded optimizer state {name} is on {t.device}, not on the host")
            if not self.holds(t):
                raise OffloadPlacementError(f"offloaded optimizer state {name} is not held by the offload store")
            if t.numel() and t.untyped_storage().data_ptr() in device_storage:
                raise OffloadPlacementError(f"offloaded optimizer state {name} shares storage with a device buffer")
        if self.pin_memory and self.copies.asynchronous:
            unpinned = [t for t in self.staging_tiles() if not t.is_pinned()]
            if unpinned:
                raise OffloadPlacementError(f"{len(unpinned)} offload staging tiles are not page-locked (pin_memory)")
        return n


class HostStep:
    """One offloaded step's copies, tile by tile, in the order :class:`ds_ext.optim.tiled.TiledAdam`
    visits the tiles: segment k of ``sources`` (each a device gradient, of the training dtype) in
    tiles of ``tile_size`` elements. ``scale`` unscales and clips a tile's fp32 gradient in place
    (the on-device step's kernels and scalars)."""

    def __init__(
        self,
        store: OffloadStore,
        sources: list[torch.Tensor],
        tile_size: int,
        scale: Callable[[torch.Tensor], None],
    ) -> None:
        dtypes = {s.dtype for s in sources}
        if len(dtypes) > 1:
            raise OffloadOrderError(f"offloaded gradients of several dtypes {sorted(map(str, dtypes))}")
        self._copies = store.copies
        self._sources = sources
        self._scale = scale
        self._tiles = [
            (k, s, min(s + tile_size, src.numel()))
            for k, src in enumerate(sources)
            for s in range(0, src.numel(), tile_size)
        ]
        dtype = dtypes.pop() if dtypes else torch.float32
        tiles = store.staging(min(tile_size, max((src.numel() for src in sources), default=1)), dtype)
        self._grads, self._weights = tiles[:2], tiles[2:]
        self._to_host: list[Any] = [None, None]  # per gradient staging tile: its copy in flight
        self._to_device: list[Any] = [None, None]  # per weight staging tile: its copy in flight
        self._next = 0  # the tile the next load takes
        self._copies.after_compute()  # the gradients and the weight slices exist on the device
        self._fetch(0)

    def _fetch(self, i: int) -> None:
        """Issue the device-to-host copy of tile i's gradient into staging tile i % 2."""
        if i < len(self._tiles):
            k, s, e = self._tiles[i]
            self._to_host[i % 2] = self._copies.copy(self._grads[i % 2][: e - s], self._sources[k][s:e])

    def load(self, k: int) -> Callable[[torch.Tensor, int], None]:
        """The :data:`ds_ext.optim.tiled.LoadTile` of segment ``k``."""

        def load(buf: torch.Tensor, s: int) -> None:
            i = self._next
            if i >= len(self._tiles) or self._tiles[i][:2] != (k, s) or self._tiles[i][2] - s != buf.numel():
                raise OffloadOrderError(f"offloaded step: tile ({k}, {s}) asked for, tile {i} of the schedule is next")
            self._copies.host_wait(self._to_host[i % 2])
            self._fetch(i + 1)  # the next tile's gradient crosses while this one is updated
            buf.copy_(self._grads[i % 2][: buf.numel()])
            self._scale(buf)
            self._next = i + 1

        return load

    def store(self, master: torch.Tensor, target: torch.Tensor) -> Callable[[int, int], None]:
        """The :data:`ds_ext.optim.tiled.StoreTile` of a segment: ``master`` (host fp32) into ``target``
        (its place in the device's updated weight slice)."""

        def store(s: int, e: int) -> None:
            slot = (self._next - 1) % 2  # the tile just loaded and updated
            self._copies.host_wait(self._to_device[slot])  # its staging tile's previous copy is done
            staged = self._weights[slot][: e - s]
            staged.copy_(master[s:e])
            self._to_device[slot] = self._copies.copy(target[s:e], staged)

        return store

    def weights_ready(self) -> None:
        """The device's current stream waits for every weight tile copied so far (before a unit's
        weight all-gather reads them)."""
        for event in self._to_device:
            self._copies.device_wait(event)

    def finish(self) -> None:
        """Every copy is done before the step returns (the staging tiles are reused next step; the
        device's gradient buffers are reused by the next backward)."""
        if self._next != len(self._tiles):
            raise OffloadOrderError(f"offloaded step: {self._next} of {len(self._tiles)} tiles updated")
        for event in self._to_device + self._to_host:
            self._copies.host_wait(event)
        self._copies.compute_after_copies()
