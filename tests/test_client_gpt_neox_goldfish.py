"""GPT-NeoX's Goldfish paths, unmodified client (its pipeline path and its plain model), in a
world of their own (the runs and their checks are ``test_client_gpt_neox``'s). These runs found a
hang: an earlier engine's ``destroy()``, run again by DeepSpeed's ``__del__`` when the collector
freed it mid-step on one rank, released the mpu a later engine had set (GPT-NeoX's ``mpu`` module,
the same object), so that rank's data-parallel all-reduce took another group than the others'
(fixed in ``ds_engine.release_mpu_on_destroy``; tests/test_initialize.py)."""

from __future__ import annotations

import pytest
from clients import skip_reason
from test_client_gpt_neox import NEOX, WORLD_MAX_GROUPS, WORLD_SIZE, _neox_train, torch_close

pytestmark = pytest.mark.skipif(NEOX is None, reason=skip_reason("gpt-neox"))
__all__ = ["WORLD_MAX_GROUPS", "WORLD_SIZE"]  # read by the world fixture (tests/conftest.py)


@pytest.mark.parametrize("pipe", [1, 2])
def test_neox_pipeline_path_goldfish_masks_its_own_loss_mask(world, pipe):
    """``"goldfish": {"enabled": true, "k": 2, "h": 13}`` in GPT-NeoX's ds_config, its pipeline path
    (``pipe_parallel_size`` 1 and 2) unmodified: the losses equal the same run whose batch function
    multiplies GPT-NeoX's own ``loss_mask`` by the hand-written rule, and differ from the plain run.
    After the tensor-parallel tests: the pipeline path shims ``Tensor.cuda`` in the ranks, which the
    world keeps."""
    run = dict(pipe=pipe, steps=3)
    gold = world.run(_neox_train, None, extra={"goldfish": {"enabled": True, "k": 2, "h": 13}}, **run)
    hand = world.run(_neox_train, None, hand_mask=(2, 13), **run)
    plain = world.run(_neox_train, None, **run)
    for (g, info), (r, _), (p, _) in zip(gold, hand, plain):
        assert info["plugins"] == ["goldfish"]
        assert g == pytest.approx(r, rel=1e-6, abs=0)
        assert all(abs(a - b) > 1e-4 for a, b in zip(g, p))


@pytest.mark.parametrize("model_parallel", [1, 2])
def test_neox_plain_model_goldfish_masks_its_own_loss_mask(world, model_parallel):
    """``"goldfish"`` in GPT-NeoX's ds_config, its plain model (``pipe_parallel_size: 0``, whose loss
    its ``forward_step`` computes outside the model) at ``model_parallel_size`` 1 and 2, unmodified,
    trained by its own ``forward_step``: each ``loss_mask`` its ``cross_entropy`` gets, the losses and
    every parameter of every rank at the end equal the same run whose ``get_batch`` multiplies its
    ``loss_mask`` by the hand-written rule; the mask is the same on both tensor ranks and drops
    about half the labels that have a whole context; losses and parameters differ from the plain run. After the tensor-parallel
    tests: GPT-NeoX's ``get_batch`` needs the ``Tensor.cuda`` shim."""
    import torch

    run = dict(its_loop=True, steps=3, params=True, model_parallel=model_parallel)
    gold = world.run(_neox_train, None, extra={"goldfish": {"enabled": True, "k": 2, "h": 13}}, **run)
    hand = world.run(_neox_train, None, hand_mask=(2, 13), **run)
    plain = world.run(_neox_train, None, **run)
    for (g, mine), (r, ref), (p, base) in zip(gold, hand, plain):
        assert mine["plugins"] == ["goldfish"] and mine["model"] == ref["model"]
        assert len(mine["masks"]) == len(ref["masks"]) == run["steps"]
        assert all(torch.equal(a, b) for a, b in zip(mine["masks"], ref["masks"]))
        # k = 2 drops half of the labels with a whole context among the labels: 19 of each row's 32
        dropped = 1 - sum(float(a.sum()) for a in mine["masks"]) / sum(float(c.sum()) for c in base["masks"])
        assert dropped == pytest.approx(0.5 * 19 / 32, abs=0.1)
        assert g == pytest.approx(r, rel=1e-6, abs=0)
        assert all(abs(a - b) > 1e-4 for a, b in zip(g, p))
        for name, q in ref["params"].items():
            torch_close(mine["params"][name], q, name)
        assert any(not torch.allclose(q, base["params"][n]) for n, q in mine["params"].items())
    if model_parallel == 2:  # ranks (0, 1) and (2, 3) are tensor pairs: one mask for both
        for a, b in [(0, 1), (2, 3)]:
            assert all(torch.equal(x, y) for x, y in zip(gold[a][1]["masks"], gold[b][1]["masks"]))
