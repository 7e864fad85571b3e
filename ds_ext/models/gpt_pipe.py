"""The :class:`~ds_ext.models.gpt.GPT` as a ``deepspeed.pipe.PipelineModule`` (DeepSpeed's PipelineEngine).

Same parameters and math as :class:`GPT`, as a sequence of layers the PipelineEngine splits into
stages (the shape of Megatron-DeepSpeed's ``GPTModelPipe`` and GPT-NeoX's pipeline model, the
clients' default path for 004's TP x PP x ZeRO-1 recipes): the token embedding as a
``TiedLayerSpec`` shared with the LM head (DeepSpeed all-reduces its gradient over the stages that
hold it, ``ReduceTiedGrads``), the learned positions, one ``LayerSpec`` per :class:`Block`, the
final norm. Layer ``i`` of the pipeline holds GPT's ``pos`` (i = 1), ``blocks[i - 2]`` or ``ln_f``
(i = n_layers + 2); the embedding is ``tied_modules.embed`` (:func:`gpt_weights_for_pipe` maps a
GPT's state dict onto these names). ``train_batch`` takes ``(tokens[:, :-1], tokens[:, 1:])`` per
micro-batch; the loss is GPT's mean next-token cross-entropy.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ds_ext.models.gpt import GPT, Block, GPTConfig


class TokenEmbedding(nn.Embedding):
    """GPT's ``embed`` (normal init, std 0.02), tied to the LM head (:func:`lm_head`)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg.vocab_size, cfg.d_model)
        GPT._init(self)


class Positions(nn.Module):
    """GPT's learned positions, added to the token embeddings."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        GPT._init(self.pos)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pos(torch.arange(x.shape[1], device=x.device))


class PipeBlock(Block):
    """GPT's :class:`Block` with GPT's initialization."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.apply(GPT._init)


class FinalNorm(nn.LayerNorm):
    """GPT's ``ln_f``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg.d_model)


def lm_head(embed: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    """The LM head, tied to the token embedding (``GPT.head``)."""
    return x @ embed.weight.t()


class LMLoss:
    """GPT's loss on the last stage's logits (a class, so the PipelineModule stays picklable): the
    mean cross-entropy over the labels that are not -100."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, self.vocab_size).float(), labels.reshape(-1))


def gpt_pipeline(
    cfg: GPTConfig, num_stages: int | None = None, topology: Any = None, partition_method: str = "uniform"
) -> Any:
    """A ``deepspeed.pipe.PipelineModule`` of ``cfg``'s GPT over ``num_stages`` stages (or DeepSpeed's
    ``topology``); needs ``deepspeed.init_distributed`` first. ``cfg.checkpoint``: every layer's
    activations recomputed in backward (``activation_checkpoint_interval`` 1)."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    layers = [
        TiedLayerSpec("embed", TokenEmbedding, cfg),
        LayerSpec(Positions, cfg),
        *[LayerSpec(PipeBlock, cfg) for _ in range(cfg.n_layers)],
        LayerSpec(FinalNorm, cfg),
        TiedLayerSpec("embed", TokenEmbedding, cfg, forward_fn=lm_head),
    ]
    return PipelineModule(
        layers,
        num_stages=num_stages,
        topology=topology,
        loss_fn=LMLoss(cfg.vocab_size),
        partition_method=partition_method,
        activation_checkpoint_interval=1 if cfg.checkpoint else 0,
    )


def gpt_weights_for_pipe(state: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """A :class:`GPT`'s state dict under the names of :func:`gpt_pipeline`'s module (all stages'; a
    stage loads the names it has)."""
    out = {}
    for name, value in state.items():
        head, _, rest = name.partition(".")
        if head == "embed":
            out[f"tied_modules.embed.{rest}"] = value
        elif head == "pos":
            out[f"1.pos.{rest}"] = value
        elif head == "blocks":
            index, _, rest = rest.partition(".")
            out[f"{int(index) + 2}.{rest}"] = value
        elif head == "ln_f":
            out[f"{n_layers + 2}.{rest}"] = value
        else:
            raise KeyError(f"GPT state dict key {name!r} has no pipeline counterpart")
    return out


def load_gpt_weights(pipe: nn.Module, gpt: GPT) -> None:
    """Copy ``gpt``'s weights into this stage's layers of ``pipe`` (:func:`gpt_pipeline`)."""
    mapped = gpt_weights_for_pipe(gpt.state_dict(), gpt.cfg.n_layers)
    own = pipe.state_dict()
    missing = sorted(set(own) - set(mapped))
    if missing:
        raise KeyError(f"pipeline parameters without a GPT counterpart: {missing}")
    pipe.load_state_dict({k: v for k, v in mapped.items() if k in own})
