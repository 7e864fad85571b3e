"""The tiled optimizer's forked ZeRO-1/2 and stage-0 steps (001 §7.2) on DeepSpeed 0.19.6.

Megatron-DeepSpeed imports ``deepspeed.compression.compress``, which DeepSpeed removed in
0.19.7, so its users run 0.19.6, whose ``step`` differs from 0.19.8's (the loss scale is
updated before the norm, no invalid-norm skip). ds_ext mirrors each tested release
(``ds_ext/integration/ds_zero12_step.py``); 0.19.8 is the installed DeepSpeed and is
verified by tests/test_tiled_optimizer.py, 0.19.6 here: the same 20-step trainings as there
(DeepSpeed-MoE expert groups, clipping, an overflow step), tiled against untiled, on ranks
that import DeepSpeed 0.19.6 from ``$DS0196`` (installed apart from the system DeepSpeed:
``DS_BUILD_OPS=0 pip install --no-build-isolation --target $DS0196 deepspeed==0.19.6``).
Reference: DeepSpeed 0.19.6's own untiled step, bit for bit.
"""

import os
import sys
from pathlib import Path

import pytest
from test_tiled_optimizer import OVERFLOW_STEP, _assert_identical, _train

WORLD_SIZE = 4
DS0196 = os.environ.get("DS0196", "")
pytestmark = pytest.mark.skipif(
    not (Path(DS0196) / "deepspeed" / "__init__.py").is_file(),
    reason="DeepSpeed 0.19.6 not found: set DS0196 to a `pip install --target` directory of deepspeed==0.19.6",
)


def _on_0_19_6(*args):
    """Import DeepSpeed from ``$DS0196`` on this rank (first use), then train as the 0.19.8 test does."""
    if "deepspeed" not in sys.modules:
        sys.path.insert(0, DS0196)
    import deepspeed
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from ds_ext.integration import ds_zero12_step
    from ds_ext.integration.ds_version import forked_release

    assert deepspeed.__version__ == "0.19.6"
    assert forked_release(DeepSpeedZeroOptimizer.step, ds_zero12_step.ZERO12_STEP_SHA256, "x") == "0.19.6"
    assert forked_release(FP16_UnfusedOptimizer.step, ds_zero12_step.UNFUSED_STEP_SHA256, "x") == "0.19.6"
    return _train(*args)


@pytest.mark.parametrize(
    "stage,precision,kind",
    [(2, "fp16", "DeepSpeedZeroOptimizer"), (0, "fp16", "FP16_UnfusedOptimizer")],
)
def test_tiled_step_on_deepspeed_0_19_6_is_bit_identical(world, stage, precision, kind):
    """ZeRO-2 and stage 0 in fp16 with clipping and one overflow step (the paths where 0.19.6's
    step differs from 0.19.8's): losses, skipped steps, 16-bit and fp32 master weights equal
    0.19.6's untiled step bit for bit."""
    ref = world.run(_on_0_19_6, stage, precision, None, True)
    ours = world.run(_on_0_19_6, stage, precision, 1000, True)
    _assert_identical(ref, ours, kind)
    assert ref[0]["skipped"][OVERFLOW_STEP] and ours[0]["skipped"] == ref[0]["skipped"]
    assert sum(ref[0]["skipped"]) == 1
