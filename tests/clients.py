"""Where the pinned real clients are (../shared/clients, or ``$DS_EXT_CLIENTS``)."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(os.environ.get("DS_EXT_CLIENTS", Path(__file__).resolve().parents[2] / "shared" / "clients"))


def client_dir(name: str) -> Path | None:
    """The client's source tree, or None where this checkout has none beside it."""
    path = ROOT / name
    return path if path.is_dir() else None


def skip_reason(name: str) -> str:
    return f"the real client {name} is not at {ROOT / name} (set DS_EXT_CLIENTS)"


# Megatron-DeepSpeed's pretrain_gpt.py end to end (examples/megatron_deepspeed_*.sh): what
# examples/megatron_deepspeed_env.sh builds and prints, the lm losses that the client prints.
MDS_ENV = {k: os.environ.get(k, "") for k in ("MDS", "DS0196", "EXTRA", "DATA")}
MDS_READY = all(MDS_ENV.values()) and (Path(MDS_ENV["MDS"]) / "pretrain_gpt.py").is_file()
MDS_SKIP = (
    "Megatron-DeepSpeed acceptance run: set MDS, DS0196, EXTRA and DATA as examples/megatron_deepspeed_env.sh prints"
)
_LM_LOSS = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?\| lm loss: ([0-9.E+-]+) \|")


_ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*")
_LOSS_FIELD = re.compile(r"\| lm loss: ([0-9.E+-]+) \|")


def lm_log(out: str, iterations: int = 10) -> list[tuple[float | None, float, int]]:
    """(lm loss or None, loss scale, skipped) of each iteration as pretrain_gpt.py prints it under fp16
    with ``--log-interval 1``: a skipped iteration (overflow) prints no lm loss."""
    rows = []
    for line in (m.group(0) for m in _ITERATION.finditer(out)):
        loss = _LOSS_FIELD.search(line)
        rows.append(
            (
                float(loss.group(1)) if loss else None,
                float(re.search(r"\| loss scale: ([0-9.]+) \|", line).group(1)),
                int(re.search(r"number of skipped iterations:\s+(\d+) \|", line).group(1)),
            )
        )
    assert len(rows) == iterations, out[-3000:]
    return rows


def lm_losses(out: str, iterations: int = 10) -> list[float]:
    """The lm loss of each iteration as pretrain_gpt.py prints it (7 significant digits)."""
    got = [(int(i), int(n), float(v)) for i, n, v in _LM_LOSS.findall(out)]
    assert [(i, n) for i, n, _ in got] == [(i, iterations) for i in range(1, iterations + 1)], out[-3000:]
    return [v for *_, v in got]
