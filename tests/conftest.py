"""Shared fixtures: ``world`` is a gloo world started once per test module.

A module sets ``WORLD_SIZE`` (default 2) and optionally ``WORLD_ENV`` (extra
environment for the ranks), ``WORLD_BACKEND`` ((backend, accelerator), default gloo on the
CPU) and ``WORLD_MAX_GROUPS`` (:class:`ds_ext.local_world.World`'s ``max_groups``) at module
level. Tests marked ``gpu`` (``pytest -m gpu``) are skipped where no CUDA device is visible.
"""

import os
import warnings

import pytest
import torch

from ds_ext.local_world import MAX_GROUPS, World, preload

warnings.filterwarnings("ignore", category=FutureWarning)
# Hugging Face's classes, imported by the ranks of several modules (about 3 s of CPU per rank),
# once in the forkserver the worlds' ranks are forked from
preload(
    "pytest",  # the test modules the ranks unpickle their tasks from import it
    "transformers.models.auto.modeling_auto",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt_neox.modeling_gpt_neox",
    "transformers.trainer",
)
# DeepSpeed with its CPU accelerator, unless test_tiled_optimizer_releases.py's ranks import
# DeepSpeed 0.19.6 (DS0196) or a CUDA device is visible (the gpu tests' NCCL worlds pick CUDA's)
if not os.environ.get("DS0196") and not torch.cuda.is_available():
    preload("ds_ext._world_preload_deepspeed")


def pytest_collection_modifyitems(config, items):
    gpu = [item for item in items if "gpu" in item.keywords]
    if not gpu:
        return
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (pytest -m gpu on a GPU machine)")
    for item in gpu:
        item.add_marker(skip)


@pytest.fixture(scope="module")
def world(request):
    backend, accelerator = getattr(request.module, "WORLD_BACKEND", ("gloo", "cpu"))
    w = World(
        getattr(request.module, "WORLD_SIZE", 2),
        getattr(request.module, "WORLD_ENV", None),
        backend=backend,
        accelerator=accelerator,
        max_groups=getattr(request.module, "WORLD_MAX_GROUPS", MAX_GROUPS),
    )
    yield w
    w.close()
