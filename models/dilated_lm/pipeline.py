"""The dilated-attention LM as pipeline layers: embedding, blocks, final norm + output layer.

Same cut as ``models.gpt.pipeline``: the plain model's state-dict prefixes per layer
(``""`` for the ends, ``blocks.i.`` for block i) and its loss (cross-entropy over the
padded vocabulary's logits). Pipeline stages run without tensor or sequence
parallelism (``ParallelDims`` refuses pp with tp or sp), so positions start at 0.
"""
from __future__ import annotations

from dstrain.parallel.pipeline_layers import checkpointed, lm_pipeline_parts

from .model import Block, DilatedLMConfig, _dense_loss

PipeBlock = checkpointed(Block)


def pipeline_parts(cfg: DilatedLMConfig, activation_checkpointing: bool = False):
    """:class:`dstrain.parallel.pipeline.PipelineParts` of a DilatedLM with ``cfg`` (padded vocabulary)."""
    return lm_pipeline_parts(cfg, PipeBlock, cfg.padded_vocab, _dense_loss, activation_checkpointing)
