"""The GPT as pipeline layers: embedding, blocks, final norm + output layer.

``pipeline_parts(cfg)`` gives DeepSpeed's ``LayerSpec``s in order with the plain
model's state-dict prefix of each (``tok_emb.weight`` stays ``tok_emb.weight``, block
i's ``ln_1.weight`` is ``blocks.i.ln_1.weight``), so a pipelined run starts from the
plain model's weights and exports back to them. The loss is the plain model's
cross-entropy over the logits (``loss_chunk`` is a memory option of the plain
forward: the pipeline's last stage computes the full logits, same value).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .model import Block, GPTConfig


class Embedding(nn.Module):
    """Token + learned position embeddings (the plain model's ``tok_emb``, ``pos_emb``, ``drop``)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.block_size = cfg.block_size
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.block_size}")
        return self.drop(self.tok_emb(input_ids) + self.pos_emb(torch.arange(t, device=input_ids.device)))


class PipeBlock(Block):
    """A transformer block that recomputes its activations in backward when ``checkpointing``."""

    def __init__(self, cfg: GPTConfig, checkpointing: bool = False) -> None:
        super().__init__(cfg)
        self.checkpointing = checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(super().forward, x, use_reentrant=False)
        return super().forward(x)


class Head(nn.Module):
    """Final LayerNorm and output layer -> logits (``ln_f``, ``lm_head``)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in fp32, as ``GPT.forward(input_ids, targets)`` computes it."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1).long())


def pipeline_parts(cfg: GPTConfig, activation_checkpointing: bool = False):
    """:class:`dstrain.parallel.pipeline.PipelineParts` of a GPT with ``cfg``."""
    from deepspeed.pipe import LayerSpec

    from dstrain.parallel.pipeline import PipelineParts
    cfg.validate()
    layers = ([LayerSpec(Embedding, cfg)]
              + [LayerSpec(PipeBlock, cfg, activation_checkpointing) for _ in range(cfg.n_layer)]
              + [LayerSpec(Head, cfg)])
    prefixes = [""] + [f"blocks.{i}." for i in range(cfg.n_layer)] + [""]
    kinds = ["embedding"] + ["block"] * cfg.n_layer + ["head"]
    return PipelineParts(layers, prefixes, lm_loss, kinds,
                         example_input=lambda b, t: torch.zeros(b, t, dtype=torch.long))
