"""Simple statistics of token streams, used as baselines for training losses."""
from __future__ import annotations

import torch


def unigram_entropy(tokens: torch.Tensor) -> float:
    """Entropy in nats of the token frequencies of a stream (the loss of the best context-free model).

    A language model's cross-entropy (also in nats) has learned something beyond
    symbol frequencies only once it falls below this number.
    """
    if tokens.numel() == 0:
        raise ValueError("unigram_entropy needs a non-empty token stream")
    counts = torch.bincount(tokens.reshape(-1).long()).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())
