"""The 3D-PMM configs under configs/ run through the documented launcher (issue 20, item 9):
``launch/local_cpu.sh 8 CONFIG`` (the real ``deepspeed`` launcher, 8 CPU ranks) with
examples/train.py, which chooses the model and passes the optimizer the way the config
needs (tests/test_pmm_logic.py checks that choice without processes)."""

import math
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("config", ["configs/pmm3d_cpu8.json"])  # pmm3d.json: same launcher path, 40 s more
def test_pmm3d_config_trains_through_the_launcher(config):
    cmd = [
        "launch/local_cpu.sh",
        "8",
        config,
        "--steps",
        "2",
        "--d-model",
        "64",
        "--layers",
        "2",
        "--seq-len",
        "32",
        "--log-losses",
    ]
    run = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    losses = [float(v) for v in re.findall(r"step \d+: loss ([0-9.]+)", run.stdout)]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
