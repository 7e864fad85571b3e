"""ruff over the code base: the linter and the formatter (configuration and the rules left out:
ruff.toml, docs/contributing.md)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PATHS = ["ds_ext", "tests", "docs", "examples"]


def test_ruff_check():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff not installed: pip install -r requirements-dev.txt")
    proc = subprocess.run([ruff, "check", "--no-cache", *PATHS], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_ruff_format():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff not installed: pip install -r requirements-dev.txt")
    proc = subprocess.run(
        [ruff, "format", "--check", "--no-cache", *PATHS], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, "run `ruff format ds_ext tests docs examples`:\n" + proc.stdout[-4000:]
