"""3D-PMM engine on 8 gloo ranks: overlap, DeepSpeed integration, ledger vs model, memory, tuning.

References: the serial model (tests/pmm_helpers.py), the blocking run for the overlap
switches, and ``ds_ext.perf.pmm`` (Eqs 5.1-5.5 plus the terms ds_ext adds) for the ledger.
"""

import pytest
from pmm_helpers import GLOBAL_BATCH, SEQ, engine_for, ds_config, parity, tokens, train_and_compare

WORLD_SIZE = 8
ALL_ON = {"all_reduce": True, "reduce_scatter": True, "all_gather": True}


def _overlap_pair(grid):
    import torch

    off = train_and_compare("gpt_ckpt", grid)
    on = train_and_compare("gpt_ckpt", grid, overlap=ALL_ON)
    identical = all(torch.equal(on["params"][n], p) for n, p in off["params"].items())
    return identical, on["losses"] == off["losses"], on["telemetry"]


def test_overlap_bit_identical_to_blocking(world):
    # activation checkpointing on: OAG must prefetch inside the recomputes of backward too
    for identical, same_losses, tel in world.run(_overlap_pair, (2, 2, 2, 1)):
        assert identical and same_losses
        order = tel["recorded_order"]
        assert len(order) == 2 * 8  # 8 layers in forward, again in the recompute
        assert order[8:] == order[4:8] + order[:4]  # the recompute runs the last block first
        assert tel["prefetch_hits"] >= (5 - 1) * (len(order) - 1)  # every later call after the first step
        assert tel["deferred_waited"] == 5 * 8 * 2  # each layer: weight reduce-scatter + bias all-reduce


def test_zero1_fp32_tiled_optimizer_with_clipping(world):
    # data axis through DeepSpeed's ZeRO-1 (optimizer states sharded over 'data'); DeepSpeed's
    # clipping norm must be the serial model's (ds_pmm.mark_parameters), so clip at 1.0 here
    world.run(parity, "gpt", (2, 1, 2, 2), stage=1, clip=1.0, tiled=True)


def test_zero1_bf16_tiled_optimizer(world):
    world.run(parity, "gpt", (2, 2, 1, 2), stage=1, clip=1.0, tiled=True, bf16=True)


def test_zero2_fp32(world):
    world.run(parity, "gpt", (1, 2, 2, 2), stage=2)


def test_matmul_tuning_same_results(world):
    results = world.run(train_and_compare, "gpt", (2, 2, 2, 1), tune=True)
    tel = results[0]["telemetry"]
    layers = [f"blocks.{b}.{n}" for b in range(2) for n in ("qkv", "proj", "fc1", "fc2")]
    assert tel["tuned_sites"] == sorted(f"{lay}/{s}" for lay in layers for s in ("fwd", "dgrad", "wgrad"))
    assert all(r["telemetry"]["tuned_modes"] == tel["tuned_modes"] for r in results)  # agreed by all ranks
