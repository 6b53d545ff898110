"""A dense GPT decoder written for a single device.

Pre-LayerNorm blocks, learned position embeddings, causal attention through
``torch.nn.functional.scaled_dot_product_attention`` and a GELU MLP. The output
head is a separate ``nn.Linear`` (not tied to the token embedding) so exported
state dicts contain no shared tensors. Parallelism (activation checkpointing now,
tensor parallelism later) is applied from outside by ``models.gpt.parallelize``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dstrain.ops.lm_head import linear_cross_entropy


@dataclass
class GPTConfig:
    """Hyper-parameters of :class:`GPT`. Values are checked in ``__post_init__``."""

    block_size: int
    """Maximum sequence length (number of learned position embeddings)."""
    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Number of attention heads; must divide ``n_embd``."""
    n_embd: int
    """Hidden size (width of the residual stream)."""
    vocab_size: int = 257
    """Vocabulary size; 257 = 256 byte values plus the end-of-sequence id 256."""
    mlp_ratio: int = 4
    """MLP hidden size is ``mlp_ratio * n_embd``."""
    dropout: float = 0.0
    """Dropout probability on attention weights and residual branches, in [0, 1)."""
    bias: bool = False
    """Whether Linear and LayerNorm layers carry a bias."""
    loss_chunk: int = 0
    """Tokens per chunk of the LM head's cross-entropy (``dstrain.ops.lm_head``): the ``[B*T, vocab]``
    fp32 logits are never held whole. 0: one plain ``F.cross_entropy`` over all logits."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending field if a value is impossible."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "dropout":
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ValueError(f"dropout must be a float, got {type(value).__name__}")
                if not 0.0 <= value < 1.0:
                    raise ValueError(f"dropout must be in [0, 1), got {value}")
            elif f.name == "bias":
                if not isinstance(value, bool):
                    raise ValueError(f"bias must be a bool, got {type(value).__name__}")
            elif f.name == "loss_chunk":
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"loss_chunk must be a non-negative int, got {value!r}")
            else:
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"{f.name} must be an int, got {type(value).__name__}")
                if value <= 0:
                    raise ValueError(f"{f.name} must be positive, got {value}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.n_embd // self.n_head


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused QKV projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.out_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # [B, T, C] -> [B, H, T, C/H]
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.out_proj(y))


class MLP(nn.Module):
    """Two-layer GELU feed-forward network."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.n_embd
        self.up_proj = nn.Linear(cfg.n_embd, hidden, bias=cfg.bias)
        self.down_proj = nn.Linear(hidden, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down_proj(F.gelu(self.up_proj(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only language model.

    ``forward(input_ids, targets=None)`` returns logits ``[B, T, vocab]`` or, with
    targets, the mean cross-entropy over all ``B*T`` tokens (computed in fp32).
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        cfg.validate()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.activation_checkpointing = False
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise weights deterministically from the global torch seed.

        Linear and Embedding weights ~ N(0, 0.02), biases zero, LayerNorm (1, 0);
        the residual output projections (attention ``out_proj`` and MLP
        ``down_proj``) use N(0, 0.02 / sqrt(2 * n_layer)).
        """
        for name, module in self.named_modules():
            self.init_module(name, module)

    @torch.no_grad()
    def init_module(self, name: str, module: nn.Module) -> None:
        """Initialise the parameters ``module`` owns directly (see :meth:`reset_parameters`).

        Separate so that a sharded build (DeepSpeed ``zero.Init``) can gather one
        module at a time and initialise it in the same order and with the same
        random numbers as an unsharded build.
        """
        if isinstance(module, nn.Linear):
            resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
            std = resid_std if name.endswith(("out_proj", "down_proj")) else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()

    # --- sizes -----------------------------------------------------------------
    @property
    def hidden_size(self) -> int:
        """Width of the residual stream (``n_embd``)."""
        return self.config.n_embd

    @property
    def num_layers(self) -> int:
        """Number of transformer blocks."""
        return self.config.n_layer

    def num_params(self) -> int:
        """Number of parameters (all of them, embeddings and lm_head included)."""
        return sum(p.numel() for p in self.parameters())

    def num_matmul_params(self) -> int:
        """Parameters of every ``nn.Linear`` (attention qkv/out, MLP up/down, lm_head).

        These are the weights that take part in a matmul for each token; the
        token and position embeddings are lookups and LayerNorm is elementwise,
        so neither is counted. For the default config this is
        ``12 * n_layer * n_embd**2 + vocab_size * n_embd`` (plus biases if any).
        """
        return sum(
            p.numel() for m in self.modules() if isinstance(m, nn.Linear) for p in m.parameters()
        )

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward) per token at sequence length ``seq_len``.

        PaLM / nanoGPT count: ``6 * N + 12 * n_layer * n_embd * seq_len``.
        ``N`` is :meth:`num_matmul_params` (all matmul weights, lm_head included,
        embeddings excluded): each such weight costs 2 FLOPs forward and 4
        backward per token. The second term is attention's two matmuls (scores
        ``QK^T`` and ``AV``), ``2 * 2 * n_embd * seq_len`` FLOPs forward per token
        per layer, times 3 for forward + backward, counted without the causal
        halving (as PaLM does).
        """
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        c = self.config
        return 6 * self.num_matmul_params() + 12 * c.n_layer * c.n_embd * seq_len

    # --- behaviour ---------------------------------------------------------------
    def set_activation_checkpointing(self, flag: bool) -> None:
        """Recompute each block's activations in backward (training mode only)."""
        self.activation_checkpointing = bool(flag)

    def forward(
        self, input_ids: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Return logits ``[B, T, V]``, or the scalar mean cross-entropy if ``targets``."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        _, t = input_ids.shape
        if t > self.config.block_size:
            raise ValueError(
                f"sequence length {t} exceeds block_size {self.config.block_size}"
            )
        pos = torch.arange(t, device=input_ids.device)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(pos))
        use_ckpt = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            if use_ckpt:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x)
        if targets.shape != input_ids.shape:
            raise ValueError(
                f"targets shape {tuple(targets.shape)} != input_ids shape {tuple(input_ids.shape)}"
            )
        if self.config.loss_chunk:
            return linear_cross_entropy(x, self.lm_head.weight, targets, self.config.loss_chunk)
        logits = self.lm_head(x)
        return F.cross_entropy(
            logits.float().view(-1, logits.size(-1)), targets.reshape(-1).long()
        )
