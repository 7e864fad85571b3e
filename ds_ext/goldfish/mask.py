"""The Goldfish loss mask (000 §VIII-D; Hans et al., "Be like a goldfish, don't memorize!",
arXiv 2406.10209, §3.1 "hashed mask").

Notation (Hans et al.): ``x_0 .. x_{L-1}`` the tokens of a sequence, ``k`` the drop frequency,
``h`` the context width, ``f`` a hash of ``h`` tokens into ``[0, 1)``. Token ``x_i`` is left out of
the loss iff ``i >= h`` and ``f(x_{i-h}, .., x_{i-1}) < 1/k``: a deterministic function of the
``h`` tokens before it, so a passage is masked the same way in every epoch, on every rank and
wherever it sits in a batch, and ``1/k`` of the tokens are dropped on average. 000 uses
``k = 2, h = 13``.

The hash ``f`` (the paper leaves it open; its reference code draws a table with ``torch.rand`` on
the device's generator, which differs between CPU and CUDA) is exact integer arithmetic, the same
bits on every device, every intermediate below ``2^63``::

    a = 0;  for x in window (oldest first):  a = (a * BASE + x + 1) mod P      (P = 2^31 - 1)
    f = mix32(a) / 2^32,  dropped iff mix32(a) * k < 2^32

``mix32`` is a 32-bit avalanche finaliser (xor-shift 16, multiply by 0x45D9F3B, twice, xor-shift
16), so contexts that differ in one token land far apart. Token ids must lie in ``[0, 2^31 - 2]``.
"""

from __future__ import annotations

import torch

from ds_ext.errors import DsExtConfigError

P = 2**31 - 1
BASE = 1_000_003
MIX = 0x45D9F3B
MASK32 = 2**32 - 1
IGNORE_INDEX = -100  # torch's cross_entropy default ignore_index (and Hugging Face's)


def _mix32(a: torch.Tensor) -> torch.Tensor:
    a = a ^ (a >> 16)
    a = (a * MIX) & MASK32
    a = a ^ (a >> 16)
    a = (a * MIX) & MASK32
    return a ^ (a >> 16)


def context_hash(windows: torch.Tensor) -> torch.Tensor:
    """``windows`` ``[..., h]`` int64 token ids (oldest first) -> ``mix32`` of each window, ``[...]``
    int64 in ``[0, 2^32)`` (module docstring)."""
    a = torch.zeros(windows.shape[:-1], dtype=torch.int64, device=windows.device)
    for j in range(windows.shape[-1]):
        a = (a * BASE + windows[..., j].long() + 1) % P
    return _mix32(a)


def goldfish_keep(tokens: torch.Tensor, k: int, h: int, preceding: torch.Tensor | None = None) -> torch.Tensor:
    """Which tokens the Goldfish loss keeps: bool of ``tokens``' shape ``[..., L]``, False where
    token ``i`` is dropped (module docstring), on ``tokens``' device.

    ``preceding`` ``[..., m]``: the tokens right before ``tokens[..., 0]`` in the sequence (a
    sequence shard's predecessors); the context of the first positions then reads them, as it
    would in the whole sequence. Without it the first ``h`` positions are always kept.
    """
    if k < 1 or h < 1:
        raise DsExtConfigError(f"ds_ext.goldfish: k and h must be >= 1 (got k={k}, h={h})")
    full = tokens if preceding is None else torch.cat([preceding.to(tokens.device, tokens.dtype), tokens], dim=-1)
    offset = full.shape[-1] - tokens.shape[-1]
    keep = torch.ones(tokens.shape, dtype=torch.bool, device=tokens.device)
    if full.shape[-1] <= h:
        return keep
    windows = full[..., :-1].unfold(-1, h, 1)  # window j = full[j : j + h], the context of full[j + h]
    dropped = context_hash(windows) * k <= MASK32
    first = max(h, offset)  # the first full position that is in tokens and has a whole context
    keep[..., first - offset :] = ~dropped[..., first - h :]
    return keep


class GoldfishMask:
    """The rule with its parameters, callable on a model's token ids: ``mask(tokens)`` =
    :func:`goldfish_keep` ``(tokens, k, h)``; ``calls`` counts the evaluations (one per
    micro-batch forward, as the tests check)."""

    def __init__(self, k: int, h: int) -> None:
        self.k, self.h, self.calls = k, h, 0

    def __call__(self, tokens: torch.Tensor, preceding: torch.Tensor | None = None) -> torch.Tensor:
        self.calls += 1
        return goldfish_keep(tokens, self.k, self.h, preceding)

    def __repr__(self) -> str:
        return f"GoldfishMask(k={self.k}, h={self.h})"


def mask_labels(labels: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``labels`` with the dropped positions set to :data:`IGNORE_INDEX` (a new tensor)."""
    return labels.masked_fill(~keep, IGNORE_INDEX)
