"""Shared fixtures: ``world`` is a gloo world started once per test module.

A module sets ``WORLD_SIZE`` (default 2) and optionally ``WORLD_ENV`` (extra
environment for the ranks) at module level.
"""

import os
import warnings

import pytest

from ds_ext.local_world import World, preload

warnings.filterwarnings("ignore", category=FutureWarning)
# Hugging Face's classes, imported by the ranks of several modules (about 3 s of CPU per rank),
# once in the forkserver the worlds' ranks are forked from
preload("transformers.models.auto.modeling_auto", "transformers.models.llama.modeling_llama",
        "transformers.models.gpt_neox.modeling_gpt_neox", "transformers.trainer")
if not os.environ.get("DS0196"):  # else test_tiled_optimizer_releases.py's ranks import DeepSpeed 0.19.6
    preload("ds_ext._world_preload_deepspeed")


@pytest.fixture(scope="module")
def world(request):
    w = World(getattr(request.module, "WORLD_SIZE", 2), getattr(request.module, "WORLD_ENV", None))
    yield w
    w.close()
