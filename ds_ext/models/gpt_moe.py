"""A small GPT with Mixture-of-Experts feed-forward blocks, ready for TED (001 ch. 7).

Pre-norm decoder blocks; every ``moe_every``-th block's feed-forward is an MoE layer
("every alternate layer has expert feedforward modules", 001 §7.1.1), the others a dense
MLP. Attention (QKV column-, output row-parallel) and the dense MLP (fc1 column-, fc2
row-parallel) are Megatron tensor-parallel layers (``ds_ext.moe.tensor_parallel``); the MoE
layer is :class:`ds_ext.moe.TEDMoE`, or DeepSpeed's own ``MoE`` (``moe_impl="deepspeed"``)
as the baseline. Embeddings, layer norms and the tied LM head are replicated.

Unbound the model is an ordinary serial model; ``ds_ext.initialize`` with ``"ted"`` enabled
slices its tensor-parallel weights. ``forward(tokens)`` returns
``cross-entropy + aux_loss_coef * sum of the MoE layers' l_aux``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from ds_ext.models.gpt import GPT, LossMask, ModelConfigError, lm_targets
from ds_ext.moe import ColumnParallelLinear, RowParallelLinear, TEDMoE
from ds_ext.moe.tensor_parallel import check_divisible

CHECKPOINT_MODES = ("none", "torch", "torch-reentrant", "deepspeed")


@dataclass(frozen=True)
class GPTMoEConfig:
    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 4
    ffn_mult: int = 4
    num_experts: int = 4
    ep_size: int = 1  # experts held per rank: num_experts / ep_size (TEDMoE's ep_size)
    top_k: int = 1
    capacity_factor: float = 1.0
    eval_capacity_factor: float = 1.0
    min_capacity: int = 4
    drop_tokens: bool = True
    use_rts: bool = True
    top2_2nd_expert_sampling: bool = True
    noisy_gate_policy: str | None = None
    aux_loss_coef: float = 0.01
    moe_every: int = 2
    checkpoint: Literal["none", "torch", "torch-reentrant", "deepspeed"] = "none"
    moe_impl: Literal["ted", "deepspeed"] = "ted"
    # TEDMoE's enable_expert_tensor_parallelism: experts split over the tensor group, or whole
    # on every tensor rank (each runs its share of the tokens: duplicate token dropping)
    expert_tensor_parallel: bool = True

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ModelConfigError(f"d_model {self.d_model} must be divisible by n_heads {self.n_heads}")
        if self.checkpoint not in CHECKPOINT_MODES:
            raise ModelConfigError(f"checkpoint must be one of {CHECKPOINT_MODES}, got {self.checkpoint!r}")

    def is_moe(self, block: int) -> bool:
        return block % self.moe_every == self.moe_every - 1

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.n_layers))

    @property
    def num_parameters(self) -> int:
        """Parameters of the whole model (every expert, nothing sliced)."""
        d, f, E = self.d_model, self.ffn_mult * self.d_model, self.num_experts
        attn = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d)
        mlp = (d * f + f) + (f * d + d)
        moe = d * E + E * mlp
        blocks = self.n_layers * attn + self.num_moe_layers * moe + (self.n_layers - self.num_moe_layers) * mlp
        return self.vocab_size * d + self.seq_len * d + blocks + 2 * d


class Attention(nn.Module):
    """Causal self-attention; heads split over the tensor group (QKV rows are ordered
    (head, q/k/v, dim) so that a contiguous row shard holds whole heads)."""

    def __init__(self, cfg: GPTMoEConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.head_dim = d // cfg.n_heads
        self.qkv = ColumnParallelLinear(d, 3 * d)
        self.proj = RowParallelLinear(d, d)

    def ted_validate(self, layout, name: str) -> None:
        check_divisible(f"{name} n_heads", self.n_heads, layout.tensor)
        check_divisible(f"{name} hidden size", self.n_heads * self.head_dim, layout.tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = rearrange(self.qkv(x), "b s (h t e) -> t b h s e", t=3, e=self.head_dim)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(rearrange(a, "b h s e -> b s (h e)"))


class DenseMLP(nn.Module):
    def __init__(self, cfg: GPTMoEConfig) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(cfg.d_model, cfg.ffn_mult * cfg.d_model)
        self.fc2 = RowParallelLinear(cfg.ffn_mult * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def moe_layer(cfg: GPTMoEConfig) -> nn.Module:
    """The MoE feed-forward: TEDMoE, or DeepSpeed's MoE with the same arguments."""
    d, f = cfg.d_model, cfg.ffn_mult * cfg.d_model
    kwargs = dict(
        num_experts=cfg.num_experts,
        ep_size=cfg.ep_size,
        k=cfg.top_k,
        capacity_factor=cfg.capacity_factor,
        eval_capacity_factor=cfg.eval_capacity_factor,
        min_capacity=cfg.min_capacity,
        noisy_gate_policy=cfg.noisy_gate_policy,
        drop_tokens=cfg.drop_tokens,
        use_rts=cfg.use_rts,
        top2_2nd_expert_sampling=cfg.top2_2nd_expert_sampling,
    )
    expert = nn.Sequential(nn.Linear(d, f), nn.GELU(), nn.Linear(f, d))
    if cfg.moe_impl == "deepspeed":
        from deepspeed.moe.layer import MoE

        return MoE(d, expert, **kwargs)
    return TEDMoE(d, expert, enable_expert_tensor_parallelism=cfg.expert_tensor_parallel, **kwargs)


class Block(nn.Module):
    """Pre-norm block; ``forward(x) -> (x, l_aux)`` (l_aux = 0 for a dense block)."""

    def __init__(self, cfg: GPTMoEConfig, moe: bool) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.ffn = moe_layer(cfg) if moe else DenseMLP(cfg)
        self.moe = moe

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.ln1(x))
        if not self.moe:
            return x + self.ffn(self.ln2(x)), x.new_zeros(())
        y, l_aux, _ = self.ffn(self.ln2(x))
        return x + y, l_aux


def _checkpointed(block: Block, x: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    if mode == "none" or not torch.is_grad_enabled():
        return block(x)
    if mode == "deepspeed":
        import deepspeed

        return deepspeed.checkpointing.checkpoint(block, x)
    return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=mode == "torch-reentrant")


class GPTMoE(nn.Module):
    """Decoder-only LM with MoE blocks (see module docstring); the cross-entropy is over the tokens
    ``loss_mask`` keeps (:func:`ds_ext.models.gpt.lm_targets`)."""

    loss_mask: LossMask | None = None

    def __init__(self, cfg: GPTMoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, cfg.is_moe(i)) for i in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.apply(GPT._init)  # every expert copy drawn independently

    def logits(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[batch, seq]`` tokens -> (logits ``[batch, seq, vocab]``, sum of l_aux)."""
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(pos)
        l_aux = x.new_zeros(())
        for block in self.blocks:
            x, aux = _checkpointed(block, x, self.cfg.checkpoint)
            l_aux = l_aux + aux
        return self.ln_f(x) @ self.embed.weight.t(), l_aux

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens``: ``[batch, seq_len + 1]`` int64; LM loss over positions 1..seq_len plus
        ``aux_loss_coef`` x l_aux."""
        logits, l_aux = self.logits(tokens[:, :-1])
        ce = F.cross_entropy(rearrange(logits, "b s v -> (b s) v").float(), lm_targets(tokens, self.loss_mask))
        return ce + self.cfg.aux_loss_coef * l_aux
