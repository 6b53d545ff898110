"""HRM building blocks: weightless RMSNorm, rotary positions, non-causal attention, SwiGLU.

Every projection is an ``nn.Linear`` without bias. A :class:`Block` is post-norm:
``h = norm(h + attn(h))``, then ``h = norm(h + mlp(h))``. A :class:`ReasoningModule`
(HRM's H or L module) adds its injected input to its state, then runs its blocks.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a gain, computed in fp32 and cast back."""
    dtype = x.dtype
    x = x.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


TRUNC_STD_RATIO = math.sqrt(1.0 - 4.0 * math.exp(-2.0) / math.sqrt(2.0 * math.pi) / math.erf(math.sqrt(2.0)))
"""Standard deviation of N(0, 1) truncated to [-2, 2] (about 0.8796)."""


@torch.no_grad()
def trunc_normal_(tensor: torch.Tensor, std: float) -> torch.Tensor:
    """Truncated normal (at two standard deviations) whose standard deviation is ``std``.

    The underlying normal is widened by ``1 / TRUNC_STD_RATIO`` so the truncated values
    have the requested spread (as JAX's and the HRM reference's initialisers do; plain
    truncation would give ``0.88 * std``). Sampled by the inverse CDF: no data-dependent
    control flow, so it also runs on meta and fake tensors. A 16-bit tensor (a bf16 ``zero.Init``
    build) gets fp32 draws rounded once, the values an fp32 build rounds to.
    """
    if tensor.dtype in (torch.float16, torch.bfloat16):
        return tensor.copy_(trunc_normal_(torch.empty_like(tensor, dtype=torch.float32), std))
    lo = 0.5 * (1.0 + math.erf(-2.0 / math.sqrt(2.0)))
    wide = std / TRUNC_STD_RATIO
    tensor.uniform_(2 * lo - 1, 1 - 2 * lo)
    tensor.erfinv_().mul_(wide * math.sqrt(2.0))
    return tensor.clamp_(-2 * wide, 2 * wide)


def lecun_init_(weight: torch.Tensor, std: float | None = None) -> torch.Tensor:
    """Truncated normal (at two standard deviations) with std ``1/sqrt(fan_in)`` by default.

    A ZeRO-3 shard built under ``zero.Init`` is empty (its shape ``[0]``): the fan-in is read
    from its full shape (``ds_shape``) and nothing is drawn; the factory initialises it again
    gathered."""
    fan_in = getattr(weight, "ds_shape", weight.shape)[-1]
    return trunc_normal_(weight, 1.0 / math.sqrt(fan_in) if std is None else std)


class Rotary(nn.Module):
    """cos/sin tables of rotary position embedding for ``positions`` positions."""

    def __init__(self, head_dim: int, positions: int, theta: float):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary positions need an even head dimension, got {head_dim}")
        self.head_dim, self.positions, self.theta = head_dim, positions, theta
        cos, sin = self._tables()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        # Integer ranges made fp32 by a cast: ``zero.Init`` turns every floating tensor a factory
        # function (arange, empty...) makes into the training dtype, and bf16 angles are off by up
        # to 0.2 rad at position 96. Casts are not intercepted, so the tables stay fp32.
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        t = torch.arange(self.positions).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    def reset_tables(self) -> None:
        """Recompute the tables (after a build on the meta device is materialised)."""
        cos, sin = self._tables()
        self.cos, self.sin = cos.to(self.cos.device), sin.to(self.sin.device)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, heads, T, D]`` by position: x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    """Multi-head non-causal self-attention with a fused QKV projection."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden_size {hidden} is not divisible by num_heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(x).split(c, dim=2))
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=False)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, c))


def swiglu_width(hidden: int, expansion: float, multiple_of: int) -> int:
    """Inner width: ``expansion * hidden * 2/3`` rounded up to a multiple of ``multiple_of``."""
    width = round(expansion * hidden * 2 / 3)
    return -(-width // multiple_of) * multiple_of


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused in one projection."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """Post-norm transformer block."""

    def __init__(self, hidden: int, heads: int, inner: int, eps: float):
        super().__init__()
        self.attn = Attention(hidden, heads)
        self.mlp = SwiGLU(hidden, inner)
        self.eps = eps

    def forward(self, x: torch.Tensor, rotary=None) -> torch.Tensor:
        x = rms_norm(x + self.attn(x, rotary), self.eps)
        return rms_norm(x + self.mlp(x), self.eps)


class ReasoningModule(nn.Module):
    """A stack of blocks that first adds its injected input: ``blocks(state + injection)``."""

    def __init__(self, layers: int, hidden: int, heads: int, inner: int, eps: float):
        super().__init__()
        self.layers = nn.ModuleList(Block(hidden, heads, inner, eps) for _ in range(layers))
        self.activation_checkpointing = False

    def forward(self, state: torch.Tensor, injection: torch.Tensor, rotary=None) -> torch.Tensor:
        x = state + injection
        use_ckpt = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for layer in self.layers:
            x = checkpoint(layer, x, rotary, use_reentrant=False) if use_ckpt else layer(x, rotary)
        return x
