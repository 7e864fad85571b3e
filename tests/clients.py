"""Where the pinned real clients are (../shared/clients, or ``$DS_EXT_CLIENTS``)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(os.environ.get("DS_EXT_CLIENTS", Path(__file__).resolve().parents[2] / "shared" / "clients"))


def client_dir(name: str) -> Path | None:
    """The client's source tree, or None where this checkout has none beside it."""
    path = ROOT / name
    return path if path.is_dir() else None


def skip_reason(name: str) -> str:
    return f"the real client {name} is not at {ROOT / name} (set DS_EXT_CLIENTS)"
