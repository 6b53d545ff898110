"""The layers a decoder-only LM is cut into for a pipeline, shared by the models that have one.

Each layer keeps the plain model's attribute names (``tok_emb``, ``pos_emb``, ``drop``;
``ln_f``, ``lm_head``; a block's own), so :mod:`dstrain.parallel.pipeline` can map its
weights to and from the plain model's state dict with a prefix per layer.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class TokenPositionEmbedding(nn.Module):
    """Token + learned position embeddings, then dropout."""

    def __init__(self, vocab: int, n_embd: int, block_size: int, dropout: float) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.block_size}")
        return self.drop(self.tok_emb(input_ids) + self.pos_emb(torch.arange(t, device=input_ids.device)))


class NormHead(nn.Module):
    """Final LayerNorm and output layer -> logits."""

    def __init__(self, n_embd: int, vocab: int, bias: bool) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def checkpointed(block_cls: type[nn.Module]) -> type[nn.Module]:
    """``block_cls(cfg)`` with an extra ``checkpointing`` argument: recompute activations in backward."""

    class PipeBlock(block_cls):
        def __init__(self, cfg, checkpointing: bool = False) -> None:
            super().__init__(cfg)
            self.checkpointing = checkpointing

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.checkpointing and self.training and torch.is_grad_enabled():
                return checkpoint(super().forward, x, use_reentrant=False)
            return super().forward(x)

    PipeBlock.__name__ = PipeBlock.__qualname__ = f"Pipe{block_cls.__name__}"
    return PipeBlock


def lm_pipeline_parts(cfg, pipe_block: type[nn.Module], vocab: int, loss: Callable,
                      activation_checkpointing: bool = False):
    """:class:`~dstrain.parallel.pipeline.PipelineParts` of embedding, ``cfg.n_layer`` blocks and the head,
    with the plain model's prefixes (``""`` for the ends, ``blocks.i.`` for block i)."""
    from deepspeed.pipe import LayerSpec

    from dstrain.parallel.pipeline import PipelineParts
    layers = ([LayerSpec(TokenPositionEmbedding, vocab, cfg.n_embd, cfg.block_size, cfg.dropout)]
              + [LayerSpec(pipe_block, cfg, activation_checkpointing) for _ in range(cfg.n_layer)]
              + [LayerSpec(NormHead, cfg.n_embd, vocab, cfg.bias)])
    prefixes = [""] + [f"blocks.{i}." for i in range(cfg.n_layer)] + [""]
    kinds = ["embedding"] + ["block"] * cfg.n_layer + ["head"]
    return PipelineParts(layers, prefixes, loss, kinds,
                         example_input=lambda b, t: torch.zeros(b, t, dtype=torch.long))
