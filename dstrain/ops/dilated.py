"""Dilated attention (LongNet) on one device: segments folded into the batch, one call per branch.

A *branch* ``(w, r)`` cuts the sequence into segments of ``w`` tokens (the whole
sequence when it is shorter than ``w``); inside a segment only every ``r``-th
position takes part, and head ``j`` starts at offset ``j mod r`` (the *global*
head index, so heads split across ranks keep their offsets), so the heads
together cover every position. Each branch is one fused attention call over
``[B * segments, H, w / r, D]`` that also returns its log-sum-exp, and the branches are
merged with weights proportional to their softmax denominators. All branches run as
one autograd function (:mod:`dstrain.ops.dilated_fused`): one output and one running
lse, no per-branch full-size buffers, saved tensors q, k, v, out, lse; the backward
hands each branch's kernel the merged output and lse. A position a branch does not
select for a head contributes nothing there.

Block-sparse variant: with ``sparse_block = b`` and ``sparse_keep = f < 1``, the
``w / r`` dilated positions of a segment form blocks of ``b``; each query block keeps
only the ``max(1, ceil(f * n_blocks))`` key blocks nearest to it (its own block
first, then the previous ones; non-causal: by distance, lower index on ties),
among the blocks causality allows. It runs one masked kernel call per branch
(:func:`branch_attention`, full-size per-branch results merged through autograd by
:func:`~dstrain.ops.attention.merge_attention`).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from dstrain.ops.attention import attention_with_lse, merge_attention
from dstrain.ops.dilated_fused import fused_dilated_attention


@dataclass(frozen=True)
class Branch:
    """One dilated-attention branch: segment length ``w`` and dilation rate ``r``."""

    segment: int
    dilation: int

    def effective(self, n: int) -> tuple[int, int]:
        """``(segment, dilation)`` used on a sequence of ``n`` tokens; ValueError if it does not tile."""
        w = min(self.segment, n)
        if n % w or w % self.dilation:
            raise ValueError(f"branch (segment {self.segment}, dilation {self.dilation}) does not tile a "
                             f"sequence of {n} tokens: the sequence must be a multiple of the segment "
                             f"length (or shorter than it) and the segment a multiple of the dilation "
                             f"(causal dense attention pads a sequence that does not tile; non-causal and "
                             f"block-sparse attention cannot)")
        return w, self.dilation


def tiles(n: int, branches: Sequence[Branch]) -> bool:
    """Whether every branch tiles a sequence of ``n`` tokens (see :meth:`Branch.effective`)."""
    return all(n % min(br.segment, n) == 0 and min(br.segment, n) % br.dilation == 0 for br in branches)


@functools.lru_cache(maxsize=256)
def padded_length(n: int, branches: tuple[Branch, ...]) -> int:
    """The shortest length ``>= n`` that every branch tiles. A multiple of the segments' least common
    multiple always does (each segment is a multiple of its dilation), so the search is bounded by it."""
    step = math.lcm(*(br.segment for br in branches))
    return next(p for p in range(n, -(-n // step) * step + 1) if tiles(p, branches))


def make_branches(segment_lengths: Sequence[int], dilation_rates: Sequence[int]) -> tuple[Branch, ...]:
    """Validate and pair up segment lengths and dilation rates."""
    if len(segment_lengths) != len(dilation_rates) or not segment_lengths:
        raise ValueError(f"segment_lengths {list(segment_lengths)} and dilation_rates {list(dilation_rates)} "
                         "must be non-empty and of the same length")
    for w, r in zip(segment_lengths, dilation_rates):
        if isinstance(w, bool) or isinstance(r, bool) or int(w) != w or int(r) != r or w < 1 or r < 1:
            raise ValueError(f"segment lengths and dilation rates must be positive integers, got ({w}, {r})")
        if w % r:
            raise ValueError(f"segment length {w} must be a multiple of its dilation rate {r}")
    return tuple(Branch(int(w), int(r)) for w, r in zip(segment_lengths, dilation_rates))


def head_offsets(num_heads: int, dilation: int, head_offset: int, device=None) -> torch.Tensor:
    """Offset ``(head_offset + j) mod r`` of each local head ``j``."""
    return (torch.arange(num_heads, device=device) + head_offset) % dilation


def _diagonal_layout(h: int, r: int, head_offset: int) -> bool:
    """Heads ``a * r + c`` use offset ``c``: the selection is a strided diagonal view, no indexing."""
    return r > 1 and h % r == 0 and head_offset % r == 0


def _diagonal(x6: torch.Tensor, b: int, h: int, s: int, m: int, r: int, d: int) -> torch.Tensor:
    """View ``[B, H, S, m, r, D]`` as its head/offset diagonal ``[B, H/r, S, m, D, r]``."""
    return torch.diagonal(x6.reshape(b, h // r, r, s, m, r, d), dim1=2, dim2=5)


def gather_dilated(x: torch.Tensor, w: int, r: int, head_offset: int = 0) -> torch.Tensor:
    """``[B, H, N, D]`` -> ``[B * N/w, H, w/r, D]``: each head's dilated positions of each segment."""
    b, h, n, d = x.shape
    s, m = n // w, w // r
    if r == 1:
        return x.reshape(b, h, s, m, d).transpose(1, 2).reshape(b * s, h, m, d)
    if _diagonal_layout(h, r, head_offset):
        diag = _diagonal(x.reshape(b, h, s, m, r, d), b, h, s, m, r, d)  # [B, H/r, S, m, D, r]
        return diag.permute(0, 2, 1, 5, 3, 4).reshape(b * s, h, m, d)
    offs = head_offsets(h, r, head_offset, x.device)
    heads = torch.arange(h, device=x.device)
    picked = x.reshape(b, h, s, m, r, d)[:, heads, :, :, offs]  # [H, B, S, m, D]
    return picked.permute(1, 2, 0, 3, 4).reshape(b * s, h, m, d)


def scatter_dilated(y: torch.Tensor, n: int, w: int, r: int, head_offset: int, fill: float) -> torch.Tensor:
    """Inverse of :func:`gather_dilated`: ``[B * N/w, H, w/r, D]`` -> ``[B, H, N, D]``, ``fill`` elsewhere."""
    bs, h, m, d = y.shape
    s = n // w
    b = bs // s
    if r == 1:
        return y.reshape(b, s, h, m, d).transpose(1, 2).reshape(b, h, n, d)
    if _diagonal_layout(h, r, head_offset):
        full = y.new_full((b, h, s, m, r, d), fill)
        _diagonal(full, b, h, s, m, r, d).copy_(y.reshape(b, s, h // r, r, m, d).permute(0, 2, 1, 4, 5, 3))
        return full.reshape(b, h, n, d)
    offs = head_offsets(h, r, head_offset, y.device)
    heads = torch.arange(h, device=y.device)
    full = y.new_full((b, h, s, m, r, d), fill)
    full[:, heads, :, :, offs] = y.reshape(b, s, h, m, d).permute(2, 0, 1, 3, 4)
    return full.reshape(b, h, n, d)


def _dense(m: int, block: int, keep: float) -> bool:
    """True when the block-sparse variant keeps every key of an ``m``-position dilated segment."""
    return keep >= 1.0 or block <= 0 or m <= block


def block_sparse_mask(m: int, block: int, keep: float, causal: bool, device=None,
                      dtype=torch.float32) -> torch.Tensor | None:
    """Additive ``[m, m]`` mask (0 kept, -inf dropped) of the block-sparse variant; None if nothing is dropped.

    Causality is folded in, so the attention call using it runs non-causal.
    """
    if _dense(m, block, keep):
        return None
    if m % block:
        raise ValueError(f"sparse_block {block} must divide the dilated segment length {m}")
    nb = m // block
    n_keep = max(1, math.ceil(keep * nb))
    qb = torch.arange(nb, device=device).unsqueeze(1)
    kb = torch.arange(nb, device=device).unsqueeze(0)
    dist = (qb - kb).abs()
    allowed = kb <= qb if causal else torch.ones(nb, nb, dtype=torch.bool, device=device)
    # Rank allowed key blocks by (distance, index); keep the first n_keep of each row.
    key = torch.where(allowed, dist * (nb + 1) + kb, torch.full_like(dist, nb * (nb + 2)))
    order = key.argsort(dim=1).argsort(dim=1)
    blocks = allowed & (order < n_keep)
    keep_pos = blocks.repeat_interleave(block, 0).repeat_interleave(block, 1)
    if causal:
        keep_pos &= torch.ones(m, m, dtype=torch.bool, device=device).tril()
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(keep_pos, zero, torch.full_like(zero, float("-inf")))


def branch_attention(q, k, v, branch: Branch, causal: bool, head_offset: int = 0,
                     sparse_block: int = 0, sparse_keep: float = 1.0, scale: float | None = None):
    """One branch on ``[B, H, N, D]`` inputs -> ``(out [B, H, N, D], lse [B, H, N])`` in full layout."""
    n = q.shape[2]
    w, r = branch.effective(n)
    qs, ks, vs = (gather_dilated(t, w, r, head_offset) for t in (q, k, v))
    mask = block_sparse_mask(w // r, sparse_block, sparse_keep, causal, q.device, q.dtype)
    out, lse = attention_with_lse(qs, ks, vs, causal=causal and mask is None, scale=scale, mask=mask)
    out = scatter_dilated(out, n, w, r, head_offset, 0.0)
    lse = scatter_dilated(lse.unsqueeze(-1), n, w, r, head_offset, float("-inf")).squeeze(-1)
    return out, lse


def dilated_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, branches: Sequence[Branch],
                      causal: bool = True, head_offset: int = 0, sparse_block: int = 0,
                      sparse_keep: float = 1.0, scale: float | None = None,
                      return_lse: bool = False, fused: bool = True):
    """Multi-branch dilated attention on ``[B, H, N, D]`` tensors (heads ``head_offset..`` globally).

    Returns ``out [B, H, N, D]`` (and the merged ``lse [B, H, N]`` if ``return_lse``).
    The default ``scale`` is ``1 / sqrt(D)``. Dense segments run as one fused autograd
    function over all branches (:mod:`dstrain.ops.dilated_fused`; ``fused=False`` puts the
    math stand-in in place of the kernels); the block-sparse variant runs a masked kernel
    per branch.
    """
    if q.dim() != 4 or q.shape != k.shape or k.shape != v.shape:
        raise ValueError(f"dilated_attention expects q, k, v of one shape [B, H, N, D], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    n = q.shape[2]
    if causal and not tiles(n, branches) and (sparse_block == 0 or sparse_keep >= 1.0):
        # The last segment of a branch is partial: pad the sequence at the end to a length every branch tiles
        # and drop the padded queries. Exact under causal masking: no real query sees a later (padded) key.
        # (Not the block-sparse variant: how many blocks a query keeps depends on the segment's length.)
        pad = padded_length(n, tuple(branches)) - n
        out, lse = dilated_attention(*(F.pad(t, (0, 0, 0, pad)) for t in (q, k, v)), branches, causal,
                                     head_offset, sparse_block, sparse_keep, scale, return_lse=True, fused=fused)
        out, lse = out[:, :, :n], lse[:, :, :n]
        return (out, lse) if return_lse else out
    sizes = [br.effective(n) for br in branches]
    if all(_dense(w // r, sparse_block, sparse_keep) for w, r in sizes):
        out, lse = fused_dilated_attention(q, k, v, sizes, causal, head_offset, scale, fused=fused)
        return (out, lse) if return_lse else out
    # The block-sparse variant: one masked kernel call per branch, merged through autograd.
    pieces = [branch_attention(q, k, v, br, causal, head_offset, sparse_block, sparse_keep, scale)
              for br in branches]
    out, lse = merge_attention(pieces)
    return (out, lse) if return_lse else out
