"""Shared fixtures: ``world`` is a gloo world spawned once per test module.

A module sets ``WORLD_SIZE`` (default 2) and optionally ``WORLD_ENV`` (extra
environment for the ranks) and ``WORLD_BACKEND`` ((backend, accelerator), default gloo on the
CPU) at module level. Tests marked ``gpu`` (``pytest -m gpu``) are skipped where no CUDA
device is visible.
"""

import warnings

import pytest

from ds_ext.local_world import World

warnings.filterwarnings("ignore", category=FutureWarning)


def pytest_collection_modifyitems(config, items):
    gpu = [item for item in items if "gpu" in item.keywords]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (pytest -m gpu on a GPU machine)")
    for item in gpu:
        item.add_marker(skip)


@pytest.fixture(scope="module")
def world(request):
    backend, accelerator = getattr(request.module, "WORLD_BACKEND", ("gloo", "cpu"))
    w = World(getattr(request.module, "WORLD_SIZE", 2), getattr(request.module, "WORLD_ENV", None),
              backend=backend, accelerator=accelerator)
    yield w
    w.close()
