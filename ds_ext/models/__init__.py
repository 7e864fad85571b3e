"""Small models built from configs (random init) for demos, tests and benchmarks."""

from ds_ext.models.gpt import GPT, GPTConfig, ModelConfigError

__all__ = ["GPT", "GPTConfig", "ModelConfigError"]
