"""Communication-aware activation checkpointing (CAC, 001 §7.3.2) and routing replay.

Activation checkpointing runs a TED layer's forward twice: once in the forward pass and
again (the *recompute*) in the backward pass. Without CAC the recompute repeats the
layer's forward collectives (the TP all-reduces ❷/❻, the all-to-alls ❹/❼ and the DTD
all-gathers), "six all-to-all and six all-reduce communication calls" per layer in all.
With CAC each layer records the outputs of those collectives in its first forward and
the recompute returns them instead of communicating: 4 + 4 calls. The backward
collectives still run.

Independently of CAC, a TED MoE layer always records its *routing decisions* (expert and
slot of every token, the capacity, noise draws): a recompute that re-routed differently
(noisy gates, a dropless capacity agreed by a collective) would mix a different dispatch
with the first forward's saved tensors.

Mechanics, per layer, a :class:`Tape` of :class:`Frame` s (one per first forward):

* a forward runs in *replay* mode while autograd's engine executes it (the recompute of
  ``torch.utils.checkpoint``, reentrant or not, or ``deepspeed.checkpointing``): it pops
  the oldest frame and reads values back in the order they were recorded;
* it runs in *record* mode when called from inside one of those checkpoint functions
  (the first forward of a checkpointed layer), Megatron's ``CheckpointFunction`` included;
* otherwise (no checkpointing, evaluation) it records nothing.

A replayed value must have the kind and shape that was recorded, else the replay raises.

Stash (what CAC keeps between the first forward and the recompute, per layer, ``Tape.stash_bytes``):
every forward collective's output (``cac_stash: full``), or, ``lean`` (the default), all but the
all-to-all outputs that only feed DTD's tensor all-gather: the recompute replays the gathered tensor, so
such an all-to-all replays a zero-stride placeholder of its shape and the calls are the same.
A checkpointed forward whose backward never runs leaves a stale frame: ``ds_ext.initialize``
clears every tape at each ``engine.forward``; code that drives TED layers by hand calls
:func:`clear_tapes` between such a forward and the next training step.
"""

from __future__ import annotations

import sys
from collections import deque
from typing import Any, Callable, Iterable

import torch

from ds_ext.errors import DsExtError
from ds_ext.integration.ds_moe import checkpoint_function_codes, is_megatron_checkpoint

_CHECKPOINT_CODES = checkpoint_function_codes()


class ReplayError(DsExtError, RuntimeError):
    """An activation-checkpoint recompute that does not repeat its layer's first forward (other
    values or shapes asked for, or no first forward recorded: a checkpoint function ds_ext does not
    recognise, or a tape cleared in between)."""


def in_recompute() -> bool:
    """True while autograd's engine runs this code: an activation-checkpoint recompute."""
    return torch._C._current_graph_task_id() != -1


def inside_checkpoint() -> bool:
    """True when called (at any depth) from an activation-checkpoint function."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _CHECKPOINT_CODES or is_megatron_checkpoint(frame.f_code):
            return True
        frame = frame.f_back
    return False


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.device)
    return type(value)


class Frame:
    """The values one forward of one layer records (record mode) or reads back (replay)."""

    def __init__(self, owner: str, mode: str, cac: bool) -> None:
        self.owner = owner
        self.mode = mode  # "plain" | "record" | "replay"
        self.cac = cac
        self.stash_bytes = 0  # bytes of the collective outputs this frame holds for the recompute
        self._items: deque[tuple[str, Any, Any]] = deque()

    def _value(self, kind: str, compute: Callable[[], Any], keep: bool = True) -> Any:
        if self.mode == "replay":
            if not self._items:
                raise ReplayError(
                    f"{self.owner}: the recompute asks for {kind!r} but its first forward recorded nothing more"
                )
            got_kind, sig, value = self._items.popleft()
            if got_kind != kind:
                raise ReplayError(
                    f"{self.owner}: the recompute asks for {kind!r} where the first forward recorded {got_kind!r}"
                )
            return value, sig
        value = compute()
        if self.mode == "record":
            stored = (value.detach() if keep else None) if isinstance(value, torch.Tensor) else value
            self._items.append((kind, _signature(value), stored))
        return value, None

    def decision(self, kind: str, compute: Callable[[], Any]) -> Any:
        """A routing decision: computed in the first forward, replayed in the recompute."""
        return self._value(kind, compute)[0]

    def collective(
        self, kind: str, run: Callable[[], torch.Tensor], like: torch.Size, stash: bool = True
    ) -> torch.Tensor:
        """A forward collective's output; with CAC the recompute returns the recorded one.

        ``like``: the output shape the caller expects (checked against the record).
        ``stash=False``: the output only feeds a collective whose output is stashed (lean
        stash, module docstring); the recompute gets a zero-stride placeholder of its shape.
        """
        if not self.cac:
            return run()
        value, sig = self._value(kind, run, keep=stash)
        if sig is None:  # first forward
            if self.mode == "record" and stash:
                self.stash_bytes += value.numel() * value.element_size()
            return value
        if sig[0] != tuple(like):
            raise ReplayError(
                f"{self.owner}: recompute of {kind} expects shape {tuple(like)}, the first forward recorded {sig[0]}"
            )
        return torch.zeros((), dtype=sig[1], device=sig[2]).expand(like) if value is None else value


class Tape:
    """The frames of one layer, oldest first (see module docstring)."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._frames: deque[Frame] = deque()

    def frame(self, cac: bool) -> Frame:
        """The frame for the forward that is starting now."""
        if in_recompute():
            if not self._frames:
                raise ReplayError(
                    f"{self.owner}: recomputed by activation checkpointing, but its first forward did not run "
                    "inside torch.utils.checkpoint / deepspeed.checkpointing (or the tape was cleared in between)"
                )
            frame = self._frames.popleft()
            frame.mode = "replay"
            return frame
        if inside_checkpoint():
            frame = Frame(self.owner, "record", cac)
            self._frames.append(frame)
            return frame
        return Frame(self.owner, "plain", cac)

    def clear(self) -> None:
        self._frames.clear()

    def stash_bytes(self) -> int:
        """Bytes of collective outputs held now for recomputes (CAC's memory cost, 001 §7.3.2)."""
        return sum(f.stash_bytes for f in self._frames)

    def __len__(self) -> int:
        return len(self._frames)


def clear_tapes(modules: Iterable[torch.nn.Module]) -> None:
    """Drop every recorded frame of the TED layers among ``modules`` (``model.modules()``)."""
    for m in modules:
        tape = getattr(m, "ted_tape", None)
        if isinstance(tape, Tape):
            tape.clear()
