"""Vocabulary-parallel embedding tables and cross-entropy for 3D-PMM (point 6).

The table of an embedding (and of the LM head, tied to it or not) is laid out like the
weight of a *normal* :class:`~ds_ext.pmm.linear.Linear` with n = V rows (vocabulary) and
k = d in-features (001 Algorithm 3): on rank g(x=i, y=j, z=k) the block ``W[vocab block i,
feature block j]`` (``[V/G_x, d/G_y]``), flattened and cut into G_z chunks, of which chunk k
is stored. So a rank holds V d / (G_x G_y G_z) of each table instead of V d / G_y, and the
head's matmul is split over X instead of repeated on every X rank. This is Megatron-LM's
``VocabParallelEmbedding`` / ``vocab_parallel_cross_entropy`` (vocabulary over the tensor
axis, X here) with AxoNN's Z sharding of the stored weight on top.

Sharding contract of :class:`Embedding` (lookup of ids ``[...]``):

======================  ==================================================================
weight Ŵ (stored)       ``[(V/G_x)(d/G_y)/G_z]``, chunk k of ``W[vocab block i, feature block j]``
ALL-GATHER_z            Ŵ -> W_{j,i} ``[V/G_x, d/G_y]`` (line 2 of Algorithm 3)
lookup                  rows of ids inside vocab block i; ids outside give zeros
ALL-REDUCE_x            ``[..., d/G_y]``: the residual stream (feature block j over Y,
                        replicated over X); backward passes the replicated gradient through
REDUCE-SCATTER_z        dL/dŴ: the block's gradient (rows scattered by id) summed over the Z
                        shares of the batch rows, chunk k kept (line 14)
======================  ==================================================================

The head is an ordinary normal ``Linear`` ``d -> V`` without bias (sharing the Embedding's
parameter when tied): logits ``[..., V/G_x]``, vocab block i over X, replicated over Y.
:func:`vocab_cross_entropy` takes those logits and the global target ids: the row maximum
(ALL-REDUCE max over X) and the target logit and the sum of exponentials (one ALL-REDUCE
sum over X of both) give each row's loss, replicated over X; backward is
``softmax - onehot`` on the local vocab block, with no collective.

``ds_ext.pmm3d.tables`` "replicated" places the tables the other way (Megatron-LM's position
embedding, and megatron-core TP's anchor in ``ds-ext bench pmm``): rows whole on every X rank
(``Linear`` with ``split_out=False``: stored ``[V (d/G_y) / G_z]``, chunk k of ``W[:, feature
block j]``). Then every lookup finds its id locally and the X ranks' outputs agree (no
ALL-REDUCE_x); the head's logits are ``[..., V]`` (ALL-REDUCE_y of the partial sums when
G_y > 1), its input gradient is complete (no line 12) and the cross-entropy needs no
collective. X ranks see the same rows, so the table's gradients agree over X as well.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ds_ext.pmm.engine import PMMEngine
from ds_ext.pmm.grid import Axis
from ds_ext.pmm.layout import ConversionError
from ds_ext.pmm.linear import Linear


def _vocab_block(layer: Linear, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids relative to this rank's vocab block, clamped into it; mask of ids inside it)."""
    rows = layer.layout.n_local
    local = ids - layer.out_axis.rank * rows
    inside = (local >= 0) & (local < rows)
    return torch.where(inside, local, torch.zeros_like(local)), inside


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, layer: "Embedding", grad_pass: bool):
        eng = layer.engine
        w = layer.gathered_weight(weight, grad_pass)  # [V/G_x, d/G_y]
        local, inside = _vocab_block(layer, ids)
        out = F.embedding(local, w) * inside.unsqueeze(-1).to(w.dtype)
        eng.all_reduce(out, layer.out_axis, layer.name)
        ctx.save_for_backward(local, inside)
        ctx.layer, ctx.dtype = layer, w.dtype
        ctx.deferred = layer.deferrable(weight)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        local, inside = ctx.saved_tensors
        layer: Embedding = ctx.layer
        lay = layer.layout
        grad = grad_out.reshape(-1, lay.k_local)[inside.reshape(-1)]
        grad_block = grad.new_zeros(lay.n_local, lay.k_local)
        grad_block.index_add_(0, local.reshape(-1)[inside.reshape(-1)], grad)
        grad_w = layer.reduce_gradients(grad_block, ctx.deferred)
        return None, grad_w, None, None


class Embedding(Linear):
    """A vocabulary-parallel ``nn.Embedding`` (see the module docstring for its contract)."""

    @classmethod
    def from_embedding(
        cls, serial: nn.Embedding, engine: PMMEngine, name: str = "embedding", vocab_parallel: bool = True
    ) -> "Embedding":
        """This rank's shard of ``serial``'s table (``vocab_parallel`` False: replicated over X)."""
        if serial.padding_idx is not None or serial.max_norm is not None:
            raise ConversionError(
                f"ds_ext.pmm.parallelize: {name}: padding_idx / max_norm embeddings are not supported"
            )
        table = cls.__new__(cls)
        nn.Module.__init__(table)
        table._setup(serial.weight, None, engine, False, 1, name, split_out=vocab_parallel)
        return table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        eng = self.engine
        out = _Lookup.apply(ids, eng.weight_input(self.weight), self, torch.is_grad_enabled())
        return eng.input_with_gate(out)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        """The tied LM head: logits ``[..., V/G_x]`` (vocab block over X, replicated over Y;
        ``[..., V]`` when the table is replicated over X);
        a model that calls it marks the table ``shared_weight``."""
        return Linear.forward(self, x)


def tied_head(table: Embedding, name: str) -> Linear:
    """An LM head ``d -> V`` whose weight is ``table``'s parameter (Hugging Face's tie_word_embeddings)."""
    head = Linear.__new__(Linear)
    nn.Module.__init__(head)
    head.engine, head.transposed, head.name, head.split_out = table.engine, False, name, table.split_out
    head.in_features, head.out_features = table.in_features, table.out_features
    head.out_axis, head.in_axis, head.layout = table.out_axis, table.in_axis, table.layout
    head.weight, head.bias = table.weight, None
    head.shared_weight = table.shared_weight = True
    return head


class _VocabCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, engine: PMMEngine, x: Axis, ignore_index: int):
        logits = logits.float()
        rows = logits.shape[-1]
        peak = logits.max(-1).values
        engine.all_reduce(peak, x, op=dist.ReduceOp.MAX)
        shifted = logits - peak.unsqueeze(-1)
        local = target - x.rank * rows
        inside = (local >= 0) & (local < rows)
        local = torch.where(inside, local, torch.zeros_like(local))
        exp = shifted.exp()
        both = torch.stack([shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * inside, exp.sum(-1)])
        engine.all_reduce(both, x)
        valid = target != ignore_index
        loss = torch.where(valid, both[1].log() - both[0], torch.zeros_like(both[0]))
        ctx.save_for_backward(exp.div_(both[1].unsqueeze(-1)), local, inside & valid, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local, hit, valid = ctx.saved_tensors
        grad = softmax.scatter_add(-1, local.unsqueeze(-1), -hit.to(softmax.dtype).unsqueeze(-1))
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad, None, None, None, None


def vocab_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, engine: PMMEngine, ignore_index: int = -100, axis: Axis | None = None
) -> torch.Tensor:
    """Per-row cross-entropy (fp32) of vocab-split ``logits`` ``[N, V/G_x]`` against global
    ``target`` ids ``[N]``; rows whose target is ``ignore_index`` give 0. ``axis``: the one the
    vocabulary is split over, the head's ``out_axis`` (default X; size one: whole logits)."""
    axis = engine.x if axis is None else axis
    flat = logits.reshape(-1, logits.shape[-1])
    return _VocabCrossEntropy.apply(flat, target.reshape(-1), engine, axis, ignore_index)


def causal_lm_loss(engine: PMMEngine, axis: Axis | None = None):
    """Hugging Face's ``ForCausalLMLoss`` (shift, ignore_index, ``num_items_in_batch``) on
    vocab-split logits (split over ``axis``, the head's ``out_axis``); installed as a converted
    model's ``_loss_function``."""

    def loss(
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int,
        num_items_in_batch: Any = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        shift_labels = shift_labels.to(logits.device)
        per_row = vocab_cross_entropy(logits, shift_labels, engine, ignore_index, axis)
        if num_items_in_batch is None:
            return per_row.sum() / (shift_labels != ignore_index).sum()
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(per_row.device)
        return per_row.sum() / num_items_in_batch

    return loss
