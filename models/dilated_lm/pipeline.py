"""The dilated-attention LM as pipeline layers: embedding, blocks, final norm + output layer.

Same cut as ``models.gpt.pipeline``: the plain model's state-dict prefixes per layer
(``""`` for the ends, ``blocks.i.`` for block i) and its loss (cross-entropy over the
padded vocabulary's logits). Pipeline stages run without tensor or sequence
parallelism (``ParallelDims`` refuses pp with tp or sp), so positions start at 0.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .model import Block, DilatedLMConfig, _dense_loss


class Embedding(nn.Module):
    """Token + learned position embeddings (``tok_emb`` over the padded vocabulary, ``pos_emb``)."""

    def __init__(self, cfg: DilatedLMConfig) -> None:
        super().__init__()
        self.block_size = cfg.block_size
        self.tok_emb = nn.Embedding(cfg.padded_vocab, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.block_size}")
        return self.drop(self.tok_emb(input_ids) + self.pos_emb(torch.arange(t, device=input_ids.device)))


class PipeBlock(Block):
    """A dilated-attention block that recomputes its activations in backward when ``checkpointing``."""

    def __init__(self, cfg: DilatedLMConfig, checkpointing: bool = False) -> None:
        super().__init__(cfg)
        self.checkpointing = checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(super().forward, x, use_reentrant=False)
        return super().forward(x)


class Head(nn.Module):
    """Final LayerNorm and output layer -> logits over the padded vocabulary (``ln_f``, ``lm_head``)."""

    def __init__(self, cfg: DilatedLMConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.padded_vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def pipeline_parts(cfg: DilatedLMConfig, activation_checkpointing: bool = False):
    """:class:`dstrain.parallel.pipeline.PipelineParts` of a DilatedLM with ``cfg``."""
    from deepspeed.pipe import LayerSpec

    from dstrain.parallel.pipeline import PipelineParts
    layers = ([LayerSpec(Embedding, cfg)]
              + [LayerSpec(PipeBlock, cfg, activation_checkpointing) for _ in range(cfg.n_layer)]
              + [LayerSpec(Head, cfg)])
    prefixes = [""] + [f"blocks.{i}." for i in range(cfg.n_layer)] + [""]
    kinds = ["embedding"] + ["block"] * cfg.n_layer + ["head"]
    return PipelineParts(layers, prefixes, _dense_loss, kinds,
                         example_input=lambda b, t: torch.zeros(b, t, dtype=torch.long))
