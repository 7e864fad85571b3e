"""ds_ext's GPT after conversion: local attention heads, the tied head and the loss vocabulary-parallel."""

from __future__ import annotations

import torch

from ds_ext.models.gpt import GPT, lm_targets
from ds_ext.pmm.vocab import vocab_cross_entropy


class PMMGPT(GPT):
    """:class:`~ds_ext.models.gpt.GPT` whose tied LM head is :meth:`ds_ext.pmm.vocab.Embedding.attend`
    (logits ``[..., V/G_x]``, or ``[..., V]`` with the tables replicated over X) and whose loss is
    :func:`ds_ext.pmm.vocab.vocab_cross_entropy` over the table's vocabulary axis. With a
    ``loss_mask`` (the Goldfish plugin's) the dropped targets enter that loss as its ignore index,
    before its reductions across the vocabulary axis, and the mean is over the rows kept."""

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed.attend(x)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens``: [batch, seq_len + 1] int64; mean loss over positions 1..seq_len (those kept)."""
        logits = self.logits(tokens[:, :-1])
        targets = lm_targets(tokens, self.loss_mask)
        per_row = vocab_cross_entropy(logits, targets, self.pmm_engine, axis=self.embed.out_axis)
        return per_row.mean() if self.loss_mask is None else per_row.sum() / (targets != -100).sum()


def adapt_gpt(model: GPT, engine) -> None:
    """Each block keeps n_heads / G_x heads (its QKV out-features are split over X); the token
    table is also the head."""
    for block in model.blocks:
        block.n_heads = model.cfg.n_heads // engine.x.size
    model.embed.shared_weight = True  # looked up and attended to (the tied head)
    model.__class__ = PMMGPT
