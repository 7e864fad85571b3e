"""Tiny Hugging Face causal LMs built from configs (random weights, nothing downloaded).

``transformers`` is imported on use: it is a dev / example dependency, not one of the
library's requirements.
"""

from __future__ import annotations

from typing import Any


def tiny_causal_lm(kind: str, layers: int = 2, hidden: int = 64, heads: int = 4, seq: int = 64):
    """A randomly initialised GPT-NeoX or Llama causal LM over the 256 byte tokens."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

    from ds_ext.models.gpt import ModelConfigError

    if kind == "gpt-neox":
        cfg = GPTNeoXConfig(
            vocab_size=256,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=4 * hidden,
            max_position_embeddings=seq,
        )
        return GPTNeoXForCausalLM(cfg)
    if kind == "llama":
        cfg = LlamaConfig(
            vocab_size=256,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads // 2,
            max_position_embeddings=seq,
        )
        return LlamaForCausalLM(cfg)
    raise ModelConfigError(f"model kind must be 'gpt-neox' or 'llama', got {kind!r}")


def hf_record(model: Any) -> dict[str, Any] | None:
    """``{"class", "config"}`` of a Hugging Face model (what a checkpoint records to rebuild it and
    to write its ``config.json``), None for any other module."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None
    return {"class": type(model).__name__, "config": config.to_dict()}
