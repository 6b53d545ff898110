"""Sequence-parallel dilated attention: each of ``sp`` ranks holds ``T = N / sp`` consecutive tokens.

Two exact ways to compute a layer, both differentiable end to end:

* ``exchange`` (LongNet's distributed algorithm). A branch whose segment fits in the
  local chunk (``w <= T``) is computed locally with no communication at all. A
  larger segment spans ``g = w / T`` consecutive ranks; each rank takes the dilated
  keys and values of its chunk (``T / r`` positions per head, offsets from the
  global head index), all-gathers them within its segment group only, and
  attends with its own dilated queries: its own chunk causally plus the earlier
  chunks of the segment in full (causal), or the whole segment (non-causal). The
  pieces and the branches are merged by log-sum-exp. Traffic per layer per rank:
  ``sum over remote branches of 2 (g - 1) T d / r`` (forward).
* ``ulysses`` (DeepSpeed-Ulysses). An all-to-all turns ``[B, T, H, D]`` sequence
  shards into ``[B, N, H / sp, D]`` head shards, every rank runs the single-device
  kernel on the whole sequence for its heads, and a second all-to-all returns.
  Traffic: about ``4 (sp - 1) / sp T d`` (q, k, v and the output). Needs ``H % sp == 0``.

``auto`` takes the feasible mode with less traffic (exchange on a tie: it needs no
head divisibility and sends nothing when every segment is local).

Collectives use ``all_to_all_single`` and ``all_gather``; the backward of the
all-gather all-reduces and slices (gloo has no reduce-scatter) or reduce-scatters on NCCL.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from dstrain.ops.attention import attention_with_lse, merge_attention
from dstrain.ops.dilated import Branch, dilated_attention, gather_dilated, scatter_dilated, tiles
from dstrain.runtime import group_timeout

MODES = ("auto", "exchange", "ulysses")


# ---------------------------------------------------------------- differentiable collectives

def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """``x [sp, ...]`` -> ``[sp, ...]`` where slot i came from rank i of ``group``."""
    x = x.contiguous()
    out = torch.empty_like(x)  # after contiguous(): empty_like keeps a permuted input's strides
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, group, sp: int) -> torch.Tensor:
    b, t, h, d = x.shape
    chunks = x.reshape(b, t, sp, h // sp, d).permute(2, 0, 1, 3, 4)      # [sp(head chunk), B, T, h, D]
    got = _all_to_all(chunks, group)                                      # [sp(seq chunk), B, T, h, D]
    return got.permute(1, 0, 2, 3, 4).reshape(b, sp * t, h // sp, d)


def _heads_to_seq(y: torch.Tensor, group, sp: int) -> torch.Tensor:
    b, n, h, d = y.shape
    t = n // sp
    chunks = y.reshape(b, sp, t, h, d).permute(1, 0, 2, 3, 4)            # [sp(seq chunk), B, T, h, D]
    got = _all_to_all(chunks, group)                                      # [sp(head chunk), B, T, h, D]
    return got.permute(1, 2, 0, 3, 4).reshape(b, t, sp * h, d)


class SeqToHeads(torch.autograd.Function):
    """``[B, T, H, D]`` sequence shard -> ``[B, N, H / sp, D]`` head shard (and back in backward)."""

    @staticmethod
    def forward(ctx, x, group, sp):
        ctx.group, ctx.sp = group, sp
        return _seq_to_heads(x, group, sp)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group, ctx.sp), None, None


class HeadsToSeq(torch.autograd.Function):
    """Inverse of :class:`SeqToHeads`."""

    @staticmethod
    def forward(ctx, y, group, sp):
        ctx.group, ctx.sp = group, sp
        return _heads_to_seq(y, group, sp)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group, ctx.sp), None, None


class GatherFromGroup(torch.autograd.Function):
    """All-gather along a new leading dim; backward sums every rank's gradient for our slot."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        ctx.index = dist.get_rank(group)
        size = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == "nccl":
            out = torch.empty_like(grad[0])
            dist.reduce_scatter_tensor(out, grad, group=ctx.group)
            return out, None
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.index].clone(), None


# ---------------------------------------------------------------- planning

def exchange_plan(branches: Sequence[Branch], n: int, sp: int) -> tuple[bool, float, str]:
    """``(feasible, traffic in units of T*d, why not)`` of the exchange mode for sequence length n."""
    t = n // sp
    if not tiles(n, branches):
        return False, 0.0, f"the segments do not tile a sequence of {n} tokens (ulysses pads it at the end)"
    traffic = 0.0
    for br in branches:
        w, r = br.effective(n)
        if w <= t:
            if t % w:
                return False, 0.0, f"segment {w} does not tile the local chunk of {t}"
            continue
        if w % t or t % r:
            return False, 0.0, f"segment {w} / dilation {r} do not align with local chunks of {t}"
        traffic += 2 * (w // t - 1) / r
    return True, traffic, ""


def choose_mode(mode: str, branches, n: int, sp: int, heads: int, sparse: bool) -> str:
    """Resolve ``auto`` (and check an explicit choice) for one layer call."""
    if mode not in MODES:
        raise ValueError(f"sequence-parallel mode must be one of {', '.join(MODES)}, got {mode!r}")
    ok_x, traffic_x, why_x = exchange_plan(branches, n, sp)
    remote = ok_x and any(br.effective(n)[0] > n // sp for br in branches)
    if ok_x and sparse and remote:
        ok_x, why_x = False, "the block-sparse variant is not implemented across ranks"
    ok_u = heads % sp == 0
    why_u = f"{heads} local heads are not divisible by sp = {sp}"
    if mode == "exchange" and not ok_x:
        raise ValueError(f"sequence-parallel mode exchange impossible: {why_x}")
    if mode == "ulysses" and not ok_u:
        raise ValueError(f"sequence-parallel mode ulysses impossible: {why_u}")
    if mode != "auto":
        return mode
    if not ok_x and not ok_u:
        raise ValueError(f"no sequence-parallel mode fits: exchange: {why_x}; ulysses: {why_u}")
    if ok_x and (not ok_u or traffic_x <= 4 * (sp - 1) / sp):
        return "exchange"
    return "ulysses"


# ---------------------------------------------------------------- the layer

class SequenceParallelDilatedCore(nn.Module):
    """Drop-in for a single-device dilated core: q, k, v ``[B, T, H_local, D]`` are this rank's chunk.

    Args:
        branches, causal, sparse_block, sparse_keep: as the single-device core.
        head_offset: global index of the first local head (tensor parallelism shifts it).
        group: the sequence-parallel process group; ``sp_groups``: every sp group's
            global ranks (to build the segment groups of the exchange mode, collectively).
        mode: auto | exchange | ulysses.
        segment_groups: a dict shared by the model's cores, so that the exchange mode's segment
            groups are built once per model rather than once per layer (under NCCL each is a
            communicator with its own buffers).
    """

    def __init__(self, branches, causal: bool, group, sp_groups: list[list[int]], mode: str = "auto",
                 head_offset: int = 0, sparse_block: int = 0, sparse_keep: float = 1.0,
                 segment_groups: dict | None = None):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"sequence-parallel mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.branches, self.causal, self.group, self.mode = tuple(branches), causal, group, mode
        self.sp_groups, self.head_offset = sp_groups, head_offset
        self.sparse_block, self.sparse_keep = sparse_block, sparse_keep
        self.sp, self.sp_rank = dist.get_world_size(group), dist.get_rank(group)
        self.last_mode: str | None = None
        self._segment_groups: dict[int, object] = {} if segment_groups is None else segment_groups

    def _segment_group(self, g: int):
        """The group of the ``g`` consecutive sp ranks sharing our segment (built once, by every rank)."""
        if g == self.sp:
            return self.group
        if g not in self._segment_groups:
            me = dist.get_rank()
            mine = None
            for ranks in self.sp_groups:
                for i in range(0, len(ranks), g):
                    grp = dist.new_group(ranks[i:i + g], timeout=group_timeout())
                    if me in ranks[i:i + g]:
                        mine = grp
            self._segment_groups[g] = mine
        return self._segment_groups[g]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, t, h, d = q.shape
        n = t * self.sp
        mode = choose_mode(self.mode, self.branches, n, self.sp, h, self.sparse_keep < 1.0)
        self.last_mode = mode
        if mode == "ulysses":
            if not self.causal or self.sparse_keep < 1.0:  # neither pads a sequence the segments do not tile:
                for br in self.branches:  # refused here, before the first all-to-all (every rank alike)
                    br.effective(n)
            qh, kh, vh = (SeqToHeads.apply(x, self.group, self.sp) for x in (q, k, v))
            qh, kh, vh = (x.transpose(1, 2) for x in (qh, kh, vh))
            out = dilated_attention(qh, kh, vh, self.branches, self.causal,
                                    self.head_offset + self.sp_rank * (h // self.sp),
                                    self.sparse_block, self.sparse_keep)
            return HeadsToSeq.apply(out.transpose(1, 2), self.group, self.sp)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, T, D]
        sizes = [br.effective(n) for br in self.branches]
        local = [Branch(w, r) for w, r in sizes if w <= t]
        remote = [(w, r) for w, r in sizes if w > t]
        pieces = []
        if local:  # every local branch in one fused call (one output, one lse, no per-branch buffers)
            out, lse = dilated_attention(q, k, v, local, self.causal, self.head_offset, self.sparse_block,
                                         self.sparse_keep, return_lse=True)
            if not remote:
                return out.transpose(1, 2)
            pieces.append((out, lse))
        pieces += [self._remote_branch(q, k, v, w, r) for w, r in remote]
        out, _ = merge_attention(pieces)
        return out.transpose(1, 2)

    def _remote_branch(self, q, k, v, w: int, r: int):
        """A branch whose segment spans ``w / T`` ranks: exchange the dilated keys and values."""
        t = q.shape[2]
        g = w // t
        group = self._segment_group(g)
        index = self.sp_rank % g
        qd, kd, vd = (gather_dilated(x, t, r, self.head_offset) for x in (q, k, v))  # [B, H, T/r, D]
        ks, vs = GatherFromGroup.apply(kd, group), GatherFromGroup.apply(vd, group)   # [g, B, H, T/r, D]
        if self.causal:
            # Own keys taken from the gathered copy, so every rank's backward reaches the
            # collective (rank 0 of a segment would otherwise skip it and the others hang).
            parts = [attention_with_lse(qd, ks[index], vs[index], causal=True)]
            if index > 0:
                k_prev = torch.cat(list(ks[:index]), dim=2)
                v_prev = torch.cat(list(vs[:index]), dim=2)
                parts.append(attention_with_lse(qd, k_prev, v_prev, causal=False))
            o, lse = merge_attention(parts)
        else:
            o, lse = attention_with_lse(qd, torch.cat(list(ks), dim=2), torch.cat(list(vs), dim=2))
        out = scatter_dilated(o, t, t, r, self.head_offset, 0.0)
        lse = scatter_dilated(lse.unsqueeze(-1), t, t, r, self.head_offset, float("-inf")).squeeze(-1)
        return out, lse
