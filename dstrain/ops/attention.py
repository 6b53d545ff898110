"""Fused attention that returns its log-sum-exp: one device-dispatching pair of primitives, and lse merging.

:func:`flash_forward` ``(q, k, v) -> (out, lse)`` and :func:`flash_backward`
``(dout, q, k, v, out, lse) -> (dq, dk, dv)`` on ``[B, H, M, D]`` tensors; callers
never branch on the device (:func:`kernel_for` says which kernel runs):

* CPU: ``aten::_scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``), any float
  dtype (fp64 included), optional additive mask.
* CUDA, fp16/bf16, head dim <= 256 and a multiple of 8: FlashAttention-2 through
  ``aten::_scaled_dot_product_flash_attention`` (+ ``_backward``; a backward whose lse-gradient
  columns take the head dim past 256 runs the memory-efficient kernel's).
* CUDA, fp16/bf16, head dim <= 120 and a multiple of 8, inside ``sdpa_priority("cudnn")``: cuDNN's
  fused attention, ``aten::_scaled_dot_product_cudnn_attention`` (+ ``_backward``); its lse has a
  trailing unit dimension, dropped here and restored for the backward.
* CUDA otherwise (fp32, other head dims): the memory-efficient kernel,
  ``aten::_scaled_dot_product_efficient_attention`` (+ ``_backward``), whose lse is
  padded to a multiple of 32 queries (sliced off here, padded back for the backward).
* ``fused=False``, other devices (meta), or a mask off the CPU: a plain
  matmul/softmax stand-in with the same contract (scores materialised). Tests use it
  to check the surrounding algorithm exactly as it runs on CUDA.

The backward takes ``out`` and ``lse`` as arguments rather than from a saved graph:
given the output and log-sum-exp of a softmax over a LARGER key set (several pieces
merged, as ring attention and dilated attention do), it returns this piece's share
of the exact gradient of the merged attention, because the kernels recompute the
probabilities as ``exp(s - lse)`` and use ``rowsum(dout * out)`` as the softmax
correction term.

A gradient ``g`` on the lse changes the score gradient to ``P * (dP - rowsum(dO * O) + g)``;
:func:`lse_grad_columns` folds it into the unchanged kernels by appending head
columns, ``[dO, 1, 0..]`` as output gradient and ``[O, -g, 0..]`` as output, zeros on
``q, k, v`` (scores unchanged): the kernels' ``rowsum(dO * O)`` becomes
``rowsum(dO * O) - g``. Eight columns keep the CUDA kernels' alignment.

:func:`attention_with_lse` is the differentiable single call on these primitives;
:func:`merge_attention` combines results over separate key sets by their lse.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

_aten = torch.ops.aten
_PAD = 8
#: The largest head dimension FlashAttention-2 takes (forward and backward); cuDNN's here is 128.
_FLASH_MAX_D = 256
#: The fused CUDA kernel :func:`kernel_for` prefers for fp16/bf16 ("flash" or "cudnn"); set by :func:`sdpa_priority`.
_preferred = ["flash"]


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def kernel_for(q: torch.Tensor, fused: bool = True, masked: bool = False) -> str:
    """Which kernel the primitives use for ``q``: cpu | flash | cudnn | efficient | math."""
    if not fused:
        return "math"
    if q.device.type == "cpu":
        return "cpu"
    if q.device.type == "cuda" and not masked:
        if q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= _FLASH_MAX_D and q.shape[-1] % 8 == 0:
            # + _PAD: the lse-gradient columns of lse_grad_columns must fit the same kernel
            return "cudnn" if _preferred[0] == "cudnn" and q.shape[-1] + _PAD <= 128 else "flash"
        return "efficient"
    return "math"


def flash_forward(q, k, v, causal: bool = False, scale: float | None = None, fused: bool = True,
                  mask: torch.Tensor | None = None, kind: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention ``(out [B, H, M, D] in q's dtype, lse [B, H, M] in fp32, fp64 for fp64 inputs)``.

    ``mask``: optional additive ``[M, N]`` (or broadcastable) float mask of 0 / -inf; every
    query must keep at least one key. Causal masking aligns the last query with the last key.
    ``kind``: the kernel (default :func:`kernel_for`); a caller that runs the backward later passes the
    same ``kind`` to :func:`flash_backward`, since the preference may have changed in between.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    kind = kind or kernel_for(q, fused, mask is not None)
    if kind == "cpu":
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=None if mask is None else mask.to(q.dtype), scale=scale)
    elif kind == "flash":
        # returns (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset,
        # debug_attn_mask); without dropout or varlen the backward needs only output and logsumexp.
        res = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        out, lse = res[0], res[1]
    elif kind == "cudnn":
        res = _aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
        out, lse = res[0], res[1].reshape(q.shape[:-1])  # [B, H, M, 1] -> [B, H, M]
    elif kind == "efficient":
        out, lse = _aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                  scale=scale)[:2]
        lse = lse[..., :q.shape[-2]]  # padded to a multiple of 32 queries
    else:
        out, lse = _math_forward(q, k, v, causal, scale, mask)
    return out, lse.to(torch.promote_types(lse.dtype, torch.float32))


def flash_backward(dout, q, k, v, out, lse, causal: bool = False, scale: float | None = None,
                   fused: bool = True, mask: torch.Tensor | None = None, kind: str | None = None):
    """``(dq, dk, dv)`` for output gradient ``dout``, given the (possibly merged) ``out`` and ``lse``."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    q, k, v, out, dout = (_unit_last(t) for t in (q, k, v, out, dout.to(out.dtype)))
    kind = kind or kernel_for(q, fused, mask is not None)
    if kind == "flash" and q.shape[-1] > _FLASH_MAX_D:
        # head dim 256 and lse_grad_columns' 8 columns: past FlashAttention-2's limit ("FlashAttention backward
        # only supports head dimension at most 256"); the memory-efficient kernel takes the same out and lse
        kind = "efficient"
    if kind == "cpu":
        lse_t = torch.float64 if q.dtype == torch.float64 else torch.float32
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.to(lse_t).contiguous(), 0.0, causal,
            attn_mask=None if mask is None else mask.to(q.dtype), scale=scale)
    if kind == "flash":
        m, n = q.shape[-2], k.shape[-2]
        no_rng = torch.empty(0, dtype=torch.int64, device=q.device)  # dropout 0: seed/offset unused
        # cum_seq_q / cum_seq_k undefined (None): the dense, not the varlen, kernel.
        return _aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.float().contiguous(), None, None, m, n, 0.0, causal, no_rng, no_rng,
            scale=scale)
    if kind == "cudnn":  # no dropout, bias or varlen: those arguments undefined
        m, n = q.shape[-2], k.shape[-2]
        return _aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse.float().unsqueeze(-1).contiguous(), None, None, None, None, None, m, n, 0.0,
            causal, scale=scale)
    if kind == "efficient":
        lse_p = F.pad(lse.float(), (0, (-lse.shape[-1]) % 32)).contiguous()
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, lse_p, seed, seed, 0.0, [True, True, True, False], causal, scale=scale)
        return dq, dk, dv
    return _math_backward(dout, q, k, v, out, lse, causal, scale, mask)


def lse_grad_columns(q, k, v, dout, out, dlse):
    """``(dout, q, k, v, out)`` (the order :func:`flash_backward` takes them) with ``_PAD`` head
    columns that make the backward honour ``dlse``; slice ``[..., :D]`` off the gradients it returns.
    """
    d = q.shape[-1]
    pad = lambda t: F.pad(t, (0, _PAD))  # noqa: E731
    dout_, out_ = pad(dout.to(out.dtype)), pad(out)
    dout_[..., d] = 1
    out_[..., d] = -dlse.to(out.dtype)
    return dout_, pad(q), pad(k), pad(v), out_


def _scores(q, k, causal: bool, scale: float, mask=None) -> torch.Tensor:
    acc = torch.promote_types(q.dtype, torch.float32)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if causal:
        m, n = q.shape[-2], k.shape[-2]
        keep = torch.ones(m, n, dtype=torch.bool, device=q.device).tril(n - m)
        s = s.masked_fill(~keep, float("-inf"))
    if mask is not None:
        s = s + mask.to(acc)
    return s


def _math_forward(q, k, v, causal: bool, scale: float, mask=None):
    s = _scores(q, k, causal, scale, mask)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.to(s.dtype))
    return out.to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, causal: bool, scale: float, mask=None):
    s = _scores(q, k, causal, scale, mask)
    p = torch.exp(s - lse.to(s.dtype).unsqueeze(-1))
    do = dout.to(s.dtype)
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, v.to(s.dtype).transpose(-1, -2))
    ds = p * (dp - (do * out.to(s.dtype)).sum(-1, keepdim=True)) * scale
    dq = torch.matmul(ds, k.to(s.dtype))
    dk = torch.matmul(ds.transpose(-1, -2), q.to(s.dtype))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    if q.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"attention expects q [B, H, M, D] and k, v [B, H, N, D], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal attention needs as many queries as keys, got {q.shape[2]} and {k.shape[2]}")


class _AttentionWithLse(torch.autograd.Function):
    """One fused call with an lse output whose gradient is honoured; saves q, k, v, out, lse."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, mask, fused: bool):
        kind = kernel_for(q, fused, mask is not None)
        out, lse = flash_forward(q, k, v, causal, scale, fused, mask, kind)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.causal, ctx.scale, ctx.fused, ctx.kind = causal, scale, fused, kind
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, mask = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        if dlse is None:
            dq, dk, dv = flash_backward(dout, q, k, v, out, lse, ctx.causal, ctx.scale, ctx.fused, mask, ctx.kind)
            return dq, dk, dv, None, None, None, None
        d = q.shape[-1]
        grads = flash_backward(*lse_grad_columns(q, k, v, dout, out, dlse), lse, ctx.causal,
                               ctx.scale, ctx.fused, mask, ctx.kind)
        return (*(g[..., :d] for g in grads), None, None, None, None)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                       scale: float | None = None, mask: torch.Tensor | None = None,
                       fused: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention returning ``(out [B, H, M, D], lse [B, H, M] fp32)``, differentiable in both.

    Args:
        q, k, v: ``[B, H, M, D]``, ``[B, H, N, D]``, ``[B, H, N, D]``.
        causal: query ``i`` sees keys ``0..i`` (needs ``M == N``).
        scale: score scale, default ``1 / sqrt(D)``.
        mask: optional additive float mask broadcastable to ``[B, H, M, N]`` (0 or -inf);
            every query must keep at least one key.
        fused: False puts the math stand-in in place of the device's kernel.
    """
    _check_shapes(q, k, v, causal)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if mask is not None:
        mask = mask.to(q.dtype)
    return _AttentionWithLse.apply(q, k, v, causal, scale, mask, fused)


def merge_attention(pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention results over separate key sets into one softmax over all of them.

    ``pieces`` holds ``(out_i [..., M, D], lse_i [..., M])``; an ``lse`` of ``-inf``
    marks a query a piece did not cover (its ``out`` is ignored). Weights
    ``exp(lse_i - lse)`` are computed in fp32 (or wider) and differentiated through; a
    query no piece covers gets 0 and ``lse = -inf``. Returns ``(out, lse)``.
    """
    if not pieces:
        raise ValueError("merge_attention needs at least one piece")
    if len(pieces) == 1:
        return pieces[0]
    dtype = pieces[0][0].dtype
    wide = torch.promote_types(torch.promote_types(dtype, pieces[0][1].dtype), torch.float32)
    lses = torch.stack([lse.to(wide) for _, lse in pieces])
    top = lses.detach().amax(dim=0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # a pure stabiliser
    weights = torch.exp(lses - top)
    total = weights.sum(dim=0)
    covered = total > 0
    safe_total = torch.where(covered, total, torch.ones_like(total))
    # where(): an uncovered query's out is ignored even when it holds NaN or Inf (0 x NaN is NaN)
    out = sum((w / safe_total).unsqueeze(-1) * torch.where((w > 0).unsqueeze(-1), o.to(wide), 0.0)
              for w, (o, _) in zip(weights, pieces))
    lse = torch.where(covered, top + torch.log(safe_total), torch.full_like(total, float("-inf")))
    return out.to(dtype), lse


def sdpa_priority(backend: str):
    """A context in which ``F.scaled_dot_product_attention`` and this module's primitives try ``backend``'s
    kernels first.

    ``auto``: PyTorch's own order (FlashAttention-2 first on CUDA), nothing changed. ``cudnn``: cuDNN's
    fused attention first, then PyTorch's order, so shapes, dtypes or devices cuDNN cannot serve (the
    CPU among them) run as before (``sdpa_kernel(..., set_priority=True)``). The backward runs the
    kernel the forward chose; under ``torch.compile`` the choice is made while tracing, inside this
    context. The primitives (dilated attention, ring attention) take cuDNN for fp16/bf16 inputs with
    head dim <= 120 (:func:`kernel_for`), chosen when the forward runs.
    """
    from dstrain.config import ATTENTION_BACKENDS
    if backend == "auto":
        return contextlib.nullcontext()
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {backend!r}")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
             SDPBackend.MATH]
    return _prefer("cudnn", sdpa_kernel(order, set_priority=True))


@contextlib.contextmanager
def _prefer(kernel: str, sdpa_context):
    before = _preferred[0]
    _preferred[0] = kernel
    try:
        with sdpa_context:
            yield
    finally:
        _preferred[0] = before
