"""Shared fixtures: ``world`` is a gloo world spawned once per test module.

A module sets ``WORLD_SIZE`` (default 2) and optionally ``WORLD_ENV`` (extra
environment for the ranks) at module level.
"""

import warnings

import pytest

from ds_ext.local_world import World

warnings.filterwarnings("ignore", category=FutureWarning)


@pytest.fixture(scope="module")
def world(request):
    w = World(getattr(request.module, "WORLD_SIZE", 2), getattr(request.module, "WORLD_ENV", None))
    yield w
    w.close()
