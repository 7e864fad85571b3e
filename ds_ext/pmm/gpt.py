"""ds_ext's GPT after conversion: local attention heads and the tied head on the Y-split stream."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ds_ext.models.gpt import GPT


class PMMGPT(GPT):
    """:class:`~ds_ext.models.gpt.GPT` whose tied LM head is :meth:`ds_ext.pmm.layers.Embedding.attend`."""

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(pos)
        for block in self.blocks:
            if self.cfg.checkpoint and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.embed.attend(self.ln_f(x))


def adapt_gpt(model: GPT, engine) -> None:
    """Each block keeps n_heads / G_x heads (its QKV out-features are split over X)."""
    for block in model.blocks:
        block.n_heads = model.cfg.n_heads // engine.x.size
    model.__class__ = PMMGPT
