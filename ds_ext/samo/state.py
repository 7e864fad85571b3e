"""The compressed 16-bit gradients and the backward compression (001 §4.1.1, §4.1.3 "Backward Pass").

Notation (001 §4.1): φ parameters before pruning, ``k`` kept (unpruned) entries over the trained
parameters, ∇θ16 the gradients in the training dtype. Sharding contract: every trainable
parameter θ_i, in model order, owns the slice ``[offset_i, offset_i + k_i)`` of ONE flat 1-D
buffer of ``k = Σ k_i`` elements in the training dtype, which holds its compressed gradient in
the order of its index (:mod:`ds_ext.samo.index`); a parameter without a mask owns ``n_i``
entries (kept whole, no index). The buffer is the same on every data-parallel rank, so the
all-reduce of §4.2.1 is one call on it. With ``shards`` = d (ZeRO-1) it is padded with zeros to
d equal chunks of ``shard_size`` = ceil(k / d) entries, data-parallel rank r owning chunk r
(:meth:`CompressedGradients.owned`). ZeRO-2 (:mod:`ds_ext.samo.zero2`) keeps the layout but holds
no flat buffer: a subclass owns other storage and reduces as backward fills it.

Backward: a post-accumulate-grad hook on each parameter adds the compressed gradient to its
slice as soon as autograd has produced the dense gradient of that parameter and drops the dense
one (``p.grad = None``), so at most one layer's dense gradient exists at a time ("we do this at
the granularity of a layer, and not the entire model"). Gradient accumulation sums the
micro-batches' compressed gradients in the buffer; the step zeroes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ds_ext.samo.index import compress, flat_index


@dataclass(frozen=True)
class Entry:
    """One trained parameter: its shared 1-D index (None: kept whole) and its slice of the flat
    compressed gradient buffer."""

    param: nn.Parameter
    index: torch.Tensor | None
    offset: int
    kept: int

    @property
    def end(self) -> int:
        return self.offset + self.kept


class CompressedGradients:
    """The flat compressed ∇θ16 of ``params`` (module docstring) and the hooks that fill it."""

    def __init__(
        self, params: list[nn.Parameter], masks: dict[nn.Parameter, torch.Tensor], dtype: torch.dtype, shards: int = 1
    ) -> None:
        self.entries: list[Entry] = []
        offset = 0
        for p in params:
            mask = masks.get(p)
            index = None if mask is None else flat_index(mask.to(p.device))
            kept = p.numel() if index is None else index.numel()
            self.entries.append(Entry(p, index, offset, kept))
            offset += kept
        self.device = params[0].device if params else torch.device("cpu")
        self.dtype = dtype
        self.kept = offset  # Σ k_i: the entries every compressed state holds
        self.shard_size = -(-offset // shards)  # ZeRO-1: the buffer padded to ``shards`` equal chunks
        self._allocate(shards)
        for entry in self.entries:
            entry.param.register_post_accumulate_grad_hook(self._compress_hook(entry))

    def _allocate(self, shards: int) -> None:
        self.flat = torch.zeros(self.shard_size * shards, dtype=self.dtype, device=self.device)

    def _add(self, entry: Entry, values: torch.Tensor) -> None:
        """Accumulate ``entry``'s compressed gradient (``entry.kept`` values)."""
        self.flat[entry.offset : entry.end].add_(values)

    def _compress_hook(self, entry: Entry):
        def hook(param: nn.Parameter) -> None:
            with torch.no_grad():
                self._add(entry, compress(param.grad, entry.index))
            param.grad = None

        return hook

    def buffers(self) -> list[torch.Tensor]:
        """The tensors that hold ∇θ16 (the bytes of the ``gradients`` state)."""
        return [self.flat]

    def owned(self, rank: int) -> list[tuple[int, int, int]]:
        """(start, stop, local start) of the flat ranges data-parallel ``rank`` owns and where they lie in
        its shard: chunk ``rank`` of ``shard_size`` entries (without sharding: rank 0, the whole buffer)."""
        lo = rank * self.shard_size
        return [(lo, lo + self.shard_size, 0)]

    @property
    def phi(self) -> int:
        """φ: elements of the trained parameters, pruned ones included."""
        return sum(e.param.numel() for e in self.entries)

    @property
    def indexed(self) -> int:
        """Entries of the shared indices (the kept entries of the parameters that have a mask)."""
        return sum(e.kept for e in self.entries if e.index is not None)

    def indices(self) -> list[torch.Tensor]:
        return [e.index for e in self.entries if e.index is not None]
