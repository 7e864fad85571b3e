"""Byte-level text available offline: the Python standard library's own sources.

:class:`ByteCorpus` reads ``*.py`` files of the running interpreter's stdlib in sorted
order (deterministic on a given Python), holds them as one uint8 tensor, and serves
``[batch, seq_len + 1]`` token windows. Each (step, rank, micro-step) draws its own
windows from a seeded generator, so any parallel layout can reproduce the exact
global batch of a serial run.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import Iterator

import torch

from ds_ext.errors import DsExtSetupError

DEFAULT_BYTES = 4_000_000
_SKIPPED_DIRS = ("site-packages", "test")


def _sources(root: Path) -> Iterator[Path]:
    """The ``*.py`` files under ``root`` outside any ``site-packages`` or ``test`` directory,
    in ``sorted(root.rglob("*.py"))`` order (by path parts), found lazily: each directory's
    entries are visited in name order, so the caller stops reading after its first few
    megabytes without walking the whole tree (site-packages alone holds torch's)."""
    if any(part in _SKIPPED_DIRS for part in root.parts):
        return
    with os.scandir(root) as it:
        entries = sorted(it, key=lambda e: e.name)
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():  # rglob's recursion: not into linked directories
            if entry.name not in _SKIPPED_DIRS:
                yield from _sources(root / entry.name)
        elif entry.name.endswith(".py") and entry.is_file():
            yield root / entry.name


class ByteCorpus:
    """Bytes of the stdlib ``.py`` sources as token ids 0..255."""

    def __init__(self, max_bytes: int = DEFAULT_BYTES, root: str | Path | None = None) -> None:
        root = Path(root or sysconfig.get_paths()["stdlib"])
        chunks, total = [], 0
        for path in _sources(root):
            data = path.read_bytes()
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                break
        blob = b"".join(chunks)[:max_bytes]
        if len(blob) < 1024:
            raise DsExtSetupError(
                f"found only {len(blob)} bytes of Python sources under {root}; pass root=, "
                "a directory holding .py files"
            )
        self.tokens = torch.frombuffer(bytearray(blob), dtype=torch.uint8)

    def __len__(self) -> int:
        return self.tokens.numel()

    def batch(self, seed: int, batch_size: int, seq_len: int) -> torch.Tensor:
        """``batch_size`` random windows of ``seq_len + 1`` tokens (int64), fixed by ``seed``."""
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, len(self) - seq_len - 1, (batch_size,), generator=g)
        idx = starts[:, None] + torch.arange(seq_len + 1)
        return self.tokens[idx].long()

    def global_batch(self, step: int, batch_size: int, seq_len: int) -> torch.Tensor:
        """The whole global batch of optimizer step ``step``."""
        return self.batch(1_000_003 * step + 17, batch_size, seq_len)

    def micro_batch(
        self, step: int, micro: int, rank: int, dp: int, micro_batch: int, grad_accum: int, seq_len: int
    ) -> torch.Tensor:
        """Rank ``rank``'s share of micro-step ``micro`` of the global batch of ``step``.

        The global batch is ``grad_accum x dp x micro_batch`` windows ordered
        (micro, rank, sample), so data-parallel and serial runs see the same samples.
        """
        full = self.global_batch(step, grad_accum * dp * micro_batch, seq_len)
        start = (micro * dp + rank) * micro_batch
        return full[start : start + micro_batch]
