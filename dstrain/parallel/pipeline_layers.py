"""The layers a decoder-only LM is cut into for a pipeline, shared by the models that have one.

Each layer keeps the plain model's attribute names (``tok_emb``, ``pos_emb``, ``drop``;
``ln_f``, ``lm_head``; a block's own), so :mod:`dstrain.parallel.pipeline` can map its
weights to and from the plain model's state dict with a prefix per layer.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


POSITIONS = ("learned", "sinusoidal")
#: Amplitude of the fixed sinusoidal table: its entries then have the RMS (0.02) of a learned table at init.
SINUSOID_SCALE = 0.02 * 2 ** 0.5


def sinusoidal_positions(pos: torch.Tensor, dim: int, dtype: torch.dtype, chunk: int = 1 << 16) -> torch.Tensor:
    """``[len(pos), dim]`` fixed encodings (Vaswani et al.): ``sin(p w_i)`` in even columns and
    ``cos(p w_i)`` in odd ones, ``w_i = 10000^(-2i / dim)``, times :data:`SINUSOID_SCALE`.
    The angles are formed in fp64 (positions up to millions keep their phase), ``chunk``
    positions at a time so that the fp64 temporaries stay small; no parameters."""
    freqs = torch.exp(torch.arange(0, dim, 2, device=pos.device, dtype=torch.float64)
                      * (-math.log(10000.0) / dim))
    table = torch.empty(len(pos), dim, device=pos.device, dtype=dtype)
    for a in range(0, len(pos), chunk):
        angles = pos[a:a + chunk].to(torch.float64)[:, None] * freqs
        table[a:a + chunk, 0::2] = (torch.sin(angles) * SINUSOID_SCALE).to(dtype)
        table[a:a + chunk, 1::2] = (torch.cos(angles[:, : dim // 2]) * SINUSOID_SCALE).to(dtype)
    return table


def position_table(positions: str, block_size: int, n_embd: int) -> nn.Embedding | None:
    """The learned position table of ``positions="learned"``; None for fixed sinusoids (no parameters)."""
    return nn.Embedding(block_size, n_embd) if positions == "learned" else None


def position_vectors(table: nn.Embedding | None, pos: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[len(pos), D]`` to add to token embeddings ``like``: rows of ``table``, or sinusoids without one."""
    return table(pos) if table is not None else sinusoidal_positions(pos, like.shape[-1], like.dtype)


class TokenPositionEmbedding(nn.Module):
    """Token + position embeddings (a learned table, or fixed sinusoids with no parameters), then dropout."""

    def __init__(self, vocab: int, n_embd: int, block_size: int, dropout: float,
                 positions: str = "learned") -> None:
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab, n_embd)
        self.pos_emb = position_table(positions, block_size, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.block_size}")
        tok = self.tok_emb(input_ids)
        return self.drop(tok + position_vectors(self.pos_emb, torch.arange(t, device=input_ids.device), tok))


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
    layers = ([LayerSpec(TokenPositionEmbedding, vocab, cfg.n_embd, cfg.block_size, cfg.dropout,
                         getattr(cfg, "positions", "learned"))]
              + [LayerSpec(pipe_block, cfg, activation_checkpointing) for _ in range(cfg.n_layer)]
              + [LayerSpec(NormHead, cfg.n_embd, vocab, cfg.bias)])
    prefixes = [""] + [f"blocks.{i}." for i in range(cfg.n_layer)] + [""]
    kinds = ["embedding"] + ["block"] * cfg.n_layer + ["head"]
    return PipelineParts(layers, prefixes, loss, kinds,
                         example_input=lambda b, t: torch.zeros(b, t, dtype=torch.long))
