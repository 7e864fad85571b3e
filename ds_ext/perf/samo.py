"""Analytic model of SAMO (001 ch. 4): model-state memory (Eq. 4.1-4.5, Fig. 4.2), the compressed
all-reduce (§4.2.1) and the pipeline / data split the memory saved allows (§4.2.2, Eq. 4.6-4.11).

Notation (001 §4.1.4, §4.2.2): φ parameters before pruning, p the pruned fraction, f = 1 - p,
k = fφ kept entries, G GPUs = G_inter x G_data, B batch size, mbs micro-batch size, t_f / t_b the
forward / backward compute time of one micro-batch through the whole model.

Memory (bytes; mixed precision with Adam, 16-bit weights)::

    M^default = (2 + 2 + 4 + 4 + 8) φ = 20 φ                                         (θ16, ∇θ16, θ32, ∇θ32, os)
    M^SAMO    = 18 k + 4 k + 2 φ + 2 k                                               (Eq. 4.1)
              = 24 f φ + 2 φ = 20 φ - (24 p - 6) φ                                    (Eq. 4.2-4.5)

(18 k: compressed ∇θ16, θ32, ∇θ32, os; 4 k: the int32 index; 2 φ: the dense θ16; 2 k: the step's
temporary compressed 16-bit copy of θ32.) :func:`model_state_bytes` is Eq. 4.1 for what
:mod:`ds_ext.samo` holds exactly: ``indexed`` <= k entries carry an index (a parameter without a
mask is kept whole with none) and ``weight_bytes`` w is the training dtype's size; in fp32 training
(w = 4) ∇θ32 is the 32-bit gradient itself and the copy is θ32 itself, so both terms vanish:
``w φ + (w + 4 + 8) k + 4 indexed + [w != 4] (4 + w) k``.

With the tiled optimizer (001 §7.2, ``ds_ext.samo.tiled``) the step's two temporaries are a tile's:
∇θ32 becomes the tile buffer, 4 ts bytes (``ts`` = tile_size, also in fp32 training, where the
untiled step's ∇θ32 is ∇θ16 itself), and the 16-bit copy of θ32 one tile's, w min(ts, k_max) with
k_max the longest compressed master (0 in fp32): :func:`tiled_model_state_bytes`; under ZeRO-1 the
chunk's buffer already holds the copies and only ∇θ32 changes, under ZeRO-1 and ZeRO-2
(:func:`tiled_shard_bytes`).

All-reduce (§4.2.1; ledger convention 2 S (d - 1) / d per rank, ``ds_ext.comm.ledger``): SAMO sends
S = w k, dense training S = w φ; the indices never travel. ZeRO-1 reduce-scatters and all-gathers
the padded S = w d s once per step (s = ceil(k / d)), the same sum. ZeRO-2
(:func:`zero2_reduction_bytes`) reduce-scatters it once per micro-batch, bucket by bucket during
backward: GA x ZeRO-1's reduce-scatter bytes, S (d - 1) / d each, (1 - p) of dense ZeRO-2's; the
all-gather stays once per step.

ZeRO-2 memory (:func:`zero2_model_state_bytes`, ``ds_ext.samo.zero2``): Eq. 4.1 with the
gradients term 2 k / d (the rank's shard of ∇θ16, w s) plus the bucket buffers, 3 x w d m <= w B
(m = min(s, max(1, B // 3 d)), B = ``reduce_bucket_size`` elements, DeepSpeed's one bucket), in
place of ZeRO-1's whole flat buffer (w d s).

Pipeline (§4.2.2): t_bubble = (t_f + t_b)(1 - 1 / G_inter) (Eq. 4.7), increasing in G_inter
(Eq. 4.8); each GPU sends and receives 4 B / (mbs G_data) messages (Eq. 4.9), = 4 (B / mbs)
G_inter / G (Eq. 4.10), increasing in G_inter too (Eq. 4.11). :func:`choose_split` takes the
smallest G_inter whose per-stage model state fits the device (the layers split evenly).
"""

from __future__ import annotations

from dataclasses import dataclass

from ds_ext.comm.ledger import all_gather_bytes, all_reduce_bytes, reduce_scatter_bytes

DEFAULT_BYTES_PER_PARAMETER = 20  # 2 + 2 + 4 + 4 + 8 (001 §4.1.4)
INDEX_BYTES = 4  # int32 (001 §4.1.2)
OPEN_BUCKETS = 3  # ZeRO-2's bucket buffers, reduce_bucket_size elements together (ds_ext.samo.zero2)


def default_model_state_bytes(phi: int) -> int:
    """M^default = 20 φ: mixed-precision Adam without SAMO (001 §4.1.4)."""
    return DEFAULT_BYTES_PER_PARAMETER * phi


def model_state_bytes(phi: int, kept: int, indexed: int | None = None, weight_bytes: int = 2) -> int:
    """M^SAMO, Eq. 4.1 (module docstring): ``phi`` elements, ``kept`` of them kept, ``indexed``
    (default ``kept``) of those with an index entry, weights in ``weight_bytes``-byte elements."""
    indexed = kept if indexed is None else indexed
    w = weight_bytes
    upcast = 0 if w == 4 else (4 + w) * kept  # ∇θ32 and the temporary 16-bit copy of θ32
    return w * phi + (w + 4 + 8) * kept + INDEX_BYTES * indexed + upcast


def sharded_model_state_bytes(phi: int, kept: int, indexed: int, weight_bytes: int, shards: int, rank: int) -> int:
    """Eq. 4.1 under ZeRO-1 (``ds_ext.samo.optimizer``) on data-parallel ``rank`` of ``shards``:
    θ16 dense (w φ), the flat ∇θ16 padded to ``shards`` chunks of s = ceil(k / shards) (w s shards),
    the rank's chunk of ∇θ16, reused for its 16-bit copy (w s), its fp32 gradient in 16-bit
    training (4 s), θ32 and os over the k_r kept entries the chunk holds (12 k_r), the indices."""
    w, s = weight_bytes, -(-kept // shards)
    own = min(max(kept - rank * s, 0), s)
    upcast = 0 if w == 4 else 4 * s
    return w * phi + w * s * shards + w * s + upcast + (4 + 8) * own + INDEX_BYTES * indexed


def bucket_piece(kept: int, shards: int, bucket_size: int) -> int:
    """m: each rank's piece of a full ZeRO-2 bucket, min(s, max(1, B // (3 d))): the ``OPEN_BUCKETS``
    buffers of d m entries hold B = ``bucket_size`` elements together (``ds_ext.samo.zero2``)."""
    return min(-(-kept // shards), max(1, bucket_size // (OPEN_BUCKETS * shards)))


def zero2_model_state_bytes(
    phi: int, kept: int, indexed: int, weight_bytes: int, shards: int, rank: int, bucket_size: int
) -> int:
    """Eq. 4.1 under ZeRO-2 (``ds_ext.samo.zero2``) on data-parallel ``rank`` of ``shards`` with
    ``reduce_bucket_size`` ``bucket_size``: θ16 dense (w φ), the rank's shard of ∇θ16 of s = ceil(k / d)
    entries, reused for its 16-bit copy (w s, the gradients term 2 k / d), the bucket buffers
    (``OPEN_BUCKETS`` x w d m <= w B),
    its fp32 gradient in 16-bit training (4 s), θ32 and os over the k_r kept entries the rank owns
    (12 k_r; the padding, fewer than d entries, is in the last bucket), the indices."""
    w, d, s = weight_bytes, shards, -(-kept // shards)
    m = bucket_piece(kept, d, bucket_size)
    count = -(-s // m)
    last, start = s - (count - 1) * m, (count - 1) * d * m
    own = (count - 1) * m + min(max(kept - start - rank * last, 0), last)
    upcast = 0 if w == 4 else 4 * s
    return w * phi + w * s + OPEN_BUCKETS * w * d * m + upcast + (4 + 8) * own + INDEX_BYTES * indexed


def zero2_reduction_bytes(elements: int, weight_bytes: int, data_parallel: int, accumulation: int) -> float:
    """Bytes one rank sends per step under ZeRO-2 for ``elements`` gradients (SAMO: the padded d s,
    dense: φ): a reduce-scatter per micro-batch (``accumulation`` of them) and one all-gather of the
    rank's 1 / d of the updated weights."""
    nbytes, d = elements * weight_bytes, data_parallel
    return accumulation * reduce_scatter_bytes(nbytes, d) + all_gather_bytes(nbytes / d, d)


def tiled_model_state_bytes(phi: int, kept: int, indexed: int, weight_bytes: int, tile_size: int, largest: int) -> int:
    """Eq. 4.1 with the step in tiles of ``tile_size`` (module docstring): ∇θ32 the 4 ts tile buffer,
    the 16-bit copy of θ32 w min(ts, ``largest``), ``largest`` the longest compressed master."""
    w = weight_bytes
    copy = 0 if w == 4 else w * min(tile_size, largest)
    return w * phi + (w + 4 + 8) * kept + INDEX_BYTES * indexed + 4 * tile_size + copy


def tiled_shard_bytes(untiled: int, kept: int, weight_bytes: int, shards: int, tile_size: int) -> int:
    """A sharded step's bytes (``untiled``: :func:`sharded_model_state_bytes` under ZeRO-1,
    :func:`zero2_model_state_bytes` under ZeRO-2) with the step in tiles of ``tile_size``: the shard's
    fp32 gradient (4 s in 16-bit training, s = ceil(k / d)) becomes the 4 ts tile buffer; the shard's
    16-bit buffer, w s, stays."""
    s = -(-kept // shards)
    upcast = 0 if weight_bytes == 4 else 4 * s
    return untiled - upcast + 4 * tile_size


def model_state_bytes_at(phi: int, p: float) -> float:
    """M^SAMO = 24 (1 - p) φ + 2 φ (Eq. 4.3) for uniform pruning of a fraction ``p``."""
    return 24 * (1 - p) * phi + 2 * phi


def memory_saved(p: float) -> float:
    """The fraction of M^default SAMO saves, (24 p - 6) / 20 (Eq. 4.5, Fig. 4.2): 0 at p = 0.25,
    0.66 at 0.8, 0.78 at 0.9."""
    return (24 * p - 6) / DEFAULT_BYTES_PER_PARAMETER


def allreduce_bytes(elements: int, weight_bytes: int, data_parallel: int) -> float:
    """Bytes one rank sends all-reducing ``elements`` gradients of ``weight_bytes`` over
    ``data_parallel`` ranks (§4.2.1: ``elements`` = k with SAMO, φ dense)."""
    return all_reduce_bytes(elements * weight_bytes, data_parallel)


def bubble_time(t_f: float, t_b: float, g_inter: int) -> float:
    """t_bubble = (t_f + t_b)(1 - 1 / G_inter) (Eq. 4.7)."""
    return (t_f + t_b) * (1 - 1 / g_inter)


def messages_per_gpu(batch: int, micro_batch: int, g_data: int) -> float:
    """Messages each GPU sends and receives in one batch, 4 B / (mbs G_data) (Eq. 4.9)."""
    return 4 * batch / (micro_batch * g_data)


@dataclass(frozen=True)
class Split:
    """A G_inter x G_data layout (§4.2.2) with its per-GPU model state and Eq. 4.7 / 4.9 terms."""

    inter: int
    data: int
    state_bytes_per_gpu: float
    bubble_fraction: float  # t_bubble / (t_f + t_b), Eq. 4.7
    messages_per_gpu: float  # Eq. 4.9


def choose_split(
    phi: int, p: float | None, gpus: int, device_bytes: float, batch: int, micro_batch: int
) -> Split | None:
    """The layout §4.2.2 argues for: the smallest G_inter dividing ``gpus`` whose stage's model
    state (M / G_inter, layers split evenly) fits ``device_bytes``, the rest data parallelism;
    ``p`` None = dense training (M^default), else SAMO at sparsity ``p``. None if no G_inter fits."""
    total = default_model_state_bytes(phi) if p is None else model_state_bytes_at(phi, p)
    for inter in range(1, gpus + 1):
        if gpus % inter or total / inter > device_bytes:
            continue
        data = gpus // inter
        return Split(inter, data, total / inter, 1 - 1 / inter, messages_per_gpu(batch, micro_batch, data))
    return None
