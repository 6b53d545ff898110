"""Multi-branch dilated attention as one autograd function: fused kernels, one output, exact backward.

Forward: for each branch ``(w, r)`` and each group of segments, the branch's dilated
queries, keys and values are selected (a view for ``r == 1``, a copy of ``1/r`` of the
data otherwise), one fused kernel (:func:`dstrain.ops.flash.flash_forward`) returns
their output and log-sum-exp, and these are merged in place into the single output
``out [B, H, N, D]`` and running ``lse [B, H, N]`` at the positions the branch covers
(``lse' = logaddexp(lse, lse_b)``, ``out' = out e^(lse - lse') + out_b e^(lse_b - lse')``).
No branch writes a full-size buffer, and no score matrix is formed.

Backward (exact, as ring attention does it): for each branch the kernel's backward is
called with the branch's slice of the MERGED output and lse; it recomputes the
probabilities as ``exp(s - lse_merged)`` (this branch's share of the merged softmax)
and uses ``rowsum(dout * out_merged)``, which is the merged softmax's correction term,
so summing the branches' ``dq, dk, dv`` at their positions gives the gradient of the
merged attention. Saved for backward: ``q, k, v, out, lse``, whatever the number of
branches. Work is done in groups of segments of bounded size, so temporaries stay
small next to the full-size tensors however long the sequence is.

With ``grad_lse`` (callers that merge this result with others, e.g. sequence
parallelism), the score gradient becomes ``P * (dP - rowsum(dO * O) + g)``. Head
columns are appended for that (8, for the kernels' alignment): ``[dO, 1, 0..]`` as output gradient and ``[O, -g, 0..]`` as
output, zeros on ``q, k, v`` (scores unchanged), which turns the kernels'
``rowsum(dO * O)`` into ``rowsum(dO * O) - g``.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from dstrain.ops.flash import flash_backward, flash_forward

#: Elements of one gathered q (or k, v) group: about 32 MB of bf16 per tensor.
GROUP_ELEMENTS = 1 << 24
_PAD = 8


class _Selection:
    """The positions one branch covers in a ``[1, H, s*w, C]`` slice (C = head dim, or 1 for lse)."""

    def __init__(self, h: int, w: int, r: int, head_offset: int):
        self.h, self.w, self.r = h, w, r
        self.diagonal = r > 1 and h % r == 0 and head_offset % r == 0
        self.heads = torch.arange(h)
        self.offs = (self.heads + head_offset) % r

    def _six(self, x):  # [1, H, s*w, C] -> [1, H, s, m, r, C]
        s = x.shape[2] // self.w
        return x.reshape(1, self.h, s, self.w // self.r, self.r, x.shape[-1])

    def _diag(self, x6):  # [1, H, s, m, r, C] -> [1, H/r, s, m, C, r] (a view)
        _, h, s, m, r, c = x6.shape
        return torch.diagonal(x6.reshape(1, h // r, r, s, m, r, c), dim1=2, dim2=5)

    def read(self, x):
        """``[s, H, m, C]``: a view when ``r == 1``, else a copy."""
        x6 = self._six(x)
        s, m, c = x6.shape[2], x6.shape[3], x6.shape[-1]
        if self.r == 1:
            return x6[0, :, :, :, 0].transpose(0, 1)
        if self.diagonal:
            return self._diag(x6)[0].permute(1, 0, 4, 2, 3).reshape(s, self.h, m, c)
        heads, offs = self.heads.to(x.device), self.offs.to(x.device)
        return x6[0, heads, :, :, offs].transpose(0, 1)  # [H, s, m, C] -> [s, H, m, C]

    def write(self, x, y, add: bool = False):
        """Store (or add) ``y [s, H, m, C]`` at the covered positions of ``x`` (in place)."""
        x6 = self._six(x)
        s, m, c = x6.shape[2], x6.shape[3], x6.shape[-1]
        if self.r == 1:
            dst = x6[0, :, :, :, 0].transpose(0, 1)
        elif self.diagonal:
            dst = self._diag(x6)[0]
            y = y.reshape(s, self.h // self.r, self.r, m, c).permute(1, 0, 3, 4, 2)
        else:
            heads, offs = self.heads.to(x.device), self.offs.to(x.device)
            val = y.transpose(0, 1)
            if add:
                val = x6[0, heads, :, :, offs] + val
            x6[0, heads, :, :, offs] = val.to(x.dtype)
            return
        if add:
            dst.add_(y.to(dst.dtype))
        else:
            dst.copy_(y)


def _groups(n: int, w: int, h: int, d: int):
    """Segment ranges ``[a, b)`` (in segments of ``w``) whose gathered tensors stay near GROUP_ELEMENTS."""
    s = n // w
    per = max(1, GROUP_ELEMENTS // max(1, h * w * d))
    return [(a, min(a + per, s)) for a in range(0, s, per)]


def _slice(x, b: int, a: int, e: int, w: int):
    return x[b:b + 1, :, a * w:e * w]


class DilatedAttention(torch.autograd.Function):
    """``(q, k, v [B, H, N, D]) -> (out [B, H, N, D], lse [B, H, N])`` over all branches at once."""

    @staticmethod
    def forward(ctx, q, k, v, branches: tuple, causal: bool, head_offset: int, scale: float, fused: bool):
        b, h, n, d = q.shape
        out = torch.zeros_like(q)
        lse = torch.full((b, h, n, 1), float("-inf"), dtype=torch.promote_types(q.dtype, torch.float32),
                         device=q.device)
        for w, r in branches:
            sel = _Selection(h, w, r, head_offset)
            for bi in range(b):
                for a, e in _groups(n, w, h, d):
                    qs, ks, vs = (sel.read(_slice(t, bi, a, e, w)) for t in (q, k, v))
                    o_b, l_b = flash_forward(qs, ks, vs, causal, scale, fused)
                    o_c, l_c = _slice(out, bi, a, e, w), _slice(lse, bi, a, e, w)
                    old_o, old_l = sel.read(o_c), sel.read(l_c)[..., 0]
                    new_l = torch.logaddexp(old_l, l_b.to(old_l.dtype))
                    merged = (old_o.to(new_l.dtype) * torch.exp(old_l - new_l).unsqueeze(-1)
                              + o_b.to(new_l.dtype) * torch.exp(l_b - new_l).unsqueeze(-1))
                    sel.write(o_c, merged.to(q.dtype))
                    sel.write(l_c, new_l.unsqueeze(-1))
        lse = lse.squeeze(-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.set_materialize_grads(False)
        ctx.branches, ctx.causal, ctx.head_offset, ctx.scale, ctx.fused = branches, causal, head_offset, scale, fused
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        b, h, n, d = q.shape
        if dout is None:
            dout = torch.zeros_like(out)
        extra = dlse is not None  # None unless the caller used lse (grads are not materialised)
        if extra:  # extra head columns carry the lse gradient (see module docstring)
            pad = lambda t: F.pad(t, (0, _PAD))  # noqa: E731  (8 keeps the kernels' alignment)
            q_, k_, v_ = pad(q), pad(k), pad(v)
            dout_, out_ = pad(dout.to(q.dtype)), pad(out)
            dout_[..., d] = 1
            out_[..., d] = -dlse.to(q.dtype)
        else:
            q_, k_, v_, dout_, out_ = q, k, v, dout.to(q.dtype), out
        dq, dk, dv = (torch.zeros_like(t) for t in (q_, k_, v_))
        lse4 = lse.unsqueeze(-1)
        for w, r in ctx.branches:
            sel = _Selection(h, w, r, ctx.head_offset)
            for bi in range(b):
                for a, e in _groups(n, w, h, d):
                    cut = lambda t: sel.read(_slice(t, bi, a, e, w))  # noqa: E731
                    grads = flash_backward(cut(dout_), cut(q_), cut(k_), cut(v_), cut(out_), cut(lse4)[..., 0],
                                           ctx.causal, ctx.scale, ctx.fused)
                    for full, g in zip((dq, dk, dv), grads):
                        sel.write(_slice(full, bi, a, e, w), g, add=True)
        if extra:
            dq, dk, dv = dq[..., :d], dk[..., :d], dv[..., :d]
        return dq, dk, dv, None, None, None, None, None


@torch.compiler.disable  # a graph break under torch.compile: the loops and aten kernels run eagerly
def fused_dilated_attention(q, k, v, branches: Sequence[tuple[int, int]], causal: bool = True,
                            head_offset: int = 0, scale: float | None = None, fused: bool = True):
    """``(out, lse)`` of multi-branch dilated attention; ``branches`` are effective ``(w, r)`` pairs."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return DilatedAttention.apply(q, k, v, tuple(branches), causal, head_offset, float(scale), fused)
