"""FLOPs and activation memory of a GPT training step (planner-only models).

Notation: B sequences per optimizer step, b sequences per micro-step of one data-parallel
replica, s sequence length, L layers, h hidden size, a attention heads, V (padded) vocabulary.

FLOPs per step, the formula GPT-NeoX and Megatron-DeepSpeed report TFLOPS with (spec
zero_topo_and_frontier.md A1 / B9, from Narayanan et al. 2021 Eq 3)::

    F = 24 c B s L h^2 (1 + s / (6 h) + V / (16 L h)),   c = 4 with activation checkpointing, else 3

(GPT-NeoX's ``get_flops`` adds the vocabulary ratio instead of multiplying by it, which drops
about 1 % of the FLOPs of a 20B model; the planner uses the formula as published). A top-1
MoE routes each token through one expert, so its FLOPs are its base model's.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", §4.1 Eq 1-2), bytes of one layer for t tokens in 16 bit:
``t h (10 + 24 / g_t)`` plus ``5 a s t / g_t`` for the attention scores; the 10 t h of layer
norms, residual and dropout masks are replicated over Megatron's tensor group, the 24 t h of
matmul inputs and outputs are split over it (g_t). Flash attention (003 §VI, 000 §VI) keeps no
score matrix, so its term is dropped. With activation checkpointing (every recipe here:
GPT-NeoX 20B.yml, 004 Table V, 000 §VI) a rank keeps each layer's 16-bit input (2 t h / g_r
bytes) and one layer's working set at a time; the loss keeps fp32 logits, 4 t V / g_v bytes.
How a plan splits tokens (g_rows), the residual stream (g_r), the matmul activations (g_t) and
the logits (g_v) over its ranks is :class:`ActivationSplit`.
"""

from __future__ import annotations

from dataclasses import dataclass


def step_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int, checkpointing: bool = True) -> float:
    """F for ``batch`` sequences (module docstring)."""
    c = 4 if checkpointing else 3
    return 24 * c * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


@dataclass(frozen=True)
class ActivationSplit:
    """Divisors of a rank's activations: tokens, residual stream, matmul activations, logits."""

    rows: int = 1
    residual: int = 1
    tensor: int = 1
    vocab: int = 1


def activation_bytes(
    tokens: int,
    layers: int,
    hidden: int,
    heads: int,
    seq: int,
    vocab: int,
    split: ActivationSplit = ActivationSplit(),
    checkpointing: bool = True,
    flash_attention: bool = True,
) -> float:
    """Peak activation bytes of one rank for ``tokens`` tokens of one micro-step (module docstring)."""
    t = tokens / split.rows
    layer = t * hidden * (10 / split.residual + 24 / split.tensor)
    if not flash_attention:
        layer += 5 * heads * seq * t / split.tensor
    logits = 4 * t * vocab / split.vocab
    if checkpointing:
        return layers * 2 * t * hidden / split.residual + layer + logits
    return layers * layer + logits
