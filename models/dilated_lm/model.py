"""A LongNet-style decoder: GPT blocks whose attention is multi-branch dilated attention.

Written for one device. Tensor and sequence parallelism are applied from outside
(``models.dilated_lm.parallelize``): they swap the Linear/Embedding layers for
fairscale's parallel ones, replace each block's attention core
(:class:`DilatedCore`) by a sequence-parallel one, and set the model's position
offset and loss function. The model itself only reads the shapes it is given.

Vocabulary: 257 byte ids, padded up to a multiple of 64 in the embedding and the
output layer so that any tensor-parallel degree up to 64 divides it (the padded
ids are never targets).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dstrain.ops.dilated import dilated_attention, make_branches, padded_length
from dstrain.parallel.pipeline_layers import POSITIONS, position_table, position_vectors

VOCAB_MULTIPLE = 64


@dataclass
class DilatedLMConfig:
    """Hyper-parameters of :class:`DilatedLM`; checked in ``__post_init__``."""

    n_layer: int
    n_embd: int
    n_head: int
    block_size: int
    """Longest sequence."""
    segment_lengths: list = field(default_factory=lambda: [64])
    """Segment length w of each branch."""
    dilation_rates: list = field(default_factory=lambda: [1])
    """Dilation rate r of each branch (same length as ``segment_lengths``)."""
    vocab_size: int = 257
    mlp_ratio: int = 4
    dropout: float = 0.0
    """Dropout on the MLP hidden layer and the residual branches."""
    bias: bool = False
    causal: bool = True
    sparse_block: int = 0
    """Block size of the block-sparse variant (0: dense segments)."""
    sparse_keep: float = 1.0
    """Fraction of key blocks each query block keeps (1.0: all)."""
    positions: str = "learned"
    """learned: a ``block_size x n_embd`` table (805M parameters at a million tokens and 768 wide) |
    sinusoidal: fixed encodings, no parameters (``dstrain.parallel.pipeline_layers.sinusoidal_positions``)."""

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_embd", "n_head", "block_size", "vocab_size", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        make_branches(self.segment_lengths, self.dilation_rates)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if not 0.0 < self.sparse_keep <= 1.0:
            raise ValueError(f"sparse_keep must be in (0, 1], got {self.sparse_keep}")
        if self.positions not in POSITIONS:
            raise ValueError(f"positions must be one of {', '.join(POSITIONS)}, got {self.positions!r}")
        if self.sparse_block < 0:
            raise ValueError(f"sparse_block must not be negative, got {self.sparse_block}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


class DilatedCore(nn.Module):
    """The attention maths on ``[B, T, H_local, D]`` q, k, v; heads start at ``head_offset`` globally."""

    def __init__(self, cfg: DilatedLMConfig) -> None:
        super().__init__()
        self.branches = make_branches(cfg.segment_lengths, cfg.dilation_rates)
        self.causal = cfg.causal
        self.sparse_block, self.sparse_keep = cfg.sparse_block, cfg.sparse_keep
        self.head_offset = 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = dilated_attention(q, k, v, self.branches, self.causal, self.head_offset,
                                self.sparse_block, self.sparse_keep)
        return out.transpose(1, 2)


class Attention(nn.Module):
    """Q, K, V projections (one Linear each, so a column split is a split by heads), core, output."""

    def __init__(self, cfg: DilatedLMConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.core = DilatedCore(cfg)
        self.out_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = self.core(q, k, v)
        return self.out_proj(y.reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DilatedLMConfig) -> None:
        super().__init__()
        self.up_proj = nn.Linear(cfg.n_embd, cfg.mlp_ratio * cfg.n_embd, bias=cfg.bias)
        self.down_proj = nn.Linear(cfg.mlp_ratio * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.p = cfg.dropout
        self.hidden_dropout = _plain_dropout  # replaced by a model-parallel-RNG dropout under TP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.hidden_dropout(F.gelu(self.up_proj(x)), self.p, self.training)
        return self.down_proj(h)


def _plain_dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    return F.dropout(x, p, training) if p > 0 else x


class Block(nn.Module):
    def __init__(self, cfg: DilatedLMConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.mlp(self.ln_2(x)))


def _dense_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1).long())


class DilatedLM(nn.Module):
    """Decoder-only LM with dilated attention.

    ``forward(input_ids, targets=None)`` -> logits ``[B, T, padded_vocab]`` or the mean
    cross-entropy over the tokens this rank holds (fp32). Under sequence
    parallelism ``input_ids`` is this rank's chunk and ``position_offset`` its start.
    """

    def __init__(self, cfg: DilatedLMConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.padded_vocab, cfg.n_embd)
        self.pos_emb = position_table(cfg.positions, cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.padded_vocab, bias=False)
        self.loss_fn = _dense_loss  # vocab-parallel under TP
        self.seq_shard = (0, 1)  # (rank, degree) of sequence parallelism
        self.activation_checkpointing = False
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """N(0, 0.02) weights, N(0, 0.02/sqrt(2L)) residual projections, zero biases, unit norms."""
        for name, module in self.named_modules():
            self.init_module(name, module)

    @torch.no_grad()
    def init_module(self, name: str, module: nn.Module) -> None:
        """Initialise what ``module`` owns directly (replayed per module under ZeRO-3 ``zero.Init``)."""
        if isinstance(module, nn.Linear):
            std = 0.02 / math.sqrt(2 * self.config.n_layer) if name.endswith(("out_proj", "down_proj")) else 0.02
            nn.init.normal_(module.weight, 0.0, std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, 0.02)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()

    @property
    def hidden_size(self) -> int:
        return self.config.n_embd

    @property
    def num_layers(self) -> int:
        return self.config.n_layer

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: ``6 * matmul params + 12 * L * d * sum_b min(w_b, T) / r_b^2``.

        The second term is attention's two matmuls (forward 4 d per key, times 3) as
        computed: in branch ``(w, r)`` a head attends from ``1 / r`` of the positions (its
        offset's), each to ``min(w, T) / r`` keys, so per token and head ``min(w, T) / r^2``
        keys on average (no causal halving, as PaLM counts). A sequence the segments do not tile
        is computed padded to ``P`` tokens (``dstrain.ops.dilated.padded_length``): ``P / T`` times the
        attention of ``P`` tokens per real token.
        """
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        c = self.config
        matmul = sum(p.numel() for m in self.modules() if isinstance(m, nn.Linear) for p in m.parameters())
        padded = padded_length(seq_len, make_branches(c.segment_lengths, c.dilation_rates))
        keys = padded / seq_len * sum(min(w, padded) / r ** 2 for w, r in zip(c.segment_lengths, c.dilation_rates))
        return int(6 * matmul + 12 * c.n_layer * c.n_embd * keys)

    def set_activation_checkpointing(self, flag: bool) -> None:
        self.activation_checkpointing = bool(flag)

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        t = input_ids.shape[1]
        rank, degree = self.seq_shard
        start = rank * t
        if start + t > self.config.block_size:
            raise ValueError(f"sequence length {t * degree} exceeds block_size {self.config.block_size}")
        pos = torch.arange(start, start + t, device=input_ids.device)
        tok = self.tok_emb(input_ids)
        x = self.drop(tok + position_vectors(self.pos_emb, pos, tok))
        use_ckpt = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if use_ckpt else block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        if targets.shape != input_ids.shape:
            raise ValueError(f"targets shape {tuple(targets.shape)} != input_ids shape {tuple(input_ids.shape)}")
        return self.loss_fn(logits, targets)
