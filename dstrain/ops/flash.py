"""Fused attention kernels that return their log-sum-exp, and their backward, behind one pair of functions.

:func:`flash_forward` ``(q, k, v) -> (out, lse)`` and :func:`flash_backward`
``(dout, q, k, v, out, lse) -> (dq, dk, dv)`` on ``[B, H, M, D]`` tensors; the caller
never branches on the device:

* CPU: ``aten::_scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``), any float dtype.
* CUDA, fp16/bf16, head dim <= 256: FlashAttention-2 through
  ``aten::_scaled_dot_product_flash_attention`` (+ ``_backward``).
* CUDA otherwise (fp32, larger heads): the memory-efficient kernel,
  ``aten::_scaled_dot_product_efficient_attention`` (+ ``_backward``), whose lse is
  padded to a multiple of 32 queries (sliced off here, padded back for the backward).
* ``fused=False`` anywhere: a plain matmul/softmax stand-in with the same contract
  (scores materialised; for tests of the surrounding algorithm on any device).

The backward takes ``out`` and ``lse`` as arguments rather than from a saved graph:
given the output and log-sum-exp of a softmax over a LARGER key set (several pieces
merged, as ring attention and dilated attention do), it returns this piece's share
of the exact gradient of the merged attention, because the kernels recompute the
probabilities as ``exp(s - lse)`` and use ``rowsum(dout * out)`` as the softmax
correction term. Inputs need a unit stride in the last dimension only.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

_aten = torch.ops.aten


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def kernel_for(q: torch.Tensor, fused: bool = True) -> str:
    """Which kernel :func:`flash_forward` uses for ``q``: cpu | flash | efficient | math."""
    if not fused:
        return "math"
    if q.device.type == "cpu":
        return "cpu"
    if q.device.type == "cuda":
        if q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0:
            return "flash"
        return "efficient"
    return "math"


def flash_forward(q, k, v, causal: bool = False, scale: float | None = None,
                  fused: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention ``(out [B, H, M, D] in q's dtype, lse [B, H, M] in fp32 or wider)``."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    kind = kernel_for(q, fused)
    if kind == "cpu":
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    elif kind == "flash":
        res = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        out, lse = res[0], res[1]
    elif kind == "efficient":
        out, lse = _aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
        lse = lse[..., :q.shape[-2]]
    else:
        out, lse = _math_forward(q, k, v, causal, scale)
    wide = torch.promote_types(lse.dtype, torch.float32)
    return out, lse.to(wide)


def flash_backward(dout, q, k, v, out, lse, causal: bool = False, scale: float | None = None,
                   fused: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``q, k, v`` for output gradient ``dout``, given the (possibly merged) ``out`` and ``lse``."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    q, k, v, out, dout = (_unit_last(t) for t in (q, k, v, out, dout.to(out.dtype)))
    kind = kernel_for(q, fused)
    if kind == "cpu":
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.to(_cpu_lse_dtype(q)).contiguous(), 0.0, causal, scale=scale)
    if kind == "flash":
        m, n = q.shape[-2], k.shape[-2]
        empty = torch.empty(0, dtype=torch.int64, device=q.device)
        return _aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.float().contiguous(), None, None, m, n, 0.0, causal, empty, empty,
            scale=scale)
    if kind == "efficient":
        pad = (-lse.shape[-1]) % 32
        lse_p = F.pad(lse.float(), (0, pad)).contiguous()
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, lse_p, seed, seed, 0.0, [True, True, True, False], causal, scale=scale)
        return dq, dk, dv
    return _math_backward(dout, q, k, v, out, lse, causal, scale)


def _cpu_lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    acc = torch.promote_types(q.dtype, torch.float32)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if causal:
        m, n = q.shape[-2], k.shape[-2]
        keep = torch.ones(m, n, dtype=torch.bool, device=q.device).tril(n - m)
        s = s.masked_fill(~keep, float("-inf"))
    return s


def _math_forward(q, k, v, causal: bool, scale: float):
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.to(s.dtype))
    return out.to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    s = _scores(q, k, causal, scale)
    p = torch.exp(s - lse.to(s.dtype).unsqueeze(-1))
    do = dout.to(s.dtype)
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, v.to(s.dtype).transpose(-1, -2))
    ds = p * (dp - (do * out.to(s.dtype)).sum(-1, keepdim=True)) * scale
    dq = torch.matmul(ds, k.to(s.dtype))
    dk = torch.matmul(ds.transpose(-1, -2), q.to(s.dtype))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
