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

from dstrain.parallel.pipeline_layers import checkpointed, lm_pipeline_parts

from .model import Block, GPTConfig

PipeBlock = checkpointed(Block)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in fp32, as ``GPT.forward(input_ids, targets)`` computes it."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1).long())


def pipeline_parts(cfg: GPTConfig, activation_checkpointing: bool = False):
    """:class:`dstrain.parallel.pipeline.PipelineParts` of a GPT with ``cfg``."""
    cfg.validate()
    return lm_pipeline_parts(cfg, PipeBlock, cfg.vocab_size, lm_loss, activation_checkpointing)
