"""Multi-branch dilated attention as one autograd function: fused kernels, one output, exact backward.

Forward: for each branch ``(w, r)`` and each group of segments, the branch's dilated
queries, keys and values are selected (a view for ``r == 1``, a copy of ``1/r`` of the
data otherwise), one fused kernel (:func:`dstrain.ops.attention.flash_forward`) returns
their output and log-sum-exp, and these are merged in place into the single output
``out [B, H, N, D]`` and running ``lse [B, H, N]`` at the positions the branch covers:
``lse' = logaddexp(lse, lse_b)`` and ``out' = lerp(out, out_b, e^(lse_b - lse'))``
(one in-place pass over the covered positions). A branch with ``r == 1`` goes first
and is stored, not merged. No branch writes a full-size buffer, and no score matrix
is formed.

Backward (exact, as ring attention does it): for each branch the kernel's backward is
called with the branch's slice of the MERGED output and lse; it recomputes the
probabilities as ``exp(s - lse_merged)`` (this branch's share of the merged softmax)
and uses ``rowsum(dout * out_merged)``, which is the merged softmax's correction term,
so summing the branches' ``dq, dk, dv`` at their positions gives the gradient of the
merged attention. Saved for backward: ``q, k, v, out, lse``, whatever the number of
branches and whichever kernel runs (so a trace on any device sees what CUDA saves).
Work is done in groups of segments of bounded size, so temporaries stay small next
to the full-size tensors however long the sequence is. Where one group holds every segment
of every batch row (up to about 86k tokens at 12 heads of 64), the ``r == 1`` branch runs as
one kernel call on a view of the whole tensors, and the kernels' output and input gradients,
laid out as their inputs, become the full output and gradients without a copy
(:func:`_whole_rows`, :func:`_as_full`).

With ``grad_lse`` (callers that merge this result with others, e.g. sequence
parallelism), the score gradient becomes ``P * (dP - rowsum(dO * O) + g)``; the
group's tensors get the extra head columns of
:func:`dstrain.ops.attention.lse_grad_columns` that make the unchanged kernels compute it.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from dstrain.ops import attention
from dstrain.ops.attention import flash_backward, flash_forward, lse_grad_columns

#: Elements of one gathered q (or k, v) group: about 128 MB of bf16 per tensor.
GROUP_ELEMENTS = 1 << 26


class _Selection:
    """The positions one branch ``(w, r)`` covers in segments ``[a, e)`` of batch row ``bi`` of a
    ``[B, H, N, C]`` tensor (C = head dim, or 1 for lse).

    For ``r == 1`` and for the diagonal layout (heads ``a * r + c`` use offset ``c``) the
    positions are one strided view made by a single ``as_strided`` from the tensor's own
    strides: no reshape/diagonal/permute chain, whose per-op dispatch cost dominated a
    call at GPU speed. Other layouts (heads not aligned with the rate) index heads and offsets.
    """

    def __init__(self, h: int, w: int, r: int, head_offset: int):
        self.h, self.w, self.r = h, w, r
        self.diagonal = r > 1 and h % r == 0 and head_offset % r == 0
        self.head_offset = head_offset

    def _heads_offs(self, device):  # the indexed layout's head and offset indices
        heads = torch.arange(self.h, device=device)
        return heads, (heads + self.head_offset) % self.r

    def _strided(self, x, bi: int, a: int, e: int):
        """``[s, H, m, C]`` (``r == 1``) or ``[s, m, H/r, r, C]`` (diagonal): a view of ``x``."""
        sb, sh, sn, sc = x.stride()
        s, w, r = e - a, self.w, self.r
        base = x.storage_offset() + bi * sb + a * w * sn
        if r == 1:
            return x.as_strided((s, self.h, w, x.shape[-1]), (w * sn, sh, sn, sc), base)
        # element [i, j, A, c, :] is head A * r + c at position (a + i) * w + j * r + c
        return x.as_strided((s, w // r, self.h // r, r, x.shape[-1]), (w * sn, r * sn, r * sh, sh + sn, sc), base)

    def _six(self, x):  # [1, H, s*w, C] -> [1, H, s, m, r, C]
        s = x.shape[2] // self.w
        return x.reshape(1, self.h, s, self.w // self.r, self.r, x.shape[-1])

    def _indexed(self, x6):  # [1, H, s, m, r, C] -> [s, m, H, r, C] (a view, to index heads and offsets)
        return x6[0].permute(1, 2, 0, 3, 4)

    def read(self, x, bi: int, a: int, e: int):
        """``[s, H, m, C]``: a view when ``r == 1``; else a copy laid out ``[s, m, H, C]`` in memory
        (sequence-major, what the flash kernels take without further copies)."""
        if self.r == 1:
            return self._strided(x, bi, a, e)
        if self.diagonal:
            v = self._strided(x, bi, a, e)
            return v.reshape(v.shape[0], v.shape[1], self.h, v.shape[-1]).transpose(1, 2)
        heads, offs = self._heads_offs(x.device)
        return self._indexed(self._six(_slice(x, bi, a, e, self.w)))[:, :, heads, offs].transpose(1, 2)

    def update(self, x, bi: int, a: int, e: int, y, op: str = "copy", weight=None):
        """In place at the covered positions of ``x``: store (copy), add, or ``lerp`` towards
        ``y [s, H, m, C]`` with ``weight [s, H, m]`` (``x += weight * (y - x)``)."""
        indexed = self.r > 1 and not self.diagonal
        if self.r == 1:
            dst, fit = self._strided(x, bi, a, e), (lambda t: t)
        elif self.diagonal:  # [s, m, H/r, r, C] view; map [s, H, m, C] onto it
            dst = self._strided(x, bi, a, e)
            fit = lambda t: t.unflatten(1, (self.h // self.r, self.r)).permute(0, 3, 1, 2, 4)  # noqa: E731
        else:  # heads not aligned with the rate: read-modify-write through indexing ([s, m, H, C])
            x6 = self._six(_slice(x, bi, a, e, self.w))
            heads, offs = self._heads_offs(x.device)
            dst, fit = self._indexed(x6)[:, :, heads, offs], (lambda t: t.transpose(1, 2))
        if op == "copy":
            dst.copy_(fit(y))
        elif op == "add":
            dst.add_(fit(y).to(dst.dtype))
        else:
            dst.lerp_(fit(y).to(dst.dtype), fit(weight.unsqueeze(-1)).to(dst.dtype))
        if indexed:
            self._indexed(x6)[:, :, heads, offs] = dst


def _groups(n: int, w: int, h: int, d: int):
    """Segment ranges ``[a, b)`` (in segments of ``w``) whose gathered tensors stay near GROUP_ELEMENTS."""
    s = n // w
    per = max(1, GROUP_ELEMENTS // max(1, h * w * d))
    return [(a, min(a + per, s)) for a in range(0, s, per)]


def _whole_rows(x, w: int):
    """``[B, H, N, C]`` -> a ``[B * N/w, H, w, C]`` view of every segment of every row (no copy), or None
    where the rows are not evenly spaced in memory (``stride(0) != N * stride(2)`` with ``B > 1``)."""
    b, h, n, c = x.shape
    sb, sh, sn, sc = x.stride()
    if b > 1 and sb != n * sn:
        return None
    return x.as_strided((b * (n // w), h, w, c), (w * sn, sh, sn, sc), x.storage_offset())


def _as_full(t, b: int, n: int):
    """The inverse of :func:`_whole_rows` for a kernel's own ``[B * N/w, H, w, C]`` result: the same memory
    seen as ``[B, H, N, C]``, when its segments follow each other as the positions do (else None: copy it)."""
    bs, h, w, c = t.shape
    st0, st1, st2, st3 = t.stride()
    if w == 1:
        st2 = st0
    if bs > 1 and st0 != w * st2:
        return None
    return t.as_strided((b, h, n, c), (n * st2, st1, st2, st3), t.storage_offset())


def _one_group(b: int, n: int, w: int, h: int, d: int) -> bool:
    """Whether :func:`_groups` would take every segment of every row (``B * N`` positions) as one group."""
    return len(_groups(b * n, w, h, d)) == 1


def _slice(x, b: int, a: int, e: int, w: int):
    return x[b:b + 1, :, a * w:e * w]


def _order(branches) -> tuple:
    """Branches with ``r == 1`` first (stable): the first then covers every position, so the
    buffers start uninitialised and that branch is stored rather than merged."""
    return tuple(sorted(branches, key=lambda br: br[1] != 1))


def _full_or_copy(t, like, w: int):
    """``t`` (a kernel's ``[B * N/w, H, w, C]`` result) as ``[B, H, N, C]``: the same memory where its
    layout allows, else copied into a tensor laid out as ``like``."""
    b, n = like.shape[0], like.shape[2]
    full = _as_full(t, b, n)
    if full is None:
        full = torch.empty_like(like)
        _whole_rows(full, w).copy_(t)
    return full


def _whole_first_forward(q, k, v, branches, causal, scale, fused, kind):
    """``(out, lse [B, H, N, 1])`` of the first (``r == 1``) branch as one kernel call over every segment of
    every row, or None where that is not one group or the rows are not evenly spaced in memory."""
    b, h, n, d = q.shape
    w = branches[0][0]
    views = [_whole_rows(t, w) for t in (q, k, v)]
    if not _one_group(b, n, w, h, d) or any(x is None for x in views):
        return None
    o_b, l_b = flash_forward(*views, causal, scale, fused, kind=kind)
    lse = torch.empty((b, h, n, 1), dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
    lse[..., 0].view(b, h, n // w, w).copy_(l_b.unflatten(0, (b, n // w)).transpose(1, 2))
    return _full_or_copy(o_b, q, w), lse


def _whole_first_backward(dout, q, k, v, out, lse, branches, causal, scale, fused, kind):
    """``(dq, dk, dv)`` of the first (``r == 1``) branch as one kernel call (see :func:`_whole_first_forward`),
    or None."""
    b, h, n, d = q.shape
    w = branches[0][0]
    views = [_whole_rows(t, w) for t in (dout, q, k, v, out)]
    if not _one_group(b, n, w, h, d) or any(x is None for x in views):
        return None
    lse_b = lse.reshape(b, h, n // w, w).transpose(1, 2).reshape(b * (n // w), h, w)
    grads = flash_backward(*views, lse_b, causal, scale, fused, kind=kind)
    return [_full_or_copy(g, t, w) for g, t in zip(grads, (q, k, v))]


class DilatedAttention(torch.autograd.Function):
    """``(q, k, v [B, H, N, D]) -> (out [B, H, N, D], lse [B, H, N])`` over all branches at once."""

    @staticmethod
    def forward(ctx, q, k, v, branches: tuple, causal: bool, head_offset: int, scale: float, fused: bool):
        b, h, n, d = q.shape
        branches = _order(branches)
        full = branches[0][1] == 1
        lse_dtype = torch.promote_types(q.dtype, torch.float32)
        kind = attention.kernel_for(q, fused)  # one kernel for every branch, forward and backward
        first = _whole_first_forward(q, k, v, branches, causal, scale, fused, kind) if full else None
        if first is not None:  # the r == 1 branch done as one call; the others merge into its result
            out, lse, start = *first, 1
        elif full:
            out = torch.empty_like(q)  # q's layout: [B, N, H, D] memory from a model's projections
            lse = torch.empty((b, h, n, 1), dtype=lse_dtype, device=q.device)
            start = 0
        else:  # uncovered positions keep out = 0, lse = -inf
            out = torch.zeros_like(q)
            lse = torch.full((b, h, n, 1), float("-inf"), dtype=lse_dtype, device=q.device)
            start = 0
        for i, (w, r) in enumerate(branches[start:], start):
            sel = _Selection(h, w, r, head_offset)
            for bi in range(b):
                for a, e in _groups(n, w, h, d):
                    qs, ks, vs = (sel.read(t, bi, a, e) for t in (q, k, v))
                    o_b, l_b = flash_forward(qs, ks, vs, causal, scale, fused, kind=kind)
                    if i == 0:
                        sel.update(out, bi, a, e, o_b)
                        sel.update(lse, bi, a, e, l_b.unsqueeze(-1))
                        continue
                    old_l = sel.read(lse, bi, a, e)[..., 0]
                    new_l = torch.logaddexp(old_l, l_b.to(lse_dtype))
                    sel.update(out, bi, a, e, o_b, "lerp", torch.exp(l_b - new_l))
                    sel.update(lse, bi, a, e, new_l.unsqueeze(-1))
        lse = lse.squeeze(-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.set_materialize_grads(False)
        ctx.branches, ctx.causal, ctx.head_offset, ctx.scale, ctx.fused = branches, causal, head_offset, scale, fused
        ctx.kind = kind
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        b, h, n, d = q.shape
        if dout is None:
            dout = torch.zeros_like(out)
        dout = dout.to(q.dtype)
        full = ctx.branches[0][1] == 1
        first = None
        if full and dlse is None:
            first = _whole_first_backward(dout, q, k, v, out, lse, ctx.branches, ctx.causal, ctx.scale, ctx.fused,
                                          ctx.kind)
        if first is not None:
            (dq, dk, dv), start = first, 1
        else:
            dq, dk, dv = ((torch.empty_like if full else torch.zeros_like)(t) for t in (q, k, v))
            start = 0
        lse4 = lse.unsqueeze(-1)
        dlse4 = None if dlse is None else dlse.unsqueeze(-1)  # None unless the caller used lse
        for i, (w, r) in enumerate(ctx.branches[start:], start):
            sel = _Selection(h, w, r, ctx.head_offset)
            for bi in range(b):
                for a, e in _groups(n, w, h, d):
                    cut = lambda t: sel.read(t, bi, a, e)  # noqa: E731
                    args = (cut(dout), cut(q), cut(k), cut(v), cut(out))
                    if dlse4 is not None:  # extra head columns carry the lse gradient
                        args = lse_grad_columns(*args[1:4], args[0], args[4], cut(dlse4)[..., 0])
                    grads = flash_backward(*args, cut(lse4)[..., 0], ctx.causal, ctx.scale, ctx.fused, kind=ctx.kind)
                    for g_full, g in zip((dq, dk, dv), grads):
                        sel.update(g_full, bi, a, e, g[..., :d], "copy" if i == 0 else "add")
        return dq, dk, dv, None, None, None, None, None


@torch.compiler.disable  # a graph break under torch.compile: the loops and aten kernels run eagerly
def fused_dilated_attention(q, k, v, branches: Sequence[tuple[int, int]], causal: bool = True,
                            head_offset: int = 0, scale: float | None = None, fused: bool = True):
    """``(out, lse)`` of multi-branch dilated attention; ``branches`` are effective ``(w, r)`` pairs."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return DilatedAttention.apply(q, k, v, tuple(branches), causal, head_offset, float(scale), fused)
