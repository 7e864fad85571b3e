"""SAMO under ZeRO-2: the compressed 16-bit gradients sharded too, reduced in buckets during
backward (001 §4.1.3, §4.2.1).

Notation as :mod:`ds_ext.samo.optimizer`: k kept entries, d data-parallel ranks, s = ceil(k / d),
w the training dtype's bytes. The flat layout of :mod:`ds_ext.samo.state` (each parameter's k_i
compressed entries at its offset, model order, padded to d s) is cut into buckets of d m entries,
m = min(s, max(1, B // 3 d)) with B = ``zero_optimization.reduce_bucket_size`` (elements, as
DeepSpeed reads it: the three bucket buffers hold B together, DeepSpeed's one bucket), the last bucket d m_last with m_last = s - (nb - 1) m. Within bucket j rank
r owns the r-th of its d equal pieces, so one bucket is one equal reduce-scatter and rank r's
shard, the concatenation of its pieces, has s entries as under ZeRO-1.

Backward (DeepSpeed's ZeRO-2 in spirit, ``reduce_bucket_size``; the reduction is synchronous,
in the hook): each parameter's compressed gradient is added into a bucket buffer (three of d m
entries, ``OPEN_BUCKETS``: a layer's bias, registered before its weight by torch's pruning, reaches
its hook first and may straddle two buckets while the one above waits for the weight), the
buckets it spans taken from its end down (backward runs in reverse model order). A bucket is
reduced as soon as every entry of it has arrived; when a fourth bucket must open, the oldest open
one is reduced as it is (partial: the sum is linear, it costs one more reduce-scatter), and the
step reduces what is still open (a parameter that got no gradient). Every rank runs the same
hooks in the same order, so the collectives match. To reduce a bucket,
rank r adds its accumulated piece to chunk r of the bucket and reduce-scatters the bucket into
that piece, so the shard accumulates the micro-batches' sums and the full-size flat buffer
never exists. The reduction carries w d s bytes of compressed gradients per micro-batch, GA x
ZeRO-1's one reduce-scatter per step (what ZeRO-2 does), (1 - p) of dense. At the step the shard
is divided by d and stepped as under ZeRO-1; the stepped masters' 16-bit copy is written into
the shard and each bucket is all-gathered through the first bucket buffer and written into θ16 (the
kept entries only: θ16's pruned entries stay the zeros written at the start).
"""

from __future__ import annotations

import torch
from torch import nn

from ds_ext.comm import Communicator
from ds_ext.perf.samo import OPEN_BUCKETS, bucket_piece
from ds_ext.samo.index import expand_range
from ds_ext.samo.optimizer import SamoOptimizer
from ds_ext.samo.state import CompressedGradients, Entry


class BucketedGradients(CompressedGradients):
    """Rank ``rank``'s shard of the compressed ∇θ16 and the bucket buffers it is reduced through
    (module docstring); ``bucket_size`` is ``reduce_bucket_size`` in elements."""

    def __init__(
        self,
        params: list[nn.Parameter],
        masks: dict[nn.Parameter, torch.Tensor],
        dtype: torch.dtype,
        comm: Communicator,
        group: object,
        bucket_size: int,
    ) -> None:
        self.comm, self.group, self.bucket_size = comm, group, bucket_size
        self.rank = torch.distributed.get_rank(group)
        self.open: dict[int, int] = {}  # bucket -> the buffer row holding it, in the order they opened
        self.filled: dict[int, int] = {}  # bucket -> entries written since it opened
        super().__init__(params, masks, dtype, comm.size(group))

    def _allocate(self, shards: int) -> None:
        self.d, s = shards, self.shard_size
        self.m = bucket_piece(self.kept, shards, self.bucket_size)  # each rank's piece of a full bucket
        self.count = -(-s // self.m)
        self.shard = torch.zeros(s, dtype=self.dtype, device=self.device)
        self.bucket = torch.zeros(OPEN_BUCKETS, shards * self.m, dtype=self.dtype, device=self.device)

    def piece(self, j: int) -> int:
        """m_j: each rank's piece of bucket ``j``."""
        return min(self.m, self.shard_size - j * self.m)

    def span(self, j: int) -> tuple[int, int]:
        """Bucket ``j``'s flat range, padding included."""
        start = j * self.d * self.m
        return start, start + self.d * self.piece(j)

    def buffers(self) -> list[torch.Tensor]:
        return [self.shard, self.bucket]

    def owned(self, rank: int) -> list[tuple[int, int, int]]:
        out = []
        for j in range(self.count):
            start, m_j = self.span(j)[0] + rank * self.piece(j), self.piece(j)
            out.append((start, start + m_j, j * self.m))
        return out

    def _add(self, entry: Entry, values: torch.Tensor) -> None:
        if not entry.kept:  # a parameter pruned whole: no entry, no bucket
            return
        size = self.d * self.m
        for j in range((entry.end - 1) // size, entry.offset // size - 1, -1):
            if j not in self.open:
                if len(self.open) == OPEN_BUCKETS:
                    self.flush(next(iter(self.open)))  # the oldest, partial: reduced as it is
                self.open[j] = min(set(range(OPEN_BUCKETS)) - set(self.open.values()))
                self.filled[j] = 0
            start, stop = self.span(j)
            lo, hi = max(entry.offset, start), min(entry.end, stop)
            self.bucket[self.open[j], lo - start : hi - start].add_(values[lo - entry.offset : hi - entry.offset])
            self.filled[j] += hi - lo
            if self.filled[j] == min(stop, self.kept) - start:  # every entry of the bucket has arrived
                self.flush(j)

    def flush(self, j: int) -> None:
        """Reduce open bucket ``j`` into the shard (module docstring)."""
        row, m_j = self.open.pop(j), self.piece(j)
        del self.filled[j]
        bucket, mine = self.bucket[row, : self.d * m_j], self.shard[j * self.m : j * self.m + m_j]
        bucket[self.rank * m_j : (self.rank + 1) * m_j].add_(mine)
        self.comm.reduce_scatter(mine, bucket, group=self.group)
        bucket.zero_()

    def flush_all(self) -> None:
        """Reduce the buckets still open (partial: a parameter that got no gradient), oldest first."""
        for j in list(self.open):
            self.flush(j)


class BucketedSamoOptimizer(SamoOptimizer):
    """:class:`~ds_ext.samo.optimizer.SamoOptimizer` over a :class:`BucketedGradients`' shard: the
    reduction happened in backward, the expansion goes bucket by bucket (module docstring)."""

    grads: BucketedGradients
    zero_stage = 2

    def _shard_buffer(self) -> torch.Tensor:
        return self.grads.shard

    def _reduce(self) -> torch.Tensor:
        self.grads.flush_all()
        self.shard.div_(self.data_size)
        return self.shard

    def gather_shards(self) -> None:
        """The shard's 16-bit copy all-gathered bucket by bucket through the first bucket buffer and
        written into θ16's kept entries (module docstring)."""
        g = self.grads
        entries, i = g.entries, 0
        for j in range(g.count):
            start, stop = g.span(j)
            bucket, m_j = g.bucket[0, : stop - start], g.piece(j)
            self.comm.all_gather(bucket, self.shard[j * g.m : j * g.m + m_j], group=self.data_group)
            while i < len(entries) and entries[i].offset < stop:
                e = entries[i]
                lo, hi = max(e.offset, start), min(e.end, stop)
                expand_range(bucket[lo - start : hi - start], e.index, e.param.data, lo - e.offset)
                if e.end > stop:  # continues in the next bucket
                    break
                i += 1
        g.bucket.zero_()

    def _clear(self) -> None:
        self.shard.zero_()
