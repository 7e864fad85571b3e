"""Held-out loss of ZeRO-topo presets against the unquantized preset over several model seeds:
the run of ``tests/test_zero_topo_convergence.py`` (8 gloo ranks, bf16; 200 steps, the test's 50 with --steps 50) repeated per
seed and quantization-group layout, one JSON line per run.

    python examples/convergence_seeds.py --seeds 1234,1,2 --variants unq zero3 zero_topo zeropp zero_topo_int8
    python examples/convergence_seeds.py --seeds 1234,1,2 --variants unq zero_topo:packed zero_topo:per_parameter
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_zero_topo import UNQUANTIZED, _corpus, _ds_config, _engine, _run_steps  # noqa: E402

from ds_ext.local_world import World  # noqa: E402


def _held_out(zero_topo: dict, steps: int, seed: int) -> float:
    import torch

    engine = _engine(_ds_config(0, "bf16", accum=1, zero_topo=zero_topo), seed=seed)
    _run_steps(engine, steps)
    with torch.no_grad():
        losses = [engine(_corpus().batch(10**9 + i, 8, 32)).item() for i in range(4)]
    engine.destroy()
    return sum(losses) / len(losses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1234", help="comma-separated model seeds")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["unq", "zero_topo:packed", "zero_topo:per_parameter"],
        help="'unq' or PRESET[:per_parameter|packed] (default per_parameter); the first is the reference",
    )
    args = parser.parse_args()
    world = World(8)
    try:
        for seed in (int(s) for s in args.seeds.split(",")):
            reference = None
            for variant in args.variants:
                preset, _, groups = variant.partition(":")
                zt = {"preset": "zero_topo", **UNQUANTIZED} if preset == "unq" else {"preset": preset}
                if groups:
                    zt["quantization_groups"] = groups
                loss = world.run(_held_out, zt, args.steps, seed, timeout=3600)[0]
                reference = loss if reference is None else reference
                print(
                    json.dumps(
                        {"seed": seed, "variant": variant, "held_out_loss": loss, "vs_reference": loss / reference - 1}
                    ),
                    flush=True,
                )
    finally:
        world.close()


if __name__ == "__main__":
    main()
