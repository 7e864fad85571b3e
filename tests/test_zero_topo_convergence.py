"""ZeRO-topo's quantized preset trains like the unquantized one: 50 steps on 8 gloo ranks
(2 nodes x 2 GPUs x 2 GCDs), in a world of its own (the longest ZeRO-topo test; a fresh world
keeps it at its standalone time).

Reference: the same run with every payload 16-bit (``UNQUANTIZED``).
"""

from test_zero_topo import UNQUANTIZED, _corpus, _ds_config, _engine, _run_steps

WORLD_SIZE = 8


def _train_then_eval(ds_cfg, steps):
    """Train ``steps`` steps, then the mean loss on 4 held-out batches (same on all ranks)."""
    import torch

    engine = _engine(ds_cfg)
    _run_steps(engine, steps)
    with torch.no_grad():
        held_out = [engine(_corpus().batch(10**9 + i, 8, 32)).item() for i in range(4)]
    engine.destroy()
    return sum(held_out) / len(held_out)


# Held-out loss of each quantized preset against the unquantized one after STEPS steps, model
# seeds 1234 / 1 / 2 (python examples/convergence_seeds.py --steps 50 --seeds 1234,1,2 --variants
# unq zero_topo zeropp zero_topo_int8, per-parameter quantization groups): zero_topo +1.1 / +1.3 /
# +1.2 %, zeropp -0.1 / -0.3 / +1.2 %, zero_topo_int8 +1.1 / +0.3 / +1.2 %. At 200 steps (the earlier
# length, 4x the time) the same seeds spread up to 4.0 % (zero_topo +3.4 / +1.2 / +4.0 %, zeropp
# +2.9 / -2.8 / +1.3 %, zero_topo_int8 +1.1 / +2.2 / +2.0 %; the unquantized model reduced in another
# order, zero3, +1.1 / +0.5 / -0.1 %): rounding and int4 / int8 noise move a trajectory further the
# longer it runs. By 50 steps the loss has fallen from ln(256) = 5.55 to about 2.7. One seed bounds
# breakage, not a 1 % bias: 3 %, over twice the largest 50-step spread. A decoder that swaps the
# two int4 halves of each gradient block lands 77 % off for zero_topo_int8 (seed 1234: 4.83 against
# 2.74; zero_topo alone 4.79). The exact claims (every parameter trains, each parameter's gradient within its int-b
# bound, ledger == model) are tests/test_zero_topo_hardening.py's and tests/test_zero_topo.py's.
STEPS = 50
BOUND = 0.03


def test_quantized_presets_train_like_unquantized(world):
    """003 §V-B / ZeRO++: int8 weights and int4 gradients (per-parameter groups, the default), with
    the int8 step boundary, train as the unquantized preset does: held-out loss within BOUND after
    STEPS steps."""
    final = {}
    for name, zt in {
        "unquantized": {"preset": "zero_topo", **UNQUANTIZED},
        # zero_topo's int8 weights and int4 gradients, + int8 across nodes at the step boundary: a
        # break in zero_topo's quantizers shows here too (zero_topo_paper and zeropp quantize the same
        # tensors to the same bits; each preset's per-parameter bound is test_zero_topo_hardening.py's)
        "zero_topo_int8": {"preset": "zero_topo_int8"},
    }.items():
        final[name] = world.run(_train_then_eval, _ds_config(0, "bf16", accum=1, zero_topo=zt), STEPS)[0]
    print(f"held-out loss after {STEPS} steps:", final)
    assert final["unquantized"] < 3.0, final  # it learned: random init is ln(256) = 5.55
    assert abs(final["zero_topo_int8"] / final["unquantized"] - 1) <= BOUND, final
