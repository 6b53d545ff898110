"""Attention that also returns its log-sum-exp, differentiable in both outputs, and lse merging.

Several attention results over disjoint (or repeated) key sets combine exactly
into one softmax over the union of the keys when each is weighted by its softmax
denominator: ``out = sum_i exp(lse_i - lse) * out_i`` with
``lse = log sum_i exp(lse_i)``. Dilated attention merges its branches this way,
and sequence parallelism merges the pieces computed against keys held by
different ranks. For the gradient to be right the merge must differentiate
through each piece's ``lse`` as well as its output.

:func:`attention_with_lse` uses PyTorch's fused CPU flash kernel
(``aten::_scaled_dot_product_flash_attention_for_cpu``, which returns the
log-sum-exp but whose backward ignores a gradient on it) and folds the lse
gradient into the kernel's backward: with ``g`` the gradient on ``lse``, the
score gradient is ``P * (dO V^T - rowsum(dO * O) + g)``, so appending one column
to the head dimension, ``[dO, 1]`` for the output gradient and ``[O, -g]`` for
the output, makes the unchanged kernel compute it. Elsewhere (other devices) a
plain autograd version that materialises the scores of one call is used.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

_CPU_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    if q.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"attention expects q [B, H, M, D] and k, v [B, H, N, D], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal attention needs as many queries as keys, got {q.shape[2]} and {k.shape[2]}")


class _FusedCPUAttention(torch.autograd.Function):
    """Flash attention on CPU with an lse output whose gradient is honoured."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, mask):
        out, lse = _CPU_FWD(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.causal, ctx.scale = causal, scale
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, mask = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        if grad_lse is None:
            dq, dk, dv = _CPU_BWD(grad_out.contiguous(), q, k, v, out, lse, 0.0, ctx.causal,
                                  attn_mask=mask, scale=ctx.scale)
            return dq, dk, dv, None, None, None
        # One extra head column: zero in q, k, v (scores unchanged), 1 in dO and -g in O,
        # so the kernel's rowsum(dO * O) becomes rowsum(dO * O) - g.
        pad = lambda t: F.pad(t, (0, 1))  # noqa: E731
        d_out = torch.cat([grad_out, torch.ones_like(grad_out[..., :1])], dim=-1)
        o_aug = torch.cat([out, -grad_lse.to(out.dtype).unsqueeze(-1)], dim=-1)
        dq, dk, dv = _CPU_BWD(d_out.contiguous(), pad(q), pad(k), pad(v), o_aug, lse, 0.0, ctx.causal,
                              attn_mask=mask, scale=ctx.scale)
        return dq[..., :-1], dk[..., :-1], dv[..., :-1], None, None, None


def _math_attention(q, k, v, causal: bool, scale: float, mask):
    """Reference-style attention in fp32 for devices without the fused kernel."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        n = q.shape[-2]
        keep = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if mask is not None:
        scores = scores + mask.float()
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return torch.matmul(probs, v.float()).to(q.dtype), lse


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                       scale: float | None = None, mask: torch.Tensor | None = None,
                       fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention returning ``(out [B, H, M, D], lse [B, H, M] fp32)``.

    Args:
        q, k, v: ``[B, H, M, D]``, ``[B, H, N, D]``, ``[B, H, N, D]``.
        causal: query ``i`` sees keys ``0..i`` (needs ``M == N``).
        scale: score scale, default ``1 / sqrt(D)``.
        mask: optional additive float mask broadcastable to ``[B, H, M, N]`` (0 or -inf);
            every query must keep at least one key.
        fused: force (True) or forbid (False) the fused CPU kernel; default: on CPU tensors.
    """
    _check_shapes(q, k, v, causal)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if mask is not None:
        mask = mask.to(q.dtype)
    if fused is None:
        fused = q.device.type == "cpu"
    if fused:
        return _FusedCPUAttention.apply(q, k, v, causal, scale, mask)
    return _math_attention(q, k, v, causal, scale, mask)


def merge_attention(pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention results over separate key sets into one softmax over all of them.

    ``pieces`` holds ``(out_i [..., M, D], lse_i [..., M])``; an ``lse`` of ``-inf``
    marks a query a piece did not cover (its ``out`` is ignored). Weights
    ``exp(lse_i - lse)`` are computed in fp32 and differentiated through; a query
    no piece covers gets 0 and ``lse = -inf``. Returns ``(out, lse)``.
    """
    if not pieces:
        raise ValueError("merge_attention needs at least one piece")
    if len(pieces) == 1:
        return pieces[0]
    dtype = pieces[0][0].dtype
    lses = torch.stack([lse.float() for _, lse in pieces])
    top = lses.detach().amax(dim=0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # a pure stabiliser
    weights = torch.exp(lses - top)
    total = weights.sum(dim=0)
    covered = total > 0
    safe_total = torch.where(covered, total, torch.ones_like(total))
    out = sum((w / safe_total).unsqueeze(-1) * o.float() for w, (o, _) in zip(weights, pieces))
    lse = torch.where(covered, top + torch.log(safe_total), torch.full_like(total, float("-inf")))
    return out.to(dtype), lse
