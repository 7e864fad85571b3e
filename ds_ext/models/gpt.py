"""A small GPT decoder (random init) for demos, tests and benchmarks.

Pre-norm transformer blocks (causal self-attention + GELU MLP), learned positions,
tied LM head, byte vocabulary by default. ``GPT.blocks`` is the natural wrapping unit
for sharded data parallelism (one block = one gather/release unit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.utils.checkpoint import checkpoint

from ds_ext.errors import DsExtError


class ModelConfigError(DsExtError, ValueError):
    """A model shape or option the example models cannot build (``ds_ext.models``)."""


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    ffn_mult: int = 4
    dropout: float = 0.0
    checkpoint: bool = False  # recompute each block in backward (activation checkpointing)

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ModelConfigError(f"d_model {self.d_model} must be divisible by n_heads {self.n_heads}")

    @property
    def num_parameters(self) -> int:
        d, f = self.d_model, self.ffn_mult * self.d_model
        block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
        return self.vocab_size * d + self.seq_len * d + self.n_layers * block + 2 * d


class Block(nn.Module):
    """One pre-norm decoder block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, cfg.ffn_mult * d)
        self.fc2 = nn.Linear(cfg.ffn_mult * d, d)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = rearrange(self.qkv(self.ln1(x)), "b s (t h e) -> t b h s e", t=3, h=self.n_heads)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(rearrange(a, "b h s e -> b s (h e)"))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


LossMask = Callable[[torch.Tensor], torch.Tensor]


def lm_targets(tokens: torch.Tensor, loss_mask: LossMask | None) -> torch.Tensor:
    """The next-token targets ``tokens[:, 1:]``, flattened; where ``loss_mask(tokens)`` (bool of
    ``tokens``' shape, True = kept; e.g. :class:`ds_ext.goldfish.mask.GoldfishMask`) is False, the
    ignore index -100, which ``F.cross_entropy`` leaves out of the loss and of its mean."""
    targets = tokens[:, 1:]
    if loss_mask is not None:
        targets = targets.masked_fill(~loss_mask(tokens)[:, 1:], -100)
    return targets.reshape(-1)


class GPT(nn.Module):
    """Decoder-only LM; ``forward(tokens)`` returns the mean next-token cross-entropy over the
    tokens ``loss_mask`` keeps (all when it is None; the Goldfish plugin sets it)."""

    loss_mask: LossMask | None = None

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(pos)
        for block in self.blocks:
            if self.cfg.checkpoint and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.ln_f(x))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head, tied to the token embedding."""
        return x @ self.embed.weight.t()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens``: [batch, seq_len + 1] int64; loss over positions 1..seq_len."""
        logits = self.logits(tokens[:, :-1])
        return F.cross_entropy(rearrange(logits, "b s v -> (b s) v").float(), lm_targets(tokens, self.loss_mask))
