"""3D-PMM on 8 gloo ranks (2 nodes x 2 GPUs x 2 GCDs, emulated) against the serial model.

For each grid: the loss, every parameter's gradient after the data-parallel reduction,
the global gradient norm (and HF logits) at each of 5 AdamW steps, and every parameter
after them, equal the serial model's under the same seed (tests/pmm_helpers.py); also for
models built on the meta device (``ds_ext.pmm.build_on_meta``), whose shards are
materialised rank by rank.
"""

import pytest
from pmm_helpers import GPT_GRIDS, parity

WORLD_SIZE = 8


@pytest.mark.parametrize("grid", GPT_GRIDS, ids=lambda g: "x{}y{}z{}d{}".format(*g))
def test_gpt_parity(world, grid):
    results = world.run(parity, "gpt", grid)
    losses = results[0][0]
    assert all(r[0] == losses for r in results)  # every rank reports the whole model's loss


@pytest.mark.parametrize(
    "family,grid",
    [
        ("neox", (2, 2, 2, 1)),
        ("neox", (2, 1, 2, 2)),
        ("llama", (2, 2, 2, 1)),
        ("llama", (1, 2, 2, 2)),
        ("llama_tied", (2, 2, 2, 1)),
    ],
)  # tied: neox in test_pmm_logic
def test_hf_parity(world, family, grid):
    world.run(parity, family, grid)


@pytest.mark.parametrize("family,grid", [("gpt_meta", (2, 2, 2, 1)), ("llama_tied_meta", (1, 2, 4, 1))])
def test_built_on_meta_parity(world, family, grid):
    # ds_ext.initialize materialises only this rank's shards of a model built
    # by ds_ext.pmm.build_on_meta (tests/test_pmm_meta.py: bit for bit the serial init's slices)
    world.run(parity, family, grid)


@pytest.mark.parametrize(
    "family,grid,kw",
    [("gpt", (8, 1, 1, 1), {}), ("gpt", (2, 2, 2, 1), {"stage": 1, "clip": 1.0}), ("llama", (2, 1, 2, 2), {})],
    ids=str,
)
def test_tables_replicated_over_x_parity(world, family, grid, kw):
    # ds_ext.pmm3d.tables "replicated" (tables and LM head whole on every X rank,
    # as megatron-core TP8's anchor keeps them). Stage 0: every gradient and ds_ext's norm;
    # ZeRO-1 with clipping: DeepSpeed's norm counts the X-replicated table once; llama: the
    # untied head and Hugging Face's loss
    world.run(parity, family, grid, tables="replicated", **kw)
