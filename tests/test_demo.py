"""The README's demo, run as a newcomer runs it (``launch/local_cpu.sh 8 configs/demo.json``, the
real ``deepspeed`` launcher, 8 CPU ranks): its last lines are the recorded run's that the README
and Getting started show (``examples/results/demo_output.txt``, written by ``python -m docs.gen
--demo``), but for what depends on the host and the number of steps (the loss, seconds per step,
the steps averaged). A shorter run than the recorded one: the bytes per optimizer step do not
depend on the step."""

import re
import subprocess
from pathlib import Path

from docs import gen

ROOT = Path(__file__).resolve().parents[1]
VARIABLE = (
    (re.compile(r"^final loss \S+ after \d+ steps \(\S+ s/step\), "), "final loss _ after _ steps (_ s/step), "),
    (re.compile(r"mean over \d+ optimizer steps"), "mean over _ optimizer steps"),
)


def _fixed(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        for pattern, repl in VARIABLE:
            line = pattern.sub(repl, line)
        out.append(line)
    return out


def test_the_readme_demo_prints_the_recorded_lines():
    recorded = gen.recorded_demo()
    command = [*gen.DEMO_COMMAND[:-1], "3"]  # --steps 3
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert _fixed(gen.demo_block(run.stdout)) == _fixed(recorded)
    assert gen.DEMO_COMMAND == ["launch/local_cpu.sh", "8", "configs/demo.json", "--steps", "30"]
