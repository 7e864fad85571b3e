"""The 3D-PMM config under configs/ trains with examples/train.py on 8 ranks (item 9),
as ``launch/local_cpu.sh 8 CONFIG`` runs it: the script's own ``main`` with the launcher's
command line and environment, in a world whose ranks start from the preloaded forkserver (the
real ``deepspeed`` launcher starting examples/train.py is tests/test_activation.py's; 8 ranks
through it cost 40 s more, each importing DeepSpeed and ds_ext anew). examples/train.py chooses
the model and passes the optimizer the way the config needs (tests/test_pmm_logic.py checks that
choice without processes)."""

import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORLD_SIZE = 8


def _train_py(config: str, *argv: str) -> str:
    """examples/train.py's ``main`` on this rank with ``--deepspeed_config config argv``; its stdout."""
    import contextlib
    import io
    import os
    import runpy
    import sys
    from unittest import mock

    out = io.StringIO()
    cmd = [
        "examples/train.py",
        f"--local_rank={os.environ['LOCAL_RANK']}",
        "--deepspeed_config",
        str(ROOT / config),
        *argv,
    ]
    with mock.patch.object(sys, "argv", cmd), contextlib.redirect_stdout(out):
        runpy.run_path(str(ROOT / "examples" / "train.py"), run_name="__main__")
    return out.getvalue()


@pytest.mark.parametrize("config", ["configs/pmm3d_cpu8.json"])  # pmm3d.json: the same path, 40 s more
def test_pmm3d_config_trains_examples_train_py_on_8_ranks(world, config):
    args = ("--steps", "2", "--d-model", "64", "--layers", "2", "--seq-len", "32", "--log-losses")
    stdout = world.run(_train_py, config, *args)[0]
    losses = [float(v) for v in re.findall(r"step \d+: loss ([0-9.]+)", stdout)]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses), stdout[-3000:]
    assert "pmm3d" in stdout, stdout[-3000:]  # the traffic table names the plugin's layout
