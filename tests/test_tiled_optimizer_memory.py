"""Step memory of the tiled optimizer (001 §7.2) on 4 gloo ranks.

Its own module, so its world is in memory mode (``mallopt``: allocations above 64 KiB
are mmapped and leave the resident set when freed) from the first large allocation on:
a heap that already holds large freed chunks would hide or double-count temporaries.
"""

import torch

WORLD_SIZE = 4


MEM_TILE = 65_536
SLACK = 1 << 20  # allocator, gloo and Python bookkeeping during a step


def _step_peak(experts, tile):
    """Median extra resident bytes of engine.step() (steps 2-4) on this rank."""
    from ds_ext.bench import median
    from ds_ext.bench.tiled import batch, measure_peak, moe_engine, use_mmap_for_large_allocations

    use_mmap_for_large_allocations()
    engine = moe_engine(experts, "tiled" if tile else "untiled", tile, 128, 512)
    peaks = []
    for step in range(4):
        x, y = batch(step, 128, 16, torch.bfloat16)
        engine.backward(engine(x, y))
        peak, _, _ = measure_peak(engine.step)
        if step >= 1:
            peaks.append(peak)
    out = {
        "peak": median(peaks),
        "max_param": max(p.numel() for p in engine.module.parameters()),
        "buffers": engine.ds_ext.plugins[-1].tiled.buffer.allocations if tile else 0,
    }
    engine.destroy()
    return out


def test_step_peak_is_bounded_by_the_tile_and_flat_in_experts(world):
    """ZeRO-1 bf16, ep 4: with E=16 each rank holds 4x the expert parameters of E=4.

    Peak = extra resident bytes during engine.step() (mmap for allocations > 64 KiB,
    VmHWM reset right before the step). Bound: 4 x tile_size (the tile buffer) + 8 x the
    largest parameter (DeepSpeed's norm up-casts one gradient at a time to fp64) + 1 MiB.
    """
    runs = {(e, t): world.run(_step_peak, e, t) for e in (4, 16) for t in (None, MEM_TILE)}
    res = {key: max(r["peak"] for r in per_rank) for key, per_rank in runs.items()}
    max_param = runs[(4, MEM_TILE)][0]["max_param"]
    bound = 4 * MEM_TILE + 8 * max_param + SLACK
    for e in (4, 16):
        assert res[(e, MEM_TILE)] <= bound, (e, res, bound)
    # untiled grows with the local expert parameters and breaks the tiled bound; tiled
    # stays flat: its growth is under a tenth of untiled's (a few hundred KiB of allocator
    # noise between ranks and runs, so a growth, not a ratio of two small peaks)
    assert res[(16, None)] >= 2.5 * res[(4, None)], res
    growth = {t: res[(16, t)] - res[(4, t)] for t in (None, MEM_TILE)}
    assert growth[MEM_TILE] <= 0.1 * growth[None], (growth, res)
    assert res[(16, None)] > bound, (res, bound)
