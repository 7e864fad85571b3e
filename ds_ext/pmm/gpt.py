"""ds_ext's GPT after conversion: local attention heads and the tied head on the Y-split stream."""

from __future__ import annotations

import torch

from ds_ext.models.gpt import GPT


class PMMGPT(GPT):
    """:class:`~ds_ext.models.gpt.GPT` whose tied LM head is :meth:`ds_ext.pmm.layers.Embedding.attend`."""

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed.attend(x)


def adapt_gpt(model: GPT, engine) -> None:
    """Each block keeps n_heads / G_x heads (its QKV out-features are split over X)."""
    for block in model.blocks:
        block.n_heads = model.cfg.n_heads // engine.x.size
    model.__class__ = PMMGPT
