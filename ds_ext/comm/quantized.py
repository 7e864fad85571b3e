"""Quantized collectives: int8 all-gather (qwZ) and all-to-all reduce-scatter (qgZ).

ZeRO++ (qwZ / qgZ) as reused by 003 §V: weights travel block-quantized in int8 and
gradients in int4 through an all-to-all, so each value is quantized once per hop
instead of once per ring step. Every message is a payload tensor plus an fp32 scale
tensor, each recorded in the ledger with its true wire bytes.

Chunk order: inputs and outputs are in *group-rank order* (chunk j belongs to group
rank j); callers convert from / to their shard order (``ds_ext.zero_topo.layout``).
All chunks must be whole quantization blocks.

Raw blocks (DeepSpeed's qgZ never quantizes 1-D tensors): the reductions take an optional
per-block mask; masked blocks travel unquantized in a given dtype, appended to the payload
message of their destination (same two calls, uneven splits), and are summed as sent.
"""

from __future__ import annotations

import torch

from ds_ext.comm.collectives import Communicator, Handle
from ds_ext.comm.quant import BlockQuantizer, QuantizedTensor


class Pending:
    """Two in-flight collectives (payload, scales) finished by a local decode."""

    def __init__(self, handles: list[Handle | None], finish) -> None:
        self._handles = handles
        self._finish = finish
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            for h in self._handles:
                if h is not None:
                    h.wait()
            self._result = self._finish()
        return self._result


def _gathered(comm: Communicator, q: QuantizedTensor, group, async_op: bool):
    d = comm.size(group)
    payload = torch.empty(q.payload.numel() * d, dtype=q.payload.dtype, device=q.payload.device)
    scales = torch.empty(q.scales.numel() * d, dtype=torch.float32, device=q.scales.device)
    hs = [
        comm.all_gather(payload, q.payload, group=group, async_op=async_op),
        comm.all_gather(scales, q.scales, group=group, async_op=async_op),
    ]
    whole = QuantizedTensor(payload, scales, q.bits, q.numel * d, q.block_size)
    return hs, whole


def all_gather_quantized(
    comm: Communicator,
    q: QuantizedTensor,
    quantizer: BlockQuantizer,
    out: torch.Tensor,
    group=None,
    async_op: bool = False,
) -> Pending:
    """All-gather an already quantized chunk; ``wait()`` decodes into ``out`` (group order)."""
    if q.numel % q.block_size:
        raise ValueError(f"quantized all-gather needs whole blocks: {q.numel} % {q.block_size}")
    hs, whole = _gathered(comm, q, group, async_op)
    pending = Pending(hs, lambda: quantizer.dequantize(whole, dtype=out.dtype, out=out.view(-1)))
    if not async_op:
        pending.wait()
    return pending


def all_gather_int(
    comm: Communicator,
    chunk: torch.Tensor,
    quantizer: BlockQuantizer,
    out: torch.Tensor,
    group=None,
    async_op: bool = False,
) -> Pending:
    """Quantize ``chunk`` and all-gather it (qwZ); ``wait()`` decodes into ``out``."""
    return all_gather_quantized(comm, quantizer.quantize(chunk), quantizer, out, group, async_op)


def all_to_all_reduce(
    comm: Communicator,
    chunks: torch.Tensor,
    quantizer: BlockQuantizer,
    group=None,
    raw: torch.Tensor | None = None,
    raw_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One-hop quantized reduce-scatter: returns the fp32 sum of every rank's chunk for me.

    ``chunks``: 1-D, ``d`` equal chunks in group-rank order (chunk j goes to group rank j).
    ``raw``: optional bool per block of ``chunks``: those blocks travel as ``raw_dtype``
    values instead of codes (module docstring). The sum runs over group ranks in order.
    Non-finite input (an fp16 overflow) is not encoded: its blocks arrive flagged and sum
    to NaN (``ds_ext.comm.quant.NONFINITE``), so the receivers see the overflow too.
    """
    d = comm.size(group)
    if raw is None or not bool(raw.any()):
        return all_to_all_reduce_async(comm, chunks, quantizer, group).wait()
    B = quantizer.block_size
    blocks = chunks.view(-1, B)
    raw = raw.view(d, -1)
    me = comm.registry.group_rank(group)
    n_raw, n_q = raw.sum(1).tolist(), (~raw).sum(1).tolist()
    q = quantizer.quantize(blocks[~raw.view(-1)], nonfinite="flag")
    code_bytes = B * quantizer.bits // 8
    codes = q.payload.view(torch.uint8)  # int8 codes ride as bytes beside the raw values' bytes
    values = blocks[raw.view(-1)].to(raw_dtype).contiguous().view(torch.uint8).view(-1)
    value_bytes = B * torch.finfo(raw_dtype).bits // 8
    parts, qi, ri = [], 0, 0
    for j in range(d):
        parts.append(codes[qi * code_bytes : (qi + n_q[j]) * code_bytes])
        parts.append(values[ri * value_bytes : (ri + n_raw[j]) * value_bytes])
        qi, ri = qi + n_q[j], ri + n_raw[j]
    sizes = [n_q[j] * code_bytes + n_raw[j] * value_bytes for j in range(d)]
    recv = torch.empty(d * sizes[me], dtype=torch.uint8, device=chunks.device)
    comm.all_to_all(recv, torch.cat(parts), [sizes[me]] * d, sizes, group=group)
    out = torch.empty(d, raw.shape[1], B, dtype=torch.float32, device=chunks.device)
    recv = recv.view(d, sizes[me])
    if sum(n_q):  # a unit made of raw blocks only sends no scales
        scales = torch.empty(d * n_q[me], dtype=torch.float32, device=chunks.device)
        comm.all_to_all(scales, q.scales, [n_q[me]] * d, n_q, group=group)
        got = recv[:, : n_q[me] * code_bytes].reshape(-1).view(q.payload.dtype)
        decoded = quantizer.dequantize(QuantizedTensor(got, scales, q.bits, d * n_q[me] * B, B))
        out[:, ~raw[me]] = decoded.view(d, n_q[me], B)
    sent = recv[:, n_q[me] * code_bytes :].reshape(-1).view(raw_dtype)
    out[:, raw[me]] = sent.view(d, n_raw[me], B).float()
    return out.sum(0).view(-1)


def all_to_all_reduce_async(comm: Communicator, chunks: torch.Tensor, quantizer: BlockQuantizer, group=None) -> Pending:
    """:func:`all_to_all_reduce` without raw blocks, in flight: ``wait()`` returns the fp32 sum."""
    d = comm.size(group)
    q = quantizer.quantize(chunks, nonfinite="flag")
    payload = torch.empty_like(q.payload)
    scales = torch.empty_like(q.scales)
    hs = [
        comm.all_to_all(payload.view(d, -1), q.payload.view(d, -1), group=group, async_op=True),
        comm.all_to_all(scales.view(d, -1), q.scales.view(d, -1), group=group, async_op=True),
    ]
    recv = QuantizedTensor(payload, scales, q.bits, q.numel, q.block_size)
    return Pending(hs, lambda: quantizer.dequantize(recv, dtype=torch.float32).view(d, -1).sum(0))


def all_to_all_reduce_2hop(
    comm: Communicator,
    chunks: torch.Tensor,
    quantizer: BlockQuantizer,
    intra_group,
    inter_group,
    raw: torch.Tensor | None = None,
    raw_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Two-hop quantized reduce-scatter (ZeRO++ qgZ): inside the node, then across nodes.

    ``chunks`` is laid out ``[p, n, c]`` (p: intra-group rank, n: inter-group rank, c: a
    chunk) so that the P-way first hop sends each intra peer the N chunks of the ranks it
    represents on the other nodes; the partial sums are requantized and the N-way second
    hop carries only 1/P of the data across nodes. ``raw`` (per block, same layout): blocks
    that travel as ``raw_dtype`` values on both hops.
    """
    partial = all_to_all_reduce(comm, chunks, quantizer, intra_group, raw, raw_dtype)  # [n * c] fp32
    if raw is not None:
        raw = raw.view(comm.size(intra_group), -1)[comm.registry.group_rank(intra_group)]
    return all_to_all_reduce(comm, partial, quantizer, inter_group, raw, raw_dtype)
