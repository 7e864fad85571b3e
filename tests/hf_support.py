"""A Hugging Face ``Trainer`` dataset of byte windows (causal LM: labels = inputs)."""

import torch

from ds_ext.data import ByteCorpus


class ByteWindows(torch.utils.data.Dataset):
    """``size`` windows of ``seq`` byte tokens from the stdlib corpus, fixed per index."""

    def __init__(self, size: int = 64, seq: int = 32) -> None:
        self.corpus = ByteCorpus(max_bytes=200_000)
        self.size, self.seq = size, seq

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        x = self.corpus.batch(i, 1, self.seq)[0]
        return {"input_ids": x, "labels": x}
