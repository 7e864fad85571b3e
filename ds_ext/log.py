"""ds_ext's messages, through DeepSpeed's logger conventions (``deepspeed.utils.logging``).

Information goes to DeepSpeed's logger on rank 0 only (``log_dist(..., ranks=[0])``: one
``[Rank 0] ...`` line per message, where DeepSpeed's own lines go, at its log level); the
start-up banner is printed on rank 0 whatever the level (``print_dist``, DeepSpeed's way for
lines that must show); warnings are Python warnings issued on rank 0 only, so Python's filter
shows each once instead of once per rank.
"""

from __future__ import annotations

import warnings


def _rank() -> int:
    """This process's rank; 0 before torch.distributed starts (a single process)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def info(message: str) -> None:
    """``message`` on rank 0 through DeepSpeed's logger (INFO)."""
    from deepspeed.utils.logging import log_dist

    log_dist(message, ranks=[0])


def banner(message: str) -> None:
    """``message`` printed on rank 0 as ``[Rank 0] ...``, whatever DeepSpeed's log level."""
    from deepspeed.utils.logging import print_dist

    print_dist(message, ranks=[0])


def warn(message: str, stacklevel: int = 2) -> None:
    """A warning from rank 0 only (Python's filter then shows it once per call site)."""
    if _rank() == 0:
        warnings.warn(message, stacklevel=stacklevel + 1)
