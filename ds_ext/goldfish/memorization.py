"""The memorization measure of 000 §VIII-B: prompt a model with each document's prefix, let it
write the last ``n`` tokens greedily, and count a document as memorized iff all ``n`` come out
exactly (000: "We consider a sequence memorized if the model perfectly reproduces the correct
50 tokens"; Carlini et al.'s extractable memorization).
"""

from __future__ import annotations

from typing import Callable

import torch

Logits = Callable[[torch.Tensor], torch.Tensor]


@torch.no_grad()
def greedy_continuation(logits: Logits, prefix: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` tokens ``logits`` writes after ``prefix`` ``[batch, p]``, each the argmax given
    all before it; ``logits(tokens [batch, t]) -> [batch, t, vocab]``. Returns ``[batch, n]``."""
    tokens = prefix
    for _ in range(n):
        nxt = logits(tokens)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens[:, prefix.shape[1] :]


def exact_match(logits: Logits, documents: torch.Tensor, n: int, batch_size: int = 64) -> torch.Tensor:
    """Bool ``[num_docs]``: whether greedy decoding from ``documents[:, :-n]`` reproduces
    ``documents[:, -n:]`` exactly (every one of the ``n`` tokens)."""
    out = []
    for docs in documents.split(batch_size):
        written = greedy_continuation(logits, docs[:, :-n], n)
        out.append((written == docs[:, -n:]).all(dim=1))
    return torch.cat(out)
