"""Brute-force dilated attention (LongNet semantics) with explicit N x N masks, in float64.

Written independently of ``dstrain.ops``: no gathering, folding or kernels. For
every head and branch it builds the full boolean mask of which key each query may
see, takes a masked softmax, and merges the branches by their softmax
denominators directly (``sum_b Z_b o_b / sum_b Z_b``, with ``Z_b`` the sum of the
exponentiated scores; a query no branch covers gets 0).
"""
from __future__ import annotations

import functools
import math

import torch


@functools.lru_cache(maxsize=None)
def branch_mask(n: int, w: int, r: int, offset: int, causal: bool,
                sparse_block: int = 0, sparse_keep: float = 1.0) -> torch.Tensor:
    """``[n, n]`` bool: may query i see key j in branch (w, r) for a head with this offset?"""
    w = min(w, n)
    mask = torch.zeros(n, n, dtype=torch.bool)
    m = w // r
    sparse = sparse_keep < 1.0 and sparse_block > 0 and m > sparse_block
    nb = m // sparse_block if sparse else 1
    n_keep = max(1, math.ceil(sparse_keep * nb)) if sparse else nb
    for i in range(n):
        for j in range(n):
            if i // w != j // w:
                continue
            if (i % w) % r != offset or (j % w) % r != offset:
                continue
            if causal and j > i:
                continue
            if sparse:
                qb, kb = ((i % w) // r) // sparse_block, ((j % w) // r) // sparse_block
                candidates = [c for c in range(nb) if (c <= qb or not causal)]
                candidates.sort(key=lambda c: (abs(qb - c), c))
                if kb not in candidates[:n_keep]:
                    continue
            mask[i, j] = True
    return mask


def reference_dilated(q, k, v, segment_lengths, dilation_rates, causal=True, head_offset=0,
                      sparse_block=0, sparse_keep=1.0, return_lse=False):
    """``[B, H, N, D]`` inputs -> output ``[B, H, N, D]`` in float64.

    ``return_lse``: also the log of the merged softmax denominator ``[B, H, N]``
    (``log sum_b Z_b``; ``-inf`` where no branch covers a query).
    """
    q, k, v = q.double(), k.double(), v.double()
    b, h, n, d = q.shape
    scale = 1.0 / math.sqrt(d)
    out = torch.zeros(b, h, n, d, dtype=torch.float64)
    lse = torch.full((b, h, n), float("-inf"), dtype=torch.float64)
    for head in range(h):
        num = torch.zeros(b, n, d, dtype=torch.float64)
        den = torch.zeros(b, n, dtype=torch.float64)
        scores = q[:, head] @ k[:, head].transpose(-1, -2) * scale        # [B, N, N]
        shift = scores.amax(dim=-1, keepdim=True).detach()                # any common shift per query
        for w, r in zip(segment_lengths, dilation_rates):
            allowed = branch_mask(n, w, r, (head + head_offset) % r, causal, sparse_block, sparse_keep)
            e = torch.exp(scores - shift) * allowed                       # unnormalised weights
            num = num + e @ v[:, head]
            den = den + e.sum(-1)
        out[:, head] = torch.where(den.unsqueeze(-1) > 0, num / den.clamp_min(1e-300).unsqueeze(-1), 0.0)
        lse[:, head] = torch.where(den > 0, torch.log(den.clamp_min(1e-300)) + shift.squeeze(-1), float("-inf"))
    return (out, lse) if return_lse else out
